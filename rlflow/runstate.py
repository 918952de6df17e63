"""What state a run is in, decided once, from its files and its processes.

status.json says what its controller last wrote: a controller killed
(SIGKILL, out of memory, its machine gone) never writes again, and the file
says "running" for ever. `run_state` reads it with the processes beside
it: a run said to be going whose controller process is gone is *dead*. Every
command that reports on a run (`rlflow status`, `down`, `report`, `audit`)
asks here, so that none of them says "running" of a dead run.

    starting, evaluating, running   its controller is at work (or, detached, starting)
    stopped                         it ran to its end, or was stopped on request
    failed                          it stopped on an error (`reason` says which)
    interrupted                     stopped by a signal or Ctrl-C
    dead                            its controller is gone without saying why

A controller is alive when its process is, on this host, and began before
its last status was written (a process that has taken its id since then does
not count). On another host it cannot be checked from here: the state is
what the file says, and `reason` says so.

`leftovers` finds what is left of a run's processes on this host: those its
status records (each replica's) and what they started, and every process
that carries its run id in its environment (``RLFLOW_RUN_ID``, set at
launch: the services, what they started, and a local Ray the run started
for itself); `end` stops them. That is what `rlflow down` cleans up of a
dead run here; its Ray actors and placement groups are
`rlflow.control.placement.remove_run`'s.
"""

from __future__ import annotations

import dataclasses
import signal
import socket

import msgspec

from rlflow.rundir import RunDir, Status

#: States of a run whose controller is at work.
LIVE = ("starting", "evaluating", "running")
#: The environment variable that marks a process as one of a run's.
RUN_ID_VAR = "RLFLOW_RUN_ID"
#: Seconds by which a status file's time may trail its writer's start (file systems round).
CLOCK_SLACK_S = 2.0


@dataclasses.dataclass(frozen=True)
class RunState:
    """A run's state and why (see the module)."""

    state: str
    reason: str = ""
    status: Status | None = None
    """What its controller last wrote, with `state` and, when dead, the reason as its error."""
    pid: int = 0
    """Its controller's process (0: not known)."""

    @property
    def live(self) -> bool:
        return self.state in LIVE


def run_state(folder: RunDir) -> RunState | None:
    """The state of the run in `folder` (None: no run was ever started there)."""
    status = folder.read_status()
    status_time = _mtime(folder.status)
    detached = _detached_pid(folder)
    if detached and (status is None or _mtime(folder.run_pid) > status_time):
        # A detached process that has not written a status of its own yet (a resume's is the last session's).
        if alive(detached, _mtime(folder.run_pid)):
            return RunState("starting", f"its process {detached} is starting", status, detached)
        if status is None:
            return RunState("dead", f"its process {detached} ended before it wrote a status; see {folder.run_log}",
                            None, detached)
    if status is None:
        return None
    if status.state not in LIVE:
        return RunState(status.state, status.error or "", status, status.pid)
    if status.host and status.host != socket.gethostname():
        return RunState(status.state, f"its controller runs on {status.host}: it cannot be checked from here",
                        status, status.pid)
    if status.pid and alive(status.pid, status_time):
        return RunState(status.state, "", status, status.pid)
    gone = f"its controller (pid {status.pid}) is gone without saying why (killed?)"
    if folder.latest_checkpoint() is not None:
        gone += f"; `rlflow up --resume {folder.path}` continues it from its newest checkpoint"
    else:
        gone += "; it has no checkpoint to continue from"
    reason = status.error or gone
    return RunState("dead", reason, msgspec.structs.replace(status, state="dead", error=reason), status.pid)


def alive(pid: int, since: float | None = None) -> bool:
    """Whether process `pid` runs (a zombie does not) and, with `since`,
    began before then (else the id was taken by another process since)."""
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return since is None or process.create_time() <= since + CLOCK_SLACK_S
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def leftovers(folder: RunDir, state: RunState) -> list[int]:
    """Processes of the run still on this host (this process, those it
    descends from and its own children aside): those its status records
    (each replica's process, if it began before the status was written) and
    what they started, and every process that carries its run id (see the
    module)."""
    import psutil

    status = state.status
    if status is None:
        return []
    # Never this process, those it descends from, nor its own children: a
    # run whose services ran in this very process records its pid.
    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents()), *(p.pid for p in me.children(recursive=True))}
    found: set[int] = set()
    if not status.host or status.host == socket.gethostname():
        since = _mtime(folder.status)
        for role in status.roles.values():
            for placed in role.placed:
                if placed.pid and placed.pid not in mine and alive(placed.pid, since):
                    found.add(placed.pid)
                    found.update(_descendants(placed.pid))
    for process in psutil.process_iter():
        try:
            if status.run_id and process.environ().get(RUN_ID_VAR) == status.run_id:
                found.add(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return sorted(found - mine)


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def end(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """SIGTERM `pids`, then SIGKILL those still there after `grace_s`; those that were running."""
    import psutil

    processes = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            process.send_signal(signal.SIGTERM)
            processes.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone, or not ours to end
            continue
    _, left = psutil.wait_procs(processes, timeout=grace_s)
    for process in left:
        try:
            process.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    psutil.wait_procs(left, timeout=grace_s)
    return [p.pid for p in processes]


def mark_dead(folder: RunDir, state: RunState) -> None:
    """Write the dead state into status.json, for readers that read the file alone."""
    from rlflow.rundir import write_json

    if state.status is not None:
        write_json(folder.status, msgspec.structs.replace(state.status, state="dead", error=state.reason))


def _detached_pid(folder: RunDir) -> int:
    try:
        return int(folder.run_pid.read_text().strip())
    except (OSError, ValueError):
        return 0


def _mtime(path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0

