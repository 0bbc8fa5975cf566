"""Image inputs of SmolVLM (SmolVLMForConditionalGeneration; Idefics3 is the same form): each
image cut by its processor into up to 2 x 2 tiles beside the whole image, every tile a 56 x 56
encoder input whose last hidden state is pixel-shuffled into 4 features, each its own run of
`<image>` placeholders between the processor's `<fake_token_around_image><row_r_col_c>` tokens.
Prompts expand as transformers' SmolVLMProcessor expands them, and greedy tokens equal
transformers' SmolVLMForConditionalGeneration on that processor's pixel values, under chunked
prompts, preemption, prefix caching, TP=2 and LLM.chat (the server: tests/entrypoints/test_image_server.py)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hf_reference import hf_greedy_with_images
from image_parity import assert_greedy_parity, image_schedules
from llm_factory import make_llm
from vllm_lite import SamplingParams

NUM_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
# text prompts with SmolVLM's `<image>` where each image goes; images of 2 x 2, 1 x 2 and 2 x 1
# tiles (by their aspect ratio) beside their whole image
TEXTS = ["the cat<image>of and", "a<image>to the<image>in", "<image>the"]
IMAGES_PER_TEXT = [[0], [1, 2], [2]]


@pytest.fixture(scope="module")
def smolvlm(tiny_smolvlm_images: Path) -> Path:
    return tiny_smolvlm_images


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    rng = np.random.default_rng(2)
    return [Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8))
            for size in ((80, 80, 3), (40, 100, 3), (100, 30, 3))]


def processor_inputs(model: Path, text: str, pictures: list[Image.Image]) -> dict:
    """What transformers' SmolVLMProcessor makes of the text and images (its class needs
    torchvision for videos: here its image processor and its own prompt-string function, each
    `<image>` of the text replaced by its image's string, then tokenized)."""
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    pixels = AutoImageProcessor.from_pretrained(model)(images=pictures, return_tensors="pt",
                                                       return_row_col_info=True)
    pieces = text.split("<image>")
    strings = [get_image_prompt_string(rows, columns, 4, "<fake_token_around_image>", "<image>",
                                       "<global-img>") for rows, columns in zip(pixels["rows"][0], pixels["cols"][0])]
    expanded = pieces[0] + "".join(string + piece for string, piece in zip(strings, pieces[1:]))
    ids = AutoTokenizer.from_pretrained(model)(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "pixel_values": pixels["pixel_values"],
            "pixel_attention_mask": pixels["pixel_attention_mask"]}


@pytest.fixture(scope="module")
def reference(smolvlm: Path, images: list[Image.Image]) -> list[tuple[list[int], list[int]]]:
    """(the processor's prompt ids, transformers' greedy tokens) per prompt."""
    out = []
    for text, which in zip(TEXTS, IMAGES_PER_TEXT):
        inputs = processor_inputs(smolvlm, text, [images[i] for i in which])
        ids = inputs["input_ids"][0].tolist()
        out.append((ids, hf_greedy_with_images(smolvlm, ids, inputs["pixel_values"], NUM_TOKENS,
                                               pixel_attention_mask=inputs["pixel_attention_mask"])))
    return out


def prompts(images: list[Image.Image]) -> list[dict]:
    return [{"prompt": text, "multi_modal_data": {"image": [images[i] for i in which]}}
            for text, which in zip(TEXTS, IMAGES_PER_TEXT)]


def test_the_images_change_the_reference(smolvlm: Path, images: list[Image.Image], reference: list) -> None:
    inputs = processor_inputs(smolvlm, TEXTS[0], [images[1]])
    ids = inputs["input_ids"][0].tolist()
    other = hf_greedy_with_images(smolvlm, ids, inputs["pixel_values"], NUM_TOKENS,
                                  pixel_attention_mask=inputs["pixel_attention_mask"])
    assert other != reference[0][1]


@pytest.mark.parametrize("engine_args", image_schedules(kv_blocks=16))
def test_greedy_tokens_equal_transformers(smolvlm: Path, images: list[Image.Image], reference: list,
                                          engine_args: dict) -> None:
    assert_greedy_parity(smolvlm, prompts(images), [ids for ids, _ in reference], [tokens for _, tokens in reference],
                         engine_args, GREEDY)


def test_prefix_cache_and_encoder_cache_reuse(smolvlm: Path, images: list[Image.Image], reference: list) -> None:
    """A prompt seen before reads its cached blocks (tiles hashed by their image and place); the
    same images in another prompt are not encoded again."""
    llm = make_llm(smolvlm, block_size=4)
    try:
        first = llm.generate(prompts(images)[:1], GREEDY, use_tqdm=False)
        again = llm.generate(prompts(images), GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert again[0].num_cached_tokens > 0
    assert list(first[0].outputs[0].token_ids) == reference[0][1]
    assert [list(out.outputs[0].token_ids) for out in again] == [tokens for _, tokens in reference]


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_chat_writes_the_image_token(smolvlm: Path, images: list[Image.Image]) -> None:
    """An image part in LLM.chat is written as `<image>` (the "string" content format) and
    expanded as the processor expands it."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(images[1])}},
                                             {"type": "text", "text": "the cat"}]}]
    text = AutoTokenizer.from_pretrained(smolvlm).apply_chat_template(
        [{"role": "user", "content": "<image>\nthe cat"}], tokenize=False, add_generation_prompt=True)
    inputs = processor_inputs(smolvlm, text, [images[1]])
    ids = inputs["input_ids"][0].tolist()
    llm = make_llm(smolvlm)
    try:
        [output] = llm.chat(messages, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert list(output.prompt_token_ids) == ids
    assert list(output.outputs[0].token_ids) == hf_greedy_with_images(
        smolvlm, ids, inputs["pixel_values"], NUM_TOKENS, pixel_attention_mask=inputs["pixel_attention_mask"])
