"""RequestOutputCollector: one request's outputs on their way to its `generate` consumer, in
bounded memory (as vLLM's collector of the same name).

A consumer that keeps up takes each output as it comes. One that falls behind finds at most one
pending output: a new one is merged into it (DELTA: tokens and logprobs appended in place, text
pieces collected and joined once when the consumer takes the output; CUMULATIVE and FINAL_ONLY:
the newer completion replaces the older), so memory per request is bounded by the request's own
output, not by the number of steps, and merging costs what the new output adds. A consumer that has left more
than `max_unread` outputs unread is taken to have stopped reading: `put` reports it, and
AsyncLLM aborts the request (freeing its KV blocks) and leaves an error for the consumer.
"""

from __future__ import annotations

import asyncio

from vllm_lite.outputs import CompletionOutput, RequestOutput
from vllm_lite.sampling_params import RequestOutputKind

DEFAULT_MAX_UNREAD_OUTPUTS = 4096


class ConsumerStoppedReadingError(RuntimeError):
    """The request was aborted: its consumer left too many outputs unread."""


class RequestOutputCollector:
    def __init__(self, output_kind: RequestOutputKind, max_unread: int = DEFAULT_MAX_UNREAD_OUTPUTS) -> None:
        self.delta = output_kind == RequestOutputKind.DELTA
        self.max_unread = max_unread
        self.pending: RequestOutput | BaseException | None = None
        self.text_parts: dict[int, list[str]] = {}  # DELTA merges: completion index -> its text pieces
        self.num_unread = 0
        # The consumer's future while it waits. A bare future, not an asyncio.Event: the Event
        # looks up the running loop on every wait, and that lookup makes a getpid system call
        # (CPython's fork check), once per streamed token.
        self._waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand over an output or an error (an error replaces whatever is pending). Returns
        False once the consumer has left more than `max_unread` outputs unread."""
        if isinstance(item, BaseException) or self.pending is None or isinstance(self.pending, BaseException):
            if not isinstance(self.pending, BaseException):
                self.pending = item
                self.text_parts.clear()
        else:
            merge_into(self.pending, item, self.delta, self.text_parts)
        self.num_unread += 1
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return self.num_unread <= self.max_unread

    # The name asyncio.Queue uses, for code that puts outputs without caring about merging.
    put_nowait = put

    async def get(self) -> RequestOutput | BaseException:
        while self.pending is None:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item, self.pending, self.num_unread = self.pending, None, 0
        if self.text_parts:
            if isinstance(item, RequestOutput):
                for completion in item.outputs:
                    parts = self.text_parts.get(completion.index)
                    if parts is not None:
                        completion.text = "".join(parts)
            self.text_parts.clear()
        return item


def merge_into(pending: RequestOutput, new: RequestOutput, delta: bool,
               text_parts: dict[int, list[str]]) -> None:
    """Fold `new` into the unread `pending` output of the same request (completions matched by
    index: with n > 1 the children's outputs share one collector). DELTA text goes to
    `text_parts` (the pending completion's text first), for the reader to join."""
    by_index = {completion.index: completion for completion in pending.outputs}
    for completion in new.outputs:
        old = by_index.get(completion.index)
        if old is None:
            pending.outputs.append(completion)
        elif delta:
            _append_delta(old, completion, text_parts)
        else:
            pending.outputs[pending.outputs.index(old)] = completion
    pending.finished = new.finished
    pending.metrics = new.metrics
    if pending.prompt_logprobs is None:
        pending.prompt_logprobs = new.prompt_logprobs
    pending.num_cached_tokens = pending.num_cached_tokens or new.num_cached_tokens


def _append_delta(old: CompletionOutput, new: CompletionOutput, text_parts: dict[int, list[str]]) -> None:
    """`old` is the collector's own (nobody else holds its lists), so they grow in place."""
    parts = text_parts.get(old.index)
    if parts is None:
        parts = text_parts[old.index] = [old.text]
    parts.append(new.text)
    old.token_ids.extend(new.token_ids)
    if old.logprobs is not None and new.logprobs is not None:
        old.logprobs.extend(new.logprobs)
    old.cumulative_logprob = new.cumulative_logprob
    old.finish_reason = new.finish_reason
    old.stop_reason = new.stop_reason
