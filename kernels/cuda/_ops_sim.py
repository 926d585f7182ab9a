"""The building blocks of `_ops_gpu.py`, emulated for Numba's CUDA simulator.

The simulator runs every GPU thread as a Python thread and knows nothing of inline PTX, so
each GPU intrinsic has a Python twin here with the documented semantics:

- addresses are `SimPtr` (a flat byte view of a host array plus an offset) instead of int64;
  loads and stores check bounds and alignment, so an out-of-range or misaligned access that
  would fault or mis-read on the GPU raises here;
- warp-collective operations (shuffles, `ldmatrix`, `mma.sync`) exchange values through a
  per-warp all-gather: every lane posts its operand, a barrier of the warp's 32 threads, every
  lane reads all 32. The kernels call them warp-uniformly, as on the GPU. What the warp
  computes from the 32 operands (the matrices of `ldmatrix` and `mma.sync`) is computed once,
  by the last lane to arrive, and each lane takes its own part of it;
- `mma.sync` rebuilds the A/B/C matrices from the 32 lanes' fragments with the PTX ISA's
  fragment layouts (groupID = lane >> 2, threadID_in_group = lane % 4) and multiplies in
  float64 before rounding the accumulators to float32;
- fp16/bf16 packing rounds to nearest even, exactly as `cvt.rn`;
- `cp.async` copies land only at the issuing thread's `wait_group` that covers their commit
  group; until then their destination reads back poison (NaN), so a missing or misplaced wait
  fails a reference check instead of passing silently.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, cast

import numpy as np

WARP = 32
_BARRIER_TIMEOUT_S = 120.0  # a lane that died (exception) must not hang its warp forever
_registry_lock = threading.Lock()


class SimPtr:
    """A byte address inside one host array: `SimPtr + int` moves it, loads/stores check it."""

    __slots__ = ("buf", "offset")

    def __init__(self, buf: np.ndarray, offset: int = 0) -> None:
        self.buf = buf  # flat uint8 view
        self.offset = int(offset)

    def __add__(self, delta: Any) -> SimPtr:
        return SimPtr(self.buf, self.offset + int(delta))

    def view(self, nbytes: int, align: int) -> np.ndarray:
        if self.offset % align:
            raise RuntimeError(f"misaligned {nbytes}-byte access at byte offset {self.offset}")
        if self.offset < 0 or self.offset + nbytes > self.buf.size:
            raise IndexError(f"{nbytes}-byte access at byte offset {self.offset} outside "
                             f"a {self.buf.size}-byte buffer")
        return self.buf[self.offset:self.offset + nbytes]


class SimPtrTable:
    """A device table of addresses under the simulator: `ld_s64(table + 8 * i)` gives back the
    i-th `SimPtr` (a host int64 array cannot hold them)."""

    __slots__ = ("entries", "offset")

    def __init__(self, entries: list[SimPtr], offset: int = 0) -> None:
        self.entries = entries
        self.offset = offset

    def __add__(self, delta: Any) -> SimPtrTable:
        return SimPtrTable(self.entries, self.offset + int(delta))


def sim_ptr(array: np.ndarray) -> SimPtr:
    """The address of a C-contiguous host array's first byte."""
    return SimPtr(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


# --------------------------------------------------------------------------------------------
# Loads and stores
# --------------------------------------------------------------------------------------------

def _words(ptr: SimPtr, n: int) -> Any:
    words = ptr.view(4 * n, 4 * n).view(np.uint32)
    return tuple(int(w) for w in words) if n > 1 else int(words[0])


def ld_v4(ptr: SimPtr) -> Any:
    return _words(ptr, 4)


def ld_v2(ptr: SimPtr) -> Any:
    return _words(ptr, 2)


def ld_u32(ptr: SimPtr) -> Any:
    return _words(ptr, 1)


def ld_s32(ptr: SimPtr) -> Any:
    return np.int32(ptr.view(4, 4).view(np.int32)[0])


def ld_s64(ptr: Any) -> Any:
    if isinstance(ptr, SimPtrTable):
        return ptr.entries[ptr.offset // 8]
    return np.int64(ptr.view(8, 8).view(np.int64)[0])


def ld_f32(ptr: SimPtr) -> Any:
    return np.float32(ptr.view(4, 4).view(np.float32)[0])


def ld_f32x4(ptr: SimPtr) -> Any:
    return tuple(np.float32(x) for x in ptr.view(16, 16).view(np.float32))


def _put(ptr: SimPtr, values: Any, dtype: Any) -> None:
    data = np.array(values, dtype=np.int64).astype(dtype) if dtype == np.uint32 else \
        np.array(values, dtype=dtype)
    ptr.view(data.nbytes, data.nbytes)[:] = data.view(np.uint8)


def st_v4(ptr: SimPtr, a: Any, b: Any, c: Any, d: Any) -> None:
    _put(ptr, [int(a), int(b), int(c), int(d)], np.uint32)


def st_v2(ptr: SimPtr, a: Any, b: Any) -> None:
    _put(ptr, [int(a), int(b)], np.uint32)


def st_u32(ptr: SimPtr, a: Any) -> None:
    _put(ptr, [int(a)], np.uint32)


def st_f32(ptr: SimPtr, a: Any) -> None:
    _put(ptr, [a], np.float32)


def st_f32x4(ptr: SimPtr, a: Any, b: Any, c: Any, d: Any) -> None:
    _put(ptr, [a, b, c, d], np.float32)


# --------------------------------------------------------------------------------------------
# Warp exchange
# --------------------------------------------------------------------------------------------

class _WarpBarrier:
    """A barrier of a warp's 32 lanes: the last to arrive releases the others.

    Each lane waits on a gate of its own (a lock held while closed, released by the last
    lane to arrive), not on a shared condition variable: woken lanes then need nothing but the
    GIL, instead of queueing again for the condition's lock (31 more hand-offs per collective;
    the simulator folder took 44 and 35 CPU-s with gates vs 47 and 52 with the condition,
    alternating). A lane already in the next collective waits on its gate again, which the last
    arrival of this one has opened exactly once for it."""

    __slots__ = ("lock", "arrived", "gates")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arrived = 0
        self.gates = [threading.Lock() for _ in range(WARP)]
        for gate in self.gates:
            gate.acquire()

    def wait(self, lane: int, on_complete: Callable[[], None] | None = None) -> None:
        """Wait for all 32 lanes; the last to arrive runs `on_complete` before releasing them."""
        with self.lock:
            self.arrived += 1
            last = self.arrived == WARP
            if last:
                self.arrived = 0
                if on_complete is not None:
                    on_complete()
        if last:
            for other, gate in enumerate(self.gates):
                if other != lane:
                    gate.release()
        elif not self.gates[lane].acquire(timeout=_BARRIER_TIMEOUT_S):
            raise threading.BrokenBarrierError(f"a warp collective waited {_BARRIER_TIMEOUT_S:.0f} s "
                                               "for its other lanes (one died or diverged)")


class _WarpState:
    """Two sets of slots (and of results), used by turns: a lane posts into one set, passes the
    barrier, reads all 32; a lane that runs ahead posts its next value into the other set, and
    can come back to this one only after the next barrier, which every lane reaches after
    reading. So one barrier per collective suffices."""

    def __init__(self) -> None:
        self.barrier = _WarpBarrier()
        self.slots: tuple[list[Any], list[Any]] = ([None] * WARP, [None] * WARP)
        self.results: list[Any] = [None, None]


class _SimThread(Protocol):
    """One simulated GPU thread, as `threading.current_thread()` returns it inside a simulated
    kernel: Numba's `BlockThread` (a `threading.Thread`), or the tests' greenlet runner's
    stand-in (`tests/kernels/cuda_sim/coop_runner.py`). `thread_id` is the thread's linear
    index in its block and `_manager` the block's manager (the simulator's); the `_pagedkv_*`
    attributes are this module's per-thread state, set on first use."""

    thread_id: int
    _manager: Any
    _pagedkv_warp: _WarpState
    _pagedkv_gather_turn: int
    _pagedkv_cp_async: _AsyncCopies


def _sim_thread() -> _SimThread:
    # typeshed's current_thread() is a plain Thread: the simulator's carries the fields above
    return cast(_SimThread, threading.current_thread())


def _all_gather(value: Any) -> list[Any]:
    """Every lane's `value`, in lane order (a collective: all 32 lanes must call it)."""
    return list(_warp_combine(value, None))


def _warp_combine(value: Any, combine: Callable[[list[Any]], Any] | None) -> Any:
    """`combine` of every lane's `value` (in lane order), computed once for the warp (a
    collective); without `combine`, the lanes' values themselves. Why once: a lane's `mma.sync`
    or `ldmatrix` result is a slice of one warp-wide matrix; built by each of the 32 lanes, it
    cost the simulator 32 times the work."""
    thread = _sim_thread()
    lane = thread.thread_id % WARP
    state = thread.__dict__.get("_pagedkv_warp")
    if state is None:                    # the lane's first collective: find its warp's state
        manager = thread._manager  # the simulator's per-thread-block manager
        with _registry_lock:
            warps = manager.__dict__.setdefault("_pagedkv_warps", {})
            state = warps.get(thread.thread_id // WARP)
            if state is None:
                state = warps[thread.thread_id // WARP] = _WarpState()
        thread._pagedkv_warp = state
    turn = thread.__dict__.get("_pagedkv_gather_turn", 0)  # the lanes' turns agree: collectives are warp-uniform
    thread._pagedkv_gather_turn = turn ^ 1
    slots = state.slots[turn]
    slots[lane] = value
    if combine is None:
        state.barrier.wait(lane)
        return slots

    def finish() -> None:
        try:
            state.results[turn] = combine(slots)
        except Exception as error:   # noqa: BLE001 (every lane raises it, as each would have)
            state.results[turn] = _Failed(error)

    state.barrier.wait(lane, finish)
    result = state.results[turn]
    if isinstance(result, _Failed):
        raise result.error
    return result


class _Failed:
    """A warp-wide result that raised (say, an out-of-bounds `ldmatrix` row): every lane
    raises it, instead of the other 31 waiting at the next barrier for the one that died."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lane() -> int:
    return _sim_thread().thread_id % WARP


def shfl_xor(value: Any, lane_mask: Any) -> Any:
    return _all_gather(value)[_lane() ^ int(lane_mask)]


def shfl_idx(value: Any, src_lane: Any) -> Any:
    return _all_gather(value)[int(src_lane) % WARP]


# --------------------------------------------------------------------------------------------
# Shared memory
# --------------------------------------------------------------------------------------------

def smem_addr(array: np.ndarray) -> SimPtr:
    return sim_ptr(array)


# cp.async: like the GPU, a copy is not visible in shared memory until the issuing thread
# waits for its group. Each simulated thread keeps its own copies: issued ones join the open
# group (and their destination reads back POISON: 0xFF bytes, NaN as fp16 / bf16 / float32),
# `commit` closes the group, and `wait_group n` lands every committed group but the n newest.
# So a kernel that reads a tile before the wait that covers it, or that overwrites a tile
# another lane still reads, sees NaN and fails its reference check.
POISON = 0xFF


class _AsyncCopies:
    """One simulated thread's copies in flight (PTX: per-thread commit groups)."""

    __slots__ = ("open", "committed")

    def __init__(self) -> None:
        self.open: list[tuple[np.ndarray, np.ndarray]] = []  # (destination view, bytes)
        self.committed: list[list[tuple[np.ndarray, np.ndarray]]] = []

    def issue(self, view: np.ndarray, data: np.ndarray) -> None:
        view[:] = POISON
        self.open.append((view, data))

    def commit(self) -> None:
        self.committed.append(self.open)
        self.open = []

    def wait(self, newest_pending: int) -> None:
        while len(self.committed) > newest_pending:
            for view, data in self.committed.pop(0):
                view[:] = data


def _async_copies() -> _AsyncCopies:
    thread = _sim_thread()
    copies = getattr(thread, "_pagedkv_cp_async", None)
    if copies is None:
        copies = thread._pagedkv_cp_async = _AsyncCopies()
    return copies


def pending_copies() -> int:
    """Copies this simulated thread issued that have not landed (tests: none may outlive a
    kernel)."""
    copies = _async_copies()
    return len(copies.open) + sum(len(group) for group in copies.committed)


def _copy(dst: SimPtr, src: SimPtr, nbytes: int) -> None:
    # The source is read at issue (the cache is invariant while a kernel runs).
    _async_copies().issue(dst.view(nbytes, nbytes), src.view(nbytes, nbytes).copy())


def cp_async16(dst: SimPtr, src: SimPtr) -> None:
    _copy(dst, src, 16)


def cp_async8(dst: SimPtr, src: SimPtr) -> None:
    _copy(dst, src, 8)


def cp_async4(dst: SimPtr, src: SimPtr) -> None:
    _copy(dst, src, 4)


def _copy_fill(dst: SimPtr, src: SimPtr, nbytes: int, src_bytes: Any) -> None:
    view = dst.view(nbytes, nbytes)
    # Zero-fill is part of the asynchronous copy: a row past the range is not read.
    data = src.view(nbytes, nbytes).copy() if int(src_bytes) else np.zeros(nbytes, np.uint8)
    _async_copies().issue(view, data)


def cp_async16_fill(dst: SimPtr, src: SimPtr, src_bytes: Any) -> None:
    _copy_fill(dst, src, 16, src_bytes)


def cp_async8_fill(dst: SimPtr, src: SimPtr, src_bytes: Any) -> None:
    _copy_fill(dst, src, 8, src_bytes)


def cp_async4_fill(dst: SimPtr, src: SimPtr, src_bytes: Any) -> None:
    _copy_fill(dst, src, 4, src_bytes)


def cp_async_commit() -> None:
    _async_copies().commit()


def cp_async_wait1() -> None:
    _async_copies().wait(1)


def cp_async_wait0() -> None:
    _async_copies().wait(0)


def syncwarp() -> None:
    _all_gather(None)


def any_sync(predicate: Any) -> bool:
    return any(bool(p) for p in _all_gather(predicate))


def lds_v4(addr: SimPtr) -> Any:
    return _words(addr, 4)


def lds_v2(addr: SimPtr) -> Any:
    return _words(addr, 2)


def lds_u32(addr: SimPtr) -> Any:
    return _words(addr, 1)


def _matrix_rows(addrs: list[SimPtr]) -> np.ndarray:
    return np.stack([a.view(16, 16).view(np.uint16) for a in addrs])    # [32 rows, 8 halves]


def _ldmatrix(addr: SimPtr, trans: bool) -> tuple[int, ...]:
    rows = _warp_combine(addr, _matrix_rows)
    g, t = divmod(_lane(), 4)
    out = []
    for i in range(4):
        if trans:  # rows 2t, 2t+1 of column g
            lo, hi = rows[8 * i + 2 * t][g], rows[8 * i + 2 * t + 1][g]
        else:  # row g, columns 2t, 2t+1
            lo, hi = rows[8 * i + g][2 * t], rows[8 * i + g][2 * t + 1]
        out.append(int(lo) | (int(hi) << 16))
    return tuple(out)


def ldmatrix_x4(addr: SimPtr) -> tuple[int, ...]:
    return _ldmatrix(addr, False)


def ldmatrix_x4_trans(addr: SimPtr) -> tuple[int, ...]:
    return _ldmatrix(addr, True)


# --------------------------------------------------------------------------------------------
# Tensor cores
# --------------------------------------------------------------------------------------------

def _halves(word: int, kind: str) -> tuple[float, float]:
    bits = np.array([word & 0xFFFF, (word >> 16) & 0xFFFF], dtype=np.uint16)
    if kind == "f16":
        lo, hi = bits.view(np.float16).astype(np.float64)
    else:
        lo, hi = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return float(lo), float(hi)


def _halves_array(words: np.ndarray, kind: str) -> np.ndarray:
    """`_halves` of every word at once: int64 [...] (32-bit words) -> float64 [..., 2], low half first."""
    bits = np.stack([words & 0xFFFF, (words >> 16) & 0xFFFF], axis=-1).astype(np.uint16)
    if kind == "f16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# Where each lane's fragment halves sit in the m16n8k16 matrices (lane = 4 g + t):
# A (row-major 16 x 16): register r holds row g + 8 (r % 2), columns 2t + 8 (r // 2) + (0, 1);
# B (column-major 16 x 8): register r holds rows 2t + 8 r + (0, 1), column g;
# C (16 x 8): c_i sits at row g + 8 (i // 2), column 2t + i % 2.
_G, _T = np.divmod(np.arange(WARP), 4)
_A_ROWS = (_G[:, None, None] + 8 * (np.arange(4) % 2)[None, :, None]).repeat(2, axis=2)
_A_COLS = 2 * _T[:, None, None] + 8 * (np.arange(4) // 2)[None, :, None] + np.arange(2)[None, None, :]
_B_ROWS = 2 * _T[:, None, None] + 8 * np.arange(2)[None, :, None] + np.arange(2)[None, None, :]
_B_COLS = np.broadcast_to(_G[:, None, None], _B_ROWS.shape)
_C_ROWS = _G[:, None] + 8 * (np.arange(4) // 2)[None, :]
_C_COLS = 2 * _T[:, None] + (np.arange(4) % 2)[None, :]


def _mma(kind: str, k: int, a: tuple[int, ...], b: tuple[int, ...], c: tuple[Any, ...]) -> Any:
    d = _warp_combine((a, b, c), lambda lanes: _mma_product(kind, k, lanes))
    g, t = divmod(_lane(), 4)
    return tuple(d[g + 8 * (i // 2), 2 * t + i % 2] for i in range(4))


def _mma_product(kind: str, k: int, lanes: list[Any]) -> np.ndarray:
    """D = A B + C of the warp's m16n8k(k) tile, from the 32 lanes' fragments."""
    mat_a = np.zeros((16, k))
    mat_b = np.zeros((k, 8))
    mat_c = np.zeros((16, 8))
    mat_a[_A_ROWS, _A_COLS] = _halves_array(np.array([la for la, _, _ in lanes], np.int64), kind)
    mat_b[_B_ROWS, _B_COLS] = _halves_array(np.array([lb for _, lb, _ in lanes], np.int64), kind)
    mat_c[_C_ROWS, _C_COLS] = np.array([[float(v) for v in lc] for _, _, lc in lanes])
    return (mat_a @ mat_b + mat_c).astype(np.float32)


def mma16816_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma("f16", 16, (int(a0), int(a1), int(a2), int(a3)), (int(b0), int(b1)), (c0, c1, c2, c3))


def mma16816_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma("bf16", 16, (int(a0), int(a1), int(a2), int(a3)), (int(b0), int(b1)), (c0, c1, c2, c3))


# --------------------------------------------------------------------------------------------
# Register-level conversions
# --------------------------------------------------------------------------------------------

def movmatrix(word: Any) -> int:
    words = _all_gather(int(word))
    g, t = divmod(_lane(), 4)

    def element(row: int, col: int) -> int:
        return (words[4 * row + col // 2] >> (16 * (col % 2))) & 0xFFFF

    return element(2 * t, g) | (element(2 * t + 1, g) << 16)


def pack_lo(a: Any, b: Any) -> int:
    return (int(a) & 0xFFFF) | ((int(b) & 0xFFFF) << 16)


def pack_hi(a: Any, b: Any) -> int:
    return ((int(a) >> 16) & 0xFFFF) | (int(b) & 0xFFFF0000)


def _f16_bits(x: Any) -> int:
    return int(np.array([x], dtype=np.float32).astype(np.float16).view(np.uint16)[0])


def _bf16_bits(x: Any) -> int:
    bits = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x7FFFFF:
        return ((bits >> 16) | 0x40) & 0xFFFF  # quiet NaN
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def f32x2_to_f16x2(lo: Any, hi: Any) -> int:
    return _f16_bits(lo) | (_f16_bits(hi) << 16)


def f32x2_to_bf16x2(lo: Any, hi: Any) -> int:
    return _bf16_bits(lo) | (_bf16_bits(hi) << 16)


def f16x2_to_f32(word: Any) -> tuple[Any, Any]:
    lo, hi = _halves(int(word), "f16")
    return np.float32(lo), np.float32(hi)


def bf16x2_to_f32(word: Any) -> tuple[Any, Any]:
    lo, hi = _halves(int(word), "bf16")
    return np.float32(lo), np.float32(hi)


def ex2(x: Any) -> Any:
    with np.errstate(over="ignore"):
        return np.float32(np.exp2(np.float32(x)))


def bits_f32(word: Any) -> Any:
    return np.array([int(word) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]
