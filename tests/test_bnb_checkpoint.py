"""bitsandbytes 4-bit checkpoints, as transformers saves them (`BitsAndBytesConfig(load_in_4bit=True)`:
QLoRA trainers, unsloth's "-bnb-4bit" releases): made here by bitsandbytes itself from the tiny
models, read into float weights equal to bitsandbytes' own `dequantize_4bit`, and generating the
greedy tokens transformers generates with those weights (NF4 with double quantization, FP4
without, a Qwen3, TP=2): what vLLM's bitsandbytes kernels compute, which dequantize and multiply
in the model's dtype. (transformers' bitsandbytes model itself is no fp32 reference on CPU: its
one-row matmul runs bitsandbytes' bf16 CPU kernel.) What this engine cannot reproduce is refused
by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from safetensors.torch import save_file

from checkpoint_copies import edited_copy
from hf_reference import hf_greedy
from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.config import EngineArgs
from vllm_lite.model.checkpoint_files import iterate_weights
from vllm_lite.model.layers.bnb_weights import dequantized_bnb_weights

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100, 200, 300]]
NEW_TOKENS = 10
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def quantized(model: Path, out: Path, quant_type: str, double_quant: bool) -> Path:
    """The checkpoint bitsandbytes makes of `model` (transformers' save_pretrained), with its tokenizer."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.float32)
    AutoModelForCausalLM.from_pretrained(model, quantization_config=config, device_map="cpu").save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (model / name).exists():
            shutil.copy(model / name, out / name)
    return out


def bitsandbytes_dequantized(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, its 4-bit weights dequantized by bitsandbytes itself."""
    from bitsandbytes.functional import QuantState, dequantize_4bit

    tensors = dict(iterate_weights(checkpoint))
    packed = [name for name, t in tensors.items() if name.endswith(".weight") and t.get_dtype() == "U8"]
    weights = {name: t[:] for name, t in tensors.items() if not any(name.startswith(p + ".") for p in packed)}
    for name in packed:
        state = {key: tensors[key][:] for key in tensors if key.startswith(name + ".")}
        weights[name] = dequantize_4bit(tensors[name][:], QuantState.from_dict(state, torch.device("cpu")))
    return weights


def transformers_greedy(checkpoint: Path, tmp_path: Path) -> list[list[int]]:
    """transformers' greedy tokens with the weights bitsandbytes dequantizes (a float checkpoint)."""
    out = edited_copy(checkpoint, tmp_path / "dequantized", lambda config: config.pop("quantization_config"))
    save_file({name: t.contiguous() for name, t in bitsandbytes_dequantized(checkpoint).items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return hf_greedy(out, PROMPTS, NEW_TOKENS)


def engine_greedy(checkpoint: Path, **engine_args) -> list[list[int]]:
    llm = make_llm(checkpoint, **engine_args)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.fixture(scope="module")
def nf4_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantized(tiny_llama, tmp_path_factory.mktemp("nf4_llama"), "nf4", True)


@pytest.mark.parametrize(("quant_type", "double_quant"), [("nf4", True), ("fp4", False)])
def test_weights_are_bitsandbytes_own_dequantization(tiny_llama: Path, tmp_path: Path, quant_type: str,
                                                     double_quant: bool) -> None:
    checkpoint = quantized(tiny_llama, tmp_path, quant_type, double_quant)
    ours = {name: torch.as_tensor(t[:]) for name, t in dequantized_bnb_weights(iterate_weights(checkpoint))}
    expected = bitsandbytes_dequantized(checkpoint)
    assert sorted(ours) == sorted(expected)  # every state tensor consumed
    packed = [name for name, t in iterate_weights(checkpoint) if name.endswith(".weight") and t.get_dtype() == "U8"]
    assert len(packed) == 2 * 7  # every linear layer of the two decoder layers
    for name, weight in expected.items():
        assert torch.equal(ours[name], weight), name


@pytest.mark.parametrize(("quant_type", "double_quant"), [("nf4", True), ("fp4", False)])
def test_tokens_are_transformers_bitsandbytes_models(tiny_llama: Path, tmp_path: Path, quant_type: str,
                                                     double_quant: bool) -> None:
    checkpoint = quantized(tiny_llama, tmp_path / "checkpoint", quant_type, double_quant)
    # (vLLM's older spelling asked for load_format="bitsandbytes" too)
    assert engine_greedy(checkpoint, quantization="bitsandbytes", load_format="bitsandbytes") == \
        transformers_greedy(checkpoint, tmp_path)


def test_another_family_and_tensor_parallel(tiny_qwen3: Path, nf4_llama: Path, tmp_path: Path) -> None:
    qwen3 = quantized(tiny_qwen3, tmp_path / "qwen3", "nf4", True)
    assert engine_greedy(qwen3) == transformers_greedy(qwen3, tmp_path / "qwen3_reference")
    assert engine_greedy(nf4_llama, multiprocess=True, tensor_parallel_size=2) == \
        transformers_greedy(nf4_llama, tmp_path / "llama_reference")


@pytest.mark.parametrize(("changes", "message"), [
    ({"load_in_8bit": True, "_load_in_8bit": True, "load_in_4bit": False, "_load_in_4bit": False},
     "load_in_8bit .* is not implemented here"),
    ({"bnb_4bit_quant_storage": "bfloat16"}, "bnb_4bit_quant_storage='bfloat16' is not supported"),
    ({"bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type='int4' is not supported"),
    ({"bnb_4bit_new_knob": 1}, "bnb_4bit_new_knob is not implemented; refusing to load rather than ignore it"),
])
def test_what_cannot_be_reproduced_is_refused(nf4_llama: Path, tmp_path: Path, changes: dict, message: str) -> None:
    checkpoint = edited_copy(nf4_llama, tmp_path / "changed", lambda config: config["quantization_config"].update(changes))
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(checkpoint)).create_engine_config()


def test_bitsandbytes_on_a_float_checkpoint_is_refused(tiny_llama: Path) -> None:
    """vLLM quantizes a float checkpoint in flight with quantization="bitsandbytes"; not here."""
    with pytest.raises(ValueError, match="quantization='bitsandbytes' needs a checkpoint whose config.json has a "
                                         "bitsandbytes quantization_config"):
        EngineArgs(model=str(tiny_llama), quantization="bitsandbytes").create_engine_config()
    with pytest.raises(ValueError, match="quantizing a float checkpoint with bitsandbytes at load is not implemented"):
        EngineArgs(model=str(tiny_llama), load_format="bitsandbytes").create_engine_config()
