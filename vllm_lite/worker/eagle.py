"""vLLM's EAGLE speculative decoding (methods "eagle" and "eagle3"), on the worker: an EAGLE head
(model/models/eagle.py) drafts a request's next k tokens greedily from the model's hidden states,
and the step verifies them as any drafts are verified (model_runner.py's draft path).

The head's KV cache sits in the request's blocks beside the model's, as a draft model's does. Its
position p holds what the head read there: the token at p + 1 and the model's states at p. So the
head follows the model step by step: once a step is finished (its sampled tokens known), the head
reads every position the step computed whose next token is known (`consume`: a prompt chunk's
positions, a decode step's kept tokens; rejected drafts are not kept, and the next step writes
over their places), and keeps, for a request whose last known token it read, its output there
(`pending`). The next step's `propose` drafts from those: the first draft from the kept output,
each later one by a pass over the draft before it. A prefix-cache hit leaves the last block out
(the scheduler's `drop_last_hit_block`, vLLM's rule): the head's entry at a hit's last position
was written with the next token of whichever request computed it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import SpeculativeConfig
from vllm_lite.distributed.parallel_state import TensorParallelGroup
from vllm_lite.host_to_device import host_to_device
from vllm_lite.model.loader import load_eagle_head
from vllm_lite.ragged import segment_offsets
from vllm_lite.worker.draft_model import draft_pass_metadata
from vllm_lite.worker.input_batch import InputBatch


@dataclass(slots=True)
class StepStates:
    """What a launched step leaves for a head that reads the model's states (EAGLE, Medusa): those
    states at each of the step's tokens (its final hidden states, or EAGLE-3's aux states), and
    where each row's tokens are."""

    states: torch.Tensor
    rows: np.ndarray  # batch rows, in the step's token order
    req_ids: list[str]  # each row's request at launch
    query_starts: np.ndarray  # each row's first token in `states`
    query_lens: np.ndarray
    starts: np.ndarray  # each row's first position this step (its computed tokens before it)


def positions_read(batch: InputBatch, step: StepStates) -> tuple[np.ndarray, np.ndarray]:
    """For each row of a finished step: how many of the positions it computed have their next
    token known, and whether those reach the position before its last known token (what its
    next drafts start from). The batch's rows are the step's: a step with drafters is finished
    before the next one is launched (`ModelRunner.needs_sampled_tokens_on_host`)."""
    known = batch.num_tokens[step.rows].astype(np.int64)
    lens = np.clip(np.minimum(step.query_lens, known - 1 - step.starts), 0, None)
    return lens, (lens > 0) & (step.starts + lens == known - 1)


@dataclass(slots=True)
class PendingStates:
    """A drafter's states at each request's position before its last known token: what its next
    drafts start from (an EAGLE head's outputs there, or the model's hidden state for Medusa).
    Rows of the tensors in `states`, one per request in `index` (a forgotten request's row stays
    until the next step's states replace them)."""

    states: tuple[torch.Tensor, ...]
    index: dict[str, int]  # request -> row

    @staticmethod
    def empty() -> PendingStates:
        return PendingStates((), {})

    def replaced(self, step_req_ids: list[str], req_ids: list[str], states: tuple[torch.Tensor, ...] | None,
                 device: torch.device) -> PendingStates:
        """A step's requests' rows replaced by `req_ids`' new `states` (the step's other requests
        have none now: not read up to their last token); other requests' rows kept."""
        in_step = set(step_req_ids)
        others = [req_id for req_id in self.index if req_id not in in_step]
        if others:
            kept_at = host_to_device(np.array([self.index[r] for r in others], dtype=np.int64), device)
            kept = tuple(tensor[kept_at] for tensor in self.states)
            states = kept if states is None else tuple(torch.cat(pair) for pair in zip(kept, states))
        ids = others + req_ids
        return PendingStates(states, dict(zip(ids, range(len(ids))))) if ids else PendingStates.empty()

    def drafting_rows(self, batch: InputBatch, counts: np.ndarray,
                      device: torch.device) -> tuple[np.ndarray, tuple[torch.Tensor, ...]] | None:
        """The batch rows that draft this step and have states (a row without any keeps zeros in
        its places: drafts the step rejects), and their states; None without any."""
        found = [(row, self.index.get(batch.req_ids[row])) for row in np.flatnonzero(counts).tolist()]
        found = [(row, at) for row, at in found if at is not None]
        if not found:
            return None
        at = host_to_device(np.array([at for _, at in found], dtype=np.int64), device)
        return np.array([row for row, _ in found], dtype=np.int64), tuple(tensor[at] for tensor in self.states)


def place_drafts(batch: InputBatch, rows: np.ndarray, num_drafts: np.ndarray, drafts: np.ndarray) -> None:
    """Each row's first `num_drafts` of its `drafts` row written after its known tokens."""
    known = batch.num_tokens[rows].astype(np.int64)
    placed = np.arange(drafts.shape[1]) < num_drafts[:, None]
    batch.token_ids[np.repeat(rows, num_drafts), (known[:, None] + np.arange(drafts.shape[1]))[placed]] = \
        drafts[placed]


class StateReadingProposer:
    """What the EAGLE and Medusa proposers share: they read the model's states of each finished
    step (`consume`) and keep, per request, what its next drafts start from (`pending`)."""

    pending: PendingStates

    def step_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The states the head reads for the forward just run (`hidden`: its final states)."""
        return hidden

    def forget(self, request_ids: Iterable[str]) -> None:
        """Finished or preempted requests (a resumed one is read again as it is recomputed)."""
        for request_id in request_ids:
            self.pending.index.pop(request_id, None)

    def reset(self) -> None:
        """The KV cache was let go (sleep): the head's states with it."""
        self.pending = PendingStates.empty()


class EagleProposer(StateReadingProposer):
    def __init__(self, spec: SpeculativeConfig, target: nn.Module, backend: AttentionBackend, device: torch.device,
                 tp: TensorParallelGroup, block_size: int) -> None:
        self.config = spec.draft_model_config
        self.eagle = spec.eagle
        self.target = target
        self.model = load_eagle_head(self.config, self.eagle, target, backend, device, tp)
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.kv_caches: list[torch.Tensor] = []
        self.pending = PendingStates.empty()
        self._captured: dict[int, torch.Tensor] = {}  # EAGLE-3: the model's residual stream at its aux layers
        self._capture_aux_states()

    def _capture_aux_states(self) -> None:
        """EAGLE-3 reads the model's residual stream where its aux layers start (the stream after
        the last layer for id num_layers): hooks on those layers keep it at every forward."""
        layers = self.target.model.layers
        for layer_id in sorted(set(self.eagle.aux_layer_ids)):
            module = layers[layer_id] if layer_id < len(layers) else self.target.model.norm
            position = 1 if layer_id < len(layers) else 0  # (a layer's args start with positions)
            module.register_forward_pre_hook(self._keeper(layer_id, position))

    def _keeper(self, layer_id: int, position: int):
        def keep(module: nn.Module, args: tuple) -> None:
            hidden, residual = args[position], args[position + 1]
            # (cloned: the first layer's norm adds into its input, the embedding, in place)
            self._captured[layer_id] = hidden.clone() if residual is None else hidden + residual
        return keep

    def reset(self) -> None:
        """The KV cache was let go (sleep), the head's with it."""
        super().reset()
        self.kv_caches = []

    def step_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """EAGLE-3's aux layers' streams side by side where it reads them, else `hidden`."""
        if not self.eagle.aux_layer_ids:
            return hidden
        return torch.cat([self._captured[i] for i in self.eagle.aux_layer_ids], dim=-1)

    @torch.inference_mode()
    def consume(self, batch: InputBatch, step: StepStates) -> None:
        """The head reads a finished step's positions whose next token is known."""
        lens, up_to_last = positions_read(batch, step)
        read = np.flatnonzero(lens)
        if not len(read):
            self.pending = self.pending.replaced(step.req_ids, [], None, self.device)
            return
        rows, lens, starts = step.rows[read], lens[read], step.starts[read]
        token_rows = np.repeat(rows, lens)
        positions = np.repeat(starts, lens) + segment_offsets(lens)
        state_index = np.repeat(step.query_starts[read].astype(np.int64), lens) + segment_offsets(lens)
        states = self.model.model.combine_target_states(step.states[host_to_device(state_index, self.device)])
        logits_states, carried = self._pass(batch, rows, lens, token_rows, positions,
                                            batch.token_ids[token_rows, positions + 1], states)
        ends = np.flatnonzero(up_to_last[read])
        at = host_to_device((np.cumsum(lens) - 1)[ends], self.device)
        self.pending = self.pending.replaced(step.req_ids, [step.req_ids[i] for i in read[ends].tolist()],
                                             (logits_states[at], carried[at]), self.device)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, counts: np.ndarray) -> None:
        """Each batch row's `counts[row]` drafts, written after its known tokens. (A row the head
        has not read up to its last token keeps zeros there: drafts the step rejects.)"""
        drafting = self.pending.drafting_rows(batch, counts, self.device)
        if drafting is None:
            return
        rows, (logits_states, carried) = drafting
        num_drafts = counts[rows]
        known = batch.num_tokens[rows].astype(np.int64)
        drafts = np.zeros((len(rows), int(num_drafts.max())), dtype=np.int64)
        drafts[:, 0] = self._draft_tokens(logits_states)
        carried_rows = np.arange(len(rows))  # the indices into `rows` whose states `carried` holds
        for i in range(1, drafts.shape[1]):
            active = np.flatnonzero(num_drafts > i)  # (a subset of the last pass's rows)
            step_rows = rows[active]
            at = host_to_device(np.searchsorted(carried_rows, active), self.device)
            logits_states, carried = self._pass(batch, step_rows, np.ones(len(active), dtype=np.int64), step_rows,
                                                known[active] - 2 + i, drafts[active, i - 1], carried[at])
            drafts[active, i] = self._draft_tokens(logits_states)
            carried_rows = active
        place_drafts(batch, rows, num_drafts, drafts)

    def _pass(self, batch: InputBatch, rows: np.ndarray, lens: np.ndarray, token_rows: np.ndarray,
              positions: np.ndarray, input_ids: np.ndarray,
              states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over the given tokens (its KV written at their positions): its logits states
        and next-pass states at each."""
        attn_metadata, _ = draft_pass_metadata(batch, rows, lens, token_rows, positions, self.backend,
                                               self.block_size, self.device)
        return self.model.model(host_to_device(np.asarray(input_ids, dtype=np.int64), self.device),
                                host_to_device(np.asarray(positions, dtype=np.int64), self.device), states,
                                self.kv_caches, attn_metadata)

    def _draft_tokens(self, logits_states: torch.Tensor) -> np.ndarray:
        return self.model.draft_tokens(logits_states, self.target.compute_logits).cpu().numpy()
