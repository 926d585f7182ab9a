"""What every pagedkv command does the same way when something goes wrong.

One error style for `pagedkv-serve`, `compute-node`, `block-manager` and the demo:
`prog: error: <what> (<hint>)` on stderr, one line, exit 2 for a usage problem (a flag, a
model directory) and 1 for a runtime failure (a port in use, a service unreachable). Checks
that are cheap run before anything slow (a busy port is found before the weights load), and a
reader that closes the pipe early (`| head`) ends the command quietly, not with a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, NoReturn

EXIT_RUNTIME = 1
EXIT_USAGE = 2


def error_line(prog: str, what: str, hint: str | None = None) -> str:
    """`prog: error: what (hint)`, kept to one line."""
    text = f"{prog}: error: {what.splitlines()[0] if what else 'failed'}"
    return text + (f" ({hint})" if hint else "")


def fail(prog: str, code: int, what: str, hint: str | None = None) -> int:
    """Print the error line on stderr; `code` back, for `return fail(...)`."""
    print(error_line(prog, what, hint), file=sys.stderr)
    return code


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are the one line too (`prog: error: ... (see prog --help)`),
    exit 2, instead of a usage block followed by the message; its subcommands' parsers are of
    this class too. A flag must be spelled out: argparse's default takes any unique prefix, so
    `block-manager serve --port 50051` was `--port-file 50051` (a file named 50051, the service
    on its default port)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, error_line(self.prog, message, f"see {self.prog} --help") + "\n")


def summary(doc: str | None) -> str:
    """A module docstring's first paragraph as a `--help` description: one sentence, so a
    colon that led into an example there ends it instead."""
    first = " ".join((doc or "").strip().split("\n\n", 1)[0].split())
    return first[:-1] + "." if first.endswith(":") else first


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi] (what the flag's protobuf field holds: out of
    range, the request could not even be built)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {value}")
        return value

    return parse


def seconds(text: str) -> float:
    """An argparse type: a duration in seconds, finite and > 0 (a deadline gRPC or urllib takes)."""
    return _seconds(text, zero_ok=False)


def seconds_or_zero(text: str) -> float:
    """An argparse type: a duration in seconds, finite and >= 0 (a grace period: 0 is none)."""
    return _seconds(text, zero_ok=True)


def _seconds(text: str, *, zero_ok: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and (value > 0 or zero_ok and value == 0)):
        raise argparse.ArgumentTypeError(f"must be a number of seconds {'>=' if zero_ok else '>'} 0, got {text}")
    return value


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (a free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is beyond 0-65535")
    return port


def split_host_port(address: str) -> tuple[str, int]:
    """`("::1", 50051)` from `[::1]:50051`, `("127.0.0.1", 0)` from `127.0.0.1:0`; `ValueError`
    for a missing or non-numeric port or one beyond 0-65535."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"port {port} in {address!r} is beyond 0-65535")
    return host.strip("[]") or "0.0.0.0", port


def port_problem(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on (in use, not an address of this machine), or None.
    Port 0 always works. The probe socket is closed at once: a service binds for real later, so
    this is a quick early answer, not a reservation."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r}: {exc.strerror or exc}"
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "address already in use"
            return exc.strerror or str(exc)
    return None


class Interrupted(KeyboardInterrupt):
    """Ctrl-C as our own handler raises it. A subclass, because CPython marks a plain
    KeyboardInterrupt that passes through `exec()` of a string (dataclasses builds its methods
    that way, so any import in progress) as unhandled, and then ends the process by SIGINT at
    exit even after `main` caught it and returned 130. `except KeyboardInterrupt` still
    catches this one, and the interpreter's exact-type check does not."""


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted


def catch_ctrl_c() -> None:
    """Make Ctrl-C raise `Interrupted` (call first thing in a command's `main`)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _raise_interrupted)


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Hold Ctrl-C back for the duration (and deliver it right after): for steps that must not
    be cut in two, e.g. starting a child process and recording it so it gets stopped again.
    An interrupt inside `subprocess.Popen` (between fork and exec) would lose the child's pid
    and leave it running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            signal.raise_signal(signal.SIGINT)


def quiet_broken_pipe() -> None:
    """After stdout's reader went away (`cmd | head`): point stdout at /dev/null so the
    interpreter's final flush does not raise again (Python's documented recipe)."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


__all__ = [
    "ArgumentParser", "EXIT_RUNTIME", "EXIT_USAGE", "Interrupted", "catch_ctrl_c", "ctrl_c_deferred", "error_line",
    "fail", "port_number", "port_problem", "quiet_broken_pipe", "split_host_port",
]
