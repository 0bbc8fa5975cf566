"""The Transformers fallback: transformers' modelling code, our scheduler, paged KV cache and
attention (vllm_lite/model/models/transformers_fallback.py). Parity for the architectures without
a native implementation runs in tests/model/test_families.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from checkpoint_copies import edited_copy
from hf_reference import hf_greedy
from test_parity import NEW_TOKENS, run_greedy
from vllm_lite import LLM, SamplingParams
from vllm_lite.config import EngineArgs
from vllm_lite.model.layers.linear import ReplicatedLinear, unpacked_weight


def test_native_architecture_through_transformers_on_request(tiny_qwen3: Path,
                                                             prompts_token_ids: list[list[int]]) -> None:
    llm = LLM(str(tiny_qwen3), max_model_len=256, dtype="float32", model_impl="transformers", max_num_batched_tokens=16,
              multiprocess=False)
    assert run_greedy(llm, prompts_token_ids) == hf_greedy(tiny_qwen3, prompts_token_ids, NEW_TOKENS)


def test_a_head_that_reaches_into_its_base_model_is_refused_by_name(tiny_opt: Path) -> None:
    """OPT's forward calls `model.decoder(...)`, not its base model: the fallback cannot feed its
    head the engine's hidden states (it failed at the first step that sampled)."""
    with pytest.raises(ValueError, match=r"OPTForCausalLM's forward reaches into its base model's parts \("):
        LLM(str(tiny_opt), max_model_len=64, dtype="float32", model_impl="transformers", multiprocess=False)


def test_auto_picks_native_then_fallback(tiny_llama: Path, tiny_cohere: Path) -> None:
    assert EngineArgs(model=str(tiny_llama)).create_engine_config().model_config.hf.model_impl == "vllm"
    assert EngineArgs(model=str(tiny_cohere)).create_engine_config().model_config.hf.model_impl == "transformers"


def test_native_only_refuses_an_architecture_without_one(tiny_cohere: Path) -> None:
    with pytest.raises(ValueError, match="CohereForCausalLM.*no native implementation"):
        EngineArgs(model=str(tiny_cohere), model_impl="vllm").create_engine_config()


def test_a_model_with_a_fixed_attention_table_is_refused_by_name(tmp_path: Path) -> None:
    """transformers' GPT-Neo picks its attention class from a fixed table (Falcon's did up to
    transformers 5.24): no place for ours (a KeyError inside transformers before)."""
    from hf_reference import build_tiny_model

    model = build_tiny_model(tmp_path / "gpt_neo", "gpt_neo", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="GPTNeoForCausalLM has no place for an attention implementation"):
        LLM(str(model), max_model_len=64, dtype="float32", multiprocess=False)


@pytest.mark.skipif(not hasattr(transformers, "Kolibri1_1Config"), reason="Kolibri 1.1 is transformers >= 5.25's")
def test_a_model_whose_forward_fails_with_our_attention_is_refused_by_name(tmp_path: Path) -> None:
    """Kolibri 1.1's indexed (sparse) layers overlay their selection on a 4D mask of their own,
    which the engine's attention does not hand them: transformers' own ValueError escaped the load
    before; now the refusal names the model and why."""
    from hf_reference import build_tiny_model

    model = build_tiny_model(tmp_path / "kolibri", "kolibri1_1", tie_word_embeddings=False)
    with pytest.raises(ValueError, match="Kolibri1_1ForCausalLM's forward fails with the engine's attention in "
                                         "place of its own .*Sparse attention layers need"):
        LLM(str(model), max_model_len=64, dtype="float32", multiprocess=False)


def test_latent_attention_is_cached_at_the_wider_of_its_key_and_value_widths(tiny_deepseek_v2: Path) -> None:
    """DeepSeek-V2's latent attention hands the cache keys of 8 + 8 dimensions and values of 24
    per head (it was refused before): the cache holds every head at 24 (parity with transformers:
    tests/model/test_families.py)."""
    hf = EngineArgs(model=str(tiny_deepseek_v2)).create_engine_config().model_config.hf
    assert (hf.model_impl, hf.num_key_value_heads, hf.head_dim) == ("transformers", hf.num_attention_heads, 24)


@pytest.mark.parametrize("field,value,message", [
    ("quantization_config", {"quant_method": "awq"}, "quantization_config"),
    ("model_type", "no_such_model", "no_such_model"),
    # Llama 4's chunked local attention: made by the attention mask, which the fallback replaces
    ("attention_chunk_size", 8192, "attention_chunk_size=8192 is not supported"),
])
def test_fallback_refuses_what_transformers_cannot_run_here(tiny_cohere: Path, tmp_path: Path,
                                                           field: str, value, message: str) -> None:
    model = edited_copy(tiny_cohere, tmp_path / "m", {field: value})
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(model)).create_engine_config()


HYBRIDS = {
    # Granite 4.0-H (Mamba-2 and attention layers), LFM2 (short convolutions and attention)
    "GraniteMoeHybridForCausalLM": ("GraniteMoeHybridConfig", {
        "layer_types": ["mamba", "attention"], "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16,
        "mamba_n_groups": 1, "mamba_expand": 2, "num_local_experts": 0}),
    "Lfm2ForCausalLM": ("Lfm2Config", {"layer_types": ["conv", "full_attention"]}),
}


def _hybrid(architecture: str, out: Path) -> Path:
    import transformers

    from hf_reference import build_tokenizer, tokenizer_vocab_size

    config_class, fields = HYBRIDS[architecture]
    config = getattr(transformers, config_class)(vocab_size=tokenizer_vocab_size(), hidden_size=64,
                                                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2, max_position_embeddings=256, **fields)
    getattr(transformers, architecture)(config).save_pretrained(out)
    build_tokenizer(out)
    return out


@pytest.mark.parametrize("architecture, layer", [("GraniteMoeHybridForCausalLM", "GraniteMoeHybridMambaLayer"),
                                                 ("Lfm2ForCausalLM", "Lfm2ShortConv")])
def test_layers_with_a_recurrent_state_are_refused_by_name(architecture: str, layer: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Their Mamba / convolution layers keep a state per request from step to step; fed a step's
    tokens of every request as one sequence, without that state, they gave other tokens than
    transformers (silently, before)."""
    model = _hybrid(architecture, tmp_path / architecture)
    with pytest.raises(ValueError, match=f"{architecture} has layers that keep a per-request state .*{layer}"):
        LLM(str(model), max_model_len=64, dtype="float32", multiprocess=False)
    # a layer of a kind not named there is still caught: it does not attend
    monkeypatch.setattr("vllm_lite.model.models.transformers_fallback._RECURRENT_LAYER_NAMES", ())
    with pytest.raises(ValueError, match=f"{architecture} attends in 1 of its 2 layers"):
        LLM(str(model), max_model_len=64, dtype="float32", multiprocess=False)


def test_qwen3_nexts_linear_attention_is_refused_by_name(tmp_path: Path) -> None:
    """Qwen3-Next's Gated DeltaNet layers fuse their projections otherwise than Qwen3.5's (which run
    on the engine's state slots: tests/model/test_linear_attention.py): refused naming them, and
    not taken for attention-only layers."""
    from hf_reference import build_tokenizer, tokenizer_vocab_size

    config = transformers.Qwen3NextConfig(
        vocab_size=tokenizer_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    model = tmp_path / "qwen3_next"
    transformers.Qwen3NextForCausalLM(config).save_pretrained(model)
    build_tokenizer(model)
    with pytest.raises(ValueError, match="Qwen3NextForCausalLM has layers that keep a per-request state .*GatedDeltaNet"):
        LLM(str(model), max_model_len=64, dtype="float32", multiprocess=False)


def test_a_model_without_a_base_model_is_refused_by_name(tmp_path: Path) -> None:
    """transformers' Llama4ForCausalLM (Llama 4's text model) names no base model: its hidden states
    cannot be taken apart from its head (an AttributeError in its first step before)."""
    import transformers

    from hf_reference import build_tokenizer, tokenizer_vocab_size

    config = transformers.Llama4TextConfig(
        vocab_size=tokenizer_vocab_size(), hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=None,
        num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=256)
    transformers.Llama4ForCausalLM(config).save_pretrained(tmp_path / "llama4")
    build_tokenizer(tmp_path / "llama4")
    with pytest.raises(ValueError, match="Llama4ForCausalLM names no base model"):
        LLM(str(tmp_path / "llama4"), max_model_len=64, dtype="float32", multiprocess=False)


@pytest.mark.parametrize("architecture, config_class, fields, message", [
    # a BERT-style causal LM whose config leaves is_decoder false attends both ways (it ran causally
    # here, with other tokens than transformers', before)
    ("RobertaForCausalLM", "RobertaConfig", {"is_decoder": False}, "attention is bidirectional"),
    # differential attention: two attention maps per layer (it wrote one cache layer twice before)
    ("DiffLlamaForCausalLM", "DiffLlamaConfig", {"num_key_value_heads": 2}, "attends 4 times in its 2 layers, not once per cache layer"),
    # recurrent depth: one stack of 2 layers run in 2 x (3 + 1) cycles, its 16 cache slots by the layers' own index
    ("HrmTextForCausalLM", "HrmTextConfig", {"num_hidden_layers": 16, "num_layers_per_stack": 2, "H_cycles": 2,
                                             "L_cycles": 3}, "attends 16 times in its 16 layers, not once per cache"),
    # Nemotron(-4, Minitron) drops the forward's keyword arguments before its attention (a KeyError before)
    ("NemotronForCausalLM", "NemotronConfig", {"num_key_value_heads": 2},
     "does not hand its model's keyword arguments on to its attention"),
])
def test_attention_the_cache_cannot_reproduce_is_refused_by_name(architecture: str, config_class: str, fields: dict,
                                                                 message: str, tmp_path: Path) -> None:
    import transformers

    from hf_reference import build_tokenizer, tokenizer_vocab_size

    config = getattr(transformers, config_class)(**{
        "vocab_size": tokenizer_vocab_size(), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 256, "bos_token_id": 0, "eos_token_id": 2,
        "pad_token_id": 0, **fields})
    getattr(transformers, architecture)(config).save_pretrained(tmp_path / "m")
    build_tokenizer(tmp_path / "m")
    with pytest.raises(ValueError, match=f"{architecture.removesuffix('ForCausalLM')}.*{message}"):
        LLM(str(tmp_path / "m"), max_model_len=64, dtype="float32", multiprocess=False)


def test_the_decoders_linear_layers_are_the_engines(tiny_cohere: Path) -> None:
    """transformers' nn.Linear layers of the decoder run as the engine's (packed for the CPU
    matmul, AMX tiles for bf16 where the CPU has them; what quantization="int8" quantizes); the LM
    head is transformers' own."""
    from torch import nn

    def linear_layers(model) -> tuple[set[str], set[str]]:
        hf_model = model.hf_model
        kinds = {type(module).__name__ for module in hf_model.base_model.modules()
                 if isinstance(module, (nn.Linear, ReplicatedLinear))}
        return kinds, {type(hf_model.lm_head).__name__}

    llm = LLM(str(tiny_cohere), max_model_len=64, dtype="float32", multiprocess=False)
    try:
        assert llm.apply_model(linear_layers) == [({"ReplicatedLinear"}, {"Linear"})]
        packed = llm.apply_model(lambda model: {module.packed_weight is not None for module in model.modules()
                                                if isinstance(module, ReplicatedLinear)})
        assert packed == [{True}]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("architecture, num_heads", [("cohere", 1), ("gpt_neox", 2)])
def test_bf16_prefills_of_a_head_dim_64_model_on_the_cpu_backend(architecture: str, num_heads: int,
                                                                 tmp_path: Path) -> None:
    """head_dim 64 in bf16 takes the csrc prefill op on an AMX CPU, which reads each token's heads as
    one row; the fallback's query comes transposed from transformers' layout, its heads apart
    (GPT-NeoX's, sliced from fused q / k / v per head) or looking so (one head), which killed the
    engine core at the first prefill. Greedy tokens as on the torch backend, but for bf16's rounding."""
    from hf_reference import build_tiny_model

    model = build_tiny_model(tmp_path / architecture, architecture, tie_word_embeddings=True,
                             hidden_size=64 * num_heads, num_heads=num_heads, num_kv_heads=num_heads)
    prompts = [{"prompt_token_ids": list(range(5 + i, 12 + 9 * i))} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for backend in ("cpu_native", "torch"):
        llm = LLM(str(model), max_model_len=128, dtype="bfloat16", attention_backend=backend, multiprocess=False,
                  model_impl="transformers")
        try:
            tokens[backend] = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()
    agreeing = sum(a[:4] == b[:4] for a, b in zip(tokens["cpu_native"], tokens["torch"]))
    assert agreeing >= 4, tokens


def test_a_bf16_model_loads_straight_into_bf16(tiny_cohere: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback has transformers load the checkpoint in the engine's dtype (it loaded float32
    and cast after: twice a bf16 model's bytes at the peak); the weights are the same."""
    import torch
    from transformers import AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained
    asked: list[torch.dtype] = []

    def recording_load(*args, **kwargs):
        asked.append(kwargs.get("dtype"))
        return load(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording_load)
    llm = LLM(str(tiny_cohere), max_model_len=64, dtype="bfloat16", multiprocess=False)
    monkeypatch.undo()
    assert asked == [torch.bfloat16]
    try:
        hf_model = llm.llm_engine.engine_core.executor.worker.model_runner.model.hf_model
        reference = AutoModelForCausalLM.from_pretrained(tiny_cohere, dtype=torch.float32).to(torch.bfloat16)
        loaded = dict(hf_model.named_parameters())
        assert {p.dtype for p in loaded.values()} == {torch.bfloat16}
        for name, param in reference.named_parameters():
            module = hf_model.get_submodule(name.rpartition(".")[0])
            if isinstance(module, ReplicatedLinear) and name.endswith(".weight"):  # (packed for the CPU matmul)
                assert loaded[name].is_meta and module.packed_weight is not None
                assert torch.equal(unpacked_weight(module.packed_weight), param), name
            else:
                assert torch.equal(loaded[name], param), name
    finally:
        llm.shutdown()
