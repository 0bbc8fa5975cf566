"""Structured outputs on the bundled demo model (SmolLM2-135M-Instruct, a real vocabulary of
49k byte-level BPE tokens): a few requests of each kind, greedy and random, in one batch."""

from __future__ import annotations

import pytest

from structured_checks import KINDS
from vllm_lite import LLM, SamplingParams


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    from vllm_lite.gguf_convert import ensure_demo_model

    return LLM(str(ensure_demo_model()), max_model_len=512, multiprocess=False)


def test_every_kind_on_the_demo_model(demo_llm: LLM) -> None:
    tokenizer = demo_llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Give me a short answer in JSON."}],
                                           tokenize=False, add_generation_prompt=True)
    kinds, params = [], []
    for kind, (structured, _, _) in KINDS.items():
        for temperature in (0.0, 0.8):
            kinds.append(kind)
            params.append(SamplingParams(temperature=temperature, seed=5, max_tokens=80,
                                         structured_outputs=structured))
    outputs = demo_llm.generate([prompt] * len(params), params, use_tqdm=False)
    for kind, out in zip(kinds, outputs):
        text, finish = out.outputs[0].text, out.outputs[0].finish_reason
        _, check, bounded = KINDS[kind]
        if bounded or finish == "stop":
            assert finish == "stop" and check(text), (kind, text)
