"""The wire contract: round trips, saved bytes, hostile input."""

from __future__ import annotations

import itertools
import math
import pathlib

import msgspec
import numpy as np
import pytest
from golden import examples, load
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import hostile, messages, sample_batches, spliced, tensors

import rlflow.protocol as P
from rlflow.protocol import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Codec,
    FrameCountMismatch,
    FrameSizeMismatch,
    Hello,
    MalformedMessage,
    ProtocolError,
    Role,
    SampleBatch,
    SchemaVersionMismatch,
    Tensor,
    TruncatedMessage,
    UnknownMessageType,
    UnsupportedDType,
    WeightsPayload,
)


def wire(frames) -> list[bytes]:
    """What a peer receives: each frame as its own bytes."""
    return [bytes(memoryview(f).cast("B")) for f in frames]


def header(*items) -> bytes:
    return msgspec.msgpack.encode(list(items))


# -- round trips --------------------------------------------------------------


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(messages())
def test_every_message_round_trips(msg):
    codec = Codec()
    frames = wire(codec.encode(msg))
    back = codec.decode(frames)
    assert type(back) is type(msg)
    assert back == msg
    assert wire(codec.encode(back)) == frames


def test_every_message_kind_has_a_saved_example():
    assert {name.split(".")[0] for name in examples()} == {cls.__name__ for cls in MESSAGE_TYPES.values()}


@pytest.mark.parametrize("name", sorted(examples()))
def test_saved_bytes_still_decode(name):
    decoded = Codec().decode(load(name))
    assert decoded == examples()[name]


def test_bytes_of_the_last_schema_are_refused_as_another_version():
    """Schema 2 removed fields (`Hello.info`, `WeightsReady.info`, ...) and typed
    `Heartbeat.counters`: a peer still sending schema 1 is refused, not misread."""
    import msgspec

    from rlflow.protocol import SchemaVersionMismatch

    old = sorted((pathlib.Path(__file__).parent / "data" / "wire" / f"v{SCHEMA_VERSION - 1}").glob("*.bin"))
    assert len(old) > 20
    for path in old:
        with pytest.raises(SchemaVersionMismatch, match=f"schema version {SCHEMA_VERSION - 1}"):
            Codec().decode(msgspec.msgpack.decode(path.read_bytes(), type=list[bytes]))


@settings(max_examples=200)
@given(tensors(max_numel=256))
def test_tensor_views_are_bit_exact(tensor):
    back = Codec().decode(wire(Codec().encode(WeightsPayload(version=0, names=["t"], tensors=[tensor]))))
    assert back.tensors[0].dtype == tensor.dtype and back.tensors[0].shape == tensor.shape
    got = back.tensors[0].torch()
    assert tuple(got.shape) == tensor.shape
    assert got.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes() == bytes(
        memoryview(tensor.data).cast("B")
    )


def test_torch_and_numpy_views_share_the_received_frame():
    import torch

    source = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    frames = wire(Codec().encode(WeightsPayload(version=1, names=["t"], tensors=[Tensor.from_torch(source)])))
    got = Codec().decode(frames).tensors[0].torch()
    assert torch.equal(got, source)
    ints = Codec().decode(wire(Codec().encode(
        WeightsPayload(version=1, names=["t"], tensors=[Tensor.of([1, 2], "int64")]))))
    view = ints.tensors[0].numpy()
    assert not view.flags.writeable  # received buffers are read-only
    assert view.base is not None  # a view, not a copy


def test_sample_batch_is_a_handful_of_frames_for_a_thousand_samples():
    rng = np.random.default_rng(0)
    groups = []
    for g in range(125):
        group = P.PromptGroup(group_id=g, prompt_ids=list(range(10)), n=8)
        responses = []
        for _ in range(8):
            t = int(rng.integers(1, 50))
            responses.append(
                P.Response(
                    token_ids=rng.integers(0, 100, t).astype(np.int32),
                    logprobs=-rng.random(t).astype(np.float32),
                    versions=np.zeros(t, np.int32),
                    finish_reason=P.FinishReason.STOP,
                )
            )
        groups.append((group, responses))
    batch = P.build_batch(groups)
    assert batch.n_samples == 1000
    frames = Codec().encode(batch)
    assert len(frames) == 10
    back = Codec().decode(wire(frames))
    P.validate(back)
    rows = list(P.samples(back))
    assert [len(r.response_ids) for r in rows] == [len(r.token_ids) for _, rs in groups for r in rs]
    assert rows[17].group.group_id == 2 and rows[17].index == 1


def test_concat_keeps_rows_columns_and_failures():
    batch = examples()["SampleBatch"]
    failed = msgspec.structs.replace(
        batch, failures=[P.SampleFailure(index=1, stage=P.Stage.REWARD_END, kind="timeout")]
    )
    both = P.concat([batch, failed])
    P.validate(both)
    assert both.n_samples == 4 and both.group_ids == [41, 41]
    assert both.failures == [P.SampleFailure(index=3, stage=P.Stage.REWARD_END, kind="timeout")]
    assert both.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert both.response_offsets.tolist() == [0, 3, 4, 7, 8]
    assert list(both.reward_details) == ["correct"]


@given(st.lists(sample_batches(), min_size=1, max_size=3))
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_batches_of_one_layout_lose_no_column_when_joined(batches):
    """What a stage joins before sending on (each run of one `layout`) keeps every column and row:
    here each batch with itself, and the runs of one layout among those drawn."""
    for run in [[b, b] for b in batches] + [list(r) for _, r in itertools.groupby(batches, key=P.layout)]:
        joined = P.concat(run)
        P.validate(joined)
        assert P.layout(joined) == P.layout(run[0])
        assert joined.group_ids == [g for b in run for g in b.group_ids]
        assert joined.response_ids.tolist() == [t for b in run for t in b.response_ids.tolist()]
        assert len(joined.failures) == sum(len(b.failures) for b in run)
    no_rewards = msgspec.structs.replace(examples()["SampleBatch"], rewards=None)
    assert P.layout(no_rewards) != P.layout(examples()["SampleBatch"])  # concat would drop the rewards


@given(st.lists(sample_batches(), min_size=1, max_size=3), st.data())
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_groups_cut_from_several_batches_are_the_batches_of_those_groups_joined(batches, data):
    """`concat_groups` (a trainer's step, cut from the messages its groups came in) makes the batch that
    joining a batch of each piece's groups would: rows, optional columns, text and failures."""
    pieces = []
    for b in batches:
        for _ in range(data.draw(st.integers(0, 2)) if b.groups else 0):
            g0 = data.draw(st.integers(0, len(b.groups) - 1))
            pieces.append((b, g0, data.draw(st.integers(g0 + 1, len(b.groups)))))
    if not any(g.size for b, g0, g1 in pieces for g in b.groups[g0:g1]):
        return  # no rows: an episode's rewards column of none is [0, K] in a group's own batch, nil when joined
    cut = P.concat_groups(pieces)
    P.validate(cut)
    assert cut == P.concat([part for b, g0, g1 in pieces for part in P.split(b)[g0:g1]])
    whole = batches[0]
    if whole.groups:
        assert P.concat_groups([(whole, 0, len(whole.groups))]) is whole


def test_a_batch_whose_columns_disagree_cannot_be_made_or_received():
    batch = examples()["SampleBatch"]
    with pytest.raises(ValueError, match="response_offsets"):
        msgspec.structs.replace(batch, response_offsets=Tensor.of([0, 3, 9], "int64"))
    frames = wire(Codec().encode(batch))
    raw = msgspec.msgpack.decode(frames[0])
    raw[1][3], raw[1][6] = raw[1][6], raw[1][3]  # prompt and response offsets swapped
    with pytest.raises(MalformedMessage, match="invalid SampleBatch: columns disagree: prompt_offsets"):
        Codec().decode([msgspec.msgpack.encode(raw), *frames[1:]])


def test_numbers_and_trailing_bytes_as_the_spec_says():
    # An integer where a float is declared; NaN and infinities where no bound forbids them.
    welcome = Codec().decode([header(SCHEMA_VERSION, [11, SCHEMA_VERSION, "r", {}, 0, 2])])
    assert welcome.heartbeat_s == 2.0 and isinstance(welcome.heartbeat_s, float)
    assert math.isnan(Codec().decode([header(SCHEMA_VERSION, [11, 1, "r", {}, 0, math.nan])]).heartbeat_s)
    with pytest.raises(MalformedMessage, match=">= 0"):
        Codec().decode([header(SCHEMA_VERSION, [19, 1, math.nan])])  # WeightsLoaded.seconds
    assert Codec().decode([header(SCHEMA_VERSION, [19, 1, math.inf])]).seconds == math.inf
    # Unsigned 64-bit integers where the bound allows them; an enum value must be a member.
    assert Codec().decode([header(SCHEMA_VERSION, [12, 2**64 - 1])]).version == 2**64 - 1
    with pytest.raises(MalformedMessage, match="invalid Hello"):
        Codec().decode([header(SCHEMA_VERSION, [10, 9, 0, 1, SCHEMA_VERSION])])  # no role 9
    # Nothing may follow the message in frame 0.
    with pytest.raises(MalformedMessage, match="trailing"):
        Codec().decode([header(SCHEMA_VERSION, [12, 3]) + b"\x00"])


def test_parallel_lists_must_be_as_long_as_each_other():
    with pytest.raises(MalformedMessage, match="group_ids has 2 entries and min_versions 1"):
        Codec().decode([header(SCHEMA_VERSION, [14, [1, 2], [0]])])
    with pytest.raises(MalformedMessage, match="names has 2 entries and tensors 1"):
        Codec().decode([header(SCHEMA_VERSION, [41, 1, ["a", "b"], [["uint8", [1], 1]]]), b"x"])


# -- hostile input -------------------------------------------------------------

HELLO = Hello(role=Role.TRAINER, rank=0, replicas=1, schema_version=SCHEMA_VERSION)


def payload(n: int = 16) -> WeightsPayload:
    return WeightsPayload(version=1, names=["t"], tensors=[Tensor.from_numpy(np.arange(n, dtype=np.uint8))])


def test_garbage_is_malformed():
    with pytest.raises(MalformedMessage, match="header is not"):
        Codec().decode([b"\xc1\xc1\xc1"])
    with pytest.raises(MalformedMessage, match="not valid msgpack"):
        Codec().decode([bytes([0x92, SCHEMA_VERSION, 0x92, 0x1B, 0xC1])])


def test_the_envelope_is_checked_before_the_version():
    """SPEC.md: the envelope `[schema_version, message]` first, then the
    version: a message that is not an array is malformed whatever version it
    claims; an empty header is truncated (it ends before its first value)."""
    for version in (SCHEMA_VERSION, SCHEMA_VERSION + 1, 0):
        with pytest.raises(MalformedMessage, match="the message is not an array") as caught:
            Codec().decode([msgspec.msgpack.encode([version, "not a message"])])
        assert caught.value.kind == "malformed"
    with pytest.raises(TruncatedMessage, match="empty"):
        Codec().decode([b""])


def test_decode_itself_refuses_more_frames_than_the_limit():
    from rlflow.protocol.codec import MAX_FRAMES

    frames = [msgspec.msgpack.encode([SCHEMA_VERSION, [27, 0]])] + [b""] * MAX_FRAMES
    with pytest.raises(FrameCountMismatch, match=f"{MAX_FRAMES + 1} frames; at most {MAX_FRAMES}"):
        P.decode(frames)


def test_truncated_header_is_rejected():
    frames = wire(Codec().encode(HELLO))
    with pytest.raises(TruncatedMessage, match="truncated"):
        Codec().decode([frames[0][:-3]])


def test_header_that_is_not_an_envelope_is_malformed():
    with pytest.raises(MalformedMessage, match="schema_version"):
        Codec().decode([header("hello")])


def test_unknown_tag_is_rejected():
    with pytest.raises(UnknownMessageType, match="unknown message tag 99"):
        Codec().decode([msgspec.msgpack.encode([SCHEMA_VERSION, [99, 1, 2]])])


def test_message_of_another_channel_is_rejected():
    frames = wire(Codec().encode(HELLO))
    with pytest.raises(UnknownMessageType, match="not accepted on this channel"):
        Codec(P.DataMessage).decode(frames)
    # A prompt group is on no channel (SPEC.md, *The data plane*).
    group = wire(Codec().encode(examples()["PromptGroup"]))
    for channel in (P.DataMessage, P.ControlMessage, P.WeightsMessage):
        with pytest.raises(UnknownMessageType, match="PromptGroup \\(tag 1\\) is not accepted on this channel"):
            Codec(channel).decode(group)


def test_wrong_schema_version_is_rejected():
    frames = wire(Codec(schema_version=SCHEMA_VERSION + 1).encode(HELLO))
    with pytest.raises(SchemaVersionMismatch, match=f"version {SCHEMA_VERSION + 1}"):
        Codec().decode(frames)


def test_field_out_of_bounds_is_malformed():
    body = [10, int(Role.TRAINER), -1, 1, SCHEMA_VERSION]  # rank < 0
    with pytest.raises(MalformedMessage, match="invalid Hello"):
        Codec().decode([msgspec.msgpack.encode([SCHEMA_VERSION, body])])


def test_missing_tensor_frame_is_rejected():
    frames = wire(Codec().encode(payload()))
    with pytest.raises(FrameCountMismatch, match="frames 1..0"):
        Codec().decode(frames[:1])


def test_extra_frame_is_rejected():
    frames = wire(Codec().encode(payload()))
    with pytest.raises(FrameCountMismatch, match="names 1 tensor frames but 2 arrived"):
        Codec().decode([*frames, b"extra"])


def test_a_tensor_field_appended_by_a_newer_sender_is_ignored_with_its_frame():
    """A newer sender's message with a tensor field this receiver does not
    know: the field and the frame after the known ones are ignored."""
    newer = [41, 1, ["t"], [["uint8", [2], 1]], ["float32", [1], 2]]
    frames = [msgspec.msgpack.encode([SCHEMA_VERSION, newer]), b"ab", b"wxyz"]
    assert Codec().decode(frames) == WeightsPayload(version=1, names=["t"], tensors=[Tensor.of([97, 98], "uint8")])
    # Without an unknown field, or with the unknown frame before a known one, it is refused.
    with pytest.raises(FrameCountMismatch):
        Codec().decode([msgspec.msgpack.encode([SCHEMA_VERSION, newer[:4]]), b"ab", b"wxyz"])
    swapped = [41, 1, ["t"], [["uint8", [2], 2]], ["float32", [1], 1]]
    with pytest.raises(FrameCountMismatch):
        Codec().decode([msgspec.msgpack.encode([SCHEMA_VERSION, swapped]), b"wxyz", b"ab"])


def test_frame_named_twice_is_rejected():
    # A sample batch whose prompt_offsets point at prompt_ids' frame.
    good = wire(Codec().encode(examples()["SampleBatch"]))
    raw = msgspec.msgpack.decode(good[0])
    raw[1][3][2] = raw[1][2][2]
    with pytest.raises(FrameCountMismatch, match="named by two tensors"):
        Codec().decode([msgspec.msgpack.encode(raw), *good[1:]])


def test_hand_written_header_decodes():
    body = [10, int(Role.TRAINER), 0, 1, SCHEMA_VERSION]
    assert Codec().decode([msgspec.msgpack.encode([SCHEMA_VERSION, body])]) == HELLO


def test_declared_size_must_match_the_frame():
    body = [41, 1, ["t"], [["float32", [4], 1]]]
    with pytest.raises(FrameSizeMismatch, match="declares 16 bytes, frame 1 has 15"):
        Codec().decode([msgspec.msgpack.encode([SCHEMA_VERSION, body]), b"x" * 15])


def test_huge_declared_shape_allocates_nothing():
    # 2**62 * 2**62 elements: checked against the 8 bytes received, never allocated.
    body = [41, 1, ["t"], [["float64", [2**62, 2**62], 1]]]
    with pytest.raises(FrameSizeMismatch, match="frame 1 has 8"):
        Codec().decode([msgspec.msgpack.encode([SCHEMA_VERSION, body]), b"x" * 8])


@pytest.mark.parametrize(
    ("tensor", "error", "match"),
    [
        (["complex64", [1], 1], UnsupportedDType, "complex64"),
        (["uint8", [-1], 1], MalformedMessage, "invalid dimension"),
        (["uint8", [1] * 40, 1], MalformedMessage, "at most 32"),
        (["uint8", "4", 1], MalformedMessage, "shape must be an array"),
        (["uint8", [1]], MalformedMessage, "must be \\[dtype, shape, frame\\]"),
        (["uint8", [1], 7], FrameCountMismatch, "frame 7"),
        (["uint8", [1], 0], FrameCountMismatch, "frame 0"),
    ],
)
def test_bad_tensor_descriptions_are_rejected(tensor, error, match):
    body = [41, 1, ["t"], [tensor]]
    with pytest.raises(error, match=match):
        Codec().decode([msgspec.msgpack.encode([SCHEMA_VERSION, body]), b"x"])


def test_empty_message_is_rejected():
    with pytest.raises(FrameCountMismatch, match="no header"):
        Codec().decode([])


@settings(max_examples=500)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_random_bytes_raise_only_protocol_errors(frames):
    try:
        Codec().decode(frames)
    except ProtocolError:
        pass


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(messages(), st.data())
def test_corrupted_messages_raise_only_protocol_errors(msg, data):
    frames = wire(Codec().encode(msg))
    head = bytearray(frames[0])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(head) - 1))
        head[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(head)))
    try:
        Codec().decode([bytes(head[:cut]), *frames[1:]])
    except ProtocolError:
        pass


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(messages(), st.data())
def test_deep_or_oversized_msgpack_anywhere_raises_only_protocol_errors(msg, data):
    """Deep nesting and huge declared or real sizes, put anywhere in a real
    message's header (or appended as an extra field): the codec either
    decodes a message or raises one of the protocol's errors, nothing else,
    and then decodes the next good message as before."""
    codec = Codec()
    frames = wire(codec.encode(msg))
    try:
        codec.decode(data.draw(spliced(frames)))
    except ProtocolError:
        pass
    assert codec.decode(frames) == msg


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hostile())
def test_a_hostile_header_is_a_protocol_error(value):
    for head in (value, header(SCHEMA_VERSION, value), bytes([0x92, SCHEMA_VERSION]) + value):
        with pytest.raises(ProtocolError):
            Codec().decode([head])


def test_a_thousand_levels_of_nesting_is_malformed_on_every_channel():
    # The header of the report: [1, [[[...]]]], about a kilobyte; and a good
    # Hello with such an extra field appended.
    deep = bytes([0x92, SCHEMA_VERSION]) + b"\x91" * 1000 + b"\x00"
    head = wire(Codec().encode(HELLO))[0]
    version, fields = msgspec.msgpack.decode(head)
    # One more field, a placeholder 0 (its byte is the last) that becomes the deep nesting.
    trailing = msgspec.msgpack.encode([version, [*fields, 0]])[:-1] + b"\x91" * 1000 + b"\x00"
    for channel in (P.AnyMessage, P.ControlMessage, P.DataMessage, P.WeightsMessage):
        with pytest.raises(MalformedMessage):
            Codec(channel).decode([deep])
    for channel in (P.AnyMessage, P.ControlMessage):
        with pytest.raises(MalformedMessage, match="nested deeper"):
            Codec(channel).decode([trailing])


def test_nesting_within_the_guaranteed_depth_is_accepted_in_an_extra_field():
    from rlflow.protocol.codec import MIN_DEPTH_ACCEPTED

    version, fields = msgspec.msgpack.decode(wire(Codec().encode(HELLO))[0])
    value = b"\x91" * (MIN_DEPTH_ACCEPTED - 2) + b"\x00"  # the message itself is two levels
    # One more field, a placeholder 0 (its byte is the last) that becomes the nested value.
    extended = msgspec.msgpack.encode([version, [*fields, 0]])[:-1] + value
    assert Codec().decode([extended]) == HELLO


def test_a_header_over_the_size_limit_is_malformed():
    frames = wire(Codec().encode(HELLO))
    with pytest.raises(MalformedMessage, match=f"header of {len(frames[0])} bytes; at most 8 are accepted"):
        Codec(max_header_bytes=8).decode(frames)
    assert Codec(max_header_bytes=len(frames[0])).decode(frames) == HELLO


def test_a_codec_recovers_after_a_rejection():
    codec = Codec()
    with pytest.raises(FrameSizeMismatch):
        codec.decode([msgspec.msgpack.encode([SCHEMA_VERSION, [41, 1, ["t"], [["uint8", [2], 1]]]]), b"x"])
    assert codec.decode(wire(codec.encode(payload(4)))) == payload(4)


def test_tensor_constructor_checks_its_buffer():
    with pytest.raises(FrameSizeMismatch, match="needs 8 bytes"):
        Tensor("float32", (2,), b"x" * 7)
    with pytest.raises(UnsupportedDType):
        Tensor.from_numpy(np.zeros(2, np.complex64))


def test_expected_nbytes_is_exact_for_large_shapes():
    assert P.tensors.expected_nbytes("bfloat16", (2**40, 3)) == 2 * 3 * 2**40
    assert math.prod((2**40, 3)) * 2 == P.tensors.expected_nbytes("float16", (2**40, 3))


def test_sample_batch_is_exported():
    assert SampleBatch.__struct_config__.tag == 2


def test_spec_tables_match_the_code():
    import pathlib

    from rlflow.protocol import spec

    text = (pathlib.Path(P.__file__).parent / "SPEC.md").read_text()
    start, end = text.index(spec.BEGIN), text.index(spec.END) + len(spec.END)
    assert text[start:end] == spec.generate(), "regenerate SPEC.md's tables: python -m rlflow.protocol.spec"


def test_take_and_split_keep_rows_and_renumber_failures():
    batch = P.concat([examples()["SampleBatch"], examples()["SampleBatch"]])
    batch = msgspec.structs.replace(batch,
                                    failures=[P.SampleFailure(index=3, stage=P.Stage.REWARD_END, kind="timeout")])
    parts = P.split(batch)
    assert [p.n_samples for p in parts] == [2, 2]
    assert parts[1].failures == [P.SampleFailure(index=1, stage=P.Stage.REWARD_END, kind="timeout")]
    kept = P.take(batch, [0, 2])
    P.validate(kept)
    assert kept.response_ids.tolist() == [5, 6, 3, 5, 6, 3]
    assert [g.size for g in kept.groups] == [1, 1]
    assert kept.teacher_logprobs.numel == 6 and kept.rewards.tolist() == [1.0, 1.0]
    assert P.take(batch, []).n_samples == 0
    assert P.take(batch, range(4)) is batch  # every row in order: the batch itself, no copy


def test_text_travels_with_its_rows_through_concat_take_and_split():
    from golden import decode

    batch = examples()["SampleBatch.text"]
    assert [(r.response_text, r.prompt_text) for r in P.samples(batch)] == [("é=0", "77"), ("#", "77")]
    assert batch.response_text.tolist() == list("é=0#".encode()) and batch.response_text_offsets.tolist() == [0, 4, 5]
    assert P.samples(examples()["SampleBatch"]).__next__().response_text is None  # none asked: no column
    other = P.with_text(P.take(batch, [1]), lambda ids: "ü" * len(ids))
    both = P.concat([batch, other])
    assert [(r.response_text, r.prompt_text) for r in P.samples(both)] == [("é=0", "77"), ("#", "77"), ("ü", "üüüü")]
    assert [r.response_text for r in P.samples(P.take(both, [2, 0]))] == ["ü", "é=0"]
    assert [[r.response_text for r in P.samples(part)] for part in P.split(both)] == [["é=0", "#"], ["ü"]]
    assert P.concat([both, examples()["SampleBatch"]]).response_text is None  # only where every batch has it
    assert [r.response_text for r in P.samples(batch)] == [decode(r.response_ids) for r in P.samples(batch)]


@pytest.mark.parametrize(("column", "value", "match"), [
    ("response_text_offsets", None, "response_text and response_text_offsets come together"),
    ("prompt_text", None, "prompt_text and prompt_text_offsets come together"),
    ("response_text_offsets", Tensor.of([0, 5], "int64"), "must be int64 \\[3\\]"),
    ("response_text_offsets", Tensor.of([0, 4, 3], "int64"), "must run from 0 to 5"),
    ("response_text_offsets", Tensor.of([0, 1, 5], "int64"), "starts inside a UTF-8 character"),
    ("response_text", Tensor.of([0xC3, 0xA9, 0x3D, 0x30, 0xFF], "uint8"), "not UTF-8 at byte 4"),
    ("prompt_text", Tensor.of([55, 55], "int32"), "must be uint8"),
])
def test_a_text_column_that_breaks_a_rule_of_the_spec_is_malformed(column, value, match):
    with pytest.raises(ValueError, match=match):
        msgspec.structs.replace(examples()["SampleBatch.text"], **{column: value})


def test_a_received_batch_whose_text_is_not_utf8_is_malformed():
    frames = wire(Codec().encode(examples()["SampleBatch.text"]))
    raw = msgspec.msgpack.decode(frames[0])
    text = raw[1][25]  # response_text: [dtype, shape, frame]
    assert bytes(frames[text[2]]) == "é=0#".encode()
    frames[text[2]] = b"\xa9\xc3=0#"  # as long, but a row starts inside a character
    with pytest.raises(MalformedMessage, match="columns disagree: a row of response_text starts inside"):
        Codec().decode(frames)


def test_every_rejection_the_spec_names_is_raised_by_decode_itself():
    """SPEC.md's *Validation* table, kind by kind: each is what `decode`
    alone (no socket) raises for a message that breaks that rule. (The
    receivers' rules of the control plane, a hello refused or a replaced
    incarnation answered, are the controller's: tests/test_controller.py and
    tests/test_faults.py.)"""
    import re

    spec = (pathlib.Path(P.__file__).parent / "SPEC.md").read_text()
    table = spec[spec.index("| rejection | when |"): spec.index("The checks run in this order")]
    kinds = re.findall(r"^\| `(\w+)` \|", table, re.M)
    good = wire(Codec().encode(payload()))
    one_tensor = msgspec.msgpack.decode(good[0])
    breaking = {
        "malformed": [msgspec.msgpack.encode([SCHEMA_VERSION, "not a message"])],
        "truncated": [good[0][:-2], good[1]],
        "unknown_type": [msgspec.msgpack.encode([SCHEMA_VERSION, [99]])],
        "wrong_version": [msgspec.msgpack.encode([SCHEMA_VERSION + 1, one_tensor[1]]), good[1]],
        "frame_count": [good[0]],
        "frame_size": [good[0], good[1][:-1]],
        "dtype": [msgspec.msgpack.encode([SCHEMA_VERSION, [41, 1, ["t"], [["complex128", [2], 1]]]]), b"x" * 16],
        # A tensor in shared memory ([dtype, shape, frame, offset]) to a decoder that takes none.
        "shm": [msgspec.msgpack.encode([SCHEMA_VERSION, [41, 1, ["t"], [["uint8", [16], 1, 4096]]]]), b"x" * 40],
    }
    assert sorted(kinds) == sorted(breaking), "a rejection kind of SPEC.md has no case here (or one went)"
    for kind in kinds:
        with pytest.raises(P.ProtocolError) as caught:
            P.decode(breaking[kind])
        assert caught.value.kind == kind, (kind, caught.value)


def test_the_weights_checksum_is_the_one_spec_md_defines():
    """CRC-32 over each tensor's ``name:dtype:shape`` line and its bytes, in
    order: what a peer in another language computes from SPEC.md."""
    import zlib

    from rlflow.protocol import Tensor, payload_checksum, weights_checksum

    w, b = np.arange(4, dtype=np.float32), np.array([7], np.int32)
    crc = zlib.crc32(b"w:float32:2,2\n")
    crc = zlib.crc32(w.tobytes(), crc)
    crc = zlib.crc32(b"b:int32:1\n", crc)
    crc = zlib.crc32(b.tobytes(), crc)
    got = weights_checksum([("w", "float32", [2, 2], w), ("b", "int32", [1], b)])
    assert got == f"crc32:{crc:08x}" == "crc32:31c1b0d8"
    assert payload_checksum(["w", "b"], [Tensor("float32", (2, 2), w), Tensor.from_numpy(b)]) == got
    # Another order, name or shape of the same bytes is another checksum.
    assert weights_checksum([("w", "float32", [4], w), ("b", "int32", [1], b)]) != got
    assert weights_checksum([("b", "int32", [1], b), ("w", "float32", [2, 2], w)]) != got
