"""Wire structs between the engine core and its workers (ranks).

Engine core -> every rank: `InitKVCache`, the step (`SchedulerOutput` in the diff form
`executor/messages.py` gives it), `Flush`, `Profile`, `CollectiveRpc`, `Shutdown`. Every rank -> engine core: `WorkerReply`, rank 0's
with the step's `ModelRunnerOutput`; an error (naming the rank) when a rank failed or died.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np


@dataclass(slots=True)
class LogprobsArrays:
    """Logprobs of a group of positions, column-wise (what workers hand to the engine core).

    Column 0 is the sampled (or, for prompt logprobs, the actual next prompt) token; columns
    1..k are the k most likely tokens, most likely first, so their ranks are 1..k."""

    token_ids: np.ndarray  # int32 [num_positions, k + 1]
    logprobs: np.ndarray  # float32 [num_positions, k + 1]
    ranks: np.ndarray  # int32 [num_positions, k + 1]

    def slice_rows(self, start: int, stop: int) -> LogprobsArrays:
        return self.take_rows(slice(start, stop))

    def take_rows(self, rows: np.ndarray | slice) -> LogprobsArrays:
        return LogprobsArrays(self.token_ids[rows], self.logprobs[rows], self.ranks[rows])


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]  # batch rows, in order
    sampled_token_ids: np.ndarray  # int32 [num_rows, 1]
    num_sampled: np.ndarray  # int32 [num_rows]; 0 for rows still mid-prefill (or unscheduled)
    logprobs: LogprobsArrays | None = None  # rows are batch rows; None when no row asked
    # request -> (prompt position of the first row, logprobs of the next prompt tokens)
    prompt_logprobs: dict[str, tuple[int, LogprobsArrays]] | None = None
    # request -> why the worker could not take it into its batch this step (it ran without it;
    # the engine core fails and frees it). None on almost every step.
    failed: dict[str, str] | None = None
    # the pooling runner: request -> its prompt's vector (float32 [hidden]), for the prompts completed
    pooled: dict[str, np.ndarray] | None = None
    # True: every row sampled (num_sampled all 1), as the worker knows; the engine core then
    # skips looking (its first numpy call after a forward pass costs tens of us). False: look.
    every_row_sampled: bool = False
    # Speculative decoding: the logprobs of the tokens a row kept after its first (row i of
    # `more_logprobs` is batch row more_logprobs_at[i, 0]'s token at position more_logprobs_at[i, 1]
    # >= 1 of its kept ones). None without such tokens of a request that asked for logprobs.
    more_logprobs: LogprobsArrays | None = None
    more_logprobs_at: np.ndarray | None = None  # int32 [num, 2]


class InitKVCache(msgspec.Struct, array_like=True, gc=False):
    num_blocks: int
    # Every rank runs its steps in this order (`executor.step_order`): the engine core's choice,
    # since it must know when to ask for a flush.
    launch_ahead: bool = False
    # the requests that hold a linear-attention state at once (a hybrid model's; else 0)
    num_state_slots: int = 0


class MeasureMemory(msgspec.Struct, array_like=True, gc=False):
    """Reply with the bytes this rank's KV cache may take under gpu_memory_utilization (every
    rank runs the profile step together: its forward pass has collectives)."""


class Flush(msgspec.Struct, array_like=True, gc=False):
    """Finish the held step (launched ahead) and reply with its output: the engine core takes it
    with no step submitted after it."""


class Shutdown(msgspec.Struct, array_like=True, gc=False):
    pass


class Profile(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """start_profile (`is_start`) or stop_profile on every rank (`Worker.profile`); every rank
    replies, with `profile_error` if it could not."""

    is_start: bool
    profile_prefix: str | None = None
    delay_iterations: int | None = None
    max_iterations: int | None = None


class CollectiveRpc(msgspec.Struct, array_like=True, gc=False):
    """collective_rpc on every rank: `call` is `vllm_lite.rpc`'s encoding of the method and its
    arguments (decoded by each rank); every rank replies with its result, encoded the same way,
    or with `rpc_error`."""

    call: bytes


class WorkerReply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Every rank replies once to every step (and to InitKVCache and MeasureMemory), in order. Rank 0's reply
    to a step carries the output; the other ranks' carry only the requests that failed on them
    (already in `output.failed` when every rank agreed on them before the forward pass), and
    each replies to MeasureMemory with its budget."""

    output: ModelRunnerOutput | None = None
    error: str | None = None  # a rank failed (its rank named) or died: the engine is dead
    rank: int = 0
    failed: dict[str, str] | None = None  # ranks > 0: request id -> why it failed on this rank
    kv_cache_budget: int | None = None  # the reply to MeasureMemory
    death_notice: bool = False  # posted by the executor's death watch, not by a rank
    profile_error: str | None = None  # the reply to Profile: why this rank could not (the engine goes on)
    rpc_result: bytes | None = None  # the reply to CollectiveRpc: the result (`vllm_lite.rpc` encoding)
    rpc_error: str | None = None  # ... or why the call failed on this rank (the engine goes on)
