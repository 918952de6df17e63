"""The typed run configuration, read from TOML and `--set key.path=value`.

One module per job:

* the tables, msgspec Structs that forbid unknown keys, with bounded numbers,
  tagged unions on a ``kind`` key for alternatives (which engine a role runs)
  and a docstring on every field: `schema` (the root, `Config`, and the
  tables of no role), one module per role, named after it (its
  `[roles.NAME]` table, its engines and its own checks; some roles'
  are ``config`` in their folders under ``services/``),
  `run` (`[run]` and `[task]`), `cluster` (`[cluster]`, `[pools.NAME]`),
  and `base` (what they share: `Table`, bounded numbers, distributions, and
  `RoleTable` / `StartedRole`, the fields every role's table has);
* `loading`: `load` reads the file, applies the overrides to the same raw
  tables and validates the whole; `build` does the same from dicts merged
  onto a base (how benches and tests make configs in code); `to_toml` writes
  the resolved config;
* `checks`: what involves several fields (a role's pool exists, sync mode
  means no staleness, ...), run at load;
* `environment`: the specs that name the env role's environment and tools
  by import path (checked for shape here, loaded and run by `rlflow.env`);
* `explain`: msgspec's validation errors as one line;
* `errors`: `ConfigError`, whose text is one line naming the key, the value
  given and what is allowed; every problem of a config raises it.

Everything is imported from here (``from rlflow.config import Config, load``).
"""

from rlflow.config.checks import check
from rlflow.config.environment import EnvironmentSpec, ToolSpec
from rlflow.config.errors import ConfigError
from rlflow.config.loading import (
    apply_override, build, default_config_path, from_dict, load, merged, read_toml, resolve_run_dir, to_toml,
)
from rlflow.config.base import (
    Distribution,
    Fixed,
    Fraction,
    kind_of,
    LogNormal,
    NonNegFloat,
    NonNegInt,
    Pareto,
    PosFloat,
    PosInt,
    RoleTable,
    StartedRole,
    Table,
)
from rlflow.config.cluster import ClusterConfig, PoolConfig
from rlflow.config.env import EnvRole
from rlflow.config.reward import EnvReward, FunctionsReward, RewardEngine, RewardRole, SimReward, TaskReward
from rlflow.config.rollout import RolloutEngine, RolloutRole, SimRollout, VllmRollout
from rlflow.config.run import ArithTask, DatasetTask, ReasoningGymTask, RunConfig, SimTask, TaskConfig
from rlflow.config.schema import (
    AgentsConfig,
    Config,
    EvalConfig,
    MetricsConfig,
    RolesConfig,
    TrackioConfig,
    undocumented_fields,
    WandbConfig,
)
from rlflow.config.trainer import ADAPTER_DIR, Lora, SimTrainer, TorchTrainer, TrainerEngine, TrainerRole

__all__ = [
    "ADAPTER_DIR",
    "ArithTask",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DatasetTask",
    "default_config_path",
    "Distribution",
    "RoleTable",
    "StartedRole",
    "EnvReward",
    "AgentsConfig",
    "EnvRole",
    "EnvironmentSpec",
    "EvalConfig",
    "Fixed",
    "Fraction",
    "FunctionsReward",
    "LogNormal",
    "Lora",
    "MetricsConfig",
    "NonNegFloat",
    "NonNegInt",
    "Pareto",
    "PoolConfig",
    "PosFloat",
    "PosInt",
    "ReasoningGymTask",
    "RewardEngine",
    "RewardRole",
    "RolesConfig",
    "RolloutEngine",
    "RolloutRole",
    "RunConfig",
    "SimReward",
    "SimRollout",
    "SimTask",
    "SimTrainer",
    "Table",
    "TaskConfig",
    "TaskReward",
    "ToolSpec",
    "TorchTrainer",
    "TrainerEngine",
    "TrackioConfig",
    "TrainerRole",
    "VllmRollout",
    "WandbConfig",
    "apply_override",
    "build",
    "check",
    "from_dict",
    "kind_of",
    "load",
    "merged",
    "read_toml",
    "resolve_run_dir",
    "to_toml",
    "undocumented_fields",
]
