"""Image inputs of Qwen2-VL (Qwen2VLForConditionalGeneration), Qwen2.5-VL
(Qwen2_5_VLForConditionalGeneration, whose vision blocks attend within windows but for its
full-attention ones) and Qwen3-VL (Qwen3VLForConditionalGeneration: 16-pixel patches, a learned
position grid, DeepStack additions to the first decoder layers' states, interleaved M-RoPE
sections): an image of any size read as its
processor's 14-pixel patches (here 4 to 16 merged 2 x 2 squares: one placeholder each) by a
vision transformer with 2-D rotary positions, and the placeholders given multimodal rotary
positions (M-RoPE: temporal, height, width) in the language model, the tokens after an image
shifted back as transformers' get_rope_index lays them out. Greedy tokens equal transformers'
classes on their image processor's pixel values, under chunked prompts,
preemption, prefix caching, the torch attention backend, TP=2 and LLM.chat."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from checkpoint_copies import edit_json, edited_copy
from hf_reference import hf_greedy_with_images
from image_parity import assert_greedy_parity, image_schedules, references, text_prompts
from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.vision_config import read_image_encoder

NUM_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
TEXTS = [f"the cat{IMAGE}of and", f"a{IMAGE}to the{IMAGE}in", f"{IMAGE}the"]
IMAGES_PER_TEXT = [[0], [1, 2], [2]]


@pytest.fixture(scope="module", params=["tiny_qwen2_vl_images", "tiny_qwen2_5_vl_images", "tiny_qwen3_vl_images"])
def qwen2_vl(request: pytest.FixtureRequest) -> Path:
    """Qwen2-VL, Qwen2.5-VL (its vision blocks: RMS norms, gated MLPs, windows) and Qwen3-VL
    (16-pixel patches, a learned position grid, DeepStack, interleaved M-RoPE)."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    """A wide, a tall and a small square image: grids of 4 x 8, 8 x 4 and (upscaled) 4 x 4 patches."""
    rng = np.random.default_rng(3)
    return [Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8))
            for size in ((56, 112, 3), (110, 50, 3), (30, 30, 3))]


def processor_inputs(model: Path, text: str, pictures: list[Image.Image]) -> dict:
    """What transformers' Qwen2VLProcessor makes of the text and images: each `<|image_pad|>`
    repeated once per merged square of its image's patches, the text tokenized; the image
    processor's pixel values and grids; the token types M-RoPE reads."""
    from transformers import AutoImageProcessor, AutoTokenizer

    pixels = AutoImageProcessor.from_pretrained(model)(images=pictures, return_tensors="pt")
    counts = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
    pieces = text.split("<|image_pad|>")
    expanded = pieces[0] + "".join("<|image_pad|>" * count + piece for count, piece in zip(counts, pieces[1:]))
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return {"input_ids": ids, "pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"],
            "mm_token_type_ids": (ids == image_token).int()}


def hf_tokens(model: Path, inputs: dict) -> list[int]:
    return hf_greedy_with_images(model, inputs["input_ids"][0].tolist(), inputs["pixel_values"], NUM_TOKENS,
                                 image_grid_thw=inputs["image_grid_thw"],
                                 mm_token_type_ids=inputs["mm_token_type_ids"])


@pytest.fixture(scope="module")
def reference(qwen2_vl: Path, images: list[Image.Image]) -> list[tuple[list[int], list[int]]]:
    """(the processor's prompt ids, transformers' greedy tokens) per prompt."""
    return references(qwen2_vl, TEXTS, IMAGES_PER_TEXT, images, processor_inputs, hf_tokens)


def prompts(images: list[Image.Image]) -> list[dict]:
    return text_prompts(TEXTS, IMAGES_PER_TEXT, images)


def test_the_images_and_their_positions_change_the_reference(qwen2_vl: Path, images: list[Image.Image],
                                                            reference: list) -> None:
    """Another image changes transformers' tokens, and so does reading the image's placeholders
    at plain positions (M-RoPE off): both are seen by the parity tests below."""
    inputs = processor_inputs(qwen2_vl, TEXTS[1], [images[0], images[2]])
    assert hf_tokens(qwen2_vl, inputs) != reference[1][1]
    inputs = processor_inputs(qwen2_vl, TEXTS[1], [images[1], images[2]])
    plain = hf_greedy_with_images(qwen2_vl, inputs["input_ids"][0].tolist(), inputs["pixel_values"], NUM_TOKENS,
                                  image_grid_thw=inputs["image_grid_thw"],
                                  mm_token_type_ids=torch.zeros_like(inputs["mm_token_type_ids"]))
    assert plain != reference[1][1]


@pytest.mark.parametrize("engine_args", image_schedules())
def test_greedy_tokens_equal_transformers(qwen2_vl: Path, images: list[Image.Image], reference: list,
                                          engine_args: dict) -> None:
    assert_greedy_parity(qwen2_vl, prompts(images), [ids for ids, _ in reference], [tokens for _, tokens in reference],
                         engine_args, GREEDY)


def test_prefix_cache_and_a_text_request_beside_images(qwen2_vl: Path, images: list[Image.Image],
                                                       reference: list) -> None:
    """A prompt seen before reads its cached blocks (its positions are the prompt's own); a
    text-only request in the same batch keeps plain positions."""
    text_only = {"prompt": "the cat of and a"}
    llm = make_llm(qwen2_vl, block_size=4)
    try:
        first = llm.generate(prompts(images)[:1], GREEDY, use_tqdm=False)
        again = llm.generate([*prompts(images), text_only], GREEDY, use_tqdm=False)
        [alone] = llm.generate([text_only], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert again[0].num_cached_tokens > 0
    assert list(first[0].outputs[0].token_ids) == reference[0][1]
    assert [list(out.outputs[0].token_ids) for out in again[:3]] == [tokens for _, tokens in reference]
    assert list(again[3].outputs[0].token_ids) == list(alone.outputs[0].token_ids)


def test_chat_writes_the_vision_tokens(qwen2_vl: Path, images: list[Image.Image]) -> None:
    """An image part in LLM.chat is written as vLLM writes Qwen2-VL's (vision start, image pad,
    vision end) in the "string" content format, and expanded as the processor expands it."""
    import base64
    import io

    from transformers import AutoTokenizer

    buffer = io.BytesIO()
    images[0].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "the cat"}]}]
    text = AutoTokenizer.from_pretrained(qwen2_vl).apply_chat_template(
        [{"role": "user", "content": f"{IMAGE}\nthe cat"}], tokenize=False, add_generation_prompt=True)
    inputs = processor_inputs(qwen2_vl, text, [images[0]])
    llm = make_llm(qwen2_vl)
    try:
        [output] = llm.chat(messages, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert list(output.prompt_token_ids) == inputs["input_ids"][0].tolist()
    assert list(output.outputs[0].token_ids) == hf_tokens(qwen2_vl, inputs)


def test_the_engine_core_refuses_patches_a_step_could_not_take(qwen2_vl: Path, images: list[Image.Image]) -> None:
    """What another client could send the engine core (request_checks.py): patches that do not
    fill their grid, a grid of no whole merged squares, lengths that are not the grid's."""
    import msgspec

    from vllm_lite.config import EngineArgs
    from vllm_lite.engine.input_processor import InputProcessor
    from vllm_lite.engine.request_checks import check_request

    model_config = EngineArgs(model=str(qwen2_vl), dtype="float32",
                              max_model_len=256).create_engine_config().model_config
    from transformers import AutoTokenizer

    processor = InputProcessor(model_config, AutoTokenizer.from_pretrained(qwen2_vl))
    _, _, good = processor.process_prompt("r", prompts(images)[1], GREEDY)
    check_request(good, model_config)
    grids = good.images.patch_grids
    assert grids.tolist() == processor_inputs(qwen2_vl, TEXTS[1], [images[1], images[2]])["image_grid_thw"][:, 1:].tolist()
    values = model_config.image_encoder.patch_values

    def refused(match: str, **images_fields: object) -> None:
        bad = msgspec.structs.replace(good, images=msgspec.structs.replace(good.images, **images_fields))
        with pytest.raises(ValueError, match=match):
            check_request(bad, model_config)

    refused(rf"float32 \[n, patches, {values}\] with each image's \(rows, columns\) of patches, multiples of 2",
            patch_grids=np.array([[8, 6], [4, 4]]))
    refused("multiples of 2", patch_grids=np.array([[7, 4], [4, 4]]))
    refused("multiples of 2", patch_grids=None)
    refused("multiples of 2", pixel_values=good.images.pixel_values[:, :, :100].copy())
    refused("each image's length must be the features it becomes", lengths=np.array([4, 8]))


def test_config_reading(qwen2_vl: Path) -> None:
    import json

    config = json.loads((qwen2_vl / "config.json").read_text())
    encoder = read_image_encoder(config)
    qwen3 = config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert encoder.mrope and encoder.mrope_section == (2, 3, 3) and encoder.spatial_merge == 2
    assert encoder.patch_values == 3 * 2 * encoder.patch_size ** 2 == (1536 if qwen3 else 1176)
    assert encoder.mrope_interleaved == qwen3

    def rope_with(**fields: object) -> dict:
        return {**config, "text_config": {**config["text_config"],
                                          "rope_parameters": {**config["text_config"]["rope_parameters"], **fields}}}

    def vision_with(**fields: object) -> dict:
        return {**config, "vision_config": {**config["vision_config"], **fields}}

    with pytest.raises(ValueError, match=r"mrope_section=\[2, 2, 2\] must be three parts of the language model's 8"):
        read_image_encoder(rope_with(mrope_section=[2, 2, 2]))
    with pytest.raises(ValueError, match=f"mrope_interleaved={not qwen3} is not implemented"):
        read_image_encoder(rope_with(mrope_interleaved=not qwen3))
    if not qwen3:
        with pytest.raises(ValueError, match=r"vision_config fields \['deepstack_visual_indexes'\] are not implemented"):
            read_image_encoder(vision_with(deepstack_visual_indexes=[0]))
        return
    assert (encoder.position_embeddings, encoder.deepstack_blocks) == (16, (0, 2))
    for indexes in ([0, 0], [3], [0, 1, 2]):  # (a block twice, no such block, more than the decoder's 2 layers)
        with pytest.raises(ValueError, match=r"deepstack_visual_indexes=.* must name distinct blocks of the 3-block"):
            read_image_encoder(vision_with(deepstack_visual_indexes=indexes))
    with pytest.raises(ValueError, match="num_position_embeddings=15 must be a square"):
        read_image_encoder(vision_with(num_position_embeddings=15))
    if encoder.windowed:
        assert (encoder.window_size, encoder.full_attention_blocks) == (56, (1,))
        broken = {**config, "vision_config": {**config["vision_config"], "window_size": 40}}
        with pytest.raises(ValueError, match="window_size=40 must be a multiple of a merged square's 28 pixels"):
            read_image_encoder(broken)


def _reference_with(model: Path, text: str, pictures: list[Image.Image], **processor_args: int) -> tuple[list, list]:
    """(prompt ids, transformers' tokens) with the image processor given `processor_args`."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(model)
    size = {**dict(processor.size), "longest_edge": processor_args["max_pixels"]}
    pixels = processor(images=pictures, return_tensors="pt", size=size)
    counts = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
    pieces = text.split("<|image_pad|>")
    expanded = pieces[0] + "".join("<|image_pad|>" * count + piece for count, piece in zip(counts, pieces[1:]))
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
    inputs = {"input_ids": ids, "pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"],
              "mm_token_type_ids": (ids == 1001).int()}
    return ids[0].tolist(), hf_tokens(model, inputs)


def test_mm_processor_kwargs_of_the_engine_and_of_a_request(qwen2_vl: Path, images: list[Image.Image],
                                                            reference: list) -> None:
    """vLLM's mm_processor_kwargs: the engine's for every request (Qwen2-VL's max_pixels: fewer
    patches), a request's own over them (in its prompt, or given to generate / chat); an image
    seen with other arguments is processed again (not taken from the processor cache); an
    argument the processor does not take is refused by name and the engine goes on."""
    model = qwen2_vl
    small = 28 * 28 * 6
    text, pictures = TEXTS[0], [images[0]]
    wanted = _reference_with(model, text, pictures, max_pixels=small)
    assert len(wanted[0]) < len(reference[0][0])
    llm = make_llm(model, mm_processor_kwargs={"max_pixels": small})
    try:
        [engine_level] = llm.generate(prompts(images)[:1], GREEDY, use_tqdm=False)
        [overridden] = llm.generate([{**prompts(images)[0], "mm_processor_kwargs": {"max_pixels": 28 * 28 * 16}}],
                                    GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match=r"mm_processor_kwargs \['bogus', 'max_pixels'\]: the image processor .* does not take "
                                             r"them: .*'bogus'"):
            llm.generate([{**prompts(images)[0], "mm_processor_kwargs": {"bogus": 1}}], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="mm_processor_kwargs must be a dict of the image processor's keyword"):
            llm.generate([{"prompt": "the cat", "mm_processor_kwargs": "max_pixels=1"}], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match=r"mm_processor_kwargs: \['return_tensors'\] are the engine's"):
            llm.generate(prompts(images)[:1], GREEDY, use_tqdm=False, mm_processor_kwargs={"return_tensors": "pt"})
    finally:
        llm.shutdown()
    assert (list(engine_level.prompt_token_ids), list(engine_level.outputs[0].token_ids)) == wanted
    # an engine argument the processor does not take: refused as the engine starts, its core stopped
    with pytest.raises(ValueError, match=r"mm_processor_kwargs=\{'bogus': 1\}: .*does not take them"):
        make_llm(model, mm_processor_kwargs={"bogus": 1}, multiprocess=True)
    assert not multiprocessing.active_children()
    assert (list(overridden.prompt_token_ids), list(overridden.outputs[0].token_ids)) == tuple(reference[0])
    llm = make_llm(model)
    try:
        [plain] = llm.generate(prompts(images)[:1], GREEDY, use_tqdm=False)
        [call_level] = llm.generate(prompts(images)[:1], GREEDY, use_tqdm=False,
                                    mm_processor_kwargs={"max_pixels": small})
        [chatted] = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": images[0]},
                                                           {"type": "text", "text": "the cat"}]}],
                             GREEDY, use_tqdm=False, mm_processor_kwargs={"max_pixels": small})
    finally:
        llm.shutdown()
    assert list(plain.outputs[0].token_ids) == reference[0][1]
    assert (list(call_level.prompt_token_ids), list(call_level.outputs[0].token_ids)) == wanted
    assert list(chatted.prompt_token_ids).count(1001) == wanted[0].count(1001)


@pytest.mark.parametrize("section", [(2, 3, 3), (3, 3, 2)])
def test_interleaved_mrope_turns_each_pair_as_transformers(section: tuple[int, int, int]) -> None:
    """Qwen3-VL's interleaved M-RoPE sections (height on pairs 1, 4, ..., width on 2, 5, ...
    within their spans, temporal elsewhere): our rotary layer's rotation of [3, T] positions is
    transformers' Qwen3VLTextRotaryEmbedding's, and differs from the contiguous sections'."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding, apply_rotary_pos_emb

    from vllm_lite.model.layers.rotary import RotaryEmbedding, use_mrope

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(section), "mrope_interleaved": True}
    config = Qwen3VLTextConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=rope)
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 60, (3, 7), generator=generator)
    query, key = torch.randn(7, 2, 16, generator=generator), torch.randn(7, 1, 16, generator=generator)
    cos, sin = Qwen3VLTextRotaryEmbedding(config)(query, positions[:, None, :])
    want_query, want_key = apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin)

    def ours(interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
        layer = RotaryEmbedding(16, 64, 10000.0, None)
        use_mrope(layer, section, interleaved)
        return layer(positions, query.clone(), key.clone())

    got_query, got_key = ours(interleaved=True)
    torch.testing.assert_close(got_query, want_query[0].transpose(0, 1))
    torch.testing.assert_close(got_key, want_key[0].transpose(0, 1))
    assert not torch.allclose(ours(interleaved=False)[0], got_query, atol=1e-3)


@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 8, "enable_chunked_prefill": True},
    {"multiprocess": True, "tensor_parallel_size": 2},  # (each rank's slice of the stacked experts)
])
def test_qwen3_vl_moe_greedy_tokens_equal_transformers(tiny_qwen3_vl_moe_images: Path, images: list[Image.Image],
                                                       engine_args: dict) -> None:
    """Qwen3-VL-MoE: Qwen3-VL's vision side beside a Qwen3-MoE decoder whose experts its
    checkpoint stacks ([experts, in, out] tensors per layer)."""
    model = tiny_qwen3_vl_moe_images
    wanted = references(model, TEXTS, IMAGES_PER_TEXT, images, processor_inputs, hf_tokens)
    llm = make_llm(model, **engine_args)
    try:
        outputs = llm.generate(prompts(images), GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [(list(out.prompt_token_ids), list(out.outputs[0].token_ids)) for out in outputs] == wanted


def test_qwen3_vl_moe_stacked_experts_are_read_as_its_checkpoints_hold_them(tiny_qwen3_vl_moe: Path,
                                                                            tmp_path: Path) -> None:
    """A stacked experts tensor in another layout (transformers' in-memory [experts, out, in]) is
    refused naming its shape, and a text config whose router would not renormalize (transformers'
    Qwen3-VL-MoE always does) is refused naming the field."""
    from safetensors.torch import load_file, save_file

    from vllm_lite.config import EngineArgs

    model = edited_copy(tiny_qwen3_vl_moe, tmp_path / "model",
                        lambda config: config["text_config"].update(norm_topk_prob=False))
    with pytest.raises(ValueError, match="text_config.norm_topk_prob=False is not supported for "
                                         "Qwen3VLMoeForConditionalGeneration"):
        EngineArgs(model=str(model), dtype="float32").create_engine_config()
    edit_json(model / "config.json", lambda config: config["text_config"].update(norm_topk_prob=True))
    tensors = load_file(str(model / "model.safetensors"))
    name = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"stacked experts' gate_up tensor of shape \[4, 48, 64\]: expected \[4, 64, 48\]"):
        make_llm(model)
