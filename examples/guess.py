"""The environment of the README: guess a number from 1 to 100; the dataset row holds it.

    [roles.env]
    pool = "env"
    environment = { path = "guess:Guess" }
    max_turns = 7
"""

from rlflow.env import Step


class Guess:
    def reset(self, row):
        return "Guess my number, from 1 to 100. "

    def step(self, episode, turn):
        said, secret = turn.strip(), episode.row["secret"]
        if not said.isdigit():
            return Step("Say a number. ", 0.0, False)
        if int(said) == secret:
            return Step(None, 1.0, True)
        return Step("Higher. " if int(said) < secret else "Lower. ", 0.0, False)
