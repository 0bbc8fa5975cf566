"""vLLM's `distributed_executor_backend="external_launcher"` (what TRL's colocated mode and verl
use): every process torchrun starts builds the same `LLM`, runs the engine in process for its
rank, and gets the same outputs as the others of its engine: transformers' greedy tokens, and
the same seeded samples on every rank. The engine joins torchrun's world itself, or uses the
process group a trainer made first (and leaves it to the trainer); a world larger than
tensor_parallel_size holds several engines. Real torchrun jobs of two processes on gloo."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hf_reference import hf_greedy
from launcher_rank import prompts_of
from llm_factory import make_llm
from vllm_lite.config import EngineArgs

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(model: Path, out_dir: Path, tensor_parallel_size: int, own_group: bool) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(REPO_ROOT / "tests" / "launcher_rank.py"), str(model), str(out_dir),
               str(tensor_parallel_size), "1" if own_group else "0"]
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("own_group", [False, True], ids=["engine-joins-the-world", "trainers-group"])
def test_two_ranks_of_one_engine(tiny_llama: Path, tmp_path: Path, own_group: bool) -> None:
    ranks = torchrun(tiny_llama, tmp_path, 2, own_group)
    expected = hf_greedy(tiny_llama, prompts_of(0), 8)
    assert ranks[0]["greedy"] == ranks[1]["greedy"] == expected
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
    # the world the engine joined is left at shutdown; a trainer's group is the trainer's
    assert ranks[0]["initialized_after"] is own_group


def test_a_world_of_two_engines(tiny_llama: Path, tmp_path: Path) -> None:
    """tensor_parallel_size=1 in a trainer's world of two: each process is an engine of its own,
    with its own prompts."""
    ranks = torchrun(tiny_llama, tmp_path, 1, True)
    for engine, result in enumerate(ranks):
        assert result["greedy"] == hf_greedy(tiny_llama, prompts_of(engine), 8)


def test_what_cannot_hold_is_refused(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="runs in the processes torchrun starts"):
        EngineArgs(model=str(tiny_llama), tensor_parallel_size=2,
                   distributed_executor_backend="external_launcher").create_engine_config()
    with pytest.raises(ValueError, match="multiprocess=True cannot hold"):
        make_llm(tiny_llama, distributed_executor_backend="external_launcher", multiprocess=True)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="WORLD_SIZE=3 processes cannot be split into engines of "
                                         "tensor_parallel_size=2"):
        EngineArgs(model=str(tiny_llama), tensor_parallel_size=2,
                   distributed_executor_backend="external_launcher").create_engine_config()
    config = EngineArgs(model=str(tiny_llama), distributed_executor_backend="external_launcher").create_engine_config()
    from vllm_lite.engine.async_llm import AsyncLLM

    with pytest.raises(ValueError, match="AsyncLLM and the server take 'mp'"):
        AsyncLLM(config)
