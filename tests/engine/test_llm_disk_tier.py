"""The disk tier through the embedded `LLM` (docs/tiers.md): prefixes pushed off a tiny device
pool and a tiny host tier land on disk and come back disk->host->device instead of being
recomputed — also in a new `LLM` on the same directory (a process restart of the embedded
node) — and greedy tokens equal transformers' throughout. A damaged slot file is discarded,
never served: the same prompts are then recomputed, tokens still right."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from compute_node.disk_tier import FILE_NAME, HEADER_BYTES
from engine.errors import EngineError
from engine.llm import LLM
from engine.params import SamplingParams
from tests.engine.test_llm import _assert_all_freed, _check_greedy, _prompts

NAME = "llama-gqa4-hd64"
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _llm(model_dir: Path, disk: Path) -> LLM:
    # 12 device blocks of 4 slots, 6 host blocks: of four 16-token prefixes only about one stays
    # above the disk
    return LLM(model_dir, block_size=4, num_kv_blocks=12, device="cpu", watermark=0.0, host_kv_blocks=6,
               max_num_seqs=1, disk_kv_path=str(disk), disk_kv_bytes=8 << 20)


def _rounds(llm: LLM, hf: Any, systems: list[list[int]], tails: list[list[int]], label: str) -> None:
    for i, system in enumerate(systems):
        _check_greedy(llm, hf, [system + tails[i]], f"{label} prefix {i}", PARAMS)


def test_prefixes_come_back_from_disk_and_survive_a_restart(tmp_path: Path, model_dirs: dict[str, Path],
                                                            hf_models: dict[str, Any]) -> None:
    systems = _prompts(31, [16, 16, 16, 16])
    tails = _prompts(32, [3] * 12)
    hf = hf_models[NAME]
    with _llm(model_dirs[NAME], tmp_path) as llm:
        _rounds(llm, hf, systems, tails[0:4], "first")
        _rounds(llm, hf, systems, tails[4:8], "second")
        stats = llm.stats()
        assert stats["disk_offloaded_blocks"] > 0 and stats["disk_onboarded_blocks"] > 0
        assert stats["disk_hit_tokens"] == 4 * stats["disk_onboarded_blocks"]
        disk = llm.client.state.core.disk_metrics("local-0")   # type: ignore[attr-defined]
        assert disk.disk_onboarded_blocks == stats["disk_onboarded_blocks"]
        _assert_all_freed(llm)
        assert llm.client.state.core.fsck() == []   # type: ignore[attr-defined]
    with _llm(model_dirs[NAME], tmp_path) as again:   # a new node process: nothing on device or host
        seeded = again.client.state.core.disk_metrics("local-0").num_cached_blocks   # type: ignore[attr-defined]
        assert seeded >= 8
        _rounds(again, hf, systems, tails[8:12], "after restart")
        stats = again.stats()
        # the prefixes the disk kept were onboarded, not recomputed
        assert stats["disk_hit_tokens"] >= 16 and stats["prefix_hit_tokens"] == 0 and stats["host_hit_tokens"] == 0
        assert again.client.state.core.fsck() == []   # type: ignore[attr-defined]


def test_a_damaged_slot_file_is_discarded_not_served(tmp_path: Path, model_dirs: dict[str, Path],
                                                     hf_models: dict[str, Any]) -> None:
    systems = _prompts(41, [16, 16, 16, 16])
    tails = _prompts(42, [3] * 8)
    hf = hf_models[NAME]
    with _llm(model_dirs[NAME], tmp_path) as llm:
        _rounds(llm, hf, systems, tails[0:4], "first")
        held = llm.client.state.core.disk_metrics("local-0").num_cached_blocks   # type: ignore[attr-defined]
        assert held > 0
    seg = tmp_path / FILE_NAME
    data = bytearray(seg.read_bytes())
    for i in range(HEADER_BYTES + 9000, len(data), 4096):   # damage every slot's payload
        data[i] ^= 0x5A
    seg.write_bytes(bytes(data))
    with _llm(model_dirs[NAME], tmp_path) as again:
        assert again.client.state.core.disk_metrics("local-0").num_cached_blocks == 0   # type: ignore[attr-defined]
        _rounds(again, hf, systems, tails[4:8], "damaged")   # recomputed, still right
        assert again.stats()["disk_hit_tokens"] == 0


def test_disk_options_are_checked(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    with pytest.raises(EngineError, match="host tier"):
        LLM(model_dirs[NAME], device="cpu", num_kv_blocks=8, block_size=4, disk_kv_path=str(tmp_path),
            disk_kv_bytes=1 << 20)
    with pytest.raises(EngineError, match="holds no block"):
        LLM(model_dirs[NAME], device="cpu", num_kv_blocks=8, block_size=4, host_kv_blocks=4,
            disk_kv_path=str(tmp_path), disk_kv_bytes=5000)
    with pytest.raises(EngineError, match="both"):
        LLM(model_dirs[NAME], device="cpu", num_kv_blocks=8, block_size=4, host_kv_blocks=4,
            disk_kv_path=str(tmp_path))


def test_a_slot_damaged_while_running_is_recomputed_not_served(tmp_path: Path, model_dirs: dict[str, Path],
                                                               hf_models: dict[str, Any]) -> None:
    """The file changes under a running node: the onboarding step fails instead of reading bad
    bytes, the node registers anew (its disk index now without the damaged slots) and the
    prompts are recomputed — tokens still equal transformers'."""
    systems = _prompts(61, [16, 16, 16, 16])
    tails = _prompts(62, [3] * 8)
    hf = hf_models[NAME]
    with _llm(model_dirs[NAME], tmp_path) as llm:
        _rounds(llm, hf, systems, tails[0:4], "first")
        core = llm.client.state.core   # type: ignore[attr-defined]
        assert core.disk_metrics("local-0").num_cached_blocks > 0
        node = llm.engine.nodes["local-0"]
        epoch, reads = node.epoch, node.runner.disk_store.num_read
        seg = tmp_path / FILE_NAME
        data = bytearray(seg.read_bytes())
        for i in range(HEADER_BYTES + 9000, len(data), 4096):
            data[i] ^= 0x5A
        seg.write_bytes(bytes(data))
        _rounds(llm, hf, systems, tails[4:8], "damaged while running")
        assert node.epoch > epoch                                  # registered anew
        assert node.runner.disk_store.num_read == reads            # nothing served from the damaged file
        assert node.runner.disk_store.num_discarded > 0
        assert llm.client.state.core.fsck() == []   # type: ignore[attr-defined]
