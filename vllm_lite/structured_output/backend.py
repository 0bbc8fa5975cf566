"""The interface a grammar engine implements (xgrammar today; llguidance could be another).

A backend turns a `(kind, spec)` pair into a compiled grammar once per tokenizer, and makes a
cheap matcher per request from it. Matchers advance with each accepted token and write the
set of allowed next tokens into one row of an int32 bitmask (bit `t % 32` of word `t // 32`
set = token `t` allowed), the layout the sampler's mask op reads.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm_lite.sampling_params import StructuredOutputsParams

# (kind, spec text, disable_any_whitespace): the cache key of a compiled grammar.
GrammarKey = tuple[str, str, bool]


def grammar_spec(params: StructuredOutputsParams) -> GrammarKey:
    """The text of a constraint: dict schemas as JSON (key order kept: it is the order the
    properties are generated in), choices as a grammar."""
    kind = params.kind
    value: Any = getattr(params, kind)
    if kind == "json":
        text = value if isinstance(value, str) else json.dumps(value)
    elif kind == "json_object":
        text = ""
    elif kind == "choice":
        kind, text = "grammar", choice_grammar(value)
    else:
        text = value
    return kind, text, params.disable_any_whitespace


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are valid
    EBNF string-literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row `row` of the backend's bitmask buffer."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar reached its end (its stop token was accepted)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding's drafts)."""


class CompiledGrammar(ABC):
    @abstractmethod
    def matcher(self, stop_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher of its own for one request. `stop_token_ids`: the request's, which end the
        value as the model's end tokens do (vLLM 0.32: at the grammar's end any of the
        request's stop tokens may be sampled, not its end token only)."""


class StructuredOutputBackend(ABC):
    """Built once per engine core, the first time a constrained request arrives."""

    vocab_size: int

    @staticmethod
    @abstractmethod
    def validate(key: GrammarKey) -> None:
        """Raise ValueError naming the problem when the spec cannot compile (no tokenizer
        needed: cheap enough for the request's entry checks)."""

    @abstractmethod
    def compile(self, key: GrammarKey) -> CompiledGrammar:
        """Compile against the tokenizer (slow: runs on the manager's thread pool)."""

    @abstractmethod
    def allocate_bitmask(self, num_rows: int) -> tuple[Any, np.ndarray]:
        """A bitmask buffer for the backend's matchers and a numpy view of the same memory."""
