"""A reward replica you start yourself, written with nothing but pyzmq and
msgpack (no rlflow import), from protocol/SPEC.md alone.

Start it with what `rlflow join RUN_DIR --role reward --rank N` prints:

    eval "$(rlflow join runs/my-run --role reward --rank 0)"
    python examples/external_reward.py

It registers with the controller, takes sample batches on its own PULL,
scores each sample with `score` below (edit it), fills in the `rewards`
column and the REWARD_END stamp, sends each batch on to the next role,
heartbeats, and exits when told to (a shutdown, or a fatal report: refused,
or replaced after it was presumed lost).
"""

import os
import struct
import sys
import time

import msgpack
import zmq
import zmq.auth.thread

SCHEMA, REWARD, REWARD_END = 2, 2, 3  # schema version, Role.REWARD, Stage.REWARD_END
HELLO, WELCOME, READY, HEARTBEAT, SHUTDOWN, ERROR, BYE, PEERS, BATCH = 10, 11, 12, 13, 22, 23, 24, 30, 2
REWARDS, STAMPS, FAILURES = 11, 10, 15  # positions in a SampleBatch's array (the tag is 0)


def score(response_ids: list[int], reference: str) -> float:
    """The reward of one response (token ids) against its group's reference answer: edit me."""
    return 1.0 if response_ids and response_ids[-1] % 2 == 0 else 0.0


def pack(fields: list, frames: tuple = ()) -> list:
    return [msgpack.packb([SCHEMA, fields]), *frames]


def unpack(frames: list) -> list:
    version, fields = msgpack.unpackb(frames[0], raw=False)
    if version != SCHEMA:
        raise SystemExit(f"a message of schema version {version}; this replica speaks {SCHEMA}")
    return fields


def field(msg: list, i: int, default):
    """Field `i` of a message, or its default (trailing defaults may be left off)."""
    return msg[i] if len(msg) > i else default


def values(frames: list, tensor: list, code: str) -> tuple:
    """A tensor field ([dtype, shape, frame]) as a tuple of numbers, little-endian."""
    data = frames[tensor[2]]
    return struct.unpack(f"<{len(data) // struct.calcsize(code)}{code}", data)


def secure(sock: zmq.Socket, server: bool) -> None:
    """CURVE, where the run uses it: servers with the server keypair, clients with the client keypair."""
    if "RLFLOW_CURVE_SERVER_PUBLIC" not in os.environ:
        return
    key = lambda name: os.environ[f"RLFLOW_CURVE_{name}"].encode()  # noqa: E731
    if server:
        sock.zap_domain = b"rlflow"
        sock.curve_server, sock.curve_secretkey = True, key("SERVER_SECRET")
    else:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            key("SERVER_PUBLIC"), key("CLIENT_PUBLIC"), key("CLIENT_SECRET"))


class OnlyTheRunsClient:
    """Admits to this replica's PULL only the run's client key (a ZAP check)."""

    def callback(self, domain: str, key: bytes) -> bool:
        return key == zmq.utils.z85.decode(os.environ["RLFLOW_CURVE_CLIENT_PUBLIC"])


def scored(frames: list) -> tuple[list, int]:
    """A sample batch with its rewards and REWARD_END stamps filled in, and its number of samples."""
    batch = unpack(frames)
    ids, offsets = values(frames, batch[5], "i"), values(frames, batch[6], "q")
    stamps = list(values(frames, batch[STAMPS], "d"))
    columns = batch[STAMPS][1][1]
    failed = {f[0] for f in batch[FAILURES]} if len(batch) > FAILURES else set()
    rewards, row, now = [], 0, time.time()
    for group in batch[1]:  # [group_id, size, n, reference, task, meta], its samples in row order
        for _ in range(group[1]):
            sample = list(ids[offsets[row]:offsets[row + 1]])
            rewards.append(float("nan") if row in failed else score(sample, group[3]))
            stamps[row * columns + REWARD_END] = now
            row += 1
    out = list(frames)
    out[batch[STAMPS][2]] = struct.pack(f"<{len(stamps)}d", *stamps)
    batch += [None] * (REWARDS + 1 - len(batch))
    if batch[REWARDS] is None:  # a new tensor, in a frame of its own at the end
        batch[REWARDS] = ["float32", [len(rewards)], len(out)]
        out.append(b"")
    out[batch[REWARDS][2]] = struct.pack(f"<{len(rewards)}f", *rewards)
    return [msgpack.packb([SCHEMA, batch]), *out[1:]], len(rewards)


def main() -> int:
    env, ctx = os.environ, zmq.Context()
    ctx.linger = 1000  # what is queued when it exits gets a second to leave
    rank, started = int(env["RLFLOW_RANK"]), time.monotonic()
    if "RLFLOW_CURVE_SERVER_PUBLIC" in env:
        auth = zmq.auth.thread.ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback("rlflow", credentials_provider=OnlyTheRunsClient())
    inbox = ctx.socket(zmq.PULL)
    secure(inbox, server=True)
    port = inbox.bind_to_random_port(f"tcp://{env.get('RLFLOW_HOST') or '127.0.0.1'}")
    control = ctx.socket(zmq.DEALER)
    secure(control, server=False)
    control.connect(env["RLFLOW_CONTROLLER"])
    endpoint = f"tcp://{env.get('RLFLOW_HOST') or '127.0.0.1'}:{port}"
    incarnation = time.time_ns() // 1_000_000  # above every earlier start of this replica
    control.send_multipart(pack([HELLO, REWARD, rank, int(env["RLFLOW_REPLICAS"]), SCHEMA, {"in": endpoint},
                                 os.getpid(), os.uname().nodename, incarnation, env["RLFLOW_SECRET"]]))
    if not control.poll(300_000):
        return print("no welcome within 300 s", file=sys.stderr) or 1
    welcome = unpack(control.recv_multipart())
    if welcome[0] == ERROR:
        return print(f"refused: {welcome[2]}: {welcome[3]}", file=sys.stderr) or 1
    out, peers, beat_s = ctx.socket(zmq.PUSH), set(field(welcome, 3, {}).get("out", [])), field(welcome, 5, 1.0)
    secure(out, server=False)
    out.setsockopt(zmq.IMMEDIATE, 1)
    for address in peers:
        out.connect(address)
    control.send_multipart(pack([READY, 0]))
    poller, seq, samples, groups, busy, next_beat = zmq.Poller(), 0, 0, 0, 0.0, 0.0
    poller.register(inbox, zmq.POLLIN)
    poller.register(control, zmq.POLLIN)
    while True:
        if time.monotonic() >= next_beat:
            elapsed = time.monotonic() - started
            control.send_multipart(pack([HEARTBEAT, seq, 0, busy, elapsed - busy, 0.0, 0.0, {}, [samples, groups]]))
            seq, next_beat = seq + 1, time.monotonic() + beat_s
        ready = dict(poller.poll(100))
        if inbox in ready:
            t0 = time.monotonic()
            frames, n = scored(inbox.recv_multipart())
            out.send_multipart(frames)
            samples, groups, busy = samples + n, groups + len(unpack(frames)[1]), busy + time.monotonic() - t0
        if control in ready:
            msg = unpack(control.recv_multipart())
            if msg[0] == PEERS:
                now = set(field(msg, 1, {}).get("out", []))
                for address in now - peers:
                    out.connect(address)
                for address in peers - now:
                    out.disconnect(address)
                peers = now
            elif msg[0] == SHUTDOWN:
                control.send_multipart(pack([BYE, "shutdown"]))
                return 0
            elif msg[0] == ERROR and msg[1]:  # fatal: refused, or replaced after it was presumed lost
                return print(f"the controller says: {msg[2]}: {msg[3]}", file=sys.stderr) or 1
            # Anything else (a welcome again, a new kind of message) is not for a reward replica.


if __name__ == "__main__":
    sys.exit(main())
