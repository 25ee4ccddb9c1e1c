"""Which source each sample of a weighted mixture comes from: a deterministic, exact interleave.

A mixture of ``m`` sources with weights ``w_i`` (normalized to shares ``p_i``, summing to 1)
fills sample slots ``0, 1, 2, ...`` one at a time. After ``n`` slots source ``i`` has
given ``c_i(n)`` samples, and its *lag* is ``n * p_i - c_i(n)``. The interleave keeps every
lag strictly inside ``(-1, 1)`` after every slot: at every step each source is less than one
window away from its exact share, whatever the weights and however many sources.

How. Source ``i``'s ``k``-th sample (``k = c_i + 1``) may go no earlier than slot
``floor((k - 1) / p_i)`` and no later than slot ``ceil(k / p_i) - 1``. Filling each slot with
the released sample of the earliest deadline (ties: the lower source index) meets every
deadline, because the shares sum to 1 and earliest-deadline-first is optimal for unit jobs on
one machine (a "Pfair" schedule, Baruah et al. 1996). Random sampling by weight would drift by
about ``sqrt(n)`` samples instead. A simpler "largest deficit first" rule (smooth weighted
round-robin) can drift past one sample with many sources, which the tests show.

State and cost. The choice at slot ``n`` depends on the counts ``c_i`` alone (``n`` is their
sum), so the counts are the whole state: a resume loads them and goes on in O(1). Weights are
turned into exact integers first (``0.7`` is ``7/10``), so no float rounding ever differs
between machines. After ``W`` slots (the integer weights' sum) every lag is 0 again and the
pattern repeats: one period, held as a table, gives any slot's source and sample number and
the counts at any slot by arithmetic (``slots``, ``counts_at``), so a rank computes only its
own slots of a global batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

__all__ = ["Interleave", "integer_weights"]

# Periods up to this many slots are held as a table (a few MB at most), which makes a slot's source and
# sample number arithmetic; a longer period (weights with many digits) is walked slot by slot.
TABLE_LIMIT = 1 << 16


def integer_weights(weights: Sequence[float]) -> tuple[int, ...]:
    """The weights as exact integers of the same ratios: each float is read as the decimal it prints as."""
    if not weights:
        raise ValueError("a mixture needs at least one source")
    fractions = []
    for w in weights:
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0):
            raise ValueError(f"weight {w!r}: give a positive finite number")
        fractions.append(Fraction(repr(float(w))))
    scale = math.lcm(*(f.denominator for f in fractions))
    ints = [int(f * scale) for f in fractions]
    common = math.gcd(*ints)
    return tuple(i // common for i in ints)


class Interleave:
    """The slot-by-slot source order of a mixture; ``next_source(counts)`` is the whole rule."""

    def __init__(self, weights: Sequence[float]) -> None:
        self.weights = integer_weights(weights)
        self.period = sum(self.weights)  # W: after W slots every source has had exactly its weight
        self._table: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # one period, built on first use
        self._cursor: tuple[int, list[int]] = (0, [0] * len(self.weights))  # a long period's last known state

    def next_source(self, counts: Sequence[int]) -> int:
        """The source of the next slot, given how many samples each source has given so far."""
        slot, total = sum(counts), self.period
        best, best_deadline = -1, 0
        for i, (w, c) in enumerate(zip(self.weights, counts)):
            # Sample c+1 of source i: released at slot floor(c*W/w), due before slot ceil((c+1)*W/w).
            if (c * total) // w > slot:
                continue
            deadline = -((-(c + 1) * total) // w)
            if best < 0 or deadline < best_deadline:
                best, best_deadline = i, deadline
        if best < 0:  # cannot happen while the shares sum to 1; a loud stop beats a silent skew
            raise AssertionError(f"interleave: no source released at slot {slot} (counts {list(counts)})")
        return best

    def take(self, counts: list[int], n: int) -> list[tuple[int, int]]:
        """The next ``n`` slots as (source, that source's sample number); advances ``counts`` in place."""
        out = []
        for _ in range(n):
            i = self.next_source(counts)
            out.append((i, counts[i]))
            counts[i] += 1
        return out

    def _pattern(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """One period as arrays: each slot's source, its sample number within the period, and the counts
        before each slot (``W + 1`` rows); None when the period is too long to hold."""
        if self._table is None and self.period <= TABLE_LIMIT:
            slots = self.take([0] * len(self.weights), self.period)
            source = np.array([i for i, _ in slots], dtype=np.int64)
            number = np.array([c for _, c in slots], dtype=np.int64)
            before = np.zeros((self.period + 1, len(self.weights)), dtype=np.int64)
            before[np.arange(1, self.period + 1), source] = 1
            self._table = (source, number, np.cumsum(before, axis=0))
        return self._table

    def slots(self, start: int, n: int) -> list[tuple[int, int]]:
        """Slots ``[start, start + n)`` as (source, that source's sample number), O(n) wherever they lie.

        A rank asks for its own slots of a global batch only, so its cost does not grow with the DP degree.
        """
        table = self._pattern()
        if table is None:  # a very long period: walk from the nearest known state
            counts = self.counts_at(start)
            return self.take(counts, n)
        source, number, _ = table
        out = []
        for k in range(start, start + n):
            q, r = divmod(k, self.period)
            i = int(source[r])
            out.append((i, q * self.weights[i] + int(number[r])))
        return out

    def counts_at(self, n: int) -> list[int]:
        """The counts after the first ``n`` slots, however large ``n`` is (the pattern repeats every W slots)."""
        periods, rest = divmod(n, self.period)
        table = self._pattern()
        if table is not None:
            return [periods * w + int(c) for w, c in zip(self.weights, table[2][rest])]
        start, counts = self._cursor if self._cursor[0] <= rest else (0, [0] * len(self.weights))
        counts = list(counts)
        self.take(counts, rest - start)
        self._cursor = (rest, list(counts))  # reads go forward: the next walk starts here
        return [periods * w + c for w, c in zip(self.weights, counts)]

    def lags(self, counts: Sequence[int]) -> list[float]:
        """Each source's exact share of the slots so far minus what it gave, in samples (always in (-1, 1))."""
        n = sum(counts)
        return [float(Fraction(n * w, self.period) - c) for w, c in zip(self.weights, counts)]
