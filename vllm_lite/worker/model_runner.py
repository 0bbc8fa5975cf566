"""Runs one scheduled step on a device: update the persistent batch, build inputs with array
code, run the model, sample, and append the sampled tokens to the batch.

A step is launched (`launch`: everything up to the sampled tokens, which stay on the device)
and then finished (`finish`: the tokens reach the host, the batch and the output). With async
scheduling the engine core schedules a row's next position before it has seen the token sampled
there (a placeholder), and the step reads that token from the worker: from the batch once the
last step is finished, or, when the next step is launched before the last one is finished (on a
GPU, so that the host prepares step N+1 while the device runs step N), straight from the device
tensor the last step sampled into (`SampledTokens`)."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vllm_lite.attention.backend import AttentionBackend, CommonAttentionMetadata, kv_cache_shape
from vllm_lite.attention.selector import get_attn_backend
from vllm_lite.bookkeeping import native_loops
from vllm_lite.config import HFModelConfig, VllmConfig, kv_cache_row, max_blocks_per_seq
from vllm_lite.cpu_info import openmp_threads_sleep
from vllm_lite.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.exceptions import describe_error, run_each_contained
from vllm_lite.host_to_device import StepInputTensors, host_to_device
from vllm_lite.model.layers.gated_delta_rule import RecurrentStates, RecurrentStep
from vllm_lite.model.layers.linear import LinearBase, linear
from vllm_lite.model.layers.matmul_rows import bucket_rows
from vllm_lite.model.layers.rotary import use_mrope
from vllm_lite.model.loader import load_image_encoder, load_model
from vllm_lite.model.weight_updates import update_weights
from vllm_lite.ragged import segment_offsets
from vllm_lite.sample.metadata import SamplingMetadata
from vllm_lite.sample.ops.grammar_mask import GrammarBitmask
from vllm_lite.sample.ops.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs, scatter_rows
from vllm_lite.sample.occurrences import TokenOccurrences
from vllm_lite.sample.sampler import Sampler, SamplerOutput
from vllm_lite.worker.cuda_graph import CudaGraphRunner, maybe_capture_cuda_graphs
from vllm_lite.worker.draft_model import DraftModelProposer
from vllm_lite.worker.encoder_cache import EncoderCache
from vllm_lite.worker.eagle import EagleProposer, StateReadingProposer, StepStates
from vllm_lite.worker.medusa import MedusaProposer
from vllm_lite.worker.input_batch import InputBatch
from vllm_lite.worker.logits_processors import CustomLogitsProcessors
from vllm_lite.worker.lora_manager import LoRAManager
from vllm_lite.worker.memory import return_freed_memory
from vllm_lite.sample.custom_logits import CustomLogitsStep
from vllm_lite.worker.pooler import Pooler
from vllm_lite.worker.mrope import MropePositions
from vllm_lite.worker.prompt_embeds import PromptEmbeds
from vllm_lite.wire import ImageInputs, LogprobsArrays, ModelRunnerOutput
from vllm_lite.worker.sampling_inputs import build_sampling_metadata, penalized

logger = logging.getLogger(__name__)

# A CPU step computing at most this many tokens may run on one thread when idle OpenMP threads
# sleep (PASSIVE, the engine's default): each parallel region (a matmul, the attention) then
# starts by waking the others. Whether that costs more than a second thread's share of the work
# depends on the machine, so the worker measures it at start (`_small_steps_fit_one_thread`).
# Demo model, bf16, decode steps, 2 threads configured (benchmarks/RESULTS.md): on an AMD EPYC VM
# one thread won (1 request 40-43 ms per step vs 45-52 on two, 8 requests 43-56 vs 51-61); on an
# Intel Xeon VM two did (8 requests 37-42 vs 44-56 in-process, 38.8-39.8 vs 49.9-50.3 through
# `LLM`). Above this size two threads win on both (the attention has the work to share).
ONE_THREAD_MAX_TOKENS = 8
# Why a request whose constraints left no token to sample at a position fails (the sampler's
# `emptied_rows`).
EMPTIED_ROW = ("nothing is left to sample: its allowed_token_ids, bad_words and structured-output grammar "
               "together exclude every token at this position")
# Weights the measurement streams per pass (8 passes at start): more than most last-level caches
# hold, as a decode step's weights are (the demo model's 211 MB of linear weights all fit), and
# about a second at start for a model of any size.
CALIBRATION_WEIGHT_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class StepRows:
    """The batch rows a step computes (ascending), their query lengths, and what follows from
    those alone: kept (read-only) while the batch keeps its rows and the scheduler hands over
    the same counts (`ModelRunner._scheduled_rows`), so a steady decode step derives none of it."""

    rows: np.ndarray
    query_lens: np.ndarray  # int32
    cu_lens: np.ndarray  # int32, cumulative query lengths
    query_start_loc: np.ndarray  # int32 [len(rows) + 1]: 0, then cu_lens
    query_starts: np.ndarray  # each row's first token in the flat step
    last_tokens: np.ndarray  # int64: each row's last token in the flat step
    max_query_len: int

    @staticmethod
    def of(rows: np.ndarray, query_lens: np.ndarray) -> StepRows:
        cu_lens = np.cumsum(query_lens, dtype=np.int32)
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
        query_start_loc[1:] = cu_lens
        step = StepRows(rows, query_lens, cu_lens, query_start_loc, cu_lens - query_lens,
                        (cu_lens - 1).astype(np.int64), int(query_lens.max()))
        for array in (rows, query_lens, cu_lens, query_start_loc, step.query_starts, step.last_tokens):
            array.flags.writeable = False  # kept for later steps
        return step


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: object
    logits_indices: torch.Tensor
    sample_rows: np.ndarray  # batch rows that sample this step
    # Every token is its row's last and samples (a decode step): the logits' hidden states are the
    # first len(sample_rows) rows as they are, no gather.
    every_token_samples: bool
    rows: np.ndarray  # batch rows scheduled this step, in token order
    query_starts: np.ndarray  # index of each scheduled row's first token in the flat batch
    query_lens: np.ndarray  # tokens of each scheduled row this step


@dataclass(slots=True)
class SampledTokens:
    """A step's sampled tokens from their sampling until `finish` writes them into the batch.
    The batch already counts them (`num_tokens`), so the next step can be prepared; their values
    are on the device (`tokens`, which that step's inputs read) and on their way to the host
    (`host`, complete once `copied` has happened)."""

    rows: np.ndarray  # batch rows at launch, ascending
    req_ids: list[str]  # the request of each row
    serials: np.ndarray  # the row's `row_serial` at launch
    positions: np.ndarray  # where in its row each token goes
    batch_version: int  # the batch's version at launch: the rows still hold if it is unchanged
    tokens: torch.Tensor  # int64 [len(rows)] on the device
    host: torch.Tensor  # [len(rows)] on the host: int32 copied from a GPU, `tokens` themselves on CPU
    copied: torch.cuda.Event | None  # None when `host` is complete already


@dataclass(slots=True)
class LaunchedStep:
    """A step whose work is queued on the device; `ModelRunner.finish` makes it an output."""

    output: ModelRunnerOutput  # complete except for the sampled tokens and their logprobs
    sampled: SampledTokens | None
    logprobs: LogprobsTensors | None
    logprobs_rows: np.ndarray | None  # the batch rows `logprobs` holds
    # the model's states an EAGLE or Medusa head reads once the step is finished
    drafter_states: StepStates | None = None


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
        # a multimodal checkpoint's vision side, where its image inputs are taken
        self.image_encoder = (load_image_encoder(vllm_config.model_config, device)
                              if vllm_config.model_config.image_encoder is not None else None)
        if self.image_encoder is not None:  # (a trainer's update of the whole checkpoint reaches it: weight_updates.py)
            self.model.load_vision_weights = self._update_vision_weights
        # Qwen2-VL: the multimodal rotary positions of the requests with images
        image_config = vllm_config.model_config.image_encoder
        self.mrope = MropePositions(image_config.spatial_merge) if image_config is not None and image_config.mrope else None
        if self.mrope is not None:
            use_mrope(self.model, image_config.mrope_section, image_config.mrope_interleaved)
        # vLLM's encoder cache, as large as its default (a step's token budget)
        self.encoder_cache = (EncoderCache(vllm_config.scheduler_config.max_num_batched_tokens)
                              if self.image_encoder is not None else None)
        lora_config = vllm_config.lora_config
        self.lora = (LoRAManager(self.model, lora_config, device, getattr(torch, vllm_config.model_config.dtype),
                                 pooling=vllm_config.model_config.pooler is not None,
                                 checkpoint_architecture=vllm_config.model_config.hf.checkpoint_architecture)
                     if lora_config is not None else None)
        # CPU steps go through the model padded to a matmul bucket size (`_padded_to_bucket`),
        # unless a layer would compute the padded rows at a cost (a MoE layer routes them).
        self._pads_steps = (device.type == "cpu" and self.attn_backend.takes_padded_rows
                            and all(getattr(m, "takes_padded_rows", True) for m in self.model.modules()))
        self.tp = tp
        # The intra-op threads a step uses (set on the thread that runs the steps, each step).
        self.num_threads = torch.get_num_threads()
        self._small_steps_on_one_thread = self._small_steps_fit_one_thread()
        model_config = vllm_config.model_config
        max_blocks = max_blocks_per_seq(model_config.max_model_len, self.block_size)
        self.input_batch = InputBatch(vllm_config.scheduler_config.max_num_seqs,
                                      model_config.max_model_len, max_blocks)
        # vLLM's custom logits processors (None without them: nothing below reports to them)
        self.custom_logits = (CustomLogitsProcessors(model_config.logits_processors, vllm_config, device)
                              if model_config.logits_processors else None)
        if self.custom_logits is not None:
            self.input_batch.on_move = self.custom_logits.moved
        self.sampler = Sampler(vllm_config.model_config.logprobs_mode)
        pooler = vllm_config.model_config.pooler
        # the pooling runner (a classifier's pooled states go through its head, `score`)
        self.pooler = (Pooler(pooler, device, self.model.score if pooler.task == "classify" else None,
                              self.lora.heads if self.lora is not None else None)
                       if pooler is not None else None)
        self.token_occurrences = TokenOccurrences(device)  # penalized requests only
        # vLLM's prompt_embeds and image features of prompts not computed yet
        self.prompt_embeds = PromptEmbeds(device, getattr(torch, model_config.dtype),
                                          image_config is not None and image_config.bidirectional,
                                          image_config.feature_pixels if image_config is not None
                                          and image_config.row_breaks else 0)
        self.min_tokens_stop_ids: dict[str, tuple[int, ...]] = {}  # only requests with min_tokens
        self.kv_caches: list[torch.Tensor] = []
        # a hybrid model's linear-attention states, a slot per batch row (InputBatch.state_slots)
        self.recurrent_states: RecurrentStates | None = None
        self.num_state_slots = 0
        spec = vllm_config.speculative_config
        # vLLM's draft_model, EAGLE and Medusa speculative decoding: the drafter beside the model
        # (worker/draft_model.py, worker/eagle.py, worker/medusa.py)
        self.drafter: DraftModelProposer | EagleProposer | MedusaProposer | None = None
        if spec is not None and spec.uses_draft_model:
            self.drafter = DraftModelProposer(spec.draft_model_config, self.attn_backend, device, tp, self.block_size)
        elif spec is not None and spec.eagle is not None:
            self.drafter = EagleProposer(spec, self.model, self.attn_backend, device, tp, self.block_size)
        elif spec is not None and spec.medusa is not None:
            self.drafter = MedusaProposer(spec, vllm_config.model_config.dtype, device, tp)
        self.cuda_graphs: CudaGraphRunner | None = None  # decode steps replay these (CUDA only)
        self._sampling_metadata: SamplingMetadata | None = None
        self._sampling_key: tuple[int, int] = (-1, -1)
        self.logits_width: int | None = None  # the model's logits' last dimension, once a step sampled
        # Requests dropped from the batch because they failed, until the engine core's finished
        # ids say it knows: a step it scheduled before it knew (async scheduling) still names
        # them, and they are passed over there.
        self.dropped_failed: set[str] = set()
        # The last launched step's sampled tokens while that step is not finished (at most one).
        self.unfinished: SampledTokens | None = None
        self._rows_cache: tuple[int, list[str], np.ndarray, slice | np.ndarray] | None = None  # see _batch_rows
        self._step_rows_cache: tuple[int, dict[str, int], StepRows | None] | None = None  # see _scheduled_rows
        self.step_inputs = StepInputTensors(device)  # the tensors `_prepare_inputs` fills
        # csrc's loops (vllm_lite._bookkeeping) for the steady decode step's inputs; None: numpy's
        # general path builds every step (the reference the tests hold the C loop to).
        self.native_loops = native_loops

    def _small_steps_fit_one_thread(self) -> bool:
        """Whether steps of at most ONE_THREAD_MAX_TOKENS tokens should run on one thread: only
        where sleeping OpenMP threads must be woken for every parallel region, and then as
        measured here (`_best_linear_pass_seconds`). The thread count changes no result: the
        matmuls and the csrc ops split rows and items among threads, not sums."""
        if self.device.type != "cpu" or not openmp_threads_sleep() or self.num_threads == 1:
            return False
        best = self._best_linear_pass_seconds((1, self.num_threads))
        one_thread = best[1] <= best[self.num_threads]
        logger.info("steps of up to %d tokens run on %s: one row through the linear layers took %.2f ms on one "
                    "thread, %.2f ms on %d", ONE_THREAD_MAX_TOKENS,
                    "one thread" if one_thread else f"{self.num_threads} threads",
                    1e3 * best[1], 1e3 * best[self.num_threads], self.num_threads)
        return one_thread

    def _best_linear_pass_seconds(self, thread_counts: tuple[int, ...]) -> dict[int, float]:
        """Seconds of one row through the linear layers (what a decode step reads; the first
        CALIBRATION_WEIGHT_BYTES of them, so a large model starts no slower) on each thread
        count: interleaved, best of three passes each after a warm-up pass."""
        dtype = getattr(torch, self.config.model_config.dtype)
        layers, weight_bytes = [], 0
        for module in self.model.modules():
            if isinstance(module, LinearBase) and weight_bytes < CALIBRATION_WEIGHT_BYTES:
                layers.append(module)
                weight_bytes += module.weight.numel() * dtype.itemsize
        rows = [torch.zeros(1, layer.weight.shape[1], dtype=dtype) for layer in layers]
        best = dict.fromkeys(thread_counts, float("inf"))
        with torch.inference_mode():
            for repeat in range(4):
                for threads in thread_counts:
                    torch.set_num_threads(threads)
                    start = time.perf_counter()
                    for layer, row in zip(layers, rows):  # the matmul alone: no TP collective
                        linear(row, layer.weight, layer.packed_weight, layer.bias)
                    if repeat:
                        best[threads] = min(best[threads], time.perf_counter() - start)
        torch.set_num_threads(self.num_threads)
        return best

    def initialize_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> None:
        """`num_state_slots`: the requests whose linear-attention states to hold (a hybrid
        model's; no more run at once: the engine core's scheduler is capped at it)."""
        self.num_kv_blocks, self.num_state_slots = num_blocks, num_state_slots
        self.kv_caches = self._new_kv_caches(num_blocks)
        self.recurrent_states = self._new_recurrent_states(num_state_slots)
        # (a draft model's or EAGLE head's KV in the same blocks: a request's block table is theirs too; a
        # Medusa head keeps none)
        if isinstance(self.drafter, (DraftModelProposer, EagleProposer)):
            self.drafter.kv_caches = self._new_kv_caches(num_blocks, self.drafter.model, self.drafter.config.hf)
        if self.device.type == "cuda" and isinstance(self.drafter, EagleProposer) and self.drafter.eagle.aux_layer_ids:
            logger.info("CUDA graphs off: the EAGLE-3 head reads the model's layers through hooks, which a graph "
                        "replay does not run")
        else:
            self.cuda_graphs = maybe_capture_cuda_graphs(self.config, self.model, self.attn_backend,
                                                         self.kv_caches, self.device)

    def release_kv_cache(self) -> None:
        """vLLM's sleep level 1 on CPU: the KV cache's memory goes back to the system (no
        request may hold blocks; `initialize_kv_cache` makes a new, zeroed one)."""
        self.kv_caches, self.cuda_graphs, self.recurrent_states = [], None, None
        if self.drafter is not None:
            self.drafter.reset()
        return_freed_memory()

    @torch.inference_mode()
    def profile_run(self) -> int:
        """A step as large as the scheduler makes, for its activations' peak (gpu_memory_utilization):
        max_num_batched_tokens prompt tokens in sequences of up to max_model_len, then logits for
        max_num_seqs rows and the sort top-p does over them. Before the KV cache exists, the
        sequences share a scratch cache of one sequence's blocks; returns its bytes (the real
        cache takes its place, so the peak less these is what the KV cache must leave room for)."""
        sched = self.config.scheduler_config
        num_tokens = sched.max_num_batched_tokens
        seq_len = min(num_tokens, self.config.model_config.max_model_len)
        query_lens = np.full(num_tokens // seq_len, seq_len, dtype=np.int32)
        if num_tokens % seq_len:
            query_lens = np.append(query_lens, np.int32(num_tokens % seq_len))
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
        query_start_loc[1:] = np.cumsum(query_lens)
        blocks = -(-seq_len // self.block_size)
        positions = segment_offsets(query_lens).astype(np.int64)
        block_table = np.tile(np.arange(1, blocks + 1, dtype=np.int32), (len(query_lens), 1))
        common = CommonAttentionMetadata(
            query_start_loc=self._to_device(query_start_loc), seq_lens=self._to_device(query_lens),
            block_table=self._to_device(block_table),
            slot_mapping=self._to_device(positions + self.block_size),  # block i + 1 holds positions of block i
            query_start_loc_np=query_start_loc, seq_lens_np=query_lens, num_actual_tokens=num_tokens,
            max_query_len=seq_len, block_size=self.block_size)
        scratch = self._new_kv_caches(blocks + 1)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        states = self._new_recurrent_states(len(query_lens))
        recurrent = ({} if states is None else
                     {"recurrent": RecurrentStep.of(states, np.arange(len(query_lens)), query_start_loc[:-1],
                                                    query_lens, np.zeros(len(query_lens), dtype=np.int32),
                                                    self.device)})
        hidden = self.model(input_ids, self._to_device(positions), scratch, self.attn_backend.build(common),
                            **recurrent)
        rows = torch.arange(sched.max_num_seqs, device=self.device) % num_tokens
        logits = self.model.compute_logits(hidden[rows])
        torch.sort(logits.float().softmax(-1), dim=-1, descending=True)
        return sum(layer.numel() * layer.element_size() for layer in scratch)

    def _new_kv_caches(self, num_blocks: int, model: torch.nn.Module | None = None,
                       hf: HFModelConfig | None = None) -> list[torch.Tensor]:
        """Zeroed KV caches of `num_blocks` blocks, one per layer: this rank's KV heads, in the KV
        cache dtype's rows (the engine's cache, or profile_run's scratch one; a draft model's
        with `model` and its `hf`)."""
        model, hf = model or self.model, hf or self.config.model_config.hf
        element, row_size = kv_cache_row(self.config.kv_cache_dtype, hf.head_dim)
        num_kv_heads = model.model.layers[0].self_attn.num_kv_heads
        shape = kv_cache_shape(num_blocks, self.block_size, num_kv_heads, row_size)
        linear = hf.linear_attention_layers
        return [torch.zeros(0 if layer in linear else shape, dtype=getattr(torch, element), device=self.device)
                for layer in range(hf.num_hidden_layers)]

    def _new_recurrent_states(self, num_slots: int) -> RecurrentStates | None:
        """Zeroed linear-attention states of `num_slots` requests (None for a model without such layers)."""
        model_config = self.config.model_config
        shape = model_config.hf.linear_attention
        if shape is None:
            return None
        return RecurrentStates.allocate(shape, num_slots, getattr(torch, model_config.dtype), self.device)

    def _recurrent_kwargs(self, inputs: StepInputs) -> dict[str, RecurrentStep]:
        """The model's linear-attention layers' part of the step ({} for a model without them)."""
        if self.recurrent_states is None:
            return {}
        batch = self.input_batch
        return {"recurrent": RecurrentStep.of(self.recurrent_states, batch.state_slots[inputs.rows],
                                              inputs.query_starts, inputs.query_lens,
                                              batch.num_computed_tokens[inputs.rows], self.device)}

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.finish(self.launch(scheduler_output))

    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Failure containment: a request whose own step work raises (joining the batch, its
        row's update, its sampling metadata) is left out of the step and reported in
        `ModelRunnerOutput.failed`; the engine core fails and frees it, the others go on. Runs
        in inference mode, entered here unless the calling thread holds it already (the
        engine's own step threads do: `Executor.step_thread_mode`)."""
        if torch.is_inference_mode_enabled():
            return self._launch(scheduler_output)
        with torch.inference_mode():
            return self._launch(scheduler_output)

    def _launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        failed = self._update_states(scheduler_output)
        batch = self.input_batch
        num_rows = batch.num_reqs
        drafts = self._place_drafts(scheduler_output.scheduled_spec_decode_tokens)
        if self.drafter is not None:
            self.drafter.forget(scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids)
            if drafts is not None:
                self.drafter.propose(batch, drafts)
        width = 1 if drafts is None else 1 + int(drafts.max(initial=0))
        output = ModelRunnerOutput(batch.live_req_ids, np.zeros((num_rows, width), dtype=np.int32),
                                   np.zeros(num_rows, dtype=np.int32), failed=failed)
        step = LaunchedStep(output, None, None, None)
        inputs = (self._prepare_inputs(scheduler_output, drafts) if scheduler_output.total_num_scheduled_tokens > 0
                  else None)
        if inputs is not None:
            if self.custom_logits is not None:
                self.custom_logits.update_state(self.input_batch.num_reqs)
            if self.lora is not None:
                self.lora.set_step(self.input_batch.lora_ids[self.input_batch.row_index(inputs.rows)],
                                   inputs.query_lens)
            self._set_step_threads(scheduler_output.total_num_scheduled_tokens)
            given = (self.prompt_embeds.take_step(self.input_batch, inputs.rows, inputs.query_starts,
                                                  inputs.query_lens) if self.prompt_embeds else None)
            if given is not None:
                hidden = self._forward_with_embeds(inputs, given)
            elif (self.cuda_graphs is not None and self.cuda_graphs.can_replay(inputs.attn_metadata)
                  and inputs.positions.dim() == 1):  # (not Qwen2-VL's placeholders' [3, tokens])
                hidden = self.cuda_graphs.replay(inputs.input_ids, inputs.positions, inputs.attn_metadata)
            else:
                hidden = self.model(*self._padded_to_bucket(inputs.input_ids, inputs.positions), self.kv_caches,
                                    inputs.attn_metadata, **self._recurrent_kwargs(inputs))
            if self.pooler is not None:
                self._pool(hidden, inputs, output)
                return step
            if isinstance(self.drafter, StateReadingProposer):
                step.drafter_states = StepStates(self.drafter.step_states(hidden), inputs.rows,
                                       [batch.req_ids[row] for row in inputs.rows.tolist()], inputs.query_starts,
                                       inputs.query_lens, batch.num_computed_tokens[inputs.rows].astype(np.int64))
            output.prompt_logprobs = self._prompt_logprobs(hidden, inputs)
            if len(inputs.sample_rows) and drafts is not None:
                self._sample_drafted(hidden, inputs, step, scheduler_output, drafts)
            elif len(inputs.sample_rows):
                self._sample(hidden, inputs, step, scheduler_output)
        return step

    def _forward_with_embeds(self, inputs: StepInputs, given: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The model on input embeddings: its own embeddings of the step's tokens, with the given
        rows of prompts that came as embeddings in their places (vLLM's splice)."""
        input_ids, positions = self._padded_to_bucket(inputs.input_ids, inputs.positions)
        embeds = self.model.embed_input_ids(input_ids)
        indices, rows = given
        indices, rows, width = indices.to(self.device), rows.to(self.device, embeds.dtype), embeds.shape[-1]
        embeds[indices] = rows[:, :width]
        if rows.shape[-1] == width:
            return self.model(input_ids, positions, self.kv_caches, inputs.attn_metadata, inputs_embeds=embeds,
                              **self._recurrent_kwargs(inputs))
        # (Qwen3-VL: an image feature's DeepStack additions follow its input embedding)
        deepstack = rows[:, width:].unflatten(-1, (-1, width)).transpose(0, 1)
        return self.model(input_ids, positions, self.kv_caches, inputs.attn_metadata, inputs_embeds=embeds,
                          deepstack=(indices, deepstack))

    # ---- speculative decoding ----
    def _place_drafts(self, drafts: dict[str, np.ndarray]) -> np.ndarray | None:
        """A step's draft tokens written after their rows' known tokens (the step's input ids
        read them there; they do not count as known). Returns each batch row's number of drafts
        (None in a step without any)."""
        if not drafts:
            return None
        batch = self.input_batch
        counts = np.zeros(batch.num_reqs, dtype=np.int64)
        for req_id, draft in drafts.items():
            row = batch.req_id_to_index.get(req_id)
            if row is not None:  # (not one that failed to join)
                start = int(batch.num_tokens[row])
                batch.token_ids[row, start:start + len(draft)] = draft
                counts[row] = len(draft)
        return counts

    def _sample_drafted(self, hidden: torch.Tensor, inputs: StepInputs, step: LaunchedStep,
                        sched: SchedulerOutput, drafts: np.ndarray) -> None:
        """A step with drafts: each sampling row samples at its token's position and at each of
        its drafts' (the same request's sampling, one logits row each), and keeps its drafts up to
        the first its samples differ from, then that sample (or, all kept, the one after the
        last). With a draft that is one token for sure (n-gram drafts), this draws exactly what
        rejection sampling draws: the draft with the model's probability of it, else a token from
        the model's distribution without it; greedy rows keep the argmax."""
        rows = inputs.sample_rows
        positions = np.searchsorted(inputs.rows, rows)
        num_positions = 1 + drafts[rows]
        ends = inputs.query_starts[positions] + inputs.query_lens[positions]
        logits_rows = np.repeat(rows, num_positions)
        hidden_index = np.repeat(ends - num_positions, num_positions) + segment_offsets(num_positions)
        logits = self.model.compute_logits(hidden[self._to_device(hidden_index.astype(np.int64))])
        self.logits_width = logits.shape[-1]

        def metadata_of(rows: np.ndarray, num_positions: np.ndarray) -> SamplingMetadata:
            return self._build_sampling_metadata(np.repeat(rows, num_positions), self.logits_width,
                                                 self._preceding_drafts(rows, num_positions),
                                                 segment_offsets(num_positions))

        try:
            metadata = metadata_of(rows, num_positions)
        except Exception:
            _, failed = self._sampling_metadata_without_culprits(logits_rows, self.logits_width)
            step.output.failed = {**(step.output.failed or {}), **failed}
            req_ids = self.input_batch.req_ids
            kept = np.array([req_ids[row] not in failed for row in logits_rows.tolist()], dtype=bool)
            logits, logits_rows = logits[self._to_device(np.flatnonzero(kept))], logits_rows[kept]
            kept_rows = np.array([req_ids[row] not in failed for row in rows.tolist()], dtype=bool)
            self._append_sampled(rows[~kept_rows], np.zeros(int((~kept_rows).sum()), dtype=np.int32))
            rows, num_positions = rows[kept_rows], num_positions[kept_rows]
            if len(rows) == 0:
                return
            metadata = metadata_of(rows, num_positions)
        every_planned_row = not (step.output.failed or self.dropped_failed)
        sampled = self.sampler(logits, metadata, self._grammar_bitmask(sched, logits_rows, every_planned_row))
        self._keep_drafts(rows, num_positions, sampled.sampled_token_ids.cpu().numpy(), step.output)
        if sampled.logprobs is not None:
            self._kept_logprobs(sampled, logits_rows, num_positions, step.output)
        if sampled.emptied_rows is not None:
            self._fail_emptied_kept(logits_rows, segment_offsets(num_positions), sampled.emptied_rows, step.output)

    def _fail_emptied_kept(self, logits_rows: np.ndarray, positions: np.ndarray, emptied: np.ndarray,
                           output: ModelRunnerOutput) -> None:
        """With drafts: a request fails when a position it kept (its drafts before it all
        accepted) had nothing left to sample; an emptied position after a rejected draft is one
        the request never reaches."""
        rows = logits_rows[emptied]
        reached = positions[emptied] < output.num_sampled[rows]
        if not reached.any():
            return
        req_ids = self.input_batch.req_ids
        failed_rows = np.unique(rows[reached])
        output.failed = {**(output.failed or {}), **{req_ids[row]: EMPTIED_ROW for row in failed_rows.tolist()}}
        output.num_sampled[failed_rows] = 0

    @staticmethod
    def _kept_logprobs(sampled: SamplerOutput, logits_rows: np.ndarray, num_positions: np.ndarray,
                       output: ModelRunnerOutput) -> None:
        """The logprobs of each asking row's kept tokens: its first token's as every step's
        (`output.logprobs`, by batch row), the others' in `output.more_logprobs`."""
        arrays = sampled.logprobs.to_numpy()
        asked = np.arange(len(logits_rows)) if sampled.logprobs_rows is None else np.asarray(sampled.logprobs_rows)
        asked_rows, asked_positions = logits_rows[asked], segment_offsets(num_positions)[asked]
        first = asked_positions == 0
        output.logprobs = scatter_rows(arrays.take_rows(first), asked_rows[first], len(output.num_sampled))
        more = (asked_positions > 0) & (asked_positions < output.num_sampled[asked_rows])
        if more.any():
            output.more_logprobs = arrays.take_rows(more)
            output.more_logprobs_at = np.stack([asked_rows[more], asked_positions[more]], axis=1).astype(np.int32)

    def _preceding_drafts(self, rows: np.ndarray, num_positions: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """For the penalties: the drafts before each draft position of the penalized rows, as
        (logits row, token) pairs (position j of a row has its first j drafts as outputs
        beyond its history); None when no drafting row is penalized."""
        batch = self.input_batch
        drafting = (num_positions > 1) & penalized(batch, rows)
        if not drafting.any():
            return None
        starts = np.cumsum(num_positions) - num_positions
        logits_rows, tokens = [], []
        for row, start, n in zip(rows[drafting].tolist(), starts[drafting].tolist(), num_positions[drafting].tolist()):
            num_tokens = int(batch.num_tokens[row])
            draft = batch.token_ids[row, num_tokens:num_tokens + n - 1]
            before = np.arange(1, n)  # position j has j drafts before it
            logits_rows.append(np.repeat(start + before, before))
            tokens.append(draft[segment_offsets(before)])
        return np.concatenate(logits_rows), np.concatenate(tokens)

    def _keep_drafts(self, rows: np.ndarray, num_positions: np.ndarray, samples: np.ndarray,
                     output: ModelRunnerOutput) -> None:
        """Each row's kept tokens (its drafts up to the first its samples differ from, then that
        sample) into the batch and the step's output."""
        batch = self.input_batch
        starts = np.cumsum(num_positions) - num_positions
        single = num_positions == 1
        if single.any():
            plain, firsts = rows[single], samples[starts[single]].astype(np.int32)
            self._append_sampled(plain, firsts)
            output.sampled_token_ids[plain, 0] = firsts
            output.num_sampled[plain] = 1
        for row, start, n in zip(rows[~single].tolist(), starts[~single].tolist(), num_positions[~single].tolist()):
            num_tokens = int(batch.num_tokens[row])
            drafted = batch.token_ids[row, num_tokens:num_tokens + n - 1]
            own = samples[start:start + n]
            differs = np.flatnonzero(own[:n - 1] != drafted)
            kept = own[:(int(differs[0]) if len(differs) else n - 1) + 1].astype(np.int32)
            batch.token_ids[row, num_tokens:num_tokens + len(kept)] = kept
            batch.num_tokens[row] = num_tokens + len(kept)
            batch.last_token_ids[row] = kept[-1]
            output.sampled_token_ids[row, :len(kept)] = kept
            output.num_sampled[row] = len(kept)

    def _padded_to_bucket(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where `_pads_steps` (CPU), the step's tokens padded (token 0 at position 0) to
        `bucket_rows` (matmul_rows.py): every linear layer then takes its rows as they are,
        instead of padding its own input (a copy per matmul: ~5% of the engine core under served
        traffic, where most steps are no bucket size). The attention leaves the padded rows out;
        the hidden states come back with them (the step's rows first)."""
        if not self._pads_steps:
            return input_ids, positions
        rows = input_ids.shape[0]
        padded = bucket_rows(rows)
        if padded == rows:
            return input_ids, positions
        return F.pad(input_ids, (0, padded - rows)), F.pad(positions, (0, padded - rows))

    def _pool(self, hidden: torch.Tensor, inputs: StepInputs, output: ModelRunnerOutput) -> None:
        """The pooling runner's step: the vectors of the prompts it completes, each counted as
        the request's one output token (token 0, never shown: the engine core finishes the
        request with it, as its max_tokens is 1)."""
        done = np.isin(inputs.rows, inputs.sample_rows, assume_unique=True)
        output.pooled = self.pooler.pool(hidden, self.input_batch, inputs.rows, inputs.query_starts,
                                         inputs.query_lens, done) or None
        if len(inputs.sample_rows):
            self._append_sampled(inputs.sample_rows, np.zeros(len(inputs.sample_rows), dtype=np.int32))
            output.num_sampled[inputs.sample_rows] = 1

    def finish(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Waits for the step's sampled tokens, writes them into the batch (where their requests
        still are) and the output."""
        output, sampled = step.output, step.sampled
        if sampled is not None:
            if sampled.copied is not None:
                sampled.copied.synchronize()
            self._take_sampled(sampled, sampled.host.numpy(), output)
            if self.custom_logits is not None:
                self.custom_logits.append_sampled(sampled.req_ids, sampled.host.numpy())
            output.every_row_sampled = len(sampled.rows) == len(output.num_sampled)
            if self.unfinished is sampled:
                self.unfinished = None
        if step.logprobs is not None:
            output.logprobs = scatter_rows(step.logprobs.to_numpy(), step.logprobs_rows, len(output.num_sampled))
        if step.drafter_states is not None:
            self.drafter.consume(self.input_batch, step.drafter_states)
        return output

    def needs_sampled_tokens_on_host(self) -> bool:
        """Whether the next step must not be launched before the last one is finished: the
        penalties count a row's whole history from the batch's host copy (TokenOccurrences), and
        bad words match the end of a row's output there; it holds the last sampled tokens only
        once that step is finished. Custom logits processors read their requests' output lists,
        which `finish` appends to. A drafter reads the last step's tokens (and EAGLE / Medusa heads
        its states, in `finish`) before it drafts the next."""
        batch, live = self.input_batch, slice(0, self.input_batch.num_reqs)
        return bool(self.custom_logits is not None or self.drafter is not None or penalized(batch, live).any()
                    or batch.has_bad_words[live].any())

    def _set_step_threads(self, num_tokens: int) -> None:
        threads = 1 if self._small_steps_on_one_thread and num_tokens <= ONE_THREAD_MAX_TOKENS else self.num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs, step: LaunchedStep, sched: SchedulerOutput) -> None:
        output = step.output
        rows = inputs.sample_rows
        sampling_hidden = hidden[:len(rows)] if inputs.every_token_samples else hidden[inputs.logits_indices]
        # Every sampling row's logits (under TP a collective: the same rows on every rank); the
        # first step that samples computes them whatever it asks, to learn their width.
        logits = None
        if self.logits_width is None:
            logits = self.model.compute_logits(sampling_hidden)
            self.logits_width = logits.shape[-1]
        vocab_size = self.logits_width
        metadata, failed = self._sampling_metadata_for(rows, vocab_size)
        custom = self._custom_logits_for(rows)
        if (logits is None and not failed and sched.grammar_bitmask is None
                and self.sampler.takes_argmax_only(metadata, custom)):
            tokens = self.model.compute_greedy_tokens(sampling_hidden)
            if tokens is not None:  # the LM head's argmax without the logits (one rank, CPU fp32)
                step.sampled = self._count_sampled(rows, tokens)
                self.unfinished = step.sampled
                return
        if logits is None:
            logits = self.model.compute_logits(sampling_hidden)
        if failed:  # those rows sample nothing; their requests fail (this rank's choice alone)
            output.failed = {**(output.failed or {}), **failed}
            kept = self._leave_out_failed(rows, failed)
            rows = rows[kept]
            logits = logits.index_select(0, self._to_device(np.flatnonzero(kept)))
            if len(rows) == 0:
                return
            custom = self._custom_logits_for(rows)
        every_planned_row = not (output.failed or self.dropped_failed)
        try:
            sampled = self.sampler(logits, metadata, self._grammar_bitmask(sched, rows, every_planned_row), custom)
        except Exception:
            if self.tp.size > 1:  # a probe would need fresh logits: a collective only this rank enters
                raise
            failed = self._probe_sampling(hidden, inputs, rows, sched, vocab_size)
            if not failed:
                raise  # no row fails alone: the batch's failure
            output.failed = {**(output.failed or {}), **failed}
            rows = rows[self._leave_out_failed(rows, failed)]
            if len(rows) == 0:
                return
            sampled = self._sample_rows(hidden, inputs, rows, sched, vocab_size)
        if sampled.logprobs is not None:
            step.logprobs = sampled.logprobs
            step.logprobs_rows = rows if sampled.logprobs_rows is None else rows[sampled.logprobs_rows]
        tokens = sampled.sampled_token_ids
        if sampled.emptied_rows is not None:
            rows, tokens = self._leave_out_emptied(output, rows, tokens, sampled.emptied_rows)
            if len(rows) == 0:
                return
        step.sampled = self._count_sampled(rows, tokens)
        self.unfinished = step.sampled

    def _leave_out_emptied(self, output: ModelRunnerOutput, rows: np.ndarray, tokens: torch.Tensor,
                           emptied: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """The sampling rows (and their tokens) left once the rows whose constraints left nothing
        to sample (`emptied`, indices into `rows`) are failed: their draws are void. As for a row
        failed before sampling, each gets token 0 in the batch (`_leave_out_failed`)."""
        req_ids = self.input_batch.req_ids
        failed = {req_ids[row]: EMPTIED_ROW for row in rows[emptied].tolist()}
        output.failed = {**(output.failed or {}), **failed}
        kept = self._leave_out_failed(rows, failed)
        return rows[kept], tokens.index_select(0, self._to_device(np.flatnonzero(kept)))

    def _count_sampled(self, rows: np.ndarray, tokens: torch.Tensor) -> SampledTokens:
        """The batch counts the tokens sampled for `rows` now; their values follow in `finish`.
        On a GPU the copy to the host is queued behind the step's work, not waited for."""
        batch = self.input_batch
        positions, serials = self._count_rows(rows)
        if tokens.dtype != torch.int64:
            tokens = tokens.long()
        host, copied = tokens, None  # (on CPU: no conversion, a torch call that costs tens of us here)
        if tokens.device.type == "cuda":
            host = torch.empty(len(rows), dtype=torch.int32, pin_memory=True)
            host.copy_(tokens.to(torch.int32), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        req_ids = batch.live_req_ids if len(rows) == batch.num_reqs else [batch.req_ids[row] for row in rows.tolist()]
        return SampledTokens(rows, req_ids, serials, positions, batch.version, tokens, host, copied)

    def _count_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each of `rows`' position for its sampled token (its `num_tokens`, which moves on by
        one) and its `row_serial`: one C loop (`sampled_count`) where the numpy code takes four
        calls, each tens of us after a forward pass (cold caches)."""
        batch = self.input_batch
        if self.native_loops is not None:
            positions, serials = np.empty(len(rows), dtype=np.int32), np.empty(len(rows), dtype=np.int64)
            self.native_loops.sampled_count(rows, batch.num_tokens, batch.row_serial, positions, serials)
            return positions, serials
        at = batch.row_index(rows)
        positions = batch.num_tokens[at].copy()
        batch.num_tokens[at] += 1
        return positions, batch.row_serial[rows]

    def _take_sampled(self, sampled: SampledTokens, tokens: np.ndarray, output: ModelRunnerOutput) -> None:
        """A finished step's tokens into the batch (`_write_sampled`) and the step's output. In
        one C loop (`sampled_write`) when the rows have not moved and each token is its row's
        last (no step launched since: on CPU, every step)."""
        batch = self.input_batch
        if self.native_loops is not None and batch.version == sampled.batch_version and self.unfinished is sampled:
            self.native_loops.sampled_write(sampled.rows, sampled.positions, tokens, batch.token_ids,
                                            batch.last_token_ids, output.sampled_token_ids, output.num_sampled)
            return
        self._write_sampled(sampled, tokens)
        output.sampled_token_ids[sampled.rows, 0] = tokens
        output.num_sampled[sampled.rows] = 1

    def _write_sampled(self, sampled: SampledTokens, tokens: np.ndarray) -> None:
        """Puts a finished step's tokens where the batch counted them: in the rows of the same
        requests (same joining), wherever the batch has moved them since."""
        batch = self.input_batch
        rows, positions = sampled.rows, sampled.positions
        at: slice | np.ndarray = batch.row_index(rows)
        if batch.version != sampled.batch_version:  # (the rows are then in no particular order)
            now = self._rows_now(sampled)
            kept = now >= 0
            if not kept.all():
                now, positions, tokens = now[kept], positions[kept], tokens[kept]
            rows = at = now
        batch.token_ids[rows, positions] = tokens
        if self.unfinished is sampled:  # no step launched since (CPU: always): each token is its row's last
            batch.last_token_ids[at] = tokens
            return
        last = positions == batch.num_tokens[at] - 1  # (not where a later launched step sampled)
        if last.all():
            batch.last_token_ids[at] = tokens
        else:
            batch.last_token_ids[rows[last]] = tokens[last]

    def _rows_now(self, sampled: SampledTokens) -> np.ndarray:
        """The batch row now holding each of `sampled`'s requests (the same joining), else -1."""
        batch = self.input_batch
        if batch.version == sampled.batch_version:
            return sampled.rows
        index = batch.req_id_to_index
        now = np.fromiter(map(index.get, sampled.req_ids, itertools.repeat(-1)), np.int64, len(sampled.req_ids))
        present = now >= 0
        now[present & (batch.row_serial[np.maximum(now, 0)] != sampled.serials)] = -1
        return now

    def _leave_out_failed(self, rows: np.ndarray, failed: dict[str, str]) -> np.ndarray:
        """Which of the sampling `rows` go on (a bool mask). A failed row gets token 0 instead of
        a sampled one: its request is failed, but a step scheduled before the engine core knew
        (async scheduling) still runs it, and there the row must read a valid token and sample
        as on the ranks where it did not fail (under TP, every rank samples the same rows)."""
        req_ids = self.input_batch.req_ids
        kept = np.array([req_ids[row] not in failed for row in rows.tolist()], dtype=bool)
        self._append_sampled(rows[~kept], np.zeros(int((~kept).sum()), dtype=np.int32))
        return kept

    def _sample_rows(self, hidden: torch.Tensor, inputs: StepInputs, rows: np.ndarray,
                     sched: SchedulerOutput, vocab_size: int) -> SamplerOutput:
        """Sample `rows` (some of the step's sampling rows) on their own, from fresh logits."""
        positions = np.searchsorted(inputs.sample_rows, rows)
        logits = self.model.compute_logits(hidden[inputs.logits_indices[self._to_device(positions.astype(np.int64))]])
        return self.sampler(logits, self._build_sampling_metadata(rows, vocab_size),
                            self._grammar_bitmask(sched, rows, every_planned_row=False), self._custom_logits_for(rows))

    def _custom_logits_for(self, rows: np.ndarray) -> CustomLogitsStep | None:
        if self.custom_logits is None:
            return None
        return self.custom_logits.for_rows(rows, self.input_batch.num_reqs, self.device)

    def _probe_sampling(self, hidden: torch.Tensor, inputs: StepInputs, rows: np.ndarray,
                        sched: SchedulerOutput, vocab_size: int) -> dict[str, str] | None:
        """The batched sampler raised (one rank): sample each row alone to find the rows that
        fail by themselves. The default generator's state is put back after each probe, so the
        rows sampled afterwards draw what they would have drawn (seeded rows draw by position:
        seeded_draws.py)."""
        batch = self.input_batch
        saved = self._random_state()

        def probe(row: int) -> None:
            try:
                self._sample_rows(hidden, inputs, np.array([row]), sched, vocab_size)
            finally:
                self._set_random_state(saved)

        return self._rank_named(run_each_contained(rows.tolist(), probe, lambda row: batch.req_ids[row],
                                                   self._where("while being sampled")))

    def _random_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set_random_state(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    # ---- persistent batch upkeep ----
    def _update_states(self, sched: SchedulerOutput) -> dict[str, str] | None:
        """Returns the requests that could not be taken into (or kept up to date in) the batch,
        on any rank: they are left out of this step on every rank."""
        batch = self.input_batch
        # Removal order does not matter: a new request takes the lowest free row (InputBatch), so
        # every tensor-parallel rank lays its batch out alike whatever its set order (hash seed).
        for req_id in sched.finished_req_ids:
            self._drop_request(req_id)
        if self.dropped_failed:
            self.dropped_failed.difference_update(sched.finished_req_ids)
        for req_id in sched.preempted_req_ids:
            row = batch.remove_request(req_id)
            if self.custom_logits is not None and row is not None:
                self.custom_logits.removed(row, req_id)
            self.token_occurrences.release(req_id)  # rebuilt from its history when it returns
            self.prompt_embeds.forget(req_id)  # (back with the request)
            if self.mrope is not None:
                self.mrope.forget(req_id)
        new_reqs = sched.scheduled_new_reqs
        failed = (run_each_contained(new_reqs, self._add_one, _new_req_id, self._where("while joining the batch"))
                  if new_reqs else None)
        cached = sched.scheduled_cached_reqs
        failed_cached = self._update_cached(cached) if cached.req_ids else None
        if failed_cached:
            failed = {**(failed or {}), **failed_cached}
        failed = self._agree_on_failures(self._rank_named(failed), bool(new_reqs))
        for req_id in failed or ():
            self._drop_request(req_id)
            self.dropped_failed.add(req_id)
        batch.condense()
        return failed

    def _agree_on_failures(self, failed: dict[str, str] | None, has_new_reqs: bool) -> dict[str, str] | None:
        """Under TP, the requests left out of the forward pass must be the same on every rank.
        The ranks agree (one small collective) only in steps that add requests, where joining
        can fail; a decode step stays free of it, and a row update failing there on a rank is
        that rank's failure (the engine stops, the rank named)."""
        if self.tp.size == 1:
            return failed
        if has_new_reqs:
            return self.tp.union_of_failures(failed)
        if failed:
            raise RuntimeError(f"the rows of {sorted(failed)} could not be updated on rank {self.tp.rank} "
                               f"in a step without new requests: {failed}")
        return None

    def _update_cached(self, cached: CachedRequestData) -> dict[str, str] | None:
        """Every decode step runs this for every running request: their counters in one array
        assignment, their new blocks in another. A request missing from the batch, or an update
        the batch cannot take, sends the step to `_update_cached_each`, which tells whose
        update failed."""
        rows, at = self._batch_rows(cached.req_ids)
        if isinstance(at, np.ndarray) and int(rows.min()) < 0:
            return self._update_cached_each(cached)
        batch = self.input_batch
        try:
            batch.num_computed_tokens[at] = cached.num_computed_tokens
            if len(cached.new_block_ids):  # (most decode steps: no request takes a block)
                batch.block_table.append_rows(rows, cached.num_new_blocks, cached.new_block_ids)
        except Exception:  # (append_rows writes every row or none; the counters are written again)
            return self._update_cached_each(cached)
        return None

    def _update_cached_each(self, cached: CachedRequestData) -> dict[str, str] | None:
        """`_update_cached` one request at a time, each in its own `try`."""
        batch = self.input_batch
        index, block_table, num_computed_tokens = batch.req_id_to_index, batch.block_table, batch.num_computed_tokens
        failed: dict[str, str] | None = None
        for req_id, new_block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids_of_each(),
                                                       cached.num_computed_tokens):
            try:
                row = index[req_id]
                block_table.append_row(row, new_block_ids)
                num_computed_tokens[row] = num_computed
            except Exception as exc:  # this request's alone
                if req_id in self.dropped_failed and req_id not in index:
                    continue  # it failed in an earlier step; async scheduling ran ahead of the news
                failed = self._row_update_failed(failed, req_id, exc)
        return failed

    def _row_update_failed(self, failed: dict[str, str] | None, req_id: str, exc: Exception) -> dict[str, str]:
        logger.exception("request %r failed %s", req_id, self._where("while updating its row"))
        failed = failed or {}
        failed[req_id] = describe_error(exc)
        return failed

    def _batch_rows(self, req_ids: list[str]) -> tuple[np.ndarray, slice | np.ndarray]:
        """The batch row of each of `req_ids` (-1 for one not in the batch), and the same as an
        index: a slice when they are rows 0..n-1 in order (read and written without a gather).
        Kept while the batch keeps its rows and the ids are the same (steady decode): one
        comparison of the id lists then, instead of a lookup per request."""
        version = self.input_batch.version
        cached = self._rows_cache
        if cached is not None and cached[0] == version and (cached[1] is req_ids or cached[1] == req_ids):
            return cached[2], cached[3]
        row_of = self.input_batch.req_id_to_index
        rows = np.fromiter(map(row_of.get, req_ids, itertools.repeat(-1)), np.int64, len(req_ids))
        rows.flags.writeable = False  # kept for later steps
        index = slice(0, len(rows)) if np.array_equal(rows, np.arange(len(rows))) else rows
        self._rows_cache = (version, req_ids, rows, index)  # (a step's ids are never changed once sent)
        return rows, index

    def _where(self, what: str) -> str:
        return what if self.tp.size == 1 else f"{what} on rank {self.tp.rank}"

    def _rank_named(self, failed: dict[str, str] | None) -> dict[str, str] | None:
        if not failed or self.tp.size == 1:
            return failed
        return {req_id: f"rank {self.tp.rank}: {why}" for req_id, why in failed.items()}

    def _add_one(self, new: NewRequestData) -> None:
        if new.lora_request is not None:
            batch = self.input_batch
            self.lora.use(new.lora_request, batch.lora_ids[:batch.num_reqs])
        row = self.input_batch.add_request(new)
        if self.custom_logits is not None:
            self.custom_logits.added(row, new)
        self._add_sampling_state(new)
        self.prompt_embeds.add(new, self._image_features)
        if self.mrope is not None:
            self.mrope.add(new)

    def _update_vision_weights(self, weights: list[tuple[str, Any]]) -> set[str]:
        self.encoder_cache.clear()  # (features of the old weights)
        return update_weights(self.image_encoder, self.image_encoder.read_tensors(weights))

    def reset_encoder_cache(self) -> None:
        if self.encoder_cache is not None:
            self.encoder_cache.clear()

    def _image_features(self, images: ImageInputs, which: np.ndarray) -> list[torch.Tensor]:
        return self.encoder_cache.features(images, which, self._encode_images)

    def _encode_images(self, images: ImageInputs, which: np.ndarray) -> list[torch.Tensor]:
        """The input embeddings [tokens, width] of each image `which` names."""
        pixels = torch.from_numpy(images.pixel_values[which]).to(self.device)
        with torch.inference_mode():
            if images.patch_grids is not None:  # (Qwen2-VL)
                return self.image_encoder(pixels, images.patch_grids[which].tolist())
            sizes = images.image_sizes[which].tolist() if images.image_sizes is not None else None
            return self.image_encoder(pixels, sizes, alone=len(images.offsets) == 1)

    def _drop_request(self, req_id: str) -> None:
        row = self.input_batch.remove_request(req_id)
        if self.custom_logits is not None and row is not None:
            self.custom_logits.removed(row, req_id)
        self.min_tokens_stop_ids.pop(req_id, None)
        self.token_occurrences.release(req_id)
        self.prompt_embeds.forget(req_id)
        if self.mrope is not None:
            self.mrope.forget(req_id)
        if self.pooler is not None:
            self.pooler.release(req_id)

    def _add_sampling_state(self, new: NewRequestData) -> None:
        params = new.sampling_params
        if params.min_tokens > 0:
            self.min_tokens_stop_ids[new.req_id] = tuple(set(new.eos_token_ids) | set(params.stop_token_ids or ()))

    # ---- inputs ----
    def _prepare_inputs(self, sched: SchedulerOutput, drafts: np.ndarray | None = None) -> StepInputs | None:
        """None when no scheduled request is in the batch (every one failed). `drafts`: each
        batch row's draft tokens this step (`_place_drafts`), None without any."""
        batch = self.input_batch
        step = self._scheduled_rows(sched.num_scheduled_tokens)
        if step is None:
            return None
        rows, query_lens, cu_lens = step.rows, step.query_lens, step.cu_lens
        at = batch.row_index(rows)
        total = int(cu_lens[-1])
        if (total == len(rows) and isinstance(at, slice) and self.unfinished is None and self.native_loops is not None
                and not self.mrope):
            inputs = self._decode_step_inputs(step)
            if inputs is not None:
                return inputs
        if total == len(rows):  # one token per row (a decode step): each row's next position
            token_rows, positions = rows, batch.num_computed_tokens[at]
            seq_lens = positions + 1
        else:
            token_rows = np.repeat(rows, query_lens)
            offsets = segment_offsets(query_lens)
            positions = batch.num_computed_tokens[token_rows] + offsets
            seq_lens = batch.num_computed_tokens[at] + query_lens
        # Rows whose known tokens (and drafts) are all computed after this step produce a new token.
        samples = seq_lens == batch.num_tokens[at] + (0 if drafts is None else drafts[at])
        every_row_samples = bool(samples.all())
        every_token_samples = total == len(rows) and every_row_samples  # every row computes its last token
        if every_token_samples:
            input_ids = batch.last_token_ids[at]
        else:
            input_ids = batch.token_ids[token_rows, positions]
        block_ids = batch.block_table.block_ids
        slot_mapping = batch.block_table.slot_mapping(token_rows, positions, self.block_size)
        max_blocks = -(-int(seq_lens.max()) // self.block_size)
        put = self.step_inputs.put
        common = CommonAttentionMetadata(
            query_start_loc=put("query_start_loc", step.query_start_loc),
            seq_lens=put("seq_lens", seq_lens),
            block_table=put("block_table", block_ids[at, :max_blocks]),
            slot_mapping=put("slot_mapping", slot_mapping),
            query_start_loc_np=step.query_start_loc,
            seq_lens_np=seq_lens,
            num_actual_tokens=total,
            max_query_len=step.max_query_len,
            block_size=self.block_size,
            key_ends_np=(self.prompt_embeds.key_ends(batch, rows, step.query_starts, query_lens, positions)
                         if self.prompt_embeds else None),
        )
        return StepInputs(
            input_ids=self._input_ids(input_ids, rows, query_lens, cu_lens),
            positions=self._rope_positions(positions, rows, step.query_starts, query_lens),
            attn_metadata=self.attn_backend.build(common),
            logits_indices=put("logits_indices", step.last_tokens if every_row_samples else cu_lens[samples] - 1,
                               np.int64),
            sample_rows=rows if every_row_samples else rows[samples],
            every_token_samples=every_token_samples,
            rows=rows,
            query_starts=step.query_starts,
            query_lens=query_lens,
        )

    def _rope_positions(self, positions: np.ndarray, rows: np.ndarray, query_starts: np.ndarray,
                        query_lens: np.ndarray) -> torch.Tensor:
        """The positions the model's rotary layers turn tokens by: their places in their
        sequences, but Qwen2-VL's multimodal ones for requests with images ([3, tokens] where an
        image's placeholders are in the step)."""
        if self.mrope:
            positions = self.mrope.step_positions(self.input_batch, rows, query_starts, query_lens, positions)
            if positions.ndim == 2:
                return self.step_inputs.put("mrope_positions", positions)
        return self.step_inputs.put("positions", positions, np.int64)

    def _decode_step_inputs(self, step: StepRows) -> StepInputs | None:
        """`_prepare_inputs` for the steady decode step (every live row computes one token, its
        last, and no launched step's tokens are pending): positions, sequence lengths, KV slots,
        input ids and block table made by two C loops in the kept input arrays, where the general
        path's numpy calls over every row (a dozen) cost more than their arithmetic. None when
        some row's token is not its last."""
        batch, buffers, block_size, native = self.input_batch, self.step_inputs, self.block_size, self.native_loops
        n = len(step.rows)
        block_ids = batch.block_table.block_ids
        seq_lens = buffers.host("seq_lens", (n,), np.int32)
        longest = native.decode_inputs(batch.num_computed_tokens, batch.num_tokens, batch.last_token_ids, block_ids,
                                       block_size, buffers.host("positions", (n,), np.int64), seq_lens,
                                       buffers.host("slot_mapping", (n,), np.int64),
                                       buffers.host("input_ids", (n,), np.int64))
        if longest < 0:
            return None
        native.copy_block_rows(block_ids, buffers.host("block_table", (n, -(-longest // block_size)), np.int32))
        common = CommonAttentionMetadata(
            query_start_loc=buffers.put("query_start_loc", step.query_start_loc),
            seq_lens=buffers.tensor("seq_lens"),
            block_table=buffers.tensor("block_table"),
            slot_mapping=buffers.tensor("slot_mapping"),
            query_start_loc_np=step.query_start_loc,
            seq_lens_np=seq_lens,
            num_actual_tokens=n,
            max_query_len=1,
            block_size=block_size,
        )
        return StepInputs(
            input_ids=buffers.tensor("input_ids"),
            positions=buffers.tensor("positions"),
            attn_metadata=self.attn_backend.build(common),
            logits_indices=buffers.put("logits_indices", step.last_tokens, np.int64),
            sample_rows=step.rows,
            every_token_samples=True,
            rows=step.rows,
            query_starts=step.query_starts,
            query_lens=step.query_lens,
        )

    def _input_ids(self, input_ids: np.ndarray, rows: np.ndarray, query_lens: np.ndarray,
                   cu_lens: np.ndarray) -> torch.Tensor:
        """The step's input ids on the device. The tokens the last step sampled, when that step is
        not finished yet, are read from the device where it sampled them (the host's copy of
        those positions is not written yet)."""
        sampled = self.unfinished
        if sampled is None:
            return self.step_inputs.put("input_ids", input_ids, np.int64)
        batch = self.input_batch
        now = self._rows_now(sampled)
        step_index = np.full(batch.num_reqs + 1, -1, dtype=np.int64)  # the last: rows gone (-1)
        step_index[rows] = np.arange(len(rows))
        k = step_index[now]
        offsets = sampled.positions - batch.num_computed_tokens[now]
        fed = (k >= 0) & (offsets >= 0) & (offsets < query_lens[k])
        flat = (cu_lens - query_lens)[k] + offsets
        if len(flat) == len(input_ids) and fed.all() and np.array_equal(flat, np.arange(len(flat))):
            return sampled.tokens  # a steady decode step: every input is a token just sampled
        ids = self.step_inputs.put("input_ids", input_ids, np.int64)
        if fed.any():
            fed_at = np.flatnonzero(fed)
            ids[self._to_device(flat[fed_at])] = sampled.tokens[self._to_device(fed_at)]
        return ids

    def _scheduled_rows(self, scheduled: dict[str, int]) -> StepRows | None:
        """The batch rows the step computes and what follows from their query lengths; None
        when no scheduled request is in the batch (every one failed). Kept while the batch
        keeps its rows and the scheduler hands over the very same counts (the dict it keeps
        for its steady decode steps)."""
        version = self.input_batch.version
        kept = self._step_rows_cache
        if kept is not None and kept[0] == version and kept[1] is scheduled:
            return kept[2]
        counts = np.fromiter(scheduled.values(), np.int32, len(scheduled))
        scheduled_rows, _ = self._batch_rows(list(scheduled))
        if int(scheduled_rows.min()) < 0:  # some failed to join the batch (this step or, async, the last)
            present = scheduled_rows >= 0
            scheduled_rows, counts = scheduled_rows[present], counts[present]
        num_scheduled = np.zeros(self.input_batch.num_reqs, dtype=np.int32)
        num_scheduled[scheduled_rows] = counts
        rows = np.flatnonzero(num_scheduled)
        step_rows = StepRows.of(rows, num_scheduled[rows]) if len(rows) else None
        self._step_rows_cache = (version, scheduled, step_rows)
        return step_rows

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return host_to_device(array, self.device)

    # ---- sampling ----
    def _sampling_metadata_for(self, rows: np.ndarray, vocab_size: int) -> tuple[SamplingMetadata, dict[str, str] | None]:
        """Cached while the batch is unchanged and the same rows sample (steady decode). When
        the batch's metadata cannot be built, the rows whose own metadata fails are found and
        returned as failed; the metadata is then for the other rows (and not cached)."""
        key = (self.input_batch.version, len(rows))
        if self._sampling_metadata is not None and key == self._sampling_key and len(rows) == self.input_batch.num_reqs:
            return self._sampling_metadata, None
        try:
            metadata = self._build_sampling_metadata(rows, vocab_size)
        except Exception:
            return self._sampling_metadata_without_culprits(rows, vocab_size)
        self._sampling_metadata, self._sampling_key = metadata, key
        return metadata, None

    def _build_sampling_metadata(self, rows: np.ndarray, vocab_size: int,
                                 preceding: tuple[np.ndarray, np.ndarray] | None = None,
                                 draft_positions: np.ndarray | None = None) -> SamplingMetadata:
        return build_sampling_metadata(self.input_batch, rows, self.min_tokens_stop_ids,
                                       self.device, self.token_occurrences, vocab_size, preceding, draft_positions)

    def _sampling_metadata_without_culprits(self, rows: np.ndarray, vocab_size: int
                                            ) -> tuple[SamplingMetadata, dict[str, str] | None]:
        """Each row's metadata alone, to find the rows that fail; then the others' together (a
        failure there is no single request's: it propagates)."""
        batch = self.input_batch
        failed = run_each_contained(rows.tolist(), lambda row: self._build_sampling_metadata(np.array([row]), vocab_size),
                                    lambda row: batch.req_ids[row], self._where("while building its sampling metadata"))
        failed = self._rank_named(failed) or {}
        kept = rows[[batch.req_ids[row] not in failed for row in rows.tolist()]]
        self._sampling_metadata, self._sampling_key = None, (-1, -1)
        return self._build_sampling_metadata(kept, vocab_size), failed

    def _grammar_bitmask(self, sched: SchedulerOutput, sample_rows: np.ndarray,
                         every_planned_row: bool = True) -> GrammarBitmask | None:
        """The scheduler's bitmask rows, placed at the logits rows of their requests
        (`sample_rows` is ascending). When not every row the scheduler planned samples
        (`every_planned_row` False: some requests failed this step, or a probe), the bitmask rows
        of the absent ones are left out."""
        if sched.grammar_bitmask is None:
            return None
        index = self.input_batch.req_id_to_index
        req_ids, bitmask = sched.structured_output_req_ids, sched.grammar_bitmask
        batch_rows = np.array([index.get(r, -1) for r in req_ids])
        # A request's k-th row (speculative decoding: its id repeated, a row per position) is
        # its k-th logits row (a row's positions are consecutive in `sample_rows`).
        position: np.ndarray | int = 0
        if sched.scheduled_spec_decode_tokens:
            first: dict[str, int] = {}
            position = np.array([i - first.setdefault(r, i) for i, r in enumerate(req_ids)])
        logits_rows = np.minimum(np.searchsorted(sample_rows, batch_rows) + position, len(sample_rows) - 1)
        present = sample_rows[logits_rows] == batch_rows
        if not present.all():
            assert not every_planned_row, "a constrained request does not sample"
            if not present.any():
                return None
            logits_rows, bitmask = logits_rows[present], bitmask[present]
        return GrammarBitmask(self._to_device(logits_rows.astype(np.int64)), torch.from_numpy(_writable(bitmask)))

    def _append_sampled(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """`rows`: distinct batch rows, ascending (all of them, 0..num_reqs-1, in a steady decode step)."""
        batch = self.input_batch
        at = batch.row_index(rows)
        batch.token_ids[rows, batch.num_tokens[at]] = tokens
        batch.last_token_ids[at] = tokens
        batch.num_tokens[at] += 1

    # ---- prompt logprobs ----
    def _prompt_logprobs(self, hidden: torch.Tensor,
                         inputs: StepInputs) -> dict[str, tuple[int, LogprobsArrays]] | None:
        """Logprobs of each prompt token given its prefix, for the prompt positions this step
        computes. Hidden state at position p predicts token p + 1, so positions run up to
        num_prompt_tokens - 2; a recomputed chunk (after preemption) yields the same rows again."""
        batch = self.input_batch
        if not batch.num_prompt_logprob_rows:
            return None
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
        offsets = segment_offsets(counts)
        hidden_index = np.repeat(inputs.query_starts[wanted], counts) + offsets
        targets = batch.token_ids[np.repeat(rows[wanted], counts), np.repeat(starts[wanted], counts) + offsets + 1]
        logprobs = compute_logprobs(self.model.compute_logits(hidden[self._to_device(hidden_index)]))
        k = int(batch.num_prompt_logprobs[rows[wanted]].max())
        arrays = gather_logprobs(logprobs, k, self._to_device(targets.astype(np.int64))).to_numpy()
        return {batch.req_ids[rows[i]]: (int(starts[i]), arrays.slice_rows(first, first + count))
                for i, first, count in zip(wanted.tolist(), firsts.tolist(), counts.tolist())}


def _new_req_id(new: NewRequestData) -> str:
    return new.req_id


def _writable(array: np.ndarray) -> np.ndarray:
    """torch wants writable memory; arrays decoded off the wire are read-only views."""
    return array if array.flags.writeable and array.flags.c_contiguous else np.array(array)
