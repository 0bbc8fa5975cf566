"""Image inputs of Mistral 3 (Mistral3ForConditionalGeneration, Mistral Small 3.1 / 3.2) and
Pixtral-12B (LlavaForConditionalGeneration with a Pixtral encoder): an image resized by its
processor to whole squares of a feature's pixels (Mistral 3's 28, at most 112 a side here;
Pixtral-12B's 14, at most 56), read whole by Pixtral (2-D rotary positions), Mistral 3's patch
states merged 2 x 2, then projected; the prompt's
[IMG] becomes the rows of features' [IMG] placeholders, each row ended by [IMG_BREAK], the last by
[IMG_END] (their own tokens: the features fill the [IMG] positions only). Greedy tokens equal
transformers' classes on their processor's pixel values, under chunked prompts (a chunk may end
within a row), preemption, prefix caching, the torch attention backend, TP=2, a prompt already
expanded, LLM.chat and the server."""

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
IMAGE = "[IMG]"
# (the two-image prompt last: the first two fit the preempting schedule's cache together)
TEXTS = [f"the cat{IMAGE}of and", f"{IMAGE}the", f"a{IMAGE}to the{IMAGE}in"]
IMAGES_PER_TEXT = [[0], [2], [1, 2]]
IMG, BREAK, END = 1000, 1001, 1002  # (tests/conftest.py's MISTRAL3_TOKENS)


@pytest.fixture(scope="module", params=["tiny_mistral3_images", "tiny_pixtral_images"])
def pixtral(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def unit(model: Path) -> int:
    """The pixels on a side of one feature's square."""
    return read_image_encoder(json.loads((model / "config.json").read_text())).feature_pixels


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    """A wide, a tall and a small square image (Mistral 3: 2 x 4, 4 x 2 and 2 x 2 features;
    Pixtral-12B: 2 x 4, 4 x 2 and 3 x 3)."""
    rng = np.random.default_rng(9)
    return [Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8))
            for size in ((56, 112, 3), (110, 50, 3), (40, 40, 3))]


def processor_inputs(model: Path, text: str, pictures: list[Image.Image]) -> dict:
    """What transformers' PixtralProcessor makes of the text and images: each [IMG] becoming its
    image's rows of [IMG], each ended by [IMG_BREAK], the last by [IMG_END]; the pixel values (the
    processor asks for whole merged squares) and sizes."""
    from transformers import AutoImageProcessor, AutoTokenizer

    side = unit(model)
    pixels = AutoImageProcessor.from_pretrained(model)(images=pictures, return_tensors="pt",
                                                       patch_size={"height": side, "width": side})
    pieces = text.split(IMAGE)
    expanded = pieces[0]
    for (height, width), piece in zip(pixels["image_sizes"].tolist(), pieces[1:]):
        rows = ("[IMG]" * (width // side) + "[IMG_BREAK]") * (height // side)
        expanded += rows.removesuffix("[IMG_BREAK]") + "[IMG_END]" + piece
    ids = AutoTokenizer.from_pretrained(model)(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "pixel_values": pixels["pixel_values"], "image_sizes": pixels["image_sizes"]}


def hf_tokens(model: Path, inputs: dict) -> list[int]:
    return hf_greedy_with_images(model, inputs["input_ids"][0].tolist(), inputs["pixel_values"], NUM_TOKENS,
                                 image_sizes=inputs["image_sizes"])


@pytest.fixture(scope="module")
def reference(pixtral: Path, images: list[Image.Image]) -> list[tuple[list[int], list[int]]]:
    return references(pixtral, TEXTS, IMAGES_PER_TEXT, images, processor_inputs, hf_tokens)


def prompts(images: list[Image.Image]) -> list[dict]:
    return text_prompts(TEXTS, IMAGES_PER_TEXT, images)


def test_the_images_change_the_reference(pixtral: Path, images: list[Image.Image],
                                         reference: list) -> None:
    """Another image changes transformers' tokens; the layout is the processor's."""
    inputs = processor_inputs(pixtral, TEXTS[2], [images[0], images[2]])
    assert hf_tokens(pixtral, inputs) != reference[2][1]
    ids = reference[2][0]
    first = ids.index(IMG)
    assert ids[first:first + 12] == ([IMG, IMG, BREAK] * 4)[:-1] + [END]  # (the tall image: 4 rows of 2 either way)


@pytest.mark.parametrize("engine_args", image_schedules(chunk=5))
def test_greedy_tokens_equal_transformers(pixtral: Path, images: list[Image.Image], reference: list,
                                          engine_args: dict) -> None:
    if "num_kv_blocks" in engine_args:  # (a cache the first two prompts outgrow together, the third fits)
        engine_args = {**engine_args, "num_kv_blocks": 5 if unit(pixtral) == 28 else 6}
    assert_greedy_parity(pixtral, prompts(images), [ids for ids, _ in reference],
                         [tokens for _, tokens in reference], engine_args, GREEDY)


def test_prefix_cache_expanded_prompts_and_chat(pixtral: Path, images: list[Image.Image],
                                                reference: list) -> None:
    """A prompt seen before reads its cached blocks; a prompt already expanded (token ids with the
    rows and their ends) is taken as it is; LLM.chat writes [IMG] for an image part; a prompt
    whose rows do not match its image is refused by name and the engine goes on."""
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(pixtral).apply_chat_template(
        [{"role": "user", "content": f"{IMAGE}\nthe cat"}], tokenize=False, add_generation_prompt=True)
    chat_inputs = processor_inputs(pixtral, text, [images[0]])
    bad = list(reference[0][0])
    bad[bad.index(BREAK)] = IMG
    llm = make_llm(pixtral, block_size=4)
    try:
        first = llm.generate(prompts(images)[:1], GREEDY, use_tqdm=False)
        again = llm.generate(prompts(images), GREEDY, use_tqdm=False)
        [given] = llm.generate([{"prompt_token_ids": reference[2][0],
                                 "multi_modal_data": {"image": [images[1], images[2]]}}], GREEDY, use_tqdm=False)
        [chatted] = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": images[0]},
                                                           {"type": "text", "text": "the cat"}]}],
                             GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="do not lie as its images' rows of features"):
            llm.generate([{"prompt_token_ids": bad, "multi_modal_data": {"image": [images[0]]}}], GREEDY,
                         use_tqdm=False)
        [after] = llm.generate(prompts(images)[1:2], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert again[0].num_cached_tokens > 0
    assert list(first[0].outputs[0].token_ids) == reference[0][1]
    assert [list(out.outputs[0].token_ids) for out in again] == [tokens for _, tokens in reference]
    assert (list(given.prompt_token_ids), list(given.outputs[0].token_ids)) == tuple(reference[2])
    assert list(chatted.prompt_token_ids) == chat_inputs["input_ids"][0].tolist()
    assert list(chatted.outputs[0].token_ids) == hf_tokens(pixtral, chat_inputs)
    assert list(after.outputs[0].token_ids) == reference[1][1]


def test_the_engine_core_refuses_what_a_step_could_not_take(pixtral: Path,
                                                            images: list[Image.Image]) -> None:
    """What another client could send the engine core: sizes not in whole features or beyond the
    pixels, spans that are not the images' rows, a feature position without [IMG]."""
    import msgspec
    from transformers import AutoTokenizer

    from vllm_lite.config import EngineArgs
    from vllm_lite.engine.input_processor import InputProcessor
    from vllm_lite.engine.request_checks import check_request

    model_config = EngineArgs(model=str(pixtral), dtype="float32",
                              max_model_len=256).create_engine_config().model_config
    processor = InputProcessor(model_config, AutoTokenizer.from_pretrained(pixtral))
    _, _, good = processor.process_prompt("r", prompts(images)[2], GREEDY)
    check_request(good, model_config)
    side = unit(pixtral)
    wanted = processor_inputs(pixtral, TEXTS[2], [images[1], images[2]])["image_sizes"]
    assert good.images.image_sizes.tolist() == wanted.tolist()
    assert good.images.lengths.tolist() == [rows * (columns + 1) for rows, columns in (wanted // side).tolist()]
    most = {28: 112, 14: 56}[side]

    def refused(match: str, **fields: object) -> None:
        bad = msgspec.structs.replace(good, images=msgspec.structs.replace(good.images, **fields))
        with pytest.raises(ValueError, match=match):
            check_request(bad, model_config)

    message = f"multiples of {side} up to {most}"
    refused(rf"float32 \[n, 3, height, width\] with each image's \(height, width\), {message}",
            image_sizes=wanted.numpy() + np.array([[0, 1], [0, 0]]))
    refused(message, image_sizes=wanted.numpy() + np.array([[most, 0], [0, 0]]))
    refused(message, image_sizes=None)
    refused("each image's length must be the features it becomes", lengths=good.images.lengths + 1)
    tokens = good.prompt_token_ids.copy()
    tokens[int(good.images.offsets[0])] = 5
    bad = msgspec.structs.replace(good, prompt_token_ids=tokens)
    with pytest.raises(ValueError, match="must hold the image placeholder token 1000"):
        check_request(bad, model_config)


def test_config_reading(pixtral: Path) -> None:
    config = json.loads((pixtral / "config.json").read_text())
    encoder = read_image_encoder(config)
    merged = config["architectures"] == ["Mistral3ForConditionalGeneration"]
    assert encoder.row_breaks and not encoder.mrope and encoder.patch_merger == merged
    assert encoder.feature_pixels == (28 if merged else 14)
    assert encoder.placeholder_span(56, 112) == (2 * 5 if merged else 4 * 9)

    def refused(match: str, outer: dict | None = None, **vision: object) -> None:
        with pytest.raises(ValueError, match=match):
            read_image_encoder({**config, **(outer or {}), "vision_config": {**config["vision_config"], **vision}})

    refused(r"vision_feature_layer=\[-1, -2\] is not implemented", {"vision_feature_layer": [-1, -2]})
    refused(r"head_dim=24 must be hidden_size / num_attention_heads", head_dim=24)
    refused(r"vision_config fields \['patch_merge'\] are not implemented", patch_merge=2)
    if not merged:
        refused(r"vision_feature_select_strategy='default' is not implemented for a Pixtral encoder",
                {"vision_feature_select_strategy": "default"})
