"""The typed run configuration, read from TOML and `--set key.path=value`.

One module per job:

* `schema`: the tables, msgspec Structs that forbid unknown keys, with
  bounded numbers, tagged unions on a ``kind`` key for alternatives (which
  engine a role runs) and a docstring on every field;
* `loading`: `load` reads the file, applies the overrides to the same raw
  tables and validates the whole; `to_toml` writes the resolved config;
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
from rlflow.config.loading import apply_override, from_dict, load, resolve_run_dir, to_toml
from rlflow.config.schema import (
    ADAPTER_DIR,
    ArithTask,
    ClusterConfig,
    Config,
    CriticEngine,
    CriticRole,
    DatasetTask,
    Distribution,
    EnvReward,
    AgentsConfig,
    EnvRole,
    EvalConfig,
    Fixed,
    Fraction,
    FunctionsReward,
    LogNormal,
    Lora,
    MetricsConfig,
    ModelTeacher,
    NonNegFloat,
    NonNegInt,
    Pareto,
    PoolConfig,
    PosFloat,
    PosInt,
    ReasoningGymTask,
    RewardEngine,
    RewardRole,
    RolesConfig,
    RolloutEngine,
    RolloutRole,
    RunConfig,
    SimCritic,
    SimReward,
    SimRollout,
    SimTask,
    SimTeacher,
    SimTrainer,
    Table,
    TaskConfig,
    TaskReward,
    TeacherEngine,
    TeacherRole,
    TorchCritic,
    TorchTrainer,
    TrainerEngine,
    TrackioConfig,
    TrainerRole,
    VllmRollout,
    WandbConfig,
    kind_of,
    undocumented_fields,
)

__all__ = [
    "ADAPTER_DIR",
    "ArithTask",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "CriticEngine",
    "CriticRole",
    "DatasetTask",
    "Distribution",
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
    "ModelTeacher",
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
    "SimCritic",
    "SimReward",
    "SimRollout",
    "SimTask",
    "SimTeacher",
    "SimTrainer",
    "Table",
    "TaskConfig",
    "TaskReward",
    "TeacherEngine",
    "TeacherRole",
    "ToolSpec",
    "TorchCritic",
    "TorchTrainer",
    "TrainerEngine",
    "TrackioConfig",
    "TrainerRole",
    "VllmRollout",
    "WandbConfig",
    "apply_override",
    "check",
    "from_dict",
    "kind_of",
    "load",
    "resolve_run_dir",
    "to_toml",
    "undocumented_fields",
]
