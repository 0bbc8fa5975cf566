"""vLLM's `collective_rpc`: a method (or a function) run on every worker, its results returned in
rank order. What a call carries between processes, and how a worker runs it.

A call is a worker method's name (the worker's own, or one a `worker_extension_cls` adds) or a
function taking the worker first, with positional and keyword arguments. Between processes it
travels as msgpack: plain values, numpy arrays and torch tensors (any dtype, bf16 included, as
raw bytes) as they are; a function, or any other object, only by pickle, which vLLM's
`VLLM_ALLOW_INSECURE_SERIALIZATION=1` must allow on both sides (otherwise refused by name, as
vLLM refuses it). Results travel the same way. As in vLLM, tuples arrive as lists.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

INSECURE_SERIALIZATION_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"

_EXT_TENSOR = 1  # msgpack (torch dtype name, shape, raw bytes)
_EXT_ARRAY = 2  # msgpack (numpy dtype str, shape, raw bytes)
_EXT_PICKLE = 3  # pickle.dumps(obj); a function: cloudpickle's


@dataclass(frozen=True, slots=True)
class RpcCall:
    """One collective_rpc call: `method` a worker method's name or a function whose first
    argument is the worker."""

    method: str | Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def make_call(method: str | Callable[..., Any], args: Any = (), kwargs: dict[str, Any] | None = None) -> RpcCall:
    """The call `collective_rpc(method, args=..., kwargs=...)` asks for, its arguments checked."""
    if not isinstance(method, str) and not callable(method):
        raise TypeError(f"collective_rpc: method must be a worker method's name or a callable, got "
                        f"{type(method).__name__}")
    if isinstance(method, str) and (not method or method.startswith("_")):
        raise ValueError(f"collective_rpc: method {method!r} is not a worker method that may be called")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"collective_rpc: args must be a tuple, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"collective_rpc: kwargs must be a dict, got {type(kwargs).__name__}")
    return RpcCall(method, tuple(args), dict(kwargs or {}))


def run_call(worker: Any, call: RpcCall) -> Any:
    """`worker.<method>(*args, **kwargs)`, or `function(worker, *args, **kwargs)`."""
    if isinstance(call.method, str):
        target = getattr(worker, call.method, None)
        if target is None or not callable(target):
            raise AttributeError(f"collective_rpc: the worker ({type(worker).__name__}) has no method "
                                 f"{call.method!r}; a worker_extension_cls adds methods")
        return target(*call.args, **call.kwargs)
    return call.method(worker, *call.args, **call.kwargs)


def insecure_serialization_allowed() -> bool:
    return os.environ.get(INSECURE_SERIALIZATION_ENV, "0").strip().lower() in ("1", "true")


def encode_call(call: RpcCall) -> bytes:
    return encode((call.method, call.args, call.kwargs))


def decode_call(data: bytes) -> RpcCall:
    method, args, kwargs = msgspec.msgpack.decode(data, type=tuple[Any, list, dict[str, Any]], ext_hook=_ext_hook)
    return make_call(method, args, kwargs)


def encode(value: Any) -> bytes:
    """`value` (a result, or a call's parts) as msgpack; a function or an object msgpack cannot
    hold is pickled only where INSECURE_SERIALIZATION_ENV allows it (TypeError naming it otherwise)."""
    return msgspec.msgpack.encode(value, enc_hook=_enc_hook)


def decode(data: bytes) -> Any:
    return msgspec.msgpack.decode(data, ext_hook=_ext_hook)


def _enc_hook(obj: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _tensor_ext(obj)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray) and not obj.dtype.hasobject:
        array = numpy.ascontiguousarray(obj)
        return msgspec.msgpack.Ext(_EXT_ARRAY, msgspec.msgpack.encode((array.dtype.str, array.shape,
                                                                       array.tobytes())))
    if not insecure_serialization_allowed():
        raise TypeError(f"collective_rpc: an object of type {type(obj).__name__} is not serializable without "
                        f"pickle; set {INSECURE_SERIALIZATION_ENV}=1 to allow pickle-based serialization (as in "
                        "vLLM)")
    if callable(obj) and getattr(obj, "__module__", None) is not None:
        import cloudpickle  # (pickles lambdas and functions defined in a script, as vLLM does)

        return msgspec.msgpack.Ext(_EXT_PICKLE, cloudpickle.dumps(obj))
    return msgspec.msgpack.Ext(_EXT_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _tensor_ext(tensor: Any) -> msgspec.msgpack.Ext:
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    dtype = str(tensor.dtype).removeprefix("torch.")
    return msgspec.msgpack.Ext(_EXT_TENSOR, msgspec.msgpack.encode((dtype, tuple(tensor.shape), raw)))


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _EXT_TENSOR:
        import torch

        dtype_name, shape, raw = msgspec.msgpack.decode(data, type=tuple[str, tuple[int, ...], bytes])
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise msgspec.DecodeError(f"collective_rpc: unknown tensor dtype {dtype_name!r}")
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    if code == _EXT_ARRAY:
        import numpy

        dtype, shape, raw = msgspec.msgpack.decode(data, type=tuple[str, tuple[int, ...], bytes])
        if numpy.dtype(dtype).hasobject:
            raise msgspec.DecodeError("collective_rpc: numpy arrays of Python objects are not accepted")
        return numpy.frombuffer(bytearray(raw), dtype=numpy.dtype(dtype)).reshape(shape)
    if code == _EXT_PICKLE:
        if not insecure_serialization_allowed():
            raise msgspec.DecodeError(f"collective_rpc: a pickled object arrived, and this process does not "
                                      f"allow pickle ({INSECURE_SERIALIZATION_ENV} is not set)")
        return pickle.loads(data)
    raise msgspec.DecodeError(f"collective_rpc: unknown msgpack ext type {code}")


def resolve_qualname(qualname: str, what: str) -> Any:
    """The object `module.sub.Name` names (vLLM's `resolve_obj_by_qualname`); `what` names the
    setting in errors."""
    module_name, _, name = qualname.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"{what}={qualname!r} is not a qualified name 'module.Name'")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what}={qualname!r} cannot be imported: {exc}") from None
