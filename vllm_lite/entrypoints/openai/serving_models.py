"""The models a server answers to, as vLLM's OpenAIServingModels: the base model under its served
names, and LoRA adapters under theirs (`--lora-modules` at start; `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` at run time when VLLM_ALLOW_RUNTIME_LORA_UPDATING is set). A request's
`model` names one of them; an adapter's requests run with its LoRARequest. With runtime updating
on and VLLM_LORA_RESOLVER_CACHE_DIR set (vLLM's filesystem resolver), a request naming an unknown
model loads the adapter in that folder's sub-folder of the same name, if it is a LoRA of the
served model."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_lite.entrypoints.openai.errors import ApiError
from vllm_lite.entrypoints.openai.protocol import ModelCard
from vllm_lite.exceptions import LoRAAdapterNotFoundError, VLLMValidationError
from vllm_lite.lora.peft import CONFIG_FILE
from vllm_lite.lora.request import LoRARequest

LORA_MODULE_KEYS = ("name", "path", "base_model_name")


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """vLLM's --lora-modules entry: an adapter's served name and folder (and the base model it is
    listed under in /v1/models)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """vLLM's two forms: `name=path`, or a JSON object with name, path and base_model_name."""
    if "=" in text and "," not in text and not text.lstrip().startswith("{"):
        name, path = text.split("=", 1)
        return LoRAModulePath(name, path)
    try:
        entry = json.loads(text)
    except ValueError:
        raise ValueError(f"--lora-modules: {text!r} is neither name=path nor a JSON object") from None
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(entry.get("path"), str):
        raise ValueError(f"--lora-modules: {text!r} needs string 'name' and 'path'")
    unknown = sorted(set(entry) - set(LORA_MODULE_KEYS))
    if unknown:
        raise ValueError(f"--lora-modules: {text!r} has keys {unknown} that vllm_lite does not take "
                         f"(it takes {', '.join(LORA_MODULE_KEYS)})")
    return LoRAModulePath(entry["name"], entry["path"], entry.get("base_model_name"))


@dataclass
class ServedModels:
    """`check_lora(request)`: the engine's check of an adapter (its folder, config and weights'
    names and shapes), raising VLLMValidationError; `forget_lora(id)`: the engine lets go of an
    adapter id no longer served (an unloaded or replaced adapter: a server that loads and unloads
    adapters all day keeps no record of the old ones). `resolver_dir`: vLLM's filesystem
    resolver's folder (None: off); `base_model_ids`: what an adapter's `base_model_name_or_path`
    may be to be resolved (the model as the server was given it, its folder, its served names)."""

    base_names: tuple[str, ...]
    check_lora: Any
    forget_lora: Any = None
    resolver_dir: str | None = None
    base_model_ids: frozenset[str] = frozenset()
    loras: dict[str, LoRARequest] = field(default_factory=dict)
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    def resolve(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """The name to answer with and the adapter it stands for (None: the base model); an
        unknown name is a 404, as with OpenAI (vLLM 0.32's message)."""
        if requested is None:
            return self.base_names[0], None
        if requested in self.base_names:
            return requested, None
        lora = self.loras.get(requested) or self._resolved(requested)
        if lora is None:
            raise ApiError(404, "NotFoundError", f"The model `{requested}` does not exist. Valid aliases: "
                           f"{', '.join(self.base_names)}.", "model")
        return requested, lora

    def _resolved(self, name: str) -> LoRARequest | None:
        """vLLM's filesystem resolver: `resolver_dir/name` when it holds a LoRA adapter of the
        served model (its adapter_config.json's peft_type LORA, base_model_name_or_path one of
        `base_model_ids`), loaded as `name`; a found adapter that cannot serve is a 400."""
        if self.resolver_dir is None or not _plain_folder_name(name):
            return None
        folder = Path(self.resolver_dir) / name
        try:
            config = json.loads((folder / CONFIG_FILE).read_text())
        except (OSError, ValueError):
            return None
        if (not isinstance(config, dict) or config.get("peft_type") != "LORA"
                or config.get("base_model_name_or_path") not in self.base_model_ids):
            return None
        try:
            self.load(name, str(folder))
        except ApiError as exc:
            raise ApiError(400, "BadRequestError", f"LoRA adapter '{name}' was found but could not be loaded: "
                           f"{exc.message}", "model") from None
        return self.loras[name]

    def cards(self, model_path: str, max_model_len: int) -> list[ModelCard]:
        """vLLM's /v1/models: the base model's names, then each adapter under its parent."""
        base = [ModelCard(id=name, root=model_path, max_model_len=max_model_len) for name in self.base_names]
        return base + [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name or self.base_names[0])
                       for lora in self.loras.values()]

    def load(self, name: str, path: str, load_inplace: bool = False, base_model_name: str | None = None) -> str:
        """Serve the adapter in `path` as `name` (vLLM's load_lora_adapter). `load_inplace`
        replaces an adapter already served under that name: its later requests read the folder
        again (a new adapter id, so no KV computed with the old weights is reused); requests in
        flight finish with the old one."""
        if not name or not path:
            raise ApiError(400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.base_names:
            raise ApiError(400, "InvalidUserInput", f"The lora adapter '{name}' conflicts with a served base model.")
        if name in self.loras and not load_inplace:
            raise ApiError(400, "InvalidUserInput", f"The lora adapter '{name}' has already been loaded. If you "
                           "want to load the adapter in place, set 'load_inplace' to True.")
        parent = base_model_name if base_model_name in self.base_names else None
        lora = LoRARequest(name, next(self._ids), path, base_model_name=parent)
        try:
            self.check_lora(lora)
        except LoRAAdapterNotFoundError as exc:
            raise ApiError(404, "NotFoundError", str(exc), "lora_path") from None
        except (VLLMValidationError, TypeError) as exc:
            raise ApiError(400, "BadRequestError", str(exc), "lora_path") from None
        replaced = self.loras.get(name)
        self.loras[name] = lora
        if replaced is not None:
            self._forget(replaced)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str, lora_int_id: int | None = None) -> str:
        """Stop serving an adapter (vLLM's unload_lora_adapter); requests in flight finish with it."""
        if not name:
            raise ApiError(400, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter.")
        lora = self.loras.get(name)
        if lora is None or (lora_int_id is not None and lora_int_id != lora.lora_int_id):
            raise ApiError(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.")
        del self.loras[name]
        self._forget(lora)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _forget(self, lora: LoRARequest) -> None:
        if self.forget_lora is not None:
            self.forget_lora(lora.lora_int_id)


def _plain_folder_name(name: str) -> bool:
    """A model name that names one folder inside the resolver's (no separator, no `..`)."""
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..") and "\0" not in name
