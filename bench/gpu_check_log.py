"""The GPU check's progress line on stdout (flushed: the device tool returns the tail)."""

from __future__ import annotations

import time


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)
