"""Write the example data files of this folder (no downloads).

    python examples/data/make.py

* ``arith.jsonl``: the default task's training problems as a dataset, one
  row per problem: ``prompt`` (``57+68=``), ``answer`` (``125``) and
  ``digits``; ``arith-eval.jsonl``: its 1,000 held-out problems, the same the
  built-in task evaluates on.
* ``code.jsonl``: small programming problems, each with stdin/stdout tests and
  a reference ``solution`` (a program that passes them).
* ``tools.jsonl``: arithmetic questions (``What is 37*41?``) and their
  ``answer``, for a chat model that calls the ``python`` tool.

The files are committed; this script says how they were made.
"""

from __future__ import annotations

import json
import pathlib
import random

HERE = pathlib.Path(__file__).resolve().parent

#: (problem, [(stdin, stdout), ...], a right program) of the programming problems.
PROBLEMS = [
    ("Read two integers on one line and print their sum.", [("1 2", "3"), ("-5 5", "0"), ("100 23", "123")],
     "a, b = map(int, input().split())\nprint(a + b)"),
    ("Read an integer n and print n squared.", [("3", "9"), ("-4", "16"), ("0", "0")],
     "n = int(input())\nprint(n * n)"),
    ("Read a line and print it reversed.", [("abc", "cba"), ("racecar", "racecar"), ("ab cd", "dc ba")],
     "print(input()[::-1])"),
    ("Read an integer n and print the sum 1 + 2 + ... + n.", [("1", "1"), ("10", "55"), ("100", "5050")],
     "n = int(input())\nprint(n * (n + 1) // 2)"),
    ("Read a line of words and print how many words it has.", [("a b c", "3"), ("hello", "1"), ("x  y", "2")],
     "print(len(input().split()))"),
    ("Read an integer and print 'even' or 'odd'.", [("2", "even"), ("7", "odd"), ("0", "even")],
     "print('even' if int(input()) % 2 == 0 else 'odd')"),
    ("Read integers on one line and print the largest.", [("1 5 3", "5"), ("-1 -7", "-1"), ("42", "42")],
     "print(max(map(int, input().split())))"),
    ("Read a line and print it in upper case.", [("abc", "ABC"), ("Hi There", "HI THERE"), ("1a", "1A")],
     "print(input().upper())"),
    ("Read an integer n and print n factorial.", [("0", "1"), ("5", "120"), ("10", "3628800")],
     "import math\nprint(math.factorial(int(input())))"),
    ("Read a line and print 'yes' if it is a palindrome, else 'no'.", [("abba", "yes"), ("abc", "no"), ("a", "yes")],
     "s = input()\nprint('yes' if s == s[::-1] else 'no')"),
    ("Read an integer n and print the n-th Fibonacci number (F(0) = 0, F(1) = 1).",
     [("0", "0"), ("1", "1"), ("10", "55")],
     "a, b = 0, 1\nfor _ in range(int(input())):\n    a, b = b, a + b\nprint(a)"),
    ("Read integers on one line and print them sorted, separated by spaces.",
     [("3 1 2", "1 2 3"), ("5", "5"), ("2 2 1", "1 2 2")],
     "print(' '.join(map(str, sorted(map(int, input().split())))))"),
]


def main() -> None:
    from rlflow.config import ArithTask
    from rlflow.tasks.arith import Arith

    cfg = ArithTask()
    arith = Arith(cfg.digit_weights, seed=0, heldout_size=cfg.heldout_size, heldout_seed=cfg.heldout_seed)
    with open(HERE / "arith.jsonl", "w") as f:
        for group_id in range(8000):
            a, b = arith.training_problem(group_id)
            f.write(json.dumps({"prompt": Arith.prompt_text(a, b), "answer": str(a + b), "digits": len(str(a))}) + "\n")
    with open(HERE / "arith-eval.jsonl", "w") as f:
        for a, b in arith.heldout:
            f.write(json.dumps({"prompt": Arith.prompt_text(a, b), "answer": str(a + b), "digits": len(str(a))}) + "\n")
    with open(HERE / "code.jsonl", "w") as f:
        for problem, tests, solution in PROBLEMS:
            row = {"prompt": problem, "tests": [{"input": i, "output": o} for i, o in tests], "solution": solution}
            f.write(json.dumps(row) + "\n")
    rng = random.Random(0)
    with open(HERE / "tools.jsonl", "w") as f:
        for _ in range(500):
            a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
            answer = {"+": a + b, "-": a - b, "*": a * b}[op]
            f.write(json.dumps({"prompt": f"What is {a}{op}{b}?", "answer": str(answer)}) + "\n")


if __name__ == "__main__":
    main()
