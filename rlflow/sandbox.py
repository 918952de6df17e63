"""Run an untrusted Python program in a throwaway Linux sandbox.

`run_python(source, stdin, limits)` runs `source` under the caller's own
interpreter as `python -S -I main.py` (no site-packages, so the standard
library only; no user site, no PYTHON* variables) and returns a `Result`:
how the program ended, its exit code, what it wrote and how long the run
took. What the program did is in the result (`Status`); `SandboxError`
means the sandbox itself failed: it cannot be set up on this machine, or a
run did not end when told to.

Every run gets, with the default `Limits`:

* No network. Its own network namespace, whose only device is a loopback
  that is down: every connect fails at once (ENETUNREACH), name lookups
  too. `Limits.network=True` leaves it the host's network instead. (Unix
  sockets are files, not network: the caller's /tmp, where most live, is
  hidden, and as root the program's uid may connect only to those open to
  everyone.)
* Nothing outlives the run. The program is the only child of the init of
  its own PID namespace; when the program exits or is stopped, or when the
  caller dies, that init dies and the kernel kills every process left in the
  namespace, before `run_python` returns. Processes and threads are capped
  by RLIMIT_NPROC, so a fork bomb stalls instead of spreading.
* Writes go nowhere but its scratch space. Every mount it sees is read-only
  (and nosuid) except two fresh size-capped tmpfs, /tmp (its cwd, HOME and
  TMPDIR, holding `main.py`) and /dev/shm, which vanish with the run: no
  file of one run is seen by the next, nor left on the host. It has its own
  /proc (it sees only its own processes) and its own System V IPC.
* Limits on CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS) and wall
  clock (killed at `timeout_s`); stdout and stderr are each kept up to
  `output_bytes`, and a program that writes more is stopped.
* As root, the program runs as a uid of its own, 0x70000000 + the pid of
  the run's first process: unique among live runs, so runs neither share a
  process count nor can signal each other, and above the ranges that
  systemd hands to users and containers. It has no groups and
  no_new_privs: no setuid binary gives root back, files it does not own
  stay unwritable, and unix sockets not open to everyone stay closed. If
  the interpreter lies under a directory closed to others (pyenv in /root),
  the program sees that directory empty but for the interpreter's tree.
* Nothing of the caller is inherited: no environment variables, no file
  descriptors but stdin (a sealed in-memory file), stdout and stderr.

Not root: the namespaces come from an unprivileged user namespace and the
program runs as the caller's uid (uid-based protection is gone, so it may
read what the caller may read and connect to the caller's unix sockets
outside /tmp), and RLIMIT_NPROC counts the caller's processes in the new
user namespace only. Where neither way works (e.g. a container that drops
CAP_SYS_ADMIN and blocks user namespaces), `run_python` raises
`SandboxError` and `check_isolation` says why; there is no unsandboxed
fallback.

`run_python` blocks; from trio, call it in a worker thread
(`trio.to_thread.run_sync`). It is thread-safe and starts no thread.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import functools
import inspect
import math
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

#: Seconds a run may take to be gone once its program has ended or it has
#: been stopped. Dying takes microseconds; only a process stuck in the kernel
#: (uninterruptible sleep) could take longer, and then we say so.
STOP_GRACE_S = 5.0

#: Bytes read from a pipe at a time.
_CHUNK = 1 << 16


class SandboxError(RuntimeError):
    """The sandbox failed, not the program: it cannot be set up on this
    machine (the message says which step and why), or a run did not end in
    `STOP_GRACE_S` after its program ended or was stopped."""


@dataclass(frozen=True)
class Limits:
    """What one run may use. Numbers must be positive and finite."""

    timeout_s: float = 5.0
    """Wall-clock seconds from start; then the run is killed (`Status.TIMEOUT`)."""
    cpu_s: float = 5.0
    """CPU seconds of the program's process (all its threads and the children
    it waited for), as RLIMIT_CPU: rounded up to whole seconds
    (`Status.CPU_LIMIT`)."""
    memory_bytes: int = 512 << 20
    """Address space of each of its processes (RLIMIT_AS). The interpreter
    alone maps ~20 MiB; a thread's stack reserves 8 MiB."""
    output_bytes: int = 64 << 10
    """Bytes kept of stdout, and of stderr; a program that writes more is
    stopped (`Status.OUTPUT_LIMIT`)."""
    processes: int = 32
    """Processes and threads it may have at once, itself included (RLIMIT_NPROC)."""
    scratch_bytes: int = 64 << 20
    """Size of its /tmp, and of its /dev/shm: memory-backed (tmpfs), so at
    most this much memory each. Holds the program's source too."""
    network: bool = False
    """False: a network namespace of its own, with no usable device. True:
    the host's network (everything else stays isolated)."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_bytes", "output_bytes", "processes", "scratch_bytes"):
            value = getattr(self, name)
            # Written so that NaN fails too.
            if not 0 < value < math.inf:
                raise ValueError(f"Limits.{name} must be positive and finite, got {value!r}")


class Status(enum.Enum):
    """How a run ended, from the program's side."""

    OK = "ok"
    """Exited with code 0."""
    ERROR = "error"
    """Exited with a nonzero code (an uncaught exception exits with 1)."""
    CRASHED = "crashed"
    """Killed by a signal it did not get from a limit (segfault, abort, its own kill)."""
    TIMEOUT = "timeout"
    """Still running at `Limits.timeout_s`: killed."""
    CPU_LIMIT = "cpu_limit"
    """Killed by the kernel at `Limits.cpu_s` CPU seconds."""
    MEMORY_LIMIT = "memory_limit"
    """Ended by a MemoryError: an allocation past `Limits.memory_bytes` failed."""
    OUTPUT_LIMIT = "output_limit"
    """Wrote more than `Limits.output_bytes` to stdout or stderr: stopped,
    and the output cut there."""


@dataclass(frozen=True)
class Result:
    """The outcome of one run."""

    status: Status
    returncode: int | None
    """Exit code, or -N if the program was killed by signal N; None when
    the sandbox stopped it (`TIMEOUT`, `OUTPUT_LIMIT`)."""
    stdout: str
    """What it wrote to stdout (at most `Limits.output_bytes` of it),
    decoded as UTF-8 with undecodable bytes replaced."""
    stderr: str
    """The same for stderr."""
    seconds: float
    """Wall-clock seconds from the start of `run_python` until every process
    of the run was gone."""


def run_python(source: str, stdin: str = "", limits: Limits = Limits()) -> Result:
    """Run `source` as a Python program in a fresh sandbox, give it `stdin`,
    and return how it ended. Returns only once every process of the run is
    gone. Raises `SandboxError` if the sandbox cannot run it here."""
    if sys.platform != "linux":
        raise SandboxError(f"the sandbox needs Linux namespaces; this platform is {sys.platform}")
    if not sys.executable:
        raise SandboxError("the sandbox runs programs with this interpreter, but sys.executable is empty")
    start = time.monotonic()
    status_r, status_w = os.pipe()
    stop_r, stop_w = os.pipe()
    # Closing the stop pipe (as our death does too) tells the run's first
    # process to kill the init, and so the whole run. A file object, so that
    # closing it early and again on exit is harmless.
    with open(stop_w, "wb", buffering=0) as stop:
        try:
            try:
                proc = _spawn(source, stdin, limits, status_w, stop_r)
            finally:
                # The child has its own copies; ours would keep the pipes from ending.
                os.close(status_w)
                os.close(stop_r)
            with proc:
                try:
                    watched = _watch(proc, status_r, stop.close, limits, deadline=start + limits.timeout_s)
                finally:
                    if proc.poll() is None:
                        # Only on an error of ours or KeyboardInterrupt.
                        stop.close()
                        try:
                            proc.wait(STOP_GRACE_S)
                        except subprocess.TimeoutExpired:
                            proc.kill()  # the init dies with it (PR_SET_PDEATHSIG)
                            proc.wait()
        finally:
            os.close(status_r)
    return _result(watched, limits, seconds=time.monotonic() - start)


def check_isolation(limits: Limits = Limits()) -> str | None:
    """None if `run_python` can run programs with `limits` here; with the
    default limits, that includes a network namespace of the program's own.
    Otherwise a sentence saying why not. Callers refuse to start a code
    reward on a sentence. The first call per value of `limits.network` runs
    one trivial program (tens of milliseconds); later ones answer from memory."""
    return _probe(limits.network)


@functools.cache
def _probe(network: bool) -> str | None:
    try:
        result = run_python("", limits=Limits(network=network))
    except SandboxError as error:
        return str(error)
    if result.status is not Status.OK:
        return f"an empty program did not run cleanly in the sandbox ({result.status.value}): {result.stderr[-500:]}"
    return None


def _spawn(source: str, stdin: str, limits: Limits, status_w: int, stop_r: int) -> subprocess.Popen[bytes]:
    """Start the run's first process (see `_sandbox_main`)."""
    with _sealed_memfd(source.encode()) as source_fd, _sealed_memfd(stdin.encode()) as stdin_fd:
        args = [
            f"status={status_w}",
            f"stop={stop_r}",
            f"source={source_fd}",
            f"cpu={math.ceil(limits.cpu_s)}",
            f"memory={limits.memory_bytes}",
            f"processes={limits.processes}",
            f"scratch={limits.scratch_bytes}",
            f"network={int(limits.network)}",
        ]
        # No preexec_fn (the child does everything itself), so subprocess can
        # use vfork: safe from any thread, and no copy of a large caller's
        # page tables.
        return subprocess.Popen(
            [sys.executable, "-S", "-I", "-c", _sandbox_code(), *args],
            stdin=stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(source_fd, status_w, stop_r),
            start_new_session=True,
            env={},
        )


# Linux 5.1; the fcntl module names it from Python 3.14 on.
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


@contextlib.contextmanager
def _sealed_memfd(data: bytes) -> Iterator[int]:
    """An in-memory file holding `data`, sealed against any change. As stdin
    it needs no writer thread and cannot deadlock; the program cannot grow
    it to eat memory the limits do not count.

    The write seal is F_SEAL_FUTURE_WRITE: it refuses every write and every
    writable shared mapping from then on, as F_SEAL_WRITE does, without
    F_SEAL_WRITE's wait for the pages' transient references to drop, which
    gives up with EBUSY on a loaded machine."""
    fd = os.memfd_create("rlflow-sandbox", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        yield fd
    finally:
        os.close(fd)


@dataclass
class _Watched:
    """What `_watch` saw of a run."""

    stdout: bytes
    stderr: bytes
    status: list[str]
    stopped: Status | None
    truncated: bool


def _watch(
    proc: subprocess.Popen[bytes], status_r: int, stop_run: Callable[[], None], limits: Limits, deadline: float
) -> _Watched:
    """Read the run's stdout, stderr and status pipe until all three end,
    calling `stop_run` at `deadline` or when an output passes its cap."""
    assert proc.stdout is not None and proc.stderr is not None
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), status_r: bytearray()}
    # The status pipe carries a few short lines, from our own code.
    caps = {proc.stdout.fileno(): limits.output_bytes, proc.stderr.fileno(): limits.output_bytes, status_r: _CHUNK}
    stopped: Status | None = None
    truncated = False
    ended = False  # the init has reported how the program ended
    give_up = math.inf

    def stop(why: Status) -> None:
        nonlocal stopped, give_up
        stopped, give_up = why, time.monotonic() + STOP_GRACE_S
        stop_run()

    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            now = time.monotonic()
            if stopped is None and not ended and now >= deadline:
                stop(Status.TIMEOUT)
            if now >= give_up:
                raise SandboxError(
                    f"a sandboxed run did not end within {STOP_GRACE_S} s after its program "
                    f"{'was stopped' if stopped else 'ended'}; some of its processes may be left (pgid {proc.pid})"
                )
            waiting = give_up if stopped or ended else deadline
            for key, _ in selector.select(waiting - now):
                fd = key.fd
                chunk = os.read(fd, _CHUNK)
                if not chunk:
                    selector.unregister(fd)
                    continue
                buffer = buffers[fd]
                room = caps[fd] - len(buffer)
                buffer += chunk[: max(room, 0)]
                if len(chunk) > room:
                    truncated = True
                    if stopped is None and not ended:
                        stop(Status.OUTPUT_LIMIT)
                if fd == status_r and not ended and b"exit " in buffer:
                    ended = any(line.startswith(b"exit ") for line in buffer.splitlines())
                    if ended and not stopped:
                        give_up = time.monotonic() + STOP_GRACE_S
    # All pipes ended: the init has exited, so the kernel has emptied the
    # namespace; its parent exits right after reaping it.
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        raise SandboxError(
            f"a sandboxed run closed its pipes but its first process (pid {proc.pid}) did not exit"
        ) from None
    stdout, stderr, status = (bytes(buffers[fd]) for fd in (proc.stdout.fileno(), proc.stderr.fileno(), status_r))
    return _Watched(stdout, stderr, status.decode("utf-8", "replace").splitlines(), stopped, truncated)


def _result(watched: _Watched, limits: Limits, seconds: float) -> Result:
    """Classify a watched run."""
    stdout = watched.stdout.decode("utf-8", "replace")
    stderr = watched.stderr.decode("utf-8", "replace")
    errors = [line.removeprefix("error ") for line in watched.status if line.startswith("error ")]
    if errors:
        raise SandboxError("the sandbox could not be set up: " + "; ".join(errors))
    if watched.stopped is not None:
        return Result(watched.stopped, None, stdout, stderr, seconds)
    ends = [line.split() for line in watched.status if line.startswith("exit ")]
    if not ends:
        raise SandboxError(
            "a sandboxed run ended without reporting how its program ended; "
            f"status pipe {watched.status!r}, stderr {stderr[-1000:]!r}"
        )
    _, wait_status, cpu_s = ends[0]
    returncode = os.waitstatus_to_exitcode(int(wait_status))
    if watched.truncated:
        status = Status.OUTPUT_LIMIT
    elif returncode == 0:
        status = Status.OK
    elif returncode == -signal.SIGXCPU or (
        # Past the soft limit the kernel sends SIGXCPU, one second later SIGKILL.
        returncode == -signal.SIGKILL and float(cpu_s) >= math.ceil(limits.cpu_s)
    ):
        status = Status.CPU_LIMIT
    elif returncode < 0:
        status = Status.CRASHED
    elif _last_line(stderr).startswith("MemoryError"):
        status = Status.MEMORY_LIMIT
    else:
        status = Status.ERROR
    return Result(status, returncode, stdout, stderr, seconds)


def _last_line(text: str) -> str:
    lines = text.rstrip().splitlines()
    return lines[-1] if lines else ""


@functools.cache
def _sandbox_code() -> str:
    # The sandbox's side runs as `python -S -I -c` with the source of
    # `_sandbox_main`: ordinary code in this file, yet the child imports
    # nothing of rlflow, since every import is paid on every start (this
    # module's own imports take ~28 ms in a fresh interpreter; ctypes ~6 ms).
    return (
        "from __future__ import annotations\nimport sys\n"
        + inspect.getsource(_sandbox_main)
        + "\n_sandbox_main(sys.argv[1:])\n"
    )


def _sandbox_main(argv: list[str]) -> None:
    """The sandbox's side of a run; runs in a fresh interpreter, never in the
    caller, and uses nothing from outside this function.

    Three processes in turn:

    * the keeper, the caller's child: makes the namespaces and the file
      system view, writes main.py, forks the init and waits for it; kills it
      when the stop pipe ends (the caller stopping the run, or dying);
    * the init, PID 1 of the new PID namespace: dies with the keeper, mounts
      its /proc, forks the program, reaps every orphan, and reports how the
      program ended; when it dies the kernel kills everything left in the
      namespace;
    * the program's process: sets the limits, drops privileges and execs
      the program.

    `argv` is `key=integer` pairs. On the status pipe: `error <why>` if a
    step fails, else `exit <wait status> <CPU seconds>` once the program has
    ended. Only the keeper and the init hold that pipe (close-on-exec), so
    the program cannot write its own verdict.
    """
    # Few imports, all compiled modules: `signal` alone (via enum) would add
    # ~6 ms to every start.
    import ctypes
    import os
    import resource
    import select
    import sys

    clone_newns, clone_newipc, clone_newuser, clone_newpid, clone_newnet = (
        0x00020000,
        0x08000000,
        0x10000000,
        0x20000000,
        0x40000000,
    )
    ms_nosuid, ms_nodev, ms_noexec, ms_bind, ms_rec, ms_private = 0x2, 0x4, 0x8, 0x1000, 0x4000, 1 << 18
    pr_set_pdeathsig, pr_set_no_new_privs = 1, 38
    # The same on every Linux architecture.
    sigint, sigkill, sig_dfl, sig_ign = 2, 9, 0, 1
    # mount_setattr(2), Linux 5.12+; 442 in the generic syscall table (x86-64, arm64).
    sys_mount_setattr, at_fdcwd, at_recursive = 442, -100, 0x8000
    mount_attr_rdonly, mount_attr_nosuid = 0x1, 0x2
    program_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}

    args = {key: int(value) for key, value in (arg.split("=", 1) for arg in argv)}
    status_fd = args["status"]
    for fd in (status_fd, args["stop"]):
        os.set_inheritable(fd, False)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def report(line: str) -> None:
        os.write(status_fd, line.replace("\n", " ").encode("utf-8", "replace") + b"\n")

    def fail(why: str) -> None:
        report("error " + why)
        os._exit(1)

    def check(result: int, what: str, hint: str = "") -> None:
        if result == -1:
            fail(f"{what} failed: {os.strerror(ctypes.get_errno())}{hint}")

    def release_stdio() -> None:
        # Only the program's processes may hold its stdio, so that the caller
        # reads end-of-file exactly when they are all gone.
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)

    def expose_interpreter() -> None:
        # As root the program runs as a uid of its own, which may not enter a
        # directory the interpreter lies under (pyenv or conda in /root,
        # 0700). Cover each such directory with an empty tmpfs and bind the
        # interpreter's trees back at their own paths: the program can run
        # Python and sees nothing else of that directory.
        trees = {
            os.path.realpath(path) for path in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(interpreter))
        }
        trees = {tree for tree in trees if not any(tree.startswith(other + "/") for other in trees)}
        binds = []
        for tree in sorted(trees):
            parts = tree.split("/")
            ancestors = ["/".join(parts[:i]) for i in range(2, len(parts))]
            closed = next((path for path in ancestors if not os.stat(path).st_mode & 0o001), None)
            if closed is not None:
                # Opened before any cover goes up, which would hide it.
                binds.append((closed, tree, os.open(tree, os.O_PATH | os.O_DIRECTORY)))
        covered = set()
        for closed, tree, fd in binds:
            if closed not in covered:
                cover = b"size=1m,mode=0755"
                check(
                    libc.mount(b"tmpfs", closed.encode(), b"tmpfs", ms_nosuid | ms_nodev, cover),
                    f"mount tmpfs on {closed}",
                )
                covered.add(closed)
            os.makedirs(tree, exist_ok=True)
            source = f"/proc/self/fd/{fd}".encode()
            check(libc.mount(source, tree.encode(), None, ms_bind | ms_rec, None), f"bind-mount {tree}")
            os.close(fd)

    def exec_program() -> None:
        libc.signal(sigint, ctypes.c_void_p(sig_dfl))
        cpu = args["cpu"]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (args["memory"], args["memory"]))
        resource.setrlimit(resource.RLIMIT_NPROC, (args["processes"], args["processes"]))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if root:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        # No setuid binary or file capability may give back what was dropped.
        check(libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        os.chdir("/tmp")
        os.execve(interpreter, [interpreter, "-S", "-I", "main.py"], program_env)

    def run_init(lifeline: int) -> None:
        libc.prctl(pr_set_pdeathsig, sigkill)
        # Signals from inside the namespace reach its init only where it has
        # a handler, and Python has one for SIGINT: without a user namespace
        # the program (another uid) cannot signal the init anyway, with one
        # it could end the init, and the run would lose its verdict.
        libc.signal(sigint, ctypes.c_void_p(sig_ign))
        # If the keeper died before that took effect, the lifeline has ended.
        os.set_blocking(lifeline, False)
        try:
            if os.read(lifeline, 1) == b"":
                os._exit(1)
        except BlockingIOError:
            pass
        os.close(lifeline)
        # The program must not hold the stop pipe: it could drain it.
        os.close(args["stop"])
        # A fresh /proc shows the PID namespace of the process that mounts it.
        check(libc.mount(b"proc", b"/proc", b"proc", ms_nosuid | ms_nodev | ms_noexec, None), "mount proc on /proc")
        program = os.fork()
        if program == 0:
            exec_program()
        release_stdio()
        while True:
            pid, wait_status, usage = os.wait4(-1, 0)
            if pid == program:
                report(f"exit {wait_status} {usage.ru_utime + usage.ru_stime:.3f}")
                os._exit(0)

    try:
        # The interpreter itself, not a link to it (a virtual environment's
        # bin/python), whose path the program's view may not have: -S makes
        # a virtual environment moot anyway.
        interpreter = os.path.realpath(sys.executable)
        root = os.geteuid() == 0
        uid = 0x70000000 + os.getpid() if root else os.geteuid()
        gid = uid if root else os.getegid()
        flags = clone_newns | clone_newpid | clone_newipc
        flags |= 0 if args["network"] else clone_newnet
        flags |= 0 if root else clone_newuser
        if root:
            hint = "; as root this needs CAP_SYS_ADMIN, which containers often drop"
        else:
            hint = (
                "; not root, this needs unprivileged user namespaces (sysctls user.max_user_namespaces, "
                "kernel.unprivileged_userns_clone, kernel.apparmor_restrict_unprivileged_userns)"
            )
        names = "".join(f",{name}" for bit, name in ((clone_newnet, "NET"), (clone_newuser, "USER")) if flags & bit)
        check(libc.unshare(flags), f"unshare(CLONE_NEW{{NS,PID,IPC{names}}})", hint)
        if not root:
            # The caller's ids map to themselves: files and limits stay theirs.
            for name, line in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as file:
                    file.write(line)
        # Private first: no mount made here may propagate back to the host.
        check(libc.mount(None, b"/", None, ms_rec | ms_private, None), "making / a private mount tree")
        if root:
            expose_interpreter()
        # Then every mount read-only and nosuid.
        attr = (ctypes.c_uint64 * 4)(mount_attr_rdonly | mount_attr_nosuid, 0, 0, 0)
        check(
            libc.syscall(
                ctypes.c_long(sys_mount_setattr),
                ctypes.c_long(at_fdcwd),
                ctypes.c_char_p(b"/"),
                ctypes.c_long(at_recursive),
                attr,
                ctypes.c_long(ctypes.sizeof(attr)),
            ),
            "mount_setattr(/, read-only, recursive)",
            " (needs Linux 5.12 or later)",
        )
        options = f"size={args['scratch']},mode=0700,uid={uid},gid={gid}".encode()
        for target in ("/tmp", "/dev/shm"):
            check(
                libc.mount(b"tmpfs", target.encode(), b"tmpfs", ms_nosuid | ms_nodev, options),
                f"mount tmpfs on {target}",
            )
        with open(args["source"], "rb") as source, open("/tmp/main.py", "wb") as script:
            script.write(source.read())
        os.chown("/tmp/main.py", uid, gid)

        lifeline_r, lifeline_w = os.pipe()
        init = os.fork()
        if init == 0:
            os.close(lifeline_w)
            run_init(lifeline_r)
        os.close(lifeline_r)
        release_stdio()
        init_fd = os.pidfd_open(init)
        ready, _, _ = select.select([init_fd, args["stop"]], [], [])
        if args["stop"] in ready:
            # Not yet reaped, so the pid is still the init's.
            os.kill(init, sigkill)
        os.waitpid(init, 0)
        os._exit(0)
    except (OSError, ValueError) as error:
        fail(f"{type(error).__name__}: {error}")
