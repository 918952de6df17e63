"""rlflow's wire contract: every message, tensor framing, encode and decode.

Depends on msgspec and numpy only (torch lazily, for `Tensor.torch`). See
SPEC.md beside this file for the format in plain language.
"""

from .batch import Response, SampleView, build_batch, concat, layout, samples, split, stamp, take, text_of, with_text
from .checks import validate
from .codec import Codec, decode, encode
from .errors import (
    FrameCountMismatch,
    FrameSizeMismatch,
    MalformedMessage,
    ProtocolError,
    SchemaVersionMismatch,
    TruncatedMessage,
    UnknownMessageType,
    UnsupportedDType,
)
from .messages import (
    MESSAGE_TYPES,
    Ack,
    Adapter,
    AdapterUpdate,
    SCHEMA_VERSION,
    REPLACED,
    UNAUTHENTICATED,
    UNEXPECTED_HELLO,
    WEIGHT_GROUP_BROKEN,
    NO_SIGNAL,
    WRONG_VERSION,
    AnyMessage,
    Bye,
    ChatMessage,
    ControlMessage,
    CONTROLLER_ERROR_KINDS,
    Counters,
    Credits,
    EngineLoad,
    DataMessage,
    Dropped,
    EnvMessage,
    EnvReply,
    EnvReset,
    EnvStep,
    ErrorReport,
    EvalDone,
    Evaluate,
    Expired,
    FinishReason,
    GroupInfo,
    Heartbeat,
    Hello,
    Message,
    ParamSpec,
    Peers,
    PromptGroup,
    Ready,
    Role,
    SampleBatch,
    SampleFailure,
    SendWeights,
    Shutdown,
    Stage,
    StepDone,
    ToolCall,
    ToolResult,
    UpdateWeights,
    WeightsLoaded,
    WeightsMessage,
    WeightsPayload,
    WeightTransfer,
    WeightsGloo,
    WeightsGroup,
    WeightsNccl,
    WeightsReady,
    WeightsRequest,
    WeightsZmq,
    Welcome,
)
from .tensors import DTYPE_SIZES, Tensor
from .checksum import payload_checksum, weights_checksum

__all__ = [name for name in dir() if not name.startswith("_")]
