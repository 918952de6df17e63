"""The default task's rules: addition written out column by column.

Only numpy and the standard library: a process without the rest of rlflow
(a peer trainer in a virtual environment of its own, see `bench/peer.py`)
imports it to draw the same problems and score answers the same way.
"""

from __future__ import annotations

import numpy as np


class Arith:
    """Addition written out column by column, least significant column first.

    ``57+68=`` is answered ``7+8=15,5+6+1=12,#125``: one column per digit of
    the longer operand (``+1`` when a carry comes in), then ``#`` and the sum.
    The reward is 1 when the number after the last ``#`` is the sum. Harder
    items (more digits) need proportionally longer answers, and the number of
    digits is drawn from a skewed distribution, so response lengths have a
    long tail.

    Prompts are a pure function of (seed, group id); the held-out set is drawn
    from its own stream and never appears among training prompts.
    """

    name = "arith"
    #: Characters of the task's language (the tokenizer adds its special tokens).
    ALPHABET = "0123456789+=,#"

    def __init__(
        self, digit_weights: tuple[float, ...], seed: int = 0, heldout_size: int = 1000, heldout_seed: int = 1234
    ):
        weights = np.asarray(digit_weights, dtype=float)
        if weights.ndim != 1 or len(weights) == 0 or (weights < 0).any() or weights.sum() <= 0:
            raise ValueError(f"digit weights must be non-negative with a positive sum, got {digit_weights!r}")
        self.p = weights / weights.sum()
        self.max_digits = len(weights)
        self.seed = seed
        self.heldout = [self.problem(np.random.default_rng((heldout_seed, 1, i))) for i in range(heldout_size)]
        self._heldout_set = set(self.heldout)

    # -- problems -----------------------------------------------------------

    def problem(self, rng: np.random.Generator, digits: int | None = None) -> tuple[int, int]:
        """Two operands: the first has `digits` digits (drawn if None), the
        second between 1 and as many."""
        d = int(digits) if digits is not None else int(rng.choice(self.max_digits, p=self.p)) + 1
        e = int(rng.integers(1, d + 1))
        return _number(rng, d), _number(rng, e)

    def fresh_problem(self, rng: np.random.Generator, *, uniform_digits: bool = False) -> tuple[int, int]:
        """A problem that is not in the held-out set; `uniform_digits`: every
        number of digits equally likely (not the skewed task distribution)."""
        while True:
            digits = int(rng.integers(1, self.max_digits + 1)) if uniform_digits else None
            problem = self.problem(rng, digits)
            if problem not in self._heldout_set:
                return problem

    def training_problem(self, group_id: int) -> tuple[int, int]:
        """The problem of group `group_id` (never one of the held-out set)."""
        return self.fresh_problem(np.random.default_rng((self.seed, 2, group_id)))

    @staticmethod
    def prompt_text(a: int, b: int) -> str:
        return f"{a}+{b}="

    @staticmethod
    def solution(a: int, b: int) -> str:
        """The worked answer, as the model should write it."""
        xs, ys = str(a)[::-1], str(b)[::-1]
        columns, carry = [], 0
        for i in range(max(len(xs), len(ys))):
            x = int(xs[i]) if i < len(xs) else 0
            y = int(ys[i]) if i < len(ys) else 0
            total = x + y + carry
            columns.append(f"{x}+{y}" + ("+1" if carry else "") + f"={total}")
            carry = total // 10
        return ",".join(columns) + f",#{a + b}"

    @staticmethod
    def answer(text: str) -> int | None:
        """The number after the last ``#``, or None if there is none."""
        _, sep, tail = text.rpartition("#")
        if not sep:
            return None
        digits = tail.strip()
        return int(digits) if digits.isdigit() and len(digits) <= 40 else None

    @staticmethod
    def check(reference: str, text: str) -> tuple[float, dict[str, float]]:
        """Reward of `text` as an answer to a problem whose sum is `reference`."""
        got = Arith.answer(text)
        correct = float(got is not None and str(got) == reference)
        return correct, {"correct": correct, "formatted": float(got is not None)}


def _number(rng: np.random.Generator, digits: int) -> int:
    if digits == 1:
        return int(rng.integers(0, 10))
    return int(rng.integers(10 ** (digits - 1), 10**digits))
