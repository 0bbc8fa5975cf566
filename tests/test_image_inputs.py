"""Image inputs (vLLM's multi_modal_data) of a LLaVA 1.5 checkpoint: a tiny CLIP encoder (two
layers, 56 x 56 images, 16 features each) and projector drawn wide enough that the image changes
the reply; greedy tokens equal transformers' LlavaForConditionalGeneration on the pixel values of
its own image processor, under chunked prompts, preemption, prefix caching, TP=2 and LLM.chat;
what cannot be honoured is refused by name."""

from __future__ import annotations

import base64
import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from checkpoint_copies import edited_copy
from hf_reference import IMAGE_TOKEN_ID, hf_greedy_with_images
from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.config import EngineArgs
from vllm_lite.entrypoints.beam_search import BeamSearchParams

NUM_TOKENS = 8
TOKENS_PER_IMAGE = 16  # (56 / 14) ** 2 patches, the CLS feature dropped
# one placeholder per image, as a chat template writes it
PROMPTS = [[5, 17, IMAGE_TOKEN_ID, 33, 71], [9, IMAGE_TOKEN_ID, 40, IMAGE_TOKEN_ID, 61, 7], [IMAGE_TOKEN_ID, 3, 8]]
IMAGES_PER_PROMPT = [[0], [1, 2], [2]]
# a template that loops over content parts (vLLM's "openai" format), writing LLaVA's placeholder
# (the tiny vocabulary's token 999 is "We", a token of its own after a newline)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ':' }}{% for part in m['content'] %}"
                 "{% if part['type'] == 'image' %}{{ '\\nWe' }}{% else %}{{ '\\n' + part['text'] }}{% endif %}"
                 "{% endfor %}{{ '\\n' }}{% endfor %}{{ 'assistant:' }}")


@pytest.fixture(scope="module")
def llava(tiny_llava_images: Path) -> Path:
    return tiny_llava_images


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (48 + 16 * i, 80, 3), dtype=np.uint8)) for i in range(3)]


def pixel_values(model: Path, images: list[Image.Image]) -> torch.Tensor:
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model)(images=images, return_tensors="pt")["pixel_values"]


def expanded(prompt: list[int]) -> list[int]:
    return [t for token in prompt for t in ([token] * TOKENS_PER_IMAGE if token == IMAGE_TOKEN_ID else [token])]


@pytest.fixture(scope="module")
def reference(llava: Path, images: list[Image.Image]) -> list[list[int]]:
    return [hf_greedy_with_images(llava, expanded(prompt), pixel_values(llava, [images[i] for i in which]), NUM_TOKENS)
            for prompt, which in zip(PROMPTS, IMAGES_PER_PROMPT)]


def image_prompts(images: list[Image.Image]) -> list[dict]:
    return [{"prompt_token_ids": prompt, "multi_modal_data": {"image": [images[i] for i in which]}}
            for prompt, which in zip(PROMPTS, IMAGES_PER_PROMPT)]


GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def run(llm, prompts: list) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 8, "enable_chunked_prefill": True},  # an image's features split across steps
    {"block_size": 8, "num_kv_blocks": 9, "enable_prefix_caching": False},  # preempted and resumed
    {"attention_backend": "torch", "dtype": "float32"},
    {"multiprocess": True, "tensor_parallel_size": 2},  # the images cross both processes' wires
])
def test_greedy_tokens_equal_transformers(llava: Path, images: list[Image.Image], reference: list[list[int]],
                                          engine_args: dict) -> None:
    llm = make_llm(llava, disable_log_stats=False, **engine_args)
    try:
        outputs = llm.generate(image_prompts(images), GREEDY, use_tqdm=False)
        assert [list(out.outputs[0].token_ids) for out in outputs] == reference
        assert [list(out.prompt_token_ids) for out in outputs] == [expanded(prompt) for prompt in PROMPTS]
        if "num_kv_blocks" in engine_args:
            assert llm.stats()["num_preemptions"] > 0
    finally:
        llm.shutdown()


# Other LLaVA vision sides: SigLIP with "full" features of the last layer (LLaVA-Interleave's form,
# its pooling head in the checkpoint and never run), CLIP with the features of two layers concatenated
VISION_SIDES = {
    "siglip": ({"model_type": "siglip_vision_model", "vision_use_head": True},
               {"vision_feature_select_strategy": "full", "vision_feature_layer": -1}, 16),
    "clip_two_layers": ({}, {"vision_feature_select_strategy": "full", "vision_feature_layer": [-3, -1]}, 17),
}


@pytest.mark.parametrize("side", VISION_SIDES)
def test_other_vision_sides_equal_transformers(side: str, images: list[Image.Image], tmp_path: Path) -> None:
    from hf_reference import build_tiny_multimodal_model
    from transformers import CLIPImageProcessor, SiglipImageProcessor

    vision, outer, tokens = VISION_SIDES[side]
    model = build_tiny_multimodal_model(tmp_path / side, "LlavaForConditionalGeneration", "llama",
                                        tie_word_embeddings=False, config_extra=outer,
                                        vision_extra={"num_hidden_layers": 2, "image_size": 56, **vision})
    processor = (SiglipImageProcessor(size={"height": 56, "width": 56}) if side == "siglip" else
                 CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}))
    processor.save_pretrained(model)
    prompt = [5, 17, IMAGE_TOKEN_ID, 33, 71]
    full = [t for token in prompt for t in ([token] * tokens if token == IMAGE_TOKEN_ID else [token])]
    llm = make_llm(model)
    try:
        [output] = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": images[0]}}, GREEDY,
                                use_tqdm=False)
    finally:
        llm.shutdown()
    assert list(output.prompt_token_ids) == full
    assert list(output.outputs[0].token_ids) == hf_greedy_with_images(model, full, pixel_values(model, images[:1]),
                                                                      NUM_TOKENS)


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LLaVA-NeXT: the tiny CLIP encoder (28 x 28 tiles of 2 x 2 features) with up to 2 x 2 tiles."""
    from hf_reference import build_tiny_multimodal_model
    from transformers import LlavaNextImageProcessor

    pinpoints = [[28, 28], [28, 56], [56, 28], [56, 56]]
    model = build_tiny_multimodal_model(tmp_path_factory.mktemp("llava_next"), "LlavaNextForConditionalGeneration",
                                        "llama", tie_word_embeddings=False, vision_extra={"num_hidden_layers": 2},
                                        config_extra={"image_grid_pinpoints": pinpoints})
    LlavaNextImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                            image_grid_pinpoints=pinpoints).save_pretrained(model)
    return model


def test_llava_next_tiles_equal_transformers(llava_next: Path) -> None:
    """Images of several aspect ratios (wide, tall, square, odd): each read as the whole image
    and its tiles, cut to its shape, a newline per row (features per image vary), beside a chunked
    schedule that splits images across steps."""
    from transformers import AutoImageProcessor

    rng = np.random.default_rng(1)
    shaped = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for h, w in ((40, 90), (90, 40), (50, 50), (30, 31))]
    prompts = [([5, IMAGE_TOKEN_ID, 33, IMAGE_TOKEN_ID, 8], [0, 1]), ([IMAGE_TOKEN_ID, 3, 8], [2]),
               ([9, 9, IMAGE_TOKEN_ID, 4], [3])]
    processor = AutoImageProcessor.from_pretrained(llava_next)
    expected, lengths = [], []  # (the features of each prompt's images)
    llm = make_llm(llava_next, max_num_batched_tokens=8, enable_chunked_prefill=True)
    try:
        outputs = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": [shaped[i] for i in which]}}
                                for prompt, which in prompts], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    for (prompt, which), output in zip(prompts, outputs):
        inputs = processor(images=[shaped[i] for i in which], return_tensors="pt")
        full = list(output.prompt_token_ids)
        expected.append(hf_greedy_with_images(llava_next, full, inputs["pixel_values"], NUM_TOKENS,
                                              image_sizes=inputs["image_sizes"]))
        lengths.append(full.count(IMAGE_TOKEN_ID))
    # (transformers refuses placeholders that do not match its features: the counts are its own)
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
    assert all(count > 4 * len(which) for count, (_, which) in zip(lengths, prompts))  # (tiles read, not only the whole image's 4)


@pytest.fixture(scope="module")
def llava_onevision(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LLaVA-OneVision: the tiny SigLIP encoder (28 x 28 tiles of 2 x 2 features, "full"
    features), up to 3 x 3 tiles, anyres_max_2: tile features past 2 tiles' worth scaled down."""
    from hf_reference import build_tiny_multimodal_model
    from transformers import LlavaOnevisionImageProcessor

    pinpoints = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28], [84, 84]]
    model = build_tiny_multimodal_model(tmp_path_factory.mktemp("llava_onevision"),
                                        "LlavaOnevisionForConditionalGeneration", "qwen2", tie_word_embeddings=False,
                                        vision_extra={"num_hidden_layers": 2},
                                        config_extra={"image_grid_pinpoints": pinpoints,
                                                      "vision_aspect_ratio": "anyres_max_2"})
    LlavaOnevisionImageProcessor(size={"height": 28, "width": 28}, image_grid_pinpoints=pinpoints).save_pretrained(model)
    return model


def test_llava_onevision_equals_transformers(llava_onevision: Path) -> None:
    """LLaVA-OneVision: a lone image read whole and as its tiles, cut to its shape and scaled down
    past anyres_max tiles' worth (wide, tall, large, odd); the images of a prompt with several read
    whole only, each with one newline (transformers' rule; the same image alone before is
    processed again, not taken from the processor cache); chunks that split images."""
    from transformers import AutoImageProcessor

    rng = np.random.default_rng(4)
    shaped = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for h, w in ((40, 90), (90, 40), (84, 84), (30, 31))]
    prompts = [([IMAGE_TOKEN_ID, 3, 8], [0]), ([9, 9, IMAGE_TOKEN_ID, 4], [1]), ([5, IMAGE_TOKEN_ID, 6], [2]),
               ([7, IMAGE_TOKEN_ID, 8], [3]), ([5, IMAGE_TOKEN_ID, 33, IMAGE_TOKEN_ID, 8], [0, 2])]
    processor = AutoImageProcessor.from_pretrained(llava_onevision)
    llm = make_llm(llava_onevision, max_num_batched_tokens=8, enable_chunked_prefill=True)
    try:
        outputs = [llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": [shaped[i] for i in which]}},
                                GREEDY, use_tqdm=False)[0] for prompt, which in prompts]
    finally:
        llm.shutdown()
    expected, lengths = [], []
    for (prompt, which), output in zip(prompts, outputs):
        pictures = [shaped[i] for i in which]
        inputs = processor(images=[pictures] if len(pictures) > 1 else pictures, return_tensors="pt")
        full = list(output.prompt_token_ids)
        expected.append(hf_greedy_with_images(llava_onevision, full, inputs["pixel_values"], NUM_TOKENS,
                                              image_sizes=inputs["image_sizes"],
                                              batch_num_images=inputs["batch_num_images"]))
        lengths.append(full.count(IMAGE_TOKEN_ID))
    # (transformers refuses placeholders that do not match its features: the counts are its own)
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
    assert lengths[2] == 4 + 2 * 3  # (3 x 3 tiles: 6 x 6 features scaled down to 2 x 2, a newline a row)
    assert lengths[4] == 2 * (4 + 1)  # (two images: each whole only, and a newline)
    import json

    from vllm_lite.vision_config import read_image_encoder

    config = json.loads((llava_onevision / "config.json").read_text())
    assert read_image_encoder(config).anyres_max == 2
    with pytest.raises(ValueError, match="vision_aspect_ratio='anyres' is not implemented"):
        read_image_encoder({**config, "vision_aspect_ratio": "anyres"})


def test_the_image_changes_the_reply_and_the_prefix_cache_keeps_images_apart(
        llava: Path, images: list[Image.Image], reference: list[list[int]]) -> None:
    """A prompt seen with one image is a prefix-cache hit only up to the block holding its image:
    the same prompt with another image reads none of the first image's KV."""
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, IMAGE_TOKEN_ID, 30, 31]
    llm = make_llm(llava, block_size=16, enable_prefix_caching=True)
    try:
        first, again, other = (llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": image}},
                                            GREEDY, use_tqdm=False)[0]
                               for image in (images[0], images[0], images[1]))
    finally:
        llm.shutdown()
    full = expanded(prompt)
    assert list(first.outputs[0].token_ids) == hf_greedy_with_images(llava, full, pixel_values(llava, images[:1]),
                                                                     NUM_TOKENS)
    assert list(other.outputs[0].token_ids) == hf_greedy_with_images(llava, full, pixel_values(llava, images[1:2]),
                                                                     NUM_TOKENS)
    assert first.outputs[0].token_ids != other.outputs[0].token_ids
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert again.num_cached_tokens == 32  # (every full block: the image's included)
    assert other.num_cached_tokens == 16  # (the block before the image only)


def test_an_image_seen_before_is_not_encoded_again(llava: Path, images: list[Image.Image],
                                                  reference: list[list[int]]) -> None:
    """vLLM's encoder cache: features kept by image hash serve the same image in a later request
    (the prefix cache off, so the features are read again); `reset_encoder_cache` forgets them."""
    llm = make_llm(llava, enable_prefix_caching=False, worker_extension_cls="worker_extensions.WeightSync")
    try:
        assert run(llm, image_prompts(images)) == reference
        # the third prompt's image is the second prompt's second: found
        assert llm.collective_rpc("encoder_cache_counts") == [{"hits": 1, "misses": 3}]
        assert run(llm, image_prompts(images)) == reference
        assert llm.collective_rpc("encoder_cache_counts") == [{"hits": 5, "misses": 3}]
        llm.reset_encoder_cache()
        assert run(llm, image_prompts(images)) == reference
        assert llm.collective_rpc("encoder_cache_counts") == [{"hits": 6, "misses": 6}]
    finally:
        llm.shutdown()


def test_an_image_processed_before_skips_the_image_processor(llava: Path, images: list[Image.Image],
                                                             reference: list[list[int]],
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's processor cache (mm_processor_cache_gb, 4 GiB by default): the client keeps processed
    images by their content, so the same pixels (another PIL object) skip the image processor;
    `reset_mm_cache` forgets them; 0 keeps none; a size that is no number of GiB is refused by name."""
    from vllm_lite.engine.image_inputs import ImageProcessor

    processed: list[Image.Image] = []
    process = ImageProcessor._process
    monkeypatch.setattr(ImageProcessor, "_process",
                        lambda self, batch, *rest: processed.extend(batch) or process(self, batch, *rest))
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.001")
    llm = make_llm(llava, disable_log_stats=False)
    try:
        with caplog.at_level(logging.INFO, logger="vllm_lite.engine.stats_log"):
            assert run(llm, image_prompts(images)) == reference
        assert any("MM cache hit rate: 25.0%" in record.getMessage() for record in caplog.records)  # (vLLM's line)
        assert len(processed) == 3  # (the third prompt's image is the second prompt's second)
        assert run(llm, image_prompts([image.copy() for image in images])) == reference
        assert len(processed) == 3
        llm.reset_mm_cache()
        assert run(llm, image_prompts(images)) == reference
        assert len(processed) == 6
        metrics = {metric.name: metric.value for metric in llm.get_metrics() if metric.name.startswith("vllm:mm_")}
        assert metrics == {"vllm:mm_cache_queries": 12, "vllm:mm_cache_hits": 1 + 4 + 1}  # (vLLM's, in images)
    finally:
        llm.shutdown()
    llm = make_llm(llava, mm_processor_cache_gb=0)
    try:
        assert run(llm, image_prompts(images)) == reference
        assert len(processed) == 10
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="mm_processor_cache_gb must be a number of GiB >= 0, got -1"):
        EngineArgs(model=str(llava), mm_processor_cache_gb=-1).create_engine_config()


def test_multi_modal_uuids_name_images_that_need_not_be_sent_again(llava: Path, images: list[Image.Image],
                                                                   reference: list[list[int]],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's multi_modal_uuids: the caller's id stands for an image in the caches (None: its
    content does), so a prompt may give None for an image processed before under its id; an id
    that names nothing kept, or uuids that do not match the images, are refused by name."""
    from vllm_lite.engine.image_inputs import ImageProcessor

    processed: list[Image.Image] = []
    process = ImageProcessor._process
    monkeypatch.setattr(ImageProcessor, "_process",
                        lambda self, batch, *rest: processed.extend(batch) or process(self, batch, *rest))
    uuids = [["a"], ["b", None], "c"]

    def prompts(given: list[list]) -> list[dict]:
        return [{"prompt_token_ids": prompt, "multi_modal_data": {"image": items}, "multi_modal_uuids": {"image": ids}}
                for prompt, items, ids in zip(PROMPTS, given, uuids)]
    llm = make_llm(llava)
    try:
        assert run(llm, prompts([[images[0]], [images[1], images[2]], [images[2]]])) == reference
        assert len(processed) == 4  # (image 2 once by its content, once as "c")
        assert run(llm, prompts([[None], [None, images[2]], [None]])) == reference
        assert len(processed) == 4
        # the id, not the content, is the image: another picture under "a" reads as a's
        assert run(llm, [{"prompt_token_ids": PROMPTS[0], "multi_modal_data": {"image": images[1]},
                          "multi_modal_uuids": {"image": "a"}}]) == reference[:1]
        refusals = [({"image": [None]}, {"image": ["never-seen"]}, "'never-seen' names no image processed before"),
                    ({"image": [images[0]]}, {"image": ["a", "b"]}, "must give a non-empty string or None for each"),
                    ({"image": [None]}, None, "must be a PIL.Image.Image"),
                    ({"image": [images[0]]}, {"video": ["v"]}, "multi_modal_uuids must be a dict with the key 'image'")]
        for data, ids, message in refusals:
            with pytest.raises(ValueError, match=message):
                llm.generate({"prompt_token_ids": PROMPTS[0], "multi_modal_data": data, "multi_modal_uuids": ids},
                             GREEDY, use_tqdm=False)
        chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": images[1], "uuid": "d"},
                                             {"type": "text", "text": "the cat"}]}]
        first = llm.chat(chat, GREEDY, chat_template=CHAT_TEMPLATE, use_tqdm=False)[0]
        chat[0]["content"][0]["image_pil"] = None
        again = llm.chat(chat, GREEDY, chat_template=CHAT_TEMPLATE, use_tqdm=False)[0]
        assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
        assert len(processed) == 5
        with pytest.raises(ValueError, match="multi_modal_uuids without multi_modal_data"):
            llm.generate({"prompt_token_ids": [5, 6], "multi_modal_uuids": {"image": "a"}}, GREEDY, use_tqdm=False)
        assert run(llm, image_prompts(images)) == reference  # (the engine still answers)
    finally:
        llm.shutdown()


def test_a_prompt_already_expanded_is_taken_as_it_is(llava: Path, images: list[Image.Image],
                                                     reference: list[list[int]]) -> None:
    llm = make_llm(llava)
    try:
        prompts = [{"prompt_token_ids": expanded(p["prompt_token_ids"]), "multi_modal_data": p["multi_modal_data"]}
                   for p in image_prompts(images)]
        assert run(llm, prompts) == reference
    finally:
        llm.shutdown()


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_chat_with_image_parts(llava: Path, images: list[Image.Image]) -> None:
    """LLM.chat: an `image_url` part (a data URL) and an `image_pil` part reach the template as
    images where their parts were, and the model as their features."""
    llm = make_llm(llava)
    try:
        [output] = llm.chat([{"role": "user", "content": [
            {"type": "text", "text": " the cat"}, {"type": "image_url", "image_url": {"url": _data_url(images[0])}},
            {"type": "image_pil", "image_pil": images[1]}]}], GREEDY, chat_template=CHAT_TEMPLATE, use_tqdm=False)
        tokenizer = llm.get_tokenizer()
    finally:
        llm.shutdown()
    text = "user:\n the cat\nWe\nWe\nassistant:"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(IMAGE_TOKEN_ID) == 2
    assert list(output.prompt_token_ids) == expanded(ids)
    # (the PNG round trip keeps the pixels exactly)
    assert list(output.outputs[0].token_ids) == hf_greedy_with_images(llava, expanded(ids),
                                                                      pixel_values(llava, images[:2]), NUM_TOKENS)


def test_chat_fetches_http_image_urls(llava: Path, image_host: str) -> None:
    import httpx

    png = base64.b64encode(httpx.get(f"{image_host}/cat.png").content).decode()
    llm = make_llm(llava)
    try:
        fetched, inline = (llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
                                    GREEDY, chat_template=CHAT_TEMPLATE, use_tqdm=False)[0]
                           for url in (f"{image_host}/cat.png", f"data:image/png;base64,{png}"))
        with pytest.raises(ValueError, match="image_url: fetching .*/dog.png failed: .*404"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{image_host}/dog.png"}}]}],
                     GREEDY, chat_template=CHAT_TEMPLATE, use_tqdm=False)
    finally:
        llm.shutdown()
    assert list(fetched.outputs[0].token_ids) == list(inline.outputs[0].token_ids)
    assert list(fetched.prompt_token_ids).count(IMAGE_TOKEN_ID) == TOKENS_PER_IMAGE


def test_image_urls_reach_only_where_the_media_flags_allow(llava: Path, images: list[Image.Image], image_host: str,
                                                          tmp_path: Path) -> None:
    """vLLM's allowed_local_media_path (file: URLs read only under it, a link out of it refused)
    and allowed_media_domains (every host a fetch reaches, a redirect's too, must be listed)."""
    folder, outside = tmp_path / "media", tmp_path / "outside.png"
    folder.mkdir()
    images[0].save(folder / "a.png")
    images[0].save(outside)
    (folder / "link.png").symlink_to(outside)
    llm = make_llm(llava, allowed_local_media_path=str(folder), allowed_media_domains=["127.0.0.1"])

    def chat(url: str) -> list[int]:
        return list(llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
                             GREEDY, chat_template=CHAT_TEMPLATE, use_tqdm=False)[0].outputs[0].token_ids)
    port = image_host.rsplit(":", 1)[1]
    try:
        assert chat(f"file://{folder / 'a.png'}") == chat(_data_url(images[0]))
        assert chat(f"{image_host}/cat.png")  # (127.0.0.1 is listed)
        refusals = [(f"file://{folder / 'link.png'}", "is not under --allowed-local-media-path"),
                    (f"file://{folder / '..' / 'outside.png'}", "is not under --allowed-local-media-path"),
                    (f"file://{folder / 'missing.png'}", "could not be read"),
                    (f"http://localhost:{port}/cat.png", "the host 'localhost' of .* is not one of --allowed-media"),
                    (f"{image_host}/to-localhost.png", "the host 'localhost' of .* is not one of --allowed-media")]
        for url, message in refusals:
            with pytest.raises(ValueError, match=message):
                chat(url)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="allowed_local_media_path='/no/such/folder' is not an existing folder"):
        EngineArgs(model=str(llava), allowed_local_media_path="/no/such/folder").create_engine_config()


def test_vllms_fetch_variables_set_the_timeout_and_the_redirects(llava: Path, image_host: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_IMAGE_FETCH_TIMEOUT (seconds) and VLLM_MEDIA_URL_ALLOW_REDIRECTS=0 (a redirect refused),
    read when the engine starts; values that are neither refused by name."""
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "0.3")
    monkeypatch.setenv("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")
    llm = make_llm(llava)

    def chat(url: str) -> list[int]:
        return list(llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
                             GREEDY, chat_template=CHAT_TEMPLATE, use_tqdm=False)[0].outputs[0].token_ids)
    try:
        assert chat(f"{image_host}/cat.png")
        with pytest.raises(ValueError, match="image_url: fetching .*/slow.png failed: .*timed out"):
            chat(f"{image_host}/slow.png")
        with pytest.raises(ValueError, match="image_url: fetching .*/to-localhost.png failed: Redirect response"):
            chat(f"{image_host}/to-localhost.png")
    finally:
        llm.shutdown()
    for name, value in (("VLLM_IMAGE_FETCH_TIMEOUT", "soon"), ("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "yes")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"{name} must be .*, got '{value}'"):
            EngineArgs(model=str(llava)).create_engine_config()
        monkeypatch.delenv(name)


def test_what_cannot_be_honoured_is_refused_by_name(llava: Path, images: list[Image.Image], tiny_llama: Path,
                                                    tmp_path: Path) -> None:
    llm = make_llm(llava, limit_mm_per_prompt={"image": 2})
    try:
        def refused(prompt: dict, match: str) -> None:
            with pytest.raises(ValueError, match=match):
                llm.generate(prompt, GREEDY, use_tqdm=False)

        refused({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": images[0]}},
                r"the prompt holds 0 image placeholder tokens \(id 999\) for 1 image\(s\)")
        refused({"prompt_token_ids": [5, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID], "multi_modal_data": {"image": images[0]}},
                "holds 2 image placeholder tokens")
        refused({"prompt_token_ids": PROMPTS[0], "multi_modal_data": {"image": images}},
                r"At most 2 image\(s\) may be provided in one prompt, got 3 \(limit_mm_per_prompt\)")
        refused({"prompt_token_ids": PROMPTS[0], "multi_modal_data": {"image": np.zeros((56, 56, 3))}},
                "multi_modal_data image must be a PIL.Image.Image, got ndarray")
        refused({"prompt_token_ids": PROMPTS[0], "multi_modal_data": {"video": [images[0]]}},
                r"modalities \['video'\] are not implemented")
        refused({"prompt_token_ids": [5] * 250 + [IMAGE_TOKEN_ID], "multi_modal_data": {"image": images[0]}},
                "max_model_len")
        with pytest.raises(ValueError, match="file: URLs are read only with --allowed-local-media-path"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///x.png"}}]}],
                     GREEDY, chat_template=CHAT_TEMPLATE, use_tqdm=False)
        with pytest.raises(ValueError, match="multi_modal_data is taken by generate only"):
            llm.beam_search([{"prompt_token_ids": PROMPTS[0], "multi_modal_data": {"image": images[0]}}],
                            BeamSearchParams(beam_width=2, max_tokens=2))
        # the engine goes on: a good request after the refused ones
        assert run(llm, image_prompts(images)[:1])[0]
    finally:
        llm.shutdown()
    text_only = make_llm(llava, language_model_only=True)
    try:
        with pytest.raises(ValueError, match="image inputs are not taken by this model: language_model_only=True"):
            text_only.generate({"prompt_token_ids": PROMPTS[0], "multi_modal_data": {"image": images[0]}}, GREEDY,
                               use_tqdm=False)
    finally:
        text_only.shutdown()
    with pytest.raises(ValueError, match="limit_mm_per_prompt must be a dict of modality -> count"):
        EngineArgs(model=str(llava), limit_mm_per_prompt="image=1").create_engine_config()
    with pytest.raises(ValueError, match="limit_mm_per_prompt: image=1 with language_model_only=True"):
        EngineArgs(model=str(llava), language_model_only=True, limit_mm_per_prompt={"image": 1}).create_engine_config()
    with pytest.raises(ValueError, match="limit_mm_per_prompt: image=1: multimodal inputs are not implemented for "
                                         "LlamaForCausalLM"):
        EngineArgs(model=str(tiny_llama), limit_mm_per_prompt={"image": 1}).create_engine_config()
    model = edited_copy(llava, tmp_path / "deep_feature", {"vision_feature_layer": 7})
    with pytest.raises(ValueError, match="vision_feature_layer=7 names no hidden state of the 2-layer vision encoder"):
        EngineArgs(model=str(model), limit_mm_per_prompt={"image": 1}).create_engine_config()


def test_a_trainers_update_of_the_whole_checkpoint_reaches_the_vision_side(
        llava: Path, images: list[Image.Image], tmp_path: Path) -> None:
    """vLLM's RLHF weight sync of a multimodal model: the vision encoder's and projector's tensors
    are loaded into the encoder the workers run (not skipped, as for a model served text only)."""
    from hf_reference import build_tiny_multimodal_model

    other = build_tiny_multimodal_model(tmp_path / "other", "LlavaForConditionalGeneration", "llama",
                                        tie_word_embeddings=False, seed=5,
                                        vision_extra={"num_hidden_layers": 2, "image_size": 56})
    prompt = image_prompts(images)[1]
    expected = hf_greedy_with_images(other, expanded(PROMPTS[1]), pixel_values(llava, images[1:3]), NUM_TOKENS)
    llm = make_llm(llava, worker_extension_cls="worker_extensions.WeightSync")
    try:
        assert run(llm, [prompt]) != [expected]
        llm.collective_rpc("load_checkpoint", args=(str(other / "model.safetensors"),))
        llm.reset_prefix_cache()
        assert run(llm, [prompt]) == [expected]
    finally:
        llm.shutdown()


def test_the_engine_core_refuses_images_a_step_could_not_take(llava: Path, images: list[Image.Image]) -> None:
    """What another client could send the engine core (its door's checks, request_checks.py):
    each malformed ImageInputs field is refused by name, before it reaches a worker."""
    import msgspec

    from vllm_lite.engine.input_processor import InputProcessor
    from vllm_lite.engine.request_checks import check_request
    from vllm_lite.wire import ImageInputs

    model_config = EngineArgs(model=str(llava), dtype="float32", max_model_len=256,
                              limit_mm_per_prompt={"image": 2}).create_engine_config().model_config
    processor = InputProcessor(model_config, None)
    _, _, good = processor.process_prompt("r", image_prompts(images)[1], GREEDY)
    check_request(good, model_config)
    pixels, offsets = good.images.pixel_values, good.images.offsets

    def refused(match: str, **images_fields: object) -> None:
        bad = msgspec.structs.replace(good, images=msgspec.structs.replace(good.images, **images_fields))
        with pytest.raises(ValueError, match=match):
            check_request(bad, model_config)

    refused(r"float32 \[n, 3, 56, 56\]", pixel_values=pixels[:, :, :28])
    refused(r"float32 \[n, 3, 56, 56\]", pixel_values=pixels.astype(np.float64))
    refused("1 to 2 images, each with an offset, a length and a hash", offsets=offsets[:1])
    refused("NaN or infinite", pixel_values=np.full_like(pixels, np.nan))
    refused("a 32-byte SHA-256 hash per image", hashes=[b"x", b"y"])
    refused("placeholder tokens must lie inside the prompt", offsets=offsets + 100)
    refused("placeholder tokens must lie inside the prompt", offsets=offsets[::-1].copy())
    refused("each image's length must be the features it becomes", lengths=np.array([4, 4]))
    refused("must hold the image placeholder token 999", offsets=offsets - 1)
    three = msgspec.structs.replace(good, images=ImageInputs(np.concatenate([pixels, pixels[:1]]),
                                                             np.array([0, 17, 34]), np.full(3, 16),
                                                             good.images.hashes * 2))
    with pytest.raises(ValueError, match="1 to 2 images"):
        check_request(three, model_config)
    text_config = EngineArgs(model=str(llava), dtype="float32", max_model_len=256,
                             language_model_only=True).create_engine_config().model_config
    with pytest.raises(ValueError, match="image inputs are not taken by this model: language_model_only=True"):
        check_request(good, text_config)


def test_disable_chunked_mm_input_keeps_each_image_in_one_step(llava: Path, images: list[Image.Image],
                                                               reference: list[list[int]]) -> None:
    """vLLM's disable_chunked_mm_input: chunks of up to 20 tokens end before an image rather than
    inside it (same tokens); an image longer than a step's budget is refused by name, and the
    engine goes on."""
    llm = make_llm(llava, max_num_batched_tokens=20, enable_chunked_prefill=True, disable_chunked_mm_input=True)
    try:
        assert run(llm, image_prompts(images)) == reference
    finally:
        llm.shutdown()
    llm = make_llm(llava, max_num_batched_tokens=8, enable_chunked_prefill=True, disable_chunked_mm_input=True)
    try:
        with pytest.raises(ValueError, match="an image of the prompt takes 16 tokens, more than "
                                             "max_num_batched_tokens=8"):
            run(llm, image_prompts(images)[:1])
        assert len(run(llm, [{"prompt_token_ids": [5, 17, 33]}])[0]) == NUM_TOKENS
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fixture,prompt,kwargs", [
    ("tiny_llava_images", [5, IMAGE_TOKEN_ID, 33], {"size": {"shortest_edge": 2000}}),  # (an upscale)
    ("tiny_qwen2_vl_images", "<|vision_start|><|image_pad|><|vision_end|> the", {"min_pixels": 4_000_000}),
    ("tiny_internvl_images", "<IMG_CONTEXT> the", {"min_patches": 200, "max_patches": 300}),
    ("tiny_gemma3_images", [5, 997, 33], {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 100}),
    ("tiny_smolvlm_images", "<image> the", {"max_image_size": {"longest_edge": 10}}),  # (tiles of 10 pixels)
])
def test_processor_arguments_beyond_the_context_are_refused_before_processing(
        fixture: str, prompt: str | list[int], kwargs: dict, request: pytest.FixtureRequest) -> None:
    """A request's mm_processor_kwargs that would have the processor build more of an image than a
    prompt of max_model_len holds (an upscale to a huge size, thousands of tiles or crops: pixels
    that would exhaust the client's memory before the prompt's length is checked; here values just
    past the bounds, which the processor could still run) are refused by name before the processor
    runs; the engine goes on answering."""
    model: Path = request.getfixturevalue(fixture)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 200, 3), dtype=np.uint8))
    given = {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt, "multi_modal_data": {"image": [image]}}
    llm = make_llm(model)
    try:
        with pytest.raises(ValueError, match=r"mm_processor_kwargs: .* would make more of an image than a prompt "
                                             r"of max_model_len=256 tokens holds"):
            llm.generate([{**given, "mm_processor_kwargs": kwargs}], SamplingParams(max_tokens=2), use_tqdm=False)
        [answer] = llm.generate([given], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(answer.outputs[0].token_ids) == 2


@pytest.mark.parametrize("fixture,prompt,kwargs", [
    ("tiny_llava_images", [5, IMAGE_TOKEN_ID, 33], {"crop_size": {"longest_edge": -5}}),  # (was an AttributeError)
    ("tiny_llava_images", [5, IMAGE_TOKEN_ID, 33], {"image_mean": "x"}),  # (transformers' own validation error)
    ("tiny_llava_images", [5, IMAGE_TOKEN_ID, 33], {"image_grid_pinpoints": 5}),
    ("tiny_mistral3_images", "[IMG] the", {"patch_size": 10 ** 30}),  # (an OverflowError)
])
def test_processor_arguments_of_any_wrong_kind_are_a_request_error(
        fixture: str, prompt: str | list[int], kwargs: dict, request: pytest.FixtureRequest) -> None:
    """Whatever the image processor raises on a request's mm_processor_kwargs (transformers'
    processors raise TypeError, their own validation errors, AttributeError, OverflowError, ...) is
    that request's error naming mm_processor_kwargs, not a server error; the engine goes on."""
    model: Path = request.getfixturevalue(fixture)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 100, 3), dtype=np.uint8))
    given = {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt, "multi_modal_data": {"image": [image]}}
    llm = make_llm(model)
    try:
        with pytest.raises(ValueError, match=r"mm_processor_kwargs \[.*\]: the image processor .* does not take them"):
            llm.generate([{**given, "mm_processor_kwargs": kwargs}], SamplingParams(max_tokens=2), use_tqdm=False)
        [answer] = llm.generate([given], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(answer.outputs[0].token_ids) == 2
