"""Continuous batching: one token budget per step shared by decodes and (chunked) prefills.

Order of service each step:
1. running requests, in admission order; when blocks run out, the most recently admitted
   running request is preempted (recompute: its blocks are freed and it returns to the front of
   the waiting queue);
2. waiting requests, FCFS, while budget, sequence slots and blocks last (not in a step that
   preempted: there is no room). A request whose grammar is still compiling
   (WAITING_FOR_GRAMMAR) is passed over, keeping its place, without holding up the others.
Under the priority policy (vLLM's) both queues are kept in `Request.queue_key` order (priority,
then arrival) instead: the most urgent running request is served first, the least urgent is the
one preempted (the back, as above), and the most urgent waiting one is admitted first.

Structured outputs: a constrained request's matcher advances exactly when a token is appended
to it (`update_from_output`), so preemption (which keeps the tokens) needs no rollback. Each
step, the constrained requests that will sample get a row of the grammar bitmask.

Output update: a running request's tokens live in the token store (core/token_store.py), so a
step's sampled tokens are appended and its stop conditions checked with array operations over the
batch; Python touches only the rows that may stop or need it otherwise (a first token, a
grammar), and finished requests leave `running` in one pass.

Failure containment: an exception in one request's own work (its bitmask row, appending its
token, its stop checks, advancing its matcher) fails that request alone, as does a failure the
worker reports for it (`update_from_output(failed=...)`): it is freed at once (its latest blocks
leave the prefix cache: their KV may never have been written) and recorded in `step_failures`
({request id: why}), from which the engine core sends its client an error.

Async scheduling (`SchedulerConfig.async_scheduling`, vLLM's rules): the engine core schedules
step N+1 before step N's output arrives, so a request that samples in step N has a placeholder
(`Request.num_output_placeholders`) for that token: step N+1 computes it (the worker feeds the
token it sampled itself) and the scheduler learns its value in `update_from_output`. Then:
- a request whose in-flight tokens surely end it (max_tokens, max_model_len) is not scheduled;
- a request finished, aborted or failed while steps are in flight is freed at once; what those
  steps still return for it (rows, failures, prompt logprobs) is discarded (`stale_req_ids`:
  id -> number of those steps), even if its id is reused meanwhile;
- a request preempted with a token in flight keeps that token when it arrives (it is valid:
  its KV was computed before the blocks were freed, and the worker runs steps in order);
- prefix-cache blocks are registered only once their tokens are known (not placeholders);
- the grammar bitmask needs the matcher to have seen every token, so the engine core takes the
  output of a step in flight in which a constrained request samples before scheduling the next
  (and the bitmask buffer, reused every step, is then free again).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np

from vllm_lite.config import CacheConfig, SchedulerConfig, SpeculativeConfig, check_priority
from vllm_lite.core.kv_cache_manager import KVCacheManager
from vllm_lite.core.ngram_proposer import propose_ngram
from vllm_lite.core.request import Request, RequestStatus, StopReason
from vllm_lite.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm_lite.core.thinking_budget import forced_token_rows
from vllm_lite.core.token_store import TokenStore
from vllm_lite.exceptions import VLLMValidationError, describe_error, run_each_contained
from vllm_lite.wire import EngineCoreOutputs, FinishedRequest, FinishReason
from vllm_lite.wire import LogprobsArrays

logger = logging.getLogger(__name__)

_NO_REQ_IDS: frozenset[str] = frozenset()
# A step's row whose request holds no slot in the token store: freed since the step was
# scheduled (its row is discarded), or live without a slot (preempted with its token in flight).
_DISCARD = -1
_UNSLOTTED = -2

_request_id = attrgetter("request_id")
_slot = attrgetter("slot")
_block_id = attrgetter("block_id")
_NO_DRAFT = np.zeros(0, dtype=np.int32)
_NO_BLOCK_IDS = np.zeros(0, dtype=np.int32)
_NO_BLOCK_IDS.flags.writeable = False  # shared by the steps that take no block


def _advanced(num_computed, num_known, num_new):
    """(num_computed_tokens, num_tokens_with_placeholders) after `num_new` more tokens are
    scheduled (`Scheduler._advance_computed`'s rule), for ints or arrays of them alike."""
    num_computed = num_computed + num_new
    return num_computed, num_known + (num_computed == num_known)


class RunningSchedule(NamedTuple):
    """The running requests' part of a step: the scheduled ones in admission order (the
    `CachedRequestData` columns), their token counts and the token budget left."""

    req_ids: list[str]
    num_computed_tokens: list[int] | np.ndarray  # before this step
    num_new_blocks: np.ndarray  # int32 per request
    new_block_ids: np.ndarray  # int32, request after request
    # request id -> tokens this step. Read-only: a decode step's may be an earlier step's object.
    num_scheduled: dict[str, int]
    budget: int


class Scheduler:
    # From this many running requests a step's running part is computed with array operations
    # when it can be (`_schedule_running_at_once`); below, numpy's fixed costs outweigh the loop's
    # (benchmarks/scheduler_step.py: the loop ahead at 32 requests, the array code from 64 on).
    AT_ONCE_MIN_RUNNING = 48

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_kv_blocks: int, structured_output_manager: Any = None, native_loops: bool | None = None,
                 max_loras: int | None = None, speculative_config: SpeculativeConfig | None = None) -> None:
        """`native_loops`: whether the token store's per-request loops run in C (`TokenStore`;
        None: where csrc is built); False also keeps the prefix-cache keys in hashlib
        (`KVCacheManager`: else in C where the CPU has SHA extensions). `max_loras`: at most this
        many LoRA adapters among the running requests (vLLM's; None: LoRA is off).
        `speculative_config`: n-gram drafts for the running requests that may have them."""
        self.config = scheduler_config
        # the most prompt tokens a request takes this step (long_prefill_token_threshold, set by `schedule`)
        self.prefill_cap = scheduler_config.max_num_batched_tokens
        self.speculative_config = speculative_config
        self.max_loras = max_loras
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(num_kv_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching,
                                               cache_config.sliding_window,
                                               False if native_loops is False else None,
                                               drop_last_hit_block=speculative_config is not None
                                               and speculative_config.eagle is not None)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.by_priority = scheduler_config.policy == "priority"
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Structured outputs (structured_output.StructuredOutputManager): grammar bitmasks.
        self.structured_output_manager = structured_output_manager
        self.structured_req_ids: set[str] = set()  # live requests with a grammar
        self.thinking_req_ids: set[str] = set()  # live requests with a thinking_token_budget
        self.failed: list[FinishedRequest] = []  # grammar failures not yet reported
        self.step_failures: dict[str, str] = {}  # request id -> why it failed (freed, not yet reported)
        # Steps scheduled (non-empty) whose output has not been applied yet: 1 while a step runs,
        # 2 with async scheduling. Requests freed meanwhile are stale for that many updates:
        # request id -> number of updates still to discard its rows.
        self.num_steps_in_flight = 0
        self.stale_req_ids: dict[str, int] = {}
        # The running requests' tokens and stop limits, for the array code of update_from_output.
        self.token_store = TokenStore(scheduler_config.max_num_seqs, scheduler_config.max_model_len, native_loops)
        self._row_slots: tuple[int, list[str], np.ndarray, bool] | None = None  # see _slots_of
        self._running_slot_cache: tuple[int, np.ndarray, list[str]] | None = None  # see _running_slots
        self._zero_block_counts = _NO_BLOCK_IDS  # see _no_new_blocks
        self._row_range = np.zeros(0, dtype=np.int64)  # see _every_row
        self._decode_counts: tuple[list[str], dict[str, int]] | None = None  # see _one_token_each

    # ---- requests in and out ----
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        check_priority(request.priority, self.config.policy)
        if request.lora_request is not None and self.max_loras is None:
            raise VLLMValidationError(f"lora_request {request.lora_request.lora_name!r}: LoRA is not enabled in this "
                                      "engine (enable_lora)", parameter="lora_request")
        self._check_fits(request)
        if self.config.disable_chunked_mm_input and request.images is not None:
            self._check_whole_images_fit(request)
        self.requests[request.request_id] = request
        self._enqueue(self.waiting, request, front=False)
        request.length_limit = min(request.length_limit, self.config.max_model_len)
        request.queued_ts = time.monotonic()
        if request.structured_output_request is not None:
            self.structured_req_ids.add(request.request_id)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        if request.thinking is not None:
            self.thinking_req_ids.add(request.request_id)
        spec = self.speculative_config
        # (a draft model's or EAGLE head's drafts are made by the workers, after the grammar's bitmask is: none
        # for constrained requests)
        request.may_draft = spec is not None and drafts_allowed(request) and not (
            spec.drafts_on_workers and request.structured_output_request is not None)

    def abort_requests(self, request_ids: list[str]) -> list[FinishedRequest]:
        aborted = []
        num_running = 0
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            num_running += self._leave_queue(request)
            self._free(request)
            aborted.append(FinishedRequest(request_id, FinishReason.ABORT, num_preemptions=request.num_preemptions))
        if num_running:
            self._drop_finished_from_running()
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step ----
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        # vLLM's rule: a lone request has nobody to starve, so no cap then
        self.prefill_cap = threshold if threshold and len(self.requests) > 1 else budget
        preempted: set[str] = set()
        drafts: dict[str, np.ndarray] = {}
        running_part = (self._schedule_running_at_once(budget)
                        if len(self.running) >= self.AT_ONCE_MIN_RUNNING and not self._drafting() else None)
        if running_part is None:
            running_part = self._schedule_running_loop(budget, preempted, drafts if self._drafting() else None)
        cached_ids, cached_num_computed, num_new_blocks, new_block_ids, num_scheduled, budget = running_part
        new_reqs: list[NewRequestData] = []
        if not preempted and self.waiting and len(self.running) < self.config.max_num_active_seqs:
            num_scheduled = dict(num_scheduled)  # (the running part's may be kept for later steps)
            budget = self._schedule_waiting(budget, num_scheduled, new_reqs)

        bitmask_failures: dict[str, str] = {}
        structured_ids, bitmask = (self._grammar_bitmask(num_scheduled, bitmask_failures, drafts)
                                   if self.structured_req_ids else ((), None))
        if self.thinking_req_ids:
            structured_ids, bitmask = self._with_forced_tokens(num_scheduled, structured_ids, bitmask)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=CachedRequestData(cached_ids, cached_num_computed, num_new_blocks, new_block_ids),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_req_ids=frozenset(self.finished_req_ids),
            preempted_req_ids=frozenset(preempted),
            structured_output_req_ids=structured_ids,
            grammar_bitmask=bitmask,
            # (a budget's next forced token depends on this step's tokens: async scheduling waits)
            needs_output_first=bool(self.thinking_req_ids) and not self.thinking_req_ids.isdisjoint(num_scheduled),
            scheduled_spec_decode_tokens=drafts,
        )
        if output.is_empty:
            # No worker runs this step, so none sees these ids: hand them to the next step
            # (a preempted request's state is dropped just like a finished one's).
            self.finished_req_ids |= preempted
        else:
            self.finished_req_ids.clear()
            self.num_steps_in_flight += 1
        if bitmask_failures:  # they sample unconstrained in this step, whose row for them is stale
            self._fail_requests(bitmask_failures)
        return output

    def _drafting(self) -> bool:
        """Whether this step's running requests may get drafts (vLLM's disable_by_batch_size:
        none while more requests than that run)."""
        spec = self.speculative_config
        return spec is not None and (spec.disable_by_batch_size is None or len(self.running) <= spec.disable_by_batch_size)

    def _schedule_running_loop(self, budget: int, preempted: set[str],
                               drafts: dict[str, np.ndarray] | None = None) -> RunningSchedule:
        """Running requests in admission order, one at a time: each gets its remaining tokens
        (what budget is left), blocks allocated or requests preempted from the back. `drafts`
        (speculative decoding): the draft tokens of the requests that get some are put there;
        they are scheduled after the request's token."""
        cached_ids: list[str] = []
        cached_num_computed: list[int] = []
        num_new_blocks: list[int] = []
        new_block_ids: list[int] = []
        num_scheduled: dict[str, int] = {}
        kv, store, running = self.kv_cache_manager, self.token_store, self.running
        # The counters of every running request, read at once: a preemption below takes requests
        # from the back, past `index`, so the values the loop reads stay those of `running[index]`.
        slots, _ = self._running_slots()
        all_known = store.num_tokens_with_placeholders[slots].tolist()
        all_computed = store.num_computed_tokens[slots].tolist()
        slots = slots.tolist()
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_known = all_known[index]
            if num_known >= request.length_limit:
                index += 1  # its tokens in flight end it: a step would compute a token nobody keeps
                continue
            num_computed = all_computed[index]
            num_new = min(num_known - num_computed, budget, self.prefill_cap)
            if request.images is not None and self.config.disable_chunked_mm_input:
                num_new = self._whole_images(request, num_computed, num_new, budget)
                if num_new == 0:
                    index += 1  # (its next image waits for a step with room for all of it)
                    continue
            draft = (self._propose(request, slots[index], num_known, budget)
                     if drafts is not None and num_new == 1 and request.may_draft else None)
            num_drafts = 0 if draft is None else len(draft)
            num_new += num_drafts
            num_blocks = 0  # (most decode steps: the request's blocks hold its new tokens)
            if not kv.fits_held_blocks(request, num_computed + num_new):
                new_blocks = self._allocate_or_preempt(request, num_new, preempted)
                if new_blocks is None:
                    break
                num_blocks = len(new_blocks)
                new_block_ids.extend(map(_block_id, new_blocks))
            num_scheduled[request.request_id] = num_new
            cached_ids.append(request.request_id)
            cached_num_computed.append(num_computed)
            num_new_blocks.append(num_blocks)
            slot = slots[index]
            computed, store.num_tokens_with_placeholders[slot] = _advanced(num_computed, num_known, num_new - num_drafts)
            store.num_computed_tokens[slot] = computed + num_drafts  # (back by the rejected ones on output)
            if num_drafts:
                drafts[request.request_id] = draft
            budget -= num_new
            index += 1

        return RunningSchedule(cached_ids, cached_num_computed, np.array(num_new_blocks, dtype=np.int32),
                               np.array(new_block_ids, dtype=np.int32), num_scheduled, budget)

    def _propose(self, request: Request, slot: int, num_known: int, budget: int) -> np.ndarray | None:
        """A decoding request's drafts: at most what the step's budget leaves after its token,
        and no more than the tokens it may still produce after it (max_tokens, max_model_len);
        None without any. n-gram drafts are found here; a draft model's places are zeros, which
        the workers fill."""
        spec = self.speculative_config
        k = min(spec.num_speculative_tokens, budget - 1, request.length_limit - num_known - 1)
        if k <= 0:
            return None
        if spec.drafts_on_workers:  # k places: the workers' drafter fills them (worker/draft_model.py, eagle.py)
            return np.zeros(k, dtype=np.int32)
        draft = propose_ngram(self.token_store.row(slot)[:num_known], spec.prompt_lookup_min, spec.prompt_lookup_max, k)
        if len(draft) and request.structured_output_request is not None:  # (what its grammar allows)
            draft = self.structured_output_manager.valid_drafts(request.structured_output_request, draft)
        return draft.copy() if len(draft) else None  # (the row changes with the step's tokens)

    def _schedule_running_at_once(self, budget: int) -> RunningSchedule | None:
        """What `_schedule_running_loop` would decide, with array operations over the running
        requests, in the step it decides most (every decode step without KV pressure): every
        running request gets all its remaining tokens and each allocation it needs fits in the
        free blocks, so nothing is preempted. The same requests, token counts and counters, and
        the same block allocations made in the same order (only for the requests that need
        one); Python runs per request only in C-level maps. None when the step is not of that
        kind (budget short, blocks short, a sliding window): the loop decides it."""
        kv, store, running = self.kv_cache_manager, self.token_store, self.running
        slots, req_ids = self._running_slots()
        held = kv.held_blocks(req_ids)
        if held is None:
            return None
        # After this step a scheduled request has computed every token it knows: `known`.
        known, computed, scheduled, total, min_new, to_allocate, new_blocks, blocks_needed = store.scan_running(
            slots, held, kv.block_size)
        if total > budget or min_new <= 0:
            return None
        if self.prefill_cap < budget and int((known - computed).max()) > self.prefill_cap:
            return None  # a prompt chunk over long_prefill_token_threshold: the loop cuts it
        new_block_ids = _NO_BLOCK_IDS
        if len(to_allocate):
            if blocks_needed > kv.get_num_free_blocks():
                return None  # an allocation may fail: the loop preempts
            taken = kv.allocate_running(to_allocate, list(map(running.__getitem__, to_allocate.tolist())), new_blocks)
            new_block_ids = np.fromiter(map(_block_id, taken), np.int32, len(taken))
        if scheduled is not None:  # (some request has all its tokens in flight)
            rows = np.flatnonzero(scheduled)
            to_allocate = np.searchsorted(rows, to_allocate)  # (now positions among the scheduled)
            req_ids = [req_ids[row] for row in rows.tolist()]
            slots, known, computed = slots[rows], known[rows], computed[rows]
        num_new_blocks = self._no_new_blocks(len(req_ids))
        if len(new_block_ids):
            num_new_blocks = num_new_blocks.copy()
            num_new_blocks[to_allocate] = new_blocks
        num_scheduled = (self._one_token_each(req_ids) if total == len(req_ids)
                         else dict(zip(req_ids, (known - computed).tolist())))
        store.advance_running(slots, known)  # (`_advanced` for these requests)
        return RunningSchedule(req_ids, computed, num_new_blocks, new_block_ids, num_scheduled, budget - total)

    def _every_row(self, num_rows: int) -> np.ndarray:
        """0..num_rows-1: one read-only array, kept while the count is the same (a steady step's
        rows, every one sampled)."""
        if len(self._row_range) != num_rows:
            self._row_range = np.arange(num_rows)
            self._row_range.flags.writeable = False
        return self._row_range

    def _no_new_blocks(self, num_requests: int) -> np.ndarray:
        """Zero new blocks for each of `num_requests` requests: one read-only array, kept while
        the count is the same (most steps take no block)."""
        if len(self._zero_block_counts) != num_requests:
            self._zero_block_counts = np.zeros(num_requests, dtype=np.int32)
            self._zero_block_counts.flags.writeable = False
        return self._zero_block_counts

    def _one_token_each(self, req_ids: list[str]) -> dict[str, int]:
        """A decode step's counts, {request id: 1}. Kept while the step names the very list
        `_running_slots` keeps (the running requests unchanged): building the dict costs ~60 ns
        a request, most of a steady step's scheduling at 1,024 requests."""
        kept = self._decode_counts
        if kept is not None and kept[0] is req_ids:
            return kept[1]
        counts = dict.fromkeys(req_ids, 1)
        self._decode_counts = (req_ids, counts)
        return counts

    def _running_slots(self) -> tuple[np.ndarray, list[str]]:
        """The token-store slots and ids of `running`, in its order. `running` changes only
        with a slot changing hands (admission, preemption, a request freed), which bumps the
        store's version: kept until then."""
        version = self.token_store.version
        if self._running_slot_cache is None or self._running_slot_cache[0] != version:
            slots = np.fromiter(map(_slot, self.running), np.int64, len(self.running))
            self._running_slot_cache = (version, slots, list(map(_request_id, self.running)))
        return self._running_slot_cache[1], self._running_slot_cache[2]

    @staticmethod
    def _advance_computed(request: Request, num_new: int) -> None:
        """`num_computed_tokens` moves at schedule time (as in vLLM). A request whose every
        token (placeholders included) is computed after this step samples one: that token is a
        placeholder until the step's output arrives (with async scheduling the next step is
        scheduled meanwhile and computes it). A running request advances as soon as it is
        scheduled: the requests preempted later in the same step are taken from the back of
        `running`, never one already scheduled."""
        request.num_computed_tokens, request.num_tokens_with_placeholders = _advanced(
            request.num_computed_tokens, request.num_tokens_with_placeholders, num_new)

    def update_from_output(self, scheduler_output: SchedulerOutput, req_ids: list[str],
                           sampled_token_ids: np.ndarray, num_sampled: np.ndarray,
                           logprobs: LogprobsArrays | None = None,
                           prompt_logprobs: dict[str, tuple[int, LogprobsArrays]] | None = None,
                           failed: dict[str, str] | None = None,
                           every_row_sampled: bool = False,
                           more_logprobs: tuple[LogprobsArrays | None, np.ndarray | None] = (None, None)
                           ) -> EngineCoreOutputs:
        """Append each row's sampled token (rows with num_sampled == 0 were mid-prefill) and
        check stop conditions. Returns the step's outputs column-wise. `logprobs` rows are
        batch rows (like `sampled_token_ids`); `prompt_logprobs` maps a request to the prompt
        position of its first row and its rows; `failed`: the requests the worker could not run
        in this step ({request id: why}), failed before any token is taken;
        `every_row_sampled`: the worker says num_sampled is all 1 (False: it is looked at);
        `more_logprobs`: with speculative decoding, the logprobs of rows' kept tokens after their
        first and where they belong (ModelRunnerOutput.more_logprobs / more_logprobs_at).

        Array code over the batch: the tokens are appended in the token store, which also finds
        the rows that may stop (length, EOS / stop ids) or need Python for another reason (a
        first token, a grammar); Python looks at those rows only."""
        stale = self._begin_update(failed)
        prompt_columns = self._prompt_logprobs_columns(prompt_logprobs, stale) if prompt_logprobs else {}
        every_row = every_row_sampled or bool(num_sampled.all())  # (a decode step: no row left mid-prefill)
        rows = self._every_row(len(req_ids)) if every_row else np.flatnonzero(num_sampled)  # the rows that sampled
        tokens = sampled_token_ids[:, 0] if every_row else sampled_token_ids[rows, 0]
        slots, every_slot_held = self._slots_of(req_ids, stale)
        if not every_row:
            slots = slots[rows]
            every_slot_held = bool((slots >= 0).all())
        store = self.token_store
        # (position among `rows`, request, whether its token is still to be appended)
        look_at: list[tuple[int, Request, bool]] = []
        keep: np.ndarray | None = None  # None: every row is kept
        if every_slot_held:  # (none freed or preempted: a steady step)
            attention = store.append(slots, tokens)
        else:
            keep = slots != _DISCARD
            held = np.flatnonzero(slots >= 0)
            attention = held[store.append(slots[held], tokens[held])] if len(held) else held
        if len(attention):
            requests = store.requests
            look_at.extend((i, requests[slot], False) for i, slot in zip(attention.tolist(), slots[attention].tolist()))
        if not every_slot_held:
            unslotted = np.flatnonzero(slots == _UNSLOTTED)
            if len(unslotted):  # preempted (async) while their token was in flight
                look_at.extend((i, self.requests[req_ids[rows[i]]], True) for i in unslotted.tolist())
                look_at.sort(key=_first)
        finished: list[FinishedRequest] = []
        num_cached: dict[str, int] = {}
        scheduling_times: dict[str, tuple[float, float]] = {}
        max_model_len = self.config.max_model_len
        num_finished_running = 0
        for i, request, to_append in look_at:
            token_id = int(tokens[i])
            try:
                stop = self._take_token(request, token_id, to_append, max_model_len)
            except Exception as exc:  # this request's alone (a zero-cost `try` when nothing raises)
                logger.exception("request %r failed while taking its sampled token", request.request_id)
                num_finished_running += self._fail(request, f"in the engine core: {describe_error(exc)}")
                keep = np.ones(len(slots), dtype=bool) if keep is None else keep
                keep[i] = False
                continue
            if request.num_output_tokens == 1:
                num_cached[request.request_id] = request.num_cached_tokens
                scheduling_times[request.request_id] = (request.queued_ts, request.scheduled_ts)
            if stop is not None:
                # A request preempted (async) while its token was in flight leaves the waiting queue.
                num_finished_running += self._leave_queue(request)
                self._free(request)
                finished.append(FinishedRequest(request.request_id, stop[0], stop[1], request.num_preemptions))
        if num_finished_running:
            self._drop_finished_from_running()
        kept_rows = rows if keep is None else rows[keep]
        out_req_ids = req_ids if len(kept_rows) == len(req_ids) else [req_ids[row] for row in kept_rows.tolist()]
        new_token_ids = tokens if keep is None else tokens[keep]
        outputs = EngineCoreOutputs(out_req_ids, new_token_ids.astype(np.int32, copy=False), finished,
                                    num_cached, timestamp=time.monotonic(), scheduling_times=scheduling_times,
                                    **prompt_columns)
        if logprobs is not None:
            outputs.logprob_token_ids = logprobs.token_ids[kept_rows]
            outputs.logprobs = logprobs.logprobs[kept_rows]
            outputs.logprob_ranks = logprobs.ranks[kept_rows]
        if scheduler_output.scheduled_spec_decode_tokens:
            self._take_drafted(scheduler_output.scheduled_spec_decode_tokens, req_ids, sampled_token_ids,
                               num_sampled, outputs, stale, *more_logprobs)
        return outputs

    def _take_drafted(self, drafts: dict[str, np.ndarray], req_ids: list[str], sampled_token_ids: np.ndarray,
                      num_sampled: np.ndarray, outputs: EngineCoreOutputs, stale: frozenset[str],
                      more_logprobs: LogprobsArrays | None, more_logprobs_at: np.ndarray | None) -> None:
        """Speculative decoding's part of a step's update, after every row's first token was taken:
        a drafted request's further tokens (the drafts the model kept, then its own; stop checks
        token by token) go into `outputs.more_token_ids` (their logprobs, when asked for, into
        `outputs.more_logprob_*`), and its computed count comes back by the drafts it did not
        keep (their KV is overwritten later)."""
        worker_row = {request_id: row for row, request_id in enumerate(req_ids) if request_id in drafts}
        out_row = {request_id: row for row, request_id in enumerate(outputs.req_ids) if request_id in drafts}
        more = np.full((len(outputs.req_ids), max(sampled_token_ids.shape[1] - 1, 1)), -1, dtype=np.int32)
        num_draft_tokens = np.zeros(len(outputs.req_ids), dtype=np.int32)
        num_accepted = np.zeros(len(outputs.req_ids), dtype=np.int32)
        num_finished_running = 0
        for request_id, draft in drafts.items():
            request, row, out = self.requests.get(request_id), worker_row.get(request_id), out_row.get(request_id)
            if request is None or row is None or out is None or request_id in stale:
                continue  # failed, or finished by its first token
            num_draft_tokens[out], num_accepted[out] = len(draft), max(int(num_sampled[row]) - 1, 0)
            if request.status != RequestStatus.RUNNING:
                continue
            try:
                stop = self._take_more_tokens(request, sampled_token_ids[row, 1:num_sampled[row]], more[out])
            except Exception as exc:  # this request's alone
                logger.exception("request %r failed while taking its drafted tokens", request_id)
                num_finished_running += self._fail(request, f"in the engine core: {describe_error(exc)}")
                continue
            if stop is not None:
                self._free(request)
                outputs.finished.append(FinishedRequest(request_id, stop[0], stop[1], request.num_preemptions))
                num_finished_running += 1
        if num_finished_running:
            self._drop_finished_from_running()
        outputs.num_draft_tokens, outputs.num_accepted_drafts = num_draft_tokens, num_accepted
        if (more >= 0).any():
            outputs.more_token_ids = more
        if more_logprobs is not None:
            _place_more_logprobs(outputs, [out_row.get(req_ids[row], -1) for row in more_logprobs_at[:, 0].tolist()],
                                 more_logprobs, more_logprobs_at[:, 1], more.shape[1])

    def _take_more_tokens(self, request: Request, tokens: np.ndarray,
                          out: np.ndarray) -> StopReason | None:
        """A running request's tokens after its first in a step, each appended and stop-checked
        (into `out` as taken); then its counters as for a token each: every known token but the
        last computed, no placeholder. Returns why it stops, or None."""
        max_model_len = self.config.max_model_len
        stop = None
        for i, token_id in enumerate(tokens.tolist()):
            request.append_token(token_id)
            out[i] = token_id
            stop = request.check_stop(token_id, max_model_len)
            if request.structured_output_request is not None:
                stop = self._advance_grammar(request, token_id, stop)
            if stop is not None:
                break
        num_tokens = request.num_tokens
        request.num_computed_tokens, request.num_tokens_with_placeholders = num_tokens - 1, num_tokens
        return stop

    def _slots_of(self, req_ids: list[str], stale: frozenset[str]) -> tuple[np.ndarray, bool]:
        """The token-store slot of each of a step's rows (`_DISCARD`, `_UNSLOTTED` for rows
        without one), and whether every row has one. Kept while the rows and the slots' owners
        stay the same (steady decode)."""
        store = self.token_store
        cached = self._row_slots
        if (cached is not None and not stale and cached[0] == store.version
                and (cached[1] is req_ids or cached[1] == req_ids)):
            return cached[2], cached[3]
        slot_of = store.slot_of
        slots = np.array([slot_of.get(request_id, _DISCARD) for request_id in req_ids], dtype=np.int64)
        for i in np.flatnonzero(slots == _DISCARD).tolist():
            if req_ids[i] in self.requests and req_ids[i] not in stale:
                slots[i] = _UNSLOTTED
        for request_id in stale:  # freed, and its id already taken by a new request with a slot
            slot = slot_of.get(request_id)
            if slot is not None:
                slots[slots == slot] = _DISCARD
        every_slot_held = bool((slots >= 0).all())
        if not stale:
            self._row_slots = (store.version, req_ids, slots, every_slot_held)
        return slots, every_slot_held

    def _begin_update(self, failed: dict[str, str] | None) -> frozenset[str]:
        """Fail the requests the worker failed, then return the requests whose rows in this
        step are stale (freed since it was scheduled) and count this step out of flight."""
        if failed:  # (one stale here was freed while the step ran: it is told nothing more)
            self._fail_requests({request_id: f"in the worker: {why}" for request_id, why in failed.items()
                                 if request_id not in self.stale_req_ids})
        if self.num_steps_in_flight:
            self.num_steps_in_flight -= 1
        if not self.stale_req_ids:
            return _NO_REQ_IDS
        stale = frozenset(self.stale_req_ids)
        self.stale_req_ids = {request_id: n - 1 for request_id, n in self.stale_req_ids.items() if n > 1}
        return stale

    def _take_token(self, request: Request, token_id: int, to_append: bool,
                    max_model_len: int) -> StopReason | None:
        """Python's part of taking a request's token (appended already unless `to_append`):
        the exact stop check and the grammar. Returns why it stops, or None."""
        if to_append:
            request.append_token(token_id)
        stop = request.check_stop(token_id, max_model_len)
        if request.structured_output_request is not None:
            stop = self._advance_grammar(request, token_id, stop)
        if request.thinking is not None:
            request.thinking.accept(token_id)
        return stop

    def _fail_requests(self, failures: dict[str, str]) -> None:
        """Fail the live requests among `failures` ({request id: why})."""
        num_running = 0
        for request_id, why in failures.items():
            request = self.requests.get(request_id)
            if request is not None:
                num_running += self._fail(request, why)
        if num_running:
            self._drop_finished_from_running()

    def _fail(self, request: Request, why: str) -> int:
        """Free a request that failed in a step; its blocks that nobody else holds leave the
        prefix cache (see `KVCacheManager.free(uncache=True)`). Returns 1 when it was running
        (the caller drops the finished from `running` in one pass), else 0."""
        was_running = self._leave_queue(request)
        self._free(request, uncache=True)
        self.step_failures[request.request_id] = why
        return was_running

    def take_step_failures(self) -> dict[str, str]:
        failures, self.step_failures = self.step_failures, {}
        return failures

    def _leave_queue(self, request: Request) -> int:
        """Take a request about to be freed out of the waiting queue; a running one stays in
        `running` (1 is returned: `_drop_finished_from_running` removes all in one pass)."""
        if request.status == RequestStatus.RUNNING:
            return 1
        self.waiting.remove(request)
        return 0

    def _drop_finished_from_running(self) -> None:
        """One pass over `running` for all the requests that finished (not one remove each)."""
        self.running = [request for request in self.running if request.status != RequestStatus.FINISHED]

    def _prompt_logprobs_columns(self, prompt_logprobs: dict[str, tuple[int, LogprobsArrays]],
                                 stale: frozenset[str]) -> dict[str, Any]:
        """Concatenate the per-request prompt-logprob chunks of live requests column-wise."""
        req_ids = [r for r in prompt_logprobs if r in self.requests and r not in stale]
        if not req_ids:
            return {}
        chunks = [prompt_logprobs[r][1] for r in req_ids]
        offsets = np.zeros(len(req_ids) + 1, dtype=np.int32)
        offsets[1:] = np.cumsum([len(chunk.token_ids) for chunk in chunks])
        return {
            "prompt_logprobs_req_ids": req_ids,
            "prompt_logprobs_starts": np.array([prompt_logprobs[r][0] for r in req_ids], dtype=np.int32),
            "prompt_logprobs_offsets": offsets,
            "prompt_logprob_token_ids": np.concatenate([c.token_ids for c in chunks]),
            "prompt_logprobs": np.concatenate([c.logprobs for c in chunks]),
            "prompt_logprob_ranks": np.concatenate([c.ranks for c in chunks]),
        }

    # ---- structured outputs ----
    def _grammar_bitmask(self, num_scheduled: dict[str, int], failures: dict[str, str],
                         drafts: dict[str, np.ndarray]) -> tuple[tuple[str, ...], np.ndarray | None]:
        """The constrained requests that sample this step (all their known tokens, and drafts,
        computed after it) and their bitmask rows, a request with drafts once per position (its
        id repeated). Loops over the constrained requests only. Requests whose own rows cannot
        be filled are added to `failures` and left out."""
        req_ids = tuple(r for r in self.structured_req_ids if r in num_scheduled and self.requests[r].num_computed_tokens
                        == self.requests[r].num_tokens + len(drafts.get(r, ())))
        if not req_ids:
            return (), None
        try:
            return self._grammar_rows(req_ids, drafts)
        except Exception:
            return self._grammar_bitmask_without_culprits(req_ids, failures, drafts)

    def _grammar_rows(self, req_ids: tuple[str, ...], drafts: dict[str, np.ndarray]
                      ) -> tuple[tuple[str, ...], np.ndarray]:
        """`req_ids`' bitmask rows and the id of each row."""
        grammars = [self.requests[r].structured_output_request for r in req_ids]
        if not drafts or drafts.keys().isdisjoint(req_ids):
            return req_ids, self.structured_output_manager.grammar_bitmask(grammars)
        positions = [drafts.get(r, _NO_DRAFT) for r in req_ids]
        row_ids = tuple(r for r, draft in zip(req_ids, positions) for _ in range(1 + len(draft)))
        return row_ids, self.structured_output_manager.grammar_bitmask(grammars, positions)

    def _grammar_bitmask_without_culprits(self, req_ids: tuple[str, ...], failures: dict[str, str],
                                          drafts: dict[str, np.ndarray]) -> tuple[tuple[str, ...], np.ndarray | None]:
        """Filling the bitmask failed: fill each request's rows alone to find the ones that
        fail (they sample unconstrained this step and are failed once it is scheduled), then the
        others' together."""
        failed = run_each_contained(req_ids, lambda r: self._grammar_rows((r,), drafts),
                                    lambda r: r, "while filling its grammar bitmask") or {}
        failures.update((request_id, f"in the engine core: {why}") for request_id, why in failed.items())
        kept = tuple(r for r in req_ids if r not in failed)
        if not kept:
            return (), None
        return self._grammar_rows(kept, drafts)

    def _with_forced_tokens(self, num_scheduled: dict[str, int], req_ids: tuple[str, ...],
                            bitmask: np.ndarray | None) -> tuple[tuple[str, ...], np.ndarray | None]:
        """The grammar rows plus a row for each request that samples this step and whose
        thinking budget is spent (it may only write the end token). Loops over the requests with
        a budget only."""
        forced = {}
        for request_id in self.thinking_req_ids:
            request = self.requests[request_id]
            if request_id in num_scheduled and request.num_computed_tokens == request.num_tokens:
                token_id = request.thinking.forced_token()
                if token_id is not None:
                    forced[request_id] = token_id
        if not forced:
            return req_ids, bitmask
        num_words = max(max(forced.values()) // 32 + 1, 0 if bitmask is None else bitmask.shape[1])
        rows = forced_token_rows(list(forced.values()), num_words)
        if bitmask is not None:
            grammar_rows = np.zeros((len(req_ids), num_words), dtype=np.int32)
            grammar_rows[:, :bitmask.shape[1]] = bitmask
            rows = np.concatenate([grammar_rows, rows])
        return req_ids + tuple(forced), rows

    @staticmethod
    def _advance_grammar(request: Request, token_id: int,
                         stop: StopReason | None) -> StopReason | None:
        """Feed the token to the request's matcher; a grammar that reached its end stops the
        request (`stop`)."""
        matcher = request.structured_output_request.matcher
        if not matcher.accept_token(token_id) and stop is None:
            logger.error("request %r: token %d is outside its grammar; the request is stopped",
                         request.request_id, token_id)
            return FinishReason.ABORT, None
        if stop is None and matcher.is_terminated():
            return FinishReason.STOP, None
        return stop

    def take_failed(self) -> list[FinishedRequest]:
        """Requests that ended while waiting (their grammar did not compile), once each."""
        failed, self.failed = self.failed, []
        return failed

    def waiting_grammars(self) -> list[Any]:
        return [r.structured_output_request for r in self.waiting if r.status == RequestStatus.WAITING_FOR_GRAMMAR]

    # ---- stats and cache control ----
    def get_stats(self) -> dict[str, Any]:
        kv = self.kv_cache_manager
        loras = {} if self.max_loras is None else {  # (vLLM's vllm:lora_requests_info labels)
            "max_lora": self.max_loras,
            "running_lora_adapters": _lora_names(self.running),
            "waiting_lora_adapters": _lora_names(self.waiting),
        }
        return {**loras,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            # vLLM's "deferred" waiting requests: held by a transient constraint (here: a grammar
            # still compiling), not by capacity.
            "num_waiting_deferred": sum(1 for r in self.waiting if r.status == RequestStatus.WAITING_FOR_GRAMMAR),
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": kv.stats.queries,
            "prefix_cache_hits": kv.stats.hits,
            "kv_blocks_total": kv.num_usable_blocks,
            "kv_blocks_free": kv.get_num_free_blocks(),
        }

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # ---- helpers ----
    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int],
                          new_reqs: list[NewRequestData]) -> int:
        kv = self.kv_cache_manager
        self._register_filled_blocks()
        # still compiling their grammar, or their LoRA adapter would be one too many: they keep their place
        passed_over: list[Request] = []
        running_loras: set[int] | None = None  # the adapters running (computed when a waiting request has one)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_active_seqs:
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR and not self._grammar_ready(request):
                self.waiting.popleft()
                if not request.is_finished:  # (a failed grammar finished it)
                    passed_over.append(request)
                continue
            if request.lora_request is not None:
                running_loras = self._running_loras() if running_loras is None else running_loras
                if not self._lora_fits(request.lora_request.lora_int_id, running_loras):
                    passed_over.append(self.waiting.popleft())
                    continue
            computed_blocks, num_computed = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget, self.prefill_cap)
            if request.images is not None and self.config.disable_chunked_mm_input:
                num_new = self._whole_images(request, num_computed, num_new, budget)
                if num_new == 0:
                    break
            if kv.allocate_slots(request, num_new, computed_blocks) is None:
                break
            kv.record_admission(request, num_computed)
            self.token_store.assign(request, request.length_limit, request.structured_output_request is not None
                                    or request.thinking is not None
                                    or request.sampling_params.repetition_detection is not None)
            self.waiting.popleft()
            self._enqueue(self.running, request, front=False)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:  # first scheduled (not a return from preemption)
                request.num_cached_tokens = num_computed
                request.scheduled_ts = time.monotonic()
            new_reqs.append(NewRequestData(
                req_id=request.request_id,
                token_ids=request.all_token_ids,
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                block_ids=kv.get_block_ids(request.request_id),
                num_computed_tokens=num_computed,
                eos_token_ids=tuple(sorted(request.eos_token_ids)),
                lora_request=request.lora_request,
                prompt_embeds=request.prompt_embeds,
                images=request.images,
            ))
            num_scheduled[request.request_id] = num_new
            self._advance_computed(request, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(passed_over))
        return budget

    def _running_loras(self) -> set[int]:
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _lora_fits(self, lora_int_id: int, running_loras: set[int]) -> bool:
        """Whether a request with this adapter may join the running ones (vLLM's max_loras);
        `running_loras` then counts it."""
        if lora_int_id in running_loras:
            return True
        if self.max_loras is None or len(running_loras) >= self.max_loras:
            return False
        running_loras.add(lora_int_id)
        return True

    def _register_filled_blocks(self) -> None:
        """Before the waiting requests' prefix lookups: the blocks the running requests filled
        with known tokens enter the prefix cache (decode steps leave them to here or to the
        request's end, when they are keyed together)."""
        slots, req_ids = self._running_slots()
        store = self.token_store
        self.kv_cache_manager.register_filled_blocks(req_ids, self.running, store.num_computed_tokens[slots],
                                                     store.num_tokens[slots])

    def _grammar_ready(self, request: Request) -> bool:
        """Whether `request` may be scheduled now; a request whose grammar failed to compile
        is finished (reported by `take_failed`) and taken out of the queue."""
        grammar = request.structured_output_request
        if not grammar.is_ready():
            return False
        if grammar.error is not None:
            logger.error("request %r: %s", request.request_id, grammar.error)
            self._free(request)
            self.failed.append(FinishedRequest(request.request_id, FinishReason.ABORT))
            return False
        request.status = RequestStatus.WAITING
        return True

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: set[str]):
        """Allocate slots for `request`, preempting from the back of `running` until they fit.
        Returns the new blocks, or None when `request` itself had to be preempted."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.token_store.release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.num_preemptions += 1
        request.num_preemptions += 1
        self._enqueue(self.waiting, request, front=True)

    def _enqueue(self, queue: deque[Request] | list[Request], request: Request, front: bool) -> None:
        """FCFS: at the back (a preempted request: at the front, to resume first); by priority:
        at its `queue_key` place (after those of equal key)."""
        if self.by_priority:
            queue.insert(bisect.bisect_right(queue, request.queue_key(), key=Request.queue_key), request)
        elif front:
            queue.appendleft(request)  # (only the waiting deque gets requests at its front)
        else:
            queue.append(request)

    def _free(self, request: Request, uncache: bool = False) -> None:
        if self.num_steps_in_flight:  # their rows for it are stale (async: even a reused id's)
            self.stale_req_ids[request.request_id] = self.num_steps_in_flight
        request.status = RequestStatus.FINISHED
        if request.store is not None:
            self.token_store.release(request)
        self.kv_cache_manager.free(request, uncache)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        self.structured_req_ids.discard(request.request_id)
        self.thinking_req_ids.discard(request.request_id)

    @staticmethod
    def _whole_images(request: Request, num_computed: int, num_new: int, budget: int) -> int:
        """vLLM's disable_chunked_mm_input (always on where an image's tokens attend each other
        both ways, Gemma 3's): a prompt chunk never ends inside an image's placeholders. One that
        would ends before the image, or, starting in it, takes the rest of it where the budget
        allows (past long_prefill_token_threshold) and else nothing this step."""
        images = request.images
        end = num_computed + num_new
        starts = images.offsets
        ends = starts + images.lengths
        inside = np.flatnonzero((starts < end) & (end < ends))
        if not len(inside):
            return num_new
        start, image_end = int(starts[inside[0]]), int(ends[inside[0]])
        if start > num_computed:
            return start - num_computed
        return image_end - num_computed if image_end - num_computed <= budget else 0

    def _check_whole_images_fit(self, request: Request) -> None:
        longest = int(request.images.lengths.max())
        if longest > self.config.max_num_batched_tokens:
            raise VLLMValidationError(f"an image of the prompt takes {longest} tokens, more than "
                                      f"max_num_batched_tokens={self.config.max_num_batched_tokens}, and "
                                      "disable_chunked_mm_input schedules an image's tokens in one step",
                                      parameter="multi_modal_data")

    def _check_fits(self, request: Request) -> None:
        """Reject a request that could never fit the KV cache even alone (it would preempt
        itself forever)."""
        max_len = min(request.num_prompt_tokens + request.max_tokens, self.config.max_model_len)
        needed = self.kv_cache_manager.max_blocks_needed(max_len, self.config.max_num_batched_tokens)
        total = self.kv_cache_manager.num_usable_blocks
        if needed > total:
            raise ValueError(f"request {request.request_id!r} needs up to {needed} KV blocks "
                             f"({max_len} tokens) but the cache has {total}")


def _place_more_logprobs(outputs: EngineCoreOutputs, out_rows: list[int], arrays: LogprobsArrays,
                         positions: np.ndarray, width: int) -> None:
    """The worker's logprobs of kept tokens after a row's first (row i: output row out_rows[i],
    -1 for one not in the outputs; its token at `positions[i]` >= 1) at [output row, position - 1]
    of `outputs.more_logprob_*`, `width` columns as `more_token_ids` (the tokens a stop cut off
    are not read)."""
    shape = (len(outputs.req_ids), width, arrays.token_ids.shape[1])
    token_ids, logprobs, ranks = np.zeros(shape, np.int32), np.zeros(shape, np.float32), np.zeros(shape, np.int32)
    present = np.array(out_rows, dtype=np.int64) >= 0
    at = (np.array(out_rows, dtype=np.int64)[present], positions[present] - 1)
    token_ids[at], logprobs[at], ranks[at] = (arrays.token_ids[present], arrays.logprobs[present],
                                              arrays.ranks[present])
    outputs.more_logprob_token_ids, outputs.more_logprobs, outputs.more_logprob_ranks = token_ids, logprobs, ranks


def drafts_allowed(request: Request) -> bool:
    """Whether speculative decoding may give `request` drafts: the sampler then draws each draft
    position from the request's own distribution at that position (penalties and min_tokens
    count the drafts before it, a grammar's bitmask row is its state after them). Not for what
    depends on the tokens before it within the step otherwise (bad words, a thinking budget);
    those requests decode a token a step, as without drafts."""
    params = request.sampling_params
    return not params.bad_words and not params.bad_words_token_ids and request.thinking is None


def _lora_names(requests: Any) -> str:
    """The adapters of `requests`, by name, comma-separated (vLLM's label value)."""
    return ",".join(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))


def _first(item: tuple[int, Request, bool]) -> int:
    return item[0]
