"""A short scheduler run at the state machine's level, covering every section of a Step and of
its answer (placed and budgeted allocations, forks, appends, written reports, swap-out and
swap-in with their tier moves, per-item errors, reports, frees, a refused step, a release).

`golden/step_journal.jsonl` holds what the service journaled for it before the Step's typed
codec existed (one line per op: the op, whether it mutated, the canonical JSON of its answer or
the error's class name), and `golden/step_payload.json` the journaled payload of a Step request
with every section: the journal format is frozen, so both must stay byte for byte the same.
"""

from __future__ import annotations

from typing import Any

from pagedkv.v1 import block_manager_pb2 as pb


def _alloc(seq_ids: list[str], pools: list[str], tokens: list[list[int] | None], num_tokens: list[int], *,
           place: list[bool] | None = None, place_pools: list[str] | None = None, budget: int = 0) -> dict[str, Any]:
    named = sorted({p for p in pools if p})
    a: dict[str, Any] = {
        "seq_ids": seq_ids, "pools": named, "salts": [],
        "pool_index": [named.index(p) if p else 0 for p in pools], "salt_index": [-1] * len(seq_ids),
        "num_token_ids": [len(t or []) for t in tokens], "token_ids": [x for t in tokens for x in (t or [])],
        "num_tokens": num_tokens, "num_compute": [0] * len(seq_ids),
    }
    if place is not None:
        a["place"], a["place_pools"], a["admit_budget"] = place, place_pools or [], budget
    return a


def _step(**sections: Any) -> dict[str, Any]:
    return {"scheduler_id": "s", **sections}


SCENARIO: list[tuple[str, dict[str, Any]]] = [
    ("register_node", {"node_id": "n1", "num_blocks": 16, "block_size": 4, "geometry": {}, "address": "h1:1",
                       "host_num_blocks": 12}),
    ("register_node", {"node_id": "n2", "num_blocks": 16, "block_size": 4, "geometry": {}, "address": "h2:1"}),
    ("step", _step(alloc=_alloc(["a", "b", "c"], ["n1", "", "n2"], [list(range(9)), list(range(9)), None],
                                [0, 0, 5], place=[False, True, False], budget=20))),
    ("step", _step(reports=[["n1", 1, 1, 0], ["n2", 1, 1, 0]],
                   fork={"parents": ["a"], "num_children": [1], "children": ["a1"]},
                   append={"seq_ids": ["a", "zz"], "num_tokens": [2, 1], "token_ids": [5, 6, 7]})),
    ("step", _step(reports=[["n1", 1, 2, 0]], written={"seq_ids": ["a1"], "num_tokens": [1], "token_ids": [3]},
                   swap_out=["a1"])),
    ("step", _step(reports=[["n1", 1, 3, 0]], swap_in=["a1"],
                   append={"seq_ids": ["a"], "num_tokens": [1], "token_ids": [9]})),
    ("step", _step(reports=[["n1", 1, 4, 0]], free=["c", "nope"])),
    ("step", _step(reports=[["n1", 1, 4, 0]], free=["c"],
                   alloc=_alloc(["d"], [""], [list(range(9))], [0], place=[True], place_pools=["n2"]))),
    ("step", _step(free=["a"], release=True)),
]


def full_request() -> pb.StepRequest:
    """A Step request with every section filled."""
    req = pb.StepRequest(
        request_id="r1", scheduler_id="s", pool_epochs={"n1": 1}, free_seq_ids=["f"],
        alloc_seq_ids=["a", "b"], pool_ids=["n1"], salts=["x"], alloc_pool_index=[0, 0], alloc_salt_index=[0, -1],
        alloc_num_token_ids=[2, 0], alloc_token_ids=[1, 2], alloc_num_tokens=[0, 3], alloc_num_compute=[0, 1],
        alloc_place=[False, True], place_pool_ids=["n1"], admit_budget=7,
        written_seq_ids=["w"], written_num_tokens=[1], written_token_ids=[4],
        fork_parent_ids=["p"], fork_num_children=[2], fork_child_ids=["p1", "p2"], release_leases=True,
        swap_out_seq_ids=["o"], swap_in_seq_ids=["i"],
        append_seq_ids=["x", "y"], append_num_tokens=[1, 2], append_token_ids=[5, 6, 7], append_num_late=[0, 1],
        late_seq_ids=["l"], late_num_tokens=[1], late_token_ids=[8],
    )
    req.reports.add(pool_id="n1", epoch=1, completed_up_to=3, failed_from=0)
    return req
