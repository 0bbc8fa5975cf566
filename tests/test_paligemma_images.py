"""Image inputs of PaliGemma (PaliGemmaForConditionalGeneration: PaliGemma 1 on Gemma, PaliGemma 2
on Gemma 2): a tiny SigLIP encoder (two layers, 56 x 56 images: 16 features each) whose last
hidden state is projected by one linear layer. A prompt is its processor's: the image's
placeholders first, then the bos token, the text and a newline; the image's placeholders attend
to each other both ways in the prompt's forward pass (vLLM's "mm prefix LM"; transformers'
token_type_ids mask with the placeholders marked). Greedy tokens equal transformers' multimodal
class under chunked prompts, preemption, prefix caching, the torch backend and TP=2; prompt ids
equal its processor's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from checkpoint_copies import edited_copy
from hf_reference import hf_greedy_with_images
from image_parity import assert_greedy_parity, assert_prefix_cache_hit_inside_an_image, image_schedules
from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.config import EngineArgs

IMAGE = 1000  # the tokenizer's `<image>` (conftest.py)
TOKENS_PER_IMAGE = 16
NUM_TOKENS = 8
TEXTS = ["the cat", "caption en\n", ""]
PROMPT_IDS = [[5, 17, 33, 71], [9, 40, 41, 61, 7], [3]]
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["paligemma", "paligemma2"])
def model(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_images")


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    rng = np.random.default_rng(1)
    return [Image.fromarray(rng.integers(0, 256, (48 + 16 * i, 80, 3), dtype=np.uint8)) for i in range(3)]


def tokenizer_of(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def processor_of(model: Path) -> Any:
    """transformers' PaliGemmaProcessor over the checkpoint's tokenizer and image processor (its
    image_seq_length: the encoder's 16 features)."""
    from transformers import AutoImageProcessor, PaliGemmaProcessor

    image_processor = AutoImageProcessor.from_pretrained(model)
    image_processor.image_seq_length = TOKENS_PER_IMAGE
    return PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer_of(model))


def processed(model: Path, prompt: list[int]) -> list[int]:
    """The processor's form of a prompt of token ids: placeholders, bos, the ids, a newline."""
    tokenizer = tokenizer_of(model)
    return ([IMAGE] * TOKENS_PER_IMAGE + [tokenizer.bos_token_id] + prompt
            + tokenizer.encode("\n", add_special_tokens=False))


def hf_reference(model: Path, ids: list[int], image: Image.Image, two_way: bool = True) -> list[int]:
    """transformers' greedy tokens, the image's placeholders marked as its two-way block (`two_way`;
    else causal throughout)."""
    from transformers import AutoImageProcessor

    pixels = AutoImageProcessor.from_pretrained(model)(images=[image], return_tensors="pt")["pixel_values"]
    token_types = {"token_type_ids": (torch.tensor([ids]) != IMAGE).long()} if two_way else {}
    return hf_greedy_with_images(model, ids, pixels, NUM_TOKENS, **token_types)


@pytest.fixture(scope="module")
def reference(model: Path, images: list[Image.Image]) -> list[list[int]]:
    return [hf_reference(model, processed(model, prompt), image) for prompt, image in zip(PROMPT_IDS, images)]


def image_prompts(images: list[Image.Image]) -> list[dict]:
    return [{"prompt_token_ids": prompt, "multi_modal_data": {"image": image}}
            for prompt, image in zip(PROMPT_IDS, images)]


def test_the_reference_depends_on_the_image_and_the_two_way_mask(model: Path, images: list[Image.Image],
                                                                reference: list[list[int]]) -> None:
    """(The weights make the image and the mask matter: an engine that read the image otherwise,
    or attended causally within it, would fail the tests below.)"""
    causal = [hf_reference(model, processed(model, prompt), image, two_way=False)
              for prompt, image in zip(PROMPT_IDS, images)]
    assert all(a != b for a, b in zip(causal, reference))
    other_image = hf_reference(model, processed(model, PROMPT_IDS[0]), images[1])
    assert other_image != reference[0]
    assert len({tuple(tokens) for tokens in reference}) == len(reference)


# (chunks of 18 tokens: each prompt's text split from its image, or the last token alone)
@pytest.mark.parametrize("engine_args", image_schedules(chunk=18, kv_blocks=8))
def test_greedy_tokens_equal_transformers(model: Path, images: list[Image.Image], reference: list[list[int]],
                                          engine_args: dict) -> None:
    assert_greedy_parity(model, image_prompts(images), [processed(model, prompt) for prompt in PROMPT_IDS],
                         reference, engine_args, GREEDY)


def test_text_prompts_as_the_processor_writes_them(model: Path, images: list[Image.Image]) -> None:
    """A text prompt with an image becomes the processor's input ids (placeholders, bos, the text,
    a newline merged with the text's own), `<image>` written in the text or not; those ids given
    as the prompt are taken as they are; the tokens follow as transformers' from those ids."""
    processor = processor_of(model)
    texts = [*TEXTS, "<image>a dog"]
    ids = [list(processor(images=[images[0]], text=[text])["input_ids"][0]) for text in texts]
    llm = make_llm(model)
    try:
        image = {"image": images[0]}
        outputs = llm.generate([{"prompt": text, "multi_modal_data": image} for text in texts]
                               + [{"prompt_token_ids": given, "multi_modal_data": image} for given in ids],
                               GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    for text, wanted, output, again in zip(texts, ids, outputs, outputs[len(texts):]):
        assert list(output.prompt_token_ids) == list(again.prompt_token_ids) == wanted, text
        assert list(output.outputs[0].token_ids) == hf_reference(model, wanted, images[0]), text
        assert list(again.outputs[0].token_ids) == list(output.outputs[0].token_ids), text


def test_a_prefix_cache_hit_inside_the_image(model: Path, images: list[Image.Image],
                                             reference: list[list[int]]) -> None:
    """Blocks of 4 tokens: the second run's cached prefix ends inside the image's placeholders;
    the rest of the image still attends the whole image."""
    assert_prefix_cache_hit_inside_an_image(model, image_prompts(images), reference, GREEDY)


def test_a_text_prompt_without_an_image_is_left_as_it_is(model: Path) -> None:
    """No placeholders, bos or newline added; causal throughout, as vLLM's (transformers' class,
    given no token_type_ids, lets the whole prompt attend both ways: its prefix-LM reading)."""
    from transformers import PaliGemmaForConditionalGeneration

    llm = make_llm(model)
    try:
        [output] = llm.generate([{"prompt_token_ids": PROMPT_IDS[0]}], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    hf = PaliGemmaForConditionalGeneration.from_pretrained(model).eval()
    ids = torch.tensor([PROMPT_IDS[0]])
    causal = hf.generate(input_ids=ids, token_type_ids=torch.ones_like(ids), max_new_tokens=NUM_TOKENS,
                         do_sample=False, eos_token_id=None)
    assert list(output.prompt_token_ids) == PROMPT_IDS[0]
    assert list(output.outputs[0].token_ids) == causal[0, len(PROMPT_IDS[0]):].tolist()


def test_the_releases_config_fields_are_read(model: Path, images: list[Image.Image], reference: list[list[int]],
                                             tmp_path: Path) -> None:
    """PaliGemma's releases write their image count and a projector activation (read by neither
    transformers nor vLLM: the projector is one linear layer) into the vision config, and older
    ones `_vocab_size` at the top: taken; an image count that is not the encoder's is refused."""
    def as_released(config: dict) -> None:
        config["vision_config"].update(num_image_tokens=TOKENS_PER_IMAGE, projector_hidden_act="gelu_fast")
        config["_vocab_size"] = 1000

    released = edited_copy(model, tmp_path / "released", as_released)
    llm = make_llm(released)
    try:
        [output] = llm.generate(image_prompts(images)[:1], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert list(output.outputs[0].token_ids) == reference[0]
    miscounted = edited_copy(model, tmp_path / "miscounted", lambda config: config["vision_config"].update(
        num_image_tokens=9))
    with pytest.raises(ValueError, match="num_image_tokens=9 must be the encoder's 16 patches"):
        EngineArgs(model=str(miscounted), limit_mm_per_prompt={"image": 1}).create_engine_config()


def test_what_cannot_be_honoured_is_refused_by_name(model: Path, images: list[Image.Image], tmp_path: Path) -> None:
    narrow = edited_copy(model, tmp_path / "narrow", lambda config: config.update(projection_dim=32))
    with pytest.raises(ValueError, match="projection_dim=32 must equal text_config.hidden_size=64"):
        EngineArgs(model=str(narrow), limit_mm_per_prompt={"image": 1}).create_engine_config()
    with pytest.raises(ValueError, match="takes at most 1 image"):
        EngineArgs(model=str(model), limit_mm_per_prompt={"image": 2}).create_engine_config()
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 is smaller than an image's 16 tokens"):
        EngineArgs(model=str(model), max_num_batched_tokens=8).create_engine_config()
    llm = make_llm(model)
    try:
        with pytest.raises(ValueError, match="At most 1 image"):
            llm.generate([{"prompt_token_ids": PROMPT_IDS[0], "multi_modal_data": {"image": images[:2]}}], GREEDY,
                         use_tqdm=False)
        with pytest.raises(ValueError, match="image placeholder tokens"):
            llm.generate([{"prompt_token_ids": [IMAGE, IMAGE, 5], "multi_modal_data": {"image": images[0]}}],
                         GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
