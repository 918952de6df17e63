"""How fast rlflow moves tensors between two processes, against the usual ways.

For payloads of named bf16 / fp32 tensors from 1 KiB to 256 MiB, measured in
one run on this machine:

* rlflow: the protocol's zero-copy frames over the trio/ZeroMQ transport;
* shm: the same, with tensors of at least 1 MiB through shared memory (one
  copy into a reused segment; the receiver views it in place);
* pickle: the same tensors pickled into one frame over the same socket;
* ray: `ray.put` in this process, `ray.get` in a Ray actor;
* memcpy: one copy of the payload's bytes between two warm buffers, the
  ceiling (a socket path copies twice, so 0.5 of it is the most it can do;
  shared memory copies once). `memcpy_ratio` divides its median by the
  path's median, measured minutes apart; on a machine whose load swings,
  the paired ratio is steadier: after each transfer the sender times one
  memcpy of the same size, and the ratio is the median of those pairs.

Each figure is the median of several one-way transfers (send to "the
receiver holds usable torch tensors"), timed on the monotonic clock both
processes share, after two untimed ones (the first transfer of a size also
makes its segments: reported apart). Also: 1 KiB messages per second, one
way, streamed, with and without shared memory turned on.

Prints a table, writes bench/results/transport.json and ends with

    RESULT transport size=64MiB memcpy_ratio=R pickle_speedup=P ray_speedup=Y small_msgs_per_s=M
        shm_memcpy_ratio=S shm_speedup=X shm_speedup_1KiB=A shm_speedup_1MiB=B shm_small_msgs_per_s=N
        paired_memcpy_ratio=Q shm_paired_memcpy_ratio=T
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import pathlib
import pickle
import statistics
import struct
import sys
import time
from typing import NamedTuple

import numpy as np
import torch
import trio

from rlflow.data import transport
from rlflow.data.shm import ShmSettings
from rlflow.protocol import Codec, Tensor, WeightsMessage, WeightsPayload

KiB, MiB = 1 << 10, 1 << 20
#: Largest tensor in a payload (a small model's layer); one more row sends
#: the 64 MiB payload as a single tensor.
MAX_TENSOR = 4 * MiB
RESULTS = pathlib.Path(__file__).parent / "results"
#: Untimed transfers before each timed series (first touches, connection set-up).
WARMUP = 2
#: The shared-memory path: rlflow's defaults (tensors of 1 MiB and more).
SHM = ShmSettings(label="bench")


def make_payload(nbytes: int, max_tensor: int = MAX_TENSOR) -> dict[str, torch.Tensor]:
    """Named tensors totalling `nbytes`, alternating fp32 and bf16."""
    tensors, left, i = {}, nbytes, 0
    while left > 0:
        size = min(left, max_tensor)
        dtype = torch.float32 if i % 2 == 0 or size % 4 else torch.bfloat16
        itemsize = 4 if dtype == torch.float32 else 2
        size -= size % itemsize
        tensors[f"layers.{i}.weight"] = torch.randn(size // itemsize).to(dtype)
        left -= size
        i += 1
    return tensors


class Case(NamedTuple):
    """One payload: its total size and its largest tensor."""

    label: str
    nbytes: int
    max_tensor: int = MAX_TENSOR

    def payload(self) -> dict[str, torch.Tensor]:
        return make_payload(self.nbytes, self.max_tensor)


def to_message(version: int, tensors: dict[str, torch.Tensor]) -> WeightsPayload:
    return WeightsPayload(
        version=version, names=list(tensors), tensors=[Tensor.from_torch(t) for t in tensors.values()]
    )


# -- the receiving process ------------------------------------------------------


def receiver(inbox: str, acks: str, plan: list[tuple[str, int]]) -> None:
    """Take each planned message, make usable tensors of it, report when done."""

    async def main() -> None:
        async with (
            transport.open_pull(connect=inbox, codec=Codec(WeightsMessage)) as pull,
            transport.open_push(connect=acks, linger_ms=10_000) as ack,
        ):
            for method, count in plan:
                if method == "stream":
                    await pull.recv()
                    t0 = time.perf_counter()
                    for _ in range(count - 1):
                        await pull.recv()
                    await ack.send_frames([struct.pack("d", (count - 1) / (time.perf_counter() - t0))])
                    continue
                for _ in range(count):
                    if method in ("rlflow", "shm"):
                        msg = await pull.recv()
                        tensors = dict(zip(msg.names, (t.torch() for t in msg.tensors)))
                    else:
                        msg = await pull.recv_frames()
                        tensors = pickle.loads(msg[0].buffer)["tensors"]
                    done = time.perf_counter()
                    assert tensors
                    # Drop them before the next arrives, as a consumer that
                    # has applied a weight update would.
                    del tensors, msg
                    await ack.send_frames([struct.pack("d", done)])

    trio.run(main)


# -- the measuring process ------------------------------------------------------


class Timed(NamedTuple):
    """What `measure_sockets` found for each payload."""

    median: dict[str, float]
    first: dict[str, float]
    #: Median of memcpy time / transfer time, each memcpy right after its transfer.
    paired: dict[str, float]


async def measure_sockets(method: str, cases: list[Case], reps: dict[str, int]) -> Timed:
    """Median one-way time of each payload with `method` ("rlflow", "shm" or
    "pickle"), to a fresh receiving process started as a service would be;
    the time of each payload's first transfer; and the paired memcpy ratio."""
    out = Timed({}, {}, {})
    async with _receiver([(method, WARMUP + reps[c.label]) for c in cases], shm=method == "shm") as (push, acks):
        assert push.uses_shm == (method == "shm")
        for case in cases:
            tensors = case.payload()
            message = to_message(0, tensors)
            src, dst = np.ones(case.nbytes, np.uint8), np.zeros(case.nbytes, np.uint8)
            np.copyto(dst, src)
            times, ratios = [], []
            for _ in range(WARMUP + reps[case.label]):
                t0 = time.perf_counter()
                if method in ("rlflow", "shm"):
                    await push.send(message)
                else:
                    # Pickling is part of the cost, as it is for its users.
                    data = pickle.dumps({"version": 0, "tensors": tensors}, protocol=pickle.HIGHEST_PROTOCOL)
                    await push.send_frames([data])
                (done,) = struct.unpack("d", (await acks.recv_frames())[0].bytes)
                times.append(done - t0)
                t1 = time.perf_counter()
                np.copyto(dst, src)
                ratios.append((time.perf_counter() - t1) / times[-1])
            out.median[case.label] = statistics.median(times[WARMUP:])
            out.first[case.label] = times[0]
            out.paired[case.label] = statistics.median(ratios[WARMUP:])
            del src, dst
        if method == "shm":
            assert push.pool.placed and not push.pool.fallbacks, "shared memory was not used for every large payload"
    return out


async def measure_stream(runs: int, count: int, shm: bool) -> list[float]:
    """1 KiB messages per second, one way, streamed."""
    rates = []
    async with _receiver([("stream", count)] * runs, shm=shm) as (push, acks):
        small = to_message(0, {"x": torch.zeros(KiB // 4)})
        for _ in range(runs):
            for _ in range(count):
                await push.send(small)
            rates.append(struct.unpack("d", (await acks.recv_frames())[0].bytes)[0])
    return rates


@contextlib.asynccontextmanager
async def _receiver(plan: list[tuple[str, int]], shm: bool = False):
    settings = SHM if shm else None
    async with (
        transport.open_push(bind="tcp://127.0.0.1:0", hwm=64, codec=Codec(WeightsMessage), shm=settings) as push,
        transport.open_pull(bind="tcp://127.0.0.1:0") as acks,
    ):
        env = os.environ.copy()
        os.environ.update(transport.PROCESS_ENV)
        try:
            proc = mp.get_context("spawn").Process(
                target=receiver, args=(transport.bound_address(push), transport.bound_address(acks), plan), daemon=True
            )
            proc.start()
        finally:
            os.environ.clear()
            os.environ.update(env)
        try:
            yield push, acks
        finally:
            await trio.to_thread.run_sync(proc.join, 60)
            if proc.is_alive():
                proc.kill()


def measure_ray(cases: list[Case], reps: dict[str, int]) -> dict[str, float]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:

        @ray.remote(num_cpus=0)
        class Receiver:
            def take(self, refs: list) -> float:
                tensors = ray.get(refs[0])["tensors"]
                assert tensors
                return time.perf_counter()

        actor = Receiver.remote()
        ray.get(actor.take.remote([ray.put({"tensors": {"x": torch.zeros(1)}})]))
        out = {}
        for case in cases:
            tensors = case.payload()
            times = []
            for _ in range(WARMUP + reps[case.label]):
                t0 = time.perf_counter()
                ref = ray.put({"version": 0, "tensors": tensors})
                times.append(ray.get(actor.take.remote([ref])) - t0)
                del ref
            out[case.label] = statistics.median(times[WARMUP:])
        return out
    finally:
        ray.shutdown()


def measure_memcpy(cases: list[Case], reps: dict[str, int]) -> dict[str, float]:
    out = {}
    for case in cases:
        src, dst = np.ones(case.nbytes, np.uint8), np.zeros(case.nbytes, np.uint8)
        np.copyto(dst, src)  # fault both in first
        times = []
        for _ in range(max(reps[case.label], 9)):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t0)
        out[case.label] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (under a minute)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "transport.json")
    args = parser.parse_args()

    cases = [
        Case("1KiB", KiB),
        Case("64KiB", 64 * KiB),
        Case("1MiB", MiB),
        Case("16MiB", 16 * MiB),
        Case("64MiB", 64 * MiB),
        Case("64MiB-1", 64 * MiB, max_tensor=64 * MiB),
    ]
    if not args.quick:
        cases.append(Case("256MiB", 256 * MiB))
    reps = {c.label: (20 if c.nbytes <= MiB else 7) if args.quick else (50 if c.nbytes <= MiB else 11) for c in cases}
    stream_runs, stream_count = (3, 50_000) if args.quick else (5, 100_000)

    timed = {method: trio.run(measure_sockets, method, cases, reps) for method in ("rlflow", "shm", "pickle")}
    sockets = {method: t.median for method, t in timed.items()}
    streams = {shm: trio.run(measure_stream, stream_runs, stream_count, shm) for shm in (False, True)}
    ray_times = measure_ray(cases, reps)
    memcpy = measure_memcpy(cases, reps)

    rows = []
    print(f"payloads: named fp32/bf16 tensors of at most {MAX_TENSOR // MiB} MiB each; '64MiB-1' is one 64 MiB tensor")
    print(f"{'payload':>8} {'rlflow':>10} {'shm':>10} {'pickle':>10} {'ray':>10} {'memcpy':>10} {'rlflow GB/s':>12} "
          f"{'vs memcpy':>10} {'shm vs memcpy':>14} {'vs pickle':>10} {'vs ray':>8}")
    for case in cases:
        size, key = case.nbytes, case.label
        r, h, p, y, m = (sockets["rlflow"][key], sockets["shm"][key], sockets["pickle"][key], ray_times[key],
                         memcpy[key])
        rows.append(
            {
                "payload": key,
                "bytes": size,
                "max_tensor_bytes": case.max_tensor,
                "rlflow_s": r,
                "shm_s": h,
                "shm_first_s": timed["shm"].first[key],
                "pickle_s": p,
                "ray_s": y,
                "memcpy_s": m,
                "memcpy_ratio": m / r,
                "shm_memcpy_ratio": m / h,
                "paired_memcpy_ratio": timed["rlflow"].paired[key],
                "shm_paired_memcpy_ratio": timed["shm"].paired[key],
                "shm_speedup": r / h,
                "pickle_speedup": p / r,
                "ray_speedup": y / r,
            }
        )
        print(
            f"{key:>8} {r * 1e3:>8.2f}ms {h * 1e3:>8.2f}ms {p * 1e3:>8.2f}ms {y * 1e3:>8.2f}ms {m * 1e3:>8.3f}ms "
            f"{size / r / 1e9:>12.2f} {m / r:>10.2f} {m / h:>14.2f} {p / r:>9.1f}x {y / r:>7.1f}x"
        )
    print("paired memcpy ratio (a memcpy timed right after each transfer), socket / shared memory: "
          + ", ".join(f"{row['payload']} {row['paired_memcpy_ratio']:.2f} / {row['shm_paired_memcpy_ratio']:.2f}"
                      for row in rows))
    print("first transfer with shared memory, its segment made then (steady state above): "
          + ", ".join(f"{row['payload']} {row['shm_first_s'] * 1e3:.2f} ms" for row in rows
                      if row["max_tensor_bytes"] >= SHM.min_bytes and row["bytes"] >= SHM.min_bytes))
    small, small_shm = statistics.median(streams[False]), statistics.median(streams[True])
    for label, rate, runs in (("", small, streams[False]), (", shared memory on", small_shm, streams[True])):
        print(f"1 KiB messages one way{label}: {rate:,.0f}/s (median of {stream_runs} runs of {stream_count:,}: "
              + ", ".join(f"{x:,.0f}" for x in runs) + ")")

    by_payload = {row["payload"]: row for row in rows}
    ref = by_payload["64MiB"]
    result = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__},
        "quick": args.quick,
        "rows": rows,
        "small_msgs_per_s": small,
        "small_msgs_runs": streams[False],
        "shm_small_msgs_per_s": small_shm,
        "shm_small_msgs_runs": streams[True],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"RESULT transport size=64MiB memcpy_ratio={ref['memcpy_ratio']:.2f} "
        f"pickle_speedup={ref['pickle_speedup']:.1f} ray_speedup={ref['ray_speedup']:.1f} "
        f"small_msgs_per_s={small:.0f} shm_memcpy_ratio={ref['shm_memcpy_ratio']:.2f} "
        f"shm_speedup={ref['shm_speedup']:.2f} shm_speedup_1KiB={by_payload['1KiB']['shm_speedup']:.2f} "
        f"shm_speedup_1MiB={by_payload['1MiB']['shm_speedup']:.2f} shm_small_msgs_per_s={small_shm:.0f} "
        f"paired_memcpy_ratio={ref['paired_memcpy_ratio']:.2f} "
        f"shm_paired_memcpy_ratio={ref['shm_paired_memcpy_ratio']:.2f}"
    )


if __name__ == "__main__":
    main()
