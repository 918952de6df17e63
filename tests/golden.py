"""One fixed example of every message kind, and their saved wire bytes.

`tests/data/wire/v<schema>/<Message>.bin` holds the frames of each example
as a msgpack array of byte strings, written when the message kind was added;
`<Message>.<what>.bin`, of a later example of the same kind with fields
appended since (e.g. `SampleBatch.share`).
A test decodes each saved file and compares it with the example built here,
so a change that would break peers still sending the old bytes fails.

Add the bytes of a new message kind with `python tests/golden.py --write`
(existing files are never overwritten).
"""

from __future__ import annotations

import pathlib
import sys

import msgspec
import numpy as np

from rlflow.protocol import (
    SCHEMA_VERSION,
    Ack,
    Adapter,
    AdapterUpdate,
    Bye,
    ChatMessage,
    Codec,
    Counters,
    Credits,
    EngineLoad,
    Dropped,
    EnvReply,
    EnvReset,
    EnvStep,
    ErrorReport,
    EvalDone,
    Evaluate,
    Expired,
    FinishReason,
    Heartbeat,
    Hello,
    ParamSpec,
    Peers,
    PromptGroup,
    Ready,
    Response,
    Role,
    SendWeights,
    Shutdown,
    Stage,
    StepDone,
    Tensor,
    ToolCall,
    ToolResult,
    UpdateWeights,
    WeightsLoaded,
    WeightsGloo,
    WeightsNccl,
    WeightsGroup,
    WeightsPayload,
    WeightsReady,
    WeightsRequest,
    Welcome,
    build_batch,
    with_text,
)

DATA = pathlib.Path(__file__).parent / "data" / "wire" / f"v{SCHEMA_VERSION}"


def _batch(stages: int = 6):
    """The example batch, with `stages` stamp columns (6: the stages there were when its bytes were saved)."""
    group = PromptGroup(group_id=41, prompt_ids=[1, 7, 7, 2], n=2, reference="14", task="add", min_version=3)
    stamps = np.full(stages, np.nan)
    stamps[Stage.ISSUED] = 1_700_000_000.25
    responses = [
        Response(
            token_ids=np.array([5, 6, 3], np.int32),
            logprobs=np.array([-0.5, -0.25, -1.0], np.float32),
            versions=np.array([3, 3, 4], np.int32),
            finish_reason=FinishReason.STOP,
            stamps=stamps,
        ),
        Response(
            token_ids=np.array([9], np.int32),
            logprobs=np.array([-2.0], np.float32),
            versions=np.array([4], np.int32),
            finish_reason=FinishReason.LENGTH,
            stamps=stamps,
        ),
    ]
    batch = build_batch([(group, responses)])
    return msgspec.structs.replace(
        batch,
        rewards=Tensor.of([1.0, 0.0], "float32"),
        reward_details={"correct": Tensor.of([1.0, 0.0], "float32")},
        teacher_logprobs=Tensor.of([-0.4, -0.3, -0.9, -1.5], "float32"),
    )


def _critic_batch():
    """The example batch as the critic sends it on: its stage stamped, its four columns filled in."""
    batch = _batch(len(Stage))
    stamps = batch.stamps.numpy().copy()
    stamps[:, Stage.CRITIC_END] = 1_700_000_001.5
    return msgspec.structs.replace(
        batch,
        stamps=Tensor.from_numpy(stamps),
        values=Tensor.of([0.25, 0.5, 0.75, 0.125], "float32"),
        returns=Tensor.of([1.0, 1.0, 1.0, 0.0], "float32"),
        token_advantages=Tensor.of([0.75, 0.5, 0.25, -0.125], "float32"),
        critic_versions=Tensor.of([3, 3], "int32"),
    )


def _episodes():
    """A batch of two episodes: the model's turns and an observation between them (masked out)."""
    group = PromptGroup(group_id=43, prompt_ids=[1, 2], n=2, reference="9", task="add")
    stamps = np.full(6, np.nan)  # the stages there were when its bytes were saved
    responses = [
        Response(token_ids=np.array([5, 6, 7, 8, 9], np.int32),
                 logprobs=np.array([-0.5, -0.25, 0.0, 0.0, -1.0], np.float32),
                 versions=np.array([3, 3, 3, 3, 4], np.int32), finish_reason=FinishReason.STOP, stamps=stamps,
                 loss_mask=np.array([1, 1, 0, 0, 1], np.uint8), env_rewards=np.array([0.0, 0.5], np.float32)),
        Response(token_ids=np.array([4], np.int32), logprobs=np.array([-2.0], np.float32),
                 versions=np.array([4], np.int32), finish_reason=FinishReason.TURNS, stamps=stamps,
                 loss_mask=np.array([1], np.uint8), env_rewards=np.array([0.0], np.float32)),
    ]
    return build_batch([(group, responses)])


#: A tokenizer's table for the example batches' ids (with a character of two UTF-8 bytes).
TEXT = {1: "", 2: "", 3: "0", 5: "é", 6: "=", 7: "7", 9: "#"}


def decode(ids) -> str:
    """The example batches' text: each id by `TEXT` (special tokens and unknown ids left out)."""
    return "".join(TEXT.get(i, "") for i in ids.tolist())


def examples() -> dict[str, object]:
    weights = np.arange(24, dtype=np.uint8)
    return {
        "PromptGroup": PromptGroup(group_id=7, prompt_ids=[1, 2, 3], n=8, reference="6", task="add", meta={"k": "v"}),
        "SampleBatch": _batch(),
        "Hello": Hello(
            role=Role.ROLLOUT,
            rank=1,
            replicas=2,
            schema_version=SCHEMA_VERSION,
            endpoints={"in": "tcp://127.0.0.1:5000"},
            pid=1234,
            host="node-a",
            incarnation=1,
            slots=64,
            model="/models/m",
            threads=2,
            cpus="0-1",
        ),
        "Hello.teacher": Hello(role=Role.TEACHER, rank=0, replicas=1, schema_version=SCHEMA_VERSION,
                               probe=[-1.5, -0.25], problems=["math scores reference row 3 at 0"]),
        "Welcome": Welcome(
            schema_version=SCHEMA_VERSION,
            run_id="run-1",
            peers={"out": ["tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"]},
            version=3,
            heartbeat_s=0.5,
            weights=WeightsGloo(host="10.0.0.2", port=29500, world_size=3, rank=1, nbytes=24, bucket_bytes=1024),
            layout=[ParamSpec(name="a.weight", dtype="float32", shape=[2, 2], offset=0),
                    ParamSpec(name="b.bias", dtype="bfloat16", shape=[4], offset=16)],
        ),
        "Ready": Ready(version=3),
        "Heartbeat": Heartbeat(
            seq=9,
            version=3,
            busy_s=1.5,
            starved_s=0.25,
            blocked_s=0.125,
            loading_s=0.0625,
            queues={"in": 2},
            counters=Counters(samples=64, tokens=512, slot_s=1.25, rejected={"malformed": 1},
                              reward_calls={"math.ok": 60, "math.timeout": 4}),
            engine=EngineLoad(slots=64, running=12, waiting=3, kv_cache_usage=0.5, preemptions=2),
        ),
        "Credits": Credits(group_ids=[10, 11, 12], min_versions=[1, 1, 2]),
        "StepDone": StepDone(step=4, version=5, acked=[10, 11], metrics={"loss": 0.5}),
        "Expired": Expired(group_ids=[3], reason="stale"),
        "Expired.errors": Expired(group_ids=[3, 4], reason="every sample failed",
                                  errors=["row 12: engine_error: prompt too long", "row 40: engine_error: boom"]),
        "WeightsReady": WeightsReady(version=5, nbytes=24),
        "UpdateWeights": UpdateWeights(version=5),
        "WeightsLoaded": WeightsLoaded(version=5, seconds=0.02),
        "Shutdown": Shutdown(reason="done"),
        "ErrorReport": ErrorReport(fatal=True, kind="RuntimeError", message="engine died"),
        "ErrorReport.replaced": ErrorReport(fatal=True, kind="replaced", message="rollout-0 incarnation 1 was presumed "
                                           "lost and replaced: it must exit"),
        "Bye": Bye(reason="done"),
        "Ack": Ack(stage=Stage.ROLLOUT_END, group_ids=[10, 12]),
        "Evaluate": Evaluate(version=7, temperature=0.0),
        "EvalDone": EvalDone(version=7, metrics={"accuracy": 0.5, "accuracy.digits_2": 0.75}, seconds=3.5,
                             version_end=8),
        "Peers": Peers(peers={"out": ["tcp://127.0.0.1:5001", "tcp://127.0.0.1:5009"]}),
        "WeightsGroup": WeightsGroup(
            transfer=WeightsGloo(host="10.0.0.2", port=29511, world_size=3, nbytes=4096, generation=2)
        ),
        "Dropped": Dropped(group_ids=[7, 9], reason="reward function 'math': timeout"),
        "SendWeights": SendWeights(
            version=6, transfer=WeightsGloo(host="10.0.0.2", port=29500, world_size=3, nbytes=4096, generation=1)
        ),
        "SampleBatch.share": msgspec.structs.replace(_batch(), advantages=Tensor.of([0.75, -0.75], "float32")),
        "SendWeights.buckets": SendWeights(
            version=7,
            transfer=WeightsGloo(host="10.0.0.2", port=29501, world_size=3, nbytes=4096, generation=2,
                                 bucket_bytes=1024),
        ),
        "SendWeights.nccl": SendWeights(
            version=8,
            transfer=WeightsNccl(host="10.0.0.2", port=29502, world_size=3, nbytes=4096, generation=3,
                                 bucket_bytes=1024, ranks_per_receiver=2),
        ),
        "SampleBatch.critic": _critic_batch(),
        "Heartbeat.critic": Heartbeat(
            seq=4, version=2, busy_s=2.5, starved_s=0.5, queues={"pending": 1},
            counters=Counters(samples=16, groups=16, tokens=200, critic_steps=2, critic_tokens=150, value_s=0.75,
                              critic_step_s=1.5),
        ),
        "WeightsRequest": WeightsRequest(version=5),
        "SampleBatch.episodes": _episodes(),
        "Heartbeat.env": Heartbeat(seq=3, version=0, counters=Counters(env_requests=12, env_calls={
            "step.ok": 8, "tool.python.ok": 3, "tool.python.timeout": 1, "tool.unparsed": 1})),
        "Hello.env": Hello(role=Role.ENV, rank=0, replicas=2, schema_version=SCHEMA_VERSION,
                           endpoints={"env": "tcp://127.0.0.1:5010"}),
        "EnvReset": EnvReset(request_id=7, group_id=41, row={"a": 57, "b": 68}, reference="125"),
        "EnvStep": EnvStep(request_id=8, group_id=41, index=1, turn=2, text='<tool_call>{"name": "python"}',
                           calls=[ToolCall(name="python", arguments='{"code": "print(1)"}', id="c1")],
                           state={"tries": 1}, row={"a": 57, "b": 68}, reference="125", turns=["7+8=15"]),
        "EnvReply": EnvReply(request_id=8, messages=[ChatMessage(role="tool", content="1\n", name="python",
                                                                 tool_call_id="c1")],
                             reward=0.5, state={"tries": 2}, results=[ToolResult(name="python", status="ok")]),
        "WeightsPayload": WeightsPayload(
            version=5,
            names=["a.weight", "b.bias"],
            tensors=[Tensor("float32", (2, 2), weights[:16]), Tensor("bfloat16", (4,), weights[16:])],
        ),
        "Hello.adapter": Hello(
            role=Role.TRAINER, rank=0, replicas=1, schema_version=SCHEMA_VERSION,
            weights=WeightsGloo(host="10.0.0.2", port=29500, nbytes=256, bucket_bytes=1024),
            layout=[ParamSpec(name="base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", dtype="float32",
                              shape=[4, 8], offset=0),
                    ParamSpec(name="base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", dtype="float32",
                              shape=[8, 4], offset=128)],
            adapter=Adapter(rank=4, alpha=8.0, targets=["q_proj", "v_proj"], update=AdapterUpdate.PER_REQUEST,
                            versions=3),
        ),
        "Welcome.adapter": Welcome(
            schema_version=SCHEMA_VERSION, run_id="run-1", version=2,
            weights=WeightsGloo(host="10.0.0.2", port=29500, world_size=2, rank=1, nbytes=256),
            adapter=Adapter(rank=4, alpha=8.0, targets=["q_proj"]),
        ),
        "WeightsReady.checksum": WeightsReady(version=6, nbytes=256, checksum="crc32:0badcafe"),
        "WeightsLoaded.checksum": WeightsLoaded(version=6, seconds=0.01, checksum="crc32:0badcafe"),
        "SampleBatch.text": with_text(_batch(len(Stage)), decode),
        "Hello.text": Hello(role=Role.REWARD, rank=0, replicas=1, schema_version=SCHEMA_VERSION,
                            endpoints={"in": "tcp://127.0.0.1:5003"}, text=True),
        "Welcome.text": Welcome(schema_version=SCHEMA_VERSION, run_id="run-1",
                                peers={"out": ["tcp://127.0.0.1:5003", "tcp://127.0.0.1:5004"]},
                                text_peers=["tcp://127.0.0.1:5003"]),
        "Peers.text": Peers(peers={"out": ["tcp://127.0.0.1:5003"]}, text_peers=["tcp://127.0.0.1:5003"]),
    }


def load(name: str) -> list[bytes]:
    return msgspec.msgpack.decode((DATA / f"{name}.bin").read_bytes(), type=list[bytes])


def write_missing() -> list[str]:
    DATA.mkdir(parents=True, exist_ok=True)
    codec, written = Codec(), []
    for name, msg in examples().items():
        path = DATA / f"{name}.bin"
        if not path.exists():
            frames = [bytes(memoryview(f).cast("B")) for f in codec.encode(msg)]
            path.write_bytes(msgspec.msgpack.encode(frames))
            written.append(name)
    return written


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/golden.py --write   (writes files for new message kinds only)")
    print("wrote:", ", ".join(write_missing()) or "nothing")
