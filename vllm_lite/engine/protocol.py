"""Wire protocol between clients and the engine core.

A leaf module (msgspec + numpy only): the client side, the engine core and `core/` (which
produces `EngineCoreOutputs`) all import it. Token ids are int32 numpy arrays.
"""

from __future__ import annotations

import enum

import msgspec
import numpy as np

from vllm_lite.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: np.ndarray
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    max_tokens: int
    client_index: int = 0


class FinishedRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    finish_reason: FinishReason
    stop_reason: int | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's results, column-wise: row i of `new_token_ids` (and of the logprob
    arrays, when requested) belongs to `req_ids[i]`. No per-request objects are built per step."""

    req_ids: list[str]
    new_token_ids: np.ndarray  # int32 [num_reqs]
    finished: list[FinishedRequest] = []
    client_index: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.req_ids and not self.finished
