"""Replicas the user starts: `launch = "external"`. The reference external
reward replica (examples/external_reward.py: pyzmq and msgpack, no rlflow)
takes the reward role of a simulated run, is killed mid-run and started
again, and the run finishes with a clean audit; again across CURVE. A reward
replica that speaks only the wire asks for text and reads the tokenizer's
decode of every response; one that does not ask gets token ids alone."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time

import pytest
import trio

from rlflow.control.status import run_status
from rlflow.rundir import RunDir
from rlflow.startup import JOIN_ENV, join_environment

from test_controller import run_in_process, sim

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "external_reward.py"


def example():
    """The example's module, for its wire helpers (`pack`, `unpack`, `field`, `values`, `scored`)."""
    spec = importlib.util.spec_from_file_location("external_reward", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start_replica(run_dir: pathlib.Path, rank: int = 0) -> subprocess.Popen:
    """The example, started as a user would: with `rlflow join`'s environment."""
    folder = RunDir(run_dir)
    env = {**os.environ, **join_environment(folder.read_join(), "reward", rank, str(folder.join))}
    with open(run_dir / f"external-{rank}.log", "ab") as log:
        return subprocess.Popen([sys.executable, str(EXAMPLE)], env=env, stdout=log, stderr=log)


@pytest.mark.parametrize("curve", ["auto", "on"])
@pytest.mark.slow  # a run, a restart and an external process
async def test_an_external_reward_replica_joins_survives_a_restart_and_nothing_is_lost(tmp_path, curve):
    from rlflow.tools.audit import audit

    config = sim("run.steps=12", "roles.reward.launch='external'", "roles.reward.pool=''", f"cluster.curve='{curve}'",
                 "cluster.heartbeat_timeout_s=2", "cluster.handshake_timeout_s=60")
    procs: list[subprocess.Popen] = []

    async def user(controller, launcher) -> None:
        while controller.address is None or not RunDir(tmp_path).join.exists():
            await trio.sleep(0.05)
        assert RunDir(tmp_path).join.stat().st_mode & 0o077 == 0  # it holds the run's secret
        procs.append(start_replica(tmp_path))
        while controller.ledger.steps_done < 4:
            await trio.sleep(0.05)
        procs[-1].send_signal(signal.SIGKILL)  # mid-run, as a crash would
        reward = controller.roster.replicas[("reward", 0)]
        while reward.registered:  # presumed lost (it went silent): its groups are granted again
            await trio.sleep(0.05)
        assert run_status(controller, trio.current_time()).waiting_for == ["reward-0"]
        procs.append(start_replica(tmp_path))  # the user starts it again

    try:
        with trio.fail_after(120):
            controller, summary = await run_in_process(config, tmp_path, during=user)
    finally:
        for proc in procs:
            try:
                proc.wait(timeout=15)  # told to shut down, it leaves on its own
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    assert summary.state == "stopped" and summary.steps == 12, summary.error
    assert procs[-1].returncode == 0  # told to shut down, it said goodbye
    status = RunDir(tmp_path).read_status()
    reward = status.roles["reward"]
    assert (reward.restarts, reward.placed[0].external, reward.placed[0].state) == (1, True, "gone")
    assert any("reward-0 sent nothing for" in w for w in status.warnings), status.warnings
    result = audit(tmp_path)
    assert (result.lost, result.duplicated, result.trained) == (0, 0, 12 * 4), result
    rewards = [row.reward_mean for row in RunDir(tmp_path).read_metrics()]
    assert all(r is not None and 0 <= r <= 1 for r in rewards)  # scored by the example's function


def test_join_prints_what_an_external_replica_needs_and_spec_md_names_each(tmp_path):
    from rlflow.data.transport import new_curve_keys
    from rlflow.rundir import JoinInfo, write_json
    from rlflow.tools import cli

    folder = RunDir(tmp_path)
    keys = new_curve_keys()
    write_json(folder.join, JoinInfo(run_id="r1", controller="tcp://10.0.0.1:5000", secret="s3", host="",
                                     replicas={"rollout": 1, "reward": 2, "trainer": 1}, external=["reward-1"],
                                     curve=keys, handshake_timeout_s=90.0), private=True)
    done = subprocess.run([sys.executable, "-m", "rlflow", "join", str(tmp_path), "--role", "reward", "--rank", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    exported = dict(shlex.split(line)[1].split("=", 1) for line in done.stdout.splitlines())  # as a shell reads it
    assert exported["RLFLOW_CONTROLLER"] == "tcp://10.0.0.1:5000" and exported["RLFLOW_REPLICAS"] == "2"
    assert exported["RLFLOW_CURVE_CLIENT_SECRET"] == keys.client_secret and set(exported) == set(JOIN_ENV)
    assert (exported["RLFLOW_HANDSHAKE_TIMEOUT_S"], exported["RLFLOW_HEARTBEAT_TIMEOUT_S"]) == ("90", "60")
    assert cli.main(["join", str(tmp_path), "--role", "reward", "--rank", "0"]) == 2  # rlflow starts that one
    assert cli.main(["join", str(tmp_path), "--role", "reward", "--rank", "5"]) == 2
    spec = (ROOT / "protocol" / "SPEC.md").read_text()
    assert all(f"`{name}`" in spec for name in JOIN_ENV)


#: Positions in a SampleBatch's array (the tag is 0) and its text columns (SPEC.md, *Text*).
PROMPT_IDS, PROMPT_OFFSETS, RESPONSE_IDS, RESPONSE_OFFSETS = 2, 3, 5, 6
RESPONSE_TEXT, RESPONSE_TEXT_OFFSETS, PROMPT_TEXT, PROMPT_TEXT_OFFSETS = 25, 26, 27, 28


def wire_reward(env: dict[str, str], text: bool, seen: list) -> None:
    """A reward replica of raw pyzmq and msgpack (the example's helpers) that says `Hello.text = text`,
    scores and forwards every batch like the example, and puts in `seen` each sample's (response ids,
    its text or None) and each group's (prompt ids, its text or None), until told to shut down."""
    import zmq

    ex = example()
    ctx = zmq.Context()
    inbox, control, out = ctx.socket(zmq.PULL), ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)
    try:
        port = inbox.bind_to_random_port("tcp://127.0.0.1")
        control.connect(env["RLFLOW_CONTROLLER"])
        # Fields 10-19 at their defaults (weights, layout, slots, model, probe, problems, threads, cpus, shm,
        # adapter), then field 20, `text`.
        control.send_multipart(ex.pack([ex.HELLO, ex.REWARD, 0, 1, ex.SCHEMA, {"in": f"tcp://127.0.0.1:{port}"},
                                        os.getpid(), "", 0, env["RLFLOW_SECRET"],
                                        None, [], 0, "", [], [], 0, "", "", None, text]))
        assert control.poll(30_000), "no welcome"
        welcome = ex.unpack(control.recv_multipart())
        assert welcome[0] == ex.WELCOME, welcome
        peers = ex.field(welcome, 3, {})["out"]
        assert ex.field(welcome, 10, []) == []  # the teacher it streams to did not ask
        for address in peers:
            out.connect(address)
        control.send_multipart(ex.pack([ex.READY, 0]))
        poller, seq, beat = zmq.Poller(), 0, 0.0
        poller.register(inbox, zmq.POLLIN)
        poller.register(control, zmq.POLLIN)
        while True:
            if time.monotonic() >= beat:
                control.send_multipart(ex.pack([ex.HEARTBEAT, seq, 0]))
                seq, beat = seq + 1, time.monotonic() + ex.field(welcome, 5, 1.0)
            ready = dict(poller.poll(100))
            if inbox in ready:
                frames = inbox.recv_multipart()
                batch = ex.unpack(frames)
                seen.extend(rows(ex, frames, batch, RESPONSE_IDS, RESPONSE_OFFSETS, RESPONSE_TEXT,
                                 RESPONSE_TEXT_OFFSETS))
                seen.extend(rows(ex, frames, batch, PROMPT_IDS, PROMPT_OFFSETS, PROMPT_TEXT, PROMPT_TEXT_OFFSETS))
                out.send_multipart(ex.scored(frames)[0])
            if control in ready:
                msg = ex.unpack(control.recv_multipart())
                if msg[0] == ex.SHUTDOWN:
                    control.send_multipart(ex.pack([ex.BYE, "shutdown"]))
                    return
    finally:
        ctx.destroy(linger=1000)


def rows(ex, frames: list, batch: list, ids_at: int, offsets_at: int, text_at: int, text_offsets_at: int) -> list:
    """(token ids, text or None) of each row of one pair of id and text columns of a batch."""
    ids, offsets = ex.values(frames, batch[ids_at], "i"), ex.values(frames, batch[offsets_at], "q")
    text = ex.field(batch, text_at, None)
    if text is None:
        texts = [None] * (len(offsets) - 1)
    else:
        data, ends = bytes(frames[text[2]]), ex.values(frames, batch[text_offsets_at], "q")
        texts = [data[a:b].decode("utf-8") for a, b in zip(ends, ends[1:])]
    return [(list(ids[a:b]), t) for a, b, t in zip(offsets[:-1], offsets[1:], texts, strict=True)]


@pytest.mark.parametrize("text", [True, False])
async def test_a_wire_only_reward_replica_gets_the_text_it_asks_for_and_none_otherwise(tmp_path, text):
    from rlflow.tasks.core import load_tokenizer
    from rlflow.models import SHIPPED

    config = sim("run.steps=2", "roles.reward.launch='external'", "roles.reward.pool=''", 'task={kind = "arith"}',
                 f"roles.rollout.model='{SHIPPED}'", "eval.before=false", "eval.after=false", "eval.every_steps=0")
    seen: list = []

    async def user(controller, launcher) -> None:
        while controller.address is None or not RunDir(tmp_path).join.exists():
            await trio.sleep(0.05)
        folder = RunDir(tmp_path)
        env = join_environment(folder.read_join(), "reward", 0, str(folder.join))
        await trio.to_thread.run_sync(wire_reward, env, text, seen, abandon_on_cancel=True)

    with trio.fail_after(60):
        controller, summary = await run_in_process(config, tmp_path, during=user)
    assert summary.state == "stopped" and summary.steps == 2, summary.error
    assert len(seen) >= 2 * 4 * (4 + 1)  # two steps of four groups of four samples, and their prompts
    if not text:
        assert all(t is None for _, t in seen)
        return
    tokenizer = load_tokenizer(SHIPPED)
    assert all(t == tokenizer.decode(ids, skip_special_tokens=True) for ids, t in seen)
    assert sum(bool(t) for _, t in seen) > len(seen) // 2  # real text, not empty strings
