"""A replica's state timeline over the whole run: ``trace/ROLE-RANK.json``.

A run outlives the processes of its replicas: one killed is restarted (a new
incarnation), a run stopped short is resumed (a new session). Each such
process is a *life* of the replica, and the timeline keeps every one, in
order, once: none overwrites another.

While a life runs, it appends to ``trace/ROLE-RANK.events.jsonl``, at every
heartbeat (so that its timeline does not grow the process):

    {"life": {"run_id": ..., "incarnation": N, "pid": P, "start": T}}   first, once
    [T, "state"]                                                          each change of state
    {"seen": T}                                                           alive at T

At a clean end a life folds that file into the trace (rewritten whole, then
put in place) and removes it. A life that was killed leaves its lines
behind: the next life to end cleanly folds them in as well, and readers
(`read`) fold them in as they read, so a killed life shows up either way.
The trace:

    {"role": ..., "rank": ..., "counters": {...}, "lives": [...], "events": [[T, "state"], ...]}

Each life ends in the events with ``[T, "down"]``: when it shut down, or,
killed, when it was last seen alive; from there to the next life's first
event the replica did not run. ``counters`` adds up the counters of the
lives that ended cleanly (a killed life could not say its own).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from rlflow.rundir import RunDir

#: The state between two lives of a replica: it did not run.
DOWN = "down"


def life_line(run_id: str, incarnation: int, pid: int, start: float) -> str:
    """The line that starts a life in the events file."""
    return json.dumps({"life": {"run_id": run_id, "incarnation": incarnation, "pid": pid, "start": start}})


def append(folder: RunDir, name: str, lines: list[str]) -> None:
    """Lines of the running life of replica `name` (see the module)."""
    path = folder.service_events(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.writelines(line + "\n" for line in lines)


def names(folder: RunDir) -> list[str]:
    """The replicas (``ROLE-RANK``) that have a timeline, ended or not."""
    found = {p.name.removesuffix(".events.jsonl") for p in folder.traces.glob("*-*.events.jsonl")}
    found |= {p.stem for p in folder.traces.glob("*-*.json") if not p.name.startswith("lengths-")}
    return sorted(found)


def read(folder: RunDir, name: str) -> dict[str, Any] | None:
    """Replica `name`'s timeline over every life so far (None: it has none)."""
    role, _, rank = name.rpartition("-")
    trace = _load(folder.service_trace(name)) or {"role": role, "rank": int(rank), "counters": {}, "lives": [],
                                                  "events": []}
    known = {_key(life) for life in trace["lives"]}
    for life, events in _lives(folder.service_events(name)):
        if _key(life) not in known:
            _add(trace, life, events)
    return trace if trace["lives"] else None


def fold(folder: RunDir, name: str, life: dict[str, Any], counters: dict[str, float], end: float) -> None:
    """A life of replica `name` ends cleanly at `end` with `counters`: its
    lines (and those a killed life left) into the trace, the events file gone."""
    trace = read(folder, name)
    if trace is None:
        raise ValueError(f"{name} has no timeline to fold")
    last = trace["lives"][-1]
    if _key(last) != _key(life):
        raise ValueError(f"{name}: the life ending is not the latest in its timeline")
    last.update(end=end, ended="shutdown", counters=counters)
    trace["events"][-1][0] = end  # its "down"
    trace["counters"] = _add_counters(trace["counters"], counters)
    path = folder.service_trace(name)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(trace))
    os.replace(tmp, path)
    folder.service_events(name).unlink(missing_ok=True)


def _key(life: dict[str, Any]) -> tuple:
    return life.get("run_id"), life.get("incarnation"), life.get("start")


def _load(path: pathlib.Path) -> dict[str, Any] | None:
    """A trace file; one written before lives were kept is one life."""
    try:
        trace = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if "lives" not in trace:
        events = trace.get("events", [])
        start, end = (events[0][0], events[-1][0]) if events else (0.0, 0.0)
        trace["lives"] = [{"start": start, "end": end, "ended": "shutdown", "counters": trace.get("counters", {})}]
        if events:
            events.append([end, DOWN])
    return trace


def _lives(path: pathlib.Path) -> list[tuple[dict[str, Any], list[list]]]:
    """The lives in an events file, each with its events and when it was last
    seen (a line cut short by a crash is left out)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out: list[tuple[dict[str, Any], list[list]]] = []
    for line in lines:
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and "life" in item:
            out.append(({**item["life"], "seen": item["life"].get("start", 0.0)}, []))
            continue
        if not out:  # written before lives were marked
            out.append(({"start": None, "seen": 0.0}, []))
        life, events = out[-1]
        if isinstance(item, dict) and "seen" in item:
            life["seen"] = max(life["seen"], item["seen"])
        elif isinstance(item, list) and len(item) == 2:
            events.append(item)
            life["seen"] = max(life["seen"], item[0])
            if life["start"] is None:
                life["start"] = item[0]
    return out


def _add(trace: dict[str, Any], life: dict[str, Any], events: list[list]) -> None:
    """A life that has not ended cleanly (or not yet): up to when it was last seen."""
    seen = life.pop("seen")
    trace["lives"].append({**life, "end": seen, "ended": "unknown", "counters": None})
    trace["events"] += events
    trace["events"].append([seen, DOWN])


def _add_counters(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {key: a.get(key, 0.0) + b.get(key, 0.0) for key in a.keys() | b.keys()}
