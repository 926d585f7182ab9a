"""Counter-based seeds, torch-free: the engine derives its sequences' seeds with the very
function the nodes' sampler uses, without importing the model stack.

A seeded sequence's k-th draw is `uniform(seed, k)` on the node; a request with `n > 1`
completions gives completion i the seed `derive_seed(seed, i)`.
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1


def derive_seed(seed: int, child_index: int) -> int:
    """The seed of parallel sample `child_index` (n > 1) of a request seeded with `seed`.

    Child 0 keeps `seed` itself, so `n=1` and the first of `n=k` draw the same tokens; child i > 0
    gets a 64-bit mix of (seed, i), so siblings are independent streams.
    """
    if child_index < 0:
        raise ValueError(f"child_index must be >= 0, got {child_index}")
    if child_index == 0:
        return seed
    return mix64(splitmix64(seed & MASK64) ^ 0x6A09E667F3BCC909, child_index)


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def mix64(a: int, b: int) -> int:
    """A 64-bit hash of the pair (a, b), both taken modulo 2**64."""
    return splitmix64(splitmix64(a & MASK64) ^ (b & MASK64))


__all__ = ["MASK64", "derive_seed", "mix64", "splitmix64"]
