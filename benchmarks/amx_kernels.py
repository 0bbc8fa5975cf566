"""The csrc AMX-BF16 kernels against what they replace, on the demo model's shapes (SmolLM2-135M:
hidden 576, intermediate 1536, 9 query / 3 KV heads of 64, vocabulary 49,152, 30 layers):

1. every linear layer of one decode step (30 x qkv, o, gate_up, down, then the LM head; a weight
   per layer, so they stream from memory as in the engine) at R rows: oneDNN's packed matmul
   (`torch.ops.mkldnn._linear_pointwise`) against `amx_bf16_linear` over the same memory;
2. one layer's prefill attention for a step of 6 prompts of 340 tokens over a paged bf16 cache
   (block size 16, blocks in random order): the torch path (gather + SDPA per prompt) against
   `paged_attention_prefill`.

Interleaved (A B A B ...), best of --rounds; needs a CPU with AMX-BF16 and the csrc build.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/amx_kernels.py [--rows 1 8 32 64 128] [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse

import torch
from benchlib import best_seconds, machine_line, print_table

from vllm_lite import _custom_ops as cpu_native
from vllm_lite.attention.torch_backend import PrefillSeq, prefill_attention
from vllm_lite.model.layers.linear import prepack

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 576, 1536, 49152, 30
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LAYER_SHAPES = ((HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN),
                (HIDDEN, INTERMEDIATE))  # (out, in): qkv, o, gate_up, down


def decode_linears(rows_list: list[int], rounds: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(0)
    shapes = [*(shape for _ in range(LAYERS) for shape in LAYER_SHAPES), (VOCAB, HIDDEN)]
    weights = [(inp, out, prepack(torch.randn(out, inp, generator=gen).bfloat16())) for out, inp in shapes]
    weight_bytes = sum(packed.tiles.numel() * 2 for _, _, packed in weights)
    table = []
    for rows in rows_list:
        inputs = {size: torch.randn(rows, size, generator=gen).bfloat16() for size in (HIDDEN, INTERMEDIATE)}
        layers = [(inputs[inp], out, packed) for inp, out, packed in weights]

        def onednn() -> None:
            for x, _, packed in layers:
                torch.ops.mkldnn._linear_pointwise(x, packed.onednn, None, "none", [], "")

        def tiles() -> None:
            for x, out, packed in layers:
                torch.ops.vllm_lite_C.amx_bf16_linear(x, packed.tiles, out, None)

        best = best_seconds({"onednn": onednn, "tiles": tiles}, rounds)
        table.append((rows, 1e3 * best["onednn"], 1e3 * best["tiles"], best["onednn"] / best["tiles"],
                      weight_bytes / best["tiles"] / 1e9))
    return table


def prefill_attention_step(rounds: int, prompts: int = 6, prompt_len: int = 340) -> tuple:
    gen = torch.Generator().manual_seed(1)
    blocks_per_prompt = -(-prompt_len // BLOCK)
    num_blocks = prompts * blocks_per_prompt + 1
    cache = torch.randn(num_blocks, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).int().view(prompts, blocks_per_prompt)
    query = torch.randn(prompts * prompt_len, Q_HEADS, HEAD_DIM, generator=gen).bfloat16()
    scale = HEAD_DIM ** -0.5
    seqs = [PrefillSeq(p * prompt_len, prompt_len, prompt_len, order[p].long(), None) for p in range(prompts)]
    starts = torch.arange(prompts, dtype=torch.int32) * prompt_len
    lens = torch.full((prompts,), prompt_len, dtype=torch.int32)
    out = torch.empty_like(query)

    def sdpa() -> None:
        for seq in seqs:
            end = seq.token_start + seq.query_len
            out[seq.token_start:end] = prefill_attention(query[seq.token_start:end], cache, seq, scale)

    def native() -> None:
        cpu_native.paged_attention_prefill(out, query, cache, order, starts, lens, lens, scale)

    best = best_seconds({"sdpa": sdpa, "native": native}, rounds)
    flops = prompts * 2 * 2 * (prompt_len * (prompt_len + 1) / 2) * HEAD_DIM * Q_HEADS
    return (f"{prompts} x {prompt_len} tokens", 1e3 * best["sdpa"], 1e3 * best["native"],
            best["sdpa"] / best["native"], flops / best["native"] / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not cpu_native.amx_bf16_usable():
        raise SystemExit("needs a CPU with AMX-BF16 and the csrc extension built")
    torch.set_num_threads(args.threads)
    print(machine_line())
    print(f"\n1. all linear layers of one decode step ({LAYERS} layers + LM head), {args.threads} threads, "
          f"best of {args.rounds}")
    print_table(("rows", "oneDNN (ms)", "AMX tiles (ms)", "speed-up", "tiles GB/s"),
                decode_linears(args.rows, args.rounds))
    print(f"\n2. one layer's prefill attention, {Q_HEADS}/{KV_HEADS} heads of {HEAD_DIM}, block size {BLOCK}")
    print_table(("step", "torch SDPA (ms)", "native (ms)", "speed-up", "native GFLOP/s"),
                [prefill_attention_step(args.rounds)])


if __name__ == "__main__":
    main()
