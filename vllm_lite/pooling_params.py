"""vLLM's PoolingParams for an embedding model's requests (`LLM.embed`, `/v1/embeddings`)."""

from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING

from vllm_lite.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from vllm_lite.config import ModelConfig


@dataclass(slots=True)
class PoolingParams:
    """| field | meaning |
    |---|---|
    | use_activation | L2-normalize the vector (vLLM's name for embeddings); None: the engine's pooler config |
    | dimensions | vLLM's matryoshka truncation: refused, no matryoshka model is implemented |
    """

    use_activation: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"PoolingParams.use_activation must be a bool or None, got {self.use_activation!r}")
        if self.dimensions is not None:
            raise ValueError(f"PoolingParams.dimensions={self.dimensions!r}: the model does not support matryoshka "
                             "representation, so changing the output dimensions is not supported")


def pooling_sampling_params() -> SamplingParams:
    """What a pooling request carries for the engine core: one placeholder token, never shown
    (the request finishes with it; its prompt's vector is the output)."""
    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def pooling_normalize(params: PoolingParams, model_config: ModelConfig) -> bool:
    """Whether a pooling request's vector is L2-normalized: its own use_activation, else the
    engine's pooler config."""
    return model_config.pooler.normalize if params.use_activation is None else params.use_activation
