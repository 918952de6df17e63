"""`SecondTry`: the embedded default's addition, with a second try.

The prompt is the problem (``57+68=``), as in the `arith` task. A right
answer ends the episode with reward 1. A wrong one is answered with the
problem and the worked columns written right up to the first column the
model got wrong (``57+68=7+8=15,5+6+1=12,``): the model's second turn goes
on from there, and a right answer then earns `second_reward`. Text only:
it speaks the default model's alphabet (whose chat template writes text alone).
"""

from __future__ import annotations

from typing import Any

from rlflow.env.core import Episode, Step
from rlflow.tasks.arith import Arith


class SecondTry:
    """Two tries at an addition; the second starts from the columns marked right."""

    def __init__(self, *, second_reward: float = 0.5):
        self.second_reward = second_reward

    def reset(self, row: dict[str, Any]) -> str:
        return Arith.prompt_text(row["a"], row["b"])

    def step(self, episode: Episode, turn: str) -> Step:
        a, b = episode.row["a"], episode.row["b"]
        if Arith.answer(turn) == a + b:
            return Step(None, 1.0 if episode.turn == 1 else self.second_reward, True)
        if episode.turn >= 2:
            return Step(None, 0.0, True)
        return Step(hint(a, b, turn), 0.0, False)

    def reference_turns(self, row: dict[str, Any]) -> list[str]:
        """A play that shows both turns: a first answer whose first column is wrong, then the rest of
        the solution after the hint (it earns `second_reward`)."""
        a, b = row["a"], row["b"]
        columns = Arith.solution(a, b).split(",")
        x, _, total = columns[0].partition("=")
        wrong = ",".join([f"{x}={(int(total) + 1) % 19}", *columns[1:-1], f"#{a + b + 1}"])
        return [wrong, ",".join(columns[len(hint(a, b, wrong).split(",")) - 1:])]


def hint(a: int, b: int, answer: str) -> str:
    """The problem and its columns, written right up to the first one `answer` got wrong."""
    right = Arith.solution(a, b).split(",")[:-1]  # the columns, without the "#sum"
    given = answer.split(",")
    wrong = next((i for i, column in enumerate(right) if i >= len(given) or given[i] != column), len(right) - 1)
    return Arith.prompt_text(a, b) + ",".join(right[: wrong + 1]) + ","
