"""Per-sequence state, kept in one slotted object so the batched append touches a few
attributes per sequence and allocates nothing when a token stays inside the last block."""

from __future__ import annotations

from dataclasses import dataclass, field

from block_manager.core.hashing import BlockHash

from .types import PoolId, SeqId, SequenceView


@dataclass(slots=True)
class Sequence:
    """One generation stream pinned to one pool.

    `block_hashes[i]` is the chained hash of logical block i; it is kept for every full
    block while `hashing` is on (even when another physical block owns that hash in the
    prefix index) because the next block's hash chains from it. `tail_token_ids` holds
    the tokens of the partial last block, the only content still needed to hash it once
    it fills up. `hashing` turns off for good when an append arrives without token ids.
    `last_write_step` is the last step that gave it tokens to write; while that step is still
    open the sequence cannot be freed (its writes, which forks and prefix hits of this step may
    share, would never happen). `last_step` is the last step that created it or changed its
    table. A failure of either step leaves the sequence inconsistent on its node, so it is
    dropped then (`last_touched_step`). Two fields so the hot in-block append stores one.
    """

    seq_id: SeqId
    pool_id: PoolId
    block_table: list[int]
    num_tokens: int
    version: int
    salt: str | None
    hashing: bool
    tail_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    last_step: int = 0        # see the class docstring (steps.py)
    last_write_step: int = 0

    @property
    def last_touched_step(self) -> int:
        """The last step whose failed Forward would leave the sequence inconsistent."""
        return max(self.last_step, self.last_write_step)

    def view(self) -> SequenceView:
        return SequenceView(
            self.seq_id, self.pool_id, tuple(self.block_table), self.num_tokens, self.version
        )
