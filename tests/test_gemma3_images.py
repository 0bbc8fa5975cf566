"""Image inputs of Gemma 3 (Gemma3ForConditionalGeneration, Gemma 3 4B and up): a tiny SigLIP
encoder (two layers, 56 x 56 images: 4 x 4 patches) whose last hidden state is average-pooled to
4 features per image, beside a Gemma 3 decoder with a 3-token sliding window. An image's
placeholders attend to each other both ways in the prompt's forward pass (transformers'
token_type_ids mask, vLLM's "mm prefix LM"); greedy tokens equal transformers' multimodal class
given the token_type_ids its processor makes, under chunked prompts (a chunk never ends inside an
image), prefix caching, preemption and each CPU attention backend."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hf_reference import IMAGE_TOKEN_ID, hf_greedy_with_images
from image_parity import assert_greedy_parity, image_schedules
from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.config import EngineArgs

BOI, EOI = 997, 998  # the tiny vocabulary's "Try" and "Un" stand for <start_of_image> / <end_of_image>
NEWLINE = 201  # the tiny tokenizer writes Gemma 3's "\n\n" frame as two of these
TOKENS_PER_IMAGE = 4
NUM_TOKENS = 8
# one start-of-image token per image, as Gemma 3's chat template writes it
PROMPTS = [[5, 17, BOI, 33, 71], [9, BOI, 40, 41, BOI, 61, 7], [BOI, 3, 8]]
IMAGES_PER_PROMPT = [[0], [1, 2], [2]]
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3_images: Path) -> Path:
    return tiny_gemma3_images


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    rng = np.random.default_rng(1)
    return [Image.fromarray(rng.integers(0, 256, (48 + 16 * i, 80, 3), dtype=np.uint8)) for i in range(3)]


def expanded(prompt: list[int]) -> list[int]:
    """Gemma 3's processor's form: "\\n\\n<boi>" + 4 placeholders + "<eoi>\\n\\n" per image."""
    frame = [NEWLINE, NEWLINE]
    return [t for token in prompt
            for t in (frame + [BOI] + [IMAGE_TOKEN_ID] * TOKENS_PER_IMAGE + [EOI] + frame if token == BOI else [token])]


def hf_reference(model: Path, prompt: list[int], pictures: list[Image.Image], bidirectional: bool = True) -> list[int]:
    from transformers import AutoImageProcessor

    ids = expanded(prompt)
    pixels = AutoImageProcessor.from_pretrained(model)(images=pictures, return_tensors="pt")["pixel_values"]
    token_types = {"token_type_ids": (torch.tensor([ids]) == IMAGE_TOKEN_ID).long()} if bidirectional else {}
    return hf_greedy_with_images(model, ids, pixels, NUM_TOKENS, **token_types)


@pytest.fixture(scope="module")
def reference(gemma3: Path, images: list[Image.Image]) -> list[list[int]]:
    return [hf_reference(gemma3, prompt, [images[i] for i in which])
            for prompt, which in zip(PROMPTS, IMAGES_PER_PROMPT)]


def image_prompts(images: list[Image.Image]) -> list[dict]:
    return [{"prompt_token_ids": prompt, "multi_modal_data": {"image": [images[i] for i in which]}}
            for prompt, which in zip(PROMPTS, IMAGES_PER_PROMPT)]


def test_the_reference_depends_on_the_two_way_mask(gemma3: Path, images: list[Image.Image],
                                                  reference: list[list[int]]) -> None:
    """(The weights make the mask matter: a causal-only engine would fail the tests below.)"""
    causal = [hf_reference(gemma3, prompt, [images[i] for i in which], bidirectional=False)
              for prompt, which in zip(PROMPTS, IMAGES_PER_PROMPT)]
    assert all(a != b for a, b in zip(causal, reference))


# (chunks of 6 tokens: without whole images a chunk would end inside each prompt's first image;
# at TP=2 each rank's attention takes the images' key ends)
@pytest.mark.parametrize("engine_args", image_schedules(chunk=6, kv_blocks=9))
def test_greedy_tokens_equal_transformers(gemma3: Path, images: list[Image.Image], reference: list[list[int]],
                                          engine_args: dict) -> None:
    assert_greedy_parity(gemma3, image_prompts(images), [expanded(prompt) for prompt in PROMPTS], reference,
                         engine_args, GREEDY)


def test_a_prefix_cache_hit_inside_an_image(gemma3: Path, images: list[Image.Image],
                                            reference: list[list[int]]) -> None:
    """Blocks of 4 tokens: the second run's cached prefix ends inside the first image's
    placeholders; the rest of that image still attends the whole image."""
    llm = make_llm(gemma3, block_size=4, enable_prefix_caching=True)
    try:
        prompts = image_prompts(images)
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert again[0].num_cached_tokens > 0
        assert list(first[0].outputs[0].token_ids) == reference[0]
        assert [list(out.outputs[0].token_ids) for out in again] == reference
    finally:
        llm.shutdown()


def test_chat_writes_the_start_of_image_token(gemma3: Path, images: list[Image.Image]) -> None:
    """LLM.chat's "string" content format writes Gemma 3's start-of-image token for an image
    part, which the engine frames and expands as the processor does."""
    import base64
    import io

    buffer = io.BytesIO()
    images[0].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    template = ("{% for m in messages %}{{ m['role'] + ':' + m['content'] + '\\n' }}{% endfor %}"
                "{{ 'assistant:' }}")
    llm = make_llm(gemma3)
    try:
        [output] = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": "the"}]}],
                            GREEDY, chat_template=template, use_tqdm=False)
        tokenizer = llm.get_tokenizer()
    finally:
        llm.shutdown()
    prompt = tokenizer.encode("user:", add_special_tokens=False) + [BOI] + tokenizer.encode(
        "\nthe\nassistant:", add_special_tokens=False)
    assert list(output.prompt_token_ids) == expanded(prompt)
    assert list(output.outputs[0].token_ids) == hf_reference(gemma3, prompt, images[:1])


def test_newlines_merge_as_the_processor_tokenizes_them(gemma3: Path) -> None:
    """Gemma 3's processor frames each image with "\\n\\n" in the text, which merges with the
    newlines beside it into the tokenizer's multi-newline tokens: the token-level expansion
    gives the same tokens (here a tokenizer with a "\\n\\n" token of its own)."""
    from transformers import AutoTokenizer

    from vllm_lite.engine.image_inputs import PlaceholderExpansion
    from vllm_lite.vision_config import read_image_encoder

    tokenizer = AutoTokenizer.from_pretrained(gemma3)
    tokenizer.add_tokens(["\n\n"])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<boi>", "<img>", "<eoi>"]})
    boi, img, eoi = tokenizer.convert_tokens_to_ids(["<boi>", "<img>", "<eoi>"])
    outer = json.loads((gemma3 / "config.json").read_text())
    config = read_image_encoder({**outer, "boi_token_index": boi, "eoi_token_index": eoi, "image_token_index": img})
    expansion = PlaceholderExpansion(config, tokenizer)
    full = "\n\n<boi>" + "<img>" * TOKENS_PER_IMAGE + "<eoi>\n\n"
    for text in ["the\n<boi>of", "<boi><boi>", "a\n\n<boi>\nand", "<boi>\n\n\nto"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        lengths = np.full(text.count("<boi>"), TOKENS_PER_IMAGE)
        ours, offsets = expansion.expand(ids, lengths)
        assert ours == tokenizer.encode(text.replace("<boi>", full), add_special_tokens=False), text
        assert [ours[offset:offset + TOKENS_PER_IMAGE] for offset in offsets.tolist()] == [[img] * 4] * len(lengths)


def test_what_cannot_be_honoured_is_refused_by_name(gemma3: Path, images: list[Image.Image],
                                                   tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens=3 is smaller than an image's 4 tokens"):
        EngineArgs(model=str(gemma3), max_num_batched_tokens=3).create_engine_config()
    from transformers import Gemma3ImageProcessor

    model = tmp_path / "pan_and_scan"
    shutil.copytree(gemma3, model)
    Gemma3ImageProcessor(size={"height": 56, "width": 56}, do_pan_and_scan=True).save_pretrained(model)
    llm = make_llm(model)
    try:
        with pytest.raises(ValueError, match="do_pan_and_scan=True"):
            llm.generate(image_prompts(images)[:1], GREEDY, use_tqdm=False)
        [output] = llm.generate([{"prompt_token_ids": [5, 17, 33]}], GREEDY, use_tqdm=False)  # (the engine still answers)
        assert len(output.outputs[0].token_ids) == NUM_TOKENS
    finally:
        llm.shutdown()
