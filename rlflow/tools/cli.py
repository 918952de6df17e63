"""The `rlflow` command: up, status, down, check, report, plan, model.

Exit status: 0 done, 1 the run failed, 2 bad configuration or a cluster that
cannot hold it (one line, no traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from rlflow import __version__
from rlflow.config.loading import default_config_path
from rlflow.roles import EXTERNAL, spoken


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlflow",
        description="Asynchronous RL post-training for language models on Ray resource pools.",
    )
    parser.add_argument("--version", action="version", version=f"rlflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    up = sub.add_parser("up", help="start a run (in the foreground unless --detach)")
    up.add_argument("--config", type=pathlib.Path, help="TOML config (default: the embedded default)")
    up.add_argument("--task", metavar="DATASET",
                    help="the embedded default on a reasoning-gym dataset, scored by its own verifier, from the model "
                         "`rlflow model build --task DATASET` builds for it (built first if need be), the trainer's "
                         "lr that model's (rlflow.taskmodel.TASK_LR: 5e-4)")
    up.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                    help="override one config value (repeatable)")
    up.add_argument("--steps", type=int, help="optimizer steps (same as --set run.steps=N)")
    up.add_argument("--run-dir", type=pathlib.Path, help="where the run writes its files")
    up.add_argument("--resume", type=pathlib.Path, metavar="RUN_DIR",
                    help="continue a run from its newest checkpoint (its config, plus --set / --steps)")
    up.add_argument("--detach", action="store_true", help="return once the run is up; see `status` and `down`")
    up.add_argument("--no-display", action="store_true", help="no live table (log lines only)")

    status = sub.add_parser("status", help="live table of a run's roles")
    status.add_argument("run_dir", nargs="?", type=pathlib.Path, help="run directory (default: the newest in runs/)")
    status.add_argument("--once", action="store_true", help="print the table once and exit")

    from rlflow.models import BUILT

    model = sub.add_parser("model", help="the embedded default model, and the models rlflow builds from its recipe")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    build = model_sub.add_parser("build", help="build and warm-start a model of the default model's recipe (cached; "
                                               "rlflow ships the default model)")
    build.add_argument("name", nargs="?", default="default", choices=sorted(BUILT),
                       help="which (default: the default model's recipe again)")
    build.add_argument("--force", action="store_true", help="rebuild even if it is cached")
    path_cmd = model_sub.add_parser("path", help="print where a model is (the default: where rlflow ships it; "
                                                 "another: where it is built)")
    path_cmd.add_argument("name", nargs="?", default="default", choices=sorted(BUILT), help="which")
    for cmd in (build, path_cmd):
        cmd.add_argument("--task", metavar="CONFIG|DATASET",
                         help="a model for a task instead: a TOML config's (its [task] and reward functions), or a "
                              "reasoning-gym dataset's name; a config names it with roles.rollout.model = \"task\"")
        cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                         help="with --task: override one config value, e.g. task.options.max_terms=3 (repeatable)")

    chk = sub.add_parser("check", help="load a config's task and reward functions and show what the model will see")
    chk.add_argument("--config", type=pathlib.Path, help="TOML config (default: the embedded default)")
    chk.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                     help="override one config value (repeatable)")
    chk.add_argument("--rows", type=int, default=0, help="score the reference answers of this many rows (0: all)")

    cfg = sub.add_parser("config", help="the effective config")
    cfg_sub = cfg.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = cfg_sub.add_parser("show", help="print the config a run would get: every key, defaults filled in, "
                                           "--set applied, checked")
    show.add_argument("--config", type=pathlib.Path, help="TOML config (default: the embedded default)")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                      help="override one config value (repeatable)")

    rep = sub.add_parser("report", help="where each role's time went, and the bottleneck")
    rep.add_argument("run_dir", nargs="?", type=pathlib.Path, help="run directory (default: the newest in runs/)")

    aud = sub.add_parser("audit", help="replay a run's ledger: what became of every prompt group it issued")
    aud.add_argument("run_dir", nargs="?", type=pathlib.Path, help="run directory (default: the newest in runs/)")

    planner = sub.add_parser("plan", help="predict the best split of N devices from a run's unit costs")
    planner.add_argument("run_dir", type=pathlib.Path, help="a finished run to take unit costs from")
    planner.add_argument("--devices", type=int, required=True, help="devices to split between rollout and trainer")
    planner.add_argument("--steps", type=int, default=30, help="optimizer steps to simulate per layout")

    join = sub.add_parser("join", help="what a replica you start yourself needs, as environment variables")
    join.add_argument("run_dir", type=pathlib.Path, help="the run directory (of a run with external roles)")
    join.add_argument("--role", required=True, help=f"the role it plays: {spoken(EXTERNAL)}")
    join.add_argument("--rank", type=int, required=True, help="its rank within the role")

    down = sub.add_parser("down", help="stop a detached run")
    down.add_argument("run_dir", nargs="?", type=pathlib.Path, help="run directory (default: the newest in runs/)")
    down.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for a clean stop")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    commands = {
        "up": cmd_up, "status": cmd_status, "down": cmd_down, "model": cmd_model,
        "report": cmd_report, "plan": cmd_plan,
        "check": cmd_check, "audit": cmd_audit, "join": cmd_join, "config": cmd_config,
    }
    return commands[args.command](args)


# ------------------------------------------------------------------------- up


def _load_config(args: argparse.Namespace):
    from rlflow.config import ConfigError, load
    from rlflow.rundir import RunDir

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"run.steps={args.steps}")
    if getattr(args, "resume", None) is not None:
        folder = RunDir(args.resume)
        checkpoint = folder.latest_checkpoint()
        if checkpoint is None:
            raise ConfigError("--resume", str(args.resume), "has no complete checkpoint under checkpoints/")
        overrides.append(f'run.resume="{checkpoint}"')
        return load(folder.config, overrides)
    if getattr(args, "task", None):
        from rlflow.taskmodel import task_config

        if args.config:
            raise ConfigError("--task", args.task, "goes without --config (set a config's [task] there instead)")
        return task_config(args.task, [*overrides, 'roles.rollout.model="task"'])
    path = args.config or default_config_path()
    return load(path, overrides)


def cmd_up(args: argparse.Namespace) -> int:
    from rlflow.config import ConfigError, resolve_run_dir
    from rlflow.control.launch import resolve

    try:
        config = _load_config(args)
        _build_models(config)
        resolve(config)  # a model or path that is not there is a config error now, not in a service
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    run_dir = args.resume or resolve_run_dir(config, str(args.run_dir) if args.run_dir else None)
    if args.detach:
        return _detach(args, run_dir)
    return _foreground(config, run_dir, display=not args.no_display)


#: Seconds between progress lines when the output is not a terminal (and a line at each change of state).
PROGRESS_EVERY_S = 5.0


def progress_line(status) -> str:
    """One line of a run's progress, for logs (where the live table cannot go)."""
    from rlflow.tools.display import trend_text

    parts = [f"[rlflow] {status.state}: step {status.step}/{status.steps}"]
    last = status.last_step
    if last is not None:
        if last.reward_mean is not None:
            parts.append(f"reward {last.reward_mean:.3f}")
        if last.time_s > 0:
            parts.append(f"{status.samples / last.time_s:.1f} samples/s")
    if status.last_eval is not None and status.last_eval.accuracy is not None:
        parts.append(f"held-out {100 * status.last_eval.accuracy:.1f}% (step {status.last_eval.step})")
    parts += [trend_text(key, trend) for key, trend in status.trends.items()]
    return ", ".join(parts)


def _foreground(config, run_dir: pathlib.Path, *, display: bool) -> int:
    from rich.console import Console
    from rich.live import Live

    from rlflow.control.launch import run
    from rlflow.control.placement import PlacementError
    from rlflow.errors import RunFailed
    from rlflow.tools.display import render

    console = Console(stderr=True)
    live = Live(console=console, refresh_per_second=4, transient=False) if display and console.is_terminal else None
    last_at, last_state = 0.0, ""  # when, and in which state, the last progress line was printed

    told: list[bool] = []

    def on_status(status) -> None:
        nonlocal last_at, last_state
        if status.waiting_for and status.address and not told:  # once: what the external replicas need
            told.append(True)
            print(join_hint(status, run_dir), file=sys.stderr, flush=True)
        if live is not None:
            live.update(render(status))
        elif time.monotonic() - last_at >= PROGRESS_EVERY_S or status.state != last_state:
            # Also at each change of state: a short run still says it ran.
            last_at, last_state = time.monotonic(), status.state
            print(progress_line(status), file=sys.stderr, flush=True)

    print(f"[rlflow] run dir {run_dir}", file=sys.stderr)
    try:
        if live is not None:
            live.start()
        summary = run(config, run_dir, on_status=on_status)
    except PlacementError as exc:
        print(f"placement error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("[rlflow] interrupted; every service was stopped", file=sys.stderr)
        return 130
    finally:
        if live is not None:
            live.stop()
    from rlflow.tools.report import report

    body, files = report(run_dir)
    print(body, file=sys.stderr)
    print(f"  wrote {', '.join(str(f) for f in files)}", file=sys.stderr)
    print(
        f"[rlflow] {summary.steps} steps, {summary.samples} samples, {summary.tokens} tokens "
        f"in {summary.wall_time_s:.1f} s; staleness max {summary.staleness_max:g}; "
        f"controller {summary.controller.messages_per_s:.0f} msg/s, "
        f"{100 * summary.controller.cpu_share:.2f}% CPU, p99 {summary.controller.latency_p99_ms:.1f} ms a message",
        file=sys.stderr,
    )
    return 0 if summary.state == "stopped" else 1


def _detach(args: argparse.Namespace, run_dir: pathlib.Path) -> int:
    """Start the same `rlflow up` in a process of its own; return once it is running."""
    from rlflow.rundir import RunDir

    folder = RunDir(run_dir)
    folder.path.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "rlflow", "up", "--no-display"]
    if args.resume is not None:
        argv += ["--resume", str(args.resume)]
    else:
        argv += ["--run-dir", str(run_dir)]
    if args.config:
        argv += ["--config", str(args.config)]
    if args.task:
        argv += ["--task", args.task]
    for item in args.overrides:
        argv += ["--set", item]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    log = open(folder.run_log, "ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    folder.run_pid.write_text(str(proc.pid))
    started = time.time()
    while True:
        if proc.poll() is not None:
            print(f"the run exited with status {proc.returncode}; its log ({folder.run_log}) ends:", file=sys.stderr)
            print("".join(folder.run_log.read_text().splitlines(True)[-20:]), file=sys.stderr)
            return 1
        status = folder.read_status()
        # A resumed run's directory holds the last run's status until this one writes its own.
        if status is not None and status.state in ("running", "stopped") and folder.status.stat().st_mtime >= started:
            break
        time.sleep(0.2)
    print(f"[rlflow] run {run_dir} is up (pid {proc.pid}); `rlflow status {run_dir}` shows it, "
          f"`rlflow down {run_dir}` stops it", file=sys.stderr)
    return 0


def join_hint(status, run_dir: pathlib.Path) -> str:
    """What the external replicas a run waits for need, in a few lines."""
    roles = sorted({name.rsplit("-", 1)[0] for name in status.waiting_for})
    return (f"[rlflow] waiting for external replicas {', '.join(status.waiting_for)}: the controller is at "
            f"{status.address}, the run's secret and keys are in {run_dir / 'join.json'} (owner-only); "
            + "; ".join(f"`rlflow join {run_dir} --role {role} --rank N` prints them as environment variables"
                        for role in roles))


def cmd_join(args: argparse.Namespace) -> int:
    """`rlflow join RUN_DIR --role R --rank K`: ``export NAME=value`` lines for a script to source."""
    import shlex

    from rlflow.rundir import RunDir
    from rlflow.startup import join_environment

    folder = RunDir(args.run_dir)
    info = folder.read_join()
    if info is None:
        print(f"{folder.join} is missing or unreadable: the run has no external roles, or it has not started",
              file=sys.stderr)
        return 2
    try:
        env = join_environment(info, args.role, args.rank, str(folder.join.resolve()))
    except ValueError as exc:
        print(f"join: {exc}", file=sys.stderr)
        return 2
    if f"{args.role}-{args.rank}" not in info.external:
        print(f"join: {args.role}-{args.rank} is started by rlflow, not by you (external: "
              f"{', '.join(info.external)})", file=sys.stderr)
        return 2
    print("\n".join(f"export {name}={shlex.quote(value)}" for name, value in env.items()))
    return 0


def _build_models(config) -> None:
    """Build the models rlflow makes itself that a role's engine in `config`
    names and that are not cached yet (the default policy ships with rlflow)."""
    from rlflow.config import ConfigError
    from rlflow.models import BUILT
    from rlflow.taskmodel import TASK_MODEL, TaskModelError
    from rlflow.tasks.dataset import DatasetError

    if not config.needs_model:
        return
    for _, role in config.role_items():
        model = getattr(getattr(role, "engine", None), "model", None)
        if model in BUILT and model != "default":
            build_model(force=False, name=model)
    if config.roles.rollout.model == TASK_MODEL:
        try:
            task_model(config, force=False)
        except (TaskModelError, DatasetError) as exc:
            raise ConfigError("roles.rollout.model", TASK_MODEL, f"the task's model cannot be built: {exc}") from None


def task_model(config, *, force: bool) -> pathlib.Path:
    """The model of `config`'s task (`rlflow.taskmodel`); built first (with a progress bar) if it is not
    cached yet, or `force`."""
    from rlflow.taskmodel import build_task_model, task_model_dir

    path = task_model_dir(config)
    if force or not (path / "config.json").exists():
        print(f"[rlflow] building the model of the task into {path} (once; a few minutes)", file=sys.stderr)
        with _build_progress() as report:
            build_task_model(config, out=path, progress=report)
    return path


def build_model(force: bool, name: str = "default") -> pathlib.Path:
    """A model rlflow builds itself (`rlflow.models.BUILT`); built first (with
    a progress bar) if needed."""
    from rlflow.models import BUILT, build_default, default_model_dir

    path = default_model_dir(name)
    if (path / "config.json").exists() and not force:
        return path
    print(f"[rlflow] building the {name} model into {path} (once; a few minutes)", file=sys.stderr)
    with _build_progress() as report:
        build_default(path, BUILT[name][1], progress=report)
    return path


@contextlib.contextmanager
def _build_progress() -> Iterator[Callable[[str, float], None]]:
    """What a build reports its progress to: a bar on a terminal, else (a log) a line every 15 s."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    if not sys.stderr.isatty():
        last = [0.0]

        def log_line(text: str, fraction: float) -> None:
            if time.monotonic() - last[0] >= 15 or fraction >= 1.0:
                last[0] = time.monotonic()
                print(f"[rlflow] {100 * fraction:3.0f}% {text}", file=sys.stderr, flush=True)

        yield log_line
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), transient=False) as progress:
        task = progress.add_task("warm start", total=1.0)
        yield lambda text, fraction: progress.update(task, completed=fraction, description=text)


def cmd_config(args: argparse.Namespace) -> int:
    """`rlflow config show`: the effective config as TOML (exit 2, one line, when it does not load)."""
    from rlflow.config import ConfigError, load, to_toml

    try:
        config = load(args.config or default_config_path(), args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(to_toml(config), end="")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """`rlflow check`: exit 0 when the task and reward functions load, 2 (one line) when not."""
    from rlflow.config import ConfigError, load
    from rlflow.tools.check import CheckError, check

    try:
        config = load(args.config or default_config_path(), args.overrides)
        _build_models(config)
        figures = check(config, rows=args.rows)
    except (ConfigError, CheckError) as exc:
        print(exc, file=sys.stderr)
        return 2
    episodes = (f" episodes={figures['episodes']} episode_reward_mean={figures['episode_reward_mean']:.4g}"
                if "episodes" in figures else "")
    print(
        f"RESULT check rows={figures['rows']} skipped={figures['skipped']} "
        f"reference_reward_mean={figures['reference_reward_mean']:.4g} failures={figures['failures']}{episodes}"
    )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rlflow.tools.report import report

    run_dir = _find_run(args.run_dir)
    if run_dir is None:
        print("no run directory given and none in runs/", file=sys.stderr)
        return 1
    try:
        body, files = report(run_dir)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(body)
    for path in files:
        print(f"  wrote {path}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """Exit status 0 when nothing was lost or trained twice, 1 otherwise."""
    from rlflow.tools.audit import audit, text

    run_dir = _find_run(args.run_dir)
    if run_dir is None:
        print("no run directory given and none in runs/", file=sys.stderr)
        return 2
    try:
        result = audit(run_dir.path)
    except FileNotFoundError as exc:
        print(f"audit: {exc}", file=sys.stderr)
        return 2
    print(text(result))
    return 0 if result.lost == 0 and result.duplicated == 0 else 1


def cmd_plan(args: argparse.Namespace) -> int:
    from rlflow.tools.plan import plan, table

    try:
        ranked, pools = plan(args.run_dir, args.devices, args.steps)
    except (FileNotFoundError, ValueError) as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return 2
    print(f"predicted from the unit costs of {args.run_dir}, {args.devices} devices:")
    print(table(ranked))
    best = ranked[0]
    print(f"\nbest: {best.layout} ({best.samples_per_s:.1f} samples/s). Its pools:\n")
    print(pools)
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    from rlflow.models import default_model_dir, resolve_model

    name = args.name
    if args.task is not None:
        return _task_model(args)
    if args.overrides:
        raise SystemExit("rlflow model: --set goes with --task (the config of the task whose model to build)")
    if args.model_command == "path":
        print(resolve_model(name) if name == "default" else default_model_dir(name))
        return 0
    path = build_model(force=args.force, name=name)
    if name == "default":
        print(f"[rlflow] rlflow ships the default model ({resolve_model(name)}); this build of its recipe is "
              f"another, used with --set roles.rollout.model={path}", file=sys.stderr)
    info = json.loads((path / "rlflow_build.json").read_text())
    print(
        f"[rlflow] {name} model at {path}: {info['parameters']:,} parameters, "
        f"development-set accuracy {info['dev_accuracy']:.1%} after {info['steps']} warm-start steps "
        f"({info['seconds']:.0f} s)",
        file=sys.stderr,
    )
    return 0


def _task_model(args: argparse.Namespace) -> int:
    """`rlflow model build|path --task`: the model of a task (`rlflow.taskmodel`)."""
    from rlflow.config import ConfigError
    from rlflow.taskmodel import TaskModelError, task_config, task_model_dir
    from rlflow.tasks.dataset import DatasetError

    try:
        config = task_config(args.task, args.overrides)
        path = task_model_dir(config)
    except (ConfigError, TaskModelError) as exc:
        print(f"rlflow model: {exc}", file=sys.stderr)
        return 2
    if args.model_command == "path":
        print(path)
        return 0
    try:
        task_model(config, force=args.force)
    except (TaskModelError, DatasetError) as exc:
        print(f"rlflow model: {exc}", file=sys.stderr)
        return 2
    info = json.loads((path / "rlflow_build.json").read_text())
    print(f"[rlflow] the task's model at {path}: {info['parameters']:,} parameters, development-set accuracy "
          f"{info['dev_accuracy']:.1%} after {info['steps']} warm-start steps ({info['seconds']:.0f} s); a config "
          f"with this task names it with roles.rollout.model = \"task\"", file=sys.stderr)
    print(path)
    return 0


# --------------------------------------------------------------- status, down


def _find_run(run_dir: pathlib.Path | None):
    """The run directory given, or the newest one under runs/."""
    from rlflow.rundir import RunDir

    if run_dir is not None:
        return RunDir(run_dir)
    runs = sorted(pathlib.Path("runs").glob("*/status.json"), key=lambda p: p.stat().st_mtime)
    return RunDir(runs[-1].parent) if runs else None


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from rlflow.runstate import run_state
    from rlflow.tools.display import render

    folder = _find_run(args.run_dir)
    state = run_state(folder) if folder else None
    if state is None or state.status is None:
        print(f"no run status in {folder or 'runs/'}", file=sys.stderr)
        return 1
    status = state.status
    console = Console()
    if not console.is_terminal:  # a pipe or a file: whole lines, not a table squeezed into 80 columns
        console = Console(width=200)
    if args.once or not console.is_terminal:
        console.print(render(status))
        return 0
    try:
        with Live(render(status), console=console, refresh_per_second=2) as live:
            while state.live:
                time.sleep(0.5)
                state = run_state(folder) or state
                status = state.status or status
                live.update(render(status))
    except KeyboardInterrupt:
        pass
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    """Stop a run that is going; of one that is not (dead: its controller
    killed), say so and clean up what is left of it. Exit status 0 either
    way, 1 when there is no run."""
    from rlflow.runstate import mark_dead, run_state

    folder = _find_run(args.run_dir)
    state = run_state(folder) if folder else None
    if state is None:
        print(f"no run in {folder or 'runs/'}", file=sys.stderr)
        return 1
    deadline = time.monotonic() + args.timeout
    while state.state == "starting" and time.monotonic() < deadline:  # stop it once it can be asked to
        time.sleep(0.5)
        state = run_state(folder) or state
    if state.live:
        _stop(folder, state, deadline)
        state = run_state(folder) or state
        print(f"[rlflow] run {folder.path} {state.state}" + (f": {state.reason}" if state.reason else ""),
              file=sys.stderr)
        if state.state != "dead":
            return 0
    elif state.state == "dead":
        print(f"[rlflow] run {folder.path} is dead: {state.reason}", file=sys.stderr)
    else:
        print(f"[rlflow] run {folder.path} is {state.state} already", file=sys.stderr)
    _clean_up(folder, state)
    if state.state == "dead":
        mark_dead(folder, state)
    return 0


def _stop(folder, state, deadline: float) -> None:
    """Ask a run's controller to stop (with the run's secret) and wait for
    its process to end; past the deadline, SIGTERM, then SIGKILL."""
    from rlflow.control.launch import request_stop
    from rlflow.runstate import alive

    info = folder.read_controller()
    pid = state.pid
    if info is not None and info.pid == pid:
        request_stop(folder.path, "rlflow down")
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(pid):
        print(f"the run did not stop in time; sending SIGTERM to {pid}", file=sys.stderr)
        os.kill(pid, signal.SIGTERM)
        time.sleep(5)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def _clean_up(folder, state) -> None:
    """What is left of a run that is not going: its actors and placement
    groups on the Ray cluster it joined, its processes on this host."""
    from rlflow.config import ConfigError, load
    from rlflow.runstate import end, leftovers

    run_id = state.status.run_id if state.status is not None else ""
    try:
        address = load(folder.config).cluster.address if folder.config.exists() else ""
    except ConfigError:
        address = ""
    if address and run_id:
        from rlflow.control.placement import remove_run

        removed = remove_run(address, run_id)
        if removed is None:
            print(f"[rlflow] no Ray cluster answers at {address}: nothing of the run is left there", file=sys.stderr)
        elif removed != ([], []):
            print(f"[rlflow] removed from Ray at {address}: actors [{', '.join(removed[0])}], "
                  f"placement groups [{', '.join(removed[1])}]", file=sys.stderr)
    ended = end(leftovers(folder, state))
    if ended:
        print(f"[rlflow] stopped {len(ended)} process{'es' if len(ended) > 1 else ''} of the run: "
              f"{', '.join(map(str, ended))}", file=sys.stderr)
    elif state.state == "dead":
        print("[rlflow] no process of the run is left on this host", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
