"""Incremental detokenization: text grows token by token and never ends in a partial
UTF-8 character (the replacement character is held back until the next token completes it).

Invariant: `tokens[prefix_offset:read_offset]` decodes to text that ends on a whole character
and has been emitted; only text after it is new. So the concatenation of everything emitted
(plus `flush()` at the end) equals decoding all the tokens at once.
"""

from __future__ import annotations

from typing import Any

# Decoding a window that starts a few tokens back keeps the tokenizer's merge/space rules right
# at the join (e.g. sentencepiece's leading spaces).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.tokens: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens; returns the text they completed (possibly empty)."""
        new_text = ""
        for token_id in token_ids:
            self.tokens.append(token_id)
            new_text += self._step(final=False)
        return new_text

    def flush(self) -> str:
        """At the end of generation, emit what was held back (an incomplete or invalid UTF-8
        tail decodes to replacement characters, as `tokenizer.decode` gives it)."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        if self.read_offset == len(self.tokens):
            return ""
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return full[len(prefix):]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
