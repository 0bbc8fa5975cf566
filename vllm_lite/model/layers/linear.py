"""Linear layers in vLLM's tensor-parallel form. With one rank they are plain `F.linear`.

Weight loaders take either a tensor or a lazy safetensors slice and read only this rank's part.
On CPU, fp32 and bf16 weights are repacked once after loading into oneDNN's blocked layout
(`process_weights_after_loading`): decode-sized matmuls then run 1.5-3.5x faster than
`F.linear` on a plain row-major weight (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite._custom_ops import amx_bf16_usable
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.amx_linear import AmxWeight, amx_linear
from vllm_lite.model.layers.gguf_quant import GGUFWeight, gguf_linear, gguf_weight_of
from vllm_lite.model.layers.head_panels import HeadPanels, head_linear
from vllm_lite.model.layers.lora import LinearLoRA
from vllm_lite.model.layers.matmul_rows import matmul_bucketed
from vllm_lite.model.layers.quantization import Int8Weight, int8_linear


def narrow_loaded(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """`loaded.narrow(dim, start, size)` for a tensor or a safetensors slice (read lazily)."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    index = [slice(None)] * len(loaded.get_shape())
    index[dim] = slice(start, start + size)
    return loaded[tuple(index)]


def materialize(loaded: Any) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


# oneDNN picks its blocked weight layout for this many rows of input; measured on the demo model's
# shapes, the layout chosen for 512 is as fast as a per-size one from 1 to 512 rows.
PREPACK_BATCH_HINT = 512


PREPACK_DTYPES = (torch.float32, torch.bfloat16)


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether `weight` can be repacked for oneDNN's CPU matmul (fp32 or bf16 on CPU, with oneDNN
    built in). bf16 runs on avx512_bf16 / AMX where the CPU has them (fp32 accumulation); oneDNN
    refuses to pack bf16 on a CPU without AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, where a bf16 weight
    stays row-major and `F.linear` computes it (emulated, slower than fp32: `dtype="auto"` picks
    fp32 on such a CPU)."""
    if weight.device.type != "cpu" or weight.dtype not in PREPACK_DTYPES:
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return weight.dtype != torch.bfloat16 or onednn_packs_bf16()


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether this CPU has what oneDNN's bf16 weight packing needs (torch asks oneDNN the same)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack(weight: torch.Tensor) -> torch.Tensor | AmxWeight:
    """oneDNN's blocked copy of `weight`; for bf16 on a CPU with AMX, AMX tiles beside it for
    decode-sized inputs (layers/amx_linear.py)."""
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PREPACK_BATCH_HINT)
    if weight.dtype == torch.bfloat16 and amx_bf16_usable():
        return AmxWeight.pack(weight, onednn)
    return onednn


PackedWeight = torch.Tensor | AmxWeight | Int8Weight | GGUFWeight | HeadPanels


def unpacked_weight(packed_weight: PackedWeight) -> torch.Tensor | None:
    """The row-major float weight a repacked one was made from, exactly (for weight updates:
    model/weight_updates.py); None for a weight kept quantized (int8, GGUF blocks), which holds
    less than the float weight did."""
    if isinstance(packed_weight, HeadPanels):
        return packed_weight.unpack()
    if isinstance(packed_weight, AmxWeight):
        packed_weight = packed_weight.onednn
    if isinstance(packed_weight, torch.Tensor):
        return packed_weight.to_dense() if packed_weight.is_mkldnn else packed_weight
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, packed_weight: PackedWeight | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through the weight made by `prepack` (or int8 quantization, or a GGUF weight
    kept in its blocks) when there is one."""
    if packed_weight is None:
        return F.linear(x, weight, bias)
    if isinstance(packed_weight, Int8Weight):
        return int8_linear(x, packed_weight, bias)
    if isinstance(packed_weight, GGUFWeight):
        return gguf_linear(x, packed_weight, bias)
    if isinstance(packed_weight, HeadPanels):
        return head_linear(x, packed_weight, bias)
    if isinstance(packed_weight, AmxWeight):
        out = amx_linear(x, packed_weight, bias)
        if out is not None:
            return out
        packed_weight = packed_weight.onednn
    flat = x.reshape(-1, x.shape[-1])
    out = matmul_bucketed(
        flat, lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed_weight, bias, "none", [], ""))
    return out.view(*x.shape[:-1], out.shape[-1])


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        self.packed_weight: PackedWeight | None = None
        # float32 [out]: the scales of an int8 weight a quantized checkpoint loaded (model/loader.py)
        self.int8_row_scales: torch.Tensor | None = None
        # the LoRA adapters' updates of this layer's output (set on every adaptable layer when
        # the engine serves LoRA: worker/lora_manager.py); None: the base layer alone
        self.lora: LinearLoRA | None = None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        param.data.copy_(materialize(loaded))

    def lora_shard(self, shard_id: Any, lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """A LoRA of the checkpoint module that loads as `shard_id` of this layer (lora_a [r, in],
        lora_b [out, r], the whole module's): (the offset of its rows in this rank's output, this
        rank's lora_a, this rank's lora_b), sliced as the weight loader slices the weight."""
        _check_lora_shape(self, lora_a.shape[1], lora_b.shape[0], self.weight.shape[1], self.weight.shape[0])
        return 0, lora_a, lora_b

    def process_weights_after_loading(self) -> None:
        """Repack the weight for the CPU matmul where that is faster; the row-major copy is
        released (a meta tensor keeps its shape for whoever asks). A GGUF weight kept in its
        blocks (layers/gguf_quant.py) is used as it is, and a checkpoint's int8 weight with its
        scales becomes the int8 layers' Int8Weight."""
        gguf_weight = gguf_weight_of(self.weight)
        if self.int8_row_scales is not None:
            self.use_int8_weight(Int8Weight.of(self.weight.detach(), self.int8_row_scales))
            self.int8_row_scales = None
        elif gguf_weight is not None:
            self.packed_weight = gguf_weight
            shape = (gguf_weight.out_features, gguf_weight.in_features)
            self.weight = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
        elif self.packed_weight is None and can_prepack(self.weight):
            self.packed_weight = prepack(self.weight)
            self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)

    def quantize_int8(self) -> None:
        """quantization="int8": the weight becomes int8 (layers/quantization.py)."""
        self.use_int8_weight(Int8Weight.quantize(self.weight))

    def use_int8_weight(self, weight: Int8Weight) -> None:
        """An int8 weight (quantized at load, or a quantized checkpoint's), the float one released
        as in packing."""
        self.packed_weight = weight
        self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.packed_weight, self.bias)
        return out if self.lora is None else self.lora.add_to(x, out)


def _check_lora_shape(layer: LinearBase, in_features: int, out_features: int, expected_in: int,
                      expected_out: int) -> None:
    if (in_features, out_features) != (expected_in, expected_out):
        raise ValueError(f"a LoRA of {in_features} -> {out_features} features does not fit {type(layer).__name__} "
                         f"({expected_in} -> {expected_out} features)")


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (an MoE router)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, SINGLE_RANK)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__(input_size, _divide(output_size, tp.size, "output_size"), bias, tp)

    def output_shard(self, shard_id: Any) -> tuple[int, int, int]:
        """(offset in this rank's output, rows, first row in the checkpoint tensor) of `shard_id`'s
        part on this rank."""
        size = self.weight.shape[0]
        return 0, size, self.tp.rank * size

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        offset, size, start = self.output_shard(shard_id)
        shard = narrow_loaded(loaded, 0, start, size)
        param.data.narrow(0, offset, size).copy_(materialize(shard))

    def lora_shard(self, shard_id: Any, lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        offset, size, start = self.output_shard(shard_id)
        full_rows = size * self.tp.size if self._splits_rows(shard_id) else size
        _check_lora_shape(self, lora_a.shape[1], lora_b.shape[0], self.weight.shape[1], full_rows)
        return offset, lora_a, lora_b.narrow(0, start, size)

    def _splits_rows(self, shard_id: Any) -> bool:
        """Whether `shard_id`'s checkpoint rows are split across the ranks (not replicated)."""
        return True


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_up_proj); shard_id is the index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        self.output_sizes = [_divide(s, tp.size, "output_size") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, tp)

    def output_shard(self, shard_id: Any) -> tuple[int, int, int]:
        size = self.output_sizes[shard_id]
        return sum(self.output_sizes[:shard_id]), size, self.tp.rank * size


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul. Query heads split across ranks; KV heads split too,
    or replicated when there are fewer KV heads than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = _divide(num_kv_heads, tp.size, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp.size, num_kv_heads, "tensor_parallel_size over KV heads")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias, tp)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def output_shard(self, shard_id: Any) -> tuple[int, int, int]:
        if shard_id == "q":
            return 0, self.q_size, self.tp.rank * self.q_size
        offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
        return offset, self.kv_size, (self.tp.rank // self.kv_replicas) * self.kv_size

    def _splits_rows(self, shard_id: Any) -> bool:
        return shard_id == "q" or self.kv_replicas == 1


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced (bias added once)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__(_divide(input_size, tp.size, "input_size"), output_size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if param.dim() == 1:
            param.data.copy_(materialize(loaded))
            return
        size = param.shape[1]
        param.data.copy_(materialize(narrow_loaded(loaded, 1, self.tp.rank * size, size)))

    def lora_shard(self, shard_id: Any, lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """lora_a is split by input features as the weight is; each rank's partial update is
        summed by the all-reduce with the partial products (B is linear)."""
        size = self.weight.shape[1]
        _check_lora_shape(self, lora_a.shape[1], lora_b.shape[0], size * self.tp.size, self.weight.shape[0])
        return 0, lora_a.narrow(1, self.tp.rank * size, size), lora_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = linear(x, self.weight, self.packed_weight)
        if self.lora is not None:
            partial = self.lora.add_to(x, partial)
        out = self.tp.all_reduce(partial)
        return out if self.bias is None else out + self.bias
