"""vLLM's `model.load_weights(weights)` on a running engine: an RL trainer's new weights, sent to
every worker through `collective_rpc` (a `worker_extension_cls` method calls it, as in vLLM's
RLHF examples). Any subset of the checkpoint's tensors, by the checkpoint's names, each loaded
in place through its parameter's weight loader as at start (this rank's slice, a fused layer's
shard). A layer repacked for the CPU matmul (oneDNN's blocked layout, the LM head's panels) is
unpacked exactly, updated, and packed again once per call; a layer kept quantized (int8, GGUF
blocks) is refused by name, since its float weight is gone. Prefix-cache entries computed with
the old weights stay until `reset_prefix_cache()`, as in vLLM."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from vllm_lite.model.checkpoint_names import SKIPPED_SUFFIXES, checkpoint_target, split_fused
from vllm_lite.model.layers.linear import materialize, unpacked_weight
from vllm_lite.multimodal_checkpoints import is_multimodal, is_vision_tensor, language_model_weights


class CheckpointWeightUpdates:
    """What every native model class offers its workers' extensions (vLLM's model interface)."""

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Replace the named weights in place; returns the parameters loaded."""
        return update_weights(self, weights)


def update_weights(model: nn.Module, weights: Iterable[tuple[str, Any]]) -> set[str]:
    """A multimodal checkpoint's tensors (a trainer of the whole model names them so): the
    language model's loaded here, the vision side's by `model.load_vision_weights` where the
    workers run it (image inputs; the runner sets it), else skipped (it is not served)."""
    config = model.config
    architecture = getattr(config, "checkpoint_architecture", "")
    loaded: set[str] = set()
    if is_multimodal(architecture):
        weights = list(weights)
        load_vision = getattr(model, "load_vision_weights", None)
        vision = [(name, weight) for name, weight in weights if is_vision_tensor(architecture, name)]
        if vision and load_vision is not None:
            loaded |= load_vision(vision)
        weights = language_model_weights(architecture, weights)
    return loaded | _update_weights(model, weights)


def _update_weights(model: nn.Module, weights: Iterable[tuple[str, Any]]) -> set[str]:
    config = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    tied = getattr(config, "tie_word_embeddings", False)
    unpacked: list[nn.Module] = []
    updated: dict[int, nn.Parameter] = {}
    loaded: set[str] = set()
    try:
        for name, weight in split_fused(_tensors(weights), getattr(model, "split_checkpoint_tensor", None)):
            if name.endswith(SKIPPED_SUFFIXES) or (tied and name.startswith("lm_head.")):
                continue
            target, shard_id = checkpoint_target(model, name)
            if target not in params:
                raise ValueError(f"load_weights: {name!r} has no matching model parameter")
            param = params[target] = _writable(modules, target, params[target], name, unpacked)
            _check_shape(name, weight, param)
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(materialize(weight))
            else:
                loader(param, weight, shard_id) if shard_id is not None else loader(param, weight)
            updated[id(param)] = param
            loaded.add(target)
    finally:  # (a failed update still leaves every layer packed and usable)
        _repack(model, unpacked, updated)
        _count_restored(model, updated)
    return loaded


@dataclass
class DiscardedWeights:
    """vLLM's sleep(level=2) on a model: its parameters' memory let go (their shapes kept), and,
    once woken, which parameters are still to be loaded. Layers that were packed for the CPU
    matmul come back unpacked and are packed again when their weight is loaded."""

    shapes: list[tuple[nn.Parameter, torch.Size]]
    packed_layers: list[nn.Module]
    missing: set[int] = field(default_factory=set)  # ids of the parameters not loaded whole since the wake


def discard_weights(model: nn.Module) -> None:
    """Every parameter's memory let go (the buffers kept, as vLLM keeps them); `restore_weights`
    makes them again (NaN until loaded) for a trainer's `load_weights`."""
    packed = [module for module in model.modules() if getattr(module, "packed_weight", None) is not None]
    for module in packed:
        if unpacked_weight(module.packed_weight) is None:
            raise ValueError(f"sleep(level=2): {type(module.packed_weight).__name__} layers are kept quantized; their "
                             "weights could not be loaded again")
    shapes = []
    for param in model.parameters():  # (a tied head's weight once)
        if not param.is_meta:
            shapes.append((param, param.shape))
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    for module in packed:
        module.packed_weight = None
    model.discarded_weights = DiscardedWeights(shapes, packed)


def restore_weights(model: nn.Module) -> None:
    """The discarded parameters back, their layers unpacked: each is to be loaded. They are made
    NaN, not zeros, so that a parameter counts as loaded only once every element was written: a
    fused layer (q, k and v in one) loads shard by shard, and a checkpoint without one of them
    must not pass."""
    discarded = model.discarded_weights
    for param, shape in discarded.shapes:
        param.data = torch.full(shape, float("nan"), dtype=param.dtype, device=param.device)
    for module in discarded.packed_layers:
        if module.weight.is_meta:  # (a tied head's weight is the embedding's, restored above)
            meta = module.weight
            module.weight = nn.Parameter(torch.full(meta.shape, float("nan"), dtype=meta.dtype), requires_grad=False)
            module.weight.weight_loader = module.weight_loader
    discarded.missing = {id(param) for param in model.parameters()}


def num_missing_weights(model: nn.Module) -> int:
    """Parameters not loaded whole since `restore_weights` (0 when nothing was discarded)."""
    discarded = getattr(model, "discarded_weights", None)
    return 0 if discarded is None else len(discarded.missing)


def _count_restored(model: nn.Module, updated: dict[int, nn.Parameter]) -> None:
    """After a load: the parameters loaded whole (no NaN of `restore_weights` left) are no longer
    missing; a layer that was packed is packed again once its weight is whole; nothing missing,
    the model is whole again. (Runs only after a level-2 sleep: other loads skip the scan.)"""
    discarded = getattr(model, "discarded_weights", None)
    if discarded is None or not discarded.missing:
        return
    whole = {key for key, param in updated.items() if key in discarded.missing and not param.isnan().any()}
    discarded.missing -= whole
    for module in [m for m in discarded.packed_layers if id(m.weight) in whole]:
        module.process_weights_after_loading()
        discarded.packed_layers.remove(module)
    if not discarded.missing:
        model.discarded_weights = None


def update_module_parameters(module: nn.Module, weights: Iterable[tuple[str, Any]]) -> set[str]:
    """`load_weights` for a model whose parameters are named as its checkpoint's tensors (the
    Transformers fallback: transformers' own module tree): each copied in place, its shape the
    parameter's; a packed layer's weight is unpacked for the copy and packed again after it."""
    params = dict(module.named_parameters(remove_duplicate=False))
    modules = dict(module.named_modules())
    unpacked: list[nn.Module] = []
    updated: dict[int, nn.Parameter] = {}
    loaded: set[str] = set()
    try:
        for name, weight in _tensors(weights):
            if name not in params:
                raise ValueError(f"load_weights: {name!r} has no matching model parameter")
            if _shape(weight) != tuple(params[name].shape):
                raise ValueError(f"load_weights: {name!r} has shape {_shape(weight)}, the parameter "
                                 f"{tuple(params[name].shape)}")
            param = params[name] = _writable(modules, name, params[name], name, unpacked)
            param.data.copy_(materialize(weight))
            updated[id(param)] = param
            loaded.add(name)
    finally:
        _repack(module, unpacked, updated)
    return loaded


def _writable(modules: dict[str, nn.Module], target: str, param: nn.Parameter, name: str,
              unpacked: list[nn.Module]) -> nn.Parameter:
    """The parameter `target` to load checkpoint tensor `name` into: a packed layer's weight (a
    meta tensor beside its packed copy) is unpacked first and its layer noted in `unpacked`."""
    module_name, _, attribute = target.rpartition(".")
    module = modules[module_name]
    if attribute == "weight" and getattr(module, "packed_weight", None) is not None and module.weight.is_meta:
        param = _unpack(module, name)  # (raises for a layer kept quantized, which stays as it is)
        unpacked.append(module)
    elif param.is_meta:  # (a copy into it would do nothing)
        raise ValueError(f"load_weights: {name!r} belongs to a layer kept quantized ({type(module).__name__}); "
                         "updating quantized weights is not supported")
    return param


def _tensors(weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    """Tensors, numpy arrays as tensors, or safetensors' lazy slices (a checkpoint read by each
    rank for its part only: `reload_weights`)."""
    for item in weights:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError("load_weights takes (name, tensor) pairs")
        name, weight = item
        if isinstance(weight, np.ndarray):
            weight = torch.from_numpy(np.array(weight))
        if not isinstance(weight, torch.Tensor) and not hasattr(weight, "get_shape"):
            raise TypeError(f"load_weights: {name!r} is a {type(weight).__name__}, not a tensor")
        yield name, weight


def _shape(weight: Any) -> tuple[int, ...]:
    return tuple(weight.shape) if isinstance(weight, torch.Tensor) else tuple(weight.get_shape())


def _unpack(module: nn.Module, name: str) -> nn.Parameter:
    """The layer's row-major weight back from its packed copy, as the parameter to load into."""
    dense = unpacked_weight(module.packed_weight)
    if dense is None:
        raise ValueError(f"load_weights: {name!r} belongs to a layer kept quantized "
                         f"({type(module.packed_weight).__name__}); updating quantized weights is not supported")
    module.weight = nn.Parameter(dense, requires_grad=False)
    module.weight.weight_loader = module.weight_loader
    module.packed_weight = None
    return module.weight


def _check_shape(name: str, weight: torch.Tensor, param: nn.Parameter) -> None:
    """A weight loader slices and copies: a tensor of another rank, or with a dimension of 1
    where the parameter has more, would be broadcast into it instead of refused."""
    shape = _shape(weight)
    broadcast = any(size == 1 < ours for size, ours in zip(shape, param.shape))
    if len(shape) != param.dim() or broadcast:
        raise ValueError(f"load_weights: {name!r} has shape {shape}, which does not fit the "
                         f"parameter it loads into ({tuple(param.shape)} on this rank)")


def _repack(model: nn.Module, unpacked: list[nn.Module], updated: dict[int, nn.Parameter]) -> None:
    """Pack again every layer unpacked here, and every packed layer whose weight was updated in
    place (a tied LM head: the embedding's weight is its own)."""
    for module in model.modules():
        if module in unpacked or (getattr(module, "packed_weight", None) is not None
                                  and id(getattr(module, "weight", None)) in updated):
            module.packed_weight = None
            module.process_weights_after_loading()
