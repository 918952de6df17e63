"""Shared fixtures. Expensive ones (Ray, vLLM) are session-scoped."""

from __future__ import annotations

import os
import sys

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


def late_starts(run_dir, batch_size: int, max_staleness: int) -> list[tuple[int, int, int]]:
    """Groups that started on weights older than the credits allow (group g
    belongs to step g // batch_size and may start on weights no older than
    that step - max_staleness)."""
    return [(s, g, v) for s, g, v in trained_groups(run_dir) if v < g // batch_size - max_staleness]
