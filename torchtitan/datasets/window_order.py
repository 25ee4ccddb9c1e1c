"""The order in which an epoch visits a store's windows: a seeded permutation, computed per index.

Depends on (number of windows, seed, epoch) only, so every rank, layout and resumed
run computes the same order without building or storing it.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["WindowPermutation"]


def _mix(x: np.ndarray) -> np.ndarray:
    # splitmix64 finalizer; uint64 arithmetic wraps, which is what we want.
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class WindowPermutation:
    """A seeded permutation of ``range(n)`` evaluated per index in O(1) time and memory.

    A balanced Feistel network over the smallest even number of bits covering
    ``n`` is a bijection; indices that land outside ``range(n)`` are walked
    through the network again until they land inside (cycle walking), which
    keeps it a bijection of ``range(n)``.  Nothing of size ``n`` is ever built,
    so a resume at window 10^9 costs what one at window 0 costs.
    """

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n = n
        bits = max(2, (max(n, 1) - 1).bit_length())
        bits += bits % 2
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8 * self.ROUNDS).digest()
        self.keys = [np.uint64(int.from_bytes(digest[8 * i : 8 * i + 8], "little")) for i in range(self.ROUNDS)]
        self._int_keys = [int(k) for k in self.keys]

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right

    def at(self, index: int) -> int:
        """The permuted position of one index (the same as ``self(np.array([index]))[0]``, without NumPy)."""
        return self._one(int(index))

    def _one(self, x: int) -> int:
        # The same network on Python ints: a step's few windows cost microseconds, not NumPy call overheads.
        half, mask, n = int(self.half), int(self.mask), self.n
        keys = self._int_keys
        while True:
            left, right = x >> half, x & mask
            for key in keys:
                z = right ^ key
                z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
                z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
                left, right = right, left ^ ((z ^ (z >> 31)) & mask)
            x = (left << half) | right
            if x < n:
                return x

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices)
        if indices.size <= 64:
            return np.array([self._one(int(i)) for i in indices.ravel()], dtype=np.int64).reshape(indices.shape)
        x = self._round_trip(indices.astype(np.uint64))
        outside = x >= np.uint64(self.n)
        while outside.any():
            x[outside] = self._round_trip(x[outside])
            outside = x >= np.uint64(self.n)
        return x.astype(np.int64)
