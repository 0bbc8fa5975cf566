"""The schedules every image model's greedy parity test runs under and the check itself (the
engine's prompt ids and greedy tokens equal the reference's, transformers' on its processor's
inputs, whole, chunked, preempted, on the torch backend and at TP=2); the prompts and references
of a suite's texts and images."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from llm_factory import make_llm
from vllm_lite import SamplingParams


def image_schedules(chunk: int = 8, kv_blocks: int = 6) -> list[dict[str, Any]]:
    """Engine arguments: as they come; prompts in chunks of `chunk` tokens (an image split across
    steps); a cache of `kv_blocks` blocks of 8 that preempts and resumes requests; the torch
    attention backend; two tensor-parallel ranks in their own processes."""
    return [{}, {"max_num_batched_tokens": chunk, "enable_chunked_prefill": True},
            {"block_size": 8, "num_kv_blocks": kv_blocks, "enable_prefix_caching": False},
            {"attention_backend": "torch"}, {"multiprocess": True, "tensor_parallel_size": 2}]


def assert_greedy_parity(model: Path, prompts: list[dict], prompt_ids: list[list[int]], tokens: list[list[int]],
                         engine_args: dict[str, Any], sampling: SamplingParams) -> None:
    llm = make_llm(model, **engine_args)
    try:
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        assert [list(out.prompt_token_ids) for out in outputs] == prompt_ids
        assert [list(out.outputs[0].token_ids) for out in outputs] == tokens
        if "num_kv_blocks" in engine_args:
            assert llm.stats()["num_preemptions"] > 0
    finally:
        llm.shutdown()


def assert_prefix_cache_hit_inside_an_image(model: Path, prompts: list[dict], tokens: list[list[int]],
                                            sampling: SamplingParams) -> None:
    """Blocks of 4 tokens: run again, the first prompt's cached prefix ends inside its image's
    placeholders (the image attends to itself both ways: the rest of it must still see all of it)."""
    llm = make_llm(model, block_size=4, enable_prefix_caching=True)
    try:
        first = llm.generate(prompts[:1], sampling, use_tqdm=False)
        again = llm.generate(prompts, sampling, use_tqdm=False)
        assert again[0].num_cached_tokens > 0
        assert list(first[0].outputs[0].token_ids) == tokens[0]
        assert [list(out.outputs[0].token_ids) for out in again] == tokens
    finally:
        llm.shutdown()


def text_prompts(texts: list[str], images_per_text: list[list[int]], images: list[Any]) -> list[dict]:
    """vLLM's prompt dicts: each text with its images (indices into `images`)."""
    return [{"prompt": text, "multi_modal_data": {"image": [images[i] for i in which]}}
            for text, which in zip(texts, images_per_text)]


def references(model: Path, texts: list[str], images_per_text: list[list[int]], images: list[Any],
               processor_inputs: Callable[[Path, str, list[Any]], dict],
               hf_tokens: Callable[[Path, dict], list[int]]) -> list[tuple[list[int], list[int]]]:
    """(the processor's prompt ids, transformers' greedy tokens) per text and its images."""
    out = []
    for text, which in zip(texts, images_per_text):
        inputs = processor_inputs(model, text, [images[i] for i in which])
        out.append((inputs["input_ids"][0].tolist(), hf_tokens(model, inputs)))
    return out
