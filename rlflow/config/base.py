"""What every table of the config shares: the base `Table`, bounded numbers,
the distributions of simulated lengths and latencies, and the base of a
role's table (`RoleTable`: its pool and replicas; `StartedRole` adds
`launch`, for the roles a user may start, and the checks and predicates a
role's table answers for itself). Each role's own tables live in a module
named after it (here, or ``config`` in the role's folder under ``services/``,
as some roles' own); `schema` puts them together into
`Config`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Union

import msgspec
from msgspec import Meta

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Fraction = Annotated[float, Meta(ge=0, le=1)]


class Table(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Base of every config table."""


def kind_of(table: Table) -> str:
    """The ``kind`` of a table from a tagged union (e.g. an engine)."""
    return str(table.__struct_config__.tag)


# -- distributions (response lengths, latencies) ------------------------------------------------


class Fixed(Table, tag_field="kind", tag="fixed", frozen=True):
    """Always the same value."""

    value: NonNegFloat
    """The value."""


class LogNormal(Table, tag_field="kind", tag="lognormal", frozen=True):
    """exp(N(log(median), sigma)), clipped to [min, max]."""

    median: PosFloat
    """The median."""
    sigma: NonNegFloat = 1.0
    """Standard deviation of the log; 1.0 is a heavy tail."""
    min: NonNegFloat = 0.0
    """Lower clip."""
    max: PosFloat = math.inf
    """Upper clip (e.g. the length cap)."""


class Pareto(Table, tag_field="kind", tag="pareto", frozen=True):
    """scale * (1 + Pareto(alpha)), clipped to max: a power-law tail."""

    scale: PosFloat
    """The smallest value."""
    alpha: PosFloat = 1.5
    """Tail index; smaller is heavier."""
    max: PosFloat = math.inf
    """Upper clip."""


Distribution = Union[Fixed, LogNormal, Pareto]


# -- what every role's table has ----------------------------------------------------------------


class RoleTable(Table, frozen=True):
    """Base of each role's table (`[roles.NAME]`): the pool its replicas run on, and how many."""

    pool: str = ""
    """Name of the pool its replicas run on (none with `launch = "external"`)."""
    replicas: PosInt = 1
    """Replicas; they share the stream."""
    #: Whether its engine, unless simulated, loads the policy's model or its tokenizer.
    uses_policy: ClassVar[bool] = False
    #: Its keys given a new name, relative to the table (old -> (new, why)): a config with the old
    #: one is refused, naming the new (`rlflow.config.loading`).
    renamed: ClassVar[Mapping[str, tuple[str, str]]] = {}

    def check(self, config: Any) -> None:
        """Checks of this table against the rest of `config` (a `Config`) that the schema cannot make
        (`load` runs them after its own): none but a role's own."""

    def holds_policy(self, step: int) -> bool:
        """Whether this role keeps the policy as it is at the trainer's step `step` (no role does but
        one whose own learning goes first)."""
        return False

    def attaches(self) -> frozenset[str]:
        """The `SampleBatch` columns this role attaches that a trainer may learn from (a simulated
        engine's are made up: none); the trainer's table says which it reads (`TrainerRole.check`)."""
        return frozenset()


class StartedRole(RoleTable, frozen=True):
    """A role whose replicas the user may start instead of rlflow (`launch = "external"`)."""

    launch: Literal["ray", "external"] = "ray"
    """ray: rlflow starts its replicas on their pool; external: the user starts them (any language, any
    machine: see `rlflow join` and SPEC.md, *Start-up parameters*); rlflow reserves no pool for them,
    waits for their hellos and supervises them like the others, but cannot restart them."""
