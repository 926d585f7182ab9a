"""structlog set-up, done once per process.

JSON lines when stderr is not a TTY (production, containers, CI), a readable console
renderer when a person is watching. Services bind request id / node / epoch per RPC with
`structlog.contextvars`, so every line of one request carries them.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure_logging(level: str | None = None, *, json: bool | None = None) -> None:
    """Configure structlog and the stdlib root logger; later calls are no-ops."""
    global _configured
    if _configured:
        return
    _configured = True
    level_name = (level or os.environ.get("PAGEDKV_LOG_LEVEL", "INFO")).upper()
    log_level = getattr(logging, level_name, logging.INFO)
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(log_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=log_level, stream=sys.stderr, format="%(message)s")


def get_logger(name: str | None = None, **initial: object) -> structlog.stdlib.BoundLogger:
    configure_logging()
    return structlog.get_logger(name, **initial)
