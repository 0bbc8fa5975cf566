"""Wire protocol between clients and the engine core.

A leaf module (msgspec + numpy only): the client side, the engine core and `core/` (which
produces `EngineCoreOutputs`) all import it. Token ids are int32 numpy arrays.

Framing: every ZMQ message is `[type tag, msgpack frame, *array frames]` (a ROUTER adds the
peer's identity in front). The tag says which struct the msgpack frame holds:

| direction | tag | struct |
|---|---|---|
| client -> engine | ADD `\x00` | EngineCoreRequest |
| client -> engine | ABORT `\x01` | AbortRequests |
| client -> engine | UTILITY `\x02` | UtilityRequest |
| engine -> client | OUTPUTS `\x00` | EngineCoreOutputs |
| engine -> client | UTILITY_RESULT `\x01` | UtilityResult |
| engine -> client | ERROR `\x02` | RequestError (a request the engine core rejected) |
| engine -> client | ENGINE_DEAD `\x03` | EngineDead (the busy loop failed; the engine exits) |

numpy arrays of at least `INLINE_ARRAY_MAX_BYTES` travel as extra frames, uncopied; the msgpack
frame holds an ext (dtype, shape, frame index) for each. Smaller arrays are inlined. No pickle.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from vllm_lite.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: np.ndarray
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    max_tokens: int
    client_index: int = 0
    cache_salt: str | None = None  # separates this request's prefix-cache entries (vLLM's field)


class FinishedRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    finish_reason: FinishReason
    stop_reason: int | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's results, column-wise: row i of `new_token_ids` (and of the logprob
    arrays, when requested) belongs to `req_ids[i]`. No per-request objects are built per step."""

    req_ids: list[str]
    new_token_ids: np.ndarray  # int32 [num_reqs]
    finished: list[FinishedRequest] = []
    client_index: int = 0
    # Sample logprobs, present when some request in the step asked for them. Column 0 is the
    # sampled token, columns 1..k the top-k (k = the largest request's), so ranks are 1..k there.
    logprob_token_ids: np.ndarray | None = None  # int32 [num_reqs, k + 1]
    logprobs: np.ndarray | None = None  # float32 [num_reqs, k + 1]
    logprob_ranks: np.ndarray | None = None  # int32 [num_reqs, k + 1]
    # Prompt logprobs of the prefill chunks computed this step: request j owns rows
    # prompt_logprobs_offsets[j]:prompt_logprobs_offsets[j+1]; its first row is prompt position
    # prompt_logprobs_starts[j] (the logprob of the token after it). Column 0 is that token.
    prompt_logprobs_req_ids: list[str] = []
    prompt_logprobs_starts: np.ndarray | None = None  # int32 [num_prompt_reqs]
    prompt_logprobs_offsets: np.ndarray | None = None  # int32 [num_prompt_reqs + 1]
    prompt_logprob_token_ids: np.ndarray | None = None  # int32 [total_rows, k + 1]
    prompt_logprobs: np.ndarray | None = None  # float32 [total_rows, k + 1]
    prompt_logprob_ranks: np.ndarray | None = None  # int32 [total_rows, k + 1]

    @property
    def is_empty(self) -> bool:
        return not self.req_ids and not self.finished


# ---------------------------------------------------------------------------------------------
# Messages besides requests and outputs
# ---------------------------------------------------------------------------------------------


class RequestType:
    """First frame of a client -> engine message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"


class OutputType:
    """First frame of an engine -> client message."""

    OUTPUTS = b"\x00"
    UTILITY_RESULT = b"\x01"
    ERROR = b"\x02"
    ENGINE_DEAD = b"\x03"


# Utility calls an engine core answers; anything else gets an error result.
UTILITY_METHODS = ("get_stats", "is_healthy", "reset_prefix_cache", "engine_info")


class AbortRequests(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_ids: list[str]


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A call of one of `UTILITY_METHODS`; the answer carries the same `call_id`."""

    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    result: Any = None
    error: str | None = None  # set when the call failed; `result` is then None


class RequestError(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The engine core rejected a request (or could not decode it): it will never run."""

    request_id: str
    message: str


class EngineDead(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    message: str


REQUEST_STRUCTS: dict[bytes, type] = {
    RequestType.ADD: EngineCoreRequest,
    RequestType.ABORT: AbortRequests,
    RequestType.UTILITY: UtilityRequest,
}
OUTPUT_STRUCTS: dict[bytes, type] = {
    OutputType.OUTPUTS: EngineCoreOutputs,
    OutputType.UTILITY_RESULT: UtilityResult,
    OutputType.ERROR: RequestError,
    OutputType.ENGINE_DEAD: EngineDead,
}


# ---------------------------------------------------------------------------------------------
# Encoder / decoder: numpy arrays as extra frames
# ---------------------------------------------------------------------------------------------

INLINE_ARRAY_MAX_BYTES = 256  # smaller arrays ride inside the msgpack frame
_EXT_INLINE_ARRAY = 1  # ext payload: msgpack (dtype, shape, raw bytes)
_EXT_FRAME_ARRAY = 2  # ext payload: msgpack (dtype, shape, index of the frame holding the data)

Frame = Any  # bytes, memoryview or zmq.Frame (anything with the buffer protocol or `.buffer`)


class MsgpackEncoder:
    """obj -> `[msgpack frame, *array frames]`, ready for `send_multipart(copy=False)`.

    Array frames are memoryviews of the arrays themselves (no copy): the arrays must not be
    changed until the message is sent. Not thread-safe: one encoder per sending thread."""

    def __init__(self, inline_array_max_bytes: int = INLINE_ARRAY_MAX_BYTES) -> None:
        self.inline_array_max_bytes = inline_array_max_bytes
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._header_encoder = msgspec.msgpack.Encoder()
        self._frames: list[Frame] = []

    def encode(self, obj: Any) -> list[Frame]:
        frames: list[Frame] = [b""]
        self._frames = frames
        try:
            frames[0] = self._encoder.encode(obj)
        finally:
            self._frames = []
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self._encode_array(obj)
        raise TypeError(f"cannot encode objects of type {type(obj).__name__} (no pickle here)")

    def _encode_array(self, array: np.ndarray) -> msgspec.msgpack.Ext:
        if array.dtype.hasobject:
            raise TypeError("numpy arrays of Python objects cannot be encoded")
        array = np.ascontiguousarray(array)
        dtype, shape = array.dtype.str, array.shape
        if array.nbytes < self.inline_array_max_bytes:
            header = self._header_encoder.encode((dtype, shape, array.tobytes()))
            return msgspec.msgpack.Ext(_EXT_INLINE_ARRAY, header)
        self._frames.append(memoryview(array.reshape(-1).view(np.uint8)))
        index = len(self._frames) - 1
        return msgspec.msgpack.Ext(_EXT_FRAME_ARRAY, self._header_encoder.encode((dtype, shape, index)))


class MsgpackDecoder:
    """`[msgpack frame, *array frames]` -> an object of `type_`. Out-of-band arrays are
    read-only `np.frombuffer` views of their frames (no copy). Every malformed input raises
    `msgspec.DecodeError`. Not thread-safe: one decoder per receiving thread."""

    def __init__(self, type_: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook, dec_hook=_dec_hook)
        self._inline_header = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], bytes])
        self._frame_header = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], int])
        self._frames: Sequence[Frame] = ()

    def decode(self, frames: Sequence[Frame]) -> Any:
        if not frames:
            raise msgspec.DecodeError("empty message: no msgpack frame")
        self._frames = frames
        try:
            return self._decoder.decode(_buffer(frames[0]))
        except msgspec.DecodeError:
            raise
        except (ValueError, TypeError, IndexError) as exc:
            raise msgspec.DecodeError(f"malformed message: {exc}") from exc
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> np.ndarray:
        if code == _EXT_INLINE_ARRAY:
            dtype, shape, raw = self._inline_header.decode(data)
            return _array_from(raw, dtype, shape)
        if code == _EXT_FRAME_ARRAY:
            dtype, shape, index = self._frame_header.decode(data)
            if not 1 <= index < len(self._frames):
                raise msgspec.DecodeError(f"array frame {index} is missing ({len(self._frames)} frames)")
            return _array_from(_buffer(self._frames[index]), dtype, shape)
        raise msgspec.DecodeError(f"unknown msgpack ext type {code}")


def _buffer(frame: Frame) -> Any:
    return getattr(frame, "buffer", frame)  # zmq.Frame -> its memoryview


def _array_from(data: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    np_dtype = np.dtype(dtype)
    if np_dtype.hasobject:
        raise msgspec.DecodeError("numpy arrays of Python objects are not accepted")
    return np.frombuffer(data, dtype=np_dtype).reshape(shape)


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise TypeError(f"expected {type_.__name__}, got {type(obj).__name__}")


def peek_request_id(frame: Frame) -> str | None:
    """The request id of a message that did not decode, when it can still be read: every
    request struct is array-like with the id first, so it is the first string of the array."""
    data = bytes(_buffer(frame)[:300])
    pos = _skip_array_header(data)
    if pos is None or pos >= len(data):
        return None
    tag = data[pos]
    if 0xA0 <= tag <= 0xBF:
        start, length = pos + 1, tag & 0x1F
    elif tag in (0xD9, 0xDA):
        width = 1 if tag == 0xD9 else 2
        start, length = pos + 1 + width, int.from_bytes(data[pos + 1:pos + 1 + width], "big")
    else:
        return None
    if start + length > len(data):
        return None
    try:
        return data[start:start + length].decode()
    except UnicodeDecodeError:
        return None


def _skip_array_header(data: bytes) -> int | None:
    if not data:
        return None
    if 0x91 <= data[0] <= 0x9F:
        return 1
    if data[0] == 0xDC:
        return 3
    if data[0] == 0xDD:
        return 5
    return None
