"""Build a model from a Hugging Face folder: safetensors (single file or sharded index), mapped
onto fused parameters through each parameter's `weight_loader`; each rank reads only its slice.
Quantized checkpoints: compressed-tensors W8A8 int8 weights become int8 layers (`_Int8Checkpoint`);
AWQ / GPTQ / pack-quantized and FP8 weights are read into float weights or Q4_1 blocks as they are read
(layers/wna16.py, layers/fp8_weights.py).
With `quantization="gguf"` the weights come from the GGUF file itself, its Q4_1 / Q8_0 tensors
kept in their blocks (layers/gguf_quant.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import ModelConfig
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.eagle_config import EagleHeadConfig
from vllm_lite.medusa_config import MedusaHeadConfig
from vllm_lite.model.layers.embedding import VocabParallelEmbedding
from vllm_lite.model.layers.fused_moe import FusedMoE
from vllm_lite.model.layers.gguf_quant import GGML_TYPE_Q4_1, can_keep, keep_quantized
from vllm_lite.model.layers.linear import LinearBase, ReplicatedLinear, materialize
from vllm_lite.model.layers.bnb_weights import dequantized_bnb_weights
from vllm_lite.model.layers.fp8_weights import FP8Scheme, dequantized_fp8_weights
from vllm_lite.model.layers.quantization import quantize_model
from vllm_lite.model.layers.wna16 import WNA16Scheme, dequantized_weights, fits_q4_1
from vllm_lite.model.checkpoint_files import iterate_weights, safetensors_files
from vllm_lite.model.checkpoint_names import SKIPPED_SUFFIXES, checkpoint_target, split_fused
from vllm_lite.model.models.eagle import EagleHead
from vllm_lite.model.models.llava_vision import LlavaImageEncoder
from vllm_lite.model.models.medusa import MedusaHead
from vllm_lite.model.models.internvl_vision import InternVLImageEncoder
from vllm_lite.model.models.pixtral_vision import PixtralImageEncoder
from vllm_lite.model.models.qwen2_vl_vision import Qwen2VLImageEncoder
from vllm_lite.model.registry import get_model_class
from vllm_lite.multimodal_checkpoints import is_multimodal, is_vision_tensor, language_model_weights

def load_weights(model: nn.Module, weights: Iterable[tuple[str, Any]], source: str, pooling: bool = False,
                 int8_checkpoint: bool = False, zero_biases_optional: bool = False) -> None:
    """Load (checkpoint name, tensor or lazy slice) pairs from `source` (named in errors).
    `pooling` (an embedding model): the checkpoint may be the decoder alone (a `*Model`'s names,
    without the `model.` prefix) and need not hold the LM head, which pooling never runs.
    `int8_checkpoint` (compressed-tensors W8A8): int8 weights with their `weight_scale`s become the
    linear layers' int8 weights (Int8Weight), as quantization="int8" makes them.
    `zero_biases_optional` (AWQ / GPTQ): a bias the model has no parameter for is skipped if it is
    all zeros (AutoGPTQ saved one for every quantized layer, as vLLM's loaders know); any other is
    refused as an unknown tensor."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if pooling:
        weights = _decoder_names(weights)
    loaded: set[str] = set()
    tied = getattr(model.config, "tie_word_embeddings", False)
    split = getattr(model, "split_checkpoint_tensor", None)
    int8 = _Int8Checkpoint() if int8_checkpoint else None
    for name, weight in split_fused(iter(weights), split):
        if name.endswith(SKIPPED_SUFFIXES) or (tied and name.startswith("lm_head.")):
            continue
        if int8 is not None and name.endswith(".weight_scale"):
            int8.add_scale(*checkpoint_target(model, name.removesuffix("_scale")), materialize(weight))
            continue
        target, shard_id = checkpoint_target(model, name)
        param = params.get(target)
        if param is None and zero_biases_optional and name.endswith(".bias") and not materialize(weight).any():
            continue
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
        if int8 is not None:
            int8.add_weight(target, shard_id, weight)
        loader = getattr(param, "weight_loader", _default_loader)
        loader(param, weight, shard_id) if shard_id is not None else loader(param, weight)
        loaded.add(target)
    if int8 is not None:
        int8.use_in(model)
    loaded_tensors = {id(params[n]) for n in loaded}  # a tied weight is loaded under either name
    missing = {n for n, p in params.items() if id(p) not in loaded_tensors
               and not ((tied or pooling) and n.startswith("lm_head."))}
    if missing:
        raise ValueError(f"checkpoint in '{source}' lacks weights for: {sorted(missing)[:5]}")


@dataclass
class _Int8Checkpoint:
    """What a compressed-tensors W8A8 checkpoint holds per model parameter: its shards (as the
    weight loaders take them: shard id, whether int8, rows) and their scales. The int8 values load
    into the float parameter exactly; `use_in` makes each all-int8 parameter int8 again and gives
    its layer the per-row float32 scales (`int8_row_scales`, placed by the layer's own weight
    loader: the TP slicing and the fused layers' shard offsets are the weight's), from which the
    layer builds its Int8Weight after loading."""

    shards: dict[str, list[tuple[Any, bool, int]]] = field(default_factory=dict)
    scales: dict[str, dict[Any, torch.Tensor]] = field(default_factory=dict)

    def add_weight(self, target: str, shard_id: Any, weight: Any) -> None:
        dtype = weight.dtype if isinstance(weight, torch.Tensor) else weight.get_dtype()
        rows = weight.shape[0] if isinstance(weight, torch.Tensor) else weight.get_shape()[0]
        self.shards.setdefault(target, []).append((shard_id, dtype in (torch.int8, "I8"), rows))

    def add_scale(self, target: str, shard_id: Any, scale: torch.Tensor) -> None:
        self.scales.setdefault(target, {})[shard_id] = scale.float().reshape(-1)

    def use_in(self, model: nn.Module) -> None:
        modules = dict(model.named_modules())
        orphans = sorted(set(self.scales) - set(self.shards))
        if orphans:
            raise ValueError(f"checkpoint: {orphans[0]}_scale has no weight beside it")
        experts: dict[FusedMoE, dict[str, torch.Tensor]] = {}  # an MoE layer's w13 / w2 row scales
        for target, shards in self.shards.items():
            int8 = [is_int8 for _, is_int8, _ in shards]
            if not any(int8):
                if target in self.scales:
                    raise ValueError(f"checkpoint: {target} has a weight_scale but is not int8")
                continue
            module_name, _, attribute = target.rpartition(".")
            module = modules.get(module_name)
            if not all(int8) or not isinstance(module, (LinearBase, FusedMoE)):
                what = "mixes int8 and unquantized parts" if not all(int8) else "is not a linear layer"
                raise ValueError(f"checkpoint: {target} is int8 but {what}; int8 weights load only as "
                                 "whole linear layers or MoE experts (compressed-tensors W8A8)")
            if isinstance(module, FusedMoE):
                experts.setdefault(module, {})[attribute] = self._row_scales(target, module, shards)
                continue
            module.int8_row_scales = self._row_scales(target, module, shards)
            module.weight = nn.Parameter(module.weight.detach().to(torch.int8), requires_grad=False)
        for module, row_scales in experts.items():
            if set(row_scales) != {"w13", "w2"}:
                name = next(name for name, m in modules.items() if m is module)
                raise ValueError(f"checkpoint: the experts of {name} are int8 in some projections only; int8 "
                                 "experts load only with gate, up and down projections all int8")
            module.use_int8_weights(row_scales["w13"], row_scales["w2"])

    def _row_scales(self, target: str, module: LinearBase | FusedMoE,
                    shards: list[tuple[Any, bool, int]]) -> torch.Tensor:
        """The parameter's float32 scales, one per output row ([rows], or [experts, rows] for an
        MoE layer's stacked experts), each shard's placed as the layer places its weight's rows."""
        scales = self.scales.get(target, {})
        param = getattr(module, target.rpartition(".")[2])
        row_scales = nn.Parameter(torch.zeros(param.shape[:-1]), requires_grad=False)
        loader = getattr(module, "row_scale_loader", module.weight_loader)
        for shard_id, _, rows in shards:
            scale = scales.get(shard_id)
            if scale is None or scale.numel() not in (1, rows):
                raise ValueError(f"checkpoint: {target} (part {shard_id}) needs a weight_scale of 1 or {rows} "
                                 f"values, got {None if scale is None else scale.numel()}")
            scale = scale.expand(rows).contiguous()  # (a tensor-wise scale: the same for every row)
            loader(row_scales, scale, shard_id) if shard_id is not None else loader(row_scales, scale)
        return row_scales.data


def _decoder_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, weight in weights:
        yield decoder_name(name), weight


def decoder_name(name: str) -> str:
    """A decoder-only checkpoint's name (a `*Model`'s, without the `model.` prefix) as the
    `*ForCausalLM` model's parameter name (names that have the prefix are kept, and a
    classifier's head, `score`)."""
    return name if name.startswith(("model.", "lm_head.", "score.")) else "model." + name


def _head_from_token_rows(model_config: ModelConfig) -> ReplicatedLinear:
    """vLLM's classifier_from_token: a head made of the tokens' rows of the language-model head
    (the embedding when tied), read from the checkpoint (whole rows, whatever this rank holds):
    from_2_way_softmax, [no, yes] -> yes - no (in float32, as vLLM); no_post_processing, the rows."""
    pooler = model_config.pooler
    if model_config.gguf_file is not None:
        raise ValueError("classifier_from_token reads the language-model head from a safetensors checkpoint (not GGUF)")
    tied = model_config.hf.tie_word_embeddings
    names = ("model.embed_tokens.weight", "embed_tokens.weight") if tied else ("lm_head.weight",)
    rows = None
    for path in safetensors_files(Path(model_config.model)):
        with safe_open(str(path), framework="pt") as f:
            found = next((name for name in names if name in f.keys()), None)
            if found is not None:
                table = f.get_slice(found)
                rows = torch.stack([table[token_id:token_id + 1][0] for token_id in pooler.classifier_token_ids])
                break
    if rows is None:
        raise ValueError(f"classifier_from_token: the checkpoint in '{model_config.model}' has no {names[0]}")
    rows = rows.float()
    weight = rows[1:2] - rows[0:1] if pooler.classifier_method == "from_2_way_softmax" else rows
    with torch.device("cpu"):
        head = ReplicatedLinear(model_config.hf.hidden_size, weight.shape[0], bias=False)
    head.weight.data.copy_(weight)
    return head


def load_gguf_weights(model: nn.Module, gguf_path: Path) -> None:
    """Weights straight from a llama GGUF file: every linear layer (and the embedding / LM head)
    whose checkpoint tensors are all Q4_1 or all Q8_0 keeps them in their blocks; the rest (norms,
    other types, fused layers of mixed types) are dequantized as in the converted folder."""
    from vllm_lite.gguf_convert import gguf_tensor_types, iterate_gguf_weights, read_gguf_tensors

    tensors = read_gguf_tensors(gguf_path)
    kept = _kept_gguf_targets(model, gguf_tensor_types(tensors))
    keep_quantized(model, {target: qtype for target, (qtype, _) in kept.items()})
    names = frozenset(name for _, names in kept.values() for name in names)
    load_weights(model, iterate_gguf_weights(tensors, model.config.raw, names), str(gguf_path))


def _kept_gguf_targets(model: nn.Module, types: dict[str, tuple[int, int]]) -> dict[str, tuple[int, list[str]]]:
    """Parameter name -> (GGML type, checkpoint names) for the weights that stay in blocks."""
    modules = dict(model.named_modules())
    tied = getattr(model.config, "tie_word_embeddings", False)
    by_target: dict[str, list[tuple[str, int, int]]] = {}
    for name, (qtype, row_len) in types.items():
        if tied and name.startswith("lm_head."):
            continue
        target, _ = checkpoint_target(model, name)
        by_target.setdefault(target, []).append((name, qtype, row_len))
    kept: dict[str, tuple[int, list[str]]] = {}
    for target, shards in by_target.items():
        module_name, _, attr = target.rpartition(".")
        qtypes = {qtype for _, qtype, _ in shards}
        if (attr == "weight" and isinstance(modules.get(module_name), (LinearBase, VocabParallelEmbedding))
                and len(qtypes) == 1 and all(can_keep(qtype, row_len) for _, qtype, row_len in shards)):
            kept[target] = (qtypes.pop(), [name for name, _, _ in shards])
    return kept


def _default_loader(param: nn.Parameter, loaded: Any) -> None:
    param.data.copy_(loaded if isinstance(loaded, torch.Tensor) else loaded[:])


def load_model(model_config: ModelConfig, backend: AttentionBackend, device: torch.device,
               tp: TensorParallelGroup = SINGLE_RANK) -> nn.Module:
    model_cls = get_model_class(model_config.hf.architecture, model_config.hf.model_impl)
    dummy = model_config.load_format == "dummy"
    if model_config.hf.model_impl == "transformers":  # transformers reads its own checkpoint
        model = model_cls(model_config.hf, Path(model_config.model), backend, tp, model_config.hf_overrides,
                          dummy_weights=dummy, dtype=getattr(torch, model_config.dtype))
    else:
        pooler = model_config.pooler
        classify = pooler is not None and pooler.task == "classify"  # a *ForSequenceClassification's head
        rows_head = classify and bool(pooler.classifier_token_ids) and not dummy
        with torch.device("cpu"):
            model = model_cls(model_config.hf, model_config.max_model_len + 1, backend, tp)
            if classify and not rows_head:
                model.score = ReplicatedLinear(model_config.hf.hidden_size, len(pooler.labels), bias=False)
        if not dummy:
            _load_checkpoint(model, model_config, keep_int4_blocks=device.type == "cpu" and tp.size == 1)
        if rows_head:
            model.score = _head_from_token_rows(model_config)
    if dummy:
        initialize_dummy_weights(model)
    return _placed(model, model_config.dtype, device, model_config.quantization)


def _placed(model: nn.Module, dtype_name: str, device: torch.device, quantization: str | None = None) -> nn.Module:
    """A loaded model on its device in the engine's dtype, its layers ready to run."""
    dtype = getattr(torch, dtype_name)
    model = model.to(device=device, dtype=dtype).eval()  # uint8 GGUF blocks (and int64 ids) keep their dtype
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            module.output_dtype = dtype
    if quantization == "int8":
        quantize_model(model, quantization)
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return model


def load_eagle_head(head_config: ModelConfig, eagle: EagleHeadConfig, target: nn.Module, backend: AttentionBackend,
                    device: torch.device, tp: TensorParallelGroup = SINGLE_RANK) -> EagleHead:
    """An EAGLE head from its folder (this rank's part, split as the model is), sharing the model's embedding where its checkpoint
    has none (vLLM's rule; EAGLE-3 heads usually have none) and, without an LM head of its own,
    drafting with the model's (EAGLE-1's usual form)."""
    source = Path(head_config.model)
    names = {name for name, _ in iterate_weights(source)}
    own_embeddings = bool({"embed_tokens.weight", "model.embed_tokens.weight"} & names)
    own_lm_head = "lm_head.weight" in names
    if not own_lm_head and eagle.draft_vocab_size != head_config.hf.vocab_size:
        raise ValueError(f"speculative_config: the EAGLE head in '{source}' has a draft vocabulary "
                         f"(draft_vocab_size={eagle.draft_vocab_size}) but no lm_head.weight for it")
    with torch.device("cpu"):
        head = EagleHead(head_config.hf, eagle, head_config.max_model_len + 1, backend, tp,
                         own_embeddings=own_embeddings, own_lm_head=own_lm_head, token_map="d2t" in names)
    load_weights(head, ((name, weight) for name, weight in iterate_weights(source) if name != "t2d"), str(source))
    head = _placed(head, head_config.dtype, device)
    if not own_embeddings:
        head.model.embed_tokens = target.model.embed_tokens
    return head


def load_medusa_head(source: Path, config: MedusaHeadConfig, dtype_name: str, device: torch.device,
                     tp: TensorParallelGroup = SINGLE_RANK) -> MedusaHead:
    """A Medusa head from its folder (safetensors), in the engine's dtype (never quantized)."""
    with torch.device("cpu"):
        head = MedusaHead(config, tp)
    load_weights(head, iterate_weights(source), str(source))
    return _placed(head, dtype_name, device)


# the vision sides of their own (by ImageEncoderConfig.encoder_type); else Qwen's or LLaVA's
_IMAGE_ENCODERS = {"internvl_vision": InternVLImageEncoder, "pixtral": PixtralImageEncoder}


def load_image_encoder(model_config: ModelConfig, device: torch.device) -> nn.Module:
    """A multimodal checkpoint's vision side (model_config.image_encoder), in the engine's dtype
    (never quantized: quantization="int8" is the language model's)."""
    config = model_config.image_encoder
    with torch.device("cpu"):
        encoder = _IMAGE_ENCODERS.get(config.encoder_type, Qwen2VLImageEncoder if config.mrope else LlavaImageEncoder)(config)
    if model_config.load_format == "dummy":
        initialize_dummy_weights(encoder)
    else:
        architecture = model_config.hf.checkpoint_architecture
        weights = encoder.read_tensors((name, weight) for name, weight in iterate_weights(Path(model_config.model))
                                       if is_vision_tensor(architecture, name))
        try:
            load_weights(encoder, weights, model_config.model)
        except ValueError as exc:
            raise ValueError(f"{exc} (the vision encoder and projector, which image inputs need; "
                             "language_model_only=True serves the language model alone)") from None
    return _placed(encoder, model_config.dtype, device)


def _load_checkpoint(model: nn.Module, model_config: ModelConfig, keep_int4_blocks: bool) -> None:
    """`keep_int4_blocks`: AWQ / GPTQ layers that fit stay in GGUF Q4_1 blocks (the CPU's kernels,
    one rank); the others, and every layer elsewhere, are dequantized into float weights."""
    if model_config.quantization == "gguf":
        load_gguf_weights(model, Path(model_config.gguf_file))
    else:
        weights = checkpoint_weights(model_config)
        quantization_config = model_config.hf.raw.get("quantization_config")
        if model_config.quantization in ("awq", "gptq") or (model_config.quantization == "compressed-tensors"
                                                             and quantization_config["format"] == "pack-quantized"):
            scheme = WNA16Scheme.of(quantization_config)
            kept = (_kept_int4_layers(model, checkpoint_weights(model_config), scheme) if keep_int4_blocks
                    else frozenset())
            weights = dequantized_weights(weights, scheme, kept)
        elif model_config.quantization == "fp8" or (model_config.quantization == "compressed-tensors"
                                                     and quantization_config["format"] == "float-quantized"):
            weights = dequantized_fp8_weights(weights, FP8Scheme.of(quantization_config))
        elif model_config.quantization == "bitsandbytes":
            weights = dequantized_bnb_weights(weights)
        load_weights(model, weights, model_config.model, pooling=model_config.pooler is not None,
                     int8_checkpoint=(model_config.quantization == "compressed-tensors"
                                      and quantization_config["format"] == "int-quantized"),
                     zero_biases_optional=model_config.quantization in ("awq", "gptq"))


def checkpoint_weights(model_config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, lazy slice) pairs as this engine names them (a multimodal
    checkpoint's language model under `model.` / `lm_head.`, its vision side left out)."""
    weights = iterate_weights(Path(model_config.model))
    architecture = model_config.hf.checkpoint_architecture
    return language_model_weights(architecture, weights) if is_multimodal(architecture) else weights


def _kept_int4_layers(model: nn.Module, weights: Iterator[tuple[str, Any]], scheme: WNA16Scheme) -> frozenset[str]:
    """The AWQ / GPTQ layers (checkpoint prefixes) whose 4-bit weights stay in Q4_1 blocks, their
    model parameters made block parameters (as GGUF's are): every linear layer whose checkpoint
    parts all fit the blocks (wna16.fits_q4_1), read from the tensors' shapes and g_idx alone.
    One rank only, as GGUF's blocks; the others are dequantized."""
    shapes: dict[str, tuple[int, int]] = {}
    num_groups: dict[str, int] = {}
    g_idx: dict[str, torch.Tensor] = {}
    unpadded: dict[str, tuple[int, int]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        role = scheme.parts.get(part)
        if role == "values":
            shapes[prefix] = scheme.layer_shape(tuple(tensor.get_shape()))
        elif role == "scales":
            num_groups[prefix] = scheme.num_groups(tuple(tensor.get_shape()))
        elif role == "g_idx":
            g_idx[prefix] = tensor[:]
        elif role == "shape":  # (compressed-tensors: the unpadded [out, in])
            unpadded[prefix] = tuple(reversed(tensor[:].tolist()))
    shapes.update(unpadded)
    split = getattr(model, "split_checkpoint_tensor", None)
    fits: dict[str, list[bool]] = {}  # target parameter -> whether each of its parts fits
    targets_of: dict[str, list[str]] = {}
    for prefix, (in_features, out_features) in shapes.items():
        names = [f"{prefix}.weight"]
        parts = split(names[0], torch.empty(out_features, in_features, device="meta")) if split else None
        names = [name for name, _ in parts] if parts else names
        keep = fits_q4_1(scheme, in_features, g_idx.get(prefix), num_groups.get(prefix, 1))
        targets_of[prefix] = [checkpoint_target(model, name)[0] for name in names]
        for target in targets_of[prefix]:
            fits.setdefault(target, []).append(keep)
    modules = dict(model.named_modules())
    kept = {target for target, keeps in fits.items()
            if all(keeps) and isinstance(modules.get(target.removesuffix(".weight")), LinearBase)}
    keep_quantized(model, dict.fromkeys(kept, GGML_TYPE_Q4_1))
    return frozenset(prefix for prefix, targets in targets_of.items() if all(t in kept for t in targets))


DUMMY_WEIGHT_SEED = 1234


def initialize_dummy_weights(model: nn.Module, bound: float = 1e-3) -> None:
    """load_format="dummy" (vLLM's): every floating-point parameter uniform in [-bound, bound] from
    a fixed seed, so runs repeat; buffers the model computes itself (rotary tables) stay as built."""
    generator = torch.Generator().manual_seed(DUMMY_WEIGHT_SEED)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.uniform_(-bound, bound, generator=generator)


def _slot_tensors(weight: Any) -> list[torch.Tensor]:
    """The tensors of a slotted dataclass of them (Int8Weight, GGUFWeight)."""
    return [value for value in (getattr(weight, name) for name in weight.__slots__) if isinstance(value, torch.Tensor)]


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy: parameters, buffers and the packed / quantized weights
    layers keep beside them (`packed_weight`), each storage counted once."""
    tensors: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if isinstance(packed, torch.Tensor):
            tensors.append(packed)
        elif packed is not None:  # Int8Weight, GGUFWeight: dataclasses of tensors
            tensors.extend(_slot_tensors(packed))
        for experts in getattr(module, "int8_experts", None) or ():  # (an MoE layer's Int8Weights)
            tensors.extend(tensor for weight in experts for tensor in _slot_tensors(weight))
    storages: dict[int, int] = {}
    for tensor in tensors:
        if tensor.device.type == "meta":
            continue
        if tensor.is_mkldnn:  # oneDNN's packed weights: no torch storage (AmxWeight may view them)
            storages[torch.ops.mkldnn.data_ptr(tensor)] = torch.ops.mkldnn._nbytes(tensor)
        elif tensor.layout != torch.strided:
            storages[id(tensor)] = tensor.numel() * tensor.element_size()
        else:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())
