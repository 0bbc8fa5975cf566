"""Grammar compilation off the busy loop, and the step's token bitmask.

Thread model: compilation (and, the first time, loading the tokenizer's vocabulary) runs on a
one-thread pool; everything else (making matchers, advancing them, filling the bitmask) runs
on the busy loop's thread. A request whose grammar is not compiled yet stays in the
scheduler's waiting queue (`RequestStatus.WAITING_FOR_GRAMMAR`) while others are served.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from vllm_lite.sampling_params import StructuredOutputsParams
from vllm_lite.structured_output.backend import (CompiledGrammar, GrammarKey, GrammarMatcher,
                                                 StructuredOutputBackend, grammar_spec)

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256


class GrammarDeadEnd(ValueError):
    """A constrained request's grammar allows no next token (and has not reached its end)."""


class StructuredOutputRequest:
    """One request's grammar: pending until compiled, then a matcher that advances with every
    token appended to the request (and only then), so a preempted request keeps a matcher
    consistent with the tokens it keeps."""

    __slots__ = ("key", "future", "stop_token_ids", "matcher", "error")

    def __init__(self, key: GrammarKey, future: Future, stop_token_ids: tuple[int, ...] = ()) -> None:
        self.key = key
        self.future = future
        self.stop_token_ids = stop_token_ids  # the request's (`CompiledGrammar.matcher`)
        self.matcher: GrammarMatcher | None = None
        self.error: str | None = None  # why compilation failed (the request cannot run)

    def is_ready(self) -> bool:
        """True once compiled (then `matcher` is set) or failed (then `error` is)."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        exc = self.future.exception()
        if exc is not None:
            self.error = f"grammar compilation failed: {type(exc).__name__}: {exc}"
        else:
            self.matcher = self.future.result().matcher(self.stop_token_ids)
        return True


class StructuredOutputManager:
    """Built by the engine core; the backend (and the tokenizer it needs) only when the first
    constrained request arrives."""

    def __init__(self, make_backend: Callable[[], StructuredOutputBackend], max_num_seqs: int,
                 validate: Callable[[GrammarKey], None], positions_per_request: int = 1) -> None:
        """`positions_per_request`: the most positions a request samples in a step (speculative
        decoding: 1 + its drafts), for the bitmask buffer's rows."""
        self._make_backend = make_backend
        self._validate = validate
        self._max_rows = max_num_seqs * positions_per_request
        self._pool: ThreadPoolExecutor | None = None
        self._backend: StructuredOutputBackend | None = None  # set on the pool thread
        self._grammars: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._bitmask: Any = None  # the backend's buffer, [max_num_seqs, ceil(vocab / 32)]
        self._bitmask_np: np.ndarray | None = None  # the same memory, for the scheduler output
        self.num_compiled = 0

    def validate(self, params: StructuredOutputsParams) -> None:
        self._validate(grammar_spec(params))

    def make_request(self, params: StructuredOutputsParams,
                     stop_token_ids: tuple[int, ...] = ()) -> StructuredOutputRequest:
        """`stop_token_ids`: the request's, which may end its value too (`CompiledGrammar.matcher`)."""
        key = grammar_spec(params)
        future = self._grammars.get(key)
        if future is None or (future.done() and future.exception() is not None):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
            future = self._pool.submit(self._compile, key)
            self._grammars[key] = future
            if len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        return StructuredOutputRequest(key, future, stop_token_ids)

    def wait_for_any(self, requests: list[StructuredOutputRequest], timeout: float) -> None:
        """Block up to `timeout` s until one of the pending compilations ends (an idle busy
        loop whose only work waits for a grammar sleeps here rather than spinning)."""
        pending = [request.future for request in requests if not request.future.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def grammar_bitmask(self, requests: list[StructuredOutputRequest],
                        drafts: list[np.ndarray] | None = None) -> np.ndarray:
        """Rows of the preallocated buffer, the allowed next tokens of each of `requests` in
        order: one row each, or with `drafts` (speculative decoding: request i's draft tokens,
        which its grammar accepts: `valid_drafts`) one row per position, after each draft (the
        matcher advanced through them and rolled back). A view: valid until the next call (the
        step that reads it runs first). Raises GrammarDeadEnd when a row allows no token:
        sampling it would emit a token outside the grammar (the engine core fails that request
        instead: see `Scheduler._grammar_bitmask`)."""
        if self._bitmask is None:
            assert self._backend is not None, "the bitmask is asked for before any grammar compiled"
            self._bitmask, self._bitmask_np = self._backend.allocate_bitmask(self._max_rows)
        row = 0
        for i, request in enumerate(requests):
            draft = () if drafts is None else drafts[i].tolist()
            matcher = request.matcher
            matcher.fill_bitmask(self._bitmask, row)
            for token_id in draft:
                matcher.accept_token(token_id)
                row += 1
                matcher.fill_bitmask(self._bitmask, row)
            if draft:
                matcher.rollback(len(draft))
            row += 1
        rows = self._bitmask_np[:row]
        if not rows.any(axis=1).all():  # (a draft position's row: only after drafts its grammar accepts)
            raise GrammarDeadEnd("the grammar allows no next token: its language is empty (e.g. a schema that no "
                                 "value satisfies), or no token of this vocabulary continues the text")
        return rows

    @staticmethod
    def valid_drafts(request: StructuredOutputRequest, draft: np.ndarray) -> np.ndarray:
        """The longest start of `draft` the request's grammar accepts, stopping where it ends
        (the matcher is left as it was)."""
        matcher, accepted = request.matcher, 0
        for token_id in draft.tolist():
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return draft[:accepted]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _compile(self, key: GrammarKey) -> CompiledGrammar:
        if self._backend is None:
            self._backend = self._make_backend()
        compiled = self._backend.compile(key)
        self.num_compiled += 1
        return compiled
