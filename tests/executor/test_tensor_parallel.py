"""Tensor parallelism on CPU (gloo): one worker process per rank, the multiproc executor.

Every engine here is shut down by a finalizer, and each test checks that no rank outlives it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from hf_reference import build_cycling_model, hf_greedy
from llm_factory import make_llm
from vllm_lite import LLM, SamplingParams
from vllm_lite.exceptions import EngineDeadError, RequestRejectedError
from vllm_lite.executor.multiproc import MultiprocExecutor
from vllm_lite.wire import EngineCoreRequest

NEW_TOKENS = 24
MAX_MODEL_LEN = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
REPO_ROOT = Path(__file__).resolve().parents[2]


def rank_processes() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("vllm_lite-rank")]


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture
def tp_llm() -> Iterator[Callable[..., LLM]]:
    """Builds in-process-core LLMs with tensor_parallel_size=2; shuts all of them down after the
    test and checks that their rank processes are gone."""
    llms: list[LLM] = []
    pids: list[int] = []
    ipc_dirs: list[Path] = []

    def build(model: Path, **engine_args) -> LLM:
        before = {p.pid for p in rank_processes()}
        llm = make_llm(model, tensor_parallel_size=2, max_model_len=MAX_MODEL_LEN, **engine_args)
        llms.append(llm)
        pids.extend(p.pid for p in rank_processes() if p.pid not in before)
        ipc_dirs.append(Path(executor_of(llm)._tmp_dir))
        return llm

    yield build
    for llm in llms:
        llm.shutdown()
    assert_gone(pids)
    assert not [d for d in ipc_dirs if d.exists()]


@pytest.fixture(params=[False, True], ids=["finish-first", "launch-ahead"])
def ranks_launch_ahead(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The order the ranks of the engines built afterwards run their steps in: finishing each
    step first (a CPU's default) or launching step N+1 before finishing step N (a GPU's)."""
    monkeypatch.setattr(MultiprocExecutor, "launches_ahead", staticmethod(lambda device_type: request.param))
    return request.param


def executor_of(llm: LLM):
    return llm.llm_engine.engine_core.executor  # the in-process engine core's


def run_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


def shared_prefix_prompts(prompts: list[list[int]]) -> list[list[int]]:
    shared = prompts[-1][:48]  # three full blocks of 16: prefix-cache hits from the second one on
    return [shared + p[:10] for p in prompts[:4]]


# ---- 1. parity: TP=2 == TP=1 == transformers ----

@pytest.mark.parametrize("name", ["tiny_llama", "tiny_llama_tied", "tiny_qwen2", "tiny_qwen3"])
def test_tp2_greedy_matches_tp1_and_transformers(name: str, tiny_models: dict[str, Path],
                                                 prompts_token_ids: list[list[int]],
                                                 tp_llm: Callable[..., LLM]) -> None:
    """Chunked prefill (16-token budget splits every prompt over 20 tokens) and prefix caching
    (shared 48-token prefix) on; tiny_llama_tied has 1 KV head, replicated over the 2 ranks."""
    model = tiny_models[name]
    prompts = prompts_token_ids + shared_prefix_prompts(prompts_token_ids)
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    tp1 = make_llm(model, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16, block_size=16)
    try:
        assert run_greedy(tp1, prompts) == expected
    finally:
        tp1.shutdown()
    tp2 = tp_llm(model, max_num_batched_tokens=16, enable_prefix_caching=True, enable_chunked_prefill=True,
                 block_size=16)
    assert run_greedy(tp2, prompts) == expected
    stats = tp2.stats()
    assert stats["prefix_cache_hits"] >= 48 * 3, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats


def test_tp2_async_scheduling_equals_sync_under_preemption(tiny_qwen3: Path, prompts_token_ids: list[list[int]],
                                                           tp_llm: Callable[..., LLM],
                                                           ranks_launch_ahead: bool) -> None:
    """The ranks queue step N+1 behind step N (launching ahead: launch it before finishing step
    N); requests preempted (and finished) with a token in flight: the same tokens as with async
    scheduling off."""
    prompts = prompts_token_ids * 2
    outputs = {}
    for async_scheduling in (True, False):
        llm = tp_llm(tiny_qwen3, num_kv_blocks=14, block_size=16, async_scheduling=async_scheduling)
        outputs[async_scheduling] = run_greedy(llm, prompts)
        assert llm.stats()["num_preemptions"] > 0
    assert outputs[True] == outputs[False]


def test_ranks_launching_ahead_answer_a_step_after_the_next_or_a_flush(
        tiny_llama: Path, prompts_token_ids: list[list[int]], tp_llm: Callable[..., LLM],
        ranks_launch_ahead: bool) -> None:
    """Launching ahead, every rank holds the step it launched last: no reply comes until the next
    step is submitted; a take with none submitted after it sends a Flush (once, at the end, with
    async scheduling; after every step without). Finishing first, replies come unasked and no
    Flush is sent. The tokens are transformers' either way."""
    expected = hf_greedy(tiny_llama, prompts_token_ids[:2], 6)
    for async_scheduling in (True, False):
        llm = tp_llm(tiny_llama, async_scheduling=async_scheduling)
        core, executor = llm.llm_engine.engine_core, executor_of(llm)
        sent: list[str] = []
        broadcast = executor._broadcast
        executor._broadcast = lambda message: (sent.append(type(message).__name__), broadcast(message))[1]
        for i, prompt in enumerate(prompts_token_ids[:2]):
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            core.add_request(EngineCoreRequest(str(i), np.array(prompt, dtype=np.int32), params, (), time.time(), 6))
        if async_scheduling:
            assert core.step().req_ids == []  # step 1 submitted, not taken
            replied = executor._replies.poll(1000 if ranks_launch_ahead else 60_000)
            assert bool(replied) != ranks_launch_ahead
        tokens: dict[str, list[int]] = {"0": [], "1": []}
        while core.has_unfinished_requests():
            outputs = core.step()
            for req_id, token in zip(outputs.req_ids, outputs.new_token_ids.tolist()):
                tokens[req_id].append(token)
        assert [tokens["0"], tokens["1"]] == expected
        assert sent.count("StepDiff") == 6
        if not ranks_launch_ahead:
            assert "Flush" not in sent
        elif async_scheduling:
            assert sent == ["StepDiff"] * 6 + ["Flush"]
        else:
            assert sent == ["StepDiff", "Flush"] * 6


# ---- 2. two engines on one host ----

def test_two_tp2_engines_run_at_the_same_time(tiny_llama: Path, tiny_qwen2: Path,
                                              prompts_token_ids: list[list[int]],
                                              tp_llm: Callable[..., LLM]) -> None:
    prompts = prompts_token_ids[:4]
    llms = {tiny_llama: tp_llm(tiny_llama), tiny_qwen2: tp_llm(tiny_qwen2)}
    results: dict[Path, list[list[int]]] = {}
    errors: list[BaseException] = []

    def generate(model: Path) -> None:
        try:
            results[model] = run_greedy(llms[model], prompts)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=generate, args=(model,)) for model in llms]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    for model in llms:
        assert results[model] == hf_greedy(model, prompts, NEW_TOKENS)
    first, second = (executor_of(llm) for llm in llms.values())
    assert first._store.port != second._store.port and first._tmp_dir != second._tmp_dir


# ---- 3. a rank killed mid-generation ----

def test_sigkill_of_a_rank_fails_pending_requests_within_5s(tiny_llama: Path,
                                                           prompts_token_ids: list[list[int]],
                                                           tp_llm: Callable[..., LLM]) -> None:
    llm = tp_llm(tiny_llama, max_num_batched_tokens=16)  # ~350 steps of prefill alone: still busy at the kill
    run_greedy(llm, prompts_token_ids[:1])  # warm
    (victim,) = [p for p in rank_processes() if p.name == "vllm_lite-rank1"]
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(victim.pid, signal.SIGKILL)

    long_run = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - 91, ignore_eos=True)
    timer = threading.Timer(0.3, kill)
    timer.start()
    with pytest.raises(EngineDeadError, match="rank1"):
        llm.generate([{"prompt_token_ids": p} for p in prompts_token_ids * 16], long_run, use_tqdm=False)
    failed_at = time.monotonic()
    timer.join()
    assert killed_at and failed_at - killed_at[0] < 5.0
    with pytest.raises(EngineDeadError):  # and so does every later request
        run_greedy(llm, prompts_token_ids[:1])
    llm.shutdown()
    assert not rank_processes()


# ---- 4. two "nodes" on localhost ----

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "vllm_lite.entrypoints.cli", *args]


def test_two_node_launch_matches_single_node(tiny_qwen3: Path, tmp_path: Path,
                                             tp_llm: Callable[..., LLM]) -> None:
    prompts = ["The quick brown fox", "Once upon a time in a village"]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    single = tp_llm(tiny_qwen3).generate(prompts, params, use_tqdm=False)
    expected = [f"{out.prompt!r} -> {out.outputs[0].text!r}" for out in single]

    port = str(free_port())
    common = ["--model", str(tiny_qwen3), "--tensor-parallel-size", "2", "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", port, "--max-model-len", str(MAX_MODEL_LEN),
              "--dtype", "float32"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    log0, log1 = tmp_path / "node0.log", tmp_path / "node1.log"  # files: a full pipe would block
    with log0.open("w") as err0, log1.open("w") as err1:
        node1 = subprocess.Popen(cli("worker", *common, "--node-rank", "1"), env=env,
                                 stdout=err1, stderr=subprocess.STDOUT)
        node0 = subprocess.Popen(cli("generate", *prompts, *common, "--node-rank", "0", "--max-tokens", "16"),
                                 env=env, stdout=subprocess.PIPE, stderr=err0, text=True)
        try:
            out0, _ = node0.communicate(timeout=150)
            with contextlib.suppress(subprocess.TimeoutExpired):  # a rank left over fails below
                node1.wait(timeout=30)  # node 1 leaves when node 0's engine shuts down
        finally:
            for proc in (node0, node1):
                proc.kill()
                proc.wait()
    assert node0.returncode == 0, log0.read_text()[-5000:]
    assert node1.returncode == 0, log1.read_text()[-5000:]
    assert out0.splitlines() == expected


def test_a_rank_that_fails_to_start_fails_the_engine_start(tiny_llama: Path, tmp_path: Path) -> None:
    for item in tiny_llama.iterdir():  # everything but the weights: the ranks fail to load
        if not item.name.endswith(".safetensors"):
            shutil.copy(item, tmp_path / item.name)
    with pytest.raises(EngineDeadError, match="rank"):
        make_llm(tmp_path, tensor_parallel_size=2, max_model_len=MAX_MODEL_LEN)
    assert not rank_processes()


# ---- 5. a failure on one rank ----

def _run_beside_poison(llm: LLM, request_ids: list[str], prompts: list[list[int]]
                       ) -> tuple[dict[str, list[int]], list[RequestRejectedError]]:
    engine = llm.llm_engine
    for request_id, prompt in zip(request_ids, prompts):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, GREEDY)
    tokens: dict[str, list[int]] = {}
    errors: list[RequestRejectedError] = []
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except RequestRejectedError as exc:
            errors.append(exc)
            continue
        tokens.update({out.request_id: out.outputs[0].token_ids for out in outputs if out.finished})
    return tokens, errors


@pytest.fixture
def rank1_fault(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Arms a fault (rank_faults.FAULTS) on rank 1 of the engines built afterwards."""
    import rank_faults
    from vllm_lite.executor import worker_proc

    def arm(fault: str) -> None:
        monkeypatch.setenv(rank_faults.RANK_FAULT_ENV, f"1:{fault}")
        monkeypatch.setattr(worker_proc, "run_worker", rank_faults.run_worker_with_fault)

    return arm


@pytest.mark.parametrize("fault", ["join", "sampling"])
def test_a_request_failing_on_rank_1_only_fails_alone(fault: str, tiny_llama: Path,
                                                      prompts_token_ids: list[list[int]],
                                                      tp_llm: Callable[..., LLM],
                                                      rank1_fault: Callable[[str], None],
                                                      ranks_launch_ahead: bool) -> None:
    """Joining the batch (before the forward pass: the ranks agree to leave it out) or building
    its sampling metadata (after it: rank 1 reports it) fails on rank 1 alone; the request's
    client gets the error with the rank named, the others' tokens are those without it."""
    rank1_fault(fault)
    llm = tp_llm(tiny_llama)
    prompts = prompts_token_ids[:3]
    reference, errors = _run_beside_poison(llm, ["a", "b", "c"], prompts)
    assert not errors
    tokens, errors = _run_beside_poison(llm, ["a2", "poison", "c2"], prompts)
    assert [e.request_id for e in errors] == ["poison"]
    assert "rank 1" in str(errors[0]) and "RuntimeError: injected fault" in str(errors[0])
    assert tokens == {"a2": reference["a"], "c2": reference["c"]}
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_running"] == 0
    again, errors = _run_beside_poison(llm, ["a3", "b3", "c3"], prompts)
    assert not errors and again == {"a3": reference["a"], "b3": reference["b"], "c3": reference["c"]}


def test_a_failing_step_on_rank_1_is_reported_with_the_rank_and_the_error(
        tiny_llama: Path, prompts_token_ids: list[list[int]], tp_llm: Callable[..., LLM],
        rank1_fault: Callable[[str], None], ranks_launch_ahead: bool) -> None:
    """Not attributable to a request (rank 1's whole step raised): the engine dies, and the
    error every caller gets names the rank and what it raised, not only that a process exited."""
    rank1_fault("step")
    llm = tp_llm(tiny_llama)
    run_greedy(llm, prompts_token_ids[:1])
    with pytest.raises(EngineDeadError, match="rank 1: RuntimeError: injected fault"):
        _run_beside_poison(llm, ["a", "poison"], prompts_token_ids[:2])
    with pytest.raises(EngineDeadError, match="rank 1: RuntimeError: injected fault"):
        run_greedy(llm, prompts_token_ids[:1])


def test_a_batch_after_finished_requests_gives_the_tokens_of_the_first(
        tiny_llama: Path, prompts_token_ids: list[list[int]], tp_llm: Callable[..., LLM]) -> None:
    """The finished requests leave every rank's batch in that rank's own set order; the new
    ones must still take the same rows on every rank (they once did not: garbage tokens)."""
    llm = tp_llm(tiny_llama, enable_prefix_caching=False)
    prompts = prompts_token_ids[:3]
    first, _ = _run_beside_poison(llm, ["a", "b", "c"], prompts)
    second, _ = _run_beside_poison(llm, ["a2", "b2", "c2"], prompts)
    assert [second["a2"], second["b2"], second["c2"]] == [first["a"], first["b"], first["c"]]


def test_tp2_forces_the_end_of_a_spent_thinking_budget(tiny_thinking_qwen3: Path, tp_llm: Callable[..., LLM]) -> None:
    """The forced-token row reaches both ranks as a grammar row does (vLLM's thinking_token_budget)."""
    llm = tp_llm(tiny_thinking_qwen3, reasoning_parser="qwen3")
    start, end = llm.get_tokenizer().convert_tokens_to_ids(["<think>", "</think>"])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, thinking_token_budget=2)
    (output,) = llm.generate({"prompt_token_ids": [5, 17, 300, start]}, params, use_tqdm=False)
    assert output.outputs[0].token_ids[2] == end


# ---- speculative decoding over 2 ranks ----

def test_tp2_speculative_decoding_keeps_the_tokens_of_tp1(tmp_path: Path, tp_llm: Callable[..., LLM]) -> None:
    """n-gram drafts checked on both ranks (each samples every draft position from the gathered
    logits): the greedy tokens of decoding without drafts on one rank, drafts kept, and with
    logprobs asked for."""
    model = build_cycling_model(tmp_path / "cycling", 0.05)
    prompts = [list(range(10 + 7 * i, 30 + 7 * i)) for i in range(4)]
    tp1 = make_llm(model, max_model_len=MAX_MODEL_LEN)
    try:
        expected = run_greedy(tp1, prompts)
    finally:
        tp1.shutdown()
    tp2 = tp_llm(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                             "prompt_lookup_max": 3}, disable_log_stats=False)
    assert run_greedy(tp2, prompts) == expected
    accepted = {m.name: m for m in tp2.get_metrics()}["vllm:spec_decode_num_accepted_tokens"].value
    assert accepted > 0
    # the kept drafts' logprobs come back from rank 0 with the tokens (the worker reply's codec)
    with_logprobs = tp2.generate([{"prompt_token_ids": p} for p in prompts],
                                 SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1),
                                 use_tqdm=False)
    for output, tokens in zip(with_logprobs, expected):
        assert list(output.outputs[0].token_ids) == tokens
        assert [next(iter(lp)) for lp in output.outputs[0].logprobs] == tokens
