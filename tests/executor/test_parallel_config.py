"""Parallel configuration is validated up front: an impossible split names the dimension."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_lite.config import EngineArgs


def model_dir(tmp_path: Path, heads: int = 4, kv_heads: int = 2, intermediate: int = 128) -> str:
    """A config.json is all the configuration step reads (no weights needed)."""
    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1001, "hidden_size": 16 * heads,
        "intermediate_size": intermediate, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 256,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("shape, tp, message", [
    (dict(heads=9, kv_heads=9), 2, "num_attention_heads=9 is not divisible by tensor_parallel_size=2"),
    (dict(heads=6, kv_heads=3), 2, "num_key_value_heads=3 is not divisible by tensor_parallel_size=2"),
    (dict(heads=12, kv_heads=3), 4, "tensor_parallel_size=4 is not a multiple of num_key_value_heads=3"),
    (dict(heads=8, kv_heads=8, intermediate=100), 8, "intermediate_size=100 is not divisible"),
])
def test_impossible_split_is_refused(tmp_path: Path, shape: dict, tp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=model_dir(tmp_path, **shape), tensor_parallel_size=tp).create_engine_config()


def test_possible_splits(tmp_path: Path) -> None:
    model = model_dir(tmp_path, heads=4, kv_heads=1)  # one KV head: replicated over the ranks
    parallel = EngineArgs(model=model, tensor_parallel_size=2, device="cpu").create_engine_config().parallel_config
    assert (parallel.tensor_parallel_size, parallel.distributed_executor_backend) == (2, "mp")
    assert EngineArgs(model=model, device="cpu").create_engine_config().parallel_config.distributed_executor_backend == "uni"
    config = EngineArgs(model=model, tensor_parallel_size=4, nnodes=2, node_rank=1, master_port=29555,
                        device="cpu").create_engine_config()
    assert config.parallel_config.ranks_per_node == 2
    # The vocabulary (1001) does not divide by 2 and need not: it is padded per rank.


@pytest.mark.parametrize("args, message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "need 'mp'"),
    (dict(distributed_executor_backend="ray"), "distributed_executor_backend must be one of"),
    (dict(tensor_parallel_size=2, nnodes=2), "master_port must be set"),
    (dict(tensor_parallel_size=4, nnodes=3, master_port=1234), "multiple of nnodes=3"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1234), "node_rank must be in"),
    (dict(master_port=70000), "master_port must be in"),
])
def test_bad_parallel_arguments(tmp_path: Path, args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=model_dir(tmp_path), device="cpu", **args).create_engine_config()
