"""The run directory, as a contract: every file a run writes, named once, and
the typed records in the JSON files.

    config.toml          the resolved config the services got (absolute paths)
    controller.json      the controller's address, pid, the run's secret and CURVE keys (owner-only)
    join.json            what a replica the user starts needs to join (`JoinInfo`, owner-only; runs with external roles)
    status.json          `Status`, rewritten twice a second; what `rlflow status` reads
    metrics.jsonl        one `StepRow` per optimizer step
    ledger.jsonl         every change of the ledger of groups (`rlflow.control.ledger.Event`)
    evals.jsonl          one `EvalRow` per held-out evaluation
    summary.json         `Summary`, at the end
    run.log, run.pid     the detached run's output and process (`rlflow up --detach`)
    logs/ROLE-RANK.log   each service's log
    trace/ROLE-RANK.json each replica's state timeline over every life of it (`rlflow.timeline`;
                         ROLE-RANK.events.jsonl while one runs); trace/lengths-RANK.jsonl the trained lengths
    checkpoints/step-NNNNNN/   a Hugging Face model directory plus trainer (optimizer/: a torch
                         distributed checkpoint) and controller state
    checkpoints/ROLE-step-NNNNNN/   another role with weights of its own (`RoleSpec.stateful`) at
                         its step NNNNNN: its Hugging Face directory, optimizer and step
    tensorboard/         event files, when TensorBoard is installed
    timeline.png, trace.json, curves.png   written by `rlflow report`

Nothing else in rlflow spells these names.

A run may take several sessions: one that stopped short (its trainer or its
controller killed) is continued by `rlflow up --resume` from its newest
checkpoint. The files still read as one run: on resume, what the earlier
sessions wrote past the checkpoint (their steps went with the weights that
took them) is cut from metrics.jsonl, evals.jsonl and the trainer's lengths,
TensorBoard is told to forget those steps, and `StepRow.time_s` goes on from
the last step kept (`rlflow.control.record`). ledger.jsonl is the one file
that keeps everything: `rlflow audit` replays the resume it records.
"""

from __future__ import annotations

import enum
import os
import pathlib
import time
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from rlflow.data.net import CurveKeys
from rlflow.protocol import Counters, EngineLoad
from rlflow.roles import STATEFUL

# ---------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------


class Record(msgspec.Struct, kw_only=True, frozen=True):
    """Base of the run directory's JSON records."""


def _named(wire: type, name: str, doc: str) -> type:
    """A record with `wire`'s fields by name: the wire's Structs are positional (`array_like`), and a file
    for people and scripts says which number is which."""
    fields = [(f.name, f.type, f.default if f.default is not msgspec.NODEFAULT
               else msgspec.field(default_factory=f.default_factory)) for f in msgspec.structs.fields(wire)]
    record = msgspec.defstruct(name, fields, bases=(Record,), module=__name__)
    record.__doc__ = doc
    return record


if TYPE_CHECKING:
    # `_named` builds these at run time (below). To a type checker each is a record with the fields of the
    # wire's Struct: it subclasses that Struct here for its fields alone (at run time it does not).
    class CounterTotals(Record, Counters, frozen=True): ...

    class EngineTotals(Record, EngineLoad, frozen=True): ...
else:
    #: A role's counts added up, by name (the fields of the wire's `Counters`).
    CounterTotals = _named(Counters, "CounterTotals", "A role's counts added up (the fields of the wire's Counters).")
    #: A rollout role's engines now, by name (the fields of the wire's `EngineLoad`).
    EngineTotals = _named(EngineLoad, "EngineTotals",
                          "A rollout role's engines now, added up (the fields of the wire's EngineLoad).")


def named(wire: Any) -> Any:
    """A `Counters` or `EngineLoad` as the record of the same fields by name (None stays None)."""
    if wire is None:
        return None
    kind = CounterTotals if isinstance(wire, Counters) else EngineTotals
    return kind(**msgspec.structs.asdict(wire))


class Shares(Record, frozen=True):
    """Shares of a role's time in each state (they add up to 1 when it reported)."""

    busy: float = 0.0
    starved: float = 0.0
    blocked: float = 0.0
    loading: float = 0.0


class EngineStep(Record, frozen=True):
    """The rollout's engines at the end of a step: requests running and
    waiting, KV-cache use (the fullest replica's) and preemptions during the step."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    preemptions: int = 0


class StepRow(Record, frozen=True):
    """One optimizer step, as the controller saw it (a line of metrics.jsonl)."""

    step: int
    version: int
    time_s: float
    """Seconds of training since the run started: a resumed session goes on from the time of the
    last step it kept (time spent on steps lost with a killed trainer, and between sessions, is not
    counted)."""
    samples: int = 0
    tokens: int = 0
    reward_mean: float | None = None
    """Mean reward of the step's samples (None: none had one)."""
    staleness_mean: float = 0.0
    """Versions between each trained token's policy and the trainer's, averaged over tokens."""
    staleness_max: float = 0.0
    train_s: float = 0.0
    """Seconds the trainer computed (forward, backward, optimizer)."""
    occupancy: float | None = None
    """Share of the rollout's slots in use over the step (engines that count slot time)."""
    roles: dict[str, Shares] = {}
    """Each role's time over the step."""
    train: dict[str, float] = {}
    """The trainer engine's own statistics (loss, gradient norm, clipped share, ...)."""
    reward_failed_share: float | None = None
    """Share of the samples scored over the step whose reward could not be computed (read from the
    reward replicas' heartbeats: the samples they scored while the step ran, not the step's)."""
    engine: EngineStep | None = None
    """The rollout's engines at the step's end (engines that report a scheduler)."""
    controller_msgs: int = 0
    """Messages the controller had received by then."""

    def learning(self) -> dict[str, Any]:
        """What the step learned from, and how: the row without what measures time or load (the
        seconds, the roles' shares, the engines' queues, the controller's messages, the reward's
        failed share over the step's time, the trainer's statistics in seconds, named `*_s`). Two
        runs with `run.deterministic` write the same."""
        row = msgspec.to_builtins(self)
        for key in _MEASURED:
            row.pop(key, None)
        row["train"] = {k: v for k, v in self.train.items() if not k.endswith("_s")}
        return row


class EvalRow(Record, frozen=True):
    """One held-out evaluation (a line of evals.jsonl)."""

    step: int
    """Steps trained when it ended (the trainer goes on while it runs)."""
    version: int
    """Policy version held when it started."""
    version_end: int
    """Policy version held when it ended (weights may change while it runs)."""
    seconds: float
    metrics: dict[str, float]
    """``accuracy`` and its breakdown (e.g. ``accuracy.digits_3``)."""

    @property
    def accuracy(self) -> float | None:
        return self.metrics.get("accuracy")

    def learning(self) -> dict[str, Any]:
        """The evaluation without what measures time: its seconds, and the step at which it ended
        (`StepRow.learning`)."""
        row = msgspec.to_builtins(self)
        row.pop("seconds")
        row.pop("step")
        return row


#: A `StepRow`'s fields that measure time or load, which no two runs share.
_MEASURED = ("time_s", "train_s", "occupancy", "roles", "engine", "controller_msgs", "reward_failed_share")


class Placed(Record, frozen=True):
    """Where one replica runs, and how it fares."""

    rank: int
    host: str
    pid: int
    incarnation: int = 0
    endpoints: dict[str, str] = {}
    state: str = "ready"
    """hello, ready, lost (waiting to be restarted), restarting, given_up, gone."""
    restarts: int = 0
    """Incarnations started after its first."""
    restart_in_s: float | None = None
    """Lost: seconds until its restart (its back-off; None: not waiting for one)."""
    last_error: str = ""
    external: bool = False
    """Started by the user (`launch = "external"`), not by rlflow."""
    threads: int = 0
    cpus: str = ""
    model: str = ""


class RoleStatus(Record, frozen=True):
    """One role, now."""

    replicas: int
    up: int
    restarts: int = 0
    """Replicas of the role restarted so far."""
    placed: list[Placed] = []
    states: Shares = Shares()
    """Over the last few heartbeats."""
    queues: dict[str, int] = {}
    counters: CounterTotals = CounterTotals()
    """Its replicas' counts, added up."""
    engine: EngineTotals | None = None
    """A rollout role: its replicas' engines now, added up (KV-cache use: the fullest replica's)."""
    version: int | None = None
    """Oldest policy version its replicas hold (None: the role holds no policy)."""
    behind: int | None = None
    """Versions that is behind the trainer (None: the role holds no policy)."""


class ControllerStats(Record, frozen=True):
    """The controller's own load."""

    messages_received: int = 0
    messages_per_s: float = 0.0
    bytes_received: int = 0
    bytes_sent: int = 0
    rejected: dict[str, int] = {}
    """Messages rejected by the protocol's checks, by kind."""
    ignored: dict[str, int] = {}
    """Well-formed messages ignored: from an unknown sender, or without the run's secret."""
    by_type: dict[str, int] = {}
    cpu_s: float = 0.0
    cpu_share: float = 0.0
    """Of one core: the controller's thread."""
    process_cpu_share: float = 0.0
    """Of one core: its whole process (with `rlflow up`, also the Ray driver's threads)."""
    latency_p50_ms: float = 0.0
    """How long a message waited for the controller and its handling, from taken off the socket to
    handled: the median (the upper edge of a histogram's bucket, at most 26% above), ..."""
    latency_p99_ms: float = 0.0
    """... the 99th percentile ..."""
    latency_max_ms: float = 0.0
    """... and the longest."""


class GroupCounts(Record, frozen=True):
    """The ledger's groups."""

    queued: int = 0
    generating: int = 0
    downstream: int = 0
    received: int = 0
    trained: int = 0
    granted: int = 0
    reissued: int = 0
    dropped: dict[str, int] = {}
    """Groups dropped for good, by reason."""


class Trend(Record, frozen=True):
    """A training statistic over the latest steps (e.g. ``kl_teacher``)."""

    last: float
    mean: float
    """Over the last `steps` steps."""
    steps: int
    change: float | None = None
    """`mean` minus the mean of the `steps` steps before (None: not that many yet)."""


class Phase(enum.StrEnum):
    """Where a run is (status.json's `state`; written as the plain string)."""

    STARTING = "starting"
    RUNNING = "running"
    EVALUATING = "evaluating"
    STOPPED = "stopped"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    DEAD = "dead"
    """Its controller is gone without saying so (what `rlflow.runstate` finds; `rlflow down` writes it)."""

    @property
    def live(self) -> bool:
        """Whether the run is under way (it trains or evaluates)."""
        return self in (Phase.RUNNING, Phase.EVALUATING)

    @property
    def ended(self) -> bool:
        return self in (Phase.STOPPED, Phase.FAILED, Phase.INTERRUPTED, Phase.DEAD)


class Status(Record, frozen=True):
    """A run now (status.json)."""

    run_id: str
    state: str
    """A `Phase`: starting, evaluating, running, stopped, failed, interrupted; or dead: its controller is
    gone without saying so (what `rlflow.runstate` finds and every command says; `rlflow down` writes it here)."""
    error: str | None = None
    pid: int = 0
    host: str = ""
    address: str | None = None
    elapsed_s: float = 0.0
    step: int = 0
    steps: int = 0
    samples: int = 0
    """Samples trained on so far (the whole run: a resumed run counts the steps it kept)."""
    version: int = 0
    mode: str = ""
    max_staleness: int = 0
    staleness_check: str = ""
    groups: GroupCounts = GroupCounts()
    last_step: StepRow | None = None
    last_eval: EvalRow | None = None
    roles: dict[str, RoleStatus] = {}
    controller: ControllerStats = ControllerStats()
    warnings: list[str] = []
    """The latest things a person should look at (e.g. rewards failing, a reward
    function that cannot score a reference answer)."""
    waiting_for: list[str] = []
    """External replicas (``role-rank``) the run waits for: not up (`rlflow join` says what each needs)."""
    trends: dict[str, Trend] = {}
    """Training statistics to watch as they move (`rlflow.control.stats.TRENDS`: e.g. ``kl_teacher``, the
    per-token KL to the reference the batches carry)."""


class SessionTotals(Record, frozen=True):
    """One session of a run: from its start, or its resume, to its end."""

    first_step: int = 0
    """The step it started from: 0, or the checkpoint it resumed from."""
    steps: int = 0
    samples: int = 0
    tokens: int = 0
    groups_trained: int = 0
    wall_time_s: float = 0.0
    """Seconds from the start of its training to its end."""
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0


class Summary(Record, frozen=True):
    """A finished run, or the latest session of it (summary.json).

    `steps`, `samples`, `tokens`, `wall_time_s`, their rates and `groups` are
    the whole run's, over every session (what each kept: see `StepRow.time_s`);
    `session` is the one that wrote it.
    """

    run_id: str
    state: str
    error: str | None = None
    stop_reason: str = ""
    mode: str = ""
    max_staleness: int = 0
    staleness_check: str = ""
    steps: int = 0
    samples: int = 0
    tokens: int = 0
    wall_time_s: float = 0.0
    """Seconds of training over the whole run (the time of its last step, plus what came after in
    the last session)."""
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    staleness_max: float = 0.0
    staleness_mean: float = 0.0
    reward_mean: float | None = None
    weights_load_s_mean: float = 0.0
    kv_cache_usage_mean: float | None = None
    """The rollout's KV-cache use at the end of each step, averaged (engines that report one)."""
    waiting_mean: float | None = None
    """Requests waiting for a slot or KV-cache room at the end of each step, averaged."""
    preemptions: int = 0
    """Requests the rollout's engines preempted for want of KV-cache room over the run."""
    evals: list[EvalRow] = []
    accuracy_before: float | None = None
    accuracy_after: float | None = None
    accuracy_last3_mean: float | None = None
    """Mean of the last three evaluations (one run's readings move by a few points)."""
    gain_points: float | None = None
    """accuracy_last3_mean - accuracy_before, in percentage points."""
    groups: GroupCounts = GroupCounts()
    data_bytes: int = 0
    """Bytes the rollout sent downstream (this session)."""
    roles: dict[str, Shares] = {}
    """Each role's time over this session (from its services' heartbeats)."""
    controller: ControllerStats = ControllerStats()
    """The controller's own load (this session)."""
    sessions: int = 1
    """Sessions the run took: one, and one more for each resume."""
    session: SessionTotals | None = None
    """This session alone (None in a summary written before sessions were told apart)."""
    weights_checked: int = 0
    """Weight updates a replica reported with the checksum the trainer sent (adapters, and weights over
    ZeroMQ; a checksum that differs fails the run)."""


class AgentsInfo(Record, frozen=True):
    """Where outside agents take episodes (agents.json, owner-only; a run with `[agents]`, see
    docs/agents.md): each rollout replica's endpoint, and the key every request carries."""

    urls: dict[str, str]
    """Each rollout replica's endpoint (``http://HOST:PORT``), by replica name."""
    api_key: str
    """The run's key (``Authorization: Bearer KEY``; the `openai` package's ``api_key``)."""
    url: str = ""
    """The router's endpoint, one for every replica (``agents.router``; empty without it)."""


class JoinInfo(Record, frozen=True):
    """What a replica the user starts needs to join the run (join.json, owner-only;
    `rlflow join` prints it as environment variables, see SPEC.md, *Start-up parameters*)."""

    run_id: str
    controller: str
    """The controller's ROUTER address."""
    secret: str
    """The run's secret, shown in `Hello.secret`."""
    host: str
    """The address a replica binds its own sockets on (empty: its own IP)."""
    replicas: dict[str, int]
    """Replicas of each role (`Hello.replicas`)."""
    external: list[str]
    """The replicas the user starts (``role-rank``)."""
    curve: CurveKeys | None = None
    """The run's CURVE keys (None: the run stays on loopback and needs none)."""
    handshake_timeout_s: float = 300.0
    """How long the controller waits for a hello, and for `Ready` after its welcome; a replica waits as
    long for its `Welcome` (cluster.handshake_timeout_s)."""
    heartbeat_timeout_s: float = 60.0
    """A replica the controller hears nothing from for this long is presumed lost (cluster.heartbeat_timeout_s)."""


class ControllerInfo(Record, frozen=True):
    """How to reach a run's controller (controller.json, owner-only)."""

    run_id: str
    pid: int
    address: str
    secret: str
    curve: CurveKeys | None = None
    """The run's CURVE keys, which a client needs to reach `address` (None: loopback, none needed)."""


R = TypeVar("R", bound=msgspec.Struct)


# ---------------------------------------------------------------------------
# The directory
# ---------------------------------------------------------------------------


class RunDir:
    """The files of one run (see the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    @property
    def config(self) -> pathlib.Path:
        return self.path / "config.toml"

    @property
    def controller(self) -> pathlib.Path:
        return self.path / "controller.json"

    @property
    def status(self) -> pathlib.Path:
        return self.path / "status.json"

    @property
    def agents(self) -> pathlib.Path:
        """Where outside agents take episodes (`AgentsInfo`, owner-only)."""
        return self.path / "agents.json"

    @property
    def join(self) -> pathlib.Path:
        """What a replica the user starts needs (`JoinInfo`, owner-only)."""
        return self.path / "join.json"

    @property
    def metrics(self) -> pathlib.Path:
        return self.path / "metrics.jsonl"

    @property
    def ledger(self) -> pathlib.Path:
        """Every change of the controller's ledger of groups (`rlflow audit` replays it)."""
        return self.path / "ledger.jsonl"

    @property
    def evals(self) -> pathlib.Path:
        return self.path / "evals.jsonl"

    @property
    def summary(self) -> pathlib.Path:
        return self.path / "summary.json"

    @property
    def run_log(self) -> pathlib.Path:
        return self.path / "run.log"

    @property
    def run_pid(self) -> pathlib.Path:
        return self.path / "run.pid"

    @property
    def logs(self) -> pathlib.Path:
        return self.path / "logs"

    @property
    def traces(self) -> pathlib.Path:
        return self.path / "trace"

    @property
    def checkpoints(self) -> pathlib.Path:
        return self.path / "checkpoints"

    @property
    def tensorboard(self) -> pathlib.Path:
        return self.path / "tensorboard"

    @property
    def timeline_png(self) -> pathlib.Path:
        return self.path / "timeline.png"

    @property
    def trace_json(self) -> pathlib.Path:
        return self.path / "trace.json"

    @property
    def curves_png(self) -> pathlib.Path:
        return self.path / "curves.png"

    def service_log(self, name: str) -> pathlib.Path:
        """``logs/<role>-<rank>.log``."""
        return self.logs / f"{name}.log"

    def service_trace(self, name: str) -> pathlib.Path:
        """``trace/<role>-<rank>.json``: a service's state timeline."""
        return self.traces / f"{name}.json"

    def service_events(self, name: str) -> pathlib.Path:
        """``trace/<role>-<rank>.events.jsonl``: a running service's state
        changes so far, one per line (it ends in the service's trace)."""
        return self.traces / f"{name}.events.jsonl"

    def lengths(self, rank: int) -> pathlib.Path:
        """``trace/lengths-<rank>.jsonl``: what a trainer rank trained on, per step."""
        return self.traces / f"lengths-{rank}.jsonl"

    def checkpoint(self, step: int) -> pathlib.Path:
        return self.checkpoints / f"step-{step:06d}"

    def role_checkpoint(self, role: str, step: int) -> pathlib.Path:
        """The checkpoint of `role` (one with weights of its own, not the trainer) at its step `step`,
        beside the trainer's of that step."""
        return beside(self.checkpoint(step), role)

    def latest_checkpoint(self) -> pathlib.Path | None:
        """The newest checkpoint that both trainer and controller finished and
        every other role that has written checkpoints in this run too."""
        done = sorted(p.parent for p in self.checkpoints.glob(f"step-*/{CONTROLLER_STATE}"))
        for role in STATEFUL:
            finished = {p.parent.name.removeprefix(f"{role}-")
                        for p in self.checkpoints.glob(f"{role}-step-*/{RUN_STATE}")}
            if finished:
                done = [p for p in done if p.name in finished]
        return done[-1].resolve() if done else None

    # -- records ---------------------------------------------------------------

    def read_status(self) -> Status | None:
        return read_json(self.status, Status)

    def read_summary(self) -> Summary | None:
        return read_json(self.summary, Summary)

    def read_controller(self) -> ControllerInfo | None:
        return read_json(self.controller, ControllerInfo)

    def read_agents(self) -> AgentsInfo | None:
        return read_json(self.agents, AgentsInfo)

    def read_join(self) -> JoinInfo | None:
        return read_json(self.join, JoinInfo)

    def read_metrics(self) -> list[StepRow]:
        return read_jsonl(self.metrics, StepRow)

    def read_evals(self) -> list[EvalRow]:
        return read_jsonl(self.evals, EvalRow)

    def append_ledger(self, events: list[Any]) -> None:
        """Append the ledger's changes (`rlflow.control.ledger.Event`s), each stamped with the time now."""
        if events:
            now = round(time.time(), 3)
            with open(self.ledger, "ab") as f:
                f.write(b"".join(_encoder.encode(msgspec.structs.replace(e, t=now)) + b"\n" for e in events))


#: Beside a checkpoint's model: the controller's ledger and clock.
CONTROLLER_STATE = "controller_state.json"
#: Beside a checkpoint's model: the trainer's RNG and step (and, written
#: before the trainer was sharded, its optimizer).
TRAINER_STATE = "trainer_state.pt"
#: Beside a checkpoint's model: the optimizer's state, a torch distributed
#: checkpoint that any number of trainer ranks can read.
TRAINER_OPTIMIZER = "optimizer"
#: Beside a checkpoint's model: the trainer's step and version.
RUN_STATE = "run_state.json"


def beside(checkpoint: pathlib.Path, role: str) -> pathlib.Path:
    """`role`'s checkpoint of the same step as the trainer's `checkpoint` (a
    folder of its own: the trainer replaces its folder whole when it writes)."""
    return checkpoint.with_name(f"{role}-{checkpoint.name}")


_encoder = msgspec.json.Encoder()


def encode(record: Record) -> bytes:
    return _encoder.encode(record)


def write_json(path: pathlib.Path, record: Any, *, private: bool = False) -> None:
    """Replace `path` atomically with `record` as JSON (owner-only if `private`)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.format(_encoder.encode(record), indent=1))
    os.replace(tmp, path)


def append_jsonl(path: pathlib.Path, record: Any) -> None:
    with open(path, "ab") as f:
        f.write(_encoder.encode(record) + b"\n")


def read_json(path: pathlib.Path, kind: type[R]) -> R | None:
    """The record in `path`; None if it is missing or not (yet) complete."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=kind)
    except (OSError, msgspec.DecodeError):
        return None


def read_jsonl(path: pathlib.Path, kind: type[R]) -> list[R]:
    """Every record of a JSON-lines file (a torn last line, one not ended
    yet by its newline, is left out: it is being written)."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    lines = data.splitlines()
    decoder = msgspec.json.Decoder(kind)
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(decoder.decode(line))
        except msgspec.DecodeError as exc:
            if i == len(lines) - 1 and not data.endswith(b"\n"):
                break
            raise ValueError(f"{path}, line {i + 1}: not a {kind.__name__}: {exc}") from exc
    return out
