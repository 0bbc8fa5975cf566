"""The LoRA adapters a worker keeps, and each step's tokens grouped by adapter.

An adapter is read when the first request with it joins this worker's batch (each rank reads its
own part), and kept, by `lora_int_id`, until `max_cpu_loras` others came after it and no request
in the batch uses it (least recently used first). Its modules are mapped onto the model's layers
as the checkpoint's weights are (`checkpoint_target`: q/k/v into qkv_proj, gate/up into
gate_up_proj, a fused Phi-3 module split first) and sliced for this rank by the layer
(`LinearBase.lora_shard`)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from vllm_lite.config import LoRAConfig
from vllm_lite.lora.peft import HEAD_TENSOR, LORA_A, LORA_B, PREFIX, PEFTAdapter, read_adapter
from vllm_lite.lora.request import LoRARequest
from vllm_lite.model.layers.linear import LinearBase
from vllm_lite.model.layers.lora import LinearLoRA, LoRAStep, LoRAWeights
from vllm_lite.model.checkpoint_names import checkpoint_target
from vllm_lite.model.loader import decoder_name
from vllm_lite.multimodal_checkpoints import adapter_module_name


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device, dtype: torch.dtype,
                 pooling: bool = False, checkpoint_architecture: str = "") -> None:
        """`pooling`: an embedding model, whose adapters may name the decoder alone (a `*Model`'s
        modules, without the `model.` prefix), as its checkpoint may. `checkpoint_architecture`: a
        multimodal one's adapters name its language model's modules as its checkpoint does."""
        self.model = model
        self.pooling = pooling
        self.checkpoint_architecture = checkpoint_architecture
        self.config = config
        self.device = device
        self.dtype = dtype
        self.step = LoRAStep()
        # every layer an adapter may change: the linear layers (not an MoE layer's experts, nor a
        # classifier's head, which the pooler applies to pooled states: an adapter replaces it whole)
        self.layers: dict[str, LinearBase] = {}
        for name, module in model.named_modules():
            if isinstance(module, LinearBase) and name != "score":
                module.lora = LinearLoRA(self.step)
                self.layers[name] = module
        self.adapters: OrderedDict[int, LoRARequest] = OrderedDict()  # loaded, least recently used first
        # a classification model's adapters that replace its head whole (PEFT's SEQ_CLS
        # modules_to_save): adapter id -> the head's weight [num_labels, hidden] (the pooler reads it)
        self.heads: dict[int, torch.Tensor] = {}

    def use(self, lora: LoRARequest, ids_in_batch: np.ndarray) -> None:
        """Have `lora` loaded for a request joining the batch (`ids_in_batch`: the adapters of
        the requests already there, which stay). Raises, naming the adapter, when it cannot be
        read or does not fit the model: that request fails, the others go on."""
        loaded = self.adapters.get(lora.lora_int_id)
        if loaded is not None and loaded.lora_path == lora.lora_path:
            self.adapters.move_to_end(lora.lora_int_id)
            return
        weights, head = self._read(lora)
        if loaded is not None:  # the id was removed and now names another folder
            self.remove(lora.lora_int_id)
        self._make_room(ids_in_batch)
        for layer_name, layer_weights in weights.items():
            self.layers[layer_name].lora.set_weights(lora.lora_int_id, layer_weights)
        if head is not None:
            self.heads[lora.lora_int_id] = head
        self.adapters[lora.lora_int_id] = lora

    def remove(self, lora_int_id: int) -> bool:
        if self.adapters.pop(lora_int_id, None) is None:
            return False
        self.heads.pop(lora_int_id, None)
        for layer in self.layers.values():
            layer.lora.set_weights(lora_int_id, None)
        return True

    def set_step(self, lora_ids: np.ndarray, query_lens: np.ndarray) -> None:
        """The step's adapters for the layers (`LoRAStep`): `lora_ids` are the scheduled rows'
        adapters (0: none), in row order, whose tokens come in that order, `query_lens` each."""
        step = self.step
        step.masks.clear()
        if not lora_ids.any():
            step.adapters, step.whole, step.token_adapters = (), 0, None
            return
        adapters = np.unique(lora_ids)
        step.num_tokens = int(query_lens.sum())
        if len(adapters) == 1:  # one adapter, every row
            step.adapters, step.whole, step.token_adapters = (int(adapters[0]),), int(adapters[0]), None
            return
        step.adapters = tuple(int(a) for a in adapters if a)
        step.whole = 0
        step.token_adapters = torch.from_numpy(np.repeat(lora_ids, query_lens).astype(np.int32)).to(self.device)

    def _make_room(self, ids_in_batch: np.ndarray) -> None:
        in_use = set(ids_in_batch.tolist())
        while len(self.adapters) >= self.config.max_cpu_loras:
            idle = next((adapter_id for adapter_id in self.adapters if adapter_id not in in_use), None)
            if idle is None:  # (the scheduler's max_loras <= max_cpu_loras keeps this from happening)
                return
            self.remove(idle)

    def _read(self, lora: LoRARequest) -> tuple[dict[str, LoRAWeights], torch.Tensor | None]:
        """The adapter's update of each layer it changes, this rank's part, and the classifier
        head it saves whole (None: it keeps the model's)."""
        adapter = read_adapter(lora.lora_path, self.config.max_lora_rank)
        pieces: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        split = getattr(self.model, "split_checkpoint_tensor", None)
        targets = self.config.target_modules
        with safe_open(str(adapter.weights_file), framework="pt") as f:
            head = self._head(f, adapter)
            for module in adapter.modules:
                lora_a = f.get_tensor(PREFIX + module.name + LORA_A).float()
                lora_b = f.get_tensor(PREFIX + module.name + LORA_B).float() * module.scaling
                name = adapter_module_name(self.checkpoint_architecture, module.name)
                weight_name = (decoder_name(name) if self.pooling else name) + ".weight"
                fused = split(weight_name, lora_b) if split is not None else None
                for name, b in fused if fused is not None else [(weight_name, lora_b)]:
                    target, shard_id = checkpoint_target(self.model, name)
                    layer_name = target.removesuffix(".weight")
                    layer = self.layers.get(layer_name) if target.endswith(".weight") else None
                    if layer is None:
                        raise ValueError(f"LoRA adapter '{lora.lora_path}': module {module.name!r} is not a linear "
                                         "layer of this model that LoRA can adapt")
                    if targets is not None and layer_name.rsplit(".", 1)[-1] not in targets:
                        continue  # (lora_target_modules leaves this layer out)
                    try:
                        pieces.setdefault(layer_name, []).append(layer.lora_shard(shard_id, lora_a, b))
                    except ValueError as exc:
                        raise ValueError(f"LoRA adapter '{lora.lora_path}': module {module.name!r}: {exc}") from None
        return {name: self._stacked(self.layers[name], layer_pieces) for name, layer_pieces in pieces.items()}, head

    def _head(self, f: Any, adapter: PEFTAdapter) -> torch.Tensor | None:
        if adapter.head_shape is None:
            return None
        score = getattr(self.model, "score", None)
        if score is None or tuple(score.weight.shape) != adapter.head_shape:
            raise ValueError(f"LoRA adapter '{adapter.path}': its classifier head {list(adapter.head_shape)} does not "
                             "fit this model")
        return f.get_tensor(HEAD_TENSOR).to(self.device, self.dtype)

    def _stacked(self, layer: LinearBase, pieces: list[tuple[int, torch.Tensor, torch.Tensor]]) -> LoRAWeights:
        """One layer's pieces (q, k, v; gate, up; or the one module) as one update: their
        lora_a rows stacked, each lora_b in its output rows and its own columns."""
        rank = sum(a.shape[0] for _, a, _ in pieces)
        b_full = torch.zeros(layer.weight.shape[0], rank)
        column = 0
        for offset, a, b in pieces:
            b_full[offset:offset + b.shape[0], column:column + a.shape[0]] = b
            column += a.shape[0]
        a_full = torch.cat([a for _, a, _ in pieces])
        return LoRAWeights(a_full.to(self.device, self.dtype).contiguous(), b_full.to(self.device, self.dtype))
