"""CUDA-graph decode runner, on CPU: the graph is faked (replay re-runs the captured call on the
same static buffers), so what is checked is the runner's own logic: capture sizes, padding to
the next captured size, the static buffers' padded rows (slot -1, seq_len 0) and the output
slice. Real capture and replay need a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from vllm_lite.attention.backend import AttentionBackend, CommonAttentionMetadata
from vllm_lite.worker.cuda_graph import CudaGraphRunner, cuda_graph_capture_sizes


class StaticMetadataBackend(AttentionBackend):
    """Metadata = the common metadata itself (as the Triton backend: views of the buffers)."""

    name = "static"
    supports_cuda_graphs = True

    def build(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        return common

    def forward(self, query, key, value, kv_cache, metadata, scale):
        raise NotImplementedError


class EchoModel(nn.Module):
    """Returns, per token row, what the attention layers would read from the buffers."""

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        return torch.stack([input_ids.float(), positions.float(), metadata.slot_mapping.float(),
                            metadata.seq_lens.float(), metadata.block_table[:, 0].float(),
                            metadata.query_start_loc[1:].float()], dim=1)


class FakeGraph:
    def __init__(self, model: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.model, self.args, self.output = model, args, output

    def replay(self) -> None:
        self.output.copy_(self.model(*self.args))


class CpuGraphRunner(CudaGraphRunner):
    def _capture_one(self, args, pool):
        output = self.model(*args)
        return FakeGraph(self.model, args, output), output


def test_capture_sizes():
    assert cuda_graph_capture_sizes(1) == [1]
    assert cuda_graph_capture_sizes(6) == [1, 2, 4, 6]
    assert cuda_graph_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert cuda_graph_capture_sizes(10_000)[-1] == 512


def _decode_step(n: int, width: int) -> CommonAttentionMetadata:
    rng = np.random.default_rng(n)
    seq_lens = rng.integers(1, 40, size=n).astype(np.int32)
    block_table = rng.integers(1, 100, size=(n, width)).astype(np.int32)
    slot_mapping = rng.integers(16, 1600, size=n).astype(np.int64)
    qsl = np.arange(n + 1, dtype=np.int32)
    return CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens),
        block_table=torch.from_numpy(block_table), slot_mapping=torch.from_numpy(slot_mapping),
        query_start_loc_np=qsl, seq_lens_np=seq_lens, num_actual_tokens=n, max_query_len=1,
        block_size=16,
    )


def test_replay_pads_to_the_next_captured_size(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    runner = CpuGraphRunner(EchoModel(), StaticMetadataBackend(), [], max_num_seqs=12,
                            max_blocks_per_seq=8, block_size=16, device=torch.device("cpu"))
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4, 8, 12]
    for n in (12, 5, 1, 3):  # shrinking batches leave stale rows behind: padding must mask them
        step = _decode_step(n, width=3)
        input_ids = torch.arange(100, 100 + n)
        positions = step.seq_lens.long() - 1
        assert runner.can_replay(step)
        with torch.inference_mode():  # as in ModelRunner.execute_model
            out = runner.replay(input_ids, positions, step)
        expected = EchoModel()(input_ids, positions, [], step)
        assert torch.equal(out, expected)
        size = min(s for s in runner.sizes if s >= n)
        assert torch.all(runner.slot_mapping[n:size] == -1)
        assert torch.all(runner.seq_lens[n:size] == 0)
        assert torch.equal(runner.outputs[size][n:, 2], torch.full((size - n,), -1.0))
    prefill = _decode_step(2, width=3)
    prefill.max_query_len = 5
    assert not runner.can_replay(prefill)
    assert not runner.can_replay(_decode_step(13, width=3))


def test_a_layer_that_cannot_be_captured_keeps_the_model_eager(monkeypatch: pytest.MonkeyPatch):
    """An MoE layer (F.grouped_mm copies between host and device under capture on CUDA) turns the
    graphs off for the whole model, before anything is captured."""
    from types import SimpleNamespace

    from vllm_lite.model.layers.fused_moe import FusedMoE
    from vllm_lite.worker.cuda_graph import maybe_capture_cuda_graphs

    captured = []  # runners built and captured (without a GPU: neither allocates anything)
    monkeypatch.setattr(CudaGraphRunner, "__init__", lambda self, *args: None)
    monkeypatch.setattr(CudaGraphRunner, "capture", lambda self: captured.append(self))
    config = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=False, max_model_len=64),
                             cache_config=SimpleNamespace(block_size=16),
                             scheduler_config=SimpleNamespace(max_num_seqs=4), lora_config=None)
    cuda = torch.device("cuda")
    moe = nn.Sequential(nn.Linear(4, 4), FusedMoE(num_experts=2, top_k=1, hidden_size=4, intermediate_size=4,
                                                  renormalize=True))
    assert maybe_capture_cuda_graphs(config, moe, StaticMetadataBackend(), [], cuda) is None
    assert maybe_capture_cuda_graphs(config, EchoModel(), StaticMetadataBackend(), [], cuda) is not None
    assert len(captured) == 1
