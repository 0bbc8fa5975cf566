"""kv_cache_dtype (vLLM's name): a bf16 KV cache under a float32 model on CPU, the
int8_per_token_head cache under any model dtype on CPU, and vLLM's fp8 caches (torch backend). The configuration each resolves to, what
is refused, the cache the engine allocates, and the command-line flag. Their accuracy against the
float32 cache is in tests/test_reduced_precision.py, the int8 format and ops in
tests/attention/test_kv_quant.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.attention.torch_backend import to_cache_rows
from vllm_lite.config import EngineArgs, kv_cache_row
from vllm_lite.entrypoints.cli_args import add_engine_args, engine_args_from

BUDGET = 4 << 20  # bytes of KV cache: few enough blocks that the budget, not max_num_seqs, decides


def config(model: Path, **args):
    return EngineArgs(model=str(model), device="cpu", kv_cache_memory_bytes=BUDGET, max_model_len=256,
                      **args).create_engine_config()


def test_bfloat16_cache_halves_block_bytes_and_doubles_blocks(tiny_llama: Path) -> None:
    fp32 = config(tiny_llama, dtype="float32")
    bf16 = config(tiny_llama, dtype="float32", kv_cache_dtype="bfloat16")
    assert fp32.kv_cache_dtype == "float32" and bf16.kv_cache_dtype == "bfloat16"
    assert bf16.model_config.dtype == "float32" and bf16.cache_config.cache_dtype == "bfloat16"
    assert bf16.kv_block_bytes() * 2 == fp32.kv_block_bytes()
    assert bf16.num_kv_blocks() == 2 * fp32.num_kv_blocks()


def test_auto_follows_the_model_dtype(tiny_llama: Path) -> None:
    assert config(tiny_llama, dtype="bfloat16").kv_cache_dtype == "bfloat16"
    assert config(tiny_llama, dtype="bfloat16", kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"


def test_int8_cache_rows_hold_codes_and_a_scale(tiny_llama: Path) -> None:
    fp32 = config(tiny_llama, dtype="float32")
    int8 = config(tiny_llama, dtype="float32", kv_cache_dtype="int8_per_token_head")
    head_dim = fp32.model_config.hf.head_dim
    assert int8.kv_cache_dtype == "int8_per_token_head"
    assert int8.kv_block_bytes() * 4 * head_dim == fp32.kv_block_bytes() * (head_dim + 4)
    assert int8.num_kv_blocks() > 3 * fp32.num_kv_blocks()
    # any model dtype on CPU
    assert config(tiny_llama, dtype="bfloat16", kv_cache_dtype="int8_per_token_head").model_config.dtype == "bfloat16"


@pytest.mark.parametrize(("value", "storage"), [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                                ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_caches_take_a_byte_an_element_on_a_cpu_backend(tiny_llama: Path, value: str,
                                                            storage: torch.dtype) -> None:
    """vLLM's fp8 KV caches ("fp8" is e4m3): one byte an element under any model dtype, on CPU
    with the cpu_native or torch attention backend (Triton and CUDA are refused)."""
    fp32 = config(tiny_llama, dtype="float32")
    for dtype in ("float32", "bfloat16"):
        fp8 = config(tiny_llama, dtype=dtype, kv_cache_dtype=value)
        assert fp8.kv_block_bytes() * 4 == fp32.kv_block_bytes()
    assert kv_cache_row(fp8.kv_cache_dtype, 64) == (str(storage).removeprefix("torch."), 64)
    # Stored at scale 1.0, saturating: a value past the format's range is its largest, never inf or NaN.
    cache = torch.zeros(1, dtype=storage)
    largest = torch.finfo(storage).max
    assert to_cache_rows(torch.tensor([1e6, -1e6, 1.0, float("inf")]), cache).float().tolist() == \
        [largest, -largest, 1.0, largest]
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{value}' runs only on CPU, with the cpu_native or torch"):
        config(tiny_llama, dtype="float32", kv_cache_dtype=value, attention_backend="triton")
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{value}' runs only on CPU"):
        EngineArgs(model=str(tiny_llama), device="cuda", kv_cache_dtype=value).create_engine_config()


def test_int8_cache_needs_a_cpu_backend(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='int8_per_token_head' runs only on CPU"):
        config(tiny_llama, dtype="float32", kv_cache_dtype="int8_per_token_head", attention_backend="triton")


@pytest.mark.parametrize("value", ["fp8_e4m3fn", "fp8_inc", "float16", "int8", "int4_per_token_head", ""])
def test_unimplemented_cache_dtypes_are_refused_by_name(tiny_llama: Path, value: str) -> None:
    with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of .*got '{value}'"):
        config(tiny_llama, dtype="float32", kv_cache_dtype=value)


@pytest.mark.parametrize("args", [{"dtype": "float16"}, {"dtype": "float32", "attention_backend": "triton"}])
def test_bf16_cache_needs_a_float32_model_and_a_cpu_backend(tiny_llama: Path, args: dict) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' differs from dtype"):
        config(tiny_llama, kv_cache_dtype="bfloat16", **args)


@pytest.mark.parametrize("args,cache_dtype,extra", [
    ({"kv_cache_dtype": "bfloat16"}, torch.bfloat16, 0),
    ({"kv_cache_dtype": "int8_per_token_head"}, torch.int8, 4),
    ({"kv_cache_dtype": "int8_per_token_head", "attention_backend": "torch"}, torch.int8, 4),
    ({"kv_cache_dtype": "int8_per_token_head", "dtype": "bfloat16"}, torch.int8, 4),
    ({"kv_cache_dtype": "fp8"}, torch.float8_e4m3fn, 0),
    ({"kv_cache_dtype": "fp8", "attention_backend": "torch"}, torch.float8_e4m3fn, 0),
    ({"kv_cache_dtype": "fp8_e5m2", "dtype": "bfloat16"}, torch.float8_e5m2, 0),
], ids=["bf16", "int8", "int8-torch", "int8-bf16-model", "fp8", "fp8-torch", "fp8_e5m2-bf16-model"])
def test_engine_stores_the_cache_dtype_and_serves_a_mixed_batch(tiny_llama: Path, args: dict,
                                                                cache_dtype: torch.dtype, extra: int) -> None:
    llm = make_llm(tiny_llama, max_num_batched_tokens=64, **args)
    try:
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        head_dim = runner.config.model_config.hf.head_dim
        assert {(cache.dtype, cache.shape[-1]) for cache in runner.kv_caches} == {(cache_dtype, head_dim + extra)}
        # prompts longer than one step's budget: prefill chunks beside decodes in the same steps
        prompts = [{"prompt_token_ids": list(range(3 + i, 50 + 9 * i))} for i in range(6)]
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                               use_tqdm=False)
        assert [len(out.outputs[0].token_ids) for out in outputs] == [8] * 6
    finally:
        llm.shutdown()


def test_command_line_flag() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args(["--kv-cache-dtype", "bfloat16"])).kv_cache_dtype == "bfloat16"
    assert engine_args_from(parser.parse_args(["--kv-cache-dtype", "int8_per_token_head"])).kv_cache_dtype \
        == "int8_per_token_head"
    assert engine_args_from(parser.parse_args([])).kv_cache_dtype == "auto"


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_mistral_window", "tiny_gemma2"])
def test_int8_cache_backends_agree(name: str, request: pytest.FixtureRequest,
                                   prompts_token_ids: list[list[int]]) -> None:
    """The cpu_native backend (csrc decode; a sliding window or a soft cap sends its layers to the
    torch path) and the torch backend attend over the same int8 cache with the same query
    rounding: the same greedy tokens, to fp32 rounding."""
    cpu_native, torch_path = greedy_per_backend(request.getfixturevalue(name), prompts_token_ids,
                                                "int8_per_token_head")
    assert sum(a == b for a, b in zip(cpu_native, torch_path)) >= len(prompts_token_ids) - 1, (cpu_native, torch_path)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_backends_agree(tiny_llama: Path, prompts_token_ids: list[list[int]], kv_cache_dtype: str) -> None:
    """The cpu_native backend (csrc decode over the float8 bytes) and the torch backend (the
    gathered rows widened) attend over the same fp8 cache in fp32: the same greedy tokens, but
    where summation order tips a near tie."""
    cpu_native, torch_path = greedy_per_backend(tiny_llama, prompts_token_ids, kv_cache_dtype)
    assert sum(a == b for a, b in zip(cpu_native, torch_path)) >= len(prompts_token_ids) - 2, (cpu_native, torch_path)


def greedy_per_backend(model: Path, prompts: list[list[int]], kv_cache_dtype: str) -> list[list[list[int]]]:
    """The greedy tokens of each prompt with the cpu_native, then the torch attention backend."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    for backend in ("cpu_native", "torch"):
        llm = make_llm(model, kv_cache_dtype=kv_cache_dtype, attention_backend=backend)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tokens.append([list(out.outputs[0].token_ids) for out in outputs])
        finally:
            llm.shutdown()
    return tokens
