"""The leaf of the package: what crosses a process boundary, and the one codec that carries it.

Imports only msgspec, numpy and `vllm_lite.sampling_params`, so every layer (core, engine,
executor, worker) may import it and dependencies still point one way.
"""

from vllm_lite.wire.codec import (
    INLINE_ARRAY_MAX_BYTES,
    Frame,
    MsgpackDecoder,
    MsgpackEncoder,
    peek_request_id,
)
from vllm_lite.wire.engine_core import (
    OUTPUT_STRUCTS,
    PAUSE_MODES,
    REPETITION_STOP_REASON,
    REQUEST_STRUCTS,
    UTILITY_METHODS,
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    FinishedRequest,
    FinishReason,
    ImageInputs,
    OutputType,
    RequestError,
    RequestIdsReceiver,
    RequestIdsSender,
    RequestType,
    ThinkingBudget,
    UtilityRequest,
    UtilityResult,
    split_token_columns,
)
from vllm_lite.wire.worker import (
    CollectiveRpc,
    Flush,
    InitKVCache,
    LogprobsArrays,
    MeasureMemory,
    ModelRunnerOutput,
    Profile,
    Shutdown,
    WorkerReply,
)

__all__ = [
    "INLINE_ARRAY_MAX_BYTES", "Frame", "MsgpackDecoder", "MsgpackEncoder", "peek_request_id",
    "OUTPUT_STRUCTS", "PAUSE_MODES", "REPETITION_STOP_REASON", "REQUEST_STRUCTS", "UTILITY_METHODS", "AbortRequests",
    "EngineCoreOutputs",
    "EngineCoreRequest", "EngineDead", "FinishedRequest", "FinishReason", "ImageInputs", "OutputType",
    "RequestError", "RequestIdsReceiver", "RequestIdsSender", "RequestType", "ThinkingBudget", "UtilityRequest",
    "UtilityResult", "split_token_columns", "CollectiveRpc", "Flush", "InitKVCache", "LogprobsArrays", "MeasureMemory", "ModelRunnerOutput", "Profile", "Shutdown", "WorkerReply",
]
