"""End to end: greedy output with the native CPU attention backend equals the torch backend's,
through prefix-cache hits and chunked prefill (mixed prefill + decode steps)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from vllm_lite import LLM, EngineArgs, SamplingParams
from vllm_lite import _custom_ops as cpu_native

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _make_llm(model: Path, **engine_args) -> LLM:
    accepts_multiprocess = ("multiprocess" in EngineArgs.field_names()
                            or "multiprocess" in inspect.signature(LLM.__init__).parameters)
    if accepts_multiprocess:
        engine_args["multiprocess"] = False  # in-process, so the op counter below sees the calls
    return LLM(str(model), max_model_len=256, max_num_batched_tokens=48, dtype="float32", **engine_args)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


@pytest.mark.skipif(not cpu_native.is_available(), reason="vllm_lite._C is not built")
def test_cpu_native_greedy_equals_torch(tiny_llama: Path, prompts_token_ids: list[list[int]],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    shared = prompts_token_ids[-1][:32]  # two full blocks: later prompts hit the prefix cache
    prompts = prompts_token_ids + [shared + p[:5] for p in prompts_token_ids[:3]]
    expected = _greedy(_make_llm(tiny_llama, attention_backend="torch"), prompts)

    calls = {"decode": 0}
    decode = cpu_native.paged_attention_decode

    def counting_decode(*args):
        calls["decode"] += 1
        decode(*args)

    monkeypatch.setattr(cpu_native, "paged_attention_decode", counting_decode)
    assert _greedy(_make_llm(tiny_llama, attention_backend="cpu_native"), prompts) == expected
    assert calls["decode"] > 0


def test_triton_interpreted_greedy_equals_torch(tiny_llama: Path, prompts_token_ids: list[list[int]]) -> None:
    """The Triton backend inside the real model (strided q/k/v views, mixed prefill + decode
    steps, split-KV decode), run by the Triton interpreter on CPU: slow, so a short run."""
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    # The second prompt starts with the first one's first block (block size 16): a prefix hit.
    prompts = [prompts_token_ids[3], prompts_token_ids[3][:16] + prompts_token_ids[0]]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def greedy(backend: str) -> list[list[int]]:
        llm = _make_llm(tiny_llama, attention_backend=backend, block_size=16)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.stats()["prefix_cache_hits"] >= 16
        return [list(out.outputs[0].token_ids) for out in outputs]

    assert greedy("triton") == greedy("torch")
