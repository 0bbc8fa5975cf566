"""Reading a PEFT LoRA adapter folder (what `peft`'s save_pretrained writes): adapter_config.json and
adapter_model.safetensors. No torch here: the client checks an adapter when a request names it
(from the config and the safetensors header alone), the workers read its tensors
(worker/lora_manager.py).

Every key of adapter_config.json is classified, as config.json's are (config_fields.py): the
fields that set the adapter's math are read (`r`, `lora_alpha`, `use_rslora`, `rank_pattern`,
`alpha_pattern`); those of PEFT features that change the math and are not implemented here
(DoRA, LoRA bias, modules_to_save, ...) are refused by name unless they hold their off value;
training-only and bookkeeping keys are ignored; a key this table does not know is refused
unless its value is off (None, False or empty: how PEFT writes a feature it did not use)."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_lite.exceptions import VLLMValidationError
from vllm_lite.multimodal_checkpoints import adapter_module_name, is_vision_tensor

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's prefix of the base model's module names
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"

# PEFT keys that only describe training, the run's bookkeeping, or what the saved tensors already
# say (which layers and modules hold weights): not needed to apply the adapter.
IGNORED_KEYS = frozenset({
    "base_model_name_or_path", "revision", "task_type", "inference_mode", "lora_dropout", "target_modules",
    "layers_to_transform", "layers_pattern", "exclude_modules", "auto_mapping", "megatron_config",
    "megatron_core", "loftq_config", "eva_config", "corda_config", "lora_ga_config", "qalora_group_size",
    "peft_version", "runtime_config", "ensure_weight_tying", "peft_type",
})
# PEFT features that change the adapter's output and are not implemented: (key, its off values).
UNSUPPORTED_FEATURES: dict[str, tuple[Any, ...]] = {
    "bias": ("none",),
    "use_dora": (False, None),
    "lora_bias": (False, None),
    # (a classifier's head, PEFT's SEQ_CLS default, is taken: `HEAD_MODULES`)
    "modules_to_save": (None, [], ["classifier", "score"], ["score", "classifier"], ["score"], ["classifier"]),
    "fan_in_fan_out": (False, None),
    "layer_replication": (None, []),
    "alora_invocation_tokens": (None, []),
    "use_bdlora": (None, {}, False),
    "use_qalora": (False, None),
    "trainable_token_indices": (None, [], {}),
    "target_parameters": (None, []),
    "arrow_config": (None,),
}
READ_KEYS = frozenset({"r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "init_lora_weights"})
# init_lora_weights values that only set the starting weights (vLLM's list): a saved adapter is a plain LoRA.
# The others (PiSSA, OLoRA, LoftQ, CorDA) change the base model's weights when PEFT loads the adapter.
PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One adapted module: its base-model name (a checkpoint name without `.weight`), its rank,
    the factor its update is scaled by, and its input / output features (from the tensors)."""

    name: str
    rank: int
    scaling: float
    in_features: int
    out_features: int


HEAD_MODULES = ("score", "classifier")  # a classification model's head, which an adapter may replace whole


@dataclass(frozen=True, slots=True)
class PEFTAdapter:
    """`head_shape`: the shape of the classifier head the adapter saved whole (PEFT's SEQ_CLS
    `modules_to_save`: `score.weight`, [num_labels, hidden]); None: it keeps the model's."""

    path: str
    modules: tuple[LoRAModule, ...]
    head_shape: tuple[int, ...] | None = None

    @property
    def weights_file(self) -> Path:
        return Path(self.path) / WEIGHTS_FILE

    @property
    def max_rank(self) -> int:
        return max(module.rank for module in self.modules)


def read_adapter(path: str, max_lora_rank: int) -> PEFTAdapter:
    """The adapter in folder `path`, checked: its config (above), its tensors' names and shapes
    (lora_A [r, in] and lora_B [out, r] per module, r as the config says), its ranks within
    `max_lora_rank`. Raises VLLMValidationError naming what is wrong."""
    folder = Path(path)
    if not (folder / CONFIG_FILE).is_file():
        raise VLLMValidationError(f"LoRA adapter '{path}': no {CONFIG_FILE} (a PEFT adapter folder is expected)",
                                  parameter="lora_path")
    config = _read_config(folder / CONFIG_FILE, path)
    shapes = _tensor_shapes(folder, path)
    head = shapes.pop(HEAD_TENSOR, None)
    modules = tuple(_module(name, shapes, config, path) for name in _module_names(shapes, path))
    if not modules:
        raise VLLMValidationError(f"LoRA adapter '{path}': {WEIGHTS_FILE} holds no LoRA weights",
                                  parameter="lora_path")
    adapter = PEFTAdapter(str(path), modules, tuple(head) if head is not None else None)
    if adapter.max_rank > max_lora_rank:
        raise VLLMValidationError(f"LoRA adapter '{path}': LoRA rank {adapter.max_rank} is greater than "
                                  f"max_lora_rank {max_lora_rank}", parameter="lora_path")
    return adapter


@dataclass(frozen=True, slots=True)
class _Config:
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    def rank_and_scaling(self, module: str) -> tuple[int, float]:
        """PEFT's rank and scaling of `module`: a pattern key matches a suffix of the module's
        name that starts at a dot (PEFT's `get_pattern_key`); the first match wins."""
        rank = _match(self.rank_pattern, module, self.r)
        alpha = _match(self.alpha_pattern, module, self.lora_alpha)
        return rank, alpha / (math.sqrt(rank) if self.use_rslora else rank)


def _match(pattern: dict[str, Any], module: str, default: Any) -> Any:
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(file: Path, path: str) -> _Config:
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise VLLMValidationError(f"LoRA adapter '{path}': {CONFIG_FILE} is not readable JSON ({exc})",
                                  parameter="lora_path") from None
    if not isinstance(raw, dict):
        raise VLLMValidationError(f"LoRA adapter '{path}': {CONFIG_FILE} is not a JSON object", parameter="lora_path")
    _check_keys(raw, path)
    r, alpha = raw.get("r"), raw.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise VLLMValidationError(f"LoRA adapter '{path}': r must be a positive int, got {r!r}", parameter="lora_path")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise VLLMValidationError(f"LoRA adapter '{path}': lora_alpha must be a number, got {alpha!r}",
                                  parameter="lora_path")
    rank_pattern = raw.get("rank_pattern") or {}
    alpha_pattern = raw.get("alpha_pattern") or {}
    for key, rank in rank_pattern.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise VLLMValidationError(f"LoRA adapter '{path}': rank_pattern[{key!r}] must be a positive int, "
                                      f"got {rank!r}", parameter="lora_path")
    return _Config(r, float(alpha), bool(raw.get("use_rslora", False)), dict(rank_pattern),
                   {key: float(value) for key, value in alpha_pattern.items()})


def _check_keys(raw: dict[str, Any], path: str) -> None:
    if raw.get("peft_type", "LORA") != "LORA":
        raise VLLMValidationError(f"LoRA adapter '{path}': peft_type {raw['peft_type']!r} is not LoRA",
                                  parameter="lora_path")
    refused = [_refusal(key, raw[key]) for key, off in UNSUPPORTED_FEATURES.items()
               if key in raw and raw[key] not in off]
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in PLAIN_INITS:
        refused.append(f"init_lora_weights={init!r} (it changes the base model's weights when PEFT loads the "
                       "adapter)")
    known = IGNORED_KEYS | READ_KEYS | UNSUPPORTED_FEATURES.keys()
    refused += [f"{key}={value!r} (not a PEFT key vllm_lite knows)" for key, value in raw.items()
                if key not in known and value not in (None, False, [], {}, "")]
    if refused:
        raise VLLMValidationError(f"LoRA adapter '{path}': {CONFIG_FILE} asks for what vllm_lite does not "
                                  f"implement: {', '.join(refused)}", parameter="lora_path")


def _refusal(key: str, value: Any) -> str:
    """A refused feature, in vLLM's words where its tests match them."""
    if key == "use_dora":
        return "vllm_lite does not yet support DoRA (use_dora=True)"
    if key == "modules_to_save":
        return f"vllm_lite only supports modules_to_save being None or ['classifier', 'score'] (got {value!r})"
    return f"{key}={value!r}"


def _tensor_shapes(folder: Path, path: str) -> dict[str, list[int]]:
    """The safetensors header's tensor shapes (the header alone is read: no tensor data)."""
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        other = sorted(p.name for p in folder.glob("adapter_model*"))
        why = f" (found {other}: pickled .bin weights are not read; save with safe_serialization)" if other else ""
        raise VLLMValidationError(f"LoRA adapter '{path}': no {WEIGHTS_FILE}{why}", parameter="lora_path")
    try:
        return header_shapes(file)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise VLLMValidationError(f"LoRA adapter '{path}': {WEIGHTS_FILE} is not a safetensors file ({exc})",
                                  parameter="lora_path") from None


HEAD_TENSOR = PREFIX + "score.weight"  # a saved classifier head (transformers' *ForSequenceClassification)


def _module_names(shapes: dict[str, list[int]], path: str) -> list[str]:
    """The adapted modules, in file order; any tensor other than a module's lora_A / lora_B (an
    embedding's lora_embedding_A, DoRA's magnitude, a saved module) is refused by name."""
    names: dict[str, None] = {}
    for key in shapes:
        suffix = LORA_A if key.endswith(LORA_A) else LORA_B if key.endswith(LORA_B) else None
        if suffix is None or not key.startswith(PREFIX):
            raise VLLMValidationError(f"LoRA adapter '{path}': tensor {key!r} is not a LoRA layer's lora_A / "
                                      "lora_B weight (embedding LoRA, DoRA and saved modules are not supported)",
                                      parameter="lora_path")
        names[key[len(PREFIX):-len(suffix)]] = None
    return list(names)


def _module(name: str, shapes: dict[str, list[int]], config: _Config, path: str) -> LoRAModule:
    a, b = shapes.get(PREFIX + name + LORA_A), shapes.get(PREFIX + name + LORA_B)
    if a is None or b is None:
        raise VLLMValidationError(f"LoRA adapter '{path}': module {name!r} lacks its "
                                  f"{'lora_A' if a is None else 'lora_B'} weight", parameter="lora_path")
    rank, scaling = config.rank_and_scaling(name)
    if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
        raise VLLMValidationError(f"LoRA adapter '{path}': module {name!r} has lora_A {a} and lora_B {b}; rank "
                                  f"{rank} ([{rank}, in] and [out, {rank}]) was expected", parameter="lora_path")
    return LoRAModule(name, rank, scaling, a[1], b[0])


def check_against_checkpoint(adapter: PEFTAdapter, model_dir: str, head_shape: tuple[int, int] | None = None,
                             checkpoint_architecture: str = "") -> None:
    """Each adapted module is a weight of the base model's checkpoint, of the adapter's in and out
    features (read from the safetensors headers). A module stored quantized (no `.weight`, its
    packed tensors instead) is left to the workers, which map every module onto the model. A
    saved classifier head must be the model's head's shape (`head_shape`; None: the model has no
    classifier head, so it cannot take one)."""
    if adapter.head_shape is not None and adapter.head_shape != head_shape:
        raise VLLMValidationError(f"LoRA adapter '{adapter.path}': it saves a classifier head {list(adapter.head_shape)}"
                                  + (f"; the model's is {list(head_shape)}" if head_shape is not None else
                                     ", and this model is no classification model"), parameter="lora_path")
    shapes = {adapter_module_name(checkpoint_architecture, name): shape
              for name, shape in checkpoint_shapes(Path(model_dir)).items()
              if not is_vision_tensor(checkpoint_architecture, name)}
    prefixes = {name.rsplit(".", 1)[0] for name in shapes}
    for module in adapter.modules:
        try:
            name = adapter_module_name(checkpoint_architecture, module.name)
        except ValueError as exc:
            raise VLLMValidationError(f"LoRA adapter '{adapter.path}': {exc}", parameter="lora_path") from None
        weight = shapes.get(name + ".weight")
        if weight is None and name in prefixes:
            continue
        if weight is None:
            raise VLLMValidationError(f"LoRA adapter '{adapter.path}': module {module.name!r} is not a weight of the "
                                      f"base model ({model_dir})", parameter="lora_path")
        if list(weight) != [module.out_features, module.in_features]:
            raise VLLMValidationError(f"LoRA adapter '{adapter.path}': module {module.name!r} maps "
                                      f"{module.in_features} -> {module.out_features} features; the base model's "
                                      f"weight is {list(weight)} ([out, in])", parameter="lora_path")


def checkpoint_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Every tensor's shape in a model folder's safetensors files, from their headers."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        shapes.update(header_shapes(file))
    return shapes


def header_shapes(file: Path) -> dict[str, list[int]]:
    """A safetensors file's tensor shapes, from its header (8 bytes of length, then JSON)."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: list(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
