"""A/B of a change to the engine's per-step work, inside one engine core: each steady decode step
runs the old or the new code by a random draw, so both sides see the same VM phases (this VM's
speed drifts by tens of percent within minutes; runs of base against new in turn show mostly
that drift).

A variant is a Python file defining `setup(core: EngineCore) -> Callable[[bool], None]`: it may
replace methods on the core's objects, and the callable it returns switches the new code on
(True) or off (False) before a step. Without `--variant`, nothing is switched: the two sides
differ by the noise alone (the floor to read a result against).

    python benchmarks/step_ab.py [--variant FILE] [--requests 64 1024] [--steps 400]

The tiny model of benchmarks/engine_overhead.py, greedy requests of 400 tokens, 2 threads, the
engine-core loop's thread state held (`Executor.step_thread_mode`). Prints, per request count,
the median per side of each step's time outside the forward pass and sampling (the model's
`forward`, `ModelRunner._sample` and `ModelRunner.finish` timed and subtracted) and outside the
forward pass only; then the means, which count the steps where requests cross a block boundary
(a block taken, a full one registered: a quarter of the steps at 1,024 requests, none of them
the median step).

Variants kept for the measurements in benchmarks/RESULTS.md: benchmarks/step_variants/.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from benchlib import RESULTS_DIR, print_table, random_workload, tiny_llama
from engine_overhead import PROMPT_LEN, VOCAB, PhaseTimer, limits_for

from vllm_lite.config import EngineArgs
from vllm_lite.engine.core import EngineCore
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.wire import EngineCoreRequest

OUTPUT_LEN = 400  # past the window: no request finishes inside it


def load_setup(path: str | None) -> Callable[[EngineCore], Callable[[bool], None]]:
    if path is None:
        return lambda core: (lambda on: None)
    spec = importlib.util.spec_from_file_location("step_ab_variant", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--variant {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.setup


def run(num_requests: int, setup: Callable[[EngineCore], Callable[[bool], None]], steps: int,
        seed: int) -> dict[str, float]:
    model = tiny_llama(RESULTS_DIR / "tiny_llama_h128_l2_v8192_t8192", truncate_tokenizer=True)
    workload = random_workload(num_requests, PROMPT_LEN, (OUTPUT_LEN, OUTPUT_LEN), VOCAB, seed=num_requests)
    limits = limits_for(num_requests, OUTPUT_LEN, 2)
    torch.set_num_threads(limits.threads)
    args = EngineArgs(model=str(model), max_model_len=limits.max_model_len, max_num_seqs=limits.max_num_seqs,
                      max_num_batched_tokens=limits.max_num_batched_tokens,
                      kv_cache_memory_bytes=int(limits.kv_cache_gib * 1024 ** 3), skip_tokenizer_init=True)
    core = EngineCore(args.create_engine_config())
    try:
        toggle = setup(core)
        runner = core.executor.worker.model_runner
        timer = PhaseTimer()
        timer.wrap(runner.model, "forward", "forward")
        timer.wrap(runner, "_sample", "sampling")
        timer.wrap(runner, "finish", "sampling")
        with core.executor.step_thread_mode():
            for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.max_tokens)):
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
                core.add_request(EngineCoreRequest(f"p{i}", np.asarray(prompt, dtype=np.int32), params, (),
                                                   time.time(), max_tokens))
            outputs = core.step()
            while len(outputs.req_ids) < num_requests:  # prefill
                outputs = core.step()
            return measure(core, timer, toggle, steps, np.random.default_rng(seed))
    finally:
        core.shutdown()


def measure(core: EngineCore, timer: PhaseTimer, toggle: Callable[[bool], None], steps: int,
            rng: np.random.Generator) -> dict[str, float]:
    outside_model: dict[bool, list[float]] = {False: [], True: []}
    outside_forward: dict[bool, list[float]] = {False: [], True: []}
    timer.enabled = True
    for _ in range(steps):
        on = bool(rng.integers(2))
        toggle(on)
        forward, sampling = timer.seconds["forward"], timer.seconds["sampling"]
        start = time.perf_counter()
        core.step()
        seconds = time.perf_counter() - start
        forward, sampling = timer.seconds["forward"] - forward, timer.seconds["sampling"] - sampling
        outside_model[on].append(seconds - forward - sampling)
        outside_forward[on].append(seconds - forward)
    return {f"{what} {side} {stat}": 1e6 * float(reduce(samples[on]))
            for what, samples in (("outside model", outside_model), ("outside forward", outside_forward))
            for side, on in (("off", False), ("on", True))
            for stat, reduce in (("median", np.median), ("mean", np.mean))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", help="a Python file defining setup(core) -> toggle(on)")
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2, got {args.steps}")
    if args.variant is not None and not Path(args.variant).is_file():
        parser.error(f"--variant {args.variant}: no such file")
    setup = load_setup(args.variant)
    results = [(num_requests, run(num_requests, setup, args.steps, args.seed)) for num_requests in args.requests]
    print(f"variant: {args.variant or 'none (the noise floor)'}; {args.steps} steady steps each, old or new by a "
          f"random draw per step; us per step")
    for stat, note in (("median", "medians: the steady step"),
                       ("mean", "means: with the steps that cross a block boundary (a block taken, one registered)")):
        print(f"\n{note}")
        print_table(("requests", "outside model: off", "on", "difference", "outside forward: off", "on", "difference"),
                    [(num_requests, *_columns(result, "outside model", stat, ".1f"),
                      *_columns(result, "outside forward", stat, ".0f")) for num_requests, result in results])


def _columns(result: dict[str, float], what: str, stat: str, spec: str) -> tuple[str, str, str]:
    off, on = result[f"{what} off {stat}"], result[f"{what} on {stat}"]
    return format(off, spec), format(on, spec), format(on - off, "+" + spec)


if __name__ == "__main__":
    main()
