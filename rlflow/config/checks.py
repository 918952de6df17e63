"""Checks that involve several fields of a config (a role's pool exists, sync
mode means no staleness, ...), run by `load` after the schema has validated
each field; then each role's own, beside its table (`RoleTable.check`)."""

from __future__ import annotations

import math

import msgspec

from rlflow.config.environment import check_tools
from rlflow.config.errors import MISSING, ConfigError
from rlflow.config.base import kind_of
from rlflow.config.reward import EnvReward, FunctionsReward
from rlflow.config.rollout import SimRollout
from rlflow.config.run import IMPLIED_STALENESS, DatasetTask, ReasoningGymTask
from rlflow.config.schema import Config
from rlflow.config.trainer import TorchTrainer
from rlflow.rewards.core import check_specs
from rlflow.roles import STATEFUL


def check(config: Config) -> None:
    """Checks that involve several fields."""
    pools = sorted(config.pools)
    for name, role in config.role_items():
        if getattr(role, "launch", "ray") == "external":
            if role.pool:
                raise ConfigError(f"roles.{name}.pool", role.pool, "an external role (launch = 'external') runs on "
                                  "no pool of the run's: leave it out")
        elif role.pool not in config.pools:
            raise ConfigError(f"roles.{name}.pool", role.pool or MISSING,
                              f"not a pool; pools: {', '.join(pools) or '(none)'}")
    used = {role.pool for _, role in config.launched_roles()}
    for name in pools:
        if name not in used:
            raise ConfigError(f"pools.{name}", msgspec.to_builtins(config.pools[name]), "no role runs on this pool")
    host = config.cluster.host
    if host.strip("[]") in ("0.0.0.0", "::", "*"):
        raise ConfigError(
            "cluster.host", host,
            "a wildcard is no address to connect to: give one, or leave it empty for each node's own IP",
        )
    run = config.run
    if run.max_staleness_given is not None and run.mode != "async":
        implied = IMPLIED_STALENESS[run.mode]
        if run.max_staleness_given != implied:
            raise ConfigError(
                "run.max_staleness", run.max_staleness_given,
                f"must be {implied} (or left out) when run.mode = {run.mode!r}"
            )
    if run.deterministic and run.mode != "sync":
        raise ConfigError("run.deterministic", True, f"a run is reproducible in run.mode = 'sync' alone (here "
                                                     f"{run.mode!r}: which weights generate a token depends on "
                                                     "when they arrive)")
    if run.deterministic and (config.agents is not None or config.roles.env is not None):
        raise ConfigError("run.deterministic", True, "episodes played by an environment or outside agents are "
                                                     "not reproducible (their turns come in their own order)")
    _check_lora(config)
    _check_filter(config)
    reward = config.roles.reward.engine
    if isinstance(reward, FunctionsReward):
        try:
            check_specs(reward.functions)
        except ValueError as exc:
            raise ConfigError("roles.reward.engine.functions", [f.path for f in reward.functions], str(exc)) from None
    if config.roles.reward.inline and (not isinstance(config.roles.rollout.engine, SimRollout)
                                       or isinstance(reward, FunctionsReward)):
        raise ConfigError("roles.reward.inline", True,
                          "scoring in line is a layout of the simulated rollout with a sim or task reward engine")
    _check_env(config)
    if (isinstance(config.task, (DatasetTask, ReasoningGymTask))
            and not isinstance(reward, (FunctionsReward, EnvReward))):
        raise ConfigError(
            "roles.reward.engine.kind", kind_of(reward),
            f"task.kind = {kind_of(config.task)!r} is scored by reward functions: use kind = 'functions'",
        )
    roles = dict(config.role_items())
    for name in STATEFUL:
        if name in roles:
            _check_ranks(config, name)
    _check_correction(config)
    for _, role in config.role_items():
        role.check(config)


def _check_correction(config: Config) -> None:
    """The mismatch correction's bounds, and the over-long shaping's buffer
    inside the rollout's longest response."""
    trainer = config.roles.trainer.engine
    if not isinstance(trainer, TorchTrainer):
        return
    key = "roles.trainer.engine."
    if trainer.correction == "truncate" and not trainer.decoupled:
        raise ConfigError(key + "correction", "truncate", "truncation reweights the gap from the trainer's proximal "
                          "policy to the behaviour policy: it needs decoupled = true (not decoupled, the ratio "
                          "already holds the behaviour policy: 'mask' leaves the tokens of a large gap out)")
    if trainer.correction == "truncate" and trainer.correction_low > 0:
        raise ConfigError(key + "correction_low", trainer.correction_low,
                          "a lower bound is mask's (correction = 'mask'): truncate only caps the weight")
    if trainer.correction_low >= trainer.correction_high:
        raise ConfigError(key + "correction_low", trainer.correction_low,
                          f"must be below correction_high ({trainer.correction_high})")
    if trainer.overlong_buffer > 0:
        max_tokens = getattr(config.roles.rollout.engine, "max_tokens", None)
        if max_tokens is None:
            raise ConfigError(key + "overlong_buffer", trainer.overlong_buffer,
                              f"the rollout engine {kind_of(config.roles.rollout.engine)!r} has no max_tokens to "
                              "measure a response's length against")
        if trainer.overlong_buffer >= max_tokens:
            raise ConfigError(key + "overlong_buffer", trainer.overlong_buffer,
                              f"must be below the rollout's max_tokens ({max_tokens})")


def _check_filter(config: Config) -> None:
    """The signal filter needs groups whose rewards can differ (the trainer's own terms: `TrainerRole.check`)."""
    run = config.run
    if run.filter == "signal" and run.samples_per_prompt < 2:
        raise ConfigError("run.filter", run.filter, "a group of one sample has no rewards to differ: "
                          "it needs run.samples_per_prompt >= 2")


def _check_env(config: Config) -> None:
    """An env role that can run: tools of distinct names, in line only with the simulated rollout, a reward
    that reads it."""
    env, reward = config.roles.env, config.roles.reward
    if config.agents is not None:
        _check_agents(config)
        return
    if env is None:
        if isinstance(reward.engine, EnvReward):
            raise ConfigError("roles.reward.engine.kind", "env", "the environment's reward needs [roles.env] "
                                                                 "(or [agents], whose agents give it)")
        return
    try:
        check_tools(env.tools)
    except ValueError as exc:
        raise ConfigError("roles.env.tools", [t.path for t in env.tools], str(exc)) from None
    if env.inline and not isinstance(config.roles.rollout.engine, SimRollout):
        raise ConfigError("roles.env.inline", True, "running the environment in line is a layout of the simulated "
                                                    "rollout")
    if env.inline and env.pool:
        raise ConfigError("roles.env.pool", env.pool, "an environment run in line (inline = true) runs on no pool "
                                                      "of its own: leave it out")
    if reward.inline:
        raise ConfigError("roles.reward.inline", True, "episodes (a run with [roles.env]) are scored by the reward "
                                                       "role")


def _check_agents(config: Config) -> None:
    """Outside agents play the episodes: not beside an environment, scored by the reward role, with
    the staleness bound checked when an episode starts."""
    agents = config.agents
    if agents is None:
        return
    if config.roles.env is not None:
        raise ConfigError("agents", "[agents]", "the episodes are played either by outside agents ([agents]) or by "
                                                "the env role ([roles.env]), not both: leave one out")
    if config.roles.reward.inline:
        raise ConfigError("roles.reward.inline", True, "episodes (a run with [agents]) are scored by the reward role")
    if config.run.staleness_check == "strict":
        raise ConfigError("run.staleness_check", "strict", "an agent's tool calls cannot be played again, so its "
                                                           "episodes are bounded when they start: use 'admission'")
    if agents.command and not agents.command[0]:
        raise ConfigError("agents.command", agents.command, "names no program")


def _check_ranks(config: Config, name: str) -> None:
    """Ranks of a sharded model (a stateful role's) on GPUs take a GPU each (NCCL refuses two ranks of one
    group on one device)."""
    ranked = dict(config.role_items())[name]
    pool = config.pools[ranked.pool]
    if ranked.replicas == 1 or pool.gpus_per_bundle == 0:
        return
    # As placement shares them: replicas round-robin over the bundles, the first bundle the most crowded.
    crowd = sum(math.ceil(role.replicas / pool.bundles) for _, role in config.role_items() if role.pool == ranked.pool)
    if pool.gpus_per_bundle / crowd < 1:
        raise ConfigError(
            f"roles.{name}.replicas", ranked.replicas,
            f"{name} ranks on GPUs need a GPU each; pool {ranked.pool!r} gives each replica "
            f"{pool.gpus_per_bundle / crowd:g} (raise its gpus_per_bundle or bundles_per_node, or run fewer ranks)",
        )


def _check_lora(config: Config) -> None:
    """A KL penalty to the base in the reward is worked out by trainer rank 0
    alone, before the step is dealt to the ranks: one rank only."""
    trainer, lora = config.roles.trainer, config.lora
    engine = trainer.engine
    if (lora is None or lora.reference != "base" or not isinstance(engine, TorchTrainer) or engine.kl_coef == 0
            or engine.kl_in != "reward"):
        return
    if trainer.replicas > 1:
        raise ConfigError("roles.trainer.engine.kl_in", "reward",
                          "with lora.reference = 'base' and several trainer ranks the KL penalty goes in the loss "
                          "(kl_in = 'loss'): the base's log-probabilities are worked out by every rank on its share")
