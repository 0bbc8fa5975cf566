"""`vllm-lite engine` on its own, served to two client processes at once (one LLM, one
AsyncLLM): each gets exactly its own outputs. SIGTERM stops it cleanly (no socket file left);
an attached client notices a SIGKILLed engine through its heartbeat."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine_utils import ENGINE_ARGS, process_gone
from vllm_lite import LLM, AsyncLLM, EngineDeadError, SamplingParams

REPO = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).with_name("standalone_client.py")
MAX_TOKENS = 12


@dataclass
class StandaloneEngine:
    proc: subprocess.Popen
    address: str

    @property
    def socket_path(self) -> str:
        return self.address[len("ipc://"):]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}


def start_standalone(model: Path, directory: str, extra_args: tuple[str, ...] = ()) -> StandaloneEngine:
    address = f"ipc://{directory}/engine.sock"
    args = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "engine", "--model", str(model),
            "--max-model-len", str(ENGINE_ARGS["max_model_len"]),
            "--num-kv-blocks", str(ENGINE_ARGS["num_kv_blocks"]), "--dtype", ENGINE_ARGS["dtype"],
            "--address", address, *extra_args]
    proc = subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    if "serving at" not in line:
        stop_standalone(proc)
        pytest.fail(f"the standalone engine did not start: {line!r}")
    assert line.split()[-1] == address
    return StandaloneEngine(proc, address)


def stop_standalone(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.stdout.close()


@pytest.fixture
def standalone(tiny_llama: Path) -> Iterator[StandaloneEngine]:
    with tempfile.TemporaryDirectory(prefix="vllm-lite-test-") as directory:  # mode 0700
        engine = start_standalone(tiny_llama, directory)
        yield engine
        stop_standalone(engine.proc)


def test_two_client_processes_each_get_their_own_outputs(standalone: StandaloneEngine, tiny_llama: Path,
                                                         prompts_token_ids: list[list[int]]) -> None:
    prompts = {"sync": [p[:5 + i] for i, p in enumerate(prompts_token_ids[:6])],
               "async": [p[-(4 + i):] for i, p in enumerate(prompts_token_ids[2:])]}
    clients = {mode: subprocess.Popen([sys.executable, str(CLIENT), standalone.address, mode,
                                       json.dumps(prompts[mode]), str(MAX_TOKENS)],
                                      env=_env(), stdout=subprocess.PIPE, text=True)
               for mode in prompts}
    results = {}
    for mode, proc in clients.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{mode} client failed"
        results[mode] = json.loads(out.strip().splitlines()[-1])

    reference = LLM(str(tiny_llama), multiprocess=False, **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for mode, sent in prompts.items():
        expected = reference.generate([{"prompt_token_ids": p} for p in sent], params, use_tqdm=False)
        assert [r["prompt_token_ids"] for r in results[mode]] == sent
        assert [r["token_ids"] for r in results[mode]] == [e.outputs[0].token_ids for e in expected]
    assert standalone.proc.poll() is None  # clients leaving does not stop the engine


def test_sigterm_stops_it_cleanly(standalone: StandaloneEngine) -> None:
    llm = LLM(engine_address=standalone.address)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.shutdown()
    assert os.path.exists(standalone.socket_path)
    standalone.proc.send_signal(signal.SIGTERM)
    assert standalone.proc.wait(10) == 0
    assert not os.path.exists(standalone.socket_path)


def test_sigterm_tells_attached_clients_at_once(standalone: StandaloneEngine) -> None:
    """A busy attached client and an idle one both learn of the stop from the engine itself
    (an EngineDead message), not from a heartbeat timing out ("has not answered")."""
    idle = LLM(engine_address=standalone.address)
    assert idle.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2), use_tqdm=False)

    async def scenario() -> None:
        engine = AsyncLLM.connect(standalone.address, heartbeat_timeout_s=60.0)
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        try:
            stream = engine.generate({"prompt_token_ids": [5, 6]}, params, "busy")
            await stream.__anext__()
            standalone.proc.send_signal(signal.SIGTERM)
            with pytest.raises(EngineDeadError, match="was stopped"):
                async for _ in stream:
                    pass
        finally:
            engine.shutdown()

    try:
        asyncio.run(scenario())
        assert standalone.proc.wait(10) == 0
        with pytest.raises(EngineDeadError, match="was stopped"):
            idle.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        idle.shutdown()


def test_second_engine_on_the_same_path_is_refused(standalone: StandaloneEngine, tiny_llama: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "vllm_lite.entrypoints.cli", "engine", "--model", str(tiny_llama),
                           "--max-model-len", "64", "--num-kv-blocks", "8", "--address", standalone.address],
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "in use" in proc.stderr
    assert os.path.exists(standalone.socket_path)  # the running engine's socket is left alone


def test_attached_client_detects_a_killed_engine_by_heartbeat(standalone: StandaloneEngine) -> None:
    async def scenario() -> float:
        engine = AsyncLLM.connect(standalone.address, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        try:
            stream = engine.generate({"prompt_token_ids": [5, 6]}, params, "hb")
            await stream.__anext__()
            os.kill(standalone.proc.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(EngineDeadError, match="has not answered"):
                async for _ in stream:
                    pass
            return time.monotonic() - killed_at
        finally:
            engine.shutdown()

    assert asyncio.run(scenario()) < 3.0
    standalone.proc.wait(5)
    assert process_gone(standalone.proc.pid)


def test_a_client_attached_to_an_embedding_engine_takes_its_runner(tiny_qwen3: Path,
                                                                  prompts_token_ids: list[list[int]]) -> None:
    """`vllm-lite engine --runner pooling`: an attached LLM given no engine arguments learns the
    runner and the pooler config from the engine (tests/test_embeddings.py has the rest)."""
    from test_embeddings import assert_close, embeddings, hf_embedding

    with tempfile.TemporaryDirectory(prefix="vllm-lite-test-") as directory:
        engine = start_standalone(tiny_qwen3, directory, ("--runner", "pooling", "--pooler-config",
                                                          '{"pooling_type": "CLS", "use_activation": false}'))
        try:
            llm = LLM(engine_address=engine.address)
            try:
                prompts = prompts_token_ids[1:3]
                expected = [hf_embedding(tiny_qwen3, p, "CLS", normalize=False) for p in prompts]
                assert_close(embeddings(llm, prompts), expected)
            finally:
                llm.shutdown()
        finally:
            stop_standalone(engine.proc)


def test_a_client_attached_to_a_lora_engine_sends_adapters(tiny_llama: Path, tmp_path: Path,
                                                           prompts_token_ids: list[list[int]]) -> None:
    """`vllm-lite engine --enable-lora`: an attached LLM given no engine arguments learns the LoRA
    settings (and checks adapters by them); its adapter's tokens are PEFT's."""
    from lora_adapters import make_adapter, peft_greedy
    from vllm_lite import SamplingParams
    from vllm_lite.lora.request import LoRARequest

    adapter = make_adapter(tiny_llama, tmp_path / "adapter", seed=1)
    with tempfile.TemporaryDirectory(prefix="vllm-lite-test-") as directory:
        engine = start_standalone(tiny_llama, directory, ("--enable-lora", "--max-lora-rank", "8"))
        try:
            llm = LLM(engine_address=engine.address)
            try:
                prompts = prompts_token_ids[:2]
                outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                       lora_request=LoRARequest("a", 1, str(adapter)), use_tqdm=False)
                assert [o.outputs[0].token_ids for o in outputs] == peft_greedy(tiny_llama, adapter, prompts, 6)
            finally:
                llm.shutdown()
        finally:
            stop_standalone(engine.proc)
