"""CPU attention: the csrc native ops (vllm_lite._C) against the torch reference backend, on the
demo model's shapes (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64, block size 16,
30 layers), in float32 or bfloat16 (query, keys, values and KV cache alike).

Per case it times one step's metadata build and one layer's forward (cache write + attention),
and reports the step's attention cost, build + 30 layers, and the KV bytes the layer's attention
reads (every row's context, K and V) per second of the native forward. With --e2e it also runs
the demo model itself (64 prompts of 256-511 random tokens, 32 greedy tokens each) with each
backend. With --cold it times the native decode op alone as the engine meets it: 64 sequences
over 30 layer caches used in turn, so each layer's cache is cold (the --dtype cache and an
int8_per_token_head one). Results also go to benchmarks/results/attention_cpu.json
(attention_cpu_bfloat16.json for bfloat16).

    python benchmarks/attention_cpu.py [--threads 1 2] [--iters 20] [--dtype float32|bfloat16] [--cold] [--e2e]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from vllm_lite.attention.backend import AttentionBackend, CommonAttentionMetadata
from vllm_lite import _custom_ops as cpu_native
from vllm_lite.attention.torch_backend import TorchAttentionBackend

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 9, 3, 64, 16, 30
RESULTS = Path(__file__).parent / "results"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# name -> (number of decode rows, context range, prefill rows: (context, query_len) each)
CASES = {
    "decode 64 seqs, ctx 256-512": (64, (256, 512), []),
    "decode 8 seqs, ctx 256-512": (8, (256, 512), []),
    "decode 16 seqs, ctx 1024-2048": (16, (1024, 2048), []),
    "mixed: 60 decodes + 2x128 prefill": (60, (256, 512), [(0, 128), (64, 128)]),
}


def make_step(num_decodes: int, context_range: tuple[int, int], prefills: list[tuple[int, int]],
              dtype: torch.dtype = torch.float32,
              seed: int = 0) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A scheduled step as the model runner builds it: prefill rows first, then decodes, each
    sequence on randomly placed blocks of a cache just large enough."""
    rng = np.random.default_rng(seed)
    specs = list(prefills) + [(int(c), 1) for c in rng.integers(*context_range, size=num_decodes)]
    blocks_per_seq = [-(-(c + q) // BLOCK_SIZE) for c, q in specs]
    num_blocks = 1 + sum(blocks_per_seq)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    block_table = np.zeros((len(specs), max(blocks_per_seq)), dtype=np.int32)
    slots, query_lens, seq_lens = [], [], []
    for row, ((context, query_len), nb) in enumerate(zip(specs, blocks_per_seq)):
        block_table[row, :nb] = [free.pop() for _ in range(nb)]
        pos = np.arange(context, context + query_len)
        slots.append(block_table[row, pos // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + pos % BLOCK_SIZE)
        query_lens.append(query_len)
        seq_lens.append(context + query_len)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_lens_np = np.array(seq_lens, dtype=np.int32)
    num_tokens = int(query_start_loc[-1])
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(query_start_loc), seq_lens=torch.from_numpy(seq_lens_np),
        block_table=torch.from_numpy(block_table), slot_mapping=torch.from_numpy(np.concatenate(slots)),
        query_start_loc_np=query_start_loc, seq_lens_np=seq_lens_np, num_actual_tokens=num_tokens,
        max_query_len=max(query_lens), block_size=BLOCK_SIZE,
    )
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(num_tokens, NUM_Q_HEADS, HEAD_DIM, generator=gen)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    kv_cache = torch.randn(num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    return common, query.to(dtype), key.to(dtype), value.to(dtype), kv_cache.to(dtype)


def kv_bytes_read(step) -> int:
    """K and V bytes of every row's context (what one layer's attention reads from the cache)."""
    common, kv_cache = step[0], step[4]
    return int(common.seq_lens_np.sum()) * 2 * NUM_KV_HEADS * HEAD_DIM * kv_cache.element_size()


def time_backend(backend: AttentionBackend, step, iters: int) -> tuple[float, float, torch.Tensor]:
    """Median seconds of (build, one layer's forward), and the output."""
    common, query, key, value, kv_cache = step
    scale = HEAD_DIM ** -0.5
    builds, forwards = [], []
    for _ in range(iters + 2):  # the first two are warm-up
        start = time.perf_counter()
        metadata = backend.build(common)
        built = time.perf_counter()
        out = backend.forward(query, key, value, kv_cache, metadata, scale)
        done = time.perf_counter()
        builds.append(built - start)
        forwards.append(done - built)
    return statistics.median(builds[2:]), statistics.median(forwards[2:]), out


def cold_layer_caches(kv_cache: torch.Tensor, kind: str, seed: int = 1) -> list[torch.Tensor]:
    """NUM_LAYERS caches shaped like `kv_cache` (random rows; `kind` "int8" quantizes them into
    int8_per_token_head caches), so that cycling through them evicts each layer's cache from the
    CPU's caches before its next use, as in the engine."""
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(NUM_LAYERS):
        rows = torch.randn(kv_cache.shape, generator=gen)
        if kind == "int8":
            cache = torch.empty(*kv_cache.shape[:-1], HEAD_DIM + 4, dtype=torch.int8)
            keys = rows[:, 0].reshape(-1, NUM_KV_HEADS, HEAD_DIM)  # slot = block * block_size + offset
            values = rows[:, 1].reshape(-1, NUM_KV_HEADS, HEAD_DIM)
            cpu_native.reshape_and_cache_int8(keys, values, cache, torch.arange(keys.shape[0]))
            caches.append(cache)
        else:
            caches.append(rows.to(kv_cache.dtype))
    return caches


def time_cold_decode(dtype: torch.dtype, kind: str, reps: int) -> float:
    """Best ms per layer of the native decode op for 64 sequences of 256-512 cached tokens,
    cycling through NUM_LAYERS caches (the engine's access pattern: every layer's cache is cold)."""
    common, query, _, _, kv_cache = make_step(64, (256, 512), [], dtype)
    caches = cold_layer_caches(kv_cache, kind)
    query = query.float() if kind == "int8" else query
    out = torch.empty_like(query)
    block_table, seq_lens = common.block_table.to(torch.int32), common.seq_lens.to(torch.int32)
    decode = cpu_native.paged_attention_decode_int8 if kind == "int8" else cpu_native.paged_attention_decode
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for cache in caches:
            decode(out, query, cache, block_table, seq_lens, HEAD_DIM ** -0.5)
        best = min(best, (time.perf_counter() - start) / NUM_LAYERS)
    return 1e3 * best


def run_demo_model(backend: str, threads: int) -> float:
    """Output tokens per second of the demo model (SmolLM2-135M) with one attention backend."""
    from vllm_lite import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(None, max_model_len=1024, max_num_seqs=64, attention_backend=backend, multiprocess=False)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 20000, size=int(rng.integers(256, 512))).tolist()}
               for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return 64 * 32 / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--e2e", action="store_true", help="also time the demo model end to end (minutes)")
    parser.add_argument("--cold", action="store_true",
                        help="also time the decode op over 30 layer caches (each cold, as in the engine), "
                             "for --dtype's cache and the int8_per_token_head one")
    args = parser.parse_args()
    if not cpu_native.is_available():
        raise SystemExit("vllm_lite._C is not built (make setup, or python setup.py build_ext --inplace); "
                         "without it the CPU backend is the torch reference and there is nothing to compare")
    from vllm_lite.attention.cpu_native_backend import CpuNativeAttentionBackend

    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, (num_decodes, context_range, prefills) in CASES.items():
            step = make_step(num_decodes, context_range, prefills, DTYPES[args.dtype])
            t_build, t_fwd, ref = time_backend(TorchAttentionBackend(), step, args.iters)
            n_build, n_fwd, out = time_backend(CpuNativeAttentionBackend(), step, args.iters)
            torch_step, native_step = t_build + NUM_LAYERS * t_fwd, n_build + NUM_LAYERS * n_fwd
            rows.append({
                "case": name, "threads": threads,
                "torch_layer_ms": 1e3 * t_fwd, "native_layer_ms": 1e3 * n_fwd,
                "torch_step_ms": 1e3 * torch_step, "native_step_ms": 1e3 * native_step,
                "speedup": torch_step / native_step,
                "native_kv_gb_per_s": kv_bytes_read(step) / n_fwd / 1e9,
                "max_abs_diff": (out.float() - ref.float()).abs().max().item(),
            })
    cold = []
    if args.cold:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for kind in (args.dtype, "int8"):
                cold.append({"cache": "int8_per_token_head" if kind == "int8" else kind, "threads": threads,
                             "layer_ms": time_cold_decode(DTYPES[args.dtype], kind, max(4, args.iters // 2))})
    e2e = {}
    if args.e2e:
        threads = max(args.threads)
        e2e = {"threads": threads, **{backend: run_demo_model(backend, threads) for backend in ("torch", "cpu_native")}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
    (RESULTS / f"attention_cpu{suffix}.json").write_text(json.dumps({
        "shapes": dict(q_heads=NUM_Q_HEADS, kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                       layers=NUM_LAYERS),
        "dtype": args.dtype, "rows": rows, "cold_decode": cold, "demo_model_tokens_per_s": e2e}, indent=1))
    print(f"dtype {args.dtype}")
    header = (f"{'case':<36} {'thr':>3} {'torch/layer':>12} {'native/layer':>13} "
              f"{'torch/step':>11} {'native/step':>12} {'speed-up':>9} {'native KV':>10} {'max|diff|':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['case']:<36} {r['threads']:>3} {r['torch_layer_ms']:>10.3f}ms {r['native_layer_ms']:>11.3f}ms "
              f"{r['torch_step_ms']:>9.1f}ms {r['native_step_ms']:>10.1f}ms {r['speedup']:>8.1f}x "
              f"{r['native_kv_gb_per_s']:>5.1f} GB/s {r['max_abs_diff']:>10.1e}")
    if cold:
        print("\ndecode op, 64 sequences of 256-512 tokens, cycling through 30 layer caches (each cold):")
        print(f"{'KV cache':<22} {'thr':>3} {'ms/layer':>9}")
        for r in cold:
            print(f"{r['cache']:<22} {r['threads']:>3} {r['layer_ms']:>9.3f}")
    if e2e:
        print(f"\ndemo model, 64 prompts x 32 tokens, {e2e['threads']} threads (prefill included):")
        print(f"{'backend':<12} {'tok/s':>8}")
        for backend in ("torch", "cpu_native"):
            print(f"{backend:<12} {e2e[backend]:>8.1f}")
        print(f"{'speed-up':<12} {e2e['cpu_native'] / e2e['torch']:>7.1f}x")


if __name__ == "__main__":
    main()
