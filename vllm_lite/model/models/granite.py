"""IBM Granite (3.x dense): the Llama block with four constant factors (config.json's
`embedding_multiplier`, `attention_multiplier` as the softmax scale, `residual_multiplier` on each
attention and MLP output, `logits_scaling` dividing the logits)."""

from __future__ import annotations

from vllm_lite.config import HFModelConfig
from vllm_lite.model.models.llama import LlamaForCausalLM, Scales


class GraniteForCausalLM(LlamaForCausalLM):
    @staticmethod
    def scales(config: HFModelConfig) -> Scales:
        raw = config.raw
        logits = float(raw["logits_scaling"])
        if not logits > 0:
            raise ValueError(f"config.json: logits_scaling={logits!r} must be positive")
        return Scales(embedding=float(raw["embedding_multiplier"]), residual=float(raw["residual_multiplier"]),
                      attention=float(raw["attention_multiplier"]), logits=logits)
