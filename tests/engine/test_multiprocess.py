"""LLM over a spawned engine-core process (SyncMPClient): same outputs as in-process, start-up
failures surface in the client, malformed frames never kill the engine, a SIGKILLed engine
fails every call fast, and no process or socket file outlives shutdown."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from engine_utils import ENGINE_ARGS, process_gone, token_prompts, wait_until
from vllm_lite import LLM, EngineDeadError, SamplingParams
from vllm_lite.engine.core_client import SyncMPClient
from vllm_lite.wire import (
    MsgpackDecoder,
    MsgpackEncoder,
    OutputType,
    RequestError,
    RequestType,
    UtilityRequest,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(_prompt_ids: tuple[tuple[int, ...], ...]) -> list[dict[str, list[int]]]:
    return token_prompts(_prompt_ids, 12)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, prompts: list[dict[str, list[int]]]) -> list[list[int]]:
    llm = LLM(str(tiny_llama), multiprocess=False, **ENGINE_ARGS)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def mp_llm(tiny_llama: Path):
    llm = LLM(str(tiny_llama), **ENGINE_ARGS)
    yield llm
    llm.shutdown()


def client_of(llm: LLM) -> SyncMPClient:
    client = llm.llm_engine.engine_core
    assert isinstance(client, SyncMPClient)
    return client


def generate_ids(llm: LLM, prompts: list) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_multiprocess_matches_in_process(mp_llm: LLM, reference: list[list[int]],
                                         prompts: list[dict[str, list[int]]]) -> None:
    assert generate_ids(mp_llm, prompts) == reference
    stats = mp_llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_steps"] > 0


def test_attached_client_and_engine_side_rejection(mp_llm: LLM, reference: list[list[int]],
                                                    prompts: list[dict[str, list[int]]]) -> None:
    """A second client attaches to the same engine core. A request id the engine core already
    runs is refused there (not by this client's checks): LLMEngine.step raises it as a
    ValueError and the engine keeps serving both clients."""
    other = SyncMPClient(mp_llm.llm_engine.vllm_config, client_of(mp_llm).address)
    try:
        assert other.engine_info["pid"] == client_of(mp_llm).engine_pid
        other.add_request(_request(mp_llm, "shared-id", max_tokens=200))
        stats = other.get_stats()  # (two sockets: order the two clients' messages by hand)
        assert stats["num_running"] + stats["num_waiting"] == 1
        engine = mp_llm.llm_engine
        engine.add_request("shared-id", {"prompt_token_ids": [7, 8, 9]}, GREEDY)
        with pytest.raises(ValueError, match="already in use"):
            while engine.has_unfinished_requests():
                engine.step()
        assert not engine.has_unfinished_requests()
        assert generate_ids(mp_llm, prompts) == reference
        assert other.get_output().req_ids == ["shared-id"]  # its outputs went to it, not to mp_llm
        other.abort_requests(["shared-id"])
        assert other.get_stats()["num_running"] == 0
    finally:
        other.shutdown()
    assert client_of(mp_llm).is_healthy()  # an attached client's shutdown leaves the engine running


def test_malformed_frames_do_not_stop_the_engine(mp_llm: LLM, reference: list[list[int]],
                                                 prompts: list[dict[str, list[int]]]) -> None:
    """Garbage, a truncated msgpack frame, an unknown type, a lone frame and a dangling array
    reference go straight to the engine's socket; the engine answers an error where it can read
    the request id and serves the next valid request correctly."""
    valid = MsgpackEncoder().encode(_request(mp_llm, "cut-1"))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(client_of(mp_llm).address)
    try:
        sock.send_multipart([RequestType.ADD, b"\xc1\xc1 not msgpack"])
        sock.send_multipart([RequestType.ADD, valid[0][: len(valid[0]) // 2]])  # truncated
        sock.send_multipart([b"\x7f", b"\x90"])  # unknown message type
        sock.send_multipart([RequestType.ADD])  # no payload frame
        sock.send_multipart([RequestType.UTILITY, b"\x93"])  # truncated utility call
        big = MsgpackEncoder().encode(_request(mp_llm, "big-1", num_tokens=200))
        assert len(big) == 2
        sock.send_multipart([RequestType.ADD, big[0]])  # its array frame left out
        assert sock.poll(10_000), "the engine answered nothing"
        tag, *frames = sock.recv_multipart()
        assert tag == OutputType.ERROR
        error = MsgpackDecoder(RequestError).decode(frames)
        assert error.request_id == "cut-1" and "malformed" in error.message
        assert sock.poll(10_000)
        tag, *frames = sock.recv_multipart()
        assert MsgpackDecoder(RequestError).decode(frames).request_id == "big-1"  # missing its array frame
        sock.send_multipart([RequestType.UTILITY, *MsgpackEncoder().encode(UtilityRequest(1, "no_such"))])
        assert sock.poll(10_000)
        assert b"unknown utility method" in sock.recv_multipart()[1]
    finally:
        ctx.destroy(linger=0)
    assert generate_ids(mp_llm, prompts) == reference


def test_deeply_nested_frame_does_not_deafen_the_engine(mp_llm: LLM, reference: list[list[int]],
                                                        prompts: list[dict[str, list[int]]]) -> None:
    """A msgpack frame nested 100,000 deep (RecursionError in the decoder) costs only itself:
    the socket thread answers an error where the request id is readable and keeps serving."""
    deep = b"\x91" * 100_000 + b"\xc0"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(client_of(mp_llm).address)
    try:
        sock.send_multipart([RequestType.ADD, deep])
        sock.send_multipart([RequestType.UTILITY, deep])
        sock.send_multipart([RequestType.ABORT, deep])
        sock.send_multipart([RequestType.ADD, b"\x92\xa7deep-id" + deep])  # readable id, then the nest
        assert sock.poll(10_000), "the engine answered nothing"
        tag, *frames = sock.recv_multipart()
        assert tag == OutputType.ERROR
        error = MsgpackDecoder(RequestError).decode(frames)
        assert error.request_id == "deep-id" and "malformed" in error.message
    finally:
        ctx.destroy(linger=0)
    assert generate_ids(mp_llm, prompts) == reference


def _request(llm: LLM, request_id: str, num_tokens: int = 20, max_tokens: int = 8):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.llm_engine.input_processor.process(request_id, list(range(3, 3 + num_tokens)), params)


def test_startup_failure_is_raised_in_the_client(tiny_llama: Path, tmp_path: Path) -> None:
    broken = Path(shutil.copytree(tiny_llama, tmp_path / "broken"))
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    before = {p.pid for p in _children()}
    with pytest.raises(Exception, match="engine core failed to start"):
        LLM(str(broken), **ENGINE_ARGS)
    assert {p.pid for p in _children()} <= before


def _children():
    import multiprocessing

    return multiprocessing.active_children()


def test_sigkill_fails_pending_and_new_calls_fast(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), **ENGINE_ARGS)
    client = client_of(llm)
    pid, ipc_dir = client.engine_pid, os.path.dirname(client.address[len("ipc://"):])
    errors: list[BaseException] = []
    started = threading.Event()

    def generate_forever() -> None:
        started.set()
        try:
            while True:  # (one call may finish before the kill on a fast machine)
                llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, SamplingParams(max_tokens=240, ignore_eos=True),
                             use_tqdm=False)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            errors.append(exc)

    thread = threading.Thread(target=generate_forever)
    thread.start()
    started.wait()
    time.sleep(0.3)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - killed_at < 2.0
    assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="died"):
        llm.generate("more", GREEDY, use_tqdm=False)
    with pytest.raises(EngineDeadError):
        llm.stats()
    assert time.monotonic() - start < 0.5
    llm.shutdown()
    assert process_gone(pid) and not os.path.exists(ipc_dir)


def test_shutdown_and_garbage_collection_leave_nothing(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), **ENGINE_ARGS)
    pid, address = client_of(llm).engine_pid, client_of(llm).address
    ipc_dir = os.path.dirname(address[len("ipc://"):])
    assert oct(os.stat(ipc_dir).st_mode & 0o777) == "0o700"
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert process_gone(pid) and not os.path.exists(ipc_dir)
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate("x", GREEDY, use_tqdm=False)

    dropped = LLM(str(tiny_llama), **ENGINE_ARGS)
    pid = client_of(dropped).engine_pid
    del dropped
    gc.collect()
    assert wait_until(lambda: process_gone(pid))


def test_stop_token_ids_still_work(mp_llm: LLM) -> None:
    """Requests carry their numpy prompt and sampling params through the wire intact."""
    ids = np.arange(3, 40).tolist()
    first = mp_llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first[2]])
    out = mp_llm.generate({"prompt_token_ids": ids}, stop, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == first[:3] and out.finish_reason == "stop"


def test_requests_of_a_departed_client_are_aborted(mp_llm: LLM) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(client_of(mp_llm).address)
    sock.send_multipart([RequestType.ADD, *MsgpackEncoder().encode(_request(mp_llm, "orphan", max_tokens=200))])
    assert sock.poll(10_000)  # it runs: outputs arrive
    ctx.destroy(linger=0)
    assert wait_until(lambda: mp_llm.stats()["num_running"] == 0)
    stats = mp_llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_engine_core_exits_when_its_client_is_killed(tiny_llama: Path) -> None:
    """SIGKILL of the client process: the engine core notices its parent is gone, exits and
    removes its private ipc directory (no orphan process, no socket file)."""
    script = ("import sys, time\nfrom vllm_lite import LLM\n"
              "if __name__ == '__main__':\n"
              f"    llm = LLM({str(tiny_llama)!r}, max_model_len=64, num_kv_blocks=16)\n"
              "    client = llm.llm_engine.engine_core\n"
              "    print(client.engine_pid, client.address, flush=True)\n"
              "    time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pid, address = client.stdout.readline().split()
        ipc_dir = os.path.dirname(address[len("ipc://"):])
        assert not process_gone(int(pid)) and os.path.isdir(ipc_dir)
    finally:
        client.kill()
        client.wait()
        client.stdout.close()
    assert wait_until(lambda: process_gone(int(pid)), timeout_s=10)
    assert not os.path.exists(ipc_dir)


def test_out_of_range_request_on_the_wire_is_refused_alone(mp_llm: LLM, reference: list[list[int]],
                                                          prompts: list[dict[str, list[int]]]) -> None:
    """Issue 12, findings 1 and 2 on the engine protocol: an EOS id outside the vocabulary with
    min_tokens > 0, and a top_k past int32, sent as raw frames, get an error for themselves
    alone; the engine serves the next greedy request unchanged."""
    import msgspec

    eos = msgspec.structs.replace(_request(mp_llm, "eos-1"), eos_token_ids=(10**6,),
                                  sampling_params=SamplingParams(min_tokens=2, max_tokens=8))
    top_k = MsgpackEncoder().encode(_request(mp_llm, "top-k-1"))
    fields = msgspec.msgpack.decode(top_k[0])
    fields[2] = {"temperature": 1.0, "top_k": 2**31}  # SamplingParams as a map
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(client_of(mp_llm).address)
    try:
        sock.send_multipart([RequestType.ADD, *MsgpackEncoder().encode(eos)])
        sock.send_multipart([RequestType.ADD, msgspec.msgpack.encode(fields), *top_k[1:]])
        errors = {}
        for _ in range(2):
            assert sock.poll(10_000), "the engine answered nothing"
            tag, *frames = sock.recv_multipart()
            assert tag == OutputType.ERROR
            error = MsgpackDecoder(RequestError).decode(frames)
            errors[error.request_id] = error.message
    finally:
        ctx.destroy(linger=0)
    assert "eos_token_ids" in errors["eos-1"] and "top_k" in errors["top-k-1"]
    assert generate_ids(mp_llm, prompts) == reference
