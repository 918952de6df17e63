"""The replicas of a run as the controller sees them: plain code, no I/O.

* `Replica`, in one `State` at a time:

      (hello) HELLO --ready--> READY --lost--> LOST --restart due--> RESTARTING --hello--> HELLO ...
                                        |                                  |
                                        +-- deaths over budget --> GIVEN_UP <-- not back in time (and over budget)
      READY --bye--> GONE

  An external replica (started by the user, not the launcher) cannot be
  restarted: once lost it waits in LOST for a new incarnation of its own
  until `handshake_timeout_s`, then is given up on.
* `admit`: whether a `Hello` may join, a pure function of the hello, the
  replicas the run expects, the run's secret and schema version, and the
  replica registered under that role and rank, if any.
* `Supervisor`: the supervision policy over an injected clock: when a
  replica counts as lost (silent, hung, or a restart that does not come
  back), how long to wait before restarting it (a back-off that doubles
  with each death in a window, with jitter, capped), and when to give up
  (more deaths in `restart_window_s` than `max_restarts`).
"""

from __future__ import annotations

import collections
import enum
import logging
import math
import random
import secrets
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass, field
from typing import Any

from rlflow.algo.staleness import groups_held
from rlflow.errors import RunFailed
from rlflow.protocol import UNAUTHENTICATED, UNEXPECTED_HELLO, WRONG_VERSION, ErrorReport, Hello
from rlflow.roles import STATEFUL

log = logging.getLogger("rlflow.controller")


class State(enum.Enum):
    HELLO = "hello"
    """Registered (said hello); not ready yet."""
    READY = "ready"
    """Working."""
    LOST = "lost"
    """Presumed dead; restarted when its back-off has passed (or, external, waited for)."""
    RESTARTING = "restarting"
    """A new incarnation is being started; no hello from it yet."""
    GIVEN_UP = "given_up"
    """Not restarted again."""
    GONE = "gone"
    """Said goodbye (the run is ending)."""


#: States of a replica that the run counts on now or soon.
REGISTERED = (State.HELLO, State.READY)


@dataclass
class Replica:
    """One replica: who it is, what it holds, how it has fared."""

    role: str
    rank: int
    identity: bytes
    """Its control socket's identity (the registered incarnation's)."""
    hello: Hello
    started: float
    """When the registered incarnation was started (the first: when it said hello)."""
    external: bool = False
    """Started by the user: the controller cannot restart it."""
    state: State = State.HELLO
    version: int = 0
    """Version of the weights it holds (rollout, trainer: the policy's; a role with weights of its own: theirs)."""
    incarnation: int = 0
    """The registered incarnation (the one that said hello last)."""
    launched: int = 0
    """The newest incarnation started (ahead of `incarnation` while a restart comes up)."""
    last_seen: float = 0.0
    capacity: int = 1
    """Groups it may hold (rollout)."""
    progress: int = 0
    """Its heartbeat's progress count at `progressed`."""
    progressed: float = 0.0
    deaths: list[float] = field(default_factory=list)
    """When it died, within the restart window."""
    restarts: int = 0
    """Incarnations started after the first."""
    restart_at: float | None = None
    """LOST: when its restart is due."""
    last_error: str = ""
    fatal: str = ""
    """What the registered incarnation said when it reported a fatal error (its death follows)."""
    caught_up: bool = True
    """A replacement rollout replica is given work only once it holds the current weights."""

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"

    @property
    def live(self) -> bool:
        return self.state is State.READY

    @property
    def registered(self) -> bool:
        return self.state in REGISTERED

    @property
    def lost(self) -> bool:
        """Waiting for its restart, or for the new incarnation to say hello."""
        return self.state in (State.LOST, State.RESTARTING)


@dataclass(frozen=True)
class Refusal:
    """Why a hello may not join: an `ErrorReport` kind and a sentence."""

    kind: str
    message: str


def admit(hello: Hello, *, expected: set[tuple[str, int]], secret: str, schema_version: int,
          current: Replica | None) -> Refusal | None:
    """None if `hello` may join (as a first hello, or as the next incarnation
    of `current`, the replica registered under its role and rank); else why not."""
    name = f"{hello.role.label}-{hello.rank}"
    if hello.schema_version != schema_version:
        return Refusal(WRONG_VERSION, f"{name} speaks schema version {hello.schema_version}, "
                                      f"this controller {schema_version}")
    if not secrets.compare_digest(hello.secret, secret):
        return Refusal(UNAUTHENTICATED, f"a hello from {name} without the run's secret")
    if (hello.role.label, hello.rank) not in expected:
        return Refusal(UNEXPECTED_HELLO, f"a hello from {name}, which the config does not have")
    if current is None:
        return None
    if current.state not in (State.LOST, State.RESTARTING):
        return Refusal(UNEXPECTED_HELLO, f"{name} said hello again as incarnation {hello.incarnation} while "
                                         f"incarnation {current.incarnation} is {current.state.value}")
    if current.external:
        if hello.incarnation <= current.incarnation:
            return Refusal(UNEXPECTED_HELLO, f"{name} came back as incarnation {hello.incarnation}: an external "
                                             f"replica's next incarnation must be above {current.incarnation}")
        return None
    if current.state is not State.RESTARTING or hello.incarnation != current.launched:
        return Refusal(UNEXPECTED_HELLO, f"a hello from {name} incarnation {hello.incarnation}, while the one "
                                         f"expected is incarnation {current.launched} ({current.state.value})")
    return None


def supersedes(hello: Hello, current: Replica | None, *, expected: set[tuple[str, int]], secret: str,
               schema_version: int) -> bool:
    """Whether `hello` is a later incarnation of `current`, an external replica still counted alive: its
    user restarted it before its death was seen. The new one is admitted at once, the old one presumed lost.
    An unauthenticated hello supersedes nothing."""
    return (current is not None and current.external and current.registered
            and hello.incarnation > current.incarnation
            and admit(hello, expected=expected, secret=secret, schema_version=schema_version, current=None) is None)


def register(current: Replica | None, identity: bytes, hello: Hello, now: float, samples_per_prompt: int) -> Replica:
    """The replica a hello `admit`ted makes: a new one, or `current` as its
    next incarnation (an external replica that came back counts as restarted)."""
    if current is None:
        replica = Replica(role=hello.role.label, rank=hello.rank, identity=identity, hello=hello, started=now,
                          incarnation=hello.incarnation, launched=hello.incarnation, last_seen=now)
    else:
        replica = current
        if replica.external:
            replica.launched = hello.incarnation
            replica.restarts += 1
        replica.identity, replica.hello, replica.incarnation = identity, hello, hello.incarnation
        replica.state, replica.last_seen, replica.version, replica.fatal = State.HELLO, now, 0, ""
    if replica.role == "rollout":
        replica.capacity = groups_held(hello.slots, samples_per_prompt)
    return replica


@dataclass(frozen=True)
class Policy:
    """The supervision settings (`cluster` of the config)."""

    heartbeat_timeout_s: float
    progress_timeout_s: float
    handshake_timeout_s: float
    max_restarts: int
    restart_window_s: float
    backoff_s: float
    backoff_max_s: float

    @classmethod
    def of(cls, cluster: Any) -> Policy:
        """From the config's `cluster` table."""
        return cls(heartbeat_timeout_s=cluster.heartbeat_timeout_s, progress_timeout_s=cluster.progress_timeout_s,
                   handshake_timeout_s=cluster.handshake_timeout_s, max_restarts=cluster.max_restarts,
                   restart_window_s=cluster.restart_window_s, backoff_s=cluster.restart_backoff_s,
                   backoff_max_s=cluster.restart_backoff_max_s)


@dataclass(frozen=True)
class Restart:
    """Restart the replica `delay_s` from now."""

    delay_s: float


@dataclass(frozen=True)
class GiveUp:
    """Do not restart it again."""

    reason: str


def evidence(replica: Replica, beat: Any, holders: collections.Counter[int]) -> tuple[int | None, bool]:
    """What `Supervisor.review` judges `replica` by: its progress counter (None for the trainer, or
    before a heartbeat: `beat` is its last) and whether it holds work (a rollout replica: groups
    it generates, in `holders`, the ledger's; any other: a queue its heartbeat says is not empty)."""
    progress = None if replica.role == "trainer" or beat is None else beat.counters.progress
    if replica.role == "rollout":
        return progress, holders[replica.rank] > 0
    return progress, beat is not None and any(v > 0 for v in beat.queues.values())


class Supervisor:
    """The policy of `Policy` over the clock `now` (see the module)."""

    def __init__(self, policy: Policy, now: Callable[[], float], rng: random.Random | None = None):
        self.policy = policy
        self.now = now
        self.rng = rng or random.Random()

    def silent_or_hung(self, replica: Replica, progress: int | None, holds_work: bool) -> str | None:
        """Why a live replica is presumed lost now, or None. `progress`: its
        latest heartbeat's progress count (None: no heartbeat yet, or a
        role not watched for progress); `holds_work`: whether it has work
        it should be getting on with."""
        now, policy = self.now(), self.policy
        if now - replica.last_seen > policy.heartbeat_timeout_s:
            return (f"sent nothing for {now - replica.last_seen:.0f} s (cluster.heartbeat_timeout_s): "
                    "presumed dead")
        if progress is None:
            return None
        if progress != replica.progress or not holds_work:
            replica.progress, replica.progressed = progress, now
        elif now - replica.progressed > policy.progress_timeout_s:
            return (f"made no progress for {now - replica.progressed:.0f} s while holding work "
                    "(cluster.progress_timeout_s): presumed hung")
        return None

    def overdue(self, replica: Replica) -> str | None:
        """Why a restarting (or lost external) replica is given up waiting
        for: not back within `handshake_timeout_s` of its start (a restart
        that is merely slow, its process alive, is not a death before then)."""
        waiting = self.now() - replica.started
        if replica.state is State.RESTARTING and waiting > self.policy.handshake_timeout_s:
            return f"was not back within {self.policy.handshake_timeout_s:g} s of its restart " \
                   "(cluster.handshake_timeout_s)"
        if replica.external and replica.state is State.LOST and waiting > self.policy.handshake_timeout_s:
            return (f"(external) did not come back within {self.policy.handshake_timeout_s:g} s "
                    "(cluster.handshake_timeout_s)")
        return None

    def died(self, replica: Replica, why: str) -> Restart | GiveUp:
        """Record a death of `replica` (it becomes LOST); restart it after a
        back-off, or give up on it."""
        now, policy = self.now(), self.policy
        replica.deaths = [t for t in replica.deaths if now - t < policy.restart_window_s] + [now]
        replica.last_error = why
        replica.state = State.LOST
        replica.started = now
        if replica.external:
            replica.restart_at = None
            return Restart(delay_s=float("inf"))  # waited for, never restarted here
        if len(replica.deaths) > policy.max_restarts:
            replica.state = State.GIVEN_UP
            return GiveUp(f"{len(replica.deaths)} deaths in {policy.restart_window_s:g} s (cluster.restart_window_s), "
                          f"over cluster.max_restarts = {policy.max_restarts}")
        delay = self.backoff(len(replica.deaths))
        replica.restart_at = now + delay
        return Restart(delay_s=delay)

    def backoff(self, deaths: int) -> float:
        """The wait before restarting a replica that died `deaths` times in
        the window: doubling from `backoff_s`, capped at `backoff_max_s`,
        with up to 25% jitter either way (so that replicas that died together
        do not all come back together)."""
        base = min(self.policy.backoff_max_s, self.policy.backoff_s * 2 ** max(0, deaths - 1))
        return min(self.policy.backoff_max_s, base * self.rng.uniform(0.75, 1.25))

    def review(self, replica: Replica, progress: int | None, holds_work: bool) -> tuple[str, str] | None:
        """What to do about `replica` now: ("lose", why) for one presumed lost
        (silent, hung, or a restart overdue: its process is ended), ("give_up",
        why) for an external replica that did not come back, ("restart", "")
        when a lost replica's back-off has passed; None: nothing."""
        if replica.state is State.RESTARTING or (replica.external and replica.state is State.LOST):
            why = self.overdue(replica)
            if why is not None:
                return ("give_up" if replica.external else "lose"), why
        elif self.due(replica):
            return "restart", ""
        elif replica.live:
            why = self.silent_or_hung(replica, progress, holds_work)
            if why is not None:
                return "lose", why
        return None

    def due(self, replica: Replica) -> bool:
        """Whether a lost replica's restart is due now."""
        return replica.state is State.LOST and replica.restart_at is not None and self.now() >= replica.restart_at

    def restarting(self, replica: Replica) -> None:
        """Its next incarnation is being started now."""
        replica.state, replica.restart_at, replica.started = State.RESTARTING, None, self.now()
        replica.restarts += 1
        replica.launched += 1

    def give_up(self, replica: Replica, why: str) -> GiveUp:
        """A replica that did not come back in time: lost for good."""
        replica.state = State.GIVEN_UP
        replica.last_error = why
        return GiveUp(why)


#: Roles whose replicas hold what a restart would lose (the trainer's policy and
#: optimizer, another role's own model): losing one ends the run, which resumes
#: from its checkpoints (`rlflow up --resume`).
STATEFUL_ROLES = STATEFUL

#: Replicas of one role whose probe log-probabilities (`Hello.probe`) differ by more (nats) do not run together.
PROBE_TOLERANCE = 1e-4


def reported(replica: Replica, msg: ErrorReport) -> str | None:
    """A replica's `ErrorReport`, logged: the error that stops the run (a stateful role's fatal one),
    else None. A fatal one is kept (`Replica.fatal`): the replica is exiting, and its death, when the
    launcher sees it, restarts it."""
    if msg.fatal and replica.role in STATEFUL_ROLES:
        return f"{replica.name} failed: {msg.kind}: {msg.message}"
    if msg.fatal:
        replica.fatal = f"{msg.kind}: {msg.message}"[:500]
    log.warning("[controller] %s failed: %s: %s", replica.name, msg.kind, msg.message)
    return None


def probes_disagree(replicas: Iterable[Replica]) -> str | None:
    """Why the replicas of a role that send a probe (`Hello.probe`: the
    log-probabilities they give the probe sequence) may not run together, as
    they scored it differently; or None."""
    by_role: dict[str, dict[str, list[float]]] = {}
    for r in replicas:
        if r.hello is not None and r.hello.probe:
            by_role.setdefault(r.role, {})[r.name] = r.hello.probe
    for role, probes in by_role.items():
        (first, reference), *others = probes.items()
        for name, values in others:
            gaps = [abs(a - b) for a, b in zip(values, reference, strict=True)]
            worst = math.nan if any(math.isnan(g) for g in gaps) else max(gaps, default=0.0)
            if not worst <= PROBE_TOLERANCE:  # NaN fails too
                return (f"{role} replicas disagree: {name} scores the probe sequence {worst:.2g} nats away from "
                        f"{first} (at most {PROBE_TOLERANCE:g}); they must load the same model and settings")
    return None


class Roster:
    """Every replica of the run, by (role, rank) and by the identity of its
    control socket, and the identities of incarnations presumed lost."""

    def __init__(self, expected: set[tuple[str, int]], external: Set[tuple[str, int]] = frozenset()):
        self.expected = expected
        #: The replicas the user starts (`launch = "external"`): never restarted by the controller.
        self.external = external
        self.replicas: dict[tuple[str, int], Replica] = {}
        self.by_identity: dict[bytes, Replica] = {}
        #: Identity of a retired incarnation -> its name (told to exit at every message).
        self.retired: dict[bytes, str] = {}

    def __iter__(self):
        return iter(list(self.replicas.values()))

    def died(self, failure: Any) -> Replica | None:
        """The replica whose process the launcher saw end (`failure`: its role, rank, incarnation and
        message), if that was the incarnation launched last (None: an older one's end, dealt with when
        it was replaced). One that never said hello: the run cannot start, a `RunFailed`."""
        replica = self.replicas.get((failure.role, failure.rank))
        if replica is None:
            raise RunFailed(f"{failure.role}-{failure.rank} {failure.message}")
        return replica if failure.incarnation == replica.launched else None

    def role(self, role: str) -> list[Replica]:
        """The replicas of `role`, in rank order."""
        return sorted((r for r in self.replicas.values() if r.role == role), key=lambda r: r.rank)

    def receivers(self) -> set[int]:
        """The rollout replicas that take part in weight rounds now (the live ones)."""
        return {r.rank for r in self.role("rollout") if r.live}

    @property
    def complete(self) -> bool:
        """Every expected replica has said hello."""
        return len(self.replicas) == len(self.expected)

    @property
    def ready(self) -> bool:
        """Every expected replica is live."""
        return self.complete and all(r.live for r in self.replicas.values())

    def superseded(self, hello: Hello, *, secret: str, schema_version: int) -> Replica | None:
        """The live external replica `hello` supersedes (see `supersedes`), if any."""
        current = self.replicas.get((hello.role.label, hello.rank))
        ok = supersedes(hello, current, expected=self.expected, secret=secret, schema_version=schema_version)
        return current if ok else None

    def join(self, identity: bytes, hello: Hello, *, secret: str, schema_version: int, now: float,
             samples_per_prompt: int) -> Replica | Refusal:
        """The replica `hello` registers (new, or the next incarnation of one), or why it may not."""
        key = (hello.role.label, hello.rank)
        current = self.replicas.get(key)
        refusal = admit(hello, expected=self.expected, secret=secret, schema_version=schema_version, current=current)
        if refusal is not None:
            return refusal
        replica = self.replicas[key] = register(current, identity, hello, now, samples_per_prompt)
        replica.external = key in self.external
        self.by_identity[identity] = replica
        return replica

    def retire(self, replica: Replica) -> None:
        """Its incarnation is presumed lost: what its identity says from now on is refused."""
        self.by_identity.pop(replica.identity, None)
        self.retired[replica.identity] = f"{replica.name} incarnation {replica.incarnation}"
