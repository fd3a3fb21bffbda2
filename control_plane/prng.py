"""A seeded pseudo-random generator for the simulator: the core's only source of "randomness".

SplitMix64 (Steele, Lea and Flood, 2014): a 64-bit state advanced by a fixed odd constant and mixed
by two multiply-xorshift rounds. The same seed gives the same sequence on every platform and Python
version, and nothing here reads the clock, the OS or a global generator, so a failing simulation
is reproduced from its printed seed alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_FLOAT_BITS = 53


class SeededRandom:
    """The subset of ``random.Random`` the simulator uses: ``random``, ``randrange``, ``randint``, ``choice``."""

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK64

    def _next(self) -> int:
        self._state = (self._state + _GOLDEN_GAMMA) & _MASK64
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def random(self) -> float:
        """A float in [0, 1) with 53 random bits."""
        return (self._next() >> (64 - _FLOAT_BITS)) / (1 << _FLOAT_BITS)

    def randrange(self, start: int, stop: int | None = None) -> int:
        """An int in [start, stop) (or [0, start) with one argument), without modulo bias."""
        if stop is None:
            start, stop = 0, start
        span = stop - start
        if span <= 0:
            raise ValueError(f"empty range [{start}, {stop})")
        if span > _MASK64:
            raise ValueError("range wider than 64 bits")
        limit = (_MASK64 + 1) - (_MASK64 + 1) % span  # reject the top partial bucket
        while True:
            x = self._next()
            if x < limit:
                return start + x % span

    def randint(self, a: int, b: int) -> int:
        """An int in [a, b], both ends included."""
        return self.randrange(a, b + 1)

    def choice(self, seq: Sequence[T]) -> T:
        if not seq:
            raise IndexError("choice from an empty sequence")
        return seq[self.randrange(len(seq))]
