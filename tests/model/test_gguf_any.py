"""A `.gguf` path loads any supported architecture (here Qwen2 and Qwen3, written from tiny
random checkpoints as fp32 GGUF files), converted once into a cached Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from gguf_export import export_gguf
from hf_reference import hf_greedy
from test_parity import NEW_TOKENS, run_greedy
from vllm_lite import LLM

pytest.importorskip("gguf")


@pytest.mark.parametrize("fixture,arch", [("tiny_qwen2", "qwen2"), ("tiny_qwen3", "qwen3")])
def test_gguf_file_matches_its_source_checkpoint(fixture: str, arch: str, request: pytest.FixtureRequest,
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 prompts_token_ids: list[list[int]]) -> None:
    monkeypatch.setenv("VLLM_LITE_CACHE", str(tmp_path / "cache"))
    source: Path = request.getfixturevalue(fixture)
    gguf_file = export_gguf(source, tmp_path / f"tiny-{arch}.gguf", arch)
    llm = LLM(str(gguf_file), max_model_len=256, multiprocess=False)
    assert run_greedy(llm, prompts_token_ids) == hf_greedy(source, prompts_token_ids, NEW_TOKENS)
    converted = list((tmp_path / "cache" / "gguf").iterdir())
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()
