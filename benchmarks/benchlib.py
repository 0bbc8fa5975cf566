"""What the benchmarks share: random workloads, model folders, running an engine (ours or a
peer's) as a subprocess on a job file, and printing tables.

Every engine runs in its own subprocess with the same thread count, model folder, prompts and
lengths, so figures from one run compare like with like. A runner script reads a job (JSON) and
writes a result (JSON); see benchmarks/runners/.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
RUNNERS_DIR = BENCH_DIR / "runners"
VLLM_CPU_VENV = BENCH_DIR / "peers" / ".venv-vllm-cpu"
OPENVINO_VENV = BENCH_DIR / "peers" / ".venv-openvino"
LLAMA_CPP_VENV = BENCH_DIR / "peers" / ".venv-llama-cpp"
KIB, GIB = 1024, 1024 ** 3


@dataclass(frozen=True, slots=True)
class Workload:
    """Token-id prompts and per-request output lengths (all generated with ignore_eos)."""
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_input_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)


def random_workload(num_requests: int, input_range: tuple[int, int], output_range: tuple[int, int],
                    vocab_size: int, seed: int = 0) -> Workload:
    """nano-vllm's shape: uniform random lengths (bounds included) and random token ids."""
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(input_range[0], input_range[1] + 1, num_requests)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, num_requests)
    # Ids below 100 hold the special tokens of most vocabularies; random text stays clear of them.
    prompts = [rng.integers(100, vocab_size, int(n)).tolist() for n in input_lens]
    return Workload(prompts, [int(n) for n in output_lens])


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Settings every engine in a comparison gets alike."""
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_gib: int
    threads: int


@dataclass(slots=True)
class RunResult:
    name: str
    elapsed_s: float
    num_requests: int
    input_tokens: int
    output_tokens: int
    outputs: list[list[int]] = field(default_factory=list)  # token ids of the first requests
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s


@dataclass(frozen=True, slots=True)
class Skipped:
    name: str
    reason: str


def vllm_cpu_python() -> Path | None:
    """The peer environment's interpreter (VLLM_CPU_PYTHON, or the one the peers/ script makes)."""
    configured = os.environ.get("VLLM_CPU_PYTHON")
    python = Path(configured) if configured else VLLM_CPU_VENV / "bin" / "python"
    return python if python.is_file() else None


def openvino_python() -> Path | None:
    """The OpenVINO GenAI peer's interpreter (OPENVINO_PYTHON, or the one the peers/ script makes)."""
    configured = os.environ.get("OPENVINO_PYTHON")
    python = Path(configured) if configured else OPENVINO_VENV / "bin" / "python"
    return python if python.is_file() else None


def llama_cpp_python() -> Path | None:
    """The llama.cpp peer's interpreter (LLAMA_CPP_PYTHON, or the one the peers/ script makes)."""
    configured = os.environ.get("LLAMA_CPP_PYTHON")
    python = Path(configured) if configured else LLAMA_CPP_VENV / "bin" / "python"
    return python if python.is_file() else None


BUSY_LOOP = "while True:\n    pass\n"


@contextlib.contextmanager
def background_load(enabled: bool) -> Iterator[None]:
    """One busy process (a Python spin loop, one core) beside whatever runs inside, when enabled:
    the fixed load under which engines are compared for contention."""
    if not enabled:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def run_runner(name: str, runner: str, job: dict[str, Any], python: Path | str | None = None,
               timeout_s: float = 3600, source: Path | None = None) -> dict[str, Any] | Skipped:
    """Run benchmarks/runners/<runner> on `job` in a subprocess; its result (JSON) as a dict.
    `source`: another checkout whose `vllm_lite` the runner imports (default: this one)."""
    python = python or sys.executable
    with tempfile.TemporaryDirectory(prefix="vllm-lite-bench-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        env = {**os.environ, "PYTHONPATH": str(source or BENCH_DIR.parent), "OMP_NUM_THREADS": str(job["threads"])}
        try:
            proc = subprocess.run([str(python), str(RUNNERS_DIR / runner), str(job_path), str(out_path)],
                                  env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return Skipped(name, f"timed out after {timeout_s:.0f} s")
        if proc.returncode != 0 or not out_path.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            print(f"[{name}] failed (exit {proc.returncode}):\n{tail}", file=sys.stderr)
            return Skipped(name, f"runner failed with exit code {proc.returncode} (log above)")
        return json.loads(out_path.read_text())


def run_engine(name: str, runner: str, job: dict[str, Any], python: Path | str | None = None,
               timeout_s: float = 3600, source: Path | None = None) -> RunResult | Skipped:
    """Run a throughput runner on `job` in a subprocess and read its result."""
    result = run_runner(name, runner, job, python, timeout_s, source)
    if isinstance(result, Skipped):
        return result
    run = RunResult(name=name, **result)
    print(f"[{name}] {run.output_tokens} tokens in {run.elapsed_s:.1f} s", file=sys.stderr, flush=True)
    return run


def engine_job(model: Path, workload: Workload, limits: EngineLimits, **options: Any) -> dict[str, Any]:
    return {"model": str(model), "prompts": workload.prompts, "max_tokens": workload.max_tokens,
            **asdict(limits), **options}


# ---- model folders ----------------------------------------------------------------------------

def demo_model() -> Path:
    """The converted demo model (SmolLM2-135M-Instruct, fp32 safetensors + tokenizer)."""
    from vllm_lite.gguf_convert import ensure_demo_model

    return ensure_demo_model()


def tiny_llama(out_dir: Path, hidden: int = 128, layers: int = 2, vocab: int = 8192,
               max_len: int = 2048, truncate_tokenizer: bool = False) -> Path:
    """A random-weight Llama with the demo model's tokenizer (ids above `vocab` never occur:
    prompts and samples stay below it). With `truncate_tokenizer`, the tokenizer keeps only the
    ids below `vocab` (and the merges between them), so that text prompts, as a serving
    benchmark sends them, tokenize inside the model's vocabulary."""
    if (out_dir / "config.json").is_file():
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True, dtype="float32")
    torch.manual_seed(0)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(config).save_pretrained(tmp)
    source = demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, tmp / name)
    if truncate_tokenizer:
        _truncate_bpe_tokenizer(tmp / "tokenizer.json", vocab)
    tmp.rename(out_dir)
    return out_dir


def _truncate_bpe_tokenizer(path: Path, vocab_size: int) -> None:
    """Keep the BPE vocabulary entries with ids below `vocab_size` and the merges whose parts
    and result all stay: encoding then never yields a larger id."""
    spec = json.loads(path.read_text())
    model = spec["model"]
    model["vocab"] = {token: i for token, i in model["vocab"].items() if i < vocab_size}
    kept = model["vocab"]
    model["merges"] = [merge for merge in model["merges"]
                       if (parts := merge if isinstance(merge, list) else merge.split(" "))
                       and parts[0] in kept and parts[1] in kept and parts[0] + parts[1] in kept]
    spec["added_tokens"] = [token for token in spec["added_tokens"] if token["id"] < vocab_size]
    path.write_text(json.dumps(spec, ensure_ascii=False))


def count_parameters(model_dir: Path) -> int:
    """Parameters stored in the folder's safetensors files (tied embeddings counted once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "np") as f:
            for name in f.keys():
                total += int(np.prod(f.get_slice(name).get_shape()))
    return total


# ---- reporting -------------------------------------------------------------------------------

def best_seconds(runs: dict[str, Callable[[], Any]], rounds: int, evict_bytes: int = 0) -> dict[str, float]:
    """Each callable's best wall time over `rounds`, run alternately after one warm-up each; with
    `evict_bytes`, that many bytes are written before every timed call (caches as cold as a
    forward pass leaves them)."""
    for run in runs.values():
        run()
    evict = np.zeros(evict_bytes // 4, dtype=np.float32)
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, run in runs.items():
            evict.fill(1.0)
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths)))
    print(line)
    print("-" * len(line))
    for row in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def write_results(name: str, data: Any) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def machine_line() -> str:
    import platform

    import torch

    from vllm_lite.cpu_info import cpu_summary

    return (f"{platform.node()}: {os.cpu_count()} CPUs ({cpu_summary()}), Python {platform.python_version()}, "
            f"torch {torch.__version__}, numpy {np.__version__}")


# ---- HTTP servers the serving benchmarks start (serve_bench.py, soak.py)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(command: list[str], port: int, log: Path, env: dict[str, str],
                 timeout_s: float = 600) -> subprocess.Popen:
    """`command` started with its output in `log`, returned once GET /health answers 200; a
    server that exits or stays unhealthy for `timeout_s` is stopped and raised with the log's tail."""
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"server did not become healthy in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (not its children), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendant_pids(pid: int) -> list[int]:
    """Every process below `pid` (children, theirs, ...), from /proc; one that exits while read is
    left out."""
    found = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                found += [int(child), *descendant_pids(int(child))]
    return found


def processes_cpu_seconds(pids: Sequence[int]) -> float:
    """`process_cpu_seconds` summed over `pids`; one that has exited counts 0."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += process_cpu_seconds(pid)
    return total


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
