"""vLLM's `LoRARequest`: which adapter a request runs with (vllm_lite.lora.request, as vLLM's path)."""

from __future__ import annotations

import msgspec

from vllm_lite.exceptions import VLLMValidationError


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """A LoRA adapter by name, id and folder (a PEFT save: adapter_config.json and
    adapter_model.safetensors). `lora_int_id` identifies the adapter's weights in the engine (the
    workers keep them by it), so one id stands for one folder for the engine's life; `lora_name`
    is what a server's clients call it. Equal and hashed by name, as vLLM's."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    # vLLM's: reload the adapter under the same id (weights updated in place); not implemented
    load_inplace: bool = False
    # vLLM's MoE expert-weight layout flag (no MoE LoRA here)
    is_3d_lora_weight: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise VLLMValidationError(f"lora_name must be a non-empty string, got {self.lora_name!r}",
                                      parameter="lora_name")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise VLLMValidationError(f"lora_int_id must be an int > 0, got {self.lora_int_id!r}",
                                      parameter="lora_int_id")
        if self.lora_int_id > 2**31 - 1:
            raise VLLMValidationError(f"lora_int_id must be < 2**31 (it lives in an int32 array), got "
                                      f"{self.lora_int_id}", parameter="lora_int_id")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise VLLMValidationError("lora_path must name the adapter's folder, got an empty path",
                                      parameter="lora_path")
        for name in ("load_inplace", "is_3d_lora_weight"):
            if getattr(self, name):
                raise VLLMValidationError(f"LoRARequest.{name}=True is not supported by vllm_lite",
                                          parameter=name)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
