"""Shared fixtures. Expensive ones (Ray, vLLM) are session-scoped."""

from __future__ import annotations

import os
import sys

# Before torch is imported: its OpenMP threads sleep when they wait, as a
# run's services do (rlflow.control.placement), rather than spin on a core
# that the run's other processes need.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Helpers beside the tests (golden.py, strategies.py, peers.py) import by name.
sys.path.insert(0, os.path.dirname(__file__))

from hypothesis import settings  # noqa: E402

# This machine is shared and noisy: time limits per example would make
# property tests flaky without testing anything about correctness.
settings.register_profile("rlflow", deadline=None)
settings.load_profile("rlflow")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the whole session, with its dashboard so that tests
    can ask Ray's state API what is left. Yields its address."""
    import ray

    ray.init(num_cpus=4, include_dashboard=True, namespace="rlflow", log_to_driver=False, configure_logging=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def leftovers(run_id: str = "") -> tuple[list[str], list[str]]:
    """rlflow actors and placement groups Ray's state API still reports."""
    import ray
    from ray.util.state import list_actors, list_placement_groups

    # This cluster's, by address: another Ray may be running on the machine.
    address = ray.get_runtime_context().gcs_address
    prefix = f"rlflow:{run_id}"
    actors = [
        a.name
        for a in list_actors(address=address, filters=[("state", "!=", "DEAD")], limit=10_000,
                             raise_on_missing_output=False)
        if (a.name or "").startswith(prefix)
    ]
    groups = [
        g.name
        for g in list_placement_groups(address=address, limit=10_000, raise_on_missing_output=False)
        if (g.name or "").startswith(prefix) and g.state != "REMOVED"
    ]
    return actors, groups


def trained_groups(run_dir) -> list[tuple[int, int, int]]:
    """(step, group id, oldest token version) of every group the trainer trained on."""
    import json
    import pathlib

    out = []
    for file in sorted((pathlib.Path(run_dir) / "trace").glob("lengths-*.jsonl")):
        for line in file.read_text().splitlines():
            record = json.loads(line)
            out += [(record["step"], g, v) for g, v in zip(record["groups"], record["oldest"], strict=True)]
    return out


async def until(condition, every_s: float = 0.05) -> None:
    """Wait for `condition()` (state another task or process writes: a run's files, a controller's
    fields; a coroutine function's too) to hold, looking again every `every_s`; bound it with the
    caller's own deadline."""
    import inspect

    import trio

    while not ((await held) if inspect.isawaitable(held := condition()) else held):
        await trio.sleep(every_s)


def until_in_thread(condition, timeout_s: float, every_s: float = 0.05) -> bool:
    """`until` for a thread of the test (beside a blocking call): whether `condition()` held within
    `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


def late_starts(run_dir, batch_size: int, max_staleness: int) -> list[tuple[int, int, int]]:
    """Groups that started on weights older than the credits allow (group g
    belongs to step g // batch_size and may start on weights no older than
    that step - max_staleness)."""
    return [(s, g, v) for s, g, v in trained_groups(run_dir) if v < g // batch_size - max_staleness]


# -- lanes: the edit loop runs what the last whole run timed as cheap -------------------------------------------

#: Each test's seconds in the last whole run (setup, call and teardown), and its fixtures that outlive it.
DURATIONS = os.path.join(os.path.dirname(__file__), "durations.json")
#: Where a whole run keeps its seconds (pytest's cache, not tracked by git): `--fast` reads them first.
CACHE_KEY = "rlflow/durations"
#: `--fast` runs the tests that took under this, without a fixture that took longer to set up.
FAST_S = 1.0
_timed: dict[str, float] = {}


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the edit loop: only tests the last whole run here (else tests/durations.json) "
                          f"timed under {FAST_S:g} s, none of them needing a fixture that took longer to set up; "
                          "a test no run has timed is left out")
    parser.addoption("--save-durations", action="store_true",
                     help="also write this whole run's seconds into tests/durations.json (the lanes a fresh "
                          "clone starts with), to commit on purpose")


def _shared_fixtures(item) -> list[str]:
    """The fixtures of `item` set up once for several tests (module or session scope)."""
    closure = getattr(item, "_fixtureinfo", None)
    defs = closure.name2fixturedefs if closure is not None else {}
    return sorted(name for name, fixturedefs in defs.items() if fixturedefs and fixturedefs[-1].scope != "function")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--fast"):
        return
    import json

    timed = _cache(config).get(CACHE_KEY, None) if _cache(config) is not None else None
    if not timed:
        try:
            with open(DURATIONS) as f:
                timed = json.load(f)
        except (OSError, ValueError):
            return
    # A shared fixture is dear when a test that set it up took long to: each test that needs it pays it alone.
    dear = {name for record in timed.values() if record["setup_s"] > FAST_S for name in record["shared"]}
    keep, slow = [], []
    for item in items:
        record = timed.get(item.nodeid)
        dear_fixture = any(name in dear for name in _shared_fixtures(item))
        (slow if record is None or dear_fixture or record["total_s"] > FAST_S else keep).append(item)
    config.hook.pytest_deselected(items=slow)
    items[:] = keep


#: Each test's shared fixtures, as its reports carry them (under xdist the process that writes the
#: durations collects no tests of its own).
_shared: dict[str, list[str]] = {}


def pytest_itemcollected(item):
    item.user_properties.append(("shared", _shared_fixtures(item)))


def pytest_runtest_logreport(report):
    _timed[f"{report.nodeid}:{report.when}"] = report.duration
    _shared[report.nodeid] = dict(report.user_properties).get("shared", [])


def pytest_sessionfinish(session, exitstatus):
    """End the rank processes kept between tests; after a whole run of the suite (no selection of any
    kind), keep each test's seconds for `--fast` in pytest's cache (and in tests/durations.json with
    `--save-durations`)."""
    import json

    if "ranks" in sys.modules:  # the rank processes tests/ranks.py keeps between jobs
        sys.modules["ranks"].close_pool()
    config = session.config
    chosen = config.getoption("--fast") or config.getoption("keyword") or config.getoption("markexpr") or \
        config.getoption("lf", False) or any(arg not in ("tests", "tests/") for arg in config.args)
    # Under xdist each worker runs some of the tests; the main process hears of them all and writes.
    if chosen or exitstatus not in (0, 1) or not _shared or hasattr(config, "workerinput"):
        return
    records = {}
    for nodeid, shared in _shared.items():
        phases = {when: _timed.get(f"{nodeid}:{when}", 0.0) for when in ("setup", "call", "teardown")}
        records[nodeid] = {"total_s": round(sum(phases.values()), 3), "setup_s": round(phases["setup"], 3),
                           "shared": shared}
    if _cache(config) is not None:
        _cache(config).set(CACHE_KEY, records)
    if config.getoption("--save-durations"):
        with open(DURATIONS, "w") as f:
            json.dump(records, f, indent=0, sort_keys=True)
            f.write("\n")


def _cache(config):
    """pytest's cache (None under `-p no:cacheprovider`)."""
    return getattr(config, "cache", None)
