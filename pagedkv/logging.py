"""structlog set-up: the renderer once per process, the level whenever a service says so.

JSON lines when stderr is not a TTY (production, containers, CI), a readable console
renderer when a person is watching. Services bind request id / node / epoch per RPC with
`structlog.contextvars`, so every line of one request carries them.

Why the level is a processor and not structlog's filtering logger class: every module calls
`get_logger` at import, which sets structlog up with the environment's level long before a
service has read its config file; loggers cache their class on first use, so a level baked
into that class could never change again (the config's `log_level` was silently ignored).
The first processor drops events below the current threshold instead, and
`configure_logging(level)` moves the threshold at any time, for every logger.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_METHOD_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "msg": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}

_configured = False
_threshold = logging.INFO


def level_number(name: str) -> int:
    """`logging.INFO` for "info" / "INFO"; `ValueError` for anything not in `LEVELS`."""
    upper = name.strip().upper()
    if upper == "WARN":
        upper = "WARNING"
    if upper not in LEVELS:
        raise ValueError(f"unknown log level {name!r} (expected one of {', '.join(LEVELS)})")
    return int(getattr(logging, upper))


def _drop_below_threshold(logger: Any, method_name: str, event_dict: Any) -> Any:
    if _METHOD_LEVELS.get(method_name, logging.INFO) < _threshold:
        raise structlog.DropEvent
    return event_dict


def configure_logging(level: str | None = None, *, json: bool | None = None) -> None:
    """Set up structlog and the stdlib root logger (first call), and set the level.

    `level` (a name from `LEVELS`) takes effect at once for every logger, including those
    already used; without one, the first call uses `PAGEDKV_LOG_LEVEL` (default INFO) and later
    calls change nothing. `json` picks the renderer on the first call only.
    """
    global _configured, _threshold
    if level is None and _configured:
        return
    try:
        _threshold = level_number(level or os.environ.get("PAGEDKV_LOG_LEVEL") or "INFO")
    except ValueError:
        if level is not None:
            raise
        _threshold = logging.INFO  # a bad environment value must not stop an import
    if _configured:
        logging.getLogger().setLevel(_threshold)
        return
    _configured = True
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            _drop_below_threshold,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=_threshold, stream=sys.stderr, format="%(message)s")


def get_logger(name: str | None = None, **initial: object) -> structlog.stdlib.BoundLogger:
    configure_logging()
    return structlog.get_logger(name, **initial)
