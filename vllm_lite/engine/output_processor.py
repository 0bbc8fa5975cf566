"""EngineCoreOutputs -> RequestOutput on the client side: detokenize incrementally, apply stop
strings, attach logprobs, fold n > 1 children into their parent, and emit cumulative, delta or
final-only outputs."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_lite.engine.detokenizer import IncrementalDetokenizer
from vllm_lite.engine.logprobs import LogprobsState
from vllm_lite.engine.parallel_sampling import ParentRequest
from vllm_lite.engine.stats import FinishedRequestStats, IterationStats
from vllm_lite.wire import EngineCoreOutputs, FinishedRequest, FinishReason
from vllm_lite.outputs import CompletionOutput, RequestOutput, RequestStateStats
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    logprobs: LogprobsState | None = None  # None unless logprobs or prompt_logprobs were asked
    parent: ParentRequest | None = None
    index: int = 0  # this sample's index among the parent's n
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text: int = 0
    sent_prompt_logprobs: bool = False
    queue: Any = None  # set by AsyncLLM: where this request's outputs go
    num_cached_tokens: int = 0  # from the engine core, with the first output token
    stats: RequestStateStats = field(default_factory=RequestStateStats)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_tokens(self, token_ids: list[int], stop_terminated: bool = False) -> None:
        """`stop_terminated`: the last token is the EOS/stop token that ended the request; its
        text is left out unless include_stop_str_in_output (vLLM's rule)."""
        num_before = len(self.token_ids)
        self.token_ids.extend(token_ids)
        if self.detokenizer is None:
            return
        if stop_terminated and not self.params.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        for num_output, token_id in enumerate(token_ids, start=num_before + 1):
            check_from = len(self.text)
            self.text += self.detokenizer.add_tokens([token_id])
            if self.params.stop and num_output > self.params.min_tokens:
                self._check_stop_strings(check_from)
                if self.finished:
                    return

    def finish(self, reason: FinishReason, stop_reason: int | None) -> None:
        if self.finished:
            return
        if self.detokenizer is not None:
            self.text += self.detokenizer.flush()
        self.finish_reason, self.stop_reason = str(reason), stop_reason

    def _check_stop_strings(self, new_from: int) -> None:
        """Stop strings may span token boundaries: search from just before the new text. Text
        made by the first min_tokens tokens is never checked alone (vLLM's rule)."""
        longest = max(len(s) for s in self.params.stop)
        start = max(0, new_from - longest + 1)
        hit = None
        for stop in self.params.stop:
            index = self.text.find(stop, start)
            if index != -1 and (hit is None or index < hit[0]):
                hit = (index, stop)
        if hit is None:
            return
        index, stop = hit
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self.text = self.text[:end]
        self.finish_reason, self.stop_reason = "stop", stop

    def make_output(self) -> RequestOutput | None:
        kind = self.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        text_end = len(self.text)
        if self.params.stop and not self.finished and not self.params.include_stop_str_in_output:
            # Hold back text that could still turn out to be the start of a stop string.
            text_end = max(self.sent_text, text_end - max(len(s) for s in self.params.stop) + 1)
        delta = kind == RequestOutputKind.DELTA
        token_start = self.sent_tokens if delta else 0
        text_start = self.sent_text if delta else 0
        if delta and token_start == len(self.token_ids) and text_start == text_end and not self.finished:
            return None
        completion = CompletionOutput(
            index=self.index,
            text=self.text[text_start:text_end],
            token_ids=self.token_ids[token_start:],
            cumulative_logprob=self._cumulative_logprob(),
            logprobs=self._sample_logprobs(token_start),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self.sent_tokens, self.sent_text = len(self.token_ids), text_end
        prompt_logprobs = self._prompt_logprobs(delta)
        if self.parent is None:
            return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion],
                                 self.finished, prompt_logprobs=prompt_logprobs,
                                 num_cached_tokens=self.num_cached_tokens, metrics=copy.copy(self.stats))
        return self._parent_output(completion, prompt_logprobs)

    def _parent_output(self, completion: CompletionOutput, prompt_logprobs: Any) -> RequestOutput | None:
        parent = self.parent
        if prompt_logprobs is not None:
            parent.prompt_logprobs = prompt_logprobs
        completions, finished = parent.get_outputs(self.request_id, completion)
        if not completions:
            return None
        return RequestOutput(parent.request_id, self.prompt, self.prompt_token_ids, completions, finished,
                             prompt_logprobs=parent.prompt_logprobs, num_cached_tokens=self.num_cached_tokens,
                             metrics=copy.copy(self.stats))

    def _cumulative_logprob(self) -> float | None:
        if self.logprobs is None or self.params.logprobs is None:
            return None
        return self.logprobs.cumulative_logprob

    def _sample_logprobs(self, start: int) -> list | None:
        if self.logprobs is None or self.params.logprobs is None:
            return None
        return self.logprobs.logprobs[start:]

    def _prompt_logprobs(self, delta: bool) -> list | None:
        """Sent with every output, or only the first one in delta mode."""
        if self.logprobs is None or (delta and self.sent_prompt_logprobs):
            return None
        self.sent_prompt_logprobs = True
        return self.logprobs.prompt_logprobs()


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self._token_text: dict[int, str] = {}  # decoded single tokens, for Logprob.decoded_token

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, queue: Any = None, parent: ParentRequest | None = None,
                    index: int = 0) -> RequestState:
        if request_id in self.request_states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        detokenizer = None
        if params.detokenize:
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        logprobs = None
        if params.logprobs is not None or params.prompt_logprobs is not None:
            decode = self._decode_token if params.detokenize else _no_text
            logprobs = LogprobsState(params.logprobs, params.prompt_logprobs, len(prompt_token_ids), decode)
        state = RequestState(request_id, prompt, prompt_token_ids, params, detokenizer, logprobs,
                             parent=parent, index=index, queue=queue,
                             stats=RequestStateStats(time.time(), time.monotonic()))
        self.request_states[request_id] = state
        if parent is not None:
            self.parent_requests[parent.request_id] = parent
        return state

    def abort_requests(self, request_ids: list[str]) -> list[RequestState]:
        """Ids may name a parent (n > 1): all its unfinished children are aborted."""
        aborted = []
        for request_id in self._expand_parents(request_ids):
            state = self.request_states.pop(request_id, None)
            if state is not None:
                state.finish(FinishReason.ABORT, None)
                aborted.append(state)
                self._drop_parent_if_done(state)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(self, outputs: EngineCoreOutputs, iteration_stats: IterationStats | None = None
                        ) -> tuple[list[RequestState], list[str]]:
        """Returns the states that changed this step and the ids whose generation a stop string
        ended here (the caller aborts those in the engine core). `iteration_stats`, when given,
        collects the step's numbers for the metrics (engine/stats.py)."""
        states = self.request_states
        finished_in_core = {f.request_id: f for f in outputs.finished}
        self._add_prompt_logprobs(outputs)
        touched: dict[str, RequestState] = {}
        now = outputs.timestamp or time.monotonic()  # the engine core's step time when it sends one
        for request_id, num_cached in outputs.num_cached_tokens.items():
            state = states.get(request_id)
            if state is not None:
                state.num_cached_tokens = num_cached
        for request_id, (queued_ts, scheduled_ts) in outputs.scheduling_times.items():
            state = states.get(request_id)
            if state is not None:
                state.stats.queued_ts, state.stats.scheduled_ts = queued_ts, scheduled_ts
        for i, (request_id, token_id) in enumerate(zip(outputs.req_ids, outputs.new_token_ids.tolist())):
            state = states.get(request_id)
            if state is None or state.finished:
                continue
            if state.logprobs is not None and state.params.logprobs is not None and outputs.logprobs is not None:
                state.logprobs.add_sample_row(outputs.logprob_token_ids[i], outputs.logprobs[i],
                                              outputs.logprob_ranks[i])
            state.add_tokens([token_id], _stop_terminated(finished_in_core.get(request_id)))
            if iteration_stats is not None:
                _count_token(iteration_stats, state, now)
            _record_token(state.stats, now)
            touched[request_id] = state
        stopped_by_string = [rid for rid, s in touched.items() if s.finished]
        for finished in outputs.finished:
            state = states.get(finished.request_id)
            if state is not None:
                state.finish(finished.finish_reason, finished.stop_reason)
                state.stats.num_preemptions = finished.num_preemptions
                touched[finished.request_id] = state
        for request_id, state in touched.items():
            if state.finished:
                del states[request_id]
                self._drop_parent_if_done(state)
                if iteration_stats is not None:
                    iteration_stats.finished_requests.append(
                        FinishedRequestStats.of(state.stats, state.finish_reason, len(state.prompt_token_ids)))
        return list(touched.values()), [r for r in stopped_by_string if r not in finished_in_core]

    def _add_prompt_logprobs(self, outputs: EngineCoreOutputs) -> None:
        offsets = outputs.prompt_logprobs_offsets
        for j, request_id in enumerate(outputs.prompt_logprobs_req_ids):
            state = self.request_states.get(request_id)
            if state is None or state.logprobs is None or state.params.prompt_logprobs is None:
                continue
            rows = slice(int(offsets[j]), int(offsets[j + 1]))
            state.logprobs.add_prompt_rows(int(outputs.prompt_logprobs_starts[j]),
                                           outputs.prompt_logprob_token_ids[rows],
                                           outputs.prompt_logprobs[rows], outputs.prompt_logprob_ranks[rows])

    def _expand_parents(self, request_ids: list[str]) -> list[str]:
        expanded = []
        for request_id in request_ids:
            parent = self.parent_requests.get(request_id)
            if parent is None:
                expanded.append(request_id)
            else:
                expanded.extend(parent.child_id(i) for i in range(parent.params.n))
        return expanded

    def _drop_parent_if_done(self, state: RequestState) -> None:
        parent = state.parent
        if parent is not None and not any(parent.child_id(i) in self.request_states
                                          for i in range(parent.params.n)):
            self.parent_requests.pop(parent.request_id, None)

    def _decode_token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


def _count_token(iteration_stats: IterationStats, state: RequestState, now: float) -> None:
    """vLLM's per-step counting: a first token brings its prompt's tokens, a later one an
    inter-token latency."""
    iteration_stats.num_generation_tokens += 1
    if state.stats.num_generation_tokens == 0:
        iteration_stats.num_prompt_tokens += len(state.prompt_token_ids)
    else:
        iteration_stats.inter_token_latencies.append(now - state.stats.last_token_ts)


def _record_token(stats: RequestStateStats, now: float) -> None:
    if stats.num_generation_tokens == 0:
        stats.first_token_ts = now
        stats.first_token_latency = time.monotonic() - stats.arrival_ts
    stats.last_token_ts = now
    stats.num_generation_tokens += 1


def _stop_terminated(finished: FinishedRequest | None) -> bool:
    return finished is not None and finished.finish_reason == FinishReason.STOP


def _no_text(token_id: int) -> None:
    return None
