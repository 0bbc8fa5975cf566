"""Wire structs between clients and the engine core.

Part of the leaf `wire` package (msgspec + numpy only): the client side, the engine core and
`core/` (which produces `EngineCoreOutputs`) all import it. Token ids are int32 numpy arrays.

Framing: every ZMQ message is `[type tag, msgpack frame, *array frames]` (a ROUTER adds the
peer's identity in front). The tag says which struct the msgpack frame holds:

| direction | tag | struct |
|---|---|---|
| client -> engine | ADD `\x00` | EngineCoreRequest |
| client -> engine | ABORT `\x01` | AbortRequests |
| client -> engine | UTILITY `\x02` | UtilityRequest |
| engine -> client | OUTPUTS `\x00` | EngineCoreOutputs |
| engine -> client | UTILITY_RESULT `\x01` | UtilityResult |
| engine -> client | ERROR `\x02` | RequestError (a request the engine core rejected) |
| engine -> client | ENGINE_DEAD `\x03` | EngineDead (the busy loop failed; the engine exits) |

numpy arrays travel as `wire.codec` frames them (extra zmq frames, uncopied). No pickle (the
`collective_rpc` utility carries its call as bytes in `vllm_lite.rpc`'s encoding, which pickles
only where VLLM_ALLOW_INSECURE_SERIALIZATION allows it, as vLLM).

An OUTPUTS message leaves its `req_ids` out when they are those of the client's previous OUTPUTS
message with ids (every steady decode step): it names that message's number instead
(`RequestIdsSender` on the engine side, `RequestIdsReceiver` on the client side).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Any

import msgspec
import numpy as np

from vllm_lite.lora.request import LoRARequest
from vllm_lite.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    REPETITION = 3  # vLLM's: SamplingParams.repetition_detection found a repeated pattern
    ERROR = 4  # vLLM's: a step failed on the request after it was admitted (RequestError.while_running)

    def __str__(self) -> str:
        return self.name.lower()


REPETITION_STOP_REASON = "repetition_detected"  # vLLM's stop_reason for FinishReason.REPETITION


class ThinkingBudget(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A request's thinking_token_budget with the reasoning parser's start and end token ids
    (the client resolves them: the engine core has no tokenizer of its own)."""

    budget: int
    start_id: int
    end_id: int


class ImageInputs(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A prompt's images as the model's image processor made them: image i's features replace
    the inputs of its lengths[i] placeholder tokens from prompt position offsets[i]."""

    # float32 [num_images, channels, height, width]; LLaVA-NeXT: [num_images, tiles, channels,
    # height, width], padded to the most tiles of an image; Qwen2-VL: [num_images, patches,
    # values of a patch], padded to the most patches of an image
    pixel_values: np.ndarray
    offsets: np.ndarray  # int64 [num_images], ascending
    lengths: np.ndarray  # int64 [num_images]
    hashes: list[bytes]  # SHA-256 of each image's pixel values (and size): its prefix-cache key
    image_sizes: np.ndarray | None = None  # LLaVA-NeXT: int64 [num_images, 2], each image's (height, width)
    patch_grids: np.ndarray | None = None  # Qwen2-VL: int64 [num_images, 2], each image's (rows, columns) of patches


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: np.ndarray
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    max_tokens: int
    cache_salt: str | None = None  # separates this request's prefix-cache entries (vLLM's field)
    priority: int = 0  # vLLM's: lower is served first under the priority scheduling policy
    # an embedding model's request (the pooling runner): its prompt's vector comes back with its one token
    pooling: bool = False
    thinking: ThinkingBudget | None = None  # (core/thinking_budget.py)
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with (checked by the client)
    # vLLM's prompt_embeds: the prompt as the model's input embeddings, float32 [num_prompt_tokens,
    # inputs_embeds_size] (the model's dtype's values); its prompt_token_ids are placeholders (0)
    prompt_embeds: np.ndarray | None = None
    images: ImageInputs | None = None  # vLLM's multi_modal_data {"image": ...}, processed by the client


class FinishedRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    finish_reason: FinishReason
    stop_reason: int | str | None = None  # a stop token id, or REPETITION_STOP_REASON
    num_preemptions: int = 0  # times the request was preempted (vllm:request_num_preemptions)


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's results, column-wise: row i of `new_token_ids` (and of the logprob
    arrays, when requested) belongs to `req_ids[i]`. No per-request objects are built per step."""

    req_ids: list[str]
    new_token_ids: np.ndarray  # int32 [num_reqs]
    finished: list[FinishedRequest] = []
    # Requests whose first output token is in this step -> how many of their prompt tokens were
    # prefix-cache hits (RequestOutput.num_cached_tokens).
    num_cached_tokens: dict[str, int] = {}
    # Engine-core time.monotonic() of this step's tokens (vLLM's engine-core timestamp: the
    # first/last token times and inter-token latencies of the metrics).
    timestamp: float = 0.0
    # Requests whose first output token is in this step -> (queued, first scheduled) times, same clock.
    scheduling_times: dict[str, tuple[float, float]] = {}
    # the pooling runner: request -> its prompt's vector (float32 [hidden]), with its one token
    pooled: dict[str, np.ndarray] = {}
    # Sample logprobs, present when some request in the step asked for them. Column 0 is the
    # sampled token, columns 1..k the top-k (k = the largest request's), so ranks are 1..k there.
    logprob_token_ids: np.ndarray | None = None  # int32 [num_reqs, k + 1]
    logprobs: np.ndarray | None = None  # float32 [num_reqs, k + 1]
    logprob_ranks: np.ndarray | None = None  # int32 [num_reqs, k + 1]
    # Prompt logprobs of the prefill chunks computed this step: request j owns rows
    # prompt_logprobs_offsets[j]:prompt_logprobs_offsets[j+1]; its first row is prompt position
    # prompt_logprobs_starts[j] (the logprob of the token after it). Column 0 is that token.
    prompt_logprobs_req_ids: list[str] = []
    prompt_logprobs_starts: np.ndarray | None = None  # int32 [num_prompt_reqs]
    prompt_logprobs_offsets: np.ndarray | None = None  # int32 [num_prompt_reqs + 1]
    prompt_logprob_token_ids: np.ndarray | None = None  # int32 [total_rows, k + 1]
    prompt_logprobs: np.ndarray | None = None  # float32 [total_rows, k + 1]
    prompt_logprob_ranks: np.ndarray | None = None  # int32 [total_rows, k + 1]
    # Speculative decoding: a row's tokens after its first (drafts the model kept, then its own),
    # -1 past the row's last. None when no row took more than one token this step (every step
    # without speculative decoding). `split_token_columns` makes them steps of one token a row.
    more_token_ids: np.ndarray | None = None  # int32 [num_reqs, k]
    # With drafts in the step (else None): each row's draft tokens, and how many of them the
    # model kept (its sampled tokens matched them; the request may have stopped before some).
    num_draft_tokens: np.ndarray | None = None  # int32 [num_reqs]
    num_accepted_drafts: np.ndarray | None = None  # int32 [num_reqs]
    # The logprobs of `more_token_ids` (entry [i, j] of each is token more_token_ids[i, j]'s, as
    # the logprob arrays' row i is new_token_ids[i]'s); None when no request with them asked.
    more_logprob_token_ids: np.ndarray | None = None  # int32 [num_reqs, k, width]
    more_logprobs: np.ndarray | None = None  # float32 [num_reqs, k, width]
    more_logprob_ranks: np.ndarray | None = None  # int32 [num_reqs, k, width]
    # The label of the weights that sampled this step's tokens (vLLM's weight version; omitted on
    # the wire while it is the default)
    weight_version: str = "default"
    # The data-parallel engine that sent it (its rank; stamped by the DP client as it reads it)
    engine_index: int = 0
    # Set on the wire only (`RequestIdsSender`): this message's number when it carries `req_ids`,
    # or, when it left them out, the number of the message whose `req_ids` they are.
    req_ids_number: int = 0
    repeats_req_ids_of: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.req_ids and not self.finished


class RequestIdsSender:
    """Engine side of leaving out repeated `req_ids`: in a steady decode step the same ids (1,024
    of them at 1,024 requests) would otherwise be encoded, sent, and decoded into new strings
    every step. Numbers each OUTPUTS message that carries ids; a message to a client whose last
    message with ids had equal ids carries that number instead. Remembers the last `max_clients`
    clients (one forgotten gets its ids again). One per sending thread."""

    def __init__(self, max_clients: int = 64) -> None:
        self.max_clients = max_clients
        self._number = 0
        self._last: OrderedDict[bytes, tuple[list[str], int]] = OrderedDict()  # client -> ids, message number

    def prepare(self, client: bytes, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        if not outputs.req_ids:
            return outputs
        last = self._last.get(client)
        if last is not None and last[0] == outputs.req_ids:
            self._last.move_to_end(client)  # (forgotten last: the clients heard from least lately)
            return msgspec.structs.replace(outputs, req_ids=[], repeats_req_ids_of=last[1])
        self._number += 1
        self._last[client] = (outputs.req_ids, self._number)
        self._last.move_to_end(client)
        if len(self._last) > self.max_clients:
            self._last.popitem(last=False)
        return msgspec.structs.replace(outputs, req_ids_number=self._number)

    def forget(self, client: bytes) -> None:
        """The last message prepared for `client` was not sent: no later one may name its ids."""
        self._last.pop(client, None)


class RequestIdsReceiver:
    """Client side: puts back the `req_ids` a message left out (the very list object received
    with them: consumers read `req_ids`, never change it). A message that repeats ids this client
    did not receive (the one that carried them was lost) raises `msgspec.DecodeError`: its rows
    cannot be told apart, and they are never given to the wrong requests."""

    def __init__(self) -> None:
        self._last: tuple[int, list[str]] | None = None  # message number, its ids

    def restore(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        if outputs.repeats_req_ids_of:
            number = outputs.repeats_req_ids_of
            if self._last is None or self._last[0] != number:
                raise msgspec.DecodeError(f"an outputs message repeats the request ids of message {number}, "
                                          f"which this client did not receive")
            outputs.req_ids, outputs.repeats_req_ids_of = self._last[1], 0
        elif outputs.req_ids:
            self._last = (outputs.req_ids_number, outputs.req_ids)
        return outputs


# ---------------------------------------------------------------------------------------------
# Messages besides requests and outputs
# ---------------------------------------------------------------------------------------------


class RequestType:
    """First frame of a client -> engine message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"


class OutputType:
    """First frame of an engine -> client message."""

    OUTPUTS = b"\x00"
    UTILITY_RESULT = b"\x01"
    ERROR = b"\x02"
    ENGINE_DEAD = b"\x03"


# Utility calls an engine core answers; anything else gets an error result.
# vLLM's pause modes (EngineCore.pause): what happens to the requests in the engine
PAUSE_MODES = ("abort", "wait", "keep")

UTILITY_METHODS = ("get_stats", "is_healthy", "reset_prefix_cache", "engine_info", "profile", "collective_rpc", "pause",
                   "resume", "is_paused", "sleep", "release_kv_cache_memory", "wake_up",
                   "is_sleeping", "set_weight_version", "get_weight_version")


class AbortRequests(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_ids: list[str]


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A call of one of `UTILITY_METHODS`; the answer carries the same `call_id`."""

    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    result: Any = None
    error: str | None = None  # set when the call failed; `result` is then None


class RequestError(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The engine core rejected a request (or could not decode it): it will never run; or, with
    `while_running`, a step failed on it after it was admitted (vLLM's finish reason "error")."""

    request_id: str
    message: str
    while_running: bool = False


class EngineDead(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    message: str


REQUEST_STRUCTS: dict[bytes, type] = {
    RequestType.ADD: EngineCoreRequest,
    RequestType.ABORT: AbortRequests,
    RequestType.UTILITY: UtilityRequest,
}
OUTPUT_STRUCTS: dict[bytes, type] = {
    OutputType.OUTPUTS: EngineCoreOutputs,
    OutputType.UTILITY_RESULT: UtilityResult,
    OutputType.ERROR: RequestError,
    OutputType.ENGINE_DEAD: EngineDead,
}


def split_token_columns(outputs: EngineCoreOutputs) -> list[EngineCoreOutputs]:
    """A step whose rows took several tokens (speculative decoding: `more_token_ids`) as steps of
    one token a row, in order, for the client's per-step processing; each finished request in the
    step of its last token. Every other field (prompt logprobs, cached tokens, logprobs of the
    rows' first tokens, the stats) stays with the first. A step without them: itself."""
    more = outputs.more_token_ids
    if more is None:
        return [outputs]
    steps = [msgspec.structs.replace(outputs, more_token_ids=None, more_logprob_token_ids=None, more_logprobs=None,
                                     more_logprob_ranks=None, finished=[])]
    last_step: dict[str, int] = {}
    for column in range(more.shape[1]):
        rows = np.flatnonzero(more[:, column] >= 0)
        if len(rows) == 0:
            break
        req_ids = [outputs.req_ids[row] for row in rows.tolist()]
        last_step.update(dict.fromkeys(req_ids, len(steps)))
        step = EngineCoreOutputs(req_ids, more[rows, column], timestamp=outputs.timestamp,
                                 weight_version=outputs.weight_version)
        if outputs.more_logprobs is not None:
            step.logprob_token_ids = outputs.more_logprob_token_ids[rows, column]
            step.logprobs = outputs.more_logprobs[rows, column]
            step.logprob_ranks = outputs.more_logprob_ranks[rows, column]
        steps.append(step)
    for finished in outputs.finished:
        steps[last_step.get(finished.request_id, 0)].finished.append(finished)
    return steps
