"""`vllm-lite serve` of a LLaVA 1.5 checkpoint (tests/conftest.py's tiny_llava_images): a chat
message's `image_url` parts (data URLs) reach the model as images, with transformers' tokens,
the expanded prompt counted in usage and returned; Responses' `input_image` parts and Messages'
image blocks answer as chat does; an image that cannot be read, or one on an
endpoint that does not take them (/tokenize), is a 400 naming it, and the server goes on serving."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from live_server import LiveServer, running_server
from PIL import Image

from hf_reference import IMAGE_TOKEN_ID, hf_greedy_with_images

MODEL = "llava-images"
API_KEY = "sk-llava"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOKENS_PER_IMAGE = 16
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def server(tiny_llava_images: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tiny_llava_images, tmp_path_factory.mktemp("llava") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "256", "--dtype", "float32")) as live:
        yield live


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 72, 3), dtype=np.uint8))


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _chat(client: httpx.Client, content: list[dict]) -> httpx.Response:
    return client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": NUM_TOKENS,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True})


def test_chat_with_images_answers_as_transformers(server: LiveServer, tiny_llava_images: Path) -> None:
    from transformers import AutoImageProcessor

    images = [_image(1), _image(2)]
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        reply = _chat(client, [{"type": "image_url", "image_url": {"url": _data_url(images[0])}},
                               {"type": "text", "text": "the cat"},
                               {"type": "image_url", "image_url": {"url": _data_url(images[1])}}])
        other = _chat(client, [{"type": "image_url", "image_url": {"url": _data_url(images[1])}},
                               {"type": "text", "text": "the cat"},
                               {"type": "image_url", "image_url": {"url": _data_url(images[0])}}])
    assert reply.status_code == 200, reply.text
    body = reply.json()
    prompt_ids = body["prompt_token_ids"]
    assert prompt_ids.count(IMAGE_TOKEN_ID) == 2 * TOKENS_PER_IMAGE  # (the template's content as a string:
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)        # a placeholder per image, before the text)
    pixels = AutoImageProcessor.from_pretrained(tiny_llava_images)(images=images, return_tensors="pt")["pixel_values"]
    assert body["choices"][0]["token_ids"] == hf_greedy_with_images(tiny_llava_images, prompt_ids, pixels, NUM_TOKENS)
    assert other.json()["choices"][0]["token_ids"] != body["choices"][0]["token_ids"]  # (the images' order matters)


def test_an_image_part_s_uuid_lets_a_later_request_leave_the_image_out(server: LiveServer) -> None:
    """vLLM's `uuid` on image parts: a later request may give `image_url: null` with the uuid of an
    image sent before and is answered as if it had sent it again; a uuid naming nothing sent, or a
    part with neither, is a 400 naming it."""
    image = _image(4)
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        sent = _chat(client, [{"type": "image_url", "image_url": {"url": _data_url(image)}, "uuid": "photo-4"},
                              {"type": "text", "text": "the cat"}])
        left_out = _chat(client, [{"type": "image_url", "image_url": None, "uuid": "photo-4"},
                                  {"type": "text", "text": "the cat"}])
        unknown = _chat(client, [{"type": "image_url", "image_url": None, "uuid": "photo-never-sent"}])
        neither = _chat(client, [{"type": "image_url", "image_url": None}])
        metrics = client.get("/metrics").text
    assert sent.status_code == left_out.status_code == 200, (sent.text, left_out.text)
    assert left_out.json()["choices"][0]["token_ids"] == sent.json()["choices"][0]["token_ids"]
    assert left_out.json()["prompt_token_ids"] == sent.json()["prompt_token_ids"]
    assert unknown.status_code == 400 and "'photo-never-sent' names no image processed before" in unknown.text
    assert neither.status_code == 400 and "needs the uuid of an image sent before" in neither.text
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith(("vllm:mm_cache_queries_total{", "vllm:mm_cache_hits_total{"))}
    assert counts["vllm:mm_cache_hits_total"] >= 1 and counts["vllm:mm_cache_queries_total"] >= 3  # (vLLM's names)


def test_what_cannot_be_read_is_a_400_and_the_server_goes_on(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        not_base64 = _chat(client, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}])
        not_an_image = _chat(client, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
        scheme = _chat(client, [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}])
        too_many = _chat(client, [{"type": "image_url", "image_url": {"url": _data_url(_image(3))}}] * 20)
        tokenize = client.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(_image(3))}}]}]})
        after = _chat(client, [{"type": "text", "text": "the cat"}])
    assert not_base64.status_code == 400 and "not valid base64" in not_base64.text, not_base64.text
    assert not_an_image.status_code == 400 and "could not be decoded" in not_an_image.text, not_an_image.text
    assert scheme.status_code == 400 and "file: URLs are read only with --allowed-local-media-path" in scheme.text, scheme.text
    assert too_many.status_code == 400 and "maximum context length" in too_many.text, too_many.text
    assert tokenize.status_code == 400 and "'image_url'" in tokenize.text, tokenize.text
    assert after.status_code == 200 and len(after.json()["choices"][0]["token_ids"]) == NUM_TOKENS


def test_responses_and_messages_images_answer_as_chat(server: LiveServer) -> None:
    image = _image(4)
    url = _data_url(image)
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        chat = client.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": NUM_TOKENS, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url, "detail": "high"}}, {"type": "text", "text": "a cat"}]}]})
        responses = client.post("/v1/responses", json={
            "model": MODEL, "max_output_tokens": NUM_TOKENS, "temperature": 0, "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": url, "detail": "auto"}, {"type": "input_text", "text": "a cat"}]}]})
        messages = client.post("/v1/messages", json={
            "model": MODEL, "max_tokens": NUM_TOKENS, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.split(",")[1]}},
                {"type": "text", "text": "a cat"}]}]})
        file_id = client.post("/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-1"}]}]})
        detail = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url, "detail": "ultra"}}]}]})
    text = chat.json()["choices"][0]["message"]["content"]
    assert chat.json()["usage"]["prompt_tokens"] > TOKENS_PER_IMAGE
    assert responses.status_code == 200, responses.text
    assert responses.json()["output"][-1]["content"][0]["text"] == text
    assert messages.status_code == 200, messages.text
    assert messages.json()["content"][0]["text"] == text
    assert file_id.status_code == 400 and "file_id is not implemented" in file_id.text, file_id.text
    assert detail.status_code == 400 and "image_url.detail must be one of" in detail.text, detail.text


def test_http_image_urls_are_fetched(server: LiveServer, image_host: str) -> None:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        fetched = _chat(client, [{"type": "image_url", "image_url": {"url": f"{image_host}/cat.png"}},
                                 {"type": "text", "text": "the cat"}])
        png = base64.b64encode(httpx.get(f"{image_host}/cat.png").content).decode()
        inline = _chat(client, [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                                {"type": "text", "text": "the cat"}])
        missing = _chat(client, [{"type": "image_url", "image_url": {"url": f"{image_host}/dog.png"}}])
    assert fetched.status_code == 200, fetched.text
    assert fetched.json()["choices"][0]["token_ids"] == inline.json()["choices"][0]["token_ids"]
    assert missing.status_code == 400 and "fetching" in missing.text and "404" in missing.text, missing.text


def test_gemma3_chat_images_frame_and_attend_both_ways(tiny_gemma3_images: Path,
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """Gemma 3 over HTTP: an image part becomes its start-of-image token framed by "\\n\\n" with
    its end token around the placeholders (the length checked and counted expanded), answered as
    transformers answers given the processor's token_type_ids."""
    import torch
    from transformers import AutoImageProcessor

    image = _image(5)
    with running_server(tiny_gemma3_images, tmp_path_factory.mktemp("gemma3") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "256", "--dtype", "float32")) as live:
        with httpx.Client(base_url=live.base_url, headers=AUTH, timeout=60) as client:
            reply = _chat(client, [{"type": "text", "text": "the cat"},
                                   {"type": "image_url", "image_url": {"url": _data_url(image)}}])
            too_long = client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
                    *[{"type": "image_url", "image_url": {"url": _data_url(image)}}] * 30]}]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    prompt_ids = body["prompt_token_ids"]
    start = prompt_ids.index(997)
    assert prompt_ids[start - 2:start + 8] == [201, 201, 997, *[IMAGE_TOKEN_ID] * 4, 998, 201, 201]
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    pixels = AutoImageProcessor.from_pretrained(tiny_gemma3_images)(images=[image], return_tensors="pt")["pixel_values"]
    token_types = (torch.tensor([prompt_ids]) == IMAGE_TOKEN_ID).long()
    assert body["choices"][0]["token_ids"] == hf_greedy_with_images(tiny_gemma3_images, prompt_ids, pixels,
                                                                    NUM_TOKENS, token_type_ids=token_types)
    assert too_long.status_code == 400 and "maximum context length is 256" in too_long.json()["error"]["message"]


def test_smolvlm_chat_images_expand_as_its_processor(tiny_smolvlm_images: Path,
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """SmolVLM over HTTP: an image part becomes `<image>`, expanded into its tiles' and whole
    image's runs between the processor's row / column tokens (the server processes the image to
    count them), checked against max_model_len, answered as transformers answers."""
    from transformers import AutoImageProcessor

    image = _image(6)
    with running_server(tiny_smolvlm_images, tmp_path_factory.mktemp("smolvlm") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "256", "--dtype", "float32")) as live:
        with httpx.Client(base_url=live.base_url, headers=AUTH, timeout=60) as client:
            reply = _chat(client, [{"type": "image_url", "image_url": {"url": _data_url(image)}},
                                   {"type": "text", "text": "the cat"}])
            too_long = client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": _data_url(image)}}] * 12}]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    prompt_ids = body["prompt_token_ids"]
    image_token = 1002  # (tests/conftest.py's SMOLVLM_TOKENS)
    pixels = AutoImageProcessor.from_pretrained(tiny_smolvlm_images)(images=[[image]], return_tensors="pt")
    assert prompt_ids.count(image_token) == 4 * pixels["pixel_values"].shape[1]  # (4 per tile)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["choices"][0]["token_ids"] == hf_greedy_with_images(
        tiny_smolvlm_images, prompt_ids, pixels["pixel_values"], NUM_TOKENS,
        pixel_attention_mask=pixels["pixel_attention_mask"])
    assert too_long.status_code == 400 and "maximum context length is 256" in too_long.json()["error"]["message"]


def test_qwen2_5_vl_chat_images_take_their_patches_and_positions(tiny_qwen2_5_vl_images: Path,
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """Qwen2.5-VL over HTTP: an image part becomes vision start, `<|image_pad|>` once per merged
    square of its processor's patches (the server processes the image to count them), vision end;
    checked against max_model_len, answered as transformers answers (M-RoPE positions). vLLM's
    --mm-processor-kwargs (here the processor's own max_pixels) and a request's
    mm_processor_kwargs over them (fewer patches); one the processor does not take is a 400."""
    from transformers import AutoImageProcessor

    image = _image(7)
    content = [{"type": "image_url", "image_url": {"url": _data_url(image)}}, {"type": "text", "text": "the cat"}]
    with running_server(tiny_qwen2_5_vl_images, tmp_path_factory.mktemp("qwen2_5_vl") / "server.log", MODEL,
                        API_KEY, ("--max-model-len", "256", "--dtype", "float32",
                                  "--mm-processor-kwargs", '{"max_pixels": 12544}')) as live:
        with httpx.Client(base_url=live.base_url, headers=AUTH, timeout=60) as client:
            reply = _chat(client, content)
            smaller = client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}],
                "mm_processor_kwargs": {"max_pixels": 28 * 28 * 4}, "return_token_ids": True})
            unknown = client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}],
                "mm_processor_kwargs": {"bogus": 1}})
            too_long = client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": _data_url(image)}}] * 40}]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    prompt_ids = body["prompt_token_ids"]
    start, pad, end = 1000, 1001, 1002  # (tests/conftest.py's QWEN2_VL_TOKENS)
    pixels = AutoImageProcessor.from_pretrained(tiny_qwen2_5_vl_images)(images=[image], return_tensors="pt")
    squares = int(pixels["image_grid_thw"].prod()) // 4
    first = prompt_ids.index(start)
    assert prompt_ids[first:first + squares + 2] == [start, *[pad] * squares, end]
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    ids = torch.tensor([prompt_ids])
    assert body["choices"][0]["token_ids"] == hf_greedy_with_images(
        tiny_qwen2_5_vl_images, prompt_ids, pixels["pixel_values"], NUM_TOKENS,
        image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(ids == pad).int())
    assert too_long.status_code == 400 and "maximum context length is 256" in too_long.json()["error"]["message"]
    assert smaller.status_code == 200, smaller.text
    processor = AutoImageProcessor.from_pretrained(tiny_qwen2_5_vl_images)
    fewer = processor(images=[image], size={**dict(processor.size), "longest_edge": 28 * 28 * 4})["image_grid_thw"]
    assert smaller.json()["prompt_token_ids"].count(pad) == int(fewer.prod()) // 4 < squares
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "mm_processor_kwargs"
    assert "'bogus'" in unknown.json()["error"]["message"]


def test_internvl_chat_images_take_their_tiles(tiny_internvl_images: Path,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    """InternVL over HTTP: an image part becomes `<img>`, 4 placeholders per tile its processor
    cuts (the server processes the image to count them), `</img>`; answered as transformers
    answers; a request's mm_processor_kwargs (max_patches=1) cut fewer."""
    from transformers import AutoImageProcessor

    image = _image(8).resize((112, 56))  # (two tiles and a thumbnail)
    content = [{"type": "image_url", "image_url": {"url": _data_url(image)}}, {"type": "text", "text": "the cat"}]
    with running_server(tiny_internvl_images, tmp_path_factory.mktemp("internvl") / "server.log", MODEL,
                        API_KEY, ("--max-model-len", "256", "--dtype", "float32")) as live:
        with httpx.Client(base_url=live.base_url, headers=AUTH, timeout=60) as client:
            reply = _chat(client, content)
            one_tile = client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}],
                "mm_processor_kwargs": {"max_patches": 1}, "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    prompt_ids = body["prompt_token_ids"]
    start, end, context = 1000, 1001, 1002  # (tests/conftest.py's INTERNVL_TOKENS)
    pixels = AutoImageProcessor.from_pretrained(tiny_internvl_images)(images=[image], crop_to_patches=True,
                                                                      return_tensors="pt")
    assert pixels["num_patches"].tolist() == [3]
    first = prompt_ids.index(start)
    assert prompt_ids[first:first + 14] == [start, *[context] * 12, end]
    assert body["choices"][0]["token_ids"] == hf_greedy_with_images(
        tiny_internvl_images, prompt_ids, pixels["pixel_values"], NUM_TOKENS)
    assert one_tile.status_code == 200, one_tile.text
    assert one_tile.json()["prompt_token_ids"].count(context) == 4


def test_mistral3_chat_images_take_their_rows(tiny_mistral3_images: Path,
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """Mistral 3 over HTTP: an image part becomes its rows of [IMG], each ended by [IMG_BREAK], the
    last by [IMG_END] (the server processes the image to lay them out); answered as transformers
    answers."""
    from transformers import AutoImageProcessor

    image = _image(9)  # (64 x 72: resized to 84 x 84, 3 x 3 features)
    content = [{"type": "image_url", "image_url": {"url": _data_url(image)}}, {"type": "text", "text": "the cat"}]
    with running_server(tiny_mistral3_images, tmp_path_factory.mktemp("mistral3") / "server.log", MODEL,
                        API_KEY, ("--max-model-len", "256", "--dtype", "float32")) as live:
        with httpx.Client(base_url=live.base_url, headers=AUTH, timeout=60) as client:
            reply = _chat(client, content)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    prompt_ids = body["prompt_token_ids"]
    image_token, row_break, image_end = 1000, 1001, 1002  # (tests/conftest.py's MISTRAL3_TOKENS)
    pixels = AutoImageProcessor.from_pretrained(tiny_mistral3_images)(
        images=[image], return_tensors="pt", patch_size={"height": 28, "width": 28})
    assert pixels["image_sizes"].tolist() == [[84, 84]]
    first = prompt_ids.index(image_token)
    assert prompt_ids[first:first + 12] == ([image_token] * 3 + [row_break]) * 2 + [image_token] * 3 + [image_end]
    assert body["choices"][0]["token_ids"] == hf_greedy_with_images(
        tiny_mistral3_images, prompt_ids, pixels["pixel_values"], NUM_TOKENS, image_sizes=pixels["image_sizes"])
