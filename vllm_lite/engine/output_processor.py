"""EngineCoreOutputs -> RequestOutput on the client side: detokenize incrementally, apply stop
strings, attach logprobs, fold n > 1 children into their parent, and emit cumulative, delta or
final-only outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_lite.engine.detokenizer import IncrementalDetokenizer, TokenPieces, new_detokenizer
from vllm_lite.engine.logprobs import LogprobsState
from vllm_lite.engine.output_text import OutputText
from vllm_lite.engine.parallel_sampling import ParentRequest
from vllm_lite.engine.stats import FinishedRequestStats, IterationStats
from vllm_lite.engine.output_token_store import OutputTokenStore
from vllm_lite.wire import EngineCoreOutputs, FinishedRequest, FinishReason, split_token_columns
from vllm_lite.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                               EmbeddingRequestOutput, RequestOutput, RequestStateStats, WeightVersionSpan)
from vllm_lite.lora.request import LoRARequest
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True, eq=False)  # a state is one request: identity, not field equality
class RequestState:
    """One engine-core request on the client. Its output token ids live in row `slot` of the
    processor's OutputTokenStore while it runs (in `own_ids` once released); they become a list only
    in the outputs handed to the user, and only the part handed out.

    A streamed request (cumulative or delta) gets an output at its first token, when it ends,
    and otherwise once `stream_interval` tokens have come since the last one (vLLM's rule).

    A request that needs nothing per token (`every_token` False: no stop strings, no sample
    logprobs, and final output only or a stream interval above 1) is seen by Python only at
    its first token, when it ends and, streamed, at each interval's output; its text is decoded
    when an output needs it (`decoded_tokens` tokens so far). `num_tokens` is then brought up
    to date from the store whenever the request is looked at."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    logprobs: LogprobsState | None = None  # None unless logprobs or prompt_logprobs were asked
    parent: ParentRequest | None = None
    index: int = 0  # this sample's index among the parent's n
    store: OutputTokenStore | None = None
    slot: int = -1
    own_ids: np.ndarray | None = None  # the tokens, once the slot is released
    num_tokens: int = 0
    every_token: bool = True
    output_text: OutputText | None = None  # None unless detokenize
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    core_finished: FinishedRequest | None = None  # the engine core finished it in the step being processed
    sent_tokens: int = 0
    decoded_tokens: int = 0  # output tokens the detokenizer has had (when not every_token)
    last_token_id: int = -1  # the latest token `add_token` took, as output token number `last_token_count`
    last_token_count: int = 0
    stream_interval: int = 1
    sent_prompt_logprobs: bool = False
    queue: Any = None  # set by AsyncLLM: where this request's outputs go
    num_cached_tokens: int = 0  # from the engine core, with the first output token
    stats: RequestStateStats = field(default_factory=RequestStateStats)
    lora_request: LoRARequest | None = None  # the adapter it runs with (handed out in its outputs)
    # vLLM's weight versions: the label when the request came, then (label, output tokens then)
    # at each change of the engine's weights' label while it ran
    first_weight_version: str = "default"
    weight_version_starts: list[tuple[str, int]] | None = None
    # An embedding request (the pooling runner): its resolved pooling (None: not one), and the
    # vector once it came (with the request's one placeholder token).
    pooling: PoolingParams | None = None
    pooled: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> np.ndarray:
        """The output token ids so far (a view)."""
        if self.own_ids is not None:
            return self.own_ids
        return self.store.ids[self.slot, :self.num_tokens]

    @property
    def text(self) -> str:
        return "" if self.output_text is None else "".join(self.output_text.pieces)

    def add_token(self, token_id: int, now: float) -> None:
        """Account for the step's token (already in the store): stats, text, stop strings. When
        the engine core ended the request with it by EOS or a stop token id, its text is left
        out unless include_stop_str_in_output (vLLM's rule)."""
        self._record_tokens(now)
        self.last_token_id, self.last_token_count = token_id, self.num_tokens
        if self.output_text is None or not self.every_token:
            return
        if self._stop_terminated() and not self.params.include_stop_str_in_output:
            return
        self._add_text(self.detokenizer.add_token(token_id), self.num_tokens)

    def _add_text(self, piece: str, num_output: int) -> None:
        """Text made by the first min_tokens tokens is never checked alone (vLLM's rule)."""
        stop = self.output_text.append(piece, check_stop=num_output > self.params.min_tokens)
        if stop is not None:
            self.finish_reason, self.stop_reason = "stop", stop

    def _stop_terminated(self) -> bool:
        finished = self.core_finished
        return finished is not None and finished.finish_reason == FinishReason.STOP

    def release(self) -> None:
        """Give the store row back, keeping a copy of the tokens."""
        if self.slot >= 0:
            self.own_ids = self.store.release(self.slot)
            self.slot = -1
            self.num_tokens = len(self.own_ids)

    def _weight_versions(self) -> list[WeightVersionSpan]:
        """vLLM's spans of output tokens by the label of the weights that sampled them (empty ones left out)."""
        starts = [(self.first_weight_version, 0), *(self.weight_version_starts or ())]
        ends = [start for _, start in starts[1:]] + [self.num_tokens]
        return [WeightVersionSpan(version, start, end) for (version, start), end in zip(starts, ends) if end > start]

    def weight_version_changed(self, version: str) -> None:
        self._sync_num_tokens()
        if self.weight_version_starts is None:
            self.weight_version_starts = []
        self.weight_version_starts.append((version, self.num_tokens))

    def _sync_num_tokens(self) -> None:
        if self.slot >= 0:
            self.num_tokens = int(self.store.counts[self.slot])

    def _record_tokens(self, now: float) -> None:
        stats = self.stats
        if stats.first_token_ts == 0.0:
            stats.first_token_ts = now
            stats.first_token_latency = time.monotonic() - stats.arrival_ts  # `now` may be the engine core's step time
        stats.last_token_ts = now
        stats.num_generation_tokens = self.num_tokens

    def finish(self, reason: FinishReason, stop_reason: int | str | None) -> None:
        if self.finished:
            return
        if self.output_text is not None:
            self.output_text.append(self._text_tail(), check_stop=False)
        self.finish_reason, self.stop_reason = str(reason), stop_reason

    def _text_tail(self) -> str:
        """What the detokenizer still holds; for a request decoded only at the end, its whole
        text (the last token left out when it was EOS or a stop id, as `add_token` does)."""
        if self.every_token:
            return self.detokenizer.flush()
        self._sync_num_tokens()
        token_ids = self.token_ids[self.decoded_tokens:]
        self.decoded_tokens = self.num_tokens
        if self._stop_terminated() and not self.params.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        return self.detokenizer.decode_rest(token_ids.tolist())

    def _decode_new_tokens(self) -> None:
        """The text of the tokens that came since the last output, for a stream that is not
        decoded token by token (it has no stop strings to check)."""
        if self.every_token or self.output_text is None or self.decoded_tokens == self.num_tokens:
            return
        piece = self.detokenizer.add_tokens(self.token_ids[self.decoded_tokens:].tolist())
        self.decoded_tokens = self.num_tokens
        self.output_text.append(piece, check_stop=False)

    def make_output(self) -> RequestOutput | EmbeddingRequestOutput | None:
        if self.pooling is not None:
            return self._embedding_output()
        kind = self.params.output_kind
        finished = self.finish_reason is not None
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if (self.stream_interval > 1 and not finished and self.sent_tokens > 0
                and self.num_tokens - self.sent_tokens < self.stream_interval):
            return None  # what is new stays for the next output (a delta's text and tokens too)
        self._decode_new_tokens()
        delta = kind == RequestOutputKind.DELTA
        token_start = self.sent_tokens if delta else 0
        text = self._text_out(delta, finished)
        if delta and token_start == self.num_tokens and not text and not finished:
            return None
        # The user-facing boundary: only the token ids handed out become a list (a stream's one
        # new token: the int the step handed over, without a view of the store).
        if self.num_tokens - token_start == 1 and self.last_token_count == self.num_tokens:
            token_ids = [self.last_token_id]
        else:
            token_ids = self.token_ids[token_start:].tolist()
        self.sent_tokens = self.num_tokens
        versions = self._weight_versions() if finished else None
        if self.logprobs is None:
            completion = CompletionOutput(self.index, text, token_ids, None, None, self.finish_reason,
                                          self.stop_reason, versions)
            prompt_logprobs = None
        else:
            completion = CompletionOutput(self.index, text, token_ids, self._cumulative_logprob(),
                                          self._sample_logprobs(token_start), self.finish_reason,
                                          self.stop_reason, versions)
            prompt_logprobs = self._prompt_logprobs(delta)
        if self.parent is None:
            # `metrics` is the live stats object, as in vLLM.
            return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion], finished,
                                 prompt_logprobs, self.num_cached_tokens, self.stats, self.lora_request)
        return self._parent_output(completion, prompt_logprobs)

    def _embedding_output(self) -> EmbeddingRequestOutput | ClassificationRequestOutput | None:
        if self.finish_reason is None or self.pooled is None:  # (aborted before its vector: no output)
            return None
        if self.pooling.task == "classify":
            probs = classifier_activation(self.pooled.astype(np.float64), self.pooling.activation)
            return ClassificationRequestOutput(self.request_id, ClassificationOutput(probs.astype(np.float32).tolist()),
                                               self.prompt_token_ids, True, self.num_cached_tokens, self.stats)
        vector = self.pooled[:self.pooling.dimensions].astype(np.float64)  # (Matryoshka: the first ones)
        if self.pooling.use_activation:  # as torch.nn.functional.normalize: x / max(||x||, 1e-12)
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return EmbeddingRequestOutput(self.request_id, EmbeddingOutput(vector.astype(np.float32).tolist()),
                                      self.prompt_token_ids, True, self.num_cached_tokens, self.stats)

    def _text_out(self, delta: bool, finished: bool) -> str:
        if self.output_text is None:
            return ""
        return self.output_text.take_delta(finished) if delta else self.output_text.text(finished)

    def _parent_output(self, completion: CompletionOutput, prompt_logprobs: Any) -> RequestOutput | None:
        parent = self.parent
        if prompt_logprobs is not None:
            parent.prompt_logprobs = prompt_logprobs
        completions, finished = parent.get_outputs(self.request_id, completion)
        if not completions:
            return None
        return RequestOutput(parent.request_id, self.prompt, self.prompt_token_ids, completions, finished,
                             prompt_logprobs=parent.prompt_logprobs, num_cached_tokens=self.num_cached_tokens,
                             metrics=self.stats, lora_request=self.lora_request)

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
    def __init__(self, tokenizer: Any, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval  # the engine's; a request may ask for a longer one
        self.request_states: dict[str, RequestState] = {}
        self.token_store = OutputTokenStore()
        self.parent_requests: dict[str, ParentRequest] = {}
        self._token_text: dict[int, str] = {}  # decoded single tokens, for Logprob.decoded_token
        self._token_pieces = TokenPieces.for_tokenizer(tokenizer)  # None: no byte-level decoder (or no tokenizer)
        # `_states_of`'s answer for each chunk start; emptied whenever a request comes or goes.
        self._rows_cache: dict[int, tuple[list[str], list[RequestState], np.ndarray, range | list[int]]] = {}
        self.weight_version = "default"  # the engine's label of its weights, as its last outputs said

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, queue: Any = None, parent: ParentRequest | None = None,
                    index: int = 0, pooling: PoolingParams | None = None,
                    lora_request: LoRARequest | None = None, prompt_is_embeds: bool = False) -> RequestState:
        """`pooling`: set for an embedding request (resolved: `resolve_pooling`). `prompt_is_embeds`:
        the prompt came as embeddings (its token ids placeholders, so the text starts without them)."""
        if request_id in self.request_states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        detokenizer = output_text = None
        # Without a tokenizer (skip_tokenizer_init) the text is "", as vLLM's, and stop strings
        # were refused by the input checks.
        detokenize = params.detokenize and self.tokenizer is not None
        if detokenize:
            detokenizer = new_detokenizer(self.tokenizer, () if prompt_is_embeds else prompt_token_ids,
                                          params.skip_special_tokens, self._token_pieces,
                                          params.spaces_between_special_tokens)
            output_text = OutputText(params.stop, params.include_stop_str_in_output,
                                     delta=params.output_kind == RequestOutputKind.DELTA)
        logprobs = None
        if params.logprobs is not None or params.prompt_logprobs is not None:
            decode = self._decode_token if detokenize else _no_text
            logprobs = LogprobsState(params.logprobs, params.prompt_logprobs, len(prompt_token_ids), decode,
                                     self.tokenizer.decode if detokenize else None,
                                     () if prompt_is_embeds else prompt_token_ids)
        interval = max(params.stream_interval or 1, self.stream_interval)
        streamed = params.output_kind != RequestOutputKind.FINAL_ONLY
        every_token = bool(params.stop) or params.logprobs is not None or (streamed and interval == 1)
        slot = self.token_store.acquire(watched=every_token, interval=interval if streamed and not every_token else 0)
        state = RequestState(request_id, prompt, prompt_token_ids, params, detokenizer, logprobs,
                             parent=parent, index=index, store=self.token_store, slot=slot,
                             every_token=every_token, output_text=output_text, queue=queue,
                             stream_interval=interval, stats=RequestStateStats(time.time(), time.monotonic()),
                             pooling=pooling, lora_request=lora_request)
        state.first_weight_version = self.weight_version
        self.request_states[request_id] = state
        self._rows_cache.clear()
        if parent is not None:
            self.parent_requests[parent.request_id] = parent
        return state

    def abort_requests(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT,
                       iteration_stats: IterationStats | None = None) -> list[RequestState]:
        """Ids may name a parent (n > 1): all its unfinished children are aborted (`reason`
        ERROR: a step failed on them; `iteration_stats` then counts them as finished so)."""
        aborted = []
        for request_id in self._expand_parents(request_ids):
            state = self.request_states.get(request_id)
            if state is not None:
                state.finish(reason, None)
                aborted.append(state)
                self._release(state, iteration_stats)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def num_prefill_tokens(self) -> int:
        """The prompt tokens of the requests without an output token yet (max_num_queued_tokens)."""
        total = 0
        for state in self.request_states.values():
            state._sync_num_tokens()
            if state.num_tokens == 0:
                total += len(state.prompt_token_ids)
        return total

    def process_outputs(self, outputs: EngineCoreOutputs, iteration_stats: IterationStats | None = None
                        ) -> tuple[list[RequestState], list[str]]:
        """Returns the states that changed this step and the ids whose generation a stop string
        ended here (the caller aborts those in the engine core). The same as `begin_step`,
        `process_rows` over all rows and `end_step`, which let a caller spread one step's
        work over several turns of its event loop. `iteration_stats`, when given, collects the
        step's numbers for the metrics (engine/stats.py)."""
        if outputs.more_token_ids is not None:  # (speculative decoding: rows with several tokens)
            return self._process_token_columns(outputs, iteration_stats)
        self.begin_step(outputs, iteration_stats)
        states, stopped_by_string = self.process_rows(outputs, 0, len(outputs.req_ids), iteration_stats)
        return states + self.end_step(outputs, iteration_stats), stopped_by_string

    def _process_token_columns(self, outputs: EngineCoreOutputs, iteration_stats: IterationStats | None
                               ) -> tuple[list[RequestState], list[str]]:
        """`process_outputs` for a step whose rows took several tokens: as that many steps of one
        (each state changed returned once)."""
        states: dict[int, RequestState] = {}
        stopped_by_string: list[str] = []
        for part in split_token_columns(outputs):
            part_states, part_stopped = self.process_outputs(part, iteration_stats)
            states.update((id(state), state) for state in part_states)
            stopped_by_string.extend(part_stopped)
        return list(states.values()), stopped_by_string

    def begin_step(self, outputs: EngineCoreOutputs, iteration_stats: IterationStats | None = None) -> None:
        """What comes before the step's token rows: prompt logprobs, prefix-cache hits, and which
        requests the engine core finished (so their last token is handled as the last); the
        step's speculative decoding counts into `iteration_stats`."""
        if iteration_stats is not None and outputs.num_draft_tokens is not None:
            iteration_stats.count_drafts(outputs.num_draft_tokens, outputs.num_accepted_drafts)
        if outputs.weight_version != self.weight_version:  # (new weights sampled this step's tokens)
            self.weight_version = outputs.weight_version
            for state in self.request_states.values():
                state.weight_version_changed(outputs.weight_version)
        if outputs.prompt_logprobs_req_ids:
            self._add_prompt_logprobs(outputs)
        states = self.request_states
        for request_id, vector in outputs.pooled.items():
            state = states.get(request_id)
            if state is not None:
                state.pooled = vector
        for request_id, num_cached in outputs.num_cached_tokens.items():
            state = states.get(request_id)
            if state is not None:
                state.num_cached_tokens = num_cached
        for request_id, (queued_ts, scheduled_ts) in outputs.scheduling_times.items():
            state = states.get(request_id)
            if state is not None:
                state.stats.queued_ts, state.stats.scheduled_ts = queued_ts, scheduled_ts
                state.stats.engine_index = outputs.engine_index
        for finished in outputs.finished:
            state = states.get(finished.request_id)
            if state is not None:
                state.core_finished = finished
                state.stats.num_preemptions = finished.num_preemptions
                self.token_store.watched[state.slot] = True  # its last token is looked at

    def process_rows(self, outputs: EngineCoreOutputs, start: int, stop: int,
                     iteration_stats: IterationStats | None = None) -> tuple[list[RequestState], list[str]]:
        """Rows `start:stop` of the step: the new tokens go into the token store in one scatter;
        the step's metrics, when asked for, are counted over the rows at once; then Python looks
        only at the requests that need it this step (every token of a stream, of stop strings or
        logprobs; a stream's token that ends its interval; a first token; a last one) for text,
        stop strings, logprobs and their own stats; requests that finish here are released.
        Returns the states looked at."""
        req_ids = outputs.req_ids  # (the whole list when it is one chunk: no copy of 1,024 references)
        states, slots, rows = self._states_of(req_ids if start == 0 and stop >= len(req_ids) else req_ids[start:stop],
                                              start)
        token_ids = (outputs.new_token_ids[start:start + len(states)] if isinstance(rows, range)
                     else outputs.new_token_ids[rows])
        counts, looked_at_rows = self.token_store.append_and_look(slots, token_ids)
        now = outputs.timestamp or time.monotonic()  # the engine core's step time when it sends one
        if iteration_stats is not None:
            self._count_tokens(iteration_stats, states, slots, counts, now)
            if outputs.pooled:  # an embedding request's placeholder token is no generated token
                iteration_stats.num_generation_tokens -= sum(state.pooling is not None for state in states)
        looked_at = looked_at_rows.tolist()
        if len(looked_at) < len(states):
            states = [states[i] for i in looked_at]
            rows = [rows[i] for i in looked_at]
            token_ids, counts = token_ids[looked_at], counts[looked_at]
        else:
            states = list(states)  # (the caller's own: the kept one stays as it is)
        as_ints = token_ids.tolist()  # the detokenizer takes Python ints
        with_logprobs = outputs.logprobs is not None
        stopped_by_string: list[str] = []
        for row, state, token_id, num_tokens in zip(rows, states, as_ints, counts.tolist()):
            state.num_tokens = num_tokens
            if with_logprobs and state.logprobs is not None and state.params.logprobs is not None:
                state.logprobs.add_sample_row(outputs.logprob_token_ids[row], outputs.logprobs[row],
                                              outputs.logprob_ranks[row])
            state.add_token(token_id, now)
            finished_in_core = state.core_finished
            if state.finish_reason is not None:
                if finished_in_core is None:
                    stopped_by_string.append(state.request_id)
                self._release(state, iteration_stats)
            elif finished_in_core is not None:
                state.finish(finished_in_core.finish_reason, finished_in_core.stop_reason)
                self._release(state, iteration_stats)
        return states, stopped_by_string

    def _states_of(self, req_ids: list[str], start: int
                   ) -> tuple[list[RequestState], np.ndarray, range | list[int]]:
        """The states and token-store slots of the requests of a step's rows `start:` (`req_ids`)
        that are still here, and which rows those are. Kept while no request comes or goes and the
        step names the same requests (steady decode): one comparison of the id lists then, instead
        of a lookup per row. The states list is the kept one: the caller reads it, never changes it."""
        cached = self._rows_cache.get(start)
        if cached is not None and (cached[0] is req_ids or cached[0] == req_ids):  # (`is`: RequestIdsReceiver)
            return cached[1], cached[2], cached[3]
        states = list(map(self.request_states.get, req_ids))
        if None in states:  # aborted since the step ran
            rows: range | list[int] = [row for row, state in enumerate(states, start) if state is not None]
            states = [state for state in states if state is not None]
        else:
            rows = range(start, start + len(states))
        slots = np.fromiter([state.slot for state in states], np.int64, len(states))
        slots.flags.writeable = False  # kept for later steps
        self._rows_cache[start] = (req_ids, states, slots, rows)
        return states, slots, rows

    def _count_tokens(self, iteration_stats: IterationStats, states: list[RequestState], slots: np.ndarray,
                      counts: np.ndarray, now: float) -> None:
        """vLLM's per-step counting, over the rows at once: a first token brings its prompt's
        tokens, a later one an inter-token latency (from the slot's previous token's step)."""
        store = self.token_store
        first = counts == 1
        iteration_stats.num_generation_tokens += len(counts)
        for i in np.flatnonzero(first).tolist():
            iteration_stats.num_prompt_tokens += len(states[i].prompt_token_ids) - states[i].num_cached_tokens
        later = slots[~first]
        if len(later):
            gaps = now - store.last_token_ts[later]
            # (a row's later tokens of one step, speculative decoding's, share its time: one
            # latency per step and request, as vLLM counts them)
            iteration_stats.inter_token_latencies.append(gaps if gaps.all() else gaps[gaps > 0])
        store.last_token_ts[slots] = now

    def end_step(self, outputs: EngineCoreOutputs,
                 iteration_stats: IterationStats | None = None) -> list[RequestState]:
        """Requests the engine core finished without a token row this step."""
        ended = []
        for finished in outputs.finished:
            state = self.request_states.get(finished.request_id)
            if state is not None:
                state.finish(finished.finish_reason, finished.stop_reason)
                self._release(state, iteration_stats)
                ended.append(state)
        return ended

    def _release(self, state: RequestState, iteration_stats: IterationStats | None = None) -> None:
        del self.request_states[state.request_id]
        self._rows_cache.clear()
        state.release()
        parent_done = self._drop_parent_if_done(state)
        if iteration_stats is None:
            return
        reason = state.finish_reason
        if state.pooling is not None:  # its one "token" is a placeholder; vLLM finishes it as stopped
            generated, max_tokens = 0, None
            reason = "abort" if reason == "abort" else "stop"
        else:
            generated, max_tokens = state.stats.num_generation_tokens, state.params.max_tokens
        most = generated
        if state.parent is None:
            n = 1
        else:
            n = state.parent.params.n if parent_done else None
            most = state.parent.max_num_generation_tokens = max(state.parent.max_num_generation_tokens, generated)
        iteration_stats.finished_requests.append(FinishedRequestStats.of(
            state.stats, reason, len(state.prompt_token_ids), generated, max_tokens, n, state.num_cached_tokens, most))

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

    def _drop_parent_if_done(self, state: RequestState) -> bool:
        """Whether `state` was the last of its parent's samples (the parent is then dropped)."""
        parent = state.parent
        if parent is not None and not any(parent.child_id(i) in self.request_states
                                          for i in range(parent.params.n)):
            self.parent_requests.pop(parent.request_id, None)
            return True
        return False

    def _decode_token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


def _no_text(token_id: int) -> None:
    return None


def classifier_activation(logits: np.ndarray, activation: str | None) -> np.ndarray:
    """vLLM's classification activations over one prompt's logits (float64 here)."""
    if activation == "softmax":
        shifted = np.exp(logits - logits.max())
        return shifted / shifted.sum()
    if activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    return logits
