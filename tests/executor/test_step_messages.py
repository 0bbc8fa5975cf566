"""The step broadcast's wire format: a SchedulerOutput survives the trip to the workers, and the
bytes per decode step do not grow with prompt length (no token lists after the first step)."""

from __future__ import annotations

import dataclasses

import numpy as np

from vllm_lite.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from vllm_lite.core.request import Request
from vllm_lite.core.scheduler import Scheduler
from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.executor.messages import MessageCodec, StepDiff, payload_bytes
from vllm_lite.wire import InitKVCache, LogprobsArrays, Shutdown, WorkerReply
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.wire import ModelRunnerOutput

BLOCK_SIZE = 16
NUM_REQUESTS = 256


def make_scheduler(max_model_len: int, num_blocks: int) -> Scheduler:
    return Scheduler(SchedulerConfig(NUM_REQUESTS, 1 << 20, max_model_len, True),
                     CacheConfig(BLOCK_SIZE, num_blocks, None, True), num_blocks)


def add_requests(scheduler: Scheduler, prompt_len: int, max_tokens: int) -> None:
    for i in range(NUM_REQUESTS):
        prompt = (np.arange(prompt_len, dtype=np.int32) * 7 + i * 1009) % 50_000  # no prefix hits
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        scheduler.add_request(Request(f"req-{i}", prompt, params, (2,), max_tokens))


def step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule, then pretend every row that reached the end of its known tokens sampled 5."""
    sched = scheduler.schedule()
    ids = sched.scheduled_cached_reqs.req_ids + [new.req_id for new in sched.scheduled_new_reqs]
    requests = [scheduler.requests[i] for i in ids]
    num_sampled = np.array([r.num_computed_tokens == r.num_tokens for r in requests], dtype=np.int32)
    scheduler.update_from_output(sched, ids, np.full((len(ids), 1), 5, dtype=np.int32), num_sampled)
    return sched


def decode_step_bytes(prompt_len: int, num_steps: int) -> list[int]:
    """Payload bytes of `num_steps` decode steps of 256 requests, once every prompt is in."""
    max_model_len = prompt_len + num_steps + 8
    blocks_per_req = -(-max_model_len // BLOCK_SIZE)
    scheduler = make_scheduler(max_model_len, NUM_REQUESTS * blocks_per_req + 1)
    add_requests(scheduler, prompt_len, num_steps + 4)
    prefill = step(scheduler)  # one step prefills everything (the token budget is unlimited)
    assert len(prefill.scheduled_new_reqs) == NUM_REQUESTS
    codec = MessageCodec()
    sizes = []
    for _ in range(num_steps):
        sched = step(scheduler)
        assert not sched.scheduled_new_reqs and len(sched.scheduled_cached_reqs.req_ids) == NUM_REQUESTS
        sizes.append(payload_bytes(codec.encode_to_worker(StepDiff.from_scheduler_output(sched))))
    return sizes


def test_decode_step_bytes_do_not_grow_with_prompt_length() -> None:
    # Prompt lengths that are multiples of the block size cross block boundaries on the same
    # decode steps, so the two runs see the same new-block pattern.
    short = decode_step_bytes(prompt_len=16, num_steps=2 * BLOCK_SIZE)
    long = decode_step_bytes(prompt_len=1024, num_steps=2 * BLOCK_SIZE)
    assert long == short
    # Roughly ids + 4 int32 per request: far below the 1024 tokens per request of the long prompts.
    assert max(short) < 24 * NUM_REQUESTS, max(short)
    print(f"decode step payload, 256 requests: {min(short)}-{max(short)} bytes")


def test_scheduler_output_round_trip() -> None:
    scheduler = make_scheduler(max_model_len=256, num_blocks=NUM_REQUESTS * 16)
    # Prompts end 2 tokens before a block boundary: the decodes cross it (new block ids).
    add_requests(scheduler, prompt_len=3 * BLOCK_SIZE - 2, max_tokens=5)
    codec = MessageCodec()
    steps_with_new_blocks = 0
    for _ in range(7):  # prefill, decodes, finishes
        sched = step(scheduler)
        decoded = codec.decode_to_worker(codec.encode_to_worker(StepDiff.from_scheduler_output(sched)))
        assert_same_scheduler_output(decoded.to_scheduler_output(), sched)
        steps_with_new_blocks += bool(sched.scheduled_cached_reqs.num_new_blocks.any())
    assert steps_with_new_blocks


def test_scheduler_output_with_drafts_round_trip() -> None:
    """Speculative decoding's drafts reach every rank (a rank without them would compute other
    rows than the rest, and the collectives would never meet)."""
    scheduler = Scheduler(SchedulerConfig(8, 1 << 20, 256, True), CacheConfig(BLOCK_SIZE, 64, None, True), 64,
                          speculative_config=SpeculativeConfig(3, 1, 2))
    for i in range(4):
        prompt = np.array([5, 6, 7, 8] * 4 + [5, 6], dtype=np.int32) + i
        scheduler.add_request(Request(f"req-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=8,
                                                                         ignore_eos=True), (2,), 8))
    codec = MessageCodec()
    step(scheduler)  # prefill
    sched = scheduler.schedule()
    drafts = sched.scheduled_spec_decode_tokens
    assert drafts and all(sched.num_scheduled_tokens[r] == 1 + len(d) for r, d in drafts.items())
    decoded = codec.decode_to_worker(codec.encode_to_worker(StepDiff.from_scheduler_output(sched)))
    assert_same_scheduler_output(decoded.to_scheduler_output(), sched)


# needs_output_first: whether async scheduling must take the step's output before scheduling the
# next (a thinking budget); the workers run steps in order either way.
ENGINE_CORE_ONLY = {"needs_output_first"}


def assert_same_scheduler_output(got: SchedulerOutput, want: SchedulerOutput) -> None:
    # The wire form knows these fields; a new SchedulerOutput field must be added to StepDiff,
    # unless only the engine core reads it (ENGINE_CORE_ONLY).
    assert {f.name for f in dataclasses.fields(SchedulerOutput)} - ENGINE_CORE_ONLY == {
        "scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
        "total_num_scheduled_tokens", "finished_req_ids", "preempted_req_ids",
        "structured_output_req_ids", "grammar_bitmask", "scheduled_spec_decode_tokens"}
    assert {r: d.tolist() for r, d in got.scheduled_spec_decode_tokens.items()} == \
           {r: d.tolist() for r, d in want.scheduled_spec_decode_tokens.items()}
    assert got.structured_output_req_ids == want.structured_output_req_ids
    assert (got.grammar_bitmask is None) == (want.grammar_bitmask is None)
    if want.grammar_bitmask is not None:
        assert np.array_equal(got.grammar_bitmask, want.grammar_bitmask)
    assert got.num_scheduled_tokens == want.num_scheduled_tokens
    got_cached, want_cached = got.scheduled_cached_reqs, want.scheduled_cached_reqs
    assert got_cached.req_ids == want_cached.req_ids
    assert got_cached.new_block_ids.tolist() == want_cached.new_block_ids.tolist()
    assert got_cached.num_new_blocks.tolist() == want_cached.num_new_blocks.tolist()
    assert list(got_cached.num_computed_tokens) == list(want_cached.num_computed_tokens)
    assert got.total_num_scheduled_tokens == want.total_num_scheduled_tokens
    assert got.finished_req_ids == want.finished_req_ids
    assert got.preempted_req_ids == want.preempted_req_ids
    assert len(got.scheduled_new_reqs) == len(want.scheduled_new_reqs)
    for a, b in zip(got.scheduled_new_reqs, want.scheduled_new_reqs):
        for f in dataclasses.fields(b):
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert np.array_equal(x, y) if isinstance(y, np.ndarray) else x == y, f.name


def test_control_messages_and_replies() -> None:
    codec = MessageCodec()
    assert codec.decode_to_worker(codec.encode_to_worker(InitKVCache(123))) == InitKVCache(123)
    assert isinstance(codec.decode_to_worker(codec.encode_to_worker(Shutdown())), Shutdown)
    logprobs = LogprobsArrays(np.arange(6, dtype=np.int32).reshape(2, 3),
                              -np.ones((2, 3), dtype=np.float32), np.ones((2, 3), dtype=np.int32))
    output = ModelRunnerOutput(["a", "b"], np.array([[7], [0]], dtype=np.int32),
                               np.array([1, 0], dtype=np.int32), logprobs, {"b": (3, logprobs)})
    got = codec.decode_reply(codec.encode_reply(WorkerReply(output))).output
    assert got.req_ids == ["a", "b"] and got.sampled_token_ids.tolist() == [[7], [0]]
    # One codec for every boundary: received arrays are views of their frames, never copied.
    assert got.sampled_token_ids.dtype == np.int32 and not got.sampled_token_ids.flags.owndata
    assert got.num_sampled.tolist() == [1, 0]
    assert np.array_equal(got.logprobs.logprobs, logprobs.logprobs)
    start, chunk = got.prompt_logprobs["b"]
    assert start == 3 and np.array_equal(chunk.token_ids, logprobs.token_ids)
    assert codec.decode_reply(codec.encode_reply(WorkerReply(error="rank 1 died"))).error == "rank 1 died"
