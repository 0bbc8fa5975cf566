"""gpt-oss's released checkpoints (openai/gpt-oss-20b / -120b): MoE experts in MXFP4, loaded
through the Transformers fallback, which dequantizes them into the engine's dtype. Parity with
transformers on the float checkpoint of exactly the weights the MXFP4 one stands for (packed
here by the format's rules), and with transformers' own loading of the MXFP4 checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_reference import hf_greedy
from llm_factory import make_llm
from quantized_checkpoints import MXFP4_CONFIG, assert_refused, write_mxfp4_pair
from vllm_lite import SamplingParams

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tiny_gpt_oss: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_mxfp4_pair(tiny_gpt_oss, tmp_path_factory.mktemp("mxfp4"))


def test_mxfp4_experts_run_as_the_weights_they_stand_for(mxfp4_gpt_oss: tuple[Path, Path],
                                                         prompts_token_ids: list[list[int]]) -> None:
    quantized, dequantized = mxfp4_gpt_oss
    expected = hf_greedy(dequantized, prompts_token_ids, NEW_TOKENS)
    assert hf_greedy(quantized, prompts_token_ids, NEW_TOKENS) == expected  # (transformers' own MXFP4 reading)
    for quantization in (None, "mxfp4"):  # (vLLM's --quantization mxfp4, or implied by the checkpoint)
        llm = make_llm(quantized, quantization=quantization)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts_token_ids],
                                   SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                                   use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        finally:
            llm.shutdown()


def test_what_mxfp4_does_not_cover_is_refused(mxfp4_gpt_oss: tuple[Path, Path], tiny_llama: Path,
                                              tmp_path: Path) -> None:
    quantized, _ = mxfp4_gpt_oss
    assert_refused(quantized, {**MXFP4_CONFIG, "group_size": 32},
                   "quantization_config.group_size is not implemented")
    import shutil

    native = tmp_path / "llama_mxfp4"
    shutil.copytree(tiny_llama, native)
    assert_refused(native, MXFP4_CONFIG, "loads through the Transformers fallback only")
    with pytest.raises(ValueError, match="quantization='mxfp4' needs a checkpoint"):
        make_llm(tiny_llama, quantization="mxfp4")
