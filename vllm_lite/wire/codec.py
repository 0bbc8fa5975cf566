"""The one msgpack codec for every process boundary (client <-> engine core, engine core ->
ranks): `obj -> [msgpack frame, *array frames]` and back.

numpy arrays of at least `INLINE_ARRAY_MAX_BYTES` travel as extra frames, uncopied; the msgpack
frame holds an ext (dtype, shape, frame index) for each. Smaller arrays are inlined. Received
arrays are read-only views of their frames (never copied). No pickle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

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
        except RecursionError:
            raise msgspec.DecodeError("malformed message: nested too deeply") from None
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
