"""Image inputs of InternVL (InternVLForConditionalGeneration, InternVL3's transformers format):
an image cut by its processor into tiles of the encoder's size (here up to 4 by its aspect ratio,
and a thumbnail), each read by InternViT, pixel-shuffled and projected into 4 features; the
prompt's `<IMG_CONTEXT>` becomes `<img>`, every tile's placeholders, `</img>`. Greedy tokens equal
transformers' class on its image processor's pixel values, for InternViT's two forms (layer norms
with q/k/v biases; RMS norms with q/k RMS norms), under chunked prompts, preemption, prefix
caching, the torch attention backend, TP=2, mm_processor_kwargs and LLM.chat."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hf_reference import hf_greedy_with_images
from image_parity import assert_greedy_parity, image_schedules, references, text_prompts
from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.vision_config import read_image_encoder

NUM_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
IMAGE = "<IMG_CONTEXT>"
TEXTS = [f"the cat{IMAGE}of and", f"a{IMAGE}to the{IMAGE}in", f"{IMAGE}the"]
IMAGES_PER_TEXT = [[0], [1, 2], [2]]


@pytest.fixture(scope="module", params=["tiny_internvl_images", "tiny_internvl_rms_images"])
def internvl(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    """A wide, a tall and a small square image: 2 x 1 tiles and a thumbnail, 1 x 2 and a
    thumbnail, one tile."""
    rng = np.random.default_rng(5)
    return [Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8))
            for size in ((56, 112, 3), (110, 50, 3), (30, 30, 3))]


def processor_inputs(model: Path, text: str, pictures: list[Image.Image], **processor_args: int) -> dict:
    """What transformers' InternVLProcessor makes of the text and images: each `<IMG_CONTEXT>`
    becoming `<img>`, 4 placeholders per tile of its image, `</img>`; the tiles' pixel values."""
    from transformers import AutoImageProcessor, AutoTokenizer

    pixels = AutoImageProcessor.from_pretrained(model)(images=pictures, return_tensors="pt",
                                                       **{"crop_to_patches": True, **processor_args})
    pieces = text.split(IMAGE)
    expanded = pieces[0] + "".join(f"<img>{IMAGE * 4 * int(count)}</img>" + piece
                                   for count, piece in zip(pixels["num_patches"], pieces[1:]))
    ids = AutoTokenizer.from_pretrained(model)(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "pixel_values": pixels["pixel_values"], "num_patches": pixels["num_patches"]}


def hf_tokens(model: Path, inputs: dict) -> list[int]:
    return hf_greedy_with_images(model, inputs["input_ids"][0].tolist(), inputs["pixel_values"], NUM_TOKENS)


@pytest.fixture(scope="module")
def reference(internvl: Path, images: list[Image.Image]) -> list[tuple[list[int], list[int]]]:
    """(the processor's prompt ids, transformers' greedy tokens) per prompt."""
    return references(internvl, TEXTS, IMAGES_PER_TEXT, images, processor_inputs, hf_tokens)


def prompts(images: list[Image.Image]) -> list[dict]:
    return text_prompts(TEXTS, IMAGES_PER_TEXT, images)


def test_the_images_and_their_tiles_change_the_reference(internvl: Path, images: list[Image.Image],
                                                        reference: list) -> None:
    """Another image changes transformers' tokens, and so do the same images cut into fewer tiles."""
    inputs = processor_inputs(internvl, TEXTS[1], [images[0], images[2]])
    assert hf_tokens(internvl, inputs) != reference[1][1]
    assert processor_inputs(internvl, TEXTS[1], [images[1], images[2]])["num_patches"].tolist() == [3, 1]
    inputs = processor_inputs(internvl, TEXTS[1], [images[1], images[2]], max_patches=1)
    assert inputs["num_patches"].tolist() == [1, 1]
    assert hf_tokens(internvl, inputs) != reference[1][1]


@pytest.mark.parametrize("engine_args", image_schedules())
def test_greedy_tokens_equal_transformers(internvl: Path, images: list[Image.Image], reference: list,
                                          engine_args: dict) -> None:
    assert_greedy_parity(internvl, prompts(images), [ids for ids, _ in reference], [tokens for _, tokens in reference],
                         engine_args, GREEDY)


def test_prefix_cache_a_text_request_and_the_processor_kwargs(internvl: Path, images: list[Image.Image],
                                                              reference: list) -> None:
    """A prompt seen before reads its cached blocks; a text-only request beside images is
    unchanged; vLLM's mm_processor_kwargs reach the processor (max_patches=1: one tile an image)
    as they reach transformers'; a prompt already expanded is taken as it is."""
    text_only = {"prompt": "the cat of and a"}
    fewer = processor_inputs(internvl, TEXTS[1], [images[1], images[2]], max_patches=1)
    llm = make_llm(internvl, block_size=4)
    try:
        first = llm.generate(prompts(images)[:1], GREEDY, use_tqdm=False)
        again = llm.generate([*prompts(images), text_only], GREEDY, use_tqdm=False)
        [alone] = llm.generate([text_only], GREEDY, use_tqdm=False)
        [one_tile] = llm.generate([{**prompts(images)[1], "mm_processor_kwargs": {"max_patches": 1}}], GREEDY,
                                  use_tqdm=False)
        [given_expanded] = llm.generate([{"prompt_token_ids": reference[0][0],
                                          "multi_modal_data": {"image": [images[0]]}}], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert again[0].num_cached_tokens > 0
    assert list(first[0].outputs[0].token_ids) == reference[0][1]
    assert [list(out.outputs[0].token_ids) for out in again[:3]] == [tokens for _, tokens in reference]
    assert list(again[3].outputs[0].token_ids) == list(alone.outputs[0].token_ids)
    assert (list(one_tile.prompt_token_ids), list(one_tile.outputs[0].token_ids)) == (
        fewer["input_ids"][0].tolist(), hf_tokens(internvl, fewer))
    assert list(given_expanded.outputs[0].token_ids) == reference[0][1]


def test_chat_writes_the_image_token(internvl: Path, images: list[Image.Image]) -> None:
    """An image part in LLM.chat is written as the model's `<IMG_CONTEXT>` in the "string" content
    format, then expanded as the processor expands it."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": images[0]},
                                             {"type": "text", "text": "the cat"}]}]
    text = AutoTokenizer.from_pretrained(internvl).apply_chat_template(
        [{"role": "user", "content": f"{IMAGE}\nthe cat"}], tokenize=False, add_generation_prompt=True)
    inputs = processor_inputs(internvl, text, [images[0]])
    llm = make_llm(internvl)
    try:
        [output] = llm.chat(messages, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert list(output.prompt_token_ids) == inputs["input_ids"][0].tolist()
    assert list(output.outputs[0].token_ids) == hf_tokens(internvl, inputs)


def test_config_reading(internvl: Path) -> None:
    config = json.loads((internvl / "config.json").read_text())
    encoder = read_image_encoder(config)
    assert encoder.tiled and encoder.tile_frame == ("<img>", "</img>") and encoder.tokens_per_image == 4
    assert (encoder.image_size, encoder.patch_size, encoder.pixel_shuffle) == (56, 14, 2)

    def refused(match: str, outer: dict | None = None, **vision: object) -> None:
        with pytest.raises(ValueError, match=match):
            read_image_encoder({**config, **(outer or {}), "vision_config": {**config["vision_config"], **vision}})

    refused(r"image_seq_length=16 must be a tile's 4 features", {"image_seq_length": 16})
    refused(r"downsample_ratio=0.3 must be 1 / n", {"downsample_ratio": 0.3})
    refused(r"vision_feature_select_strategy='full' is not implemented", {"vision_feature_select_strategy": "full"})
    refused(r"vision_feature_layer=5 must name one hidden state of the 2-layer encoder", {"vision_feature_layer": 5})
    refused(r"norm_type='batch_norm' is not implemented", norm_type="batch_norm")
    refused(r"use_mean_pooling=False is not implemented", use_mean_pooling=False)
    refused(r"image_size=\[56, 28\] must be a positive square size", image_size=[56, 28])
