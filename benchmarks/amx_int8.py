"""The int8 linear layers on AMX-INT8 tiles (csrc/int8_linear_ops.cpp, what quantization="int8"
runs on a CPU with AMX-INT8): the matmul against torch._int_mm on the same int8 values; the
layer as one op (`amx_int8_linear`) against its three ops in turn (quantize, matmul, rescale)
and against the bf16 layer it replaces, on the demo's and a 1B model's shapes; then, end to end,
the decode and prefill of a random-weight Llama of 1B shape (hidden 2,048, 8 layers) in bf16 and
in bf16 + int8.

    python benchmarks/amx_int8.py [--threads 2] [--skip-engine]

To compare with a build without the tiles, run the engine part with `PYTHONPATH` pointing at each
checkout, alternating.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from int8_linear import median_seconds

from vllm_lite import _custom_ops as ops
from vllm_lite.cpu_info import cpu_summary

SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008), (2048, 2048), (960, 576), (3072, 576))
ROWS = (1, 8, 64, 512, 2048)


def kernel_table(repeats: int) -> None:
    from vllm_lite.model.layers.quantization import pack_int8_tiles
    from vllm_lite.worker.worker import keep_freed_memory_in_heap

    # As in the engine's worker: without it a large product's int32 output (32 MB at 2,048 x
    # 4,096) is mapped afresh and page-faulted in on every call, which both kernels would pay.
    keep_freed_memory_in_heap()
    print(f"{'shape (N x K)':>14} {'rows':>5} {'_int_mm (us)':>13} {'tiles (us)':>11} {'speed-up':>9}")
    for out_features, in_features in SHAPES:
        q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
        tiles, transposed = pack_int8_tiles(q), q.t()
        for rows in ROWS:
            x = torch.randint(-127, 128, (rows, in_features), dtype=torch.int8)
            n = repeats if rows <= 64 else max(3, repeats // 4)
            plain = median_seconds(lambda: torch._int_mm(x, transposed), n)
            packed = median_seconds(lambda: ops.amx_int8_mm(x, tiles, out_features), n)
            print(f"{out_features:>6} x {in_features:<5} {rows:>5} {plain * 1e6:>13.0f} {packed * 1e6:>11.0f} "
                  f"{plain / packed:>8.2f}x")


LAYER_SHAPES = ((960, 576), (3072, 576), (576, 1536), (4096, 2048), (11264, 2048), (2048, 5632))


def layer_table(repeats: int) -> None:
    from vllm_lite.model.layers.linear import linear, prepack
    from vllm_lite.model.layers.quantization import Int8Weight

    print(f"{'shape (N x K)':>14} {'rows':>5} {'three ops (us)':>15} {'one op (us)':>12} {'speed-up':>9} "
          f"{'bf16 layer (us)':>16} {'bf16 / int8':>12}")
    for out_features, in_features in LAYER_SHAPES:
        weight = torch.randn(out_features, in_features).bfloat16()
        packed, quantized = prepack(weight), Int8Weight.quantize(weight)
        for rows in (1, 8, 64, 256):
            x = torch.randn(rows, in_features).bfloat16()

            def three_ops() -> torch.Tensor:
                xq, x_scale = ops.quantize_rows_int8(x)
                acc = ops.amx_int8_mm(xq, quantized.tiles, out_features)
                return ops.dequantize_int32(acc, x_scale, quantized.scale, None, x.dtype)

            separate = median_seconds(three_ops, repeats)
            fused = median_seconds(lambda: ops.amx_int8_linear(x, quantized.tiles, quantized.scale, None), repeats)
            bf16 = median_seconds(lambda: linear(x, weight, packed), repeats)
            print(f"{out_features:>6} x {in_features:<5} {rows:>5} {separate * 1e6:>15.1f} {fused * 1e6:>12.1f} "
                  f"{separate / fused:>8.2f}x {bf16 * 1e6:>16.1f} {bf16 / fused:>11.2f}x")


def one_billion_shaped_model(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def engine_table(model: Path) -> None:
    from vllm_lite import LLM, SamplingParams

    print(f"{'precision':>12} {'1 request (ms/step)':>20} {'8 requests (ms/step)':>21} {'prefill 2 x 900 (ms)':>21}")
    for precision, extra in (("bf16", {}), ("bf16 + int8", {"quantization": "int8"})):
        llm = LLM(str(model), dtype="bfloat16", max_model_len=1024, skip_tokenizer_init=True, **extra)
        try:
            steps = []
            for count in (1, 8):
                prompts = [{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(count)]
                llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
                start = time.perf_counter()
                llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
                steps.append((time.perf_counter() - start) / 64 * 1e3)
            long = [{"prompt_token_ids": [5 + i % 900 for i in range(900)]} for _ in range(2)]
            start = time.perf_counter()
            llm.generate(long, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            prefill = (time.perf_counter() - start) * 1e3
        finally:
            llm.shutdown()
        print(f"{precision:>12} {steps[0]:>20.1f} {steps[1]:>21.1f} {prefill:>21.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_summary()}; AMX-INT8: {'yes' if ops.amx_int8_usable() else 'no'}; {args.threads} threads")
    if ops.amx_int8_usable():
        kernel_table(args.repeats)
        layer_table(args.repeats * 5)
    if not args.skip_engine:
        with tempfile.TemporaryDirectory(prefix="vllm-lite-1b-") as folder:
            engine_table(one_billion_shaped_model(Path(folder)))


if __name__ == "__main__":
    main()
