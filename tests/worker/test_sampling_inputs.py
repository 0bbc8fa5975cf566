"""SamplingMetadata from the persistent batch: only what some row uses is built, and per-row
sampling state follows its request when condense() moves rows."""

from __future__ import annotations

import numpy as np

from sampling_fixtures import make_batch, make_metadata
from vllm_lite import SamplingParams


def test_all_greedy_batch_builds_nothing_else() -> None:
    batch = make_batch([([1, 2], [], SamplingParams(temperature=0.0, top_p=0.5)) for _ in range(4)])
    metadata = make_metadata(batch)
    assert metadata.all_greedy and not metadata.needs_logits_processing
    assert (metadata.temperature, metadata.top_p, metadata.top_k, metadata.min_p) == (None, None, None, None)
    assert metadata.max_num_logprobs == -1 and metadata.seeded is None


def test_sampling_state_follows_rows_through_condense() -> None:
    params = [SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.5, logprobs=4),
              SamplingParams(temperature=0.0, logit_bias={9: 2.0}, min_tokens=2)]
    batch = make_batch([([1, 2, 3], [4], p) for p in params])
    batch.remove_request("r1")
    batch.condense()  # r3 moves into row 1
    assert batch.live_req_ids == ["r0", "r3", "r2"]
    metadata = make_metadata(batch, stop_ids={"r3": (0, 2)})
    assert metadata.greedy_mask.tolist() == [False, True, False]
    assert metadata.temperature.squeeze(1).tolist() == [1.0, 1.0, np.float32(0.7)]
    assert metadata.top_p.tolist() == [0.5, 1.0, 1.0] and metadata.top_k.tolist() == [0, 0, 3]
    assert metadata.penalties.logits_rows.tolist() == [2] and metadata.penalties.batch_rows.tolist() == [2]
    assert metadata.logit_bias.rows.tolist() == [1] and metadata.logit_bias.token_ids.tolist() == [9]
    assert metadata.min_tokens.batch_rows.tolist() == [1] and metadata.min_tokens.pair_token_ids.tolist() == [0, 2]
    assert metadata.max_num_logprobs == 4
