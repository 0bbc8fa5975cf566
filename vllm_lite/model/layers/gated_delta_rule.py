"""Gated DeltaNet linear attention (Qwen3.5's `linear_attention` layers) on the engine's steps.

Such a layer keeps, per request, the last inputs of a short causal convolution and a state
matrix per value head, in place of keys and values: each token decays the state by exp(g),
writes its value where its key points (the delta rule: the value less what the state already
reads there, times beta) and reads the state with its query. The states live in slots
(`RecurrentStates`, one per request the batch can hold, `InputBatch.state_slots`); a step hands
each layer its sequences' slots and token ranges (`RecurrentStep`). A sequence starting at
position 0 starts from zeroed states (the model runner resets them: a new or preempted request).

One-token sequences (decode) run as one batched recurrence step (on CPU csrc's op, in place in
the pool: csrc/delta_rule_ops.cpp); longer ones (prefill chunks)
through the chunked form: within a chunk of CHUNK tokens the updates are one triangular solve,
the state passed from chunk to chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite import _custom_ops as ops
from vllm_lite.config import LinearAttentionShape

CHUNK = 64
_L2_EPS = 1e-6  # transformers' (and the FLA kernels') l2norm epsilon


@dataclass(frozen=True, slots=True)
class RecurrentStates:
    """Per linear-attention layer: the convolution's last inputs [slots, conv_dim, kernel - 1]
    (model dtype) and the delta rule's state [slots, value heads, key dim, value dim] (float32)."""

    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]

    @staticmethod
    def allocate(shape: LinearAttentionShape, num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> RecurrentStates:
        conv = {layer: torch.zeros(num_slots, shape.conv_dim, shape.conv_kernel - 1, dtype=dtype, device=device)
                for layer in shape.layers}
        recurrent = {layer: torch.zeros(num_slots, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim,
                                        dtype=torch.float32, device=device) for layer in shape.layers}
        return RecurrentStates(conv, recurrent)

    def reset(self, slots: torch.Tensor) -> None:
        for states in (*self.conv.values(), *self.recurrent.values()):
            states[slots] = 0


@dataclass(frozen=True, slots=True)
class RecurrentStep:
    """Where a step's sequences keep their states and where their tokens are."""

    states: RecurrentStates
    num_tokens: int
    decode_tokens: torch.Tensor  # int64: the token of each one-token sequence
    decode_slots: torch.Tensor  # int64: their slots
    prefills: tuple[tuple[int, int, int], ...]  # (first token, end, slot) of each longer sequence

    @staticmethod
    def of(states: RecurrentStates, slots: np.ndarray, query_starts: np.ndarray, query_lens: np.ndarray,
           context_lens: np.ndarray, device: torch.device) -> RecurrentStep:
        """Per sequence: its slot, first token, tokens this step and tokens computed before it;
        the slots of sequences that start at position 0 are zeroed here, in every layer."""
        fresh = slots[context_lens == 0]
        if len(fresh):
            states.reset(torch.from_numpy(fresh.astype(np.int64)).to(device))
        one = query_lens == 1
        starts, ends = query_starts[~one], query_starts[~one] + query_lens[~one]
        prefills = tuple(zip(starts.tolist(), ends.tolist(), slots[~one].tolist()))
        return RecurrentStep(states, int(query_starts[-1] + query_lens[-1]),
                             torch.from_numpy(query_starts[one].astype(np.int64)).to(device),
                             torch.from_numpy(slots[one].astype(np.int64)).to(device), prefills)


class GatedDeltaNetOnSlots(nn.Module):
    """Takes the place of a transformers Gated DeltaNet layer (Qwen3.5's), holding its very
    submodules and parameters (their names unchanged: checkpoints and weight updates reach them
    as before); its projections and gated norm run as transformers' modules, the convolution and
    the delta rule here, on the step's state slots."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        if layer.activation not in ("silu", "swish"):
            raise ValueError(f"{type(layer).__name__}: the convolution's activation {layer.activation!r} is not "
                             "implemented here (silu is)")
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj"):
            setattr(self, name, getattr(layer, name))
        self.dt_bias, self.A_log = layer.dt_bias, layer.A_log
        self.layer_idx: int = layer.layer_idx
        self.num_key_heads, self.num_value_heads = layer.num_k_heads, layer.num_v_heads
        self.key_head_dim, self.value_head_dim = layer.head_k_dim, layer.head_v_dim

    def forward(self, hidden_states: torch.Tensor, vllm_lite_recurrent: RecurrentStep | None = None,
                **kwargs: Any) -> torch.Tensor:
        """hidden_states [1, rows, hidden] (rows past the step's tokens: padding, left zero)."""
        if vllm_lite_recurrent is None:  # (the load-time probe of the attention layers)
            return torch.zeros_like(hidden_states)
        step = vllm_lite_recurrent
        x = hidden_states[0, :step.num_tokens]
        mixed, z = self.in_proj_qkv(x), self.in_proj_z(x)
        beta = self.in_proj_b(x).float().sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        conv_states, states = step.states.conv[self.layer_idx], step.states.recurrent[self.layer_idx]
        core = torch.empty(len(x), self.num_value_heads, self.value_head_dim, dtype=torch.float32, device=x.device)
        if len(step.decode_tokens):
            at, slots = step.decode_tokens, step.decode_slots
            q, k, v = self._heads(self._convolved(conv_states, slots, mixed[at, :, None])[..., 0].to(x.dtype))
            if states.is_cpu and ops.is_available():  # (in place in the pool: nothing gathered)
                core[at] = ops.gated_delta_rule_decode(states, slots, q, k, v, decay[at], beta[at])
            else:
                core[at], states[slots] = _delta_rule_step(q, k, v, decay[at], beta[at], states[slots])
        for start, end, slot in step.prefills:
            slot_of = torch.tensor([slot], device=x.device)
            q, k, v = self._heads(self._convolved(conv_states, slot_of, mixed[None, start:end].mT)[0].T.to(x.dtype))
            core[start:end], states[slot] = _chunked_delta_rule(q, k, v, decay[start:end], beta[start:end],
                                                                states[slot])
        out = self.norm(core.to(x.dtype).reshape(-1, self.value_head_dim), z.reshape(-1, self.value_head_dim))
        out = self.out_proj(out.reshape(len(x), -1))
        return F.pad(out, (0, 0, 0, hidden_states.shape[1] - len(x)))[None]

    def _convolved(self, conv_states: torch.Tensor, slots: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """The causal convolution (and its SiLU) of `inputs` [sequences, channels, tokens] after each
        sequence's kept inputs at `slots`, which then keep the last of them."""
        window = torch.cat([conv_states[slots], inputs.to(conv_states.dtype)], dim=-1)
        conv_states[slots] = window[..., window.shape[-1] - conv_states.shape[-1]:]
        weight = self.conv1d.weight
        return F.silu(F.conv1d(window, weight, self.conv1d.bias, groups=weight.shape[0]))

    def _heads(self, convolved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[tokens, conv_dim] -> float32 queries and keys (unit length per head, queries scaled by
        1/sqrt(key dim), repeated for the value heads that share them) and values, [tokens, heads, dim]."""
        key_width = self.num_key_heads * self.key_head_dim
        q, k, v = convolved.float().split([key_width, key_width, self.num_value_heads * self.value_head_dim], dim=-1)
        q, k = (_unit(t.unflatten(-1, (self.num_key_heads, self.key_head_dim))) for t in (q, k))
        repeats = self.num_value_heads // self.num_key_heads
        if repeats > 1:
            q, k = q.repeat_interleave(repeats, dim=1), k.repeat_interleave(repeats, dim=1)
        return q * self.key_head_dim ** -0.5, k, v.unflatten(-1, (self.num_value_heads, self.value_head_dim))


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)


def _delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each sequence: q, k [n, H, dk], v [n, H, dv], decay / beta [n, H], state
    [n, H, dk, dv] -> (output [n, H, dv], the new state)."""
    state = state * decay.exp()[..., None, None]
    read = (k[..., None, :] @ state)[..., 0, :]
    state = state + k[..., :, None] * ((v - read) * beta[..., None])[..., None, :]
    return (q[..., None, :] @ state)[..., 0, :], state


def _chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over one sequence's tokens: q, k [L, H, dk], v [L, H, dv], decay / beta
    [L, H], state [H, dk, dv] -> (output [L, H, dv], the state after the last token).

    Within a chunk, with G the running sum of the decays and S the state before it, each token's
    write u_t = beta_t (v_t - e^{G_t} S^T k_t - sum_{s<t} e^{G_t - G_s} (k_t . k_s) u_s): the
    writes solve a unit lower-triangular system, u = A^-1 (beta v) - A^-1 (beta e^G k) S; the
    outputs are e^{G_t} S^T q_t + sum_{s<=t} e^{G_t - G_s} (q_t . k_s) u_s, and the state after
    the chunk e^{G_last} S + sum_s e^{G_last - G_s} k_s u_s^T. (Padding tokens: zero key, value
    and beta, no decay: they change nothing.)"""
    length = len(q)
    pad = -length % CHUNK
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)).unflatten(1, (-1, CHUNK)) for t in (q, k, v))
    decay, beta = (F.pad(t.T, (0, pad)).unflatten(1, (-1, CHUNK)) for t in (decay, beta))  # [H, chunks, CHUNK]
    G = decay.cumsum(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    between = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # e^{G_t - G_s}, s <= t
    system = ((k @ k.transpose(-1, -2)) * between * beta[..., None]).tril(-1)
    writes = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    state_weights = torch.linalg.solve_triangular(system, (beta * G.exp())[..., None] * k, upper=False,
                                                  unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * between
    q_decayed, k_to_end = q * G.exp()[..., None], k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        u = writes[:, i] - state_weights[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + scores[:, i] @ u
        state = chunk_decay[:, i] * state + k_to_end[:, i].transpose(-1, -2) @ u
    return out.flatten(1, 2)[:, :length].transpose(0, 1), state
