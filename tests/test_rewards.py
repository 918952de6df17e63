"""Reward functions and the pool that runs them: the built-ins against
known answers, and the pool against real worker processes whose functions
hang, crash, raise and return garbage. Nothing of what is tested is mocked.

The user functions live in a module written to a temporary directory on
sys.path, as a user's would; workers import it from there."""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
import trio

from rlflow.rewards import (
    FunctionSpec,
    PoolError,
    RewardFunctionError,
    Sample,
    Scored,
    Status,
    check_references,
    check_specs,
    combine,
    load_function,
    open_pool,
)
from rlflow.sandbox import check_isolation

#: The README's example, verbatim: what a user copies.
README_EXAMPLE = """\
# my_rewards.py
from rlflow.rewards import Sample

def brevity(sample: Sample, *, limit: int = 200) -> tuple[float, dict[str, float]]:
    over = max(0, len(sample.response_ids) - limit)
    return 1.0 / (1 + over / limit), {"over_tokens": float(over)}

async def judge(sample: Sample) -> float:  # async works too
    return float("because" in sample.response)
"""

USER_MODULE = README_EXAMPLE + textwrap.dedent(
    '''
    import asyncio
    import ctypes
    import os
    import subprocess
    import time

    NOT_CALLABLE = 3


    def echo(sample, *, scale=1.0):
        return sample.row["x"] * scale, {"chars": float(len(sample.response))}


    async def async_echo(sample):
        await asyncio.sleep(0.001)
        return float(sample.row["x"])


    def pid(sample):
        """This worker's pid, unless the prompt asks for trouble."""
        match sample.prompt:
            case "spin":
                print("spinning", flush=True)  # a worker's stdout is its stderr
                while True:
                    pass
            case "sleep":
                time.sleep(3600)
            case "segfault":
                ctypes.string_at(0)
            case "exit":
                os._exit(7)
            case "raise":
                raise ValueError("asked to raise")
            case "nan":
                return float("nan")
            case "text":
                return "1.0"
            case "inf part":
                return 1.0, {"p": float("inf")}
            case "child":
                return float(subprocess.Popen(["sleep", "60"]).pid)
        return float(os.getpid())


    def batch_size(samples):
        return [(float(s.row["x"]), {"batch": float(len(samples))}) for s in samples]

    batch_size.batched = True


    def wrong_length(samples):
        return [1.0]

    wrong_length.batched = True


    def scored_by_model(samples, **kwargs):
        from rlflow.rewards import reward_model
        return [(v, {"batch": float(len(samples))}) for v in reward_model(samples, **kwargs)]

    scored_by_model.batched = True
    scored_by_model.prepare = lambda **kwargs: __import__("rlflow.rewards").rewards.reward_model.prepare(**kwargs)


    def never_right(sample):
        return 0.0

    never_right.reference_response = lambda reference: reference


    def cannot_prepare(sample):
        return 1.0

    def _fail(**kwargs):
        raise RuntimeError("no model here")

    cannot_prepare.prepare = _fail
    '''
)

SANDBOX = check_isolation()
needs_sandbox = pytest.mark.skipif(SANDBOX is not None, reason=f"no sandbox on this machine: {SANDBOX}")


@pytest.fixture(scope="session")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("user")
    (directory / "user_rewards.py").write_text(USER_MODULE)
    (directory / "user_broken.py").write_text("raise RuntimeError('this module does not import')\n")
    return str(directory)


@pytest.fixture(autouse=True)
def user_path(user_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(user_dir)


def spec(path: str, **fields) -> FunctionSpec:
    return FunctionSpec(path=path, **{"workers": 1, **fields})


def sample(response: str = "", reference: str = "", prompt: str = "p", **row) -> Sample:
    return Sample(prompt=prompt, response=response, reference=reference, row=row)


def alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def gone(pids: list[int]) -> bool:
    """Whether `pids` all end within a few seconds: a process sent SIGKILL
    is gone within moments, but not at the instant the signal is sent."""
    for _ in range(100):
        if not any(alive(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


# -- the contract -------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "kwargs", "says"),
    [
        ("user_rewards.echo", {}, "expected an import path"),
        ("no_such_module_here:f", {}, "cannot import module 'no_such_module_here': ModuleNotFoundError"),
        ("user_broken:f", {}, "cannot import module 'user_broken': RuntimeError: this module does not import"),
        ("user_rewards:missing", {}, "'user_rewards' has no attribute 'missing'"),
        ("user_rewards:echo.nested", {}, "'user_rewards.echo' has no attribute 'nested'"),
        ("user_rewards:NOT_CALLABLE", {}, "is not callable: it is a int"),
        ("user_rewards:echo", {"sclae": 2}, "cannot be called as echo(sample, **kwargs) with sclae"),
        ("user_rewards:batch_size", {"scale": 2}, "cannot be called as batch_size(sample, **kwargs) with scale"),
    ],
)
def test_load_function_names_the_path_and_what_is_wrong(path, kwargs, says):
    with pytest.raises(RewardFunctionError) as caught:
        load_function(path, kwargs)
    assert repr(path) in str(caught.value)
    assert says in str(caught.value)


def test_builtins_load_by_path():
    import rlflow.rewards as rewards
    from rlflow.rewards import model, programs, text

    assert load_function("rlflow.rewards:math") is text.math is rewards.math
    assert load_function("rlflow.rewards:exact", {"ignore_case": True}) is text.exact
    assert load_function("rlflow.rewards:regex", {"pattern": "x"}) is text.regex
    assert load_function("rlflow.rewards:code") is programs.code
    assert load_function("rlflow.rewards:reward_model", {"model": "/m"}) is model.reward_model


def test_spec_defaults_and_checks():
    assert spec("rlflow.rewards:math").name == "math"
    assert spec("pkg.mod:Scorer.score").name == "score"
    assert msgspec.convert({"path": "a:b", "weight": 2}, FunctionSpec) == FunctionSpec(path="a:b", weight=2.0)
    with pytest.raises(msgspec.ValidationError, match="unknown field `wieght`"):
        msgspec.convert({"path": "a:b", "wieght": 2}, FunctionSpec)
    with pytest.raises(ValueError, match="must look like"):
        FunctionSpec(path="a.b")
    with pytest.raises(ValueError, match="must not contain '.'"):
        FunctionSpec(path="a:b", name="b.c")
    with pytest.raises(ValueError, match="weight .* must be finite"):
        FunctionSpec(path="a:b", weight=math.nan)
    with pytest.raises(ValueError, match="workers .* must be >= 1"):
        FunctionSpec(path="a:b", workers=0)
    with pytest.raises(ValueError, match=r"two reward functions are named 'b' \(a:b and c:b\)"):
        check_specs([FunctionSpec(path="a:b"), FunctionSpec(path="c:b")])
    check_specs([FunctionSpec(path="a:b"), FunctionSpec(path="c:b", name="b2")])


def test_combine_weights_parts_and_failures():
    specs = [FunctionSpec(path="m:acc", weight=1.0), FunctionSpec(path="m:fmt", weight=0.5), spec("m:log", weight=0)]
    ok = [
        Scored(function="acc", status=Status.OK, value=1.0, parts={"extracted": 1.0}),
        Scored(function="fmt", status=Status.OK, value=0.4),
        Scored(function="log", status=Status.OK, value=7.0),
    ]
    combined = combine(ok, specs)
    assert combined.reward == pytest.approx(1.2)
    assert combined.details == {"acc": 1.0, "acc.extracted": 1.0, "fmt": 0.4, "log": 7.0}
    assert combined.failed == ()
    # A failed metric of weight 0 is reported but does not fail the sample.
    log_failed = [*ok[:2], Scored(function="log", status=Status.CRASHED, message="died")]
    assert combine(log_failed, specs).reward == pytest.approx(1.2)
    assert [s.function for s in combine(log_failed, specs).failed] == ["log"]
    timed_out = [ok[0], Scored(function="fmt", status=Status.TIMEOUT), ok[2]]
    assert combine(timed_out, specs).reward is None
    with pytest.raises(ValueError, match="result of 'fmt' where 'acc' was expected"):
        combine(ok[1:] + ok[:1], specs)


# -- built-ins, called directly (this is the main thread: math-verify's alarms work) --


@pytest.mark.parametrize("reference", ["1/2", "0.5", "\\frac{1}{2}"])
@pytest.mark.parametrize("answer", ["1/2", "0.5", "\\frac{1}{2}", "\\dfrac12", "2/4"])
def test_math_agrees_on_equal_values(reference, answer):
    from rlflow.rewards import math as math_reward

    assert math_reward(sample(f"so \\boxed{{{answer}}}", reference)) == (1.0, {"extracted": 1.0})
    assert math_reward(sample("so \\boxed{0.49}", reference)) == (0.0, {"extracted": 1.0})


@pytest.mark.parametrize(
    ("kwargs", "response", "expected"),
    [
        ({}, "first \\boxed{3} then \\boxed{\\frac{6}{2}} done", (1.0, 1.0)),
        ({}, "the last box wins: \\boxed{3} \\boxed{4}", (0.0, 1.0)),
        ({}, "a cut-off box \\boxed{3} \\boxed{\\frac{1}{", (0.0, 0.0)),
        ({}, "3, no box", (0.0, 0.0)),
        ({"extract": "last_number"}, "2 apples and 1 more make 3 apples.", (1.0, 1.0)),
        ({"extract": "last_number"}, "it is 3, not 4", (0.0, 1.0)),
        ({"extract": "last_number"}, "three", (0.0, 0.0)),
        ({"extract": "marker"}, "1+2 = 3\n#### 3\nthanks", (1.0, 1.0)),
        ({"extract": "marker", "marker": "Answer:"}, "Answer: 6/2", (1.0, 1.0)),
        ({"extract": "marker"}, "no marker, 3", (0.0, 0.0)),
        ({"extract": "none"}, "The answer is $3$.", (1.0, 1.0)),
    ],
)
def test_math_extraction_modes(kwargs, response, expected):
    from rlflow.rewards import math as math_reward

    value, parts = math_reward(sample(response, "3"), **kwargs)
    assert (value, parts["extracted"]) == expected


def test_math_reference_that_does_not_parse_is_an_error():
    from rlflow.rewards import math as math_reward

    with pytest.raises(ValueError, match="cannot parse the reference answer 'what\\?' as math"):
        math_reward(sample("\\boxed{3}", "what?"))
    with pytest.raises(ValueError, match="extract must be one of"):
        math_reward.prepare(extract="first")


def test_exact_and_regex():
    from rlflow.rewards import exact, regex

    assert exact(sample("  Paris \n", "Paris")) == (1.0, {"extracted": 1.0})
    assert exact(sample("New   York", "New York")) == (1.0, {"extracted": 1.0})
    assert exact(sample("new york", "New York"))[0] == 0.0
    assert exact(sample("new york", "New York"), ignore_case=True)[0] == 1.0
    assert exact(sample("NewYork", "New York"), whitespace="ignore")[0] == 1.0
    assert exact(sample("New  York", "New York"), whitespace="strip")[0] == 0.0
    assert exact(sample("it is \\boxed{Paris}", "Paris"), extract="boxed")[0] == 1.0
    fmt = r"(?s)^<think>.+</think>\s*<answer>.+</answer>$"
    assert regex(sample("<think>hm</think>\n<answer>4</answer>"), pattern=fmt) == 1.0
    assert regex(sample("<answer>4</answer>"), pattern=fmt) == 0.0
    assert regex(sample("x 42 y"), pattern=r"\d+") == 1.0
    assert regex(sample("x 42 y"), pattern=r"\d+", full=True) == 0.0


@needs_sandbox
def test_code_scores_the_share_of_tests_passed():
    from rlflow.rewards import code

    program = "```python\nn = int(input())\nprint(n * 2 if n < 3 else n)\n```"
    io_tests = [{"input": f"{n}\n", "output": f"{2 * n}\n"} for n in (1, 2, 3, 4)]
    response = f"Here it is:\n```text\nnot this\n```\n{program}\nDone."
    assert code(sample(response, tests=io_tests)) == (0.5, {"passed": 2.0, "tests": 4.0})
    # Tests as statements after the program, as a JSON string.
    asserts = '["assert double(2) == 4", "assert double(-1) == -2", "assert double(0) == 1"]'
    assert code(sample("def double(x):\n    return 2 * x\n", tests=asserts))[0] == pytest.approx(2 / 3)
    # Exiting early, however cleanly, passes nothing.
    for leave in ("import sys\nsys.exit(0)", "import os\nos._exit(0)"):
        assert code(sample(f"{leave}\n", tests=["assert False"]))[0] == 0.0
    # A program that never ends fails its test at the sandbox's limit.
    assert code(sample("while True: pass", tests=["pass"]), timeout_s=0.5)[0] == 0.0
    with pytest.raises(ValueError, match="no tests under 'tests'"):
        code(sample("print(1)"))


# -- the pool ----------------------------------------------------------------


async def test_sync_and_async_functions_score_through_the_pool():
    specs = [
        spec("user_rewards:brevity", kwargs={"limit": 2}),
        spec("user_rewards:judge", weight=0.5),
        spec("user_rewards:echo", name="twice", kwargs={"scale": 2.0}),
        spec("user_rewards:async_echo"),
    ]
    with trio.fail_after(60):
        async with open_pool(specs) as pool:
            one = Sample(prompt="p", response="because", response_ids=(1, 2, 3, 4), row={"x": 3})
            scored = await pool.score(one)
    assert [s.function for s in scored] == ["brevity", "judge", "twice", "async_echo"]
    assert all(s.status is Status.OK for s in scored), scored
    assert [s.value for s in scored] == [0.5, 1.0, 6.0, 3.0]
    assert scored[0].parts == {"over_tokens": 2.0}
    combined = pool.combine(scored)
    assert combined.reward == pytest.approx(0.5 + 0.5 + 6.0 + 3.0)
    assert combined.details["twice.chars"] == 7.0


@pytest.mark.slow  # waits out a timeout
async def test_a_call_past_its_timeout_or_whose_worker_dies_is_marked_and_the_worker_replaced():
    with trio.fail_after(60):
        async with open_pool([spec("user_rewards:pid", timeout_s=0.5)]) as pool:

            async def score(prompt: str) -> Scored:
                (result,) = await pool.score(sample(prompt=prompt))
                assert result.function == "pid"
                return result

            first = await score("ok")
            assert first.status is Status.OK
            pids = [int(first.value)]
            for trouble, status, says in [
                ("spin", Status.TIMEOUT, "took longer than its timeout_s = 0.5 s; its worker was killed"),
                ("sleep", Status.TIMEOUT, "took longer than its timeout_s = 0.5 s"),
                ("segfault", Status.CRASHED, "the worker died of SIGSEGV"),
                ("exit", Status.CRASHED, "the worker exited with code 7"),
            ]:
                result = await score(trouble)
                assert (result.status, result.value) == (status, None)
                assert says in result.message
                after = await score("ok")
                assert after.status is Status.OK
                pids.append(int(after.value))
                assert not alive(pids[-2]), f"the worker that ran {trouble!r} is still alive"
            assert len(set(pids)) == 5
            assert pool.restarts == {"pid": 4}


#: IDLE_TIMEOUT: how long trio's idle worker threads live (10 s by default), shortened so that the
#: threads that started the workers are gone within the test's wait.
HOLD_A_POOL = """
import psutil, trio
import trio._core._thread_cache
from rlflow.rewards import FunctionSpec, open_pool

trio._core._thread_cache.IDLE_TIMEOUT = 1.0

async def main():
    async with open_pool([FunctionSpec(path="rlflow.rewards:exact", workers=2)]):
        print(" ".join(str(p.pid) for p in psutil.Process().children()), flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


@pytest.mark.slow  # waits for processes to die
def test_workers_outlive_the_thread_that_started_them_and_die_with_their_parent(tmp_path):
    """trio starts processes from threads that end after a while idle (1 s
    here, 10 s by default): the workers live on past that, and are gone soon
    after the process that holds the pool is SIGKILLed."""
    script = tmp_path / "hold.py"
    script.write_text(HOLD_A_POOL)
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(p) for p in holder.stdout.readline().split()]
        assert len(pids) == 2, pids
        time.sleep(3)
        assert all(alive(p) for p in pids), "a worker died with the thread that started it"
        holder.kill()
        holder.wait(timeout=30)
        assert gone(pids), "a worker outlived its parent"
    finally:
        holder.kill()
        holder.wait(timeout=30)
        holder.stdout.close()
        for pid in pids:
            if alive(pid):
                os.kill(pid, 9)


async def test_exceptions_and_bad_returns_are_errors_and_the_worker_stays():
    with trio.fail_after(60):
        async with open_pool([spec("user_rewards:pid")]) as pool:
            (before,) = await pool.score(sample(prompt="ok"))
            for prompt, says in [
                ("raise", "ValueError: asked to raise (at "),
                ("nan", "returned nan (float) as its reward"),
                ("text", "returned '1.0' (str): expected a finite float"),
                ("inf part", "returned part 'p' (str): inf (float)"),
            ]:
                (result,) = await pool.score(sample(prompt=prompt))
                assert (result.function, result.status, result.value) == ("pid", Status.ERROR, None)
                assert says in result.message
            (after,) = await pool.score(sample(prompt="ok"))
            assert after.value == before.value
            assert pool.restarts == {"pid": 0}


async def test_many_tasks_score_at_once_and_cancelled_callers_leave_the_pool_in_step():
    specs = [spec("user_rewards:echo", workers=2), spec("user_rewards:async_echo", workers=2)]
    with trio.fail_after(60):
        async with open_pool(specs) as pool:
            results: dict[int, list[Scored]] = {}

            async def one(i: int) -> None:
                results[i] = await pool.score(sample(f"r{i}", x=i))

            async with trio.open_nursery() as nursery:
                for i in range(40):
                    nursery.start_soon(one, i)
            assert {i: [s.value for s in scored] for i, scored in results.items()} == {
                i: [float(i), float(i)] for i in range(40)
            }
            # Callers cancelled while queued or mid-call: every later answer
            # still belongs to its own question.
            async with trio.open_nursery() as nursery:
                for i in range(40):
                    nursery.start_soon(one, 100 + i)
                await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
            results.clear()
            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(one, 200 + i)
            assert {i: [s.value for s in scored] for i, scored in results.items()} == {
                200 + i: [float(200 + i)] * 2 for i in range(20)
            }


async def test_a_batched_function_gets_the_samples_that_arrive_together():
    specs = [spec("user_rewards:batch_size", max_batch=8, batch_wait_s=0.05), spec("user_rewards:wrong_length")]
    with trio.fail_after(60):
        async with open_pool(specs) as pool:
            assert [f.batched for f in pool.functions] == [True, True]
            scored = await pool.score_many([sample(x=i) for i in range(20)])
    assert [s[0].value for s in scored] == [float(i) for i in range(20)]
    sizes = [s[0].parts["batch"] for s in scored]
    assert max(sizes) > 1 and max(sizes) <= 8
    wrong = {(s[1].status, s[1].message) for s in scored}
    assert len(wrong) == 1
    ((status, message),) = wrong
    assert status is Status.ERROR and message.startswith("returned 1 results for a batch of")


async def test_the_builtins_run_in_the_pool_by_path():
    specs = [
        spec("rlflow.rewards:math", kwargs={"extract": "marker"}),
        spec("rlflow.rewards:exact", kwargs={"extract": "marker", "ignore_case": True}),
        spec("rlflow.rewards:regex", name="format", kwargs={"pattern": r"#### \S+$"}),
    ]
    if SANDBOX is None:
        specs.append(spec("rlflow.rewards:code"))
    row = {"tests": [{"input": "", "output": "0.5"}]}
    with trio.fail_after(60):
        async with open_pool(specs) as pool:
            right, wrong = await pool.score_many(
                [sample("print(1/2)\n#### 1/2", "0.5", **row), sample("print(1/3)\n#### 1/3", "0.5", **row)]
            )
    assert [(s.function, s.status, s.value) for s in right][:3] == [
        ("math", Status.OK, 1.0),
        ("exact", Status.OK, 0.0),  # "1/2" is not the string "0.5"
        ("format", Status.OK, 1.0),
    ]
    assert [s.value for s in wrong][:3] == [0.0, 0.0, 1.0]
    if SANDBOX is None:
        assert (right[3].value, wrong[3].value) == (1.0, 0.0)
        assert right[3].parts == {"passed": 1.0, "tests": 1.0}


@pytest.mark.slow  # waits out a timeout
async def test_math_verify_times_itself_out_in_a_worker():
    # Its alarm needs the main thread, which a worker gives the function: the
    # call ends as TIMEOUT at math-verify's own limit, and the worker stays.
    hard = sample("\\boxed{10^{10^{10}}}", "9^{9^{9^{9}}}")
    with trio.fail_after(60):
        async with open_pool([spec("rlflow.rewards:math", kwargs={"timeout_s": 1})]) as pool:
            (result,) = await pool.score(hard)
            (easy,) = await pool.score(sample("\\boxed{2}", "2"))
            assert pool.restarts == {"math": 0}
    assert result.status is Status.TIMEOUT
    assert result.message.startswith("TimeoutError: math-verify took longer than timeout_s = 1 s")
    assert (easy.status, easy.value) == (Status.OK, 1.0)


async def test_a_function_that_cannot_start_stops_the_pool_with_its_reason():
    with trio.fail_after(60):
        with pytest.raises(PoolError, match=r"'user_rewards:missing': 'user_rewards' has no attribute 'missing'"):
            async with open_pool([spec("user_rewards:echo"), spec("user_rewards:missing")]):
                pytest.fail("the pool opened")
        with pytest.raises(PoolError, match="'cannot_prepare' cannot start: RuntimeError: no model here"):
            async with open_pool([spec("user_rewards:cannot_prepare")]):
                pytest.fail("the pool opened")
        with pytest.raises(PoolError, match=r"cannot start: re.error: missing \), unterminated subpattern"):
            async with open_pool([spec("rlflow.rewards:regex", kwargs={"pattern": "("})]):
                pytest.fail("the pool opened")
        with pytest.raises(ValueError, match="two reward functions are named 'echo'"):
            async with open_pool([spec("user_rewards:echo"), spec("user_rewards:echo")]):
                pytest.fail("the pool opened")


async def test_workers_import_from_the_runs_import_dir_whatever_their_working_directory(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "beside_config.py").write_text("def fn(sample):\n    return float(len(sample.response))\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a service's working directory is not the launcher's
    with trio.fail_after(60):
        with pytest.raises(PoolError, match="'beside_config:fn': cannot import module 'beside_config'"):
            async with open_pool([spec("beside_config:fn")]):
                pytest.fail("the pool opened")
        async with open_pool([spec("beside_config:fn")], import_dir=str(mine)) as pool:
            (scored,) = await pool.score(sample("four"))
    assert (scored.status, scored.value) == (Status.OK, 4.0)


async def test_check_references_reports_what_cannot_score_its_reference():
    specs = [
        spec("rlflow.rewards:math"),  # renders "\boxed{reference}"
        spec("rlflow.rewards:exact", kwargs={"extract": "marker"}),
        spec("user_rewards:never_right"),
        spec("user_rewards:judge"),  # no reference_response: only checked to score
    ]
    references = [sample(reference="\\frac{1}{2}"), sample(reference="12"), sample(reference="what?")]
    with trio.fail_after(60):
        async with open_pool(specs) as pool:
            problems = await check_references(pool, references)
    assert len(problems) == 4, problems
    assert problems[0] == (
        "reward function 'never_right': the reference answer of sample 0 ('\\\\frac{1}{2}') scored 0, expected 1"
    )
    assert problems[1] == "reward function 'never_right': the reference answer of sample 1 ('12') scored 0, expected 1"
    assert problems[2].startswith(
        "reward function 'math': the reference answer of sample 2 ('what?') did not score (error): "
        "ValueError: math-verify cannot parse the reference answer 'what?'"
    )
    assert (
        problems[3] == "reward function 'never_right': the reference answer of sample 2 ('what?') scored 0, expected 1"
    )


async def test_a_row_that_is_not_plain_data_is_an_error_and_numpy_is_plain():
    import numpy as np

    with trio.fail_after(60):
        async with open_pool([spec("user_rewards:echo")]) as pool:
            (bad,) = await pool.score(sample(x=object()))
            (good,) = await pool.score(sample(x=np.float32(2.5)))
    assert bad.status is Status.ERROR and "the sample cannot be sent to a reward worker" in bad.message
    assert (good.status, good.value) == (Status.OK, 2.5)


async def test_leaving_the_pool_kills_its_workers_and_what_they_started():
    with trio.fail_after(60):
        async with open_pool([spec("user_rewards:pid", workers=2)]) as pool:
            workers = {int(s[0].value) for s in await pool.score_many([sample(prompt="ok")] * 8)}
            (child,) = await pool.score(sample(prompt="child"))
            assert alive(int(child.value))
        assert gone([*workers, int(child.value)])
        with pytest.raises(PoolError, match="closed"):
            await pool.score(sample())


def test_workers_die_with_the_process_that_started_them(user_dir):
    # Even a worker stuck in a call: it does not outlive a service killed with SIGKILL.
    script = textwrap.dedent(
        """
        import trio
        from rlflow.rewards import FunctionSpec, Sample, open_pool

        async def main():
            async with open_pool([FunctionSpec(path="user_rewards:pid", workers=1, timeout_s=600)]) as pool:
                (result,) = await pool.score(Sample(prompt="ok", response=""))
                print(int(result.value), flush=True)
                await pool.score(Sample(prompt="spin", response=""))

        trio.run(main)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([user_dir, *sys.path])}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with subprocess.Popen([sys.executable, "-c", script], env=env, **pipes) as service:
        assert service.stdout is not None and service.stderr is not None
        worker = int(service.stdout.readline())
        while "spinning" not in service.stderr.readline():
            pass
        service.kill()
    assert gone([worker])


@pytest.mark.slow
@pytest.mark.timeout(900)  # see its pool's start below
async def test_reward_model_scores_in_batches_as_a_direct_forward_does(tmp_path):
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from rlflow.models import build_tokenizer
    from rlflow.tasks.arith import Arith

    tokenizer = build_tokenizer(Arith.ALPHABET)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = Qwen2ForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    samples = [
        Sample(prompt=f"{a}+{b}=", response=str(a + b + a % 2)) for a, b in [(1, 2), (34, 5), (678, 90), (1, 1)] * 4
    ]
    kwargs = {"model": str(tmp_path), "batch_size": 16}
    # Its worker imports torch and transformers and loads the model: over 60 s on a machine busy with
    # other work. The limits guard against a hang alone.
    with trio.fail_after(900):
        async with open_pool(
            [spec("user_rewards:scored_by_model", max_batch=16, batch_wait_s=0.05, kwargs=kwargs)],
            start_timeout_s=600,
        ) as pool:
            scored = [s[0] for s in await pool.score_many(samples)]
    assert all(s.status is Status.OK for s in scored), scored
    assert max(s.parts["batch"] for s in scored) > 1
    with torch.no_grad():
        direct = [model(**tokenizer(s.prompt, s.response, return_tensors="pt")).logits[0, 0].item() for s in samples]
    assert [s.value for s in scored] == pytest.approx(direct, abs=1e-5)
    assert len(set(direct)) > 1  # the check compares something
