"""Reduced precision against float32 on the same weights: greedy agreement and teacher-forced
logprobs, for bf16, for int8 W8A8 (quantization="int8") over bf16 and over fp32 activations (the
int8 path of CPUs without native bf16), for a float32 model with a bf16 KV cache
(kv_cache_dtype="bfloat16"), for the int8_per_token_head KV cache under float32 and bf16
models, on both CPU attention backends, and for vLLM's fp8 KV caches (e4m3, e5m2).

bf16 cannot be token-for-token equal to fp32: each bf16 rounding moves a logit by ~0.4% of its
size, so wherever the top two logits of a step are closer than that the argmax may flip, and
after a flip the sequences continue from different tokens (they may never meet again). So the
greedy check is statistical: most prompts agree on their first tokens, and the first divergence
of each prompt is reported. The teacher-forced check feeds the fp32 sequence to both models and
bounds the mean |logprob difference| of the tokens fp32 chose; it does not compound, so its
bound is tight. The random tiny models here draw weights with a large spread (conftest), which
makes them more sensitive to rounding than trained models, not less.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_factory import make_llm
from vllm_lite import LLM, SamplingParams

NEW_TOKENS = 16
AGREE_PREFIX = 4  # first tokens compared for agreement
# Bounds per precision, with about 2x room over what these models measured (first-4 agreement
# bf16 15/16 prompts, int8 13/16; mean |dlogprob| bf16 0.025-0.028, int8 0.049-0.073; int8 KV cache
# 7-8/8 and 0.014-0.019 under float32, 0.025-0.033 under bf16; fp8 KV caches at scale 1.0, vLLM's
# without calibrated scales, round each element to 3 (e4m3) or 2 (e5m2) mantissa bits: e4m3 under
# float32 4-8/8 and 0.066-0.103, e5m2 under bf16 4-5/8 and 0.14-0.25).
# Engine arguments per precision (the reference: dtype="float32" on the same device). int8 weights
# and a KV cache in another dtype than the model's are CPU features (refused by name on CUDA), so
# those run on the CPU on every machine; bf16 runs on the default device (the GPU under gpu-check).
CPU = {"device": "cpu"}
PRECISIONS = {
    "bfloat16": {"dtype": "bfloat16"},
    "bfloat16+int8": {"dtype": "bfloat16", "quantization": "int8", **CPU},
    "float32+int8": {"dtype": "float32", "quantization": "int8", **CPU},
    "float32, bf16 KV cache": {"dtype": "float32", "kv_cache_dtype": "bfloat16", **CPU},
    "float32, bf16 KV cache, torch attention": {"dtype": "float32", "kv_cache_dtype": "bfloat16",
                                                "attention_backend": "torch", **CPU},
    "float32, int8 KV cache": {"dtype": "float32", "kv_cache_dtype": "int8_per_token_head", **CPU},
    "float32, int8 KV cache, torch attention": {"dtype": "float32", "kv_cache_dtype": "int8_per_token_head",
                                                "attention_backend": "torch", **CPU},
    "bfloat16, int8 KV cache": {"dtype": "bfloat16", "kv_cache_dtype": "int8_per_token_head", **CPU},
    "float32, fp8 KV cache": {"dtype": "float32", "kv_cache_dtype": "fp8", **CPU},
    "bfloat16, fp8_e5m2 KV cache": {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e5m2", **CPU},
}
# float32+int8 has the same bounds as bfloat16+int8: the int8 rounding dominates either way. A bf16
# KV cache rounds a subset of what a bf16 model rounds: the bf16 bounds.
MIN_AGREEING_FRACTION = {"bfloat16": 0.75, "bfloat16+int8": 0.5, "float32+int8": 0.5,
                         "float32, bf16 KV cache": 0.75, "float32, bf16 KV cache, torch attention": 0.75,
                         "float32, int8 KV cache": 0.75, "float32, int8 KV cache, torch attention": 0.75,
                         "bfloat16, int8 KV cache": 0.75, "float32, fp8 KV cache": 0.25,
                         "bfloat16, fp8_e5m2 KV cache": 0.25}
MAX_MEAN_ABS_LOGPROB_DIFF = {"bfloat16": 0.05, "bfloat16+int8": 0.15, "float32+int8": 0.15,
                             "float32, bf16 KV cache": 0.05, "float32, bf16 KV cache, torch attention": 0.05,
                             "float32, int8 KV cache": 0.05, "float32, int8 KV cache, torch attention": 0.05,
                             "bfloat16, int8 KV cache": 0.07, "float32, fp8 KV cache": 0.2,
                             "bfloat16, fp8_e5m2 KV cache": 0.5}


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token; the shorter length when one is a prefix of the other."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def teacher_forced_logprobs(llm: LLM, sequences: list[list[int]], skip: list[int]) -> list[list[float]]:
    """The logprob of each token of `sequences` after the first `skip[i]` (the prompt), given
    everything before it."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    result = []
    for seq, start, out in zip(sequences, skip, outputs):
        entries = out.prompt_logprobs
        result.append([entries[i][seq[i]].logprob for i in range(start, len(seq))])
    return result


def teacher_forced_drift(reference_llm: LLM, reduced_llm: LLM, prompts: list[list[int]],
                         reference: list[list[int]]) -> list[float]:
    """|logprob difference| between the two models of each token the reference generated, both fed
    the reference's sequences (no compounding: the bound stays tight)."""
    sequences = [p + r for p, r in zip(prompts, reference)]
    skip = [len(p) for p in prompts]
    reference_logprobs = teacher_forced_logprobs(reference_llm, sequences, skip)
    reduced_logprobs = teacher_forced_logprobs(reduced_llm, sequences, skip)
    return [abs(a - b) for ra, rb in zip(reference_logprobs, reduced_logprobs) for a, b in zip(ra, rb)]


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen3"])
def test_reduced_precision_close_to_fp32(name: str, precision: str, tiny_models: dict[str, Path],
                                          prompts_token_ids: list[list[int]]) -> None:
    model = tiny_models[name]
    reduced_args = PRECISIONS[precision]
    reference_llm = make_llm(model, dtype="float32", device=reduced_args.get("device", "auto"))
    reduced_llm = make_llm(model, **reduced_args)
    reference = greedy(reference_llm, prompts_token_ids)
    reduced = greedy(reduced_llm, prompts_token_ids)
    divergence = [first_divergence(a, b) for a, b in zip(reduced, reference)]
    print(f"{name} {precision}: first divergence per prompt (of {NEW_TOKENS}): {divergence}")
    agreeing = sum(d >= AGREE_PREFIX for d in divergence)
    assert agreeing >= MIN_AGREEING_FRACTION[precision] * len(prompts_token_ids), divergence

    diffs = teacher_forced_drift(reference_llm, reduced_llm, prompts_token_ids, reference)
    mean_diff = sum(diffs) / len(diffs)
    print(f"{name} {precision}: mean |dlogprob| {mean_diff:.4f}, max {max(diffs):.4f} over {len(diffs)} tokens")
    assert mean_diff < MAX_MEAN_ABS_LOGPROB_DIFF[precision]
    # A sanity floor: the reduced model really ran in reduced precision.
    assert mean_diff > 0.0


def float_matrices(model) -> list[str]:
    """The weights (2-D and up) a model holds in float other than its embeddings, LM head and MoE
    routers, which quantization="int8" leaves in the model dtype."""
    from torch import nn

    from vllm_lite.model.layers.embedding import VocabParallelEmbedding
    from vllm_lite.model.layers.fused_moe import RouterLinear

    from vllm_lite.model.layers.quantization import Int8Weight

    kept = (nn.Embedding, VocabParallelEmbedding, RouterLinear)
    found = []
    for module_name, module in model.named_modules():
        if isinstance(module, kept) or module_name.endswith("lm_head"):
            continue
        packed = getattr(module, "packed_weight", None)
        if packed is not None and not isinstance(packed, Int8Weight):  # (packed for the float matmul)
            found.append(f"{module_name}.weight")
        found += [f"{module_name}.{name}" for name, param in module.named_parameters(recurse=False)
                  if param.dim() >= 2 and param.is_floating_point() and not param.is_meta]
    return found


@pytest.mark.parametrize("name", ["tiny_mixtral", "tiny_cohere"])
def test_int8_reaches_moe_experts_and_the_transformers_fallback(name: str, request: pytest.FixtureRequest,
                                                               prompts_token_ids: list[list[int]]) -> None:
    """quantization="int8" quantizes a native MoE model's experts (its routers stay in the model
    dtype, as vLLM keeps them) and the Transformers fallback's decoder (Cohere has no native
    implementation): nothing else is left in float, and the outputs stay within int8's bounds."""
    model = request.getfixturevalue(name)
    reference_llm = make_llm(model, dtype="float32")
    reduced_llm = make_llm(model, dtype="bfloat16", quantization="int8")
    assert reduced_llm.apply_model(float_matrices) == [[]]
    assert reference_llm.apply_model(float_matrices) != [[]]
    diffs = teacher_forced_drift(reference_llm, reduced_llm, prompts_token_ids,
                                 greedy(reference_llm, prompts_token_ids))
    mean_diff = sum(diffs) / len(diffs)
    print(f"{name} int8: mean |dlogprob| {mean_diff:.4f}, max {max(diffs):.4f} over {len(diffs)} tokens")
    assert 0.0 < mean_diff < MAX_MEAN_ABS_LOGPROB_DIFF["bfloat16+int8"]


def test_int8_refuses_the_fallbacks_stacked_experts_by_name(tiny_olmoe: Path) -> None:
    """OLMoE runs through the Transformers fallback, whose experts are stacked tensors transformers'
    own code multiplies: int8 would leave them in float, so it is refused, naming them."""
    with pytest.raises(ValueError, match=r"OlmoeForCausalLM through the Transformers fallback keeps its experts "
                                         r"in stacked tensors \(layers.0.mlp.experts.gate_up_proj"):
        make_llm(tiny_olmoe, dtype="bfloat16", quantization="int8")
