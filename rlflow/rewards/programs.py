"""The built-in `code` reward: the response's program, run against the
dataset row's tests in the sandbox (`sandbox.py`); the reward is the share
of tests passed.

The program is the last fenced block marked ``python`` (or ``py``, or
unmarked) in the response, else the whole response. The tests are
``row[tests_key]`` (a JSON string of it is read too), one of:

* a list of ``{"input": str, "output": str}``: the program reads `input`
  on stdin and passes if its stdout equals `output`, line by line with
  trailing whitespace and blank lines at either end ignored;
* a list of strings, each a statement (``assert f(2) == 4``) run after the
  program: it passes if the run gets past it (an early ``sys.exit(0)`` in
  the program does not pass; a program that reads its own source to forge
  the end of the run could);
* ``{"inputs": [...], "outputs": [...]}``: the first form, as parallel lists.

Each test is one sandboxed run with the limits given as keywords. The
sandbox has no network unless ``network = true``; where it cannot isolate
a program, `code` does not start (its `prepare` raises with
`sandbox_problem`'s sentence).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from rlflow.rewards.core import Sample
from rlflow.sandbox import Limits, SandboxError, Status, check_isolation, run_python

_FENCE = re.compile(r"^```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)


def code(
    sample: Sample,
    *,
    tests_key: str = "tests",
    timeout_s: float = 5.0,
    cpu_s: float = 5.0,
    memory_bytes: int = 512 << 20,
    network: bool = False,
) -> tuple[float, dict[str, float]]:
    """Share of the row's tests that the response's program passes; parts
    ``passed`` and ``tests`` (counts). A row without tests is an error."""
    limits = Limits(timeout_s=timeout_s, cpu_s=cpu_s, memory_bytes=memory_bytes, network=network)
    program = extract_program(sample.response)
    tests = _tests(sample.row, tests_key)
    passed = 0
    for test in tests:
        if isinstance(test, str):
            # Passing means getting past the statement: a program that exits
            # early (`sys.exit(0)`) never prints the word, which it cannot know.
            word = secrets.token_hex(16)
            result = run_python(f"{program}\n\n{test}\nprint({word!r})\n", limits=limits)
            passed += result.status is Status.OK and result.stdout.rstrip().endswith(word)
        else:
            result = run_python(program, stdin=test[0], limits=limits)
            passed += result.status is Status.OK and _lines(result.stdout) == _lines(test[1])
    return passed / len(tests), {"passed": float(passed), "tests": float(len(tests))}


def sandbox_problem(*, network: bool = False, **_: Any) -> str | None:
    """None if `code` can run its programs here with these keywords (by
    default: in a sandbox without network); else a sentence saying why not,
    for the launcher to refuse the run with."""
    problem = check_isolation(Limits(network=network))
    if problem is None:
        return None
    if not network and check_isolation(Limits(network=True)) is None:
        problem += (
            "; the sandbox works here without a network namespace of its own: to let programs reach "
            "the host's network, set network = true in the code reward's kwargs"
        )
    return f"the code reward cannot sandbox programs here: {problem}"


def _prepare(
    *,
    tests_key: str = "tests",
    timeout_s: float = 5.0,
    cpu_s: float = 5.0,
    memory_bytes: int = 512 << 20,
    network: bool = False,
) -> None:
    Limits(timeout_s=timeout_s, cpu_s=cpu_s, memory_bytes=memory_bytes, network=network)  # bad limits stop the start
    problem = sandbox_problem(network=network)
    if problem is not None:
        raise SandboxError(problem)


def _render(reference: str, **_: Any) -> str:
    return f"```python\n{reference}\n```"


code.prepare = _prepare  # type: ignore[attr-defined]
code.reference_response = _render  # type: ignore[attr-defined]


def extract_program(response: str) -> str:
    """The last fenced python (or unmarked) block of `response`, else all of it."""
    blocks = [
        body for language, body in _FENCE.findall(response) if language.lower() in ("", "python", "py", "python3")
    ]
    return blocks[-1] if blocks else response


def _tests(row: dict[str, Any], key: str) -> list[str | tuple[str, str]]:
    if key not in row:
        raise ValueError(f"the row has no tests under {key!r} (its keys: {', '.join(sorted(row)) or 'none'})")
    tests = row[key]
    if isinstance(tests, str):
        tests = json.loads(tests)
    if isinstance(tests, dict) and set(tests) >= {"inputs", "outputs"}:
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"], strict=True)]
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"row[{key!r}] must be a non-empty list of tests, got {str(tests)[:100]!r}")
    out: list[str | tuple[str, str]] = []
    for test in tests:
        if isinstance(test, str):
            out.append(test)
        elif isinstance(test, dict) and isinstance(test.get("input"), str) and isinstance(test.get("output"), str):
            out.append((test["input"], test["output"]))
        else:
            raise ValueError(
                f"a test in row[{key!r}] is neither a statement nor {{'input': str, 'output': str}}: "
                f"{str(test)[:100]!r}"
            )
    return out


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]
