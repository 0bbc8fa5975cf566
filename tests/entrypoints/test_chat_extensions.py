"""vLLM's chat-request extensions in-process over the fake engine (the prompt the engine gets
is what the chat template rendered): documents and chat_template_kwargs reach a (trusted)
template; echo, continue_final_message and add_generation_prompt as vLLM combines them. The
real engine's side of them is in test_vllm_extensions.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine
from transformers import AutoTokenizer

from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.entrypoints.openai.server_state import ServerOptions

API_KEY = "sk-chat-ext"
MODEL = "tiny"
TEMPLATE = ("{% for d in documents or [] %}[doc {{ d['title'] }}: {{ d['text'] }}]{% endfor %}"
            "{% for m in messages %}<{{ m['role'] }}|{{ m['content'] }}>{% endfor %}"
            "{% if flavour is defined %}(flavour={{ flavour }}){% endif %}"
            "{% if add_generation_prompt %}<assistant|{% endif %}")


@pytest.fixture
def engine(tiny_tokenizer_dir: Path) -> FakeEngine:
    return FakeEngine(AutoTokenizer.from_pretrained(tiny_tokenizer_dir), max_model_len=256)


def chat(engine: FakeEngine, **body: Any) -> httpx.Response:
    options = ServerOptions(api_key=API_KEY, trust_request_chat_template=True)

    async def go() -> httpx.Response:
        app = build_app(engine, [MODEL], options=options)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, **body},
                                     headers={"Authorization": f"Bearer {API_KEY}"})
    return asyncio.run(go())


def test_documents_and_chat_template_kwargs_reach_the_template(engine: FakeEngine) -> None:
    response = chat(engine, messages=[{"role": "user", "content": "hi"}], chat_template=TEMPLATE,
                    documents=[{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}],
                    chat_template_kwargs={"flavour": "mint"})
    assert response.status_code == 200, response.text
    assert engine.prompts[-1]["prompt"] == "[doc A: alpha][doc B: beta]<user|hi>(flavour=mint)<assistant|"


def test_content_as_text_parts_renders_as_the_joined_text(engine: FakeEngine) -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert chat(engine, messages=[{"role": "user", "content": parts}], chat_template=TEMPLATE).status_code == 200
    assert engine.prompts[-1]["prompt"] == "<user|one\ntwo><assistant|"


def test_continue_final_message_continues_and_echo_repeats_it(engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}]
    response = chat(engine, messages=messages, chat_template=TEMPLATE, add_generation_prompt=False,
                    continue_final_message=True, echo=True)
    assert response.status_code == 200, response.text
    assert not engine.prompts[-1]["prompt"].endswith("<assistant|")
    content = response.json()["choices"][0]["message"]["content"]
    plain = chat(engine, messages=messages, chat_template=TEMPLATE, add_generation_prompt=False,
                 continue_final_message=True).json()["choices"][0]["message"]["content"]
    assert content == "Well," + plain


def test_echo_repeats_nothing_when_the_last_message_is_not_the_replys_role(engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "hi"}]
    echoed = chat(engine, messages=messages, chat_template=TEMPLATE, echo=True).json()["choices"][0]["message"]
    plain = chat(engine, messages=messages, chat_template=TEMPLATE).json()["choices"][0]["message"]
    assert echoed["content"] == plain["content"]


def test_continue_final_message_with_add_generation_prompt_is_400(engine: FakeEngine) -> None:
    response = chat(engine, messages=[{"role": "assistant", "content": "x"}], continue_final_message=True,
                    add_generation_prompt=True)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "continue_final_message"
    assert error["message"] == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."



@pytest.mark.parametrize(("template", "expected"), [
    (TEMPLATE, "<system|be brief\n\nbe nice><user|hi><assistant|"),
    (TEMPLATE + "{# a template that names 'developer' #}", "<system|be brief><developer|be nice><user|hi><assistant|")])
def test_developer_messages_are_system_ones_where_the_template_does_not_know_the_role(
        engine: FakeEngine, template: str, expected: str) -> None:
    """vLLM 0.32's rule: a template that never names 'developer' gets such messages as system
    ones, the system messages merged into one first; one that names it gets them as they are."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "developer", "content": "be nice"},
                {"role": "user", "content": "hi"}]
    response = chat(engine, messages=messages, chat_template=template)
    assert response.status_code == 200, response.text
    assert engine.prompts[-1]["prompt"] == expected
