"""vLLM's gpu_memory_utilization: the KV cache takes what is left of that share of the device's
memory once the weights and a full step's activations are in. On CPU (as vLLM's CPU backend) the
share is of the host's memory, less the rank's resident set; on CUDA (vLLM's default 0.92) a
profile step measures the peak (checked on a GPU by tools/gpu_check.sh). Also vLLM CPU's
VLLM_CPU_KVCACHE_SPACE, and the client's copy of the size the engine core settled on."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch

from hf_reference import build_prompts, hf_greedy
from llm_factory import make_llm
from vllm_lite import LLM, SamplingParams
from vllm_lite.config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineArgs
from vllm_lite.entrypoints.cli_args import add_engine_args, engine_args_from
from vllm_lite.worker import worker as worker_module
from vllm_lite.worker.memory import GIB, DeviceMemory, host_memory, kv_cache_budget, resident_bytes
from vllm_lite.worker.model_runner import ModelRunner

MAX_LEN, MAX_SEQS = 256, 4


def config(model: Path, **args):
    return EngineArgs(model=str(model), max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS, **args).create_engine_config()


def useful_blocks(vllm_config) -> int:
    """The cap: max_num_seqs full-length requests plus the reserved block."""
    return MAX_SEQS * math.ceil(MAX_LEN / vllm_config.cache_config.block_size) + 1


# ---- configuration ----

def test_cuda_defaults_to_vllms_share_and_cpu_to_a_fixed_size(tiny_llama: Path) -> None:
    assert config(tiny_llama, device="cuda").cache_config.gpu_memory_utilization == DEFAULT_GPU_MEMORY_UTILIZATION
    assert config(tiny_llama, device="cuda", kv_cache_memory_bytes=1 << 20).cache_config.gpu_memory_utilization is None
    assert config(tiny_llama, device="cuda", num_kv_blocks=8).cache_config.gpu_memory_utilization is None
    assert config(tiny_llama, device="cpu").cache_config.gpu_memory_utilization is None
    assert config(tiny_llama, device="cpu", gpu_memory_utilization=0.5).cache_config.gpu_memory_utilization == 0.5


@pytest.mark.parametrize("value", [0, -0.1, 1.01, float("nan"), True])
def test_out_of_range_shares_are_refused(tiny_llama: Path, value: float) -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        config(tiny_llama, device="cpu", gpu_memory_utilization=value)


@pytest.mark.parametrize("fixed", [{"kv_cache_memory_bytes": 1 << 30}, {"num_kv_blocks": 16}])
def test_a_share_and_a_fixed_size_together_are_refused(tiny_llama: Path, fixed: dict) -> None:
    """vLLM lets kv_cache_memory_bytes win without a word; here the user learns which counts."""
    name = next(iter(fixed))
    with pytest.raises(ValueError, match=f"gpu_memory_utilization=0.5 and {name}=.* both size the KV cache"):
        config(tiny_llama, device="cpu", gpu_memory_utilization=0.5, **fixed)


def test_num_kv_blocks_needs_the_measured_budget_under_a_share(tiny_llama: Path) -> None:
    vllm_config = config(tiny_llama, device="cpu", gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="measured by the workers"):
        vllm_config.num_kv_blocks()
    block = vllm_config.kv_block_bytes()
    assert vllm_config.num_kv_blocks(5 * block + 1) == 5
    assert vllm_config.num_kv_blocks(1 << 40) == useful_blocks(vllm_config)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.5 leaves 100 bytes for the KV cache, which "
                                         r"holds 0 KV block\(s\)"):
        vllm_config.num_kv_blocks(100)


def test_vllm_cpu_kvcache_space_sizes_the_cpu_cache(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert config(tiny_llama, device="cpu").cache_config.kv_cache_memory_bytes == GIB
    assert config(tiny_llama, device="cpu", kv_cache_memory_bytes=4096).cache_config.kv_cache_memory_bytes == 4096
    assert config(tiny_llama, device="cuda").cache_config.kv_cache_memory_bytes is None  # a CPU setting
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.5 and VLLM_CPU_KVCACHE_SPACE=1 both size"):
        config(tiny_llama, device="cpu", gpu_memory_utilization=0.5)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")  # vLLM: unset
    assert config(tiny_llama, device="cpu").cache_config.kv_cache_memory_bytes is None
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2.5")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE must be a whole number of GiB, got '2.5'"):
        config(tiny_llama, device="cpu")


def test_the_flag_takes_a_fraction(tiny_llama: Path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--model", str(tiny_llama), "--gpu-memory-utilization", "0.85"]))
    assert args.gpu_memory_utilization == 0.85


# ---- the budget ----

def test_budget_is_the_share_less_what_the_rank_uses() -> None:
    start = DeviceMemory(free=70 * GIB, total=80 * GIB)
    assert kv_cache_budget(0.5, start, used=10 * GIB, now_free=60 * GIB) == 30 * GIB
    assert kv_cache_budget(0.5, start, used=GIB, now_free=60 * GIB, sharers=2, device="cpu") == 19 * GIB


def test_budget_refusals_name_the_share_and_the_numbers() -> None:
    start = DeviceMemory(free=40 * GIB, total=80 * GIB)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9 asks for 72.00 GiB of the GPU's 80.00 GiB, "
                                         r"but only 40.00 GiB were free when the engine started"):
        kv_cache_budget(0.9, start, used=GIB, now_free=39 * GIB)
    with pytest.raises(ValueError, match=r"gives this engine 8.00 GiB .* already take 9.00 GiB, leaving nothing"):
        kv_cache_budget(0.1, start, used=9 * GIB, now_free=30 * GIB)


def test_budget_takes_no_more_than_is_free_now(caplog: pytest.LogCaptureFixture) -> None:
    """The engine caps its cache at what max_num_seqs requests can use: a share beyond what is free
    fails the start only if even that is too little (num_kv_blocks says so)."""
    assert kv_cache_budget(0.4, DeviceMemory(free=80 * GIB, total=80 * GIB), used=16 * GIB, now_free=2 * GIB,
                           device="cpu") == 2 * GIB
    assert "leaves 16.00 GiB for the KV cache, but only 2.00 GiB are free" in caplog.text


def test_host_memory_and_resident_set_are_read() -> None:
    memory = host_memory()
    assert 0 < memory.free <= memory.total
    assert 0 < resident_bytes() < memory.total


# ---- the engine ----

def test_cpu_engine_sizes_its_cache_from_the_share(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker runs in this process: its view of the host is the one given here, so the
    budget (share less resident set) and the blocks it buys are exact; tokens stay transformers'."""
    total, resident = 64 * GIB, 10 * GIB
    monkeypatch.setattr(worker_module, "device_memory", lambda device: DeviceMemory(total, total))
    monkeypatch.setattr(worker_module, "host_memory", lambda: DeviceMemory(total, total))
    monkeypatch.setattr(worker_module, "resident_bytes", lambda: resident)
    block = config(tiny_llama, device="cpu", dtype="float32").kv_block_bytes()
    utilization = (resident + 7 * block + block // 2) / total
    llm = make_llm(tiny_llama, device="cpu", max_num_seqs=MAX_SEQS, gpu_memory_utilization=utilization)
    try:
        assert llm.llm_engine.engine_core.num_kv_blocks == 7
        assert llm.llm_engine.vllm_config.num_kv_blocks() == 7
        prompts = build_prompts(tiny_llama)[:2]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(tiny_llama, prompts, 8)
    finally:
        llm.shutdown()


def test_spawned_engine_core_reports_its_measured_size(tiny_llama: Path) -> None:
    """The whole host's memory: the cap (max_num_seqs full-length requests) decides, and the
    client's config learns the count from the engine core's start-up report."""
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS,
              gpu_memory_utilization=1.0, multiprocess=True)
    try:
        expected = useful_blocks(llm.llm_engine.vllm_config)
        assert llm.llm_engine.engine_core.num_kv_blocks == expected
        assert llm.llm_engine.vllm_config.num_kv_blocks() == expected
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_a_share_smaller_than_the_process_fails_the_start_by_name(tiny_llama: Path, tensor_parallel_size: int) -> None:
    """One hundred-thousandth of the host is less than any engine process's resident set."""
    with pytest.raises(Exception, match="gpu_memory_utilization=1e-05 gives this engine .* leaving nothing"):
        LLM(str(tiny_llama), device="cpu", dtype="float32", max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS,
            gpu_memory_utilization=1e-5, tensor_parallel_size=tensor_parallel_size, multiprocess=True)


def test_tensor_parallel_ranks_agree_on_the_measured_size(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS,
              gpu_memory_utilization=1.0, tensor_parallel_size=2, multiprocess=True)
    try:
        prompts = build_prompts(tiny_llama)[:2]
        assert llm.llm_engine.vllm_config.num_kv_blocks() == useful_blocks(llm.llm_engine.vllm_config)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(tiny_llama, prompts, 8)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", ["torch", "cpu_native"])
def test_profile_step_runs_the_largest_step_without_a_kv_cache(tiny_llama: Path, backend: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """What CUDA measures its peak with: max_num_batched_tokens (300: sequences of 128, 128 and 44
    under max_model_len 128) through the model, writing a scratch cache of one sequence's blocks
    (whose bytes it returns: the peak less them is what the KV cache leaves room for)."""
    vllm_config = EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=128, max_num_batched_tokens=300,
                             attention_backend=backend, device="cpu").create_engine_config()
    runner = ModelRunner(vllm_config, torch.device("cpu"))
    built = record_metadata(runner, monkeypatch)
    scratch: list[torch.Tensor] = []
    make_scratch = runner._new_kv_caches
    monkeypatch.setattr(runner, "_new_kv_caches", lambda blocks: scratch.extend(make_scratch(blocks)) or scratch)
    seen_tokens = []
    forward = runner.model.forward
    monkeypatch.setattr(runner.model, "forward",
                        lambda ids, *args: seen_tokens.append(len(ids)) or forward(ids, *args))
    scratch_bytes = runner.profile_run()
    assert seen_tokens == [300]
    assert built[0].block_table.tolist() == [[1]] * 3 and built[0].block_table.stride() == (1, 1)
    assert built[0].slot_mapping.tolist() == [*range(128, 256), *range(128, 256), *range(128, 172)]
    assert len(scratch) == vllm_config.model_config.hf.num_hidden_layers
    assert all(layer.shape[0] == 2 and layer.any() for layer in scratch)  # 128 tokens: block 1 (0 reserved)
    assert scratch_bytes == 2 * vllm_config.kv_block_bytes()
    assert runner.kv_caches == []


def record_metadata(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> list:
    built = []
    build = runner.attn_backend.build
    monkeypatch.setattr(runner.attn_backend, "build", lambda common: built.append(common) or build(common))
    return built


def test_profile_step_of_one_block_has_a_real_block_table(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of at most a block's tokens (max_num_batched_tokens=16, one sequence): the block table
    is an array of its own, not a broadcast view (the Triton kernels need a unit last stride)."""
    vllm_config = EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=256, max_num_batched_tokens=16,
                             block_size=16, device="cpu").create_engine_config()
    runner = ModelRunner(vllm_config, torch.device("cpu"))
    built = record_metadata(runner, monkeypatch)
    runner.profile_run()
    assert built[0].block_table.tolist() == [[1]] and built[0].block_table.stride(-1) == 1


def test_vllms_other_names_fold_into_ours(tiny_llama: Path) -> None:
    """num_gpu_blocks_override is vLLM's num_kv_blocks; device_memory_utilization its device-neutral
    gpu_memory_utilization. The same value under both names is one setting; two values are refused."""
    assert config(tiny_llama, device="cpu", num_gpu_blocks_override=9).num_kv_blocks() == 9
    assert config(tiny_llama, device="cpu", num_gpu_blocks_override=9, num_kv_blocks=9).num_kv_blocks() == 9
    assert config(tiny_llama, device="cpu", device_memory_utilization=0.4).cache_config.gpu_memory_utilization == 0.4
    with pytest.raises(ValueError, match="num_gpu_blocks_override=9 and num_kv_blocks=8 are one setting"):
        config(tiny_llama, device="cpu", num_gpu_blocks_override=9, num_kv_blocks=8)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        config(tiny_llama, device="cpu", device_memory_utilization=2.0)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    blocks = engine_args_from(parser.parse_args(["--model", str(tiny_llama), "--num-gpu-blocks-override", "12"]))
    assert blocks.create_engine_config().num_kv_blocks() == 12
    share = engine_args_from(parser.parse_args(["--model", str(tiny_llama), "--device-memory-utilization", "0.3"]))
    assert share.create_engine_config().cache_config.gpu_memory_utilization == 0.3
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.3 and num_kv_blocks=12 both size"):
        EngineArgs(model=str(tiny_llama), device="cpu", num_gpu_blocks_override=12,
                   device_memory_utilization=0.3).create_engine_config()
