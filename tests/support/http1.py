"""A port that answers every connection the way an HTTP/1.1 server (uvicorn: the OpenAI
server) answers a gRPC client, for the tests of what the gRPC tools say when pointed at it."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def http1_port() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        threading.Thread(target=_answer, args=(listener,), daemon=True).start()
        yield listener.getsockname()[1]


def _answer(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:              # the listener closed: the test is over
            return
        with conn:
            conn.recv(1024)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
