"""Builds SamplingMetadata from the persistent batch's per-row arrays (array code over the rows
that sample; Python loops only over rows that use logit_bias or min_tokens).

The build states the preconditions of the sampler's batched ops that depend on a row's own data
(every token id it indexes the logits with lies inside them), so that a bad row fails here, where
the model runner can tell which row it was, and never inside a batched op."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from vllm_lite.host_to_device import host_to_device
from vllm_lite.sample.metadata import (AllowedTokensMetadata, BadWordsMetadata, LogitBiasMetadata, MinTokensMetadata,
                                       PenaltyMetadata,
                                       RequestedLogprobsMetadata, SamplingMetadata, TokenHistory)
from vllm_lite.sample.occurrences import TokenOccurrences
from vllm_lite.sample.seeded_draws import SeededRows
from vllm_lite.sampling_params import SAMPLING_EPS
from vllm_lite.worker.input_batch import InputBatch


def build_sampling_metadata(batch: InputBatch, rows: np.ndarray,
                            min_tokens_stop_ids: Mapping[str, tuple[int, ...]],
                            device: torch.device,
                            occurrences: TokenOccurrences | None = None,
                            vocab_size: int | None = None,
                            preceding: tuple[np.ndarray, np.ndarray] | None = None,
                            draft_positions: np.ndarray | None = None) -> SamplingMetadata:
    """`rows`: the batch rows that sample, in logits-row order (a row may come several times:
    speculative decoding's draft positions). `occurrences`: the penalty state kept across steps
    (the model runner's); a fresh one is built from the history if None. `vocab_size`: the
    logits' width; a token id of a row outside it raises ValueError. `preceding`: (logits row,
    token) pairs of output tokens a logits row has beyond its row's history (the drafts before
    its position), for the penalties; `draft_positions`: each logits row's position among its
    request's (0: its token's, j: after j drafts), for min_tokens and the seeded rows' draws."""
    temperature = batch.temperature[rows]
    greedy = temperature < SAMPLING_EPS
    all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())
    random_rows = ~greedy
    history = TokenHistory(batch.token_ids, batch.num_prompt_tokens, batch.num_tokens, batch.prompt_is_embeds)
    top_p, top_k, min_p = batch.top_p[rows], batch.top_k[rows].astype(np.int64), batch.min_p[rows]
    uses_top_p, uses_top_k = bool((top_p[random_rows] < 1.0).any()), bool((top_k[random_rows] > 0).any())
    return SamplingMetadata(
        all_greedy=all_greedy,
        all_random=all_random,
        temperature=_divisors(temperature, greedy, device),
        greedy_mask=None if all_greedy or all_random else host_to_device(greedy, device),
        seeded=_seeded_rows(batch, rows, random_rows, device, draft_positions),
        top_p=host_to_device(top_p, device) if uses_top_p else None,
        top_k=host_to_device(top_k, device) if uses_top_k else None,
        top_p_host=top_p if uses_top_p else None,
        top_k_host=top_k if uses_top_k else None,
        min_p=host_to_device(min_p, device) if (min_p[random_rows] > 0.0).any() else None,
        max_num_logprobs=_max_num_logprobs(batch, rows),
        logprobs_rows=_logprobs_rows(batch.num_logprobs[rows]),
        requested_logprobs=_requested_logprobs(batch, rows, device),
        penalties=_penalties(batch, rows, history, device, occurrences, preceding),
        logit_bias=_logit_bias(batch, rows, device, vocab_size),
        allowed_tokens=_allowed_tokens(batch, rows, device, vocab_size),
        bad_words=_bad_words(batch, rows, history, vocab_size),
        min_tokens=_min_tokens(batch, rows, history, min_tokens_stop_ids, vocab_size, draft_positions),
    )


def _divisors(temperature: np.ndarray, greedy: np.ndarray, device: torch.device) -> torch.Tensor | None:
    """The rows' temperatures as the logits' divisors (1.0 on greedy rows); None when every one is
    1.0 (all greedy, or the OpenAI default temperature): dividing would only copy the logits."""
    divisors = np.where(greedy, 1.0, temperature).astype(np.float32)
    return None if (divisors == 1.0).all() else host_to_device(divisors[:, None], device)


def _logprobs_rows(num_logprobs: np.ndarray) -> np.ndarray | None:
    asked = num_logprobs >= 0
    return None if asked.all() or not asked.any() else np.flatnonzero(asked)


def _max_num_logprobs(batch: InputBatch, rows: np.ndarray) -> int:
    """The top-k width: rows with logprob_token_ids need none (their columns are their ids)."""
    num_logprobs = batch.num_logprobs[rows]
    if not batch.has_logprob_token_ids[rows].any():
        return int(num_logprobs.max(initial=-1))
    return int(np.where(batch.has_logprob_token_ids[rows], 0, num_logprobs).max(initial=-1))


def _requested_logprobs(batch: InputBatch, rows: np.ndarray,
                        device: torch.device) -> RequestedLogprobsMetadata | None:
    given = batch.has_logprob_token_ids[rows]
    if not given.any():
        return None
    asked = batch.num_logprobs[rows] >= 0  # logprobs rows are the asked rows, in order
    positions = np.flatnonzero(given[asked])
    id_lists = [batch.sampling_params[row].logprob_token_ids for row in rows[given].tolist()]
    width = max(len(ids) for ids in id_lists)
    padded = np.array([ids + ids[-1:] * (width - len(ids)) for ids in id_lists], dtype=np.int64)
    return RequestedLogprobsMetadata(rows=host_to_device(positions.astype(np.int64), device),
                                     token_ids=host_to_device(padded, device))


def _seeded_rows(batch: InputBatch, rows: np.ndarray, random_rows: np.ndarray, device: torch.device,
                 draft_positions: np.ndarray | None) -> SeededRows | None:
    seeded = random_rows & batch.has_seed[rows]
    if not seeded.any():
        return None
    logits_rows = np.flatnonzero(seeded)
    offsets = (np.zeros(len(logits_rows), dtype=np.uint64) if draft_positions is None
               else draft_positions[logits_rows].astype(np.uint64))
    batch_rows = rows[logits_rows]
    return SeededRows(host_to_device(logits_rows.astype(np.int64), device), batch.seed_keys[batch_rows], batch_rows,
                      offsets, batch.num_tokens)


def penalized(batch: InputBatch, rows: np.ndarray | slice) -> np.ndarray:
    """Which of `rows` have a repetition, frequency or presence penalty (a bool mask)."""
    return ((batch.repetition_penalty[rows] != 1.0) | (batch.frequency_penalty[rows] != 0.0)
            | (batch.presence_penalty[rows] != 0.0))


def _penalties(batch: InputBatch, rows: np.ndarray, history: TokenHistory, device: torch.device,
               occurrences: TokenOccurrences | None,
               preceding: tuple[np.ndarray, np.ndarray] | None = None) -> PenaltyMetadata | None:
    used = np.flatnonzero(penalized(batch, rows))
    if len(used) == 0:
        return None
    used_rows = rows[used]
    preceding_pairs = None
    if preceding is not None and len(preceding[0]):
        at = np.minimum(np.searchsorted(used, preceding[0]), len(used) - 1)
        kept = used[at] == preceding[0]
        if kept.any():
            preceding_pairs = (host_to_device(at[kept].astype(np.int64), device),
                               host_to_device(preceding[1][kept].astype(np.int64), device))
    return PenaltyMetadata(
        logits_rows=host_to_device(used.astype(np.int64), device),
        batch_rows=used_rows,
        req_ids=[batch.req_ids[row] for row in used_rows.tolist()],
        repetition=host_to_device(batch.repetition_penalty[used_rows][:, None], device),
        frequency=host_to_device(batch.frequency_penalty[used_rows][:, None], device),
        presence=host_to_device(batch.presence_penalty[used_rows][:, None], device),
        history=history,
        occurrences=occurrences if occurrences is not None else TokenOccurrences(device),
        all_rows=len(used) == len(rows),
        preceding=preceding_pairs,
    )


def _check_token_ids(token_ids: np.ndarray, vocab_size: int | None, field: str) -> None:
    if vocab_size is not None and len(token_ids) and (token_ids.min() < 0 or token_ids.max() >= vocab_size):
        bad = token_ids[(token_ids < 0) | (token_ids >= vocab_size)][0]
        raise ValueError(f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})")


def _logit_bias(batch: InputBatch, rows: np.ndarray, device: torch.device,
                vocab_size: int | None = None) -> LogitBiasMetadata | None:
    used = np.flatnonzero(batch.has_logit_bias[rows])
    if len(used) == 0:
        return None
    logits_rows: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i in used.tolist():
        bias = batch.sampling_params[rows[i]].logit_bias
        logits_rows.extend([i] * len(bias))
        token_ids.extend(bias.keys())
        values.extend(bias.values())
    token_ids_np = np.array(token_ids, dtype=np.int64)
    _check_token_ids(token_ids_np, vocab_size, "logit_bias")
    return LogitBiasMetadata(
        rows=host_to_device(np.array(logits_rows, dtype=np.int64), device),
        token_ids=host_to_device(token_ids_np, device),
        values=host_to_device(np.array(values, dtype=np.float32), device),
    )


def _allowed_tokens(batch: InputBatch, rows: np.ndarray, device: torch.device,
                    vocab_size: int | None = None) -> AllowedTokensMetadata | None:
    used = np.flatnonzero(batch.has_allowed_token_ids[rows])
    if len(used) == 0:
        return None
    if vocab_size is None:
        raise ValueError("allowed_token_ids: the logits' width is needed to mask the other tokens")
    disallowed = np.ones((len(used), vocab_size), dtype=bool)
    for j, i in enumerate(used.tolist()):
        token_ids = np.asarray(batch.sampling_params[rows[i]].allowed_token_ids, dtype=np.int64)
        _check_token_ids(token_ids, vocab_size, "allowed_token_ids")
        disallowed[j, token_ids] = False
    return AllowedTokensMetadata(rows=host_to_device(used.astype(np.int64), device),
                                 disallowed=host_to_device(disallowed, device))


def _bad_words(batch: InputBatch, rows: np.ndarray, history: TokenHistory,
               vocab_size: int | None = None) -> BadWordsMetadata | None:
    used = np.flatnonzero(batch.has_bad_words[rows])
    if len(used) == 0:
        return None
    words: list[dict[int, list[tuple[tuple[int, ...], int]]]] = []
    for i in used.tolist():
        sequences = batch.sampling_params[rows[i]].bad_words_token_ids
        _check_token_ids(np.array([t for seq in sequences for t in seq], dtype=np.int64), vocab_size, "bad_words")
        by_length: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for seq in sequences:
            by_length.setdefault(len(seq) - 1, []).append((tuple(seq[:-1]), seq[-1]))
        words.append(by_length)
    return BadWordsMetadata(logits_rows=used.tolist(), batch_rows=rows[used].tolist(), words=words, history=history)


def _min_tokens(batch: InputBatch, rows: np.ndarray, history: TokenHistory,
                stop_ids: Mapping[str, tuple[int, ...]], vocab_size: int | None = None,
                draft_positions: np.ndarray | None = None) -> MinTokensMetadata | None:
    used = np.flatnonzero(batch.min_tokens[rows] > 0)
    pair_index: list[int] = []
    pair_token_ids: list[int] = []
    for j, i in enumerate(used.tolist()):
        ids = stop_ids.get(batch.req_ids[rows[i]], ())
        pair_index.extend([j] * len(ids))
        pair_token_ids.extend(ids)
    if not pair_index:
        return None
    pair_index_np = np.array(pair_index, dtype=np.int64)
    pair_token_ids_np = np.array(pair_token_ids, dtype=np.int64)
    _check_token_ids(pair_token_ids_np, vocab_size, "eos_token_ids / stop_token_ids (min_tokens)")
    return MinTokensMetadata(
        batch_rows=rows[used],
        min_tokens=batch.min_tokens[rows[used]],
        pair_index=pair_index_np,
        pair_logits_rows=used[pair_index_np].astype(np.int64),
        pair_token_ids=pair_token_ids_np,
        history=history,
        output_offsets=None if draft_positions is None else draft_positions[used],
    )
