"""The code sandbox, against real programs: limits, isolation, and that
nothing of a run is left behind. Every test starts real processes."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlflow.sandbox import Limits, Result, SandboxError, Status, check_isolation, run_python

REASON = check_isolation()

#: Slack for a run to be gone after its limit: generous, since this checks
#: that the limit stops the run (a program it failed to stop would run for a
#: minute), not how fast; bench/sandbox_start.py times the sandbox.
MARGIN_S = 5.0


def test_sandbox_is_available_or_the_machine_refuses_namespaces():
    # The only reasons the other tests may skip: not Linux, or the kernel
    # refused to make namespaces. Anything else (a bug of ours) fails here.
    if REASON is not None and sys.platform == "linux":
        assert REASON.startswith("the sandbox could not be set up: unshare("), REASON


needs_sandbox = pytest.mark.skipif(REASON is not None, reason=f"no sandbox on this machine: {REASON}")


def token() -> str:
    """A process name (at most 15 characters) no other process has."""
    return "sbx" + secrets.token_hex(6)


def named(name: str) -> list[int]:
    """Pids, on the host, of the processes called `name`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                comm = Path(f"/proc/{entry}/comm").read_text().strip()
            except OSError:
                continue  # it ended while we looked
            if comm == name:
                pids.append(int(entry))
    return pids


def rename(name: str) -> str:
    """Program text that gives its process, and all it forks, `name`."""
    return f"open('/proc/self/comm', 'w').write({name!r})\n"


@needs_sandbox
def test_program_gets_stdin_and_returns_stdout():
    result = run_python("import sys\ntext = sys.stdin.read()\nprint(text.upper(), end='')\n", stdin="héllo\nworld\n")
    assert result == Result(Status.OK, 0, "HÉLLO\nWORLD\n", "", result.seconds)


@needs_sandbox
def test_the_program_cannot_write_grow_or_shrink_its_stdin():
    # Its stdin is a sealed in-memory file: reopened for writing through
    # /proc, every write, resize and writable shared mapping is refused.
    program = (
        "import mmap, os\n"
        "fd = os.open('/proc/self/fd/0', os.O_RDWR)\n"
        "for name, attempt in [\n"
        "    ('write', lambda: os.pwrite(fd, b'X', 0)),\n"
        "    ('grow', lambda: os.ftruncate(fd, 1 << 20)),\n"
        "    ('shrink', lambda: os.ftruncate(fd, 0)),\n"
        "    ('map', lambda: mmap.mmap(fd, 4, mmap.MAP_SHARED, mmap.PROT_WRITE)),\n"
        "]:\n"
        "    try:\n"
        "        attempt()\n"
        "        print(name, 'allowed')\n"
        "    except OSError:\n"
        "        print(name, 'refused')\n"
        "print(os.pread(fd, 16, 0).decode())\n"
    )
    result = run_python(program, stdin="kept")
    assert result.stdout == "write refused\ngrow refused\nshrink refused\nmap refused\nkept\n", result


@needs_sandbox
def test_nonzero_exit_and_uncaught_exception_are_errors():
    exited = run_python("import sys\nprint('partial')\nsys.exit(3)\n")
    assert (exited.status, exited.returncode, exited.stdout) == (Status.ERROR, 3, "partial\n")
    raised = run_python("raise ValueError('bad answer')\n")
    assert (raised.status, raised.returncode) == (Status.ERROR, 1)
    assert raised.stderr.rstrip().endswith("ValueError: bad answer")


@needs_sandbox
def test_a_signal_is_a_crash():
    result = run_python("import os\nos.abort()\n")
    assert (result.status, result.returncode) == (Status.CRASHED, -6)


@needs_sandbox
@pytest.mark.slow  # waits out a sandbox limit
def test_infinite_loop_is_killed_at_its_timeout():
    name = token()
    # It also leaves a sleeper behind, which must die with it.
    program = rename(name) + "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nwhile True:\n    pass\n"
    started = time.monotonic()
    result = run_python(program, limits=Limits(timeout_s=1.0, cpu_s=30))
    elapsed = time.monotonic() - started
    assert (result.status, result.returncode) == (Status.TIMEOUT, None)
    assert 1.0 <= elapsed < 1.0 + MARGIN_S
    assert named(name) == []


@needs_sandbox
@pytest.mark.slow  # waits out a sandbox limit
def test_cpu_limit_stops_a_busy_program():
    # Its wall-clock limit only guards against a hang: one CPU-second took over 10 s of a machine busy
    # with other work.
    result = run_python("while True:\n    pass\n", limits=Limits(timeout_s=240, cpu_s=1))
    assert (result.status, result.returncode) == (Status.CPU_LIMIT, -signal.SIGXCPU)


@needs_sandbox
def test_memory_bomb_is_stopped_at_its_limit():
    program = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    result = run_python(program, limits=Limits(memory_bytes=256 << 20))
    assert (result.status, result.returncode) == (Status.MEMORY_LIMIT, 1)
    assert result.stderr.rstrip().endswith("MemoryError")
    # Under the limit, the same kind of allocation is fine.
    fits = run_python("x = bytearray(64 << 20)\nprint(len(x))\n", limits=Limits(memory_bytes=256 << 20))
    assert (fits.status, fits.stdout) == (Status.OK, f"{64 << 20}\n")


@needs_sandbox
@pytest.mark.slow  # waits out a sandbox limit
def test_fork_bomb_is_contained_and_leaves_nothing():
    name = token()
    program = rename(name) + "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    limits = Limits(timeout_s=1.0, processes=16)
    peak, done = 0, threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, len(named(name)))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run_python(program, limits=limits)
    finally:
        done.set()
        watcher.join(timeout=30)
    assert result.status is Status.TIMEOUT
    assert result.seconds < limits.timeout_s + MARGIN_S
    assert 1 < peak <= limits.processes  # it did fork, and no further than its limit
    assert named(name) == []


@needs_sandbox
def test_double_forked_sleeper_does_not_outlive_its_program():
    name = token()
    program = rename(name) + (
        "import os, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"  # out of the program's session and process group too
        "        os.write(w, b'up')\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "print(os.read(r, 2).decode())\n"
    )
    result = run_python(program)
    # OK, not TIMEOUT: the run did not wait for the sleeper, which held its stdout.
    assert (result.status, result.stdout) == (Status.OK, "up\n")
    assert named(name) == []


@needs_sandbox
def test_no_network_even_to_a_local_listener():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        program = (
            "import socket\n"
            "print(socket.if_nameindex())\n"
            f"for address in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
            "    try:\n"
            "        socket.create_connection(address, timeout=2).close()\n"
            "        print('connected')\n"
            "    except OSError as error:\n"
            "        print(type(error).__name__, error.errno)\n"
        )
        result = run_python(program)
        assert result.status is Status.OK, result.stderr
        # Only a loopback that is down: every connect fails at once (ENETUNREACH).
        assert result.stdout.splitlines() == ["[(1, 'lo')]", "OSError 101", "OSError 101"]
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached it


@needs_sandbox
def test_network_true_shares_the_host_network():
    # The control for the test above: the same connect works when allowed.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')\n"
        result = run_python(program, limits=Limits(network=True))
        assert result.status is Status.OK, result.stderr
        listener.settimeout(2)
        connection, _ = listener.accept()
        with connection:
            assert connection.recv(2) == b"hi"


@pytest.fixture
def outside_dirs():
    """Directories a run can see but must not write to: one that the
    program's uid may not write (as root), one open to everyone. Under
    /var/tmp, because the caller's /tmp is hidden from the program."""
    made = []
    for mode in (0o755, 0o777):
        path = Path(tempfile.mkdtemp(prefix="rlflow-sandbox-test-", dir="/var/tmp"))
        path.chmod(mode)
        made.append(path)
    yield made
    for path in made:
        for child in path.iterdir():
            child.unlink()
        path.rmdir()


@needs_sandbox
def test_writes_outside_its_directory_fail(outside_dirs, tmp_path):
    repository = Path(__file__).resolve().parent.parent
    name = f"escape-{secrets.token_hex(4)}"
    targets = [directory / name for directory in (*outside_dirs, repository, tmp_path)]
    program = (
        "import errno, sys\n"
        "for path in sys.stdin.read().split():\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('written')\n"
        "    except OSError as error:\n"
        "        print(errno.errorcode[error.errno])\n"
    )
    result = run_python(program, stdin="\n".join(map(str, targets)))
    assert result.status is Status.OK, result.stderr
    # A read-only file system whatever the permissions; the caller's /tmp,
    # where the last one lives (and the repository, when it is cloned there),
    # is hidden by the program's own.
    hidden = repository.is_relative_to("/tmp")
    assert result.stdout.splitlines() == ["EROFS", "EROFS", "ENOENT" if hidden else "EROFS", "ENOENT"]
    assert [target for target in targets if target.exists()] == []


@needs_sandbox
def test_scratch_directory_is_private_capped_and_gone_afterwards():
    name = f"left-{secrets.token_hex(4)}"
    program = (
        "import os\n"
        "print(os.getcwd(), sorted(os.listdir('.')))\n"
        f"open({name!r}, 'w').write('x')\n"
        f"open('/dev/shm/{name}', 'w').write('x')\n"
        "try:\n"
        "    open('big', 'wb').write(bytes(2 << 20))\n"
        "except OSError as error:\n"
        "    print(error.strerror)\n"
    )
    limits = Limits(scratch_bytes=1 << 20)
    first = run_python(program, limits=limits)
    assert first.stdout.splitlines() == ["/tmp ['main.py']", "No space left on device"], first.stderr
    assert not Path("/tmp", name).exists() and not Path("/dev/shm", name).exists()
    # The next run starts from an empty directory again.
    second = run_python(program, limits=limits)
    assert second.stdout == first.stdout


@needs_sandbox
def test_output_beyond_the_cap_is_cut():
    limits = Limits(output_bytes=1000)
    flood = run_python(
        "import sys\nsys.stdout.write('x' * 100_000)\nsys.stderr.write('never reached')\n", limits=limits
    )
    assert (flood.status, flood.returncode) == (Status.OUTPUT_LIMIT, None)
    assert flood.stdout == "x" * 1000
    endless = run_python("while True:\n    print('y' * 100, file=__import__('sys').stderr)\n", limits=limits)
    assert (endless.status, len(endless.stderr)) == (Status.OUTPUT_LIMIT, 1000)
    exact = run_python("print('z' * 999)\n", limits=limits)
    assert (exact.status, len(exact.stdout)) == (Status.OK, 1000)


@needs_sandbox
def test_nothing_of_the_caller_is_inherited(monkeypatch):
    monkeypatch.setenv("RLFLOW_TEST_SECRET", "hunter2")
    program = (
        "import os\n"
        "print(sorted(os.environ))\n"
        "print(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))\n"
        "print(os.getuid() != 0, os.getgroups())\n"
        "print(sorted(int(pid) for pid in os.listdir('/proc') if pid.isdigit()))\n"
    )
    with open(os.devnull) as extra:  # an open descriptor of ours, even one marked inheritable
        os.set_inheritable(extra.fileno(), True)
        result = run_python(program)
    lines = result.stdout.splitlines()
    assert lines[0] == "['HOME', 'LANG', 'PATH', 'TMPDIR']"
    assert lines[1] == "[0, 1, 2, 3]"  # stdio, and the listing's own
    if os.geteuid() == 0:
        assert lines[2] == "True []"
    assert lines[3] == "[1, 2]"  # its own /proc: its init and itself


@needs_sandbox
def test_concurrent_runs_are_independent():
    program = "import os, sys\nprint(sys.stdin.read(), os.getuid())\n"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python(program, stdin=str(i)), range(8)))
    assert [r.stdout.split()[0] for r in results] == [str(i) for i in range(8)]
    if os.geteuid() == 0:
        assert len({r.stdout.split()[1] for r in results}) == 8  # a uid of its own each


def test_limits_are_checked():
    for bad in ({"timeout_s": 0}, {"cpu_s": float("nan")}, {"memory_bytes": -1}, {"processes": 0}):
        with pytest.raises(ValueError, match=f"Limits.{next(iter(bad))} must be positive"):
            Limits(**bad)


@needs_sandbox
def test_sandbox_error_is_not_a_program_result():
    # A source that cannot fit its scratch space is the caller's problem.
    with pytest.raises(SandboxError, match="No space left on device"):
        run_python("#" * (2 << 20), limits=Limits(scratch_bytes=1 << 20))


@needs_sandbox
def test_the_program_cannot_take_its_runs_verdict_away():
    # Its init is out of reach: signals to it are dropped or refused, and a
    # kill of everything it may signal spares it.
    program = (
        "import os, signal\n"
        "for pid, signum in [(1, signal.SIGINT), (1, signal.SIGKILL), (-1, signal.SIGKILL)]:\n"
        "    try:\n"
        "        os.kill(pid, signum)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('still judged')\n"
    )
    result = run_python(program)
    assert (result.status, result.stdout) == (Status.OK, "still judged\n")
