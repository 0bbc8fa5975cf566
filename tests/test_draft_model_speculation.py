"""vLLM's draft-model speculative decoding (speculative_config={"model": DRAFT, ...}, method
"draft_model"): a smaller model of the same vocabulary drafts each request's next k tokens
greedily, and the model keeps them while its own samples equal them.

The model is the n-gram tests' cycling Llama (blocks scaled down: it mostly walks 7-token
cycles and leaves them now and then); the draft is the same model with its blocks off (a pure
bigram walking the same cycles): its drafts are mostly right and sometimes wrong. Greedy tokens
must be the very tokens of decoding without drafts (and transformers'), under chunked prompts,
preemption, tensor parallelism and a spawned engine; a draft that is the model itself has every
draft kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_reference import build_cycling_model, build_tiny_model, hf_greedy
from llm_factory import make_llm
from vllm_lite import EngineArgs, SamplingParams
from vllm_lite.sampling_params import StructuredOutputsParams

PROMPTS = [{"prompt_token_ids": list(range(10 + 7 * i, 30 + 7 * i))} for i in range(6)]
NUM_TOKENS = 60
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def cycling_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cycling_model(tmp_path_factory.mktemp("cycling"), 0.05)


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cycling_model(tmp_path_factory.mktemp("cycling_draft"), 0.0)


@pytest.fixture(scope="module")
def greedy_reference(cycling_model: Path) -> list[list[int]]:
    return hf_greedy(cycling_model, [p["prompt_token_ids"] for p in PROMPTS], NUM_TOKENS)


def spec(draft: Path, k: int = 4, **more: object) -> dict:
    return {"speculative_config": {"model": str(draft), "num_speculative_tokens": k, **more}}


def token_ids(llm, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def spec_counts(llm) -> tuple[float, float]:
    metrics = {metric.name: metric for metric in llm.get_metrics()}
    return (metrics["vllm:spec_decode_num_accepted_tokens"].value,
            metrics["vllm:spec_decode_num_draft_tokens"].value)


def test_greedy_tokens_equal_transformers_and_drafts_are_kept(cycling_model: Path, draft_model: Path,
                                                               greedy_reference: list[list[int]]) -> None:
    llm = make_llm(cycling_model, disable_log_stats=False, **spec(draft_model))
    try:
        assert token_ids(llm) == greedy_reference
        accepted, drafted = spec_counts(llm)
        assert 0 < accepted < drafted  # (kept, and not always)
    finally:
        llm.shutdown()
    itself = make_llm(cycling_model, disable_log_stats=False, **spec(cycling_model, k=3))
    try:
        assert token_ids(itself) == greedy_reference
        accepted, drafted = spec_counts(itself)
        assert accepted == drafted > 0  # (the model drafting for itself: every draft kept)
    finally:
        itself.shutdown()


@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 9},  # drafts cut short by the budget, prompts chunked beside drafting requests
    {"block_size": 16, "num_kv_blocks": 16, "enable_prefix_caching": False},  # preempted and resumed
    {"block_size": 16},  # a second run's prompts hit the prefix cache (the draft catches up on them)
    {"attention_backend": "torch"},
    {"multiprocess": True, "tensor_parallel_size": 2},
])
def test_greedy_tokens_under_every_schedule(cycling_model: Path, draft_model: Path,
                                            greedy_reference: list[list[int]], engine_args: dict) -> None:
    llm = make_llm(cycling_model, **spec(draft_model), **engine_args)
    try:
        assert token_ids(llm) == greedy_reference
        if "num_kv_blocks" in engine_args:
            assert llm.stats()["num_preemptions"] > 0
        assert token_ids(llm) == greedy_reference  # (again: prefix-cache hits where cached)
    finally:
        llm.shutdown()


def test_seeded_sampling_repeats_and_grammars_decode_without_drafts(cycling_model: Path, draft_model: Path) -> None:
    params = [SamplingParams(temperature=0.8, top_k=50, max_tokens=40, ignore_eos=True, seed=i)
              for i in range(len(PROMPTS))]
    llm = make_llm(cycling_model, **spec(draft_model))
    try:
        first = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        again = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[::-1], params[::-1], use_tqdm=False)]
        assert again == first[::-1]
        choice = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(
            choice=["alpha", "beta"]))
        constrained = llm.generate("pick one:", choice, use_tqdm=False)[0].outputs[0].text
        plain = make_llm(cycling_model)
        try:
            assert constrained == plain.generate("pick one:", choice, use_tqdm=False)[0].outputs[0].text
        finally:
            plain.shutdown()
    finally:
        llm.shutdown()


def test_what_a_draft_model_cannot_be_is_refused(tiny_llama: Path, draft_model: Path, tmp_path: Path) -> None:
    other_vocab = build_tiny_model(tmp_path / "other_vocab", "llama", tie_word_embeddings=False,
                                   extra_config={"vocab_size": 1200})
    cases = [
        (spec(other_vocab), "vocab_size=1200 is not the model's"),
        (spec(draft_model, prompt_lookup_max=3), "are the n-gram method's"),
        (spec(draft_model, draft_tensor_parallel_size=2), "draft_tensor_parallel_size=2"),
        (spec(draft_model, quantization="fp8"), "quantization for a draft model are not implemented"),
        ({"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2}}, "needs the draft's `model`"),
        ({"speculative_config": {"method": "ngram", "model": str(draft_model), "num_speculative_tokens": 2}},
         "prompt lookup has no model"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message.replace("`", ".")):
            EngineArgs(model=str(tiny_llama), **arguments).create_engine_config()
