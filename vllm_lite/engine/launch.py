"""Starting an engine-core process, and attaching to one that runs already.

A spawned engine core reports on a pipe once it serves (or why it could not start: that error
is raised here, in the client). An attaching client first asks the engine who it is
(`engine_info`), which also proves something answers at the address.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import msgspec
import zmq

from vllm_lite.config import EngineArgs, VllmConfig
from vllm_lite.engine.core import spawned_engine_core_main
from vllm_lite.exceptions import EngineStartupError
from vllm_lite.wire import (
    MsgpackDecoder,
    MsgpackEncoder,
    OutputType,
    RequestType,
    UtilityRequest,
    UtilityResult,
)
from vllm_lite.engine.tokenizer import load_tokenizer
from vllm_lite.engine.zmq_utils import EngineAddress, make_socket, normalize_address, private_ipc_address
from vllm_lite.lifecycle import ready_pipe, spawn, stop_processes, wait_ready_report

T = TypeVar("T")

STARTUP_TIMEOUT_S = 600.0  # loading a large model can take minutes
HANDSHAKE_TIMEOUT_S = 10.0
# Start-up errors re-raised with their own type (others become EngineStartupError).
_STARTUP_ERROR_TYPES: dict[str, type[Exception]] = {
    "ValueError": ValueError, "TypeError": TypeError, "FileNotFoundError": FileNotFoundError,
    "MemoryError": MemoryError,
}


@dataclass(slots=True)
class EngineLaunch:
    """An engine-core process being started. `launch_engine_core` returns at once, so the caller
    can do its own start-up (load the tokenizer) meanwhile; `wait_ready` then blocks."""

    proc: BaseProcess
    address: EngineAddress
    ready_reader: Connection

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> dict[str, Any]:
        """The engine core's start-up report: its address and `engine_info`."""
        try:
            return self._wait_ready(timeout_s)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        stop_processes([self.proc])
        self.address.cleanup()

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        try:
            raw = wait_ready_report(self.ready_reader, self.proc, timeout_s)
        except TimeoutError:
            raise EngineStartupError(f"engine core did not start within {timeout_s:.0f} s") from None
        if raw is None:
            raise EngineStartupError(
                f"engine core process exited with code {self.proc.exitcode} while starting (its error is "
                "above; a script that starts an engine needs an `if __name__ == '__main__':` guard, "
                "since the engine core process is spawned)")
        report = msgspec.msgpack.decode(raw)
        if "error_type" in report:
            error_type = _STARTUP_ERROR_TYPES.get(report["error_type"], EngineStartupError)
            raise error_type(f"engine core failed to start: {report['error_type']}: {report['message']}")
        return report


def launch_engine_core(vllm_config: VllmConfig) -> EngineLaunch:
    """Spawn an engine-core process listening on a fresh private ipc path."""
    address = private_ipc_address()
    reader, writer = ready_pipe()
    try:
        proc = spawn(spawned_engine_core_main, (vllm_config, address, writer), name="vllm-lite-engine-core",
                     imports_torch=True)
    except BaseException:
        address.cleanup()
        raise
    writer.close()
    return EngineLaunch(proc, address, reader)


def load_tokenizer_while_launching(vllm_config: VllmConfig, launch: EngineLaunch | list[EngineLaunch] | None) -> Any:
    """The client's tokenizer, loaded while spawned engine cores (if any: one, or a data-parallel
    engine's each) load their models (`made_while_launching`). None with skip_tokenizer_init."""
    if vllm_config.model_config.skip_tokenizer_init:
        return None
    return made_while_launching(launch, lambda: load_tokenizer(vllm_config.model_config.tokenizer))


def made_while_launching(launch: EngineLaunch | list[EngineLaunch] | None, make: Callable[[], T]) -> T:
    """`make()`, a part of the client made while spawned engine cores load their models; if it
    fails, the launches are stopped rather than left running."""
    try:
        return make()
    except BaseException:
        for each in launch if isinstance(launch, list) else [launch] if launch is not None else []:
            each.abort()
        raise


def fetch_engine_info(address: str, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> dict[str, Any]:
    """Ask the engine core at `address` who it is (model, max_model_len, pid)."""
    address = normalize_address(address)
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, zmq.DEALER, connect=address)
        sock.send_multipart([RequestType.UTILITY, *MsgpackEncoder().encode(UtilityRequest(0, "engine_info"))])
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no engine core answered at {address} within {timeout_s:.0f} s")
        frames = sock.recv_multipart(copy=False)
    finally:
        ctx.destroy(linger=0)
    if frames[0].bytes != OutputType.UTILITY_RESULT:
        raise ConnectionError(f"{address} answered, but not like an engine core")
    return utility_value(MsgpackDecoder(UtilityResult).decode(frames[1:]))


def attached_engine_args(address: str, model: str | None, engine_args: dict[str, Any]) -> EngineArgs:
    """EngineArgs for a client of the engine core at `address`: the model, tokenizer,
    max_model_len, runner (with its pooler config), LoRA settings and logits processors the user
    left out are the engine's."""
    info = fetch_engine_info(address)
    values = dict(engine_args)
    values.setdefault("tokenizer", None)
    values.setdefault("max_model_len", None)
    if "runner" not in values and info.get("runner") == "pooling":
        values["runner"] = "pooling"
        values.setdefault("pooler_config", info.get("pooler_config"))
    if values["tokenizer"] is None and model is None:
        values["tokenizer"] = info["tokenizer"]
    if values["max_model_len"] is None:
        values["max_model_len"] = info["max_model_len"]
    if info.get("lora") and "enable_lora" not in values:
        values.update(enable_lora=True, **{key: value for key, value in info["lora"].items() if key not in values})
    if info.get("logits_processors") and "logits_processors" not in values:
        values["logits_processors"] = info["logits_processors"]
    return EngineArgs(model=model or info["model"], **values)


def utility_value(result: UtilityResult) -> Any:
    if result.error is not None:
        raise RuntimeError(f"engine core utility call failed: {result.error}")
    return result.result
