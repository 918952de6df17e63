"""Placement's arithmetic, without Ray: who shares which bundle, which cores
each bundle gets, and whether the pools fit the cluster."""

from __future__ import annotations

import pytest

from rlflow import config as C
from rlflow.control.placement import PlacementError, check_resources, core_ranges, share_bundles

BASE = """
[pools.generate]
bundles_per_node = 2
cpus_per_bundle = 2.0
gpus_per_bundle = 1.0
[pools.score]
cpus_per_bundle = 0.5
[roles.rollout]
pool = "generate"
replicas = 3
[roles.reward]
pool = "score"
[roles.trainer]
pool = "score"
"""


def test_replicas_take_bundles_round_robin_and_split_them():
    placed = share_bundles(C.load(text=BASE))
    assert [(role, pool, bundle) for role, pool, bundle, _ in placed] == [
        ("reward", "score", 0),
        ("rollout", "generate", 0),
        ("rollout", "generate", 1),
        ("rollout", "generate", 0),
        ("trainer", "score", 0),
    ]
    shares = {(role, bundle): share for role, _, bundle, share in placed}
    assert shares[("rollout", 0)] == {"CPU": 1.0, "GPU": 0.5}  # two replicas in bundle 0
    assert shares[("rollout", 1)] == {"CPU": 2.0, "GPU": 1.0}
    assert shares[("reward", 0)] == shares[("trainer", 0)] == {"CPU": 0.25}


def test_bundles_get_their_own_cores_in_order_and_small_ones_share():
    by_node = {"a": [("generate", 0, 1.5), ("train", 0, 0.5)], "b": [("generate", 1, 3.0)]}
    assert core_ranges(by_node, {"a": 2, "b": 4}) == {
        ("generate", 0): (0, 2),
        ("train", 0): (1, 1),  # shares core 1 with the half it does not fill
        ("generate", 1): (0, 3),
    }
    # A node asked for more CPUs than it has: its bundles share every core.
    assert core_ranges({"a": [("p", 0, 3.0)]}, {"a": 2}) == {}


def test_a_shortfall_names_the_pool_the_resource_and_the_numbers():
    config = C.load(text=BASE)
    with pytest.raises(PlacementError,
                       match=r"pool 'generate' asks for 2 GPU \(2 bundles x 1\); the cluster has 1 GPU"):
        check_resources(config, {"CPU": 8, "GPU": 1}, [{"CPU": 8, "GPU": 1}])
    with pytest.raises(PlacementError, match=r"bundles of 2 CPU; the largest node has 1"):
        check_resources(config, {"CPU": 8, "GPU": 4}, [{"CPU": 1, "GPU": 2}] * 8)
    check_resources(config, {"CPU": 5, "GPU": 2}, [{"CPU": 5, "GPU": 2}])



def test_a_labelled_pool_fits_only_on_the_nodes_that_carry_its_labels():
    config = C.load(text=BASE, overrides=['pools.generate.labels={pool = "generate"}'])
    nodes = [{"CPU": 8, "GPU": 0}, {"CPU": 2, "GPU": 2}]
    with pytest.raises(PlacementError, match=r"pool 'generate' asks for nodes labelled pool=generate; no live node"):
        check_resources(config, {"CPU": 10, "GPU": 2}, nodes, [{}, {"pool": "train"}])
    # The labelled node has the GPUs but too few CPUs for a bundle; the other has CPUs but not the label.
    with pytest.raises(PlacementError, match=r"bundles of 2 CPU; the largest node has 1"):
        check_resources(config, {"CPU": 10, "GPU": 2}, [{"CPU": 8, "GPU": 0}, {"CPU": 1, "GPU": 2}],
                        [{}, {"pool": "generate"}])
    check_resources(config, {"CPU": 10, "GPU": 2}, nodes, [{}, {"pool": "generate", "zone": "a"}])


def test_a_death_report_names_the_services_own_error_not_the_border_of_its_traceback():
    from rlflow.control.placement import _first_line

    wrapped = RuntimeError("ray.exceptions.RayTaskError: ServiceHost.run()\n  File \"x\", line 3\n"
                           "    | rlflow.services.rollout.vllm_engine.EngineDead: vLLM's engine died: gone\n"
                           "    +------------------------------------\n")
    assert _first_line(wrapped) == "rlflow.services.rollout.vllm_engine.EngineDead: vLLM's engine died: gone"
    assert _first_line(RuntimeError("just this")) == "just this"
