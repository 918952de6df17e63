"""The roles of a run, in one table: whatever keeps a list of roles derives it from here.

A role is a folder under ``services/`` (its service and its engines) plus one
`RoleSpec` in `ROLES`: its name (the config's ``[roles.NAME]`` and the wire's
`Role`, whose value is `wire`), the service class, where it sits in the
stream, what it takes and what it hands on, whether it holds a policy
version, whether losing one of its replicas stops the run, whether a user
may start its replicas (``launch = "external"``) and what its busy time is
called. The order of `ROLES` is the stream's: the config's order of roles,
the report's, the live table's.

Plain data, importable from anywhere above `rlflow.protocol` (the config
imports it; it imports nothing of rlflow).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RoleSpec:
    """One role."""

    name: str
    """``[roles.NAME]`` in the config, ``Role.NAME`` on the wire, ``NAME-RANK`` for its replicas."""
    wire: int
    """Its `rlflow.protocol.Role` value."""
    service: str
    """``module:Class`` of its service."""
    takes: str
    """What it works on: ``credits`` (group ids from the controller), ``samples`` (batches from the role
    before it in the stream) or ``requests`` (asked by the rollout, request and reply)."""
    hands_on: str
    """What it sends: ``samples`` (to the next role), ``replies`` (to who asked) or ``weights`` (the
    trainer's new versions, to the rollout)."""
    busy: str
    """What its busy time is, in the report's pictures."""
    optional: bool = False
    """A run may leave it out (its ``[roles.NAME]`` table)."""
    versioned: bool = False
    """Its replicas hold a policy version (shown with how far it is behind the trainer)."""
    stateful: bool = False
    """Its state (weights, an optimizer) is nowhere else: a lost replica stops the run, which resumes from its
    checkpoint, instead of being restarted."""
    external: bool = False
    """Its replicas may be started by the user (``launch = "external"``, see SPEC.md)."""
    asked_by: str = ""
    """The role that asks it (``takes = "requests"``): its replicas get this role's endpoints."""
    report: str = ""
    """``module:function`` giving the line `rlflow report` adds about the role, from the run's `StepRow`s
    ("" for none)."""
    curves: tuple[tuple[str, str], ...] = ()
    """(`StepRow.train` key, label) of statistics of its own that `rlflow report` draws in a panel and the
    status shows the trend of."""
    curves_title: str = ""
    """That panel's title."""
    plan: str = ""
    """``module:function`` giving, from a run, the costs `rlflow plan` models the role by, for a role that
    values each group on its way to the trainer and trains on it (`rlflow.tools.plan.Learner`)."""
    models: tuple[tuple[str, float, int], ...] = ()
    """Models rlflow builds for the role (``rlflow model build NAME``; on first use by a config that names
    one): (name, held-out accuracy its warm start stops at, most warm-start steps), each the default
    model's recipe warm-started further."""
    attaches: tuple[str, ...] = ()
    """Columns of the wire's `SampleBatch` it may attach for the trainer to read (which ones a run's table of it
    attaches: `RoleTable.attaches`); a trainer's setting that reads one no role attaches is refused."""
    batch_stats: str = ""
    """``module:function`` giving, from a trainer step's batch and the step, statistics of the columns it
    attached (``{}``: none there), added to the step's metrics ("" for none)."""
    counters: tuple[tuple[str, str], ...] = ()
    """Families of counts its replicas keep by name, each (prefix, field): a count named
    ``<prefix>.<key>`` goes to the `Counters` map `field` under ``<key>`` (e.g. ``reward.<function>.<status>``
    to `reward_calls`). A new count of a family is one line where it is counted; a new family, one entry here."""


#: Messages a second, at most, that the replicas of a stage (and of the rollout) send on together while
#: batches keep coming: a replica leaves `replicas / MESSAGES_PER_S` seconds between two (a batch done
#: sooner waits, and those done meanwhile join it; one after a pause goes at once). At 16,384 slots each
#: of 16 reward replicas scored a group every 90 ms and sent it alone: the trainer took 176 messages a
#: second, and cutting a step's batch out of 8,192 of them took it 1.4-4.8 s a step; the 64 rollout
#: replicas sent 220 messages a second of a group each. One replica waits 20 ms at most.
MESSAGES_PER_S = 50


ROLES: tuple[RoleSpec, ...] = (
    RoleSpec("rollout", 1, "rlflow.services.rollout.service:RolloutService", takes="credits", hands_on="samples",
             busy="generating", versioned=True, external=True, counters=(("agents", "agent_events"),)),
    RoleSpec("env", 5, "rlflow.services.env.service:EnvService", takes="requests", hands_on="replies",
             busy="stepping episodes", optional=True, external=True, asked_by="rollout",
             counters=(("env", "env_calls"),)),
    RoleSpec("reward", 2, "rlflow.services.reward.service:RewardService", takes="samples", hands_on="samples",
             busy="scoring", external=True, counters=(("reward", "reward_calls"),)),
    RoleSpec("teacher", 3, "rlflow.services.teacher.service:TeacherService", takes="samples", hands_on="samples",
             busy="scoring", optional=True, external=True,
             curves=(("kl_teacher", "KL"),), curves_title="KL to the teacher (per token)",
             models=(("default-teacher", 0.8, 8000),),
             attaches=("teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs")),
    RoleSpec("critic", 6, "rlflow.services.critic.service:CriticService", takes="samples", hands_on="samples",
             busy="valuing and training", optional=True, versioned=True, stateful=True,
             report="rlflow.services.critic.report:line",
             curves=(("critic_value_loss", "value loss"), ("critic_explained_var", "explained variance")),
             curves_title="critic (on each step's samples, before it trained on them)",
             plan="rlflow.services.critic.plan:costs",
             attaches=("values", "returns", "token_advantages", "critic_versions"),
             batch_stats="rlflow.services.critic.stats:of_batch"),
    RoleSpec("trainer", 4, "rlflow.services.trainer.service:TrainerService", takes="samples", hands_on="weights",
             busy="training", versioned=True, stateful=True, report="rlflow.services.trainer.report:line",
             curves=(("gap_p99", "p99"), ("gap_mean", "mean")),
             curves_title="engine-trainer gap |log p_train - log p_rollout| per token"),
)

#: Role name -> its spec.
BY_NAME: dict[str, RoleSpec] = {role.name: role for role in ROLES}
#: Every role's name, in the stream's order.
NAMES: tuple[str, ...] = tuple(role.name for role in ROLES)
#: Roles whose lost replica stops the run (resumed from its checkpoint).
STATEFUL: tuple[str, ...] = tuple(role.name for role in ROLES if role.stateful)
#: Roles whose replicas hold a policy version.
VERSIONED: tuple[str, ...] = tuple(role.name for role in ROLES if role.versioned)
#: Prefix of a family of counts -> the `Counters` map it goes to (`RoleSpec.counters`, every role's).
COUNTER_FAMILIES: dict[str, str] = {prefix: field for role in ROLES for prefix, field in role.counters}
#: Roles whose replicas a user may start.
EXTERNAL: tuple[str, ...] = tuple(role.name for role in ROLES if role.external)


def hook(path: str) -> Any:
    """The function a registry entry names by ``module:function`` (`RoleSpec.report`, `plan`, ...)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def spoken(names: tuple[str, ...]) -> str:
    """``a, b or c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
