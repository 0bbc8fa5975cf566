"""vLLM's RLHF pattern on vllm_lite: a worker extension (`worker_extension_cls`) takes a trainer's
new weights through `collective_rpc`, the engine paused around the update and its weights
labelled (`update_weight_version`), so each output says which weights sampled its tokens.

    python examples/rlhf_weight_update.py                   # the demo model's float weights
    python examples/rlhf_weight_update.py /path/to/model    # a safetensors model folder
    # on a server: VLLM_SERVER_DEV_MODE=1 vllm-lite serve MODEL --worker-extension-cls MODULE.WeightSync,
    # then POST /pause, /collective_rpc {"method": ..., "args": [...]}, /reset_prefix_cache, /resume
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from vllm_lite import LLM, SamplingParams


class WeightSync:
    """Mixed into every worker (rank). `self.model_runner.model.load_weights` takes the
    checkpoint's names and tensors, as vLLM's models do; each rank loads its own slice."""

    def update_weights(self, weights: dict[str, torch.Tensor]) -> int:
        return len(self.model_runner.model.load_weights(weights=list(weights.items())))


def trainer_step(model_dir: Path) -> dict[str, torch.Tensor]:
    """Stands in for a training step: the checkpoint's LM-side weights, one layer's MLP scaled."""
    weights = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    name = next(n for n in weights if n.endswith("layers.0.mlp.down_proj.weight"))
    return {name: weights[name] * 0.5}


def main(model: str | None) -> None:
    if model is None:
        from vllm_lite.gguf_convert import ensure_demo_model

        model = str(ensure_demo_model())  # (the float folder: a GGUF file's Q4_1 blocks take no update)
    llm = LLM(model, max_model_len=1024, worker_extension_cls=f"{Path(__file__).stem}.WeightSync")
    params = SamplingParams(temperature=0.0, max_tokens=20)
    prompt = "The capital of France is"
    try:
        print("before:", repr(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text))
        llm.sleep(level=0)  # (nothing runs while the weights change)
        loaded = llm.collective_rpc("update_weights", args=(trainer_step(Path(model)),))
        llm.update_weight_version("step-1")
        llm.reset_prefix_cache()  # (cached prompts were computed with the old weights)
        llm.wake_up()
        output = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        print(f"{loaded[0]} parameter(s) loaded on each of {len(loaded)} rank(s); after:", repr(output.text))
        print("weights that sampled it:", output.weight_versions)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
