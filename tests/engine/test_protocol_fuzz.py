"""Engine-protocol fuzz (issue 12, acceptance 1, engine half): random, truncated, nested and
out-of-range frames go straight to a real engine-core process's socket; after each batch a
normal greedy request returns the same tokens as before, and the engine never dies."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_utils import ENGINE_ARGS, wait_until
from vllm_lite import LLM, SamplingParams
from vllm_lite.wire import MsgpackEncoder, RequestType

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}
EXAMPLES = 40
BATCH = 8

# msgpack values of every kind, nested a little, with integers past int32/int64.
_leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                    st.text(max_size=8), st.binary(max_size=8))
_values = st.recursive(_leaves, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=12)
_ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([-1, 0, 2**31 - 1, 2**31, 2**63, 10**6]))
_sampling = st.dictionaries(st.sampled_from(["n", "temperature", "top_p", "top_k", "min_p", "seed",
                                             "max_tokens", "min_tokens", "stop_token_ids", "logprobs",
                                             "prompt_logprobs", "logit_bias", "repetition_penalty",
                                             "frequency_penalty", "presence_penalty", "ignore_eos"]),
                            st.one_of(_ints, st.floats(), st.lists(_ints, max_size=3),
                                      st.dictionaries(_ints, st.floats(), max_size=2), st.booleans()),
                            max_size=4)


@st.composite
def frames(draw: st.DrawFn, valid: list[bytes]) -> list[bytes]:
    """One hostile message: a valid request mutated field by field, raw garbage, a truncated
    frame, deep nesting, or an unknown type tag."""
    kind = draw(st.sampled_from(["mutated", "garbage", "truncated", "nested", "tag"]))
    tag = draw(st.sampled_from([RequestType.ADD, RequestType.ABORT, RequestType.UTILITY]))
    if kind == "mutated":
        fields = msgspec.msgpack.decode(valid[0])
        fields[0] = f"fuzz-{draw(st.integers(0, 10**6))}"
        position = draw(st.integers(0, len(fields)))
        if position == 2:
            fields[2] = draw(_sampling)
        elif position == 3:
            fields[3] = draw(st.lists(_ints, max_size=3))
        elif position < len(fields):
            fields[position] = draw(_values)
        else:
            fields.append(draw(_values))
        return [RequestType.ADD, msgspec.msgpack.encode(fields), *valid[1:]]
    if kind == "garbage":
        return [tag, draw(st.binary(max_size=64))]
    if kind == "truncated":
        return [RequestType.ADD, valid[0][: draw(st.integers(0, len(valid[0]) - 1))]]
    if kind == "nested":
        return [tag, b"\x91" * draw(st.integers(1, 50_000)) + b"\xc0"]
    return [draw(st.binary(min_size=1, max_size=2)), msgspec.msgpack.encode(draw(_values))]


@pytest.fixture(scope="module")
def mp_llm(tiny_llama: Path):
    llm = LLM(str(tiny_llama), **ENGINE_ARGS)
    yield llm
    llm.shutdown()


def test_hostile_frames_never_kill_the_engine(mp_llm: LLM) -> None:
    reference = greedy_tokens(mp_llm)
    valid = MsgpackEncoder().encode(mp_llm.llm_engine.input_processor.process("fuzz", [5, 6, 7], GREEDY))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(mp_llm.llm_engine.engine_core.address)
    sent = [0]

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(frames(valid), min_size=1, max_size=BATCH))
    def one_batch(batch: list[list[bytes]]) -> None:
        for message in batch:
            sock.send_multipart(message)
        sent[0] += len(batch)
        assert greedy_tokens(mp_llm) == reference
        drain(sock)  # the fuzz client's own answers (errors, outputs of requests that were valid)

    try:
        one_batch()
    finally:
        ctx.destroy(linger=0)
    assert sent[0] >= EXAMPLES
    assert mp_llm.llm_engine.engine_core.is_healthy()

    def idle() -> bool:  # requests the fuzz made valid run to their end
        stats = mp_llm.stats()
        return stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]

    assert wait_until(idle, timeout_s=60)


def greedy_tokens(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def drain(sock: zmq.Socket) -> None:
    while sock.poll(0):
        sock.recv_multipart()
