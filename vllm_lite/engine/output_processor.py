"""EngineCoreOutputs -> RequestOutput on the client side: detokenize incrementally, apply stop
strings, and emit cumulative, delta or final-only outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_lite.engine.detokenizer import IncrementalDetokenizer
from vllm_lite.engine.protocol import EngineCoreOutputs, FinishReason
from vllm_lite.outputs import CompletionOutput, RequestOutput
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text: int = 0
    queue: Any = None  # set by AsyncLLM: where this request's outputs go

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_tokens(self, token_ids: list[int]) -> None:
        self.token_ids.extend(token_ids)
        if self.detokenizer is None:
            return
        before = len(self.text)
        self.text += self.detokenizer.add_tokens(token_ids)
        if self.params.stop:
            self._check_stop_strings(before)

    def finish(self, reason: FinishReason, stop_reason: int | None) -> None:
        if not self.finished:
            self.finish_reason, self.stop_reason = str(reason), stop_reason

    def _check_stop_strings(self, new_from: int) -> None:
        """Stop strings may span token boundaries: search from just before the new text."""
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
            index=0,
            text=self.text[text_start:text_end],
            token_ids=self.token_ids[token_start:],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self.sent_tokens, self.sent_text = len(self.token_ids), text_end
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion], self.finished)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, queue: Any = None) -> RequestState:
        if request_id in self.request_states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        detokenizer = None
        if params.detokenize:
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        state = RequestState(request_id, prompt, prompt_token_ids, params, detokenizer, queue=queue)
        self.request_states[request_id] = state
        return state

    def abort_requests(self, request_ids: list[str]) -> list[RequestState]:
        aborted = []
        for request_id in request_ids:
            state = self.request_states.pop(request_id, None)
            if state is not None:
                state.finish(FinishReason.ABORT, None)
                aborted.append(state)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(self, outputs: EngineCoreOutputs) -> tuple[list[RequestState], list[str]]:
        """Returns the states that changed this step and the ids whose generation a stop string
        ended here (the caller aborts those in the engine core)."""
        touched: dict[str, RequestState] = {}
        states = self.request_states
        for request_id, token_id in zip(outputs.req_ids, outputs.new_token_ids.tolist()):
            state = states.get(request_id)
            if state is not None and not state.finished:
                state.add_tokens([token_id])
                touched[request_id] = state
        stopped_by_string = [rid for rid, s in touched.items() if s.finished]
        for finished in outputs.finished:
            state = states.get(finished.request_id)
            if state is not None:
                state.finish(finished.finish_reason, finished.stop_reason)
                touched[finished.request_id] = state
        for request_id, state in touched.items():
            if state.finished:
                del states[request_id]
        finished_in_core = {f.request_id for f in outputs.finished}
        return list(touched.values()), [r for r in stopped_by_string if r not in finished_in_core]
