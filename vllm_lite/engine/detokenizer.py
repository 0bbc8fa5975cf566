"""Incremental detokenization: text grows token by token and never ends in a partial UTF-8
character (the replacement character is held back until a later token completes it). The
concatenation of everything emitted, plus `flush()` at the end, equals decoding the context and
the new tokens at once, minus the text of the context's whole characters: a prompt that ends
inside a character leaves it to the output (the output's first tokens may complete it).

Two implementations, as vLLM has them:

* `FastIncrementalDetokenizer`: `tokenizers`' `DecodeStream` (one Rust call per token) over the
  tokenizer's backend; for every tokenizer built on `tokenizers` (transformers' fast tokenizers).
  With a byte-level decoder, a token whose bytes are whole UTF-8 characters decodes to the same
  text after any prefix that ends on a character: such tokens take their text from
  `TokenPieces` (decoded once per tokenizer) instead of a stream step while nothing is held back.
* `SlowIncrementalDetokenizer`: two `tokenizer.decode` calls per token over a sliding window of
  token ids; for any other tokenizer.

`new_detokenizer` picks one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# Decoding a window that starts a few tokens back keeps the tokenizer's merge/space rules right
# at the join (e.g. sentencepiece's leading spaces).
_CONTEXT_TOKENS = 5
# tokenizers' DecodeStream raises this when a new token changes text it has already returned
# (possible with some normalizers); the stream is then restarted (vLLM does the same).
_INVALID_PREFIX = "Invalid prefix encountered"


def whole_characters(decode: Callable[[list[int]], str], context: list[int]) -> int:
    """How many of `context`'s first tokens decode to text that ends on a whole character (the
    tokens after them leave one unfinished)."""
    end = len(context)
    while end and decode(context[:end]).endswith("\ufffd"):
        end -= 1
    return end


class IncrementalDetokenizer(Protocol):
    def add_token(self, token_id: int) -> str:
        """Append one token; returns the text it completed (possibly empty)."""

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append tokens; returns the text they completed (possibly empty)."""

    def flush(self) -> str:
        """At the end of generation, emit what was held back (an incomplete or invalid UTF-8
        tail decodes to replacement characters, as `tokenizer.decode` gives it)."""

    def decode_rest(self, token_ids: Sequence[int]) -> str:
        """At the end of generation, the text of tokens never added one by one, with what was
        held back: `add_tokens(token_ids) + flush()` in one decode."""


def new_detokenizer(tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool,
                    pieces: TokenPieces | None = None,
                    spaces_between_special_tokens: bool = True) -> IncrementalDetokenizer:
    """`pieces`: the tokenizer's TokenPieces, shared by its requests (None: every token takes a
    stream step). `spaces_between_special_tokens` False (vLLM's): an added token right after
    another is its bare text, without the space a decoder may put before it."""
    backend = fast_backend(tokenizer)
    if backend is None:
        return SlowIncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens,
                                          spaces_between_special_tokens)
    detokenizer = FastIncrementalDetokenizer(backend, prompt_token_ids, skip_special_tokens, pieces)
    if spaces_between_special_tokens or skip_special_tokens:  # (vLLM's rule: skipped ones have no text)
        return detokenizer
    added = {token_id: token.content for token_id, token in backend.get_added_tokens_decoder().items()}
    return AdjacentAddedTokens(detokenizer, added) if added else detokenizer


class AdjacentAddedTokens:
    """vLLM's spaces_between_special_tokens=False over a fast detokenizer: tokens go one by one,
    and an added token that follows another is given as its bare content."""

    __slots__ = ("inner", "added", "last_added")

    def __init__(self, inner: FastIncrementalDetokenizer, added: dict[int, str]) -> None:
        self.inner = inner
        self.added = added
        self.last_added = False

    def add_token(self, token_id: int) -> str:
        text = self.inner.add_token(token_id)
        content = self.added.get(token_id)
        if content is not None and self.last_added:
            text = content
        self.last_added = content is not None
        return text

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        return "".join([self.add_token(int(t)) for t in token_ids])

    def flush(self) -> str:
        return self.inner.flush()

    def decode_rest(self, token_ids: Sequence[int]) -> str:
        return self.add_tokens(token_ids) + self.flush()


class TokenPieces:
    """The text of each token that decodes alike in every context, for a tokenizer whose decoder
    is exactly `ByteLevel` (GPT-2, Llama 3, Qwen, SmolLM): it maps a token's characters to bytes
    and decodes the joined bytes, so a token of whole UTF-8 characters after text that ends on a
    character adds exactly its own text. Added tokens (special or not) are left to the stream.
    Each token is decoded the first time it is asked for; None: not such a token."""

    __slots__ = ("backend", "added", "known")

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.added = frozenset(backend.get_added_tokens_decoder())
        self.known: dict[int, str | None] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> TokenPieces | None:
        from tokenizers import decoders

        backend = fast_backend(tokenizer)
        if backend is None or type(backend.decoder) is not decoders.ByteLevel:
            return None
        return cls(backend)

    def get(self, token_id: int) -> str | None:
        piece = self.known.get(token_id, _UNSEEN)
        if piece is _UNSEEN:
            piece = self.known[token_id] = self._context_free_text(token_id)
        return piece

    def _context_free_text(self, token_id: int) -> str | None:
        if token_id in self.added or not 0 <= token_id < self.backend.get_vocab_size(with_added_tokens=False):
            return None
        text = self.backend.decode([token_id], skip_special_tokens=False)
        return text if text and "\ufffd" not in text else None


_UNSEEN = object()


def fast_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or a bare one), else
    None."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class FastIncrementalDetokenizer:
    """`DecodeStream` primed with the prompt's last tokens. The stream keeps back tokens whose
    text ends in an incomplete character; `pending` mirrors them (with `context`, the tokens of
    the last emitted text) so that `flush` can decode the tail the stream never returns."""

    __slots__ = ("backend", "skip_special_tokens", "stream", "context", "pending", "pieces", "stream_behind")

    def __init__(self, backend: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool,
                 pieces: TokenPieces | None = None) -> None:
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        context = [int(t) for t in prompt_token_ids[-_CONTEXT_TOKENS:]]
        # A stream primed with tokens whose text ends inside a character would take that text as
        # never returned, and return it (the prompt's) with the output's first text: it is primed
        # with the whole characters, the rest stepped (held: its text ends inside one). A last token
        # of whole characters in any context (`pieces`) ends the text on one: no decode needed.
        whole = len(context)
        if context and (pieces is None or pieces.get(context[-1]) is None):
            whole = whole_characters(lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens), context)
        self.context, self.pending = context[:whole], context[whole:]
        self.stream = self._new_stream(self.context)
        if self.pending:
            self.stream.step(backend, list(self.pending))
        self.pieces = pieces
        self.stream_behind = False  # tokens were taken from `pieces`: the stream must restart at `context`

    def add_token(self, token_id: int) -> str:
        if not self.pending and self.pieces is not None:
            piece = self.pieces.get(token_id)
            if piece is not None:
                self.context, self.stream_behind = [token_id], True
                return piece
        self.pending.append(token_id)
        return self._step(token_id)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """One stream step for all of them: the stream returns their whole text, or nothing while
        the last ends inside a character (the text of stepping them one by one, in one call)."""
        ids = [int(t) for t in token_ids]
        if not ids:
            return ""
        self.pending.extend(ids)
        return self._step(ids)

    def _step(self, ids: int | list[int]) -> str:
        if self.stream_behind:
            self.stream, self.stream_behind = self._new_stream(self.context), False
        try:
            piece = self.stream.step(self.backend, ids)
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            logger.warning("detokenizer: DecodeStream reported an invalid prefix; restarting it")
            piece = self._restart()
        if piece is None:
            return ""
        self.context, self.pending = self.pending, []
        return piece

    def decode_rest(self, token_ids: Sequence[int]) -> str:
        if not self.pending:
            skip = self.skip_special_tokens
            prefix = self.backend.decode(self.context, skip_special_tokens=skip)
            full = self.backend.decode(self.context + list(token_ids), skip_special_tokens=skip)
            if full.startswith(prefix):
                self.context = list(token_ids[-_CONTEXT_TOKENS:])
                return full[len(prefix):]
        # The context's text changes when the output joins it (e.g. it ends inside a character).
        return self.add_tokens(token_ids) + self.flush()

    def flush(self) -> str:
        if not self.pending:
            return ""
        pending, self.pending = self.pending, []
        prefix = self.backend.decode(self.context, skip_special_tokens=self.skip_special_tokens)
        full = self.backend.decode(self.context + pending, skip_special_tokens=self.skip_special_tokens)
        self.context = pending
        return full[len(prefix):] if full.startswith(prefix) else ""

    def _restart(self) -> str | None:
        """A new empty stream fed the pending tokens (as vLLM recovers). Text already emitted
        stays as it was, so the result then differs from decoding everything at once; this
        happens only for byte sequences that are not valid UTF-8 (e.g. byte-fallback pieces
        whose group stops decoding when an invalid byte joins it)."""
        self.stream = self._new_stream([])
        self.context = []
        return self.stream.step(self.backend, list(self.pending))

    def _new_stream(self, context: list[int]) -> Any:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)


class SlowIncrementalDetokenizer:
    """Invariant: `tokens[prefix_offset:read_offset]` decodes to text that ends on a whole
    character and has been emitted; only text after it is new."""

    __slots__ = ("tokenizer", "skip_special_tokens", "spaces_between_special_tokens", "tokens", "prefix_offset",
                 "read_offset")

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        context = [int(t) for t in prompt_token_ids[-_CONTEXT_TOKENS:]]
        self.tokens: list[int] = context
        self.prefix_offset = 0
        self.read_offset = whole_characters(self._decode, context)  # (a character left unfinished is unread)

    def add_token(self, token_id: int) -> str:
        self.tokens.append(token_id)
        return self._step(final=False)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        return "".join([self.add_token(int(t)) for t in token_ids])

    def flush(self) -> str:
        return self._step(final=True)

    def decode_rest(self, token_ids: Sequence[int]) -> str:
        self.tokens.extend(token_ids)
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
        # Only the window is decoded again: tokens before prefix_offset are dropped.
        if self.prefix_offset > 4 * _CONTEXT_TOKENS:
            del self.tokens[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        return full[len(prefix):]

    def _decode(self, token_ids: list[int]) -> str:
        if self.spaces_between_special_tokens:
            return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        # (transformers' slow tokenizers take vLLM's argument themselves)
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=False)
