"""A synthetic attention "model" whose K/V are a pure function of the token prefix.

Prefix caching only makes sense if the K/V of a token depend on nothing but the tokens before
it (and the tenant's salt): then a block computed by one request is exactly what a later
request with the same prefix would compute, and reusing it is correct. This module gives the
workload driver such a model, cheaply and vectorised:

- `PrefixHasher` keeps a chained 64-bit hash per position (`h[p] = mix(h[p-1], token[p])`,
  seeded by the salt), so a forked child inherits its parent's hashes and diverges after;
- `SyntheticModel.kv(hashes)` maps position hashes to K and V `[L, n, kv_heads, head_dim]`
  through fixed random frequencies (`sin(2π(u·f + φ))` with `u` the hash as a fraction), so
  distinct prefixes give distinct, well-spread vectors; values are rounded to the pool dtype
  once, so the reference sees exactly the bytes the pool holds;
- `reference_attention` is the float64 dense causal attention the driver checks the compute
  node's paged outputs against.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-distributed 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def salt_seed(salt: str | None) -> int:
    digest = hashlib.blake2b((salt or "").encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def extend_hashes(hashes: list[int], token_ids: Sequence[int], salt: str | None) -> None:
    """Append the chained hash of each new token to `hashes` (in place)."""
    h = hashes[-1] if hashes else salt_seed(salt)
    for t in token_ids:
        h = _mix(h ^ ((int(t) * 0x100000001B3) & _MASK))
        hashes.append(h)


@dataclass
class SyntheticModel:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str = "float16"
    seed: int = 0
    # Queries are scaled up so softmax is far from uniform (a real check of the max/rescale).
    query_scale: float = 4.0

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        width = self.num_layers * self.num_kv_heads * self.head_dim
        self._freq = rng.uniform(1.0, 4096.0, size=(2, width))
        self._phase = rng.uniform(0.0, 1.0, size=(2, width))
        self._rng = np.random.default_rng(self.seed + 1)

    @property
    def scale(self) -> float:
        return 1.0 / float(np.sqrt(self.head_dim))

    def kv(self, hashes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """K and V `[num_layers, n, num_kv_heads, head_dim]` in the pool dtype."""
        n = len(hashes)
        u = (np.asarray(hashes, dtype=np.uint64) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        out = []
        for i in range(2):
            x = np.sin(2 * np.pi * (u[:, None] * self._freq[i][None, :] + self._phase[i][None, :]))
            x = x.reshape(n, self.num_layers, self.num_kv_heads, self.head_dim).transpose(1, 0, 2, 3)
            out.append(np.ascontiguousarray(x.astype(self.kv_dtype)))
        return out[0], out[1]

    def queries(self, n: int) -> np.ndarray:
        """Random queries `[num_layers, n, num_heads, head_dim]` (float32)."""
        q = self._rng.standard_normal((self.num_layers, n, self.num_heads, self.head_dim))
        return (self.query_scale * q).astype(np.float32)


def reference_attention(query: np.ndarray, key: np.ndarray, value: np.ndarray, scale: float) -> np.ndarray:
    """Dense causal attention in float64 for the LAST `q_len` positions of a context.

    query `[q_len, num_heads, head_dim]`; key/value `[ctx, num_kv_heads, head_dim]` (the whole
    context, new tokens included). Returns `[q_len, num_heads, head_dim]` float64.
    """
    q_len, num_heads, _ = query.shape
    ctx, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    q = query.astype(np.float64)
    k = np.repeat(key.astype(np.float64), group, axis=1)       # [ctx, heads, d]
    v = np.repeat(value.astype(np.float64), group, axis=1)
    logits = np.einsum("qhd,khd->hqk", q, k) * scale           # [heads, q_len, ctx]
    pos_q = np.arange(ctx - q_len, ctx)[:, None]
    mask = np.arange(ctx)[None, :] > pos_q                     # causal: key after the query
    logits[:, mask] = -np.inf
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)
