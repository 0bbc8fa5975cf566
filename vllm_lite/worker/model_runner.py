"""Runs one scheduled step on a device: update the persistent batch, build inputs with array
code, run the model, sample, and append the sampled tokens to the batch.

The batch's own copy of the tokens is what the next step reads: with async scheduling the
engine core schedules a row's next position before it has seen the token sampled there (a
placeholder), and the step reads that token from the batch, where it already is."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from vllm_lite.attention.backend import AttentionBackend, CommonAttentionMetadata, kv_cache_shape
from vllm_lite.attention.selector import get_attn_backend
from vllm_lite.config import VllmConfig, max_blocks_per_seq
from vllm_lite.core.scheduler_output import NewRequestData, SchedulerOutput
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.loader import load_model
from vllm_lite.sample.metadata import SamplingMetadata
from vllm_lite.sample.ops.grammar_mask import GrammarBitmask
from vllm_lite.sample.ops.logprobs import compute_logprobs, gather_logprobs, scatter_rows
from vllm_lite.sample.occurrences import TokenOccurrences
from vllm_lite.sample.sampler import Sampler
from vllm_lite.worker.cuda_graph import CudaGraphRunner, maybe_capture_cuda_graphs
from vllm_lite.worker.host_to_device import host_to_device
from vllm_lite.worker.input_batch import InputBatch
from vllm_lite.wire import LogprobsArrays, ModelRunnerOutput
from vllm_lite.worker.sampling_inputs import build_sampling_metadata

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: object
    logits_indices: torch.Tensor
    sample_rows: np.ndarray  # batch rows that sample this step
    rows: np.ndarray  # batch rows scheduled this step, in token order
    query_starts: np.ndarray  # index of each scheduled row's first token in the flat batch
    query_lens: np.ndarray  # tokens of each scheduled row this step


class ModelRunner:
    def __init__(self, vllm_config: VllmConfig, device: torch.device,
                 tp: TensorParallelGroup = SINGLE_RANK,
                 attn_backend: AttentionBackend | None = None) -> None:
        self.config = vllm_config
        self.device = device
        self.block_size = vllm_config.cache_config.block_size
        self.attn_backend = attn_backend or get_attn_backend(
            vllm_config.model_config.attention_backend, device, getattr(torch, vllm_config.model_config.dtype))
        self.model = load_model(vllm_config.model_config, self.attn_backend, device, tp)
        self.tp = tp
        model_config = vllm_config.model_config
        max_blocks = max_blocks_per_seq(model_config.max_model_len, self.block_size)
        self.input_batch = InputBatch(vllm_config.scheduler_config.max_num_seqs,
                                      model_config.max_model_len, max_blocks)
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self.token_occurrences = TokenOccurrences(device)  # penalized requests only
        self.min_tokens_stop_ids: dict[str, tuple[int, ...]] = {}  # only requests with min_tokens
        self.kv_caches: list[torch.Tensor] = []
        self.cuda_graphs: CudaGraphRunner | None = None  # decode steps replay these (CUDA only)
        self._sampling_metadata: SamplingMetadata | None = None
        self._sampling_key: tuple[int, int] = (-1, -1)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        hf = self.config.model_config.hf
        attn = self.model.model.layers[0].self_attn
        shape = kv_cache_shape(num_blocks, self.block_size, attn.num_kv_heads, hf.head_dim)
        dtype = getattr(torch, self.config.model_config.dtype)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=self.device)
                          for _ in range(hf.num_hidden_layers)]
        self.cuda_graphs = maybe_capture_cuda_graphs(self.config, self.model, self.attn_backend,
                                                     self.kv_caches, self.device)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        failed = self._update_states(scheduler_output)
        batch = self.input_batch
        num_rows = batch.num_reqs
        output = ModelRunnerOutput(list(batch.live_req_ids), np.zeros((num_rows, 1), dtype=np.int32),
                                   np.zeros(num_rows, dtype=np.int32), failed=failed)
        inputs = self._prepare_inputs(scheduler_output) if scheduler_output.total_num_scheduled_tokens > 0 else None
        if inputs is not None:
            if self.cuda_graphs is not None and self.cuda_graphs.can_replay(inputs.attn_metadata):
                hidden = self.cuda_graphs.replay(inputs.input_ids, inputs.positions, inputs.attn_metadata)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
            output.prompt_logprobs = self._prompt_logprobs(hidden, inputs)
            if len(inputs.sample_rows):
                self._sample(hidden, inputs, output, self._grammar_bitmask(scheduler_output, inputs.sample_rows))
        return output

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs, output: ModelRunnerOutput,
                grammar: GrammarBitmask | None = None) -> None:
        rows = inputs.sample_rows
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        sampled = self.sampler(logits, self._sampling_metadata_for(rows), grammar)
        tokens = sampled.sampled_token_ids.to(torch.int32).cpu().numpy()
        self._append_sampled(rows, tokens)
        output.sampled_token_ids[rows, 0] = tokens
        output.num_sampled[rows] = 1
        if sampled.logprobs is not None:
            asked = rows if sampled.logprobs_rows is None else rows[sampled.logprobs_rows]
            output.logprobs = scatter_rows(sampled.logprobs.to_numpy(), asked, len(output.num_sampled))

    # ---- persistent batch upkeep ----
    def _update_states(self, sched: SchedulerOutput) -> dict[str, str] | None:
        """Returns the new requests that could not be taken into the batch (see _add_new)."""
        batch = self.input_batch
        # Sorted: a set's order depends on the process's hash seed, and the rows freed first are
        # the rows new requests take; every tensor-parallel rank must lay its batch out alike
        # (the collectives add up the rows of different ranks by position).
        for req_id in sorted(sched.finished_req_ids):
            self._drop_request(req_id)
        for req_id in sorted(sched.preempted_req_ids):
            # Its generator stays: the request resumes its random stream where it stopped.
            batch.remove_request(req_id)
            self.token_occurrences.release(req_id)  # rebuilt from its history when it returns
        failed = self._add_new(sched.scheduled_new_reqs) if sched.scheduled_new_reqs else None
        cached = sched.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                       cached.num_computed_tokens):
            row = batch.req_id_to_index.get(req_id)
            if row is None:  # failed to join the batch; async scheduling ran ahead of the news
                continue
            batch.block_table.append_row(row, new_block_ids)
            batch.num_computed_tokens[row] = num_computed
        batch.condense()
        return failed

    def _add_new(self, new_reqs: list[NewRequestData]) -> dict[str, str] | None:
        """Add the step's new requests to the batch. A request whose addition raises is dropped
        from this worker and reported, and the others go on: one `try` per step, re-entered only
        after a failure, so the common path costs nothing per request."""
        failed: dict[str, str] | None = None
        start = 0
        while start < len(new_reqs):
            index = start
            try:
                for index in range(start, len(new_reqs)):
                    self._add_one(new_reqs[index])
                return failed
            except Exception as exc:  # attributable to new_reqs[index] alone
                req_id = new_reqs[index].req_id
                logger.exception("worker: request %r failed while joining the batch", req_id)
                self._drop_request(req_id)
                failed = failed or {}
                failed[req_id] = f"{type(exc).__name__}: {exc}"
                start = index + 1
        return failed

    def _add_one(self, new: NewRequestData) -> None:
        self.input_batch.add_request(new)
        self._add_sampling_state(new)

    def _drop_request(self, req_id: str) -> None:
        self.input_batch.remove_request(req_id)
        self.generators.pop(req_id, None)
        self.min_tokens_stop_ids.pop(req_id, None)
        self.token_occurrences.release(req_id)

    def _add_sampling_state(self, new: NewRequestData) -> None:
        params = new.sampling_params
        if params.seed is not None and new.req_id not in self.generators:
            self.generators[new.req_id] = torch.Generator(self.device).manual_seed(params.seed)
        if params.min_tokens > 0:
            self.min_tokens_stop_ids[new.req_id] = tuple(set(new.eos_token_ids) | set(params.stop_token_ids or ()))

    # ---- inputs ----
    def _prepare_inputs(self, sched: SchedulerOutput) -> StepInputs | None:
        """None when no scheduled request is in the batch (every one failed to join it)."""
        batch = self.input_batch
        index = batch.req_id_to_index
        num_scheduled = np.zeros(batch.num_reqs, dtype=np.int32)
        for req_id, n in sched.num_scheduled_tokens.items():
            row = index.get(req_id)  # None: a request that failed to join the batch this step
            if row is not None:
                num_scheduled[row] = n
        rows = np.flatnonzero(num_scheduled)
        if len(rows) == 0:
            return None
        query_lens = num_scheduled[rows]
        cu_lens = np.cumsum(query_lens, dtype=np.int32)
        total = int(cu_lens[-1])
        token_rows = np.repeat(rows, query_lens)
        offsets = np.arange(total, dtype=np.int32) - np.repeat(cu_lens - query_lens, query_lens)
        positions = batch.num_computed_tokens[token_rows] + offsets
        input_ids = batch.token_ids[token_rows, positions]
        block_ids = batch.block_table.block_ids
        slot_mapping = (block_ids[token_rows, positions // self.block_size].astype(np.int64)
                        * self.block_size + positions % self.block_size)
        seq_lens = batch.num_computed_tokens[rows] + query_lens
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
        query_start_loc[1:] = cu_lens
        max_blocks = -(-int(seq_lens.max()) // self.block_size)
        # Rows whose known tokens are all computed after this step produce a new token.
        samples = seq_lens == batch.num_tokens[rows]
        common = CommonAttentionMetadata(
            query_start_loc=self._to_device(query_start_loc),
            seq_lens=self._to_device(seq_lens),
            block_table=self._to_device(block_ids[rows, :max_blocks]),
            slot_mapping=self._to_device(slot_mapping),
            query_start_loc_np=query_start_loc,
            seq_lens_np=seq_lens,
            num_actual_tokens=total,
            max_query_len=int(query_lens.max()),
            block_size=self.block_size,
        )
        return StepInputs(
            input_ids=self._to_device(input_ids.astype(np.int64)),
            positions=self._to_device(positions.astype(np.int64)),
            attn_metadata=self.attn_backend.build(common),
            logits_indices=self._to_device((cu_lens[samples] - 1).astype(np.int64)),
            sample_rows=rows[samples],
            rows=rows,
            query_starts=cu_lens - query_lens,
            query_lens=query_lens,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return host_to_device(array, self.device)

    # ---- sampling ----
    def _sampling_metadata_for(self, rows: np.ndarray) -> SamplingMetadata:
        """Cached while the batch is unchanged and the same rows sample (steady decode)."""
        key = (self.input_batch.version, len(rows))
        if self._sampling_metadata is None or key != self._sampling_key or len(rows) != self.input_batch.num_reqs:
            self._sampling_metadata = build_sampling_metadata(self.input_batch, rows, self.generators,
                                                              self.min_tokens_stop_ids, self.device,
                                                              self.token_occurrences)
            self._sampling_key = key
        return self._sampling_metadata

    def _grammar_bitmask(self, sched: SchedulerOutput, sample_rows: np.ndarray) -> GrammarBitmask | None:
        """The scheduler's bitmask rows, placed at the logits rows of their requests
        (`sample_rows` is ascending: the rows of a flatnonzero)."""
        if sched.grammar_bitmask is None:
            return None
        batch_rows = np.array([self.input_batch.req_id_to_index[r] for r in sched.structured_output_req_ids])
        logits_rows = np.searchsorted(sample_rows, batch_rows)
        assert (sample_rows[logits_rows] == batch_rows).all(), "a constrained request does not sample"
        return GrammarBitmask(self._to_device(logits_rows.astype(np.int64)),
                              torch.from_numpy(_writable(sched.grammar_bitmask)))

    def _append_sampled(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        batch = self.input_batch
        batch.token_ids[rows, batch.num_tokens[rows]] = tokens
        batch.num_tokens[rows] += 1

    # ---- prompt logprobs ----
    def _prompt_logprobs(self, hidden: torch.Tensor,
                         inputs: StepInputs) -> dict[str, tuple[int, LogprobsArrays]] | None:
        """Logprobs of each prompt token given its prefix, for the prompt positions this step
        computes. Hidden state at position p predicts token p + 1, so positions run up to
        num_prompt_tokens - 2; a recomputed chunk (after preemption) yields the same rows again."""
        batch = self.input_batch
        rows = inputs.rows
        asked = batch.num_prompt_logprobs[rows] >= 0
        if not asked.any():
            return None
        starts = batch.num_computed_tokens[rows]
        ends = np.minimum(starts + inputs.query_lens, batch.num_prompt_tokens[rows] - 1)
        wanted = np.flatnonzero(asked & (ends > starts))
        if len(wanted) == 0:
            return None
        counts = ends[wanted] - starts[wanted]
        firsts = np.cumsum(counts) - counts
        offsets = np.arange(int(counts.sum())) - np.repeat(firsts, counts)
        hidden_index = np.repeat(inputs.query_starts[wanted], counts) + offsets
        targets = batch.token_ids[np.repeat(rows[wanted], counts), np.repeat(starts[wanted], counts) + offsets + 1]
        logprobs = compute_logprobs(self.model.compute_logits(hidden[self._to_device(hidden_index)]))
        k = int(batch.num_prompt_logprobs[rows[wanted]].max())
        arrays = gather_logprobs(logprobs, k, self._to_device(targets.astype(np.int64))).to_numpy()
        return {batch.req_ids[rows[i]]: (int(starts[i]), arrays.slice_rows(first, first + count))
                for i, first, count in zip(wanted.tolist(), firsts.tolist(), counts.tolist())}


def _writable(array: np.ndarray) -> np.ndarray:
    """torch wants writable memory; arrays decoded off the wire are read-only views."""
    return array if array.flags.writeable and array.flags.c_contiguous else np.array(array)
