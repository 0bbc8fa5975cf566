"""Beam search on top of the engine, as vLLM V1 does it (vllm/beam_search.py and
`LLM.beam_search`): each step asks the engine for one token of every live beam with
`logprobs = 2 * beam_width` and keeps the `beam_width` best extensions by score. The search is
a plain state machine (`BeamSearch`: `pending()` -> engine -> `advance()`), so the offline
`LLM` and the async server drive the same code."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_lite.exceptions import VLLMValidationError
from vllm_lite.outputs import Logprob
from vllm_lite.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    skip_special_tokens: bool = True  # (the sequences' text)

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise VLLMValidationError(f"BeamSearchParams.beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise VLLMValidationError(f"BeamSearchParams.max_tokens must be >= 1, got {self.max_tokens}")

    def step_params(self) -> SamplingParams:
        """One engine step of every beam: one token and the 2 * beam_width best candidates."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.beam_width, temperature=self.temperature)


@dataclass(slots=True)
class BeamSearchSequence:
    """`tokens` are the prompt's and the generated ones, and `LLM.beam_search`'s `text` is theirs
    (as vLLM's: the prompt's text then the generated text); the server's choices hold the
    generated text alone."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def beam_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's score: the cumulative logprob over length ** length_penalty (a final EOS not counted)."""
    length = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (max(length, 1) ** length_penalty)


@dataclass(slots=True)
class _Instance:
    prompt_len: int
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


class BeamSearch:
    """The search over several prompts at once. Drive it with:
    `while (batch := search.pending()): search.advance(<one logprob dict per batch entry>)`."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None) -> None:
        self.params = params
        self.eos_token_id = eos_token_id
        self.steps_done = 0
        self._instances = [_Instance(len(p), [BeamSearchSequence(list(p), [])]) for p in prompts]

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty)

    def pending(self) -> list[list[int]]:
        """The token ids of every live beam (the next engine batch); empty when the search is done."""
        if self.steps_done >= self.params.max_tokens:
            return []
        return [beam.tokens for instance in self._instances for beam in instance.beams]

    def pending_prompts(self) -> list[int]:
        """The prompt (its index) each of `pending()`'s beams continues."""
        return [index for index, instance in enumerate(self._instances) for _ in instance.beams]

    def advance(self, step_logprobs: list[dict[int, Logprob]]) -> None:
        """One step: `step_logprobs[i]` are the candidates after the i-th pending beam."""
        position = 0
        for instance in self._instances:
            candidates = []
            for beam in instance.beams:
                for token_id, logprob in step_logprobs[position].items():
                    extended = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [step_logprobs[position]],
                                                  beam.cum_logprob + logprob.logprob)
                    if token_id == self.eos_token_id and not self.params.ignore_eos:
                        extended.finish_reason = "stop"
                        instance.completed.append(extended)
                    else:
                        candidates.append(extended)
                position += 1
            candidates.sort(key=self._score, reverse=True)
            instance.beams = candidates[:self.params.beam_width]
        self.steps_done += 1

    def results(self) -> list[list[BeamSearchSequence]]:
        """Per prompt, the beam_width best finished or length-capped beams, best first (no text yet)."""
        out = []
        for instance in self._instances:
            for beam in instance.beams:
                beam.finish_reason = "length"
            ranked = sorted(instance.completed + instance.beams, key=self._score, reverse=True)
            out.append(ranked[:self.params.beam_width])
        return out

    def generated(self, prompt_index: int, beam: BeamSearchSequence) -> list[int]:
        return beam.tokens[self._instances[prompt_index].prompt_len:]
