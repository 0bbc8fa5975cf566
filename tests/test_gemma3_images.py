"""Image inputs of Gemma 3 (Gemma3ForConditionalGeneration, Gemma 3 4B and up): a tiny SigLIP
encoder (two layers, 56 x 56 images: 4 x 4 patches) whose last hidden state is average-pooled to
4 features per image, beside a Gemma 3 decoder with a 3-token sliding window. An image's
placeholders attend to each other both ways in the prompt's forward pass (transformers'
token_type_ids mask, vLLM's "mm prefix LM"); greedy tokens equal transformers' multimodal class
given the token_type_ids its processor makes, under chunked prompts (a chunk never ends inside an
image), prefix caching, preemption and each CPU attention backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from hf_reference import IMAGE_TOKEN_ID, hf_greedy_with_images
from image_parity import assert_greedy_parity, assert_prefix_cache_hit_inside_an_image, image_schedules
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
    assert_prefix_cache_hit_inside_an_image(gemma3, image_prompts(images), reference, GREEDY)


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


def special_token_expansion(gemma3: Path) -> tuple[Any, Any, int]:
    """(tokenizer, its PlaceholderExpansion, the placeholder id) for a tokenizer with a "\n\n"
    token and special <boi>, <img>, <eoi> tokens, as Gemma 3's has."""
    from transformers import AutoTokenizer

    from vllm_lite.engine.image_inputs import PlaceholderExpansion
    from vllm_lite.vision_config import read_image_encoder

    tokenizer = AutoTokenizer.from_pretrained(gemma3)
    tokenizer.add_tokens(["\n\n"])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<boi>", "<img>", "<eoi>"]})
    boi, img, eoi = tokenizer.convert_tokens_to_ids(["<boi>", "<img>", "<eoi>"])
    outer = json.loads((gemma3 / "config.json").read_text())
    config = read_image_encoder({**outer, "boi_token_index": boi, "eoi_token_index": eoi, "image_token_index": img})
    return tokenizer, PlaceholderExpansion(config, tokenizer), img


def test_newlines_merge_as_the_processor_tokenizes_them(gemma3: Path) -> None:
    """Gemma 3's processor frames each image with "\\n\\n" in the text, which merges with the
    newlines beside it into the tokenizer's multi-newline tokens: the token-level expansion
    gives the same tokens (here a tokenizer with a "\\n\\n" token of its own)."""
    tokenizer, expansion, img = special_token_expansion(gemma3)
    full = "\n\n<boi>" + "<img>" * TOKENS_PER_IMAGE + "<eoi>\n\n"
    for text in ["the\n<boi>of", "<boi><boi>", "a\n\n<boi>\nand", "<boi>\n\n\nto"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        lengths = np.full(text.count("<boi>"), TOKENS_PER_IMAGE)
        ours, offsets = expansion.expand(ids, lengths)
        assert ours == tokenizer.encode(text.replace("<boi>", full), add_special_tokens=False), text
        assert [ours[offset:offset + TOKENS_PER_IMAGE] for offset in offsets.tolist()] == [[img] * 4] * len(lengths)


def test_what_cannot_be_honoured_is_refused_by_name(gemma3: Path) -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens=3 is smaller than an image's 4 tokens"):
        EngineArgs(model=str(gemma3), max_num_batched_tokens=3).create_engine_config()


def test_pan_and_scan_text_as_the_processor_writes_it(gemma3: Path) -> None:
    """vLLM's do_pan_and_scan: an image with crops is written as transformers' Gemma3Processor
    writes it ("Here is the original image", the framed image, "and here are some crops to help
    you see better", each crop framed, space-separated), the text between special tokens
    tokenized whole as the processor's text is (a tokenizer with special image tokens)."""
    tokenizer, expansion, img = special_token_expansion(gemma3)
    full = "\n\n<boi>" + "<img>" * TOKENS_PER_IMAGE + "<eoi>\n\n"

    def processor_text(crops: int) -> str:  # (transformers' Gemma3Processor.replace_image_token)
        if not crops:
            return full
        return (f"Here is the original image {full} and here are some crops to help you see better "
                + " ".join([full] * crops))

    for text, crops in [("the\n<boi>of", [2]), ("<boi> and <boi>\n", [0, 3]), ("a\n\n<boi>\nto", [1])]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        ours, offsets = expansion.expand_framed(ids, crops)
        pieces = text.split("<boi>")
        wanted = pieces[0] + "".join(processor_text(count) + piece for count, piece in zip(crops, pieces[1:]))
        assert ours == tokenizer.encode(wanted, add_special_tokens=False), text
        assert len(offsets) == len(crops) + sum(crops)
        assert all(ours[offset:offset + TOKENS_PER_IMAGE] == [img] * TOKENS_PER_IMAGE for offset in offsets.tolist())


def test_pan_and_scan_crops_equal_transformers(gemma3: Path, images: list[Image.Image]) -> None:
    """vLLM's do_pan_and_scan (mm_processor_kwargs, as its Gemma 3 example passes it): a wide
    image's crops are read as images of their own, each framed and attending within itself both
    ways, as transformers' class reads its processor's pixel values; a request without it, on
    the same engine, is not cut."""
    from transformers import AutoImageProcessor, AutoTokenizer, Gemma3Processor

    pan = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8}
    wide = images[0].resize((150, 50))
    # (what transformers' Gemma3Processor gives its image processor: its defaults, then the request's)
    pixels = AutoImageProcessor.from_pretrained(gemma3)(images=[wide], return_tensors="pt",
                                                        **{**Gemma3Processor.images_kwargs, **pan})
    crops = int(pixels["num_crops"][0])
    assert crops == 3
    tokenizer = AutoTokenizer.from_pretrained(gemma3)
    frame = [NEWLINE, NEWLINE]
    image = [BOI] + [IMAGE_TOKEN_ID] * TOKENS_PER_IMAGE + [EOI]
    prompt = [5, 17, BOI, 33, 71]
    text = tokenizer.encode
    ids = ([5, 17] + text("Here is the original image \n\n", add_special_tokens=False) + image
           + text("\n\n and here are some crops to help you see better \n\n", add_special_tokens=False) + image
           + (text("\n\n \n\n", add_special_tokens=False) + image) * (crops - 1) + frame + [33, 71])
    token_types = (torch.tensor([ids]) == IMAGE_TOKEN_ID).long()
    wanted = hf_greedy_with_images(gemma3, ids, pixels["pixel_values"], NUM_TOKENS, token_type_ids=token_types)
    llm = make_llm(gemma3, max_num_batched_tokens=16, enable_chunked_prefill=True)
    try:
        [cut] = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": [wide]},
                               "mm_processor_kwargs": pan}], GREEDY, use_tqdm=False)
        [whole] = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": [wide]}}], GREEDY,
                               use_tqdm=False)
    finally:
        llm.shutdown()
    assert (list(cut.prompt_token_ids), list(cut.outputs[0].token_ids)) == (ids, wanted)
    assert list(whole.prompt_token_ids) == expanded(prompt)
    assert list(whole.outputs[0].token_ids) == hf_reference(gemma3, prompt, [wide])
