"""The xgrammar backend (vLLM's default): JSON schema, JSON object, regex, EBNF, structural tag."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm_lite.structured_output.backend import (CompiledGrammar, GrammarKey, GrammarMatcher,
                                                 StructuredOutputBackend)


class XgrammarMatcher(GrammarMatcher):
    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)


class XgrammarCompiledGrammar(CompiledGrammar):
    def __init__(self, compiled: Any, end_token_ids: list[int]) -> None:
        self._compiled = compiled
        self._end_token_ids = end_token_ids  # the model's, which the tokenizer info holds

    def matcher(self, stop_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        import xgrammar

        override = sorted(set(self._end_token_ids).union(stop_token_ids)) if stop_token_ids else None
        return XgrammarMatcher(xgrammar.GrammarMatcher(self._compiled, override_stop_tokens=override))


class XgrammarBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int = 1) -> None:
        import xgrammar

        self.vocab_size = vocab_size
        self._end_token_ids = list(stop_token_ids)
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stop_token_ids)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=max_threads)

    @staticmethod
    def validate(key: GrammarKey) -> None:
        import xgrammar

        kind, text, disable_any_whitespace = key
        try:
            if kind == "json":
                json.loads(text)
                xgrammar.Grammar.from_json_schema(text, any_whitespace=not disable_any_whitespace)
            elif kind == "regex":
                xgrammar.Grammar.from_regex(text)
            elif kind == "grammar":
                xgrammar.Grammar.from_ebnf(text)
            elif kind == "structural_tag":
                xgrammar.Grammar.from_structural_tag(text)
        except Exception as exc:  # xgrammar raises RuntimeError / its own error types
            name = "json" if kind == "json" else kind
            raise ValueError(f"structured_outputs.{name} is invalid: {_first_line(exc)}") from None

    def compile(self, key: GrammarKey) -> CompiledGrammar:
        kind, text, disable_any_whitespace = key
        compiler = self._compiler
        if kind == "json":
            compiled = compiler.compile_json_schema(text, any_whitespace=not disable_any_whitespace)
        elif kind == "json_object":  # an object (OpenAI's JSON mode), not any JSON value
            compiled = compiler.compile_json_schema('{"type": "object"}',
                                                    any_whitespace=not disable_any_whitespace)
        elif kind == "regex":
            compiled = compiler.compile_regex(text)
        elif kind == "grammar":
            compiled = compiler.compile_grammar(text)
        elif kind == "structural_tag":
            compiled = compiler.compile_structural_tag(text)
        else:
            raise ValueError(f"unknown structured output kind {kind!r}")
        return XgrammarCompiledGrammar(compiled, self._end_token_ids)

    def allocate_bitmask(self, num_rows: int) -> tuple[Any, np.ndarray]:
        import xgrammar

        tensor = xgrammar.allocate_token_bitmask(num_rows, self.vocab_size)
        return tensor, tensor.numpy()


def _first_line(exc: Exception) -> str:
    """The message without xgrammar's `[time] file.cc:line: ` prefix."""
    text = str(exc).strip() or type(exc).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text.splitlines()[0])[:500]
