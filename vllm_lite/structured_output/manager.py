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

    __slots__ = ("key", "future", "matcher", "error")

    def __init__(self, key: GrammarKey, future: Future) -> None:
        self.key = key
        self.future = future
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
            self.matcher = self.future.result().matcher()
        return True


class StructuredOutputManager:
    """Built by the engine core; the backend (and the tokenizer it needs) only when the first
    constrained request arrives."""

    def __init__(self, make_backend: Callable[[], StructuredOutputBackend], max_num_seqs: int,
                 validate: Callable[[GrammarKey], None]) -> None:
        self._make_backend = make_backend
        self._validate = validate
        self._max_num_seqs = max_num_seqs
        self._pool: ThreadPoolExecutor | None = None
        self._backend: StructuredOutputBackend | None = None  # set on the pool thread
        self._grammars: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._bitmask: Any = None  # the backend's buffer, [max_num_seqs, ceil(vocab / 32)]
        self._bitmask_np: np.ndarray | None = None  # the same memory, for the scheduler output
        self.num_compiled = 0

    def validate(self, params: StructuredOutputsParams) -> None:
        self._validate(grammar_spec(params))

    def make_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
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
        return StructuredOutputRequest(key, future)

    def wait_for_any(self, requests: list[StructuredOutputRequest], timeout: float) -> None:
        """Block up to `timeout` s until one of the pending compilations ends (an idle busy
        loop whose only work waits for a grammar sleeps here rather than spinning)."""
        pending = [request.future for request in requests if not request.future.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def grammar_bitmask(self, requests: list[StructuredOutputRequest]) -> np.ndarray:
        """Rows 0..len(requests)-1 of the preallocated buffer, row i the allowed next tokens
        of requests[i]. A view: valid until the next call (the step that reads it runs first).
        Raises GrammarDeadEnd when a row allows no token: sampling it would emit a token outside
        the grammar (the engine core fails that request instead: see `Scheduler._grammar_bitmask`)."""
        if self._bitmask is None:
            assert self._backend is not None, "the bitmask is asked for before any grammar compiled"
            self._bitmask, self._bitmask_np = self._backend.allocate_bitmask(self._max_num_seqs)
        for row, request in enumerate(requests):
            request.matcher.fill_bitmask(self._bitmask, row)
        rows = self._bitmask_np[: len(requests)]
        if not rows.any(axis=1).all():
            raise GrammarDeadEnd("the grammar allows no next token: its language is empty (e.g. a schema that no "
                                 "value satisfies), or no token of this vocabulary continues the text")
        return rows

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
