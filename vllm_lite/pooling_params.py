"""vLLM's PoolingParams for a pooling model's requests (`LLM.embed` / `/v1/embeddings`,
`LLM.classify` / `/classify`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_lite.exceptions import VLLMValidationError
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from vllm_lite.config import ModelConfig


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """| field | meaning |
    |---|---|
    | use_activation | embeddings: L2-normalize the vector; classification: the model's activation (softmax, sigmoid) over the logits; None: the engine's pooler config |
    | dimensions | vLLM's Matryoshka truncation: the vector's first `dimensions` numbers (normalized after), for a model whose config.json says it was trained so (`is_matryoshka`, `matryoshka_dimensions`) |
    | task | vLLM's: "embed" or "classify", the model's own (set by the engine; another is refused) |
    | activation | set by the engine for classification: "softmax", "sigmoid" or "identity" |
    """

    use_activation: bool | None = None
    dimensions: int | None = None
    task: str | None = None
    activation: str | None = None

    def __post_init__(self) -> None:
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise VLLMValidationError(f"PoolingParams.use_activation must be a bool or None, "
                                      f"got {self.use_activation!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)):
            raise VLLMValidationError(f"PoolingParams.dimensions must be an int or None, got {self.dimensions!r}")


def resolve_pooling(params: PoolingParams | None, model_config: ModelConfig) -> PoolingParams:
    """A request's pooling with the engine's default filled in (use_activation: the pooler
    config's) and its dimensions checked against the model, by vLLM's rules."""
    params = params or PoolingParams()
    pooler = model_config.pooler
    use_activation = pooler.normalize if params.use_activation is None else params.use_activation
    if params.task is not None and params.task != pooler.task:
        raise VLLMValidationError(f"PoolingParams.task {params.task!r}: this model's task is {pooler.task!r}",
                                  parameter="task")
    if pooler.task == "classify":
        if params.dimensions is not None:
            raise VLLMValidationError("PoolingParams.dimensions is for embeddings; this is a classification model",
                                      parameter="dimensions")
        return PoolingParams(use_activation, None, "classify", pooler.activation if use_activation else "identity")
    dimensions = params.dimensions
    if dimensions is not None:
        hf = model_config.hf
        named = hf.raw.get("matryoshka_dimensions")
        if not (named or hf.raw.get("is_matryoshka")):
            raise VLLMValidationError(f"PoolingParams.dimensions: the model does not support Matryoshka embeddings; "
                                      f"dimensions must be unset (received dimensions={dimensions}); a model trained "
                                      "for them says so in config.json (is_matryoshka, matryoshka_dimensions; "
                                      "hf_overrides sets them)")
        if not 1 <= dimensions <= hf.hidden_size:
            raise VLLMValidationError(f"PoolingParams.dimensions: the model only supports dimensions in range "
                                      f"[1, {hf.hidden_size}], got {dimensions}")
        if named and dimensions not in named:
            raise VLLMValidationError(f"PoolingParams.dimensions: the model only supports Matryoshka dimensions "
                                      f"{named}, got {dimensions}")
    return PoolingParams(use_activation, dimensions, "embed")


def pooling_sampling_params() -> SamplingParams:
    """What a pooling request carries for the engine core: one placeholder token, never shown
    (the request finishes with it; its prompt's vector is the output)."""
    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY)
