"""Built-in rewards that read the response's text: `math` (the answer,
compared with math-verify), `exact` (normalised string equality) and
`regex` (a format check).

`math` and `exact` first take the answer out of the response, as their
``extract`` keyword says:

* ``"boxed"``: the content of the last ``\\boxed{...}`` (braces balanced);
* ``"last_number"``: the last number (``-1,234.5`` or ``3/4``);
* ``"marker"``: the rest of the line after the last ``marker`` (``"####"``
  by default, as in GSM8K);
* ``"none"``: the whole response (for `math`: math-verify's own search
  through it).

A response with nothing to extract scores 0, with the part ``extracted``
at 0 (it is 1 otherwise): a format failure shows in the logs, apart from a
wrong answer.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import math_verify
from math_verify.errors import TimeoutException

from rlflow.rewards.core import Sample

EXTRACTIONS = ("boxed", "last_number", "marker", "none")

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_answer(text: str, extract: str = "boxed", marker: str = "####") -> str | None:
    """The answer in `text` by `extract` (see the module docstring), or None."""
    match extract:
        case "boxed":
            return _last_boxed(text)
        case "last_number":
            numbers = _NUMBER.findall(text)
            return numbers[-1].replace(",", "").replace(" ", "") if numbers else None
        case "marker":
            if not marker or marker not in text:
                return None
            answer = text.rsplit(marker, 1)[1].strip().split("\n", 1)[0].strip()
            return answer or None
        case "none":
            return text.strip() or None
    raise ValueError(f"extract must be one of {', '.join(EXTRACTIONS)}; got {extract!r}")


def render_answer(answer: str, extract: str = "boxed", marker: str = "####") -> str:
    """A response from which `extract_answer` takes `answer`."""
    match extract:
        case "boxed":
            return f"The answer is \\boxed{{{answer}}}."
        case "marker":
            return f"{marker} {answer}"
    return answer


def math(
    sample: Sample, *, extract: str = "boxed", marker: str = "####", timeout_s: int = 5
) -> tuple[float, dict[str, float]]:
    """1 if the answer in the response equals `sample.reference` as
    math-verify compares them (``1/2``, ``0.5`` and ``\\frac{1}{2}`` agree),
    else 0. The reference is read as LaTeX math (``$...$``); one that
    math-verify cannot read as math is an error. `timeout_s` bounds each of
    math-verify's parses and comparisons (whole seconds, by `signal.alarm`;
    the pool's timeout bounds the call); past it the call is a TIMEOUT, not
    a 0."""
    gold = _parse_reference(sample.reference, timeout_s)
    answer = extract_answer(sample.response, extract, marker)
    if answer is None:
        return 0.0, {"extracted": 0.0}
    try:
        if extract == "none":
            target = math_verify.parse(answer, parsing_timeout=timeout_s, raise_on_error=True)
        else:
            target = _parse(answer, timeout_s)
        right = bool(target) and math_verify.verify(gold, target, timeout_seconds=timeout_s, raise_on_error=True)
    except TimeoutException as error:
        raise TimeoutError(f"math-verify took longer than timeout_s = {timeout_s} s: {error}") from None
    return float(right), {"extracted": 1.0}


def _prepare_math(*, extract: str = "boxed", marker: str = "####", timeout_s: int = 5) -> None:
    _check_extract(extract, marker)
    if not isinstance(timeout_s, int) or timeout_s < 1:
        raise ValueError(f"math: timeout_s must be a whole number of seconds >= 1 (signal.alarm), got {timeout_s!r}")


def _render_math(reference: str, *, extract: str = "boxed", marker: str = "####", **_: Any) -> str:
    return render_answer(reference, extract, marker)


math.prepare = _prepare_math  # type: ignore[attr-defined]
math.reference_response = _render_math  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=4096)
def _parse_reference(reference: str, timeout_s: int) -> list[Any]:
    # The samples of a group share their reference: parse it once.
    try:
        gold = _parse(reference, timeout_s)
    except TimeoutException:
        raise TimeoutError(f"math-verify took longer than timeout_s = {timeout_s} s to parse the reference") from None
    if all(isinstance(value, str) for value in gold):
        # Nothing but math-verify's fallback to the text itself.
        raise ValueError(f"math-verify cannot parse the reference answer {reference!r} as math")
    return gold


def _parse(answer: str, timeout_s: int) -> list[Any]:
    # An extracted answer is one expression: read it as LaTeX math, which
    # also reads plain numbers and fractions.
    return math_verify.parse(f"${answer}$", parsing_timeout=timeout_s, raise_on_error=True)


def exact(
    sample: Sample,
    *,
    extract: str = "none",
    marker: str = "####",
    ignore_case: bool = False,
    whitespace: str = "collapse",
) -> tuple[float, dict[str, float]]:
    """1 if the answer in the response equals `sample.reference` after
    normalising both, else 0. `whitespace`: "strip" (ends only), "collapse"
    (also runs of whitespace inside to one space) or "ignore" (all removed)."""
    answer = extract_answer(sample.response, extract, marker)
    if answer is None:
        return 0.0, {"extracted": 0.0}
    same = _normal(answer, ignore_case, whitespace) == _normal(sample.reference, ignore_case, whitespace)
    return float(same), {"extracted": 1.0}


def _prepare_exact(
    *, extract: str = "none", marker: str = "####", ignore_case: bool = False, whitespace: str = "collapse"
) -> None:
    _check_extract(extract, marker)
    if whitespace not in ("strip", "collapse", "ignore"):
        raise ValueError(f"exact: whitespace must be strip, collapse or ignore; got {whitespace!r}")


def _render_exact(reference: str, *, extract: str = "none", marker: str = "####", **_: Any) -> str:
    return render_answer(reference, extract, marker)


exact.prepare = _prepare_exact  # type: ignore[attr-defined]
exact.reference_response = _render_exact  # type: ignore[attr-defined]


def _normal(text: str, ignore_case: bool, whitespace: str) -> str:
    text = text.strip()
    if whitespace == "collapse":
        text = " ".join(text.split())
    elif whitespace == "ignore":
        text = "".join(text.split())
    return text.casefold() if ignore_case else text


def regex(sample: Sample, *, pattern: str, full: bool = False) -> float:
    """1 if the response matches `pattern` (Python syntax; flags inline,
    e.g. ``(?s)``), else 0: a format check. `full`: the whole response must
    match, not just some part of it."""
    compiled = _compile(pattern)
    found = compiled.fullmatch(sample.response) if full else compiled.search(sample.response)
    return float(found is not None)


def _prepare_regex(*, pattern: str, full: bool = False) -> None:
    _compile(pattern)  # a bad pattern stops the start, not every call


regex.prepare = _prepare_regex  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=64)
def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def _check_extract(extract: str, marker: str) -> None:
    if extract not in EXTRACTIONS:
        raise ValueError(f"extract must be one of {', '.join(EXTRACTIONS)}; got {extract!r}")
    if extract == "marker" and not marker:
        raise ValueError('extract = "marker" needs a non-empty marker')


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} or \\fbox{...}, braces
    balanced; None if it is empty or never closes (a cut-off response does
    not fall back to an earlier box)."""
    starts = [match.end() for match in _BOXED.finditer(text)]
    if not starts:
        return None
    depth = 1
    for i in range(starts[-1], len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[starts[-1] : i].strip() or None
    return None
