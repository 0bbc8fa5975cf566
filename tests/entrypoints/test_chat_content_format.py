"""vLLM's chat_template_content_format: message content as the template reads it. "string"
joins the text parts with newlines; "openai" hands the template a list of parts (a string is one
part; tool messages stay strings); "auto" reads the template (a loop over a message's content
means "openai"). Checked on the detector, on `LLM.chat` (with vLLM's other chat arguments) and
on a live server's /tokenize and chat completions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer, running_server

from vllm_lite.lora.request import LoRARequest
from vllm_lite import LLM, SamplingParams
from vllm_lite.entrypoints.chat_content import detect_content_format, resolve_content_format, with_content_format

# Reads a list of parts (an "openai" template): renders each part in brackets.
PARTS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% if m['content'] is string %}S:{{ m['content'] }}"
                  "{% else %}{% for part in m['content'] %}[{{ part.text }}]{% endfor %}{% endif %}{% endfor %}")
# Reads a string (a "string" template).
STRING_TEMPLATE = "{% for message in messages %}<{{ message.role }}>{{ message.content }}{% endfor %}"
TWO_PARTS = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "tool", "content": [{"type": "text", "text": "t1"}, {"type": "text", "text": "t2"}]},
             {"role": "assistant", "content": "c"}]


@pytest.mark.parametrize(("template", "expected"), [
    (PARTS_TEMPLATE, "openai"),
    (STRING_TEMPLATE, "string"),
    ("{% for m in messages[1:] %}{% for c in m.content | list %}{{ c.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for i, m in messages | enumerate %}{% for c in m['content'] %}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for x in other.content %}{% endfor %}{{ m.content }}{% endfor %}", "string"),
    ("{% for m in messages %", "string"),  # unparsable: rendering reports it
])
def test_detection_reads_loops_over_a_messages_content(template: str, expected: str) -> None:
    assert detect_content_format(template) == expected


def test_formats_shape_the_content() -> None:
    assert with_content_format(TWO_PARTS, "string") == [
        {"role": "user", "content": "a\nb"}, {"role": "tool", "content": "t1\nt2"},
        {"role": "assistant", "content": "c"}]
    assert with_content_format(TWO_PARTS, "openai") == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "tool", "content": "t1\nt2"}, {"role": "assistant", "content": [{"type": "text", "text": "c"}]}]
    assert with_content_format([{"role": "assistant", "content": None}], "openai") == [
        {"role": "assistant", "content": []}]
    assert resolve_content_format("auto", {"default": PARTS_TEMPLATE}) == "openai"
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        resolve_content_format("json", PARTS_TEMPLATE)
    with pytest.raises(ValueError, match="only text content parts are supported, got a part of type 'image_url'"):
        with_content_format([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "string")
    with pytest.raises(ValueError, match="a text content part's `text` must be a string, got 5"):
        with_content_format([{"role": "user", "content": [{"type": "text", "text": 5}]}], "string")


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_qwen3), max_model_len=128, dtype="float32", multiprocess=False)
    yield llm
    llm.shutdown()


def chat_prompt(llm: LLM, messages, **kwargs) -> str:
    return llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, **kwargs)[0].prompt


@pytest.mark.parametrize(("template", "content_format", "expected"), [
    (PARTS_TEMPLATE, "auto", "<user>[a][b]<tool>S:t1\nt2<assistant>[c]"),
    (PARTS_TEMPLATE, "string", "<user>S:a\nb<tool>S:t1\nt2<assistant>S:c"),
    (STRING_TEMPLATE, "auto", "<user>a\nb<tool>t1\nt2<assistant>c"),
])
def test_llm_chat_renders_content_in_the_templates_format(llm: LLM, template: str, content_format: str,
                                                          expected: str) -> None:
    assert chat_prompt(llm, TWO_PARTS, chat_template=template, chat_template_content_format=content_format,
                       add_generation_prompt=False) == expected


LANG_PARTS = [{"role": "user", "content": [{"type": "text", "text": "hi", "source_lang_code": "en",
                                            "target_lang_code": "es"}]}]


def test_a_text_parts_other_fields_reach_a_template_that_reads_parts(llm: LLM) -> None:
    """TranslateGemma's template reads source_lang_code / target_lang_code off each text part:
    with the "openai" format they reach it (vLLM's behaviour); where the content becomes a
    string they could reach nothing, and are refused by name instead of dropped."""
    template = ("{% for m in messages %}{% for p in m['content'] %}{{ p.source_lang_code }}>{{ p.target_lang_code }}"
                ":{{ p.text }}{% endfor %}{% endfor %}")
    assert chat_prompt(llm, LANG_PARTS, chat_template=template, add_generation_prompt=False) == "en>es:hi"
    with pytest.raises(ValueError, match=r"content part field\(s\) source_lang_code, target_lang_code"):
        chat_prompt(llm, LANG_PARTS, chat_template=STRING_TEMPLATE)
    with pytest.raises(ValueError, match=r"source_lang_code.*a tool message's content"):
        with_content_format([{**LANG_PARTS[0], "role": "tool"}], "openai")


def test_llm_chat_takes_vllms_chat_arguments(llm: LLM) -> None:
    template = ("{% for m in messages %}{{ m.content }}|{% endfor %}{% if tools %}T{{ tools | length }}{% endif %}"
                "{% if flag %}F{% endif %}{% if add_generation_prompt %}G{% endif %}")
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial"}]
    assert chat_prompt(llm, messages, chat_template=template, tools=[{"type": "function", "function": {"name": "f"}}],
                       chat_template_kwargs={"flag": True}, lora_request=None) == "q|partial|T1FG"
    assert chat_prompt(llm, messages, chat_template=template, add_generation_prompt=False,
                       continue_final_message=True) == "q|partial"  # cut after the final message's text
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt cannot both be True"):
        chat_prompt(llm, messages, continue_final_message=True)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        chat_prompt(llm, messages, lora_request=object())
    with pytest.raises(ValueError, match="LoRA is not enabled"):  # (a LoRARequest: the engine runs without LoRA)
        chat_prompt(llm, messages, lora_request=LoRARequest("a", 1, "/adapter"))
    with pytest.raises(ValueError, match="priority=1 needs the priority scheduling policy"):
        llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False, priority=[1])


MODEL = "tiny-qwen3"
API_KEY = "sk-content"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def parts_server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("content")
    (folder / "parts.jinja").write_text(PARTS_TEMPLATE)
    args = ("--max-model-len", "128", "--chat-template", str(folder / "parts.jinja"))
    with running_server(tiny_qwen3, folder / "server.log", MODEL, API_KEY, args) as live:
        yield live


def tokenized_text(server: LiveServer, tokenizer_dir: Path, messages) -> str:
    from transformers import AutoTokenizer

    reply = httpx.post(f"{server.base_url}/tokenize", headers=AUTH, timeout=30,
                       json={"model": MODEL, "messages": messages, "add_generation_prompt": False})
    assert reply.status_code == 200, reply.text
    return AutoTokenizer.from_pretrained(tokenizer_dir).decode(reply.json()["tokens"])


def test_server_reads_the_format_from_its_template(parts_server: LiveServer, tiny_qwen3: Path) -> None:
    assert tokenized_text(parts_server, tiny_qwen3, TWO_PARTS) == "<user>[a][b]<tool>S:t1\nt2<assistant>[c]"
    assert tokenized_text(parts_server, tiny_qwen3, LANG_PARTS) == "<user>[hi]"  # (its other fields: accepted)
    reply = httpx.post(f"{parts_server.base_url}/v1/chat/completions", headers=AUTH, timeout=60,
                       json={"model": MODEL, "messages": TWO_PARTS, "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    bad = httpx.post(f"{parts_server.base_url}/v1/chat/completions", headers=AUTH, timeout=60,
                     json={"model": MODEL, "max_tokens": 2,
                           "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]})
    assert bad.status_code == 400 and "only text content parts" in bad.json()["error"]["message"]


def test_server_flag_forces_the_string_format(tiny_qwen3: Path, tmp_path: Path) -> None:
    (tmp_path / "parts.jinja").write_text(PARTS_TEMPLATE)
    args = ("--max-model-len", "128", "--chat-template", str(tmp_path / "parts.jinja"),
            "--chat-template-content-format", "string")
    with running_server(tiny_qwen3, tmp_path / "server.log", MODEL, API_KEY, args) as live:
        assert tokenized_text(live, tiny_qwen3, TWO_PARTS) == "<user>S:a\nb<tool>S:t1\nt2<assistant>S:c"
        lost = httpx.post(f"{live.base_url}/v1/chat/completions", headers=AUTH, timeout=60,
                          json={"model": MODEL, "messages": LANG_PARTS, "max_tokens": 2})
        assert lost.status_code == 400 and "source_lang_code" in lost.json()["error"]["message"], lost.text
