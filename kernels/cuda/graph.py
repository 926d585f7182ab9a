"""Decode attention replayed from CUDA graphs, one per (layer, batch-size bucket).

A decode step launches attention once per layer for a batch whose size changes from step to
step. `DecodeGraphs` rounds the batch up to a bucket (1, 2, 4, …, 256 by default), keeps static
input/output buffers per bucket, and captures CUDA graphs per (layer, bucket) around a
`DecodePlan` launch, one per kernel (one-pass, split-K): a step then costs one copy of the
block tables and lengths (and of the split-K work list) into the bucket's buffers, and per
layer one copy of the queries and one graph replay — no Python launch path, no allocation.
Rows past the batch get length 0 (their output is zeros) and are never returned.

Which kernel a step replays, and how its sequences are partitioned, is decided once per step
in `prepare` from the lengths when they are on the host (or passed as `host_seq_lens`): a
ragged batch gets a common chunk size, so its long sequences get more partitions
(`decode_policy`). The bucket's split-K grid and buffers are sized for its worst case
(`DecodePlan`), so any step's partitioning replays in the same graph. With device-only
lengths the bucket's design point applies (every row taken at the table capacity).

    graphs = DecodeGraphs(key_caches, value_caches, num_heads=32, max_blocks_per_seq=256,
                          scale=128 ** -0.5)
    graphs.capture()                      # optional: capture every graph up front
    graphs.prepare(block_tables, seq_lens)            # once per step (host or device arrays)
    # or, lengths on the device and their host copy for the partitioning:
    graphs.prepare(block_tables, seq_lens_dev, host_seq_lens=seq_lens_host)
    out = graphs.run(layer, query)                    # per layer: [num_seqs, heads, head_dim]

`run` returns a view of the bucket's static output buffer: the next `run` of any layer in that
bucket overwrites it (stream-ordered, so torch work queued in between reads the right values),
so copy it (or pass `out=`) to keep it longer. Under Numba's simulator (no CUDA graphs) the
same object launches the plan directly at each replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kernels._validate import KernelInputError, is_torch, to_host_numpy
from kernels.cuda._runtime import SIMULATOR
from kernels.cuda.plan import DecodePlan

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _EagerGraph:
    """Stands in for a CUDA graph where none exists (simulator): replay calls the launch."""

    def __init__(self, launch: Callable[[], Any]) -> None:
        self._launch = launch

    def replay(self) -> None:
        self._launch()


def capture_graph(launch: Callable[[], Any], pool: Any) -> Any:
    """A torch CUDA graph of `launch` (run once uncaptured first: compiles, loads modules),
    drawing its memory from `pool` (`new_graph_pool()`, shared by graphs never replayed at
    once); under the simulator an `_EagerGraph` whose replay runs `launch`. Also used for
    whole decode steps (`compute_node/step_graph.py`)."""
    if SIMULATOR:
        return _EagerGraph(launch)
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        launch()
    return graph


def new_graph_pool() -> Any:
    """A memory pool for graphs that replay one at a time (None under the simulator)."""
    if SIMULATOR:
        return None
    import torch

    return torch.cuda.graph_pool_handle()


class _Bucket:
    """Static buffers and plan of one batch size."""

    def __init__(self, like: Any, batch: int, num_heads: int, max_blocks: int, q_dtype: Any,
                 out_dtype: Any) -> None:
        import torch

        head_dim = int(like.shape[3])
        dev = like.device
        self.batch = batch
        self.query = torch.zeros((batch, num_heads, head_dim), dtype=q_dtype, device=dev)
        self.out = torch.zeros((batch, num_heads, head_dim), dtype=out_dtype, device=dev)
        self.tables = torch.zeros((batch, max_blocks), dtype=torch.int32, device=dev)
        self.lens = torch.zeros((batch,), dtype=torch.int32, device=dev)
        from kernels.cuda._runtime import kind_of

        self.plan = DecodePlan(like, num_heads, batch, max_blocks, q_kind=kind_of(self.query),
                               out_kind=kind_of(self.out))


class DecodeGraphs:
    """Per-(layer, bucket) CUDA graphs of decode attention over fixed pools (module doc).

    key_caches / value_caches: every layer's caches (torch tensors on one CUDA device — CPU
    tensors under the simulator), all of one geometry and dtype. `dtype`: query/output dtype
    (default: the caches'). Tables passed to `prepare` may be narrower than
    `max_blocks_per_seq`, never wider.
    """

    def __init__(self, key_caches: Sequence[Any], value_caches: Sequence[Any], num_heads: int,
                 max_blocks_per_seq: int, scale: float,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, dtype: Any = None) -> None:
        if not key_caches or len(key_caches) != len(value_caches):
            raise KernelInputError("need one key and one value cache per layer")
        if not all(is_torch(c) for c in (*key_caches, *value_caches)):
            raise KernelInputError("DecodeGraphs needs torch tensors")
        first = key_caches[0]
        for c in (*key_caches, *value_caches):
            if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
                raise KernelInputError("every layer's caches must share one geometry and dtype")
        self.key_caches, self.value_caches = list(key_caches), list(value_caches)
        self.num_heads, self.max_blocks, self.scale = num_heads, max_blocks_per_seq, scale
        self.buckets = sorted({int(b) for b in buckets})
        dtype = dtype or first.dtype
        self._dtype = dtype
        self._state: dict[int, _Bucket] = {}
        self._graphs: dict[tuple[int, int, bool], Any] = {}
        self._pool: Any = None
        # (num_seqs, bucket, split-K?) of the last prepare
        self._current: tuple[int, int, bool] | None = None

    def bucket_for(self, num_seqs: int) -> int:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        raise KernelInputError(f"{num_seqs} sequences exceed the largest bucket {self.buckets[-1]}")

    def _bucket(self, batch: int) -> _Bucket:
        state = self._state.get(batch)
        if state is None:
            state = self._state[batch] = _Bucket(self.key_caches[0], batch, self.num_heads,
                                                 self.max_blocks, self._dtype, self._dtype)
        return state

    def _graph(self, layer: int, batch: int, split: bool = False) -> Any:
        key = (layer, batch, split)
        graph = self._graphs.get(key)
        if graph is None:
            state = self._bucket(batch)
            kc, vc = self.key_caches[layer], self.value_caches[layer]
            if self._pool is None:
                self._pool = new_graph_pool()

            def launch() -> None:
                state.plan.launch(state.query, kc, vc, state.tables, state.lens, self.scale,
                                  state.out, split=split)

            graph = self._graphs[key] = capture_graph(launch, self._pool)
        return graph

    def capture(self, layers: Sequence[int] | None = None,
                buckets: Sequence[int] | None = None) -> None:
        """Capture graphs up front, both kernels where the bucket's plan has both (otherwise
        each is captured at its first `run`)."""
        for batch in buckets or self.buckets:
            plan = self._bucket(batch).plan
            kinds = [s for s in (False, True) if not s or plan.max_items]
            for layer in layers if layers is not None else range(len(self.key_caches)):
                for split in kinds:
                    self._graph(layer, batch, split)

    def prepare(self, block_tables: Any, seq_lens: Any, *, host_seq_lens: Any = None) -> int:
        """Load this step's tables ([num_seqs, <= max_blocks_per_seq] int32) and lengths
        ([num_seqs] int32) into their bucket's buffers and choose its kernel and partitions
        (from `host_seq_lens`, or `seq_lens` when on the host); returns the bucket."""
        import torch

        num_seqs = int(seq_lens.shape[0])
        width = int(block_tables.shape[1])
        if int(block_tables.shape[0]) != num_seqs or width > self.max_blocks:
            raise KernelInputError(
                f"block_tables must be [{num_seqs}, <= {self.max_blocks}], got {tuple(block_tables.shape)}")
        batch = self.bucket_for(num_seqs)
        state = self._bucket(batch)
        non_blocking = not SIMULATOR
        tables = torch.as_tensor(block_tables, dtype=torch.int32)
        lens = torch.as_tensor(seq_lens, dtype=torch.int32)
        if not SIMULATOR and not tables.is_cuda:
            tables, lens = tables.pin_memory(), lens.pin_memory()
        state.tables[:num_seqs, :width].copy_(tables, non_blocking=non_blocking)
        state.lens[:num_seqs].copy_(lens, non_blocking=non_blocking)
        state.lens[num_seqs:].zero_()  # padded rows attend to nothing and yield zeros
        host = to_host_numpy(seq_lens) if host_seq_lens is None else to_host_numpy(host_seq_lens)
        padded = None
        if host is not None:
            if host.shape != (num_seqs,):
                raise KernelInputError(f"host_seq_lens must have shape ({num_seqs},)")
            padded = np.zeros(batch, np.int64)
            padded[:num_seqs] = host
        split = state.plan.schedule(padded)
        self._current = (num_seqs, batch, split)
        return batch

    def query_buffer(self) -> Any:
        """The current bucket's static query rows [:num_seqs]: write q here to skip a copy."""
        num_seqs, batch, _ = self._require_prepared()
        return self._bucket(batch).query[:num_seqs]

    def run(self, layer: int, query: Any, out: Any | None = None) -> Any:
        """Attention of layer `layer` for the prepared batch: [num_seqs, heads, head_dim]."""
        num_seqs, batch, split = self._require_prepared()
        if not 0 <= layer < len(self.key_caches):
            raise KernelInputError(f"layer {layer} out of range")
        state = self._bucket(batch)
        if tuple(query.shape) != (num_seqs, *state.query.shape[1:]):
            raise KernelInputError(f"query must have shape {(num_seqs, *state.query.shape[1:])}")
        if query.data_ptr() != state.query.data_ptr():
            state.query[:num_seqs].copy_(query)
        self._graph(layer, batch, split).replay()
        result = state.out[:num_seqs]
        if out is not None:
            out.copy_(result)
            return out
        return result

    def static_bytes(self) -> int:
        """Device bytes held by the buckets built so far: static query, output, table and
        length buffers, plus split-K scratch and work list where a bucket's plan has them (the
        graphs themselves hold kernel launches only: a plan allocates nothing inside a
        capture)."""
        total = 0
        for state in self._state.values():
            tensors = [state.query, state.out, state.tables, state.lens]
            if state.plan.scratch is not None:
                tensors += [state.plan.scratch, state.plan.work]
            total += sum(int(t.numel()) * t.element_size() for t in tensors)
        return total

    def _require_prepared(self) -> tuple[int, int, bool]:
        if self._current is None:
            raise KernelInputError("call prepare(block_tables, seq_lens) first")
        return self._current
