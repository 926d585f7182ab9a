"""The `step` operation's request: one typed value (`StepInput`), its journal forms and its
protobuf form.

A Step request travels as parallel lists (the protobuf's packed columns), read straight into
`StepInput` by `StepInput.from_pb`, so neither the servicer nor the journal builds one object
per item. The decoders check every list's shape before the state machine touches anything: a
malformed request fails as a whole with nothing changed. The answer is `step_answer.StepAnswer`.

Journal forms. Since version 1 (`STEP_REQUEST_FORMAT`) a Step is journaled as the bytes of its
request (`ReceivedStep.journal_form`: the same bytes its digest is taken over) and its answer as
the bytes of its `StepResponse` (`ReceivedStep.record`); replay parses the bytes and decodes
them with `from_pb`, the live path's decoder. Before, it was a JSON dict (`step_payload`, its
answer `StepAnswer.to_json`); those forms are frozen, because journals written by earlier
versions must replay: `from_json` reads every older payload.
This module is transport-free at run time: the protobuf types appear in annotations only (the
transport hands in `new_response`, replay the request type's parser).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from block_manager.core.errors import InvalidRequest
from block_manager.core.leases import check_scheduler_id
from block_manager.core.types import PoolId, SeqId
from block_manager.service.request_index import body_digest, message_body
from block_manager.service.state_codec import MAX_ID_LEN
from block_manager.service.step_answer import StepAnswer, pool_step_dict
from block_manager.store.records import Body, Packed

if TYPE_CHECKING:
    from pagedkv.v1 import block_manager_pb2 as pb

SECTIONS = ("alloc", "written", "fork", "append", "late")


# The checks below run once per Step on lists of hundreds of entries: they use C-level
# passes (map/min/max/set) instead of a Python loop per entry.
def _ints(name: str, value: object, *, minimum: int = 0) -> list[int]:
    if not isinstance(value, list):
        raise InvalidRequest(f"{name} must be a list of integers")
    if value and (not set(map(type, value)) <= {int} or min(value) < minimum):
        raise InvalidRequest(f"{name} must hold integers >= {minimum}")
    return value


def _ids(name: str, value: object) -> list[str]:
    if not isinstance(value, list):
        raise InvalidRequest(f"{name} must be a list of ids")
    if value and (
        not set(map(type, value)) <= {str} or not 0 < min(map(len, value)) <= max(map(len, value)) <= MAX_ID_LEN
    ):
        raise InvalidRequest(f"{name} entries must be non-empty strings of at most {MAX_ID_LEN} characters")
    return value


def _seq_ids(name: str, value: object) -> list[SeqId]:
    """`_ids` of sequences: checked, they are sequence ids (`SeqId` is a `str`; no copy)."""
    return cast(list[SeqId], _ids(name, value))



def _check_batch_limits(max_batch: int, **sections: Sized) -> None:
    """Each section of a step carries at most `max_batch` items (both decoders' one check)."""
    names = {"written": "written reports", "late": "late-id items"}
    for key, items in sections.items():
        if len(items) > max_batch:
            raise InvalidRequest(f"a step may carry at most {max_batch} {names.get(key, key)}, got {len(items)}")

def _distinct(name: str, ids: Sequence[str]) -> None:
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"duplicate {name} in one step")


def _split(name: str, counts: list[int], flat: list[int]) -> list[list[int] | None]:
    """Per-item token ids: `flat` holds all of them (sum of counts) or none."""
    if not flat:
        return [None] * len(counts)
    if len(flat) != sum(counts):
        raise InvalidRequest(f"{name}: {len(flat)} token ids for {sum(counts)} tokens (give all or none)")
    out: list[list[int] | None] = []
    pos = 0
    for n in counts:
        out.append(flat[pos : pos + n])
        pos += n
    return out


@dataclass(slots=True)
class Report:
    pool_id: PoolId
    epoch: int
    completed_up_to: int
    failed_from: int | None


@dataclass(slots=True)
class Alloc:
    seq_id: SeqId
    pool_id: str                  # "" for a placed allocation until the block manager placed it
    token_ids: list[int] | None
    num_tokens: int | None
    salt: str | None
    num_compute: int | None
    place: bool = False           # the block manager picks the pool (among `StepInput.place_pools`)
    fetch_sources: list[str] = field(default_factory=list)   # placement's fetch source (docs/prefix_fetch.md)


@dataclass(slots=True)
class Placement:
    """The placed allocations' candidate pools (empty: every live pool) and token budget."""

    pool_ids: list[str]
    admit_budget: int             # 0: no budget (each computes what it asks, `num_compute`)


@dataclass(slots=True)
class AppendColumns:
    """A section of appends as the request carries it: parallel ids and counts, the token ids
    of every item back to back (or none). Shape-checked; the core validates the rest."""

    seq_ids: list[SeqId]
    counts: list[int]
    token_ids: Sequence[int] | None     # an int64 array once decoded (`_int64s`)
    num_late: list[int] | None = None   # appends only: per item, its last tokens whose ids come later

    def __len__(self) -> int:
        return len(self.seq_ids)


@dataclass(slots=True)
class StepInput:
    """A decoded, shape-checked step payload."""

    scheduler_id: str
    pool_epochs: dict[str, int]
    reports: list[Report]
    free_ids: list[SeqId]
    allocs: list[Alloc]
    written: AppendColumns
    forks: list[tuple[SeqId, list[SeqId]]]
    appends: AppendColumns
    placement: Placement
    late: AppendColumns = field(default_factory=lambda: AppendColumns([], [], None))  # late ids of earlier appends
    swap_out: list[SeqId] = field(default_factory=list)
    swap_in: list[SeqId] = field(default_factory=list)
    release: bool = False         # give up this scheduler's pool leases after the step
    # A fleet member's step (set by the runtime, journaled with the payload so a replay decides
    # the same): it drives only pools it holds the lease of, fetch sources may be any owner's.
    fleet: bool = False

    @property
    def swap_ids(self) -> list[SeqId]:
        """The swap-outs, then the swap-ins."""
        return [*self.swap_out, *self.swap_in]

    @property
    def num_items(self) -> int:
        """The items that may fail one by one (allocations, written reports, forks, appends,
        late ids); swaps are counted apart."""
        return len(self.allocs) + len(self.written) + len(self.forks) + len(self.appends) + len(self.late)

    @classmethod
    def from_json(cls, p: Mapping[str, Any], max_batch: int) -> StepInput:
        """The journaled payload (`step_payload`), shape-checked: `InvalidRequest` when any
        list is malformed or a section carries more than `max_batch` items."""
        reports = [
            Report(PoolId(_ids("report pool", [r[0]])[0]), int(r[1]), int(r[2]), int(r[3]) or None)
            for r in p.get("reports", [])
        ]
        for r in reports:
            if r.completed_up_to < 0 or (r.failed_from is not None and r.failed_from < 1) or r.epoch < 0:
                raise InvalidRequest("report step ids and epochs must be >= 0")
        _distinct("report pools", [r.pool_id for r in reports])
        free_ids = _seq_ids("free_seq_ids", p.get("free", []))
        _distinct("free_seq_ids", free_ids)
        allocs, placement = _decode_allocs(p.get("alloc") or {})
        _distinct("allocation seq_ids", [a.seq_id for a in allocs])
        written = _decode_appends("written", p.get("written") or {})
        appends = _decode_appends("append", p.get("append") or {})
        late = _decode_late(p.get("late") or {})
        forks = _decode_forks(p.get("fork") or {})
        children = [c for _, cs in forks for c in cs]
        _distinct("fork child ids", children)
        _check_batch_limits(max_batch, frees=free_ids, allocations=allocs, written=written, forks=children,
                            appends=appends, late=late)
        epochs = p.get("pool_epochs") or {}
        if not isinstance(epochs, dict):
            raise InvalidRequest("pool_epochs must be a mapping")
        return cls(str(p["scheduler_id"]), dict(epochs), reports, free_ids, allocs, written, forks, appends,
                   placement, late, decode_swap_ids(p, "swap_out", max_batch),
                   decode_swap_ids(p, "swap_in", max_batch), bool(p.get("release")), p.get("fleet") is True)


    @classmethod
    def from_pb(cls, request: pb.StepRequest, max_batch: int, *, fleet: bool = False) -> StepInput:
        """The request's columns read straight from the message: the same value, checks and
        errors as `from_json(step_payload(request))` (a section counts only when its ids are
        given, as there), without the payload in between. The message's types are known
        (strings, unsigned ints), so only what they do not guarantee is checked: id lengths,
        counts >= 1, salt length and index range, column shapes."""
        reports = []
        for r in request.reports:
            reports.append(Report(PoolId(_pb_ids("report pool", [r.pool_id])[0]), r.epoch, r.completed_up_to,
                                  r.failed_from or None))
        _distinct("report pools", [r.pool_id for r in reports])
        free_ids = cast(list[SeqId], _pb_ids("free_seq_ids", request.free_seq_ids))
        _distinct("free_seq_ids", free_ids)
        if request.alloc_seq_ids:
            allocs, placement = _decode_allocs_pb(request)
        else:
            allocs, placement = [], Placement([], 0)
        _distinct("allocation seq_ids", [a.seq_id for a in allocs])
        written = _appends_pb("written", request.written_seq_ids, request.written_num_tokens,
                              request.written_token_ids, ())
        appends = _appends_pb("append", request.append_seq_ids, request.append_num_tokens,
                              request.append_token_ids, request.append_num_late)
        late = _check_late(_appends_pb("late", request.late_seq_ids, request.late_num_tokens,
                                       request.late_token_ids, ()))
        forks = _forks_pb(request) if request.fork_parent_ids else []
        children = [c for _, cs in forks for c in cs]
        _distinct("fork child ids", children)
        _check_batch_limits(max_batch, frees=free_ids, allocations=allocs, written=written, forks=children,
                            appends=appends, late=late)
        return cls(request.scheduler_id, dict(request.pool_epochs), reports, free_ids, allocs, written, forks,
                   appends, placement, late, _swap_ids_pb("swap_out", request.swap_out_seq_ids, max_batch),
                   _swap_ids_pb("swap_in", request.swap_in_seq_ids, max_batch), request.release_leases, fleet)


def _decode_allocs(a: Mapping[str, Any]) -> tuple[list[Alloc], Placement]:
    seq_ids = _seq_ids("alloc_seq_ids", a.get("seq_ids", []))
    n = len(seq_ids)
    pools = _ids("pool_ids", a.get("pools", []))
    salts = a.get("salts", [])
    if not isinstance(salts, list) or any(type(s) is not str or len(s) > 1024 for s in salts):
        raise InvalidRequest("salts must be strings of at most 1024 characters")
    pool_index = _ints("alloc_pool_index", a.get("pool_index", []))
    salt_index = a.get("salt_index", [])
    num_token_ids = _ints("alloc_num_token_ids", a.get("num_token_ids", []))
    num_tokens = _ints("alloc_num_tokens", a.get("num_tokens", []))
    num_compute = _ints("alloc_num_compute", a.get("num_compute", []))
    _check_alloc_columns(n, pool_index, salt_index, num_token_ids, num_tokens, num_compute)
    place = a.get("place", [])
    if not isinstance(place, list) or (place and (len(place) != n or not set(map(type, place)) <= {bool})):
        raise InvalidRequest(f"alloc_place must be empty or hold one bool per allocation ({n})")
    place_pools = _ids("place_pool_ids", a.get("place_pools", []))
    admit_budget = a.get("admit_budget", 0)
    if type(admit_budget) is not int or admit_budget < 0:
        raise InvalidRequest("admit_budget must be an integer >= 0")
    token_ids = _ints("alloc_token_ids", a.get("token_ids", []))
    out = _build_allocs(seq_ids, pools, salts, place, pool_index, salt_index, num_token_ids, num_tokens, num_compute,
                        token_ids)
    return out, Placement(place_pools, admit_budget)


def _check_alloc_columns(n: int, *cols: Sequence[object]) -> None:
    """Every per-allocation column (pool index, salt index, token-id count, token count, compute
    budget) holds one entry per allocation."""
    names = ("alloc_pool_index", "alloc_salt_index", "alloc_num_token_ids", "alloc_num_tokens", "alloc_num_compute")
    for name, col in zip(names, cols, strict=True):
        if len(col) != n:
            raise InvalidRequest(f"{name} has {len(col)} entries for {n} allocations")


def _build_allocs(seq_ids: Sequence[SeqId], pools: Sequence[str], salts: Sequence[str], place: Sequence[bool],
                  pool_index: Sequence[int], salt_index: Sequence[object], num_token_ids: Sequence[int],
                  num_tokens: Sequence[int], num_compute: Sequence[int], token_ids: list[int]) -> list[Alloc]:
    """The allocations of columns already checked for type and length (both decoders end here,
    so the JSON journal and the protobuf request are refused alike)."""
    if len(token_ids) != sum(num_token_ids):
        raise InvalidRequest(f"alloc_token_ids has {len(token_ids)} ids, the counts say {sum(num_token_ids)}")
    out: list[Alloc] = []
    pos = 0
    for i in range(len(seq_ids)):
        placed = bool(place) and place[i]
        if not placed and pool_index[i] >= len(pools):
            raise InvalidRequest(f"allocation {i}: pool index {pool_index[i]} out of range")
        si = salt_index[i]
        if type(si) is not int or not -1 <= si < len(salts):
            raise InvalidRequest(f"allocation {i}: salt index {si!r} out of range")
        k = num_token_ids[i]
        toks = token_ids[pos : pos + k] if k else None
        pos += k
        if (toks is None) == (num_tokens[i] == 0):
            raise InvalidRequest(f"allocation {i}: give token ids or a token count, exactly one")
        out.append(Alloc(seq_ids[i], "" if placed else pools[pool_index[i]], toks, num_tokens[i] or None,
                         salts[si] if si >= 0 else None, num_compute[i] or None, placed))
    return out


def _decode_appends(section: str, a: Mapping[str, Any]) -> AppendColumns:
    seq_ids = _seq_ids(f"{section}_seq_ids", a.get("seq_ids", []))
    counts = _ints(f"{section}_num_tokens", a.get("num_tokens", []), minimum=1)
    return _append_columns(section, seq_ids, counts, lambda: _ints(f"{section}_token_ids", a.get("token_ids", [])),
                           lambda: _ints(f"{section}_num_late", a.get("num_late", [])))


def _append_columns(section: str, seq_ids: list[SeqId], counts: list[int], token_ids_of: Callable[[], list[int]],
                    num_late_of: Callable[[], list[int]]) -> AppendColumns:
    """An append-shaped section from its decoded ids and counts; its token ids and late counts
    are decoded (`*_of`) only after the checks before them passed, so both decoders (JSON of the
    journal, the protobuf request) refuse a malformed section with the same message."""
    if len(counts) != len(seq_ids):
        raise InvalidRequest(f"{section}_num_tokens has {len(counts)} entries for {len(seq_ids)} sequences")
    _distinct(f"{section} seq_ids", seq_ids)
    token_ids = token_ids_of()
    if token_ids and len(token_ids) != sum(counts):
        raise InvalidRequest(f"{section}: {len(token_ids)} token ids for {sum(counts)} tokens (give all or none)")
    num_late = num_late_of()
    if num_late and len(num_late) != len(seq_ids):
        raise InvalidRequest(f"{section}_num_late has {len(num_late)} entries for {len(seq_ids)} sequences")
    return AppendColumns(seq_ids, counts, _int64s(token_ids) if token_ids else None, num_late or None)


def _int64s(values: list[int]) -> Sequence[int]:
    """Checked integers as an int64 array: the core's screen takes such a column without its
    per-item type pass (issue 45). The list itself when one does not fit (only a hand-made
    journal payload can hold one: the request's are uint32), for the core to refuse its item."""
    try:
        return array("q", values)
    except OverflowError:
        return values


def _decode_late(a: Mapping[str, Any]) -> AppendColumns:
    """The late-ids section: per sequence, all the ids it awaits (at least one): shaped like
    an append section whose ids are required."""
    return _check_late(_decode_appends("late", a))


def _check_late(late: AppendColumns) -> AppendColumns:
    if late.seq_ids and late.token_ids is None:
        raise InvalidRequest(f"late: no token ids for {sum(late.counts)} tokens")
    if late.num_late:
        raise InvalidRequest("late ids cannot themselves be late")
    return late


def _fork_pairs(parents: list[SeqId], counts: list[int], children: list[SeqId]) -> list[tuple[SeqId, list[SeqId]]]:
    """Each parent with its children (both decoders: one refusal for columns that disagree)."""
    if len(counts) != len(parents) or sum(counts) != len(children):
        raise InvalidRequest("fork columns disagree: one child count per parent, one id per child")
    out = []
    pos = 0
    for parent, n in zip(parents, counts):
        out.append((parent, children[pos : pos + n]))
        pos += n
    return out


def _decode_forks(f: Mapping[str, Any]) -> list[tuple[SeqId, list[SeqId]]]:
    parents = _seq_ids("fork_parent_ids", f.get("parents", []))
    counts = _ints("fork_num_children", f.get("num_children", []), minimum=1)
    children = _seq_ids("fork_child_ids", f.get("children", []))
    return _fork_pairs(parents, counts, children)


def decode_swap_ids(p: Mapping[str, Any], key: str, max_batch: int) -> list[SeqId]:
    """A Step's `swap_out` / `swap_in` ids: distinct, at most `max_batch`."""
    ids = _seq_ids(key, p.get(key, []))
    _distinct(key, ids)
    if len(ids) > max_batch:
        raise InvalidRequest(f"a step may carry at most {max_batch} {key} items, got {len(ids)}")
    return ids


# ---- straight from the message (`StepInput.from_pb`) ---------------------------------------
# The same checks as the journal form's decoders above, in the same order and with the same
# messages, minus the type checks the message's schema already guarantees.
def _pb_ids(name: str, col: Sequence[str]) -> list[str]:
    ids = list(col)
    lengths = set(map(len, ids))   # one pass (an `"" in ids` scan compares every string)
    if ids and (0 in lengths or max(lengths) > MAX_ID_LEN):
        raise InvalidRequest(f"{name} entries must be non-empty strings of at most {MAX_ID_LEN} characters")
    return ids


def _pb_counts(name: str, col: Sequence[int]) -> list[int]:
    """Unsigned counts that must be >= 1."""
    counts = list(col)
    if counts and min(counts) < 1:
        raise InvalidRequest(f"{name} must hold integers >= 1")
    return counts


def _decode_allocs_pb(r: pb.StepRequest) -> tuple[list[Alloc], Placement]:
    seq_ids = cast(list[SeqId], _pb_ids("alloc_seq_ids", r.alloc_seq_ids))
    n = len(seq_ids)
    pools = _pb_ids("pool_ids", r.pool_ids)
    salts = list(r.salts)
    if any(len(s) > 1024 for s in salts):
        raise InvalidRequest("salts must be strings of at most 1024 characters")
    pool_index, salt_index = list(r.alloc_pool_index), list(r.alloc_salt_index)
    num_token_ids, num_tokens = list(r.alloc_num_token_ids), list(r.alloc_num_tokens)
    num_compute = list(r.alloc_num_compute)
    _check_alloc_columns(n, pool_index, salt_index, num_token_ids, num_tokens, num_compute)
    place = list(r.alloc_place)
    if place and len(place) != n:
        raise InvalidRequest(f"alloc_place must be empty or hold one bool per allocation ({n})")
    place_pools = _pb_ids("place_pool_ids", r.place_pool_ids) if place else []
    admit_budget = r.admit_budget if place else 0
    token_ids = list(r.alloc_token_ids)
    out = _build_allocs(seq_ids, pools, salts, place, pool_index, salt_index, num_token_ids, num_tokens, num_compute,
                        token_ids)
    return out, Placement(place_pools, admit_budget)


def _appends_pb(section: str, seq_col: Sequence[str], count_col: Sequence[int], token_col: Sequence[int],
                late_col: Sequence[int]) -> AppendColumns:
    """A section's columns (all ignored when it names no sequence, as `step_payload` drops them)."""
    if not seq_col:
        return AppendColumns([], [], None)
    seq_ids = cast(list[SeqId], _pb_ids(f"{section}_seq_ids", seq_col))
    counts = _pb_counts(f"{section}_num_tokens", count_col)
    return _append_columns(section, seq_ids, counts, lambda: list(token_col), lambda: list(late_col))


def _forks_pb(r: pb.StepRequest) -> list[tuple[SeqId, list[SeqId]]]:
    parents = cast(list[SeqId], _pb_ids("fork_parent_ids", r.fork_parent_ids))
    counts = _pb_counts("fork_num_children", r.fork_num_children)
    children = cast(list[SeqId], _pb_ids("fork_child_ids", r.fork_child_ids))
    return _fork_pairs(parents, counts, children)


def _swap_ids_pb(key: str, col: Sequence[str], max_batch: int) -> list[SeqId]:
    ids = cast(list[SeqId], _pb_ids(key, col))
    _distinct(key, ids)
    if len(ids) > max_batch:
        raise InvalidRequest(f"a step may carry at most {max_batch} {key} items, got {len(ids)}")
    return ids


# The Step's binary journal forms (the `Packed` formats of `store/records.py`). Version 1: the
# request's `message_body` (its deterministic protobuf encoding without request_id and session)
# after one flags byte; the answer's `StepResponse` encoding. A journal's meaning then rests on
# the proto's field numbers, which protobuf's own compatibility rules already freeze.
STEP_REQUEST_FORMAT = "step-request/1"
STEP_ANSWER_FORMAT = "step-answer/1"
_FLAG_FLEET = 1


@dataclass(slots=True)
class ReceivedStep:
    """A Step request as the servicer received it, on its way into the runtime (or a packed
    journal record of one, `from_packed`). Decoded once, straight from the message into the
    state machine's columns (`decode`), whether or not the server journals.

    Its representations are built at most once each: `body()` (the deterministic encoding
    without request_id and session) is what the digest is taken over *and* what the journal
    stores (`journal_form`), and `record(answer)` fills the response message once
    (`new_response`, given by the transport) and keeps both it (`response`, what the servicer
    returns) and its bytes (the recorded answer a retry gets back). Without `new_response`
    (replay, tests) the answer is recorded in its JSON form. `fleet`: a fleet member's step
    (journaled with the request)."""

    request: pb.StepRequest
    fleet: bool = False
    new_response: Callable[[], pb.StepResponse] | None = None
    response: pb.StepResponse | None = None
    recorded: Packed | None = None
    _body: bytes | None = None

    @classmethod
    def from_packed(cls, packed: Packed, parse: Callable[[bytes], pb.StepRequest]) -> ReceivedStep:
        """A journaled `STEP_REQUEST_FORMAT` record (`parse`: the message type's `FromString`)."""
        if packed.format != STEP_REQUEST_FORMAT or not packed.data:
            raise InvalidRequest(f"not a packed step request ({packed.format!r})")
        flags, body = packed.data[0], packed.data[1:]
        if flags & ~_FLAG_FLEET:
            raise InvalidRequest(f"packed step request with unknown flags {flags:#x}")
        return cls(parse(body), fleet=bool(flags & _FLAG_FLEET), _body=body)

    @property
    def scheduler_id(self) -> str:
        return self.request.scheduler_id

    def decode(self, max_batch: int) -> StepInput:
        """The `StepInput` that `StepInput.from_json(self.payload())` gives, with the same
        checks in the same order (the scheduler id first, as the state machine checks it)."""
        check_scheduler_id(self.request.scheduler_id)
        return StepInput.from_pb(self.request, max_batch, fleet=self.fleet)

    def body(self) -> bytes:
        if self._body is None:
            self._body = message_body(self.request)
        return self._body

    def digest(self) -> str:
        """What a retry is compared against: `protocol.request_digest("Step", request)`."""
        return body_digest("Step", self.body())

    def journal_form(self) -> Packed:
        """The journaled payload (`STEP_REQUEST_FORMAT`)."""
        return Packed(STEP_REQUEST_FORMAT, bytes((_FLAG_FLEET if self.fleet else 0,)) + self.body())

    def record(self, answer: StepAnswer) -> Body:
        """The recorded form of this step's answer (see the class docstring)."""
        if self.new_response is None:
            return answer.to_json()
        self.response = answer.fill(self.new_response())
        self.recorded = Packed(STEP_ANSWER_FORMAT, self.response.SerializeToString())
        return self.recorded

    def payload(self) -> dict[str, Any]:
        """The JSON journal form written before version 1 (`step_payload`, marked `fleet` for
        a member's step): what `StepInput.from_json` reads; no longer journaled."""
        p = step_payload(self.request)
        return {**p, "fleet": True} if self.fleet else p


def step_payload(request: pb.StepRequest) -> dict[str, Any]:
    """A Step request's columns as the journaled payload (what `StepInput.from_json` reads)."""
    payload: dict[str, Any] = {"scheduler_id": request.scheduler_id}
    if request.pool_epochs:
        payload["pool_epochs"] = dict(request.pool_epochs)
    if request.reports:
        payload["reports"] = [[r.pool_id, r.epoch, r.completed_up_to, r.failed_from] for r in request.reports]
    if request.free_seq_ids:
        payload["free"] = list(request.free_seq_ids)
    if request.alloc_seq_ids:
        alloc: dict[str, Any] = {
            "seq_ids": list(request.alloc_seq_ids),
            "pools": list(request.pool_ids),
            "salts": list(request.salts),
            "pool_index": list(request.alloc_pool_index),
            "salt_index": list(request.alloc_salt_index),
            "num_token_ids": list(request.alloc_num_token_ids),
            "token_ids": list(request.alloc_token_ids),
            "num_tokens": list(request.alloc_num_tokens),
            "num_compute": list(request.alloc_num_compute),
        }
        if request.alloc_place:
            alloc["place"] = [bool(x) for x in request.alloc_place]
            alloc["place_pools"] = list(request.place_pool_ids)
            alloc["admit_budget"] = int(request.admit_budget)
        payload["alloc"] = alloc
    if request.written_seq_ids:
        payload["written"] = _token_section(request.written_seq_ids, request.written_num_tokens,
                                            request.written_token_ids)
    if request.fork_parent_ids:
        payload["fork"] = {
            "parents": list(request.fork_parent_ids),
            "num_children": list(request.fork_num_children),
            "children": list(request.fork_child_ids),
        }
    if request.release_leases:
        payload["release"] = True
    if request.swap_out_seq_ids:
        payload["swap_out"] = list(request.swap_out_seq_ids)
    if request.swap_in_seq_ids:
        payload["swap_in"] = list(request.swap_in_seq_ids)
    if request.append_seq_ids:
        append = _token_section(request.append_seq_ids, request.append_num_tokens, request.append_token_ids)
        if request.append_num_late:
            append["num_late"] = list(request.append_num_late)
        payload["append"] = append
    if request.late_seq_ids:
        payload["late"] = _token_section(request.late_seq_ids, request.late_num_tokens, request.late_token_ids)
    return payload


def _token_section(seq_ids: Sequence[str], num_tokens: Sequence[int], token_ids: Sequence[int]) -> dict[str, list[Any]]:
    """A section of per-sequence token counts with their ids back to back, as journaled."""
    return {"seq_ids": list(seq_ids), "num_tokens": list(num_tokens), "token_ids": list(token_ids)}


__all__ = [
    "SECTIONS", "STEP_ANSWER_FORMAT", "STEP_REQUEST_FORMAT", "Alloc", "AppendColumns", "ReceivedStep", "Report",
    "StepInput", "pool_step_dict", "step_payload",
]
