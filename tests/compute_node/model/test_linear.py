"""The CPU matmuls with packed weights (`compute_node.model.linear`: oneDNN's layout, or the
panel GEMM's on AVX2 hosts): against a float64 reference on random shapes (ragged row counts,
odd feature sizes, bias, strided and 3-D inputs), a model that packs and unpacks its weights
unchanged, and a runner whose packed and plain paths agree to float rounding and give the same
greedy tokens — each for both kinds of packing, whichever this host prefers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from compute_node.model import ModelRunner, SamplingParams
from compute_node.model import linear as dense
from tests.compute_node.model.model_helpers import (
    Request,
    compare_greedy,
    hf_greedy,
    load_hf,
    run_schedule,
    tiny_model_dir,
)

pytestmark = pytest.mark.skipif(not dense.onednn_available(),
                                reason="packed matmuls need x86-64 and a torch build with oneDNN")

SPEC = {"num_layers": 2, "hidden_size": 96, "num_heads": 6, "num_kv_heads": 2, "head_dim": 16,
        "intermediate_size": 200, "vocab_size": 333, "max_position_embeddings": 96}
# float32 accumulates in float32 either way; bfloat16 rounds each output to 8 bits of mantissa.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
BF16_PACKS = dense.onednn_available(torch.bfloat16)
needs_bf16_path = pytest.mark.skipif(
    not BF16_PACKS, reason="this CPU lacks oneDNN's bfloat16 path (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); "
    "test_bfloat16_stays_plain_where_the_cpu_cannot_pack_it covers it here")


@pytest.fixture(params=["panels", "onednn"])
def float32_packing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """float32 weights packed the given way, whatever this host prefers (the panel kernel
    computes on any x86-64 CPU; it is only preferred where it is the faster)."""
    monkeypatch.setattr(dense, "panels_preferred", lambda: request.param == "panels")
    return str(request.param)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_path)])
@pytest.mark.parametrize(("rows", "in_features", "out_features"),
                         [(1, 576, 960), (3, 70, 33), (8, 576, 3072), (37, 1536, 576), (300, 64, 129), (64, 96, 48)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("packer", ["pack", "pack_onednn", "pack_panels"])
def test_packed_linear_matches_float64(dtype: torch.dtype, rows: int, in_features: int, out_features: int,
                                       with_bias: bool, packer: str) -> None:
    if packer == "pack_panels" and (dtype != torch.float32 or out_features % 16):
        pytest.skip("panels take float32 weights of whole panels (the kernel's own tests cover ragged ones)")
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype) if with_bias else None
    # a strided input, as the model's chunked gate/up and split q/k/v views are
    x = torch.randn(rows, 2 * in_features, generator=g).to(dtype)[:, ::2]
    packed = getattr(dense, packer)(weight)
    assert dense.is_packed(packed) and dense.unpack(packed).equal(weight)   # a reorder: the values are kept
    assert packed.is_mkldnn == (packer == "pack_onednn" or (packer == "pack" and packed.dim() == 2))
    got = dense.linear(x, packed, bias)
    want = _reference(x, weight, bias)
    scale = (x.double().abs() @ weight.double().abs().T).clamp_min(1.0)   # the sum's own size
    assert got.dtype == dtype and got.shape == (rows, out_features)
    assert ((got.double() - want).abs() / scale).max() <= TOLERANCE[dtype]
    # and it is as close as F.linear on the plain weight is
    plain = ((F.linear(x, weight, bias).double() - want).abs() / scale).max()
    assert ((got.double() - want).abs() / scale).max() <= max(4 * plain, TOLERANCE[dtype] / 4)


@pytest.mark.usefixtures("float32_packing")
def test_packed_linear_takes_batched_inputs() -> None:
    g = torch.Generator().manual_seed(7)
    weight, x = torch.randn(48, 24, generator=g), torch.randn(3, 5, 24, generator=g)
    got = dense.linear(x, dense.pack(weight))
    assert got.shape == (3, 5, 48)
    assert torch.allclose(got.double(), x.double() @ weight.double().T, atol=1e-5)


def test_panels_are_preferred_on_avx2_without_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN computes 16 floats wide (AVX-512) it keeps float32 weights; on AVX2 hosts
    the panel GEMM takes those whose width is a whole number of panels."""
    for features, preferred in (({"avx2": True, "fma": True, "avx512f": False}, True),
                                ({"avx2": True, "fma": True, "avx512f": True}, False),
                                ({"avx2": False, "fma": False, "avx512f": False}, False)):
        monkeypatch.setattr(dense.llvm, "get_host_cpu_features", lambda f=features: f)
        dense.panels_preferred.cache_clear()
        try:
            assert dense.panels_preferred() == preferred
            assert dense.pack(torch.randn(48, 8)).dim() == (3 if preferred else 2)
            assert dense.pack(torch.randn(40, 8)).is_mkldnn   # not a whole number of panels
        finally:
            monkeypatch.undo()
            dense.panels_preferred.cache_clear()


def test_what_is_packed() -> None:
    cpu = torch.device("cpu")
    assert dense.can_pack(cpu, torch.float32) and dense.can_pack(cpu, torch.bfloat16) == BF16_PACKS
    assert not dense.can_pack(cpu, torch.float16)                    # stays on F.linear
    assert not dense.can_pack(torch.device("cuda"), torch.float32)   # GPUs run cuBLAS


def test_only_large_weights_are_packed() -> None:
    """Below `MIN_PACKED_ELEMENTS` oneDNN's fixed cost per call exceeds what it saves."""
    small, large = torch.randn(64, 128), torch.randn(512, 512)
    assert dense.pack_if_large(small) is small
    assert dense.is_packed(dense.pack_if_large(large)) and large.numel() == dense.MIN_PACKED_ELEMENTS


@pytest.fixture
def pack_every_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test model is tiny: pack its weights anyway, to test the packed model."""
    monkeypatch.setattr(dense, "MIN_PACKED_ELEMENTS", 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("linear"), "llama", seed=5, **SPEC)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.usefixtures("pack_every_weight", "float32_packing")
def test_a_model_packs_and_unpacks_its_weights_unchanged(tmp_path: Path, tied: bool) -> None:
    directory = tiny_model_dir(tmp_path, "llama", seed=2, tie_word_embeddings=tied, **SPEC)
    plain = ModelRunner(directory, block_size=4, num_blocks=8, device="cpu", prepack_linear=False).model
    model = ModelRunner(directory, block_size=4, num_blocks=8, device="cpu").model
    assert model.packed_linear and not plain.packed_linear
    assert all(dense.is_packed(layer.qkv_weight) and dense.is_packed(layer.down_weight) for layer in model.layers)
    # the lookup keeps its plain table; a vocab of 333 is no whole number of panels: oneDNN's
    assert model.lm_head.is_mkldnn and not dense.is_packed(model.embed)
    model.unpack_linear_weights()
    for ours, theirs in zip(model.layers, plain.layers):
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name))
    assert torch.equal(model.lm_head, plain.lm_head)
    assert (model.lm_head is model.embed) == tied                   # tied again, not a copy
    model.pack_linear_weights()
    assert model.packed_linear and model.lm_head.is_mkldnn and dense.is_packed(model.layers[0].o_weight)


def test_float16_and_opt_out_keep_plain_weights(model_dir: Path) -> None:
    for options in ({"dtype": "float16"}, {"prepack_linear": False}):
        runner = ModelRunner(model_dir, block_size=4, num_blocks=8, device="cpu", **options)  # type: ignore[arg-type]
        assert not runner.model.packed_linear


@pytest.mark.usefixtures("pack_every_weight")
def test_bfloat16_stays_plain_where_the_cpu_cannot_pack_it(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without oneDNN's bfloat16 path (a plain AVX2 one: its reorder raises) a
    bfloat16 model keeps F.linear and computes, and float32 still packs. Simulated where the
    CPU has the path: the bfloat16 probe is made to fail as it does there."""
    real = dense.pack_onednn

    def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")
        return real(weight)

    monkeypatch.setattr(dense, "pack_onednn", pack_onednn)
    dense.onednn_available.cache_clear()
    try:
        assert not dense.onednn_available(torch.bfloat16) and dense.onednn_available(torch.float32)
        runner = ModelRunner(model_dir, block_size=4, num_blocks=8, device="cpu", dtype="bfloat16")
        assert not runner.model.packed_linear
        runner.model.pack_linear_weights()   # asked anyway: nothing changes
        assert not runner.model.packed_linear
        run_schedule(runner, [Request([5, 6, 7, 8, 9], 3)], seed=0)
        assert ModelRunner(model_dir, block_size=4, num_blocks=8, device="cpu").model.packed_linear
    finally:
        monkeypatch.undo()
        dense.onednn_available.cache_clear()


@pytest.mark.parametrize("lacking", ["onednn", "x86"])
@pytest.mark.usefixtures("pack_every_weight")
def test_without_onednn_the_model_runs_on_plain_weights(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                        lacking: str) -> None:
    """Without oneDNN, float32 weights still take panels where those are preferred (they need
    only Numba), the rest stay plain; off x86-64 everything stays plain."""
    panels_here = dense.panels_preferred()
    if lacking == "onednn":
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    else:
        monkeypatch.setattr(dense.platform, "machine", lambda: "aarch64")
    dense.onednn_available.cache_clear()
    dense.panels_preferred.cache_clear()
    try:
        runner = ModelRunner(model_dir, block_size=4, num_blocks=8, device="cpu")
        assert runner.model.packed_linear == (lacking == "onednn" and panels_here)
        assert not runner.model.lm_head.is_mkldnn   # 333 rows: no whole number of panels, stays plain
        run_schedule(runner, [Request([5, 6, 7, 8, 9], 3)], seed=0)   # and it computes
    finally:
        monkeypatch.undo()
        dense.onednn_available.cache_clear()
        dense.panels_preferred.cache_clear()
    assert dense.onednn_available()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.usefixtures("pack_every_weight", "float32_packing")
def test_packed_and_plain_runners_agree(model_dir: Path, dtype: str) -> None:
    """A mixed schedule (chunked prefill, a shared prefix, decodes joining mid-way) on packed
    and plain weights: the same greedy tokens, logprobs equal to float rounding."""
    with_logprobs = SamplingParams(temperature=0.0, logprobs=4)
    results = []
    for packed in (True, False):
        runner = ModelRunner(model_dir, block_size=4, num_blocks=80, device="cpu", dtype=dtype, prepack_linear=packed)
        packs = packed and (dtype == "float32" or BF16_PACKS)
        assert runner.model.packed_linear == packs and dense.is_packed(runner.model.layers[0].qkv_weight) == packs
        requests = [
            Request(list(range(10, 33)), 9, chunk_size=7, sample=with_logprobs),
            Request(list(range(10, 26)) + [90, 91, 92], 6, admit_step=3, share_from=0, shared_blocks=4),
            Request([7, 8, 9], 12, admit_step=1, sample=with_logprobs),
        ]
        results.append((run_schedule(runner, requests, seed=1), [r.logprobs for r in requests]))
    (tokens_a, logprobs_a), (tokens_b, logprobs_b) = results
    assert tokens_a == tokens_b
    tol = 1e-4 if dtype == "float32" else 5e-2
    for seq_a, seq_b in zip(logprobs_a, logprobs_b, strict=True):
        assert len(seq_a) == len(seq_b)
        for (chosen_a, top_a), (chosen_b, top_b) in zip(seq_a, seq_b):
            if chosen_a is None:   # the request asked for none
                assert chosen_b is None and top_a is None and top_b is None
                continue
            assert chosen_a == pytest.approx(chosen_b, abs=tol)
            values_a, values_b = dict(top_a), dict(top_b)
            for token in values_a.keys() & values_b.keys():   # a near-tie may swap the last of the top k
                assert values_a[token] == pytest.approx(values_b[token], abs=tol)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])   # qwen2: q/k/v biases through the fused GEMM
@pytest.mark.usefixtures("pack_every_weight")
def test_fused_layers_give_transformers_greedy_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      arch: str) -> None:
    """With every weight in panels each layer runs as two fused kernels (`kernels.cpu.fused_layer`):
    greedy tokens are transformers' (near-tie rule) and the op-by-op path's, on a schedule with
    chunked prefill, a shared prefix and decodes joining mid-way."""
    monkeypatch.setattr(dense, "panels_preferred", lambda: True)
    directory = tiny_model_dir(tmp_path, arch, seed=3, **SPEC)

    def requests_of() -> list[Request]:   # fresh ones per run (a run records its progress in them)
        return [
            Request(list(range(10, 33)), 9, chunk_size=7),
            Request(list(range(10, 26)) + [90, 91, 92], 6, admit_step=3, share_from=0, shared_blocks=4),
            Request([7, 8, 9], 12, admit_step=1),
        ]

    outputs = []
    for fused in (True, False):
        runner = ModelRunner(directory, block_size=4, num_blocks=80, device="cpu")
        runner.model.fused_layers = fused
        assert (runner.model._fused_layer_weights() is not None) == fused
        requests = requests_of()
        outputs.append(run_schedule(runner, requests, seed=1))
    assert outputs[0] == outputs[1]
    hf = load_hf(directory)
    matched = sum(compare_greedy(ours, hf_greedy(hf, r.prompt, r.max_new_tokens), f"{arch} seq {i}")
                  for i, (r, ours) in enumerate(zip(requests, outputs[0])))
    assert matched >= 0.8 * sum(r.max_new_tokens for r in requests)
