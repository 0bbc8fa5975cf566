"""`vllm-lite serve` of a multimodal checkpoint (a tiny Gemma3ForConditionalGeneration) with
vLLM's text-only flags: completions and chat answer with transformers' tokens; a request with an
image, on chat, Responses or Messages, is a 400 naming what is not implemented, and the server
goes on serving; asking for image inputs at start stops the server naming the flag."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import REPO_ROOT, LiveServer, running_server

from hf_reference import hf_greedy

MODEL = "gemma-3-mm"
API_KEY = "sk-mm"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [5, 17, 33, 71, 140, 260, 511]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.fixture(scope="module")
def server(tiny_gemma3_mm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tiny_gemma3_mm, tmp_path_factory.mktemp("mm") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "256", "--language-model-only",
                         "--limit-mm-per-prompt.image", "0")) as live:
        yield live


def test_completions_and_chat_answer_as_transformers(server: LiveServer, tiny_gemma3_mm: Path) -> None:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        completion = client.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}).json()
        chat = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "the cat"}]}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}).json()
    assert completion["choices"][0]["token_ids"] == hf_greedy(tiny_gemma3_mm, [PROMPT], 12)[0]
    assert chat["choices"][0]["token_ids"] == hf_greedy(tiny_gemma3_mm, [chat["prompt_token_ids"]], 8)[0]


def test_requests_with_images_are_refused_by_name_and_others_go_on(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        chat = client.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, IMAGE]}]})
        responses = client.post("/v1/responses", json={
            "model": MODEL, "max_output_tokens": 4,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "what is it?"},
                                                   {"type": "input_image", "image_url": IMAGE["image_url"]["url"]}]}]})
        messages = client.post("/v1/messages", json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]})
        after = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
    # (each as chat's image_url part, refused with the reason this model takes none)
    why = "image inputs are not taken here: language_model_only=True serves the language model alone"
    for reply in (chat, responses, messages):
        assert reply.status_code == 400 and "'image_url'" in reply.text and why in reply.text, reply.text
    assert after.status_code == 200 and len(after.json()["choices"][0]["text"]) > 0


def test_asking_for_image_inputs_stops_the_server_naming_the_flag(tiny_gemma3_mm: Path) -> None:
    command = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve", str(tiny_gemma3_mm),
               "--limit-mm-per-prompt", '{"image": 2}']
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    assert "limit_mm_per_prompt: image=2: multimodal inputs are not implemented" in result.stderr, result.stderr[-2000:]
