"""Multimodal checkpoints served as their language model (vLLM's --language-model-only): Gemma 3,
Mistral 3, LLaVA, LLaVA-NeXT, LLaVA-OneVision, InternVL, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, SmolVLM and
Idefics3 checkpoints written by transformers (a tiny
vision encoder and projector beside a tiny decoder, random weights, fp32) give, text in, the
tokens and logprobs of transformers' own multimodal class, and with a LoRA adapter of its
language model PEFT's; the older and newer tensor-name and config forms load alike; what is not
implemented (image inputs, LoRA of the vision side, pooling) is refused by name. (Quantized ones:
tests/test_wna16_checkpoint.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_copies import edit_json
from hf_reference import IMAGE_TOKEN_ID, hf_greedy, hf_logits
from lora_adapters import make_adapter, peft_greedy, peft_prompt_logprobs
from test_parity import NEW_TOKENS, assert_no_leaked_blocks, run_greedy
from vllm_lite import LLM, SamplingParams
from vllm_lite.config import EngineArgs
from vllm_lite.lora.request import LoRARequest

MULTIMODAL = ["tiny_gemma3_mm", "tiny_mistral3", "tiny_llava", "tiny_llava_next", "tiny_llava_onevision", "tiny_internvl",
              "tiny_qwen2_vl", "tiny_qwen2_5_vl", "tiny_qwen3_vl", "tiny_qwen3_vl_moe", "tiny_smolvlm", "tiny_idefics3"]


def _copy(model: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model, tmp_path / model.name))


def _config(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def _assert_greedy_equals_transformers(model: Path, reference: Path, prompts: list[list[int]], **args: object) -> None:
    """The engine on `model` gives transformers' greedy tokens on `reference` (the same weights)."""
    llm = LLM(str(model), max_model_len=256, dtype="float32", multiprocess=False, **args)
    try:
        assert run_greedy(llm, prompts) == hf_greedy(reference, prompts, NEW_TOKENS)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fixture", MULTIMODAL)
def test_language_model_matches_transformers_multimodal_class(fixture: str, request: pytest.FixtureRequest,
                                                               prompts_token_ids: list[list[int]]) -> None:
    model: Path = request.getfixturevalue(fixture)
    assert not any(IMAGE_TOKEN_ID in prompt for prompt in prompts_token_ids)
    _assert_greedy_equals_transformers(model, model, prompts_token_ids)
    expected = hf_greedy(model, prompts_token_ids, NEW_TOKENS)
    # chunks of 16 tokens, a cache that forces preemption, and a second pass over prefix-cache hits
    llm = LLM(str(model), max_model_len=256, dtype="float32", num_kv_blocks=18, block_size=16,
              max_num_batched_tokens=16, multiprocess=False)
    try:
        assert run_greedy(llm, prompts_token_ids) == expected
        assert run_greedy(llm, prompts_token_ids) == expected
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
        assert_no_leaked_blocks(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fixture", MULTIMODAL)
def test_prompt_logprobs_match_transformers_multimodal_class(fixture: str, request: pytest.FixtureRequest,
                                                             prompts_token_ids: list[list[int]]) -> None:
    model: Path = request.getfixturevalue(fixture)
    prompt = prompts_token_ids[3]
    llm = LLM(str(model), max_model_len=256, dtype="float32", multiprocess=False)
    try:
        [output] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                use_tqdm=False)
    finally:
        llm.shutdown()
    expected = torch.log_softmax(hf_logits(model, prompt), dim=-1)
    for position in range(1, len(prompt)):
        got = output.prompt_logprobs[position][prompt[position]].logprob
        assert abs(got - expected[position - 1, prompt[position]].item()) < 2e-4, position


def test_tensor_names_of_newer_transformers_load_alike(tiny_gemma3_mm: Path, tiny_qwen2_5_vl: Path,
                                                       tmp_path: Path, prompts_token_ids: list[list[int]]) -> None:
    """transformers 4.52+ names a composite model's language model `model.language_model.` and its
    LM head `lm_head.` in memory (vLLM maps both forms); a checkpoint written that way loads the
    same weights."""
    prompts = prompts_token_ids[:3]
    renames = {"tiny_gemma3_mm": [("language_model.model.", "model.language_model."),
                                  ("vision_tower.", "model.vision_tower."),
                                  ("multi_modal_projector.", "model.multi_modal_projector.")],
               "tiny_qwen2_5_vl": [("model.", "model.language_model."), ("visual.", "model.visual.")]}
    for original in (tiny_gemma3_mm, tiny_qwen2_5_vl):
        model = _copy(original, tmp_path)
        tensors = load_file(model / "model.safetensors")
        renamed = {}
        for name, tensor in tensors.items():
            for old, new in renames[original.name.rstrip("0123456789")]:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            renamed[name] = tensor
        assert renamed.keys() != tensors.keys()
        save_file(renamed, model / "model.safetensors", metadata={"format": "pt"})
        _assert_greedy_equals_transformers(model, original, prompts)


def test_qwen2_vl_config_with_the_text_fields_at_the_top_level(tiny_qwen2_5_vl: Path, tmp_path: Path,
                                                               prompts_token_ids: list[list[int]]) -> None:
    """Released Qwen2-VL / Qwen2.5-VL configs keep the language model's fields at the top level
    (no text_config) with `rope_scaling: {"type": "mrope", ...}`; transformers moves them into its
    text config, and so they are read here."""
    model = _copy(tiny_qwen2_5_vl, tmp_path)
    cfg = _config(model)
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**cfg, **{k: v for k, v in text.items() if k not in ("model_type", "layer_types", "head_dim")},
            "rope_theta": rope["rope_theta"], "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    (model / "config.json").write_text(json.dumps(flat))
    prompts = prompts_token_ids[:3]
    _assert_greedy_equals_transformers(model, tiny_qwen2_5_vl, prompts)


def test_llava_15_config_keys_are_read(tiny_llava: Path, tmp_path: Path, prompts_token_ids: list[list[int]]) -> None:
    """llava-hf's LLaVA 1.5 configs (transformers 4.36) carry the loss's `ignore_index` and repeat the
    language model's vocab_size at the top: read as transformers reads them; a top-level
    vocab_size that disagrees with the text config's is refused rather than picked."""
    model = _copy(tiny_llava, tmp_path)
    vocab = _config(model)["text_config"]["vocab_size"]
    edit_json(model / "config.json", {"ignore_index": -100, "vocab_size": vocab})
    _assert_greedy_equals_transformers(model, tiny_llava, prompts_token_ids[:2])
    edit_json(model / "config.json", {"vocab_size": vocab + 64})
    with pytest.raises(ValueError, match=f"vocab_size={vocab + 64} and text_config.vocab_size={vocab} disagree"):
        EngineArgs(model=str(model)).create_engine_config()


def test_the_language_model_through_the_transformers_fallback(tiny_gemma3_mm: Path,
                                                              prompts_token_ids: list[list[int]]) -> None:
    """model_impl="transformers": transformers' text model built from the text config, the
    checkpoint's language-model tensors loaded into it (how Gemma 3n's, which has no native
    implementation, is served)."""
    _assert_greedy_equals_transformers(tiny_gemma3_mm, tiny_gemma3_mm, prompts_token_ids[:3], model_impl="transformers")


def test_gemma_3n_is_served_as_its_text_model(tiny_gemma3n: Path, tmp_path: Path,
                                              prompts_token_ids: list[list[int]]) -> None:
    """Gemma 3n's releases are `Gemma3nForConditionalGeneration` (vision and audio towers beside its
    text model, which has no native implementation): the text model through the Transformers
    fallback. The checkpoint is tiny_gemma3n's text model in that form (transformers' vision tower
    needs timm, which is not installed here, so the towers are stand-in tensors, never read)."""
    model = tmp_path / "gemma3n_mm"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_gemma3n / name, model / name)
    text = _config(tiny_gemma3n)
    text.pop("architectures")
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3nForConditionalGeneration"], "model_type": "gemma3n", "text_config": text,
        "audio_soft_tokens_per_image": 188, "vision_soft_tokens_per_image": 256, "image_token_id": 999,
        "tie_word_embeddings": True, "torch_dtype": "float32"}))
    tensors = {"model.language_model." + name.removeprefix("model."): tensor
               for name, tensor in load_file(tiny_gemma3n / "model.safetensors").items()}
    tensors.update({"model.vision_tower.stem.weight": torch.zeros(2), "model.audio_tower.conv.weight": torch.zeros(2),
                    "model.embed_vision.embedding.weight": torch.zeros(2, 2)})
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    _assert_greedy_equals_transformers(model, tiny_gemma3n, prompts_token_ids[:3])


def test_gemma_4_is_served_as_its_text_model(tiny_gemma4: Path, tmp_path: Path,
                                             prompts_token_ids: list[list[int]]) -> None:
    """Gemma 4's releases are `Gemma4ForConditionalGeneration` (transformers >= 5.25): a vision
    tower beside tiny_gemma4's text model (global layers of their own head_dim and KV heads), built
    and saved by transformers; the text model through the Transformers fallback, greedy tokens as
    transformers' multimodal class gives them."""
    import transformers

    from hf_reference import _redraw_weights, _write_generation_config

    text = _config(tiny_gemma4)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16, "patch_size": 14, "position_embedding_size": 64}
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                                       tie_word_embeddings=True, image_token_id=IMAGE_TOKEN_ID)
    checkpoint = transformers.Gemma4ForConditionalGeneration(config).to(torch.float32)
    _redraw_weights(checkpoint.get_decoder(), 0)
    model = tmp_path / "gemma4_mm"
    checkpoint.save_pretrained(model)
    _write_generation_config(model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_gemma4 / name, model / name)
    _assert_greedy_equals_transformers(model, model, prompts_token_ids[:3])


def test_qwen3_5_is_served_as_its_text_model(tiny_qwen3_5: Path, tmp_path: Path,
                                             prompts_token_ids: list[list[int]]) -> None:
    """Qwen3.5's releases are `Qwen3_5ForConditionalGeneration` (transformers >= 5.25): a vision
    tower and a multi-token-prediction head (`mtp.`, not read) beside tiny_qwen3_5's text model
    (Gated DeltaNet and gated attention layers), built and saved by transformers; greedy tokens as
    transformers' multimodal class gives them."""
    import transformers

    from hf_reference import _redraw_weights, _write_generation_config

    text = _config(tiny_qwen3_5)
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 14}
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                        image_token_id=IMAGE_TOKEN_ID)
    checkpoint = transformers.Qwen3_5ForConditionalGeneration(config).to(torch.float32)
    _redraw_weights(checkpoint.get_decoder(), 0)
    model = tmp_path / "qwen3_5_mm"
    checkpoint.save_pretrained(model)
    tensors = load_file(model / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    _write_generation_config(model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_qwen3_5 / name, model / name)
    _assert_greedy_equals_transformers(model, model, prompts_token_ids[:3])


def test_hf_overrides_update_the_text_config(tiny_gemma3_mm: Path) -> None:
    """vLLM updates a nested config with a dict override (the others of its fields kept)."""
    hf = EngineArgs(model=str(tiny_gemma3_mm), dtype="float32",
                    hf_overrides={"text_config": {"sliding_window": 4}}).create_engine_config().model_config.hf
    assert hf.sliding_windows == (4, None) and hf.head_dim == 32 and hf.hidden_size == 64


def test_an_lm_head_is_tied_only_where_the_outer_and_the_text_config_both_say_so(
        tiny_mistral3: Path, tmp_path: Path, prompts_token_ids: list[list[int]]) -> None:
    """Mistral Small 3.1's config (written by transformers 4) says nothing of tying at the top,
    where transformers 5's Mistral3 class defaults to tied, and its text config is untied; its
    checkpoint has the LM head, which is read (as transformers 4 and vLLM read it)."""
    model = _copy(tiny_mistral3, tmp_path)
    cfg = _config(model)
    del cfg["tie_word_embeddings"]
    cfg["text_config"]["tie_word_embeddings"] = False
    (model / "config.json").write_text(json.dumps(cfg))
    prompts = prompts_token_ids[:2]
    _assert_greedy_equals_transformers(model, tiny_mistral3, prompts)


def test_the_vision_tensors_are_not_read_and_unknown_tensors_are_refused(tiny_llava: Path, tmp_path: Path,
                                                                        prompts_token_ids: list[list[int]]) -> None:
    model = _copy(tiny_llava, tmp_path)
    tensors = load_file(model / "model.safetensors")
    text_only = {name: t for name, t in tensors.items() if name.startswith("language_model.")}
    assert len(text_only) < len(tensors)
    save_file(text_only, model / "model.safetensors", metadata={"format": "pt"})
    prompts = prompts_token_ids[:2]
    _assert_greedy_equals_transformers(model, tiny_llava, prompts, language_model_only=True)
    # (LLaVA's image inputs are taken by default, as in vLLM: its vision side is then needed)
    with pytest.raises(ValueError, match="lacks weights for.*the vision encoder and projector, which image inputs "
                                         "need; language_model_only=True serves the language model alone"):
        LLM(str(model), max_model_len=256, dtype="float32", multiprocess=False)
    save_file({**text_only, "audio_tower.proj.weight": torch.zeros(2, 2)}, model / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'audio_tower.proj.weight' has no matching model parameter"):
        LLM(str(model), max_model_len=256, dtype="float32", multiprocess=False, language_model_only=True)


def test_chat_template_of_the_processor_is_used(tiny_gemma3_mm: Path, tmp_path: Path) -> None:
    """A multimodal checkpoint may keep its chat template in the processor's chat_template.json,
    which vLLM reads (through the processor) and transformers' tokenizer does not."""
    model = _copy(tiny_gemma3_mm, tmp_path)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    for name in ("tokenizer_config.json",):
        cfg = json.loads((model / name).read_text())
        cfg.pop("chat_template", None)
        (model / name).write_text(json.dumps(cfg))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    (model / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    llm = LLM(str(model), max_model_len=256, dtype="float32", multiprocess=False)
    try:
        [output] = llm.chat([{"role": "user", "content": "the cat"}],
                            SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        tokenizer = llm.get_tokenizer()
        assert tokenizer.chat_template == template
        assert output.prompt_token_ids == tokenizer("<user>the cat", add_special_tokens=False)["input_ids"]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("args", [{"language_model_only": True}, {"limit_mm_per_prompt": {"image": 0}},
                                  {"limit_mm_per_prompt": {"image": {"count": 0}, "video": 0}}])
def test_vllms_text_only_settings_are_taken(args: dict, tiny_gemma3_mm: Path, prompts_token_ids: list[list[int]]) -> None:
    _assert_greedy_equals_transformers(tiny_gemma3_mm, tiny_gemma3_mm, prompts_token_ids[:1], **args)


@pytest.mark.parametrize("limit", [{"image": 1}, {"video": {"count": 2, "num_frames": 8}}])
def test_multimodal_inputs_asked_for_are_refused_by_name(limit: dict) -> None:
    modality = next(iter(limit))
    with pytest.raises(ValueError, match=f"limit_mm_per_prompt: {modality}=.*multimodal inputs are not implemented"):
        EngineArgs(limit_mm_per_prompt=limit).create_engine_config()


def test_what_is_not_implemented_is_refused_by_name(tiny_gemma3_mm: Path, tiny_llava: Path, tiny_llama: Path,
                                                   tmp_path: Path) -> None:
    def refused(model: Path, match: str, **args: object) -> None:
        with pytest.raises(ValueError, match=match):
            EngineArgs(model=str(model), dtype="float32", **args).create_engine_config()

    # the image processor's arguments where no image can reach it: refused rather than unused
    refused(tiny_llama, r"mm_processor_kwargs=\{'max_pixels': 1\} is for a model that takes images; this one "
                        r"takes none \(LlamaForCausalLM is a text model\)", mm_processor_kwargs={"max_pixels": 1})
    refused(tiny_llava, "is for a model that takes images; this one takes none .language_model_only=True",
            mm_processor_kwargs={"max_pixels": 1}, language_model_only=True)

    refused(tiny_gemma3_mm, "runs with the generate runner only", runner="pooling")
    refused(tiny_gemma3_mm, "runs with the generate runner only", convert="embed")
    model = _copy(tiny_gemma3_mm, tmp_path)
    cfg = _config(model)
    cfg["text_config"]["final_logit_softcapping"] = 30.0
    (model / "config.json").write_text(json.dumps(cfg))
    refused(model, "text_config.final_logit_softcapping=30.0 is not supported for Gemma3ForConditionalGeneration")
    model = _copy(tiny_llava, tmp_path)
    edit_json(model / "config.json", {"quantization_config": {"quant_method": "awq", "bits": 3}})
    refused(model, "quantization_config.bits=3 is not supported")
    edit_json(model / "config.json", {"quantization_config": None, "vision_feature_layer_weights": [1.0]})
    refused(model, "field 'vision_feature_layer_weights' is not implemented for LlavaForConditionalGeneration")
    cfg = _config(model)
    del cfg["vision_feature_layer_weights"]
    cfg["text_config"]["model_type"] = "phi3"
    (model / "config.json").write_text(json.dumps(cfg))
    refused(model, "text_config.model_type 'phi3' of LlavaForConditionalGeneration is not supported")
    cfg["text_config"]["model_type"] = "llama"
    cfg["text_config"]["hidden_act"] = "gelu"
    (model / "config.json").write_text(json.dumps(cfg))
    refused(model, "hidden_act='gelu' is not supported for LlamaForCausalLM")


LANGUAGE_MODEL_LINEAR = r".*(language_model|text_model).*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


@pytest.mark.parametrize("fixture", ["tiny_gemma3_mm", "tiny_qwen2_5_vl", "tiny_smolvlm"])
def test_lora_adapter_of_the_language_model_matches_peft(fixture: str, request: pytest.FixtureRequest,
                                                         tmp_path: Path, prompts_token_ids: list[list[int]]) -> None:
    """PEFT names a multimodal model's modules by its class's tree (`model.language_model.*`);
    the adapter applies to the served language model as PEFT applies it."""
    base: Path = request.getfixturevalue(fixture)
    adapter = make_adapter(base, tmp_path / "adapter", seed=5, target_modules=LANGUAGE_MODEL_LINEAR)
    lora = LoRARequest("adapter", 1, str(adapter))
    prompts = prompts_token_ids[:3]
    llm = LLM(str(base), max_model_len=256, dtype="float32", multiprocess=False, enable_lora=True, max_lora_rank=8)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                               lora_request=lora, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == peft_greedy(base, adapter, prompts, NEW_TOKENS)
        prompt = prompts_token_ids[4]
        logprobs = {}
        for name, adapter_request in (("adapter", lora), ("base", None)):
            [output] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                    lora_request=adapter_request, use_tqdm=False)
            logprobs[name] = torch.tensor([entry[t].logprob for entry, t in zip(output.prompt_logprobs[1:], prompt[1:])])
    finally:
        llm.shutdown()
    torch.testing.assert_close(logprobs["adapter"], peft_prompt_logprobs(base, adapter, prompt), atol=2e-4, rtol=0)
    assert (logprobs["adapter"] - logprobs["base"]).abs().max() > 0.05  # (the adapter changes the model)


def test_lora_adapter_of_the_vision_side_is_refused_by_name(tiny_gemma3_mm: Path, tmp_path: Path,
                                                            prompts_token_ids: list[list[int]]) -> None:
    adapter = make_adapter(tiny_gemma3_mm, tmp_path / "adapter", target_modules=r".*vision_tower.*\.q_proj")
    llm = LLM(str(tiny_gemma3_mm), max_model_len=256, dtype="float32", multiprocess=False, enable_lora=True,
              max_lora_rank=8)
    try:
        with pytest.raises(ValueError, match="belongs to Gemma3ForConditionalGeneration's vision encoder or projector"):
            llm.generate([{"prompt_token_ids": prompts_token_ids[0]}], SamplingParams(max_tokens=2),
                         lora_request=LoRARequest("vision", 1, str(adapter)), use_tqdm=False)
        assert run_greedy(llm, prompts_token_ids[:1]) == hf_greedy(tiny_gemma3_mm, prompts_token_ids[:1], NEW_TOKENS)
    finally:
        llm.shutdown()
