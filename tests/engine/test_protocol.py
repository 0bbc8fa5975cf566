"""The wire protocol: structs round-trip, big arrays travel as uncopied extra frames, malformed
input raises DecodeError (never anything else), and the per-client output split."""

from __future__ import annotations

import os
import stat

import msgspec
import numpy as np
import pytest

from vllm_lite.engine.core import SELECTED_FIELDS, select_requests
from vllm_lite.wire import (
    INLINE_ARRAY_MAX_BYTES,
    OUTPUT_STRUCTS,
    REQUEST_STRUCTS,
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishedRequest,
    FinishReason,
    MsgpackDecoder,
    MsgpackEncoder,
    RequestError,
    RequestIdsReceiver,
    RequestIdsSender,
    UtilityRequest,
    UtilityResult,
    peek_request_id,
)
from vllm_lite.engine.zmq_utils import normalize_address, private_ipc_address
from vllm_lite.sampling_params import SamplingParams


def make_request(num_tokens: int, request_id: str = "req-7") -> EngineCoreRequest:
    return EngineCoreRequest(request_id, np.arange(num_tokens, dtype=np.int32),
                             SamplingParams(temperature=0.0, max_tokens=4, stop=["x"]), (2, 0), 1.5, 4)


def round_trip(obj, type_=None):
    frames = MsgpackEncoder().encode(obj)
    return MsgpackDecoder(type_ or type(obj)).decode(frames), frames


def test_large_array_is_an_uncopied_extra_frame() -> None:
    request = make_request(1024)
    decoded, frames = round_trip(request)
    assert len(frames) == 2
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.int32), request.prompt_token_ids)
    assert decoded.request_id == "req-7" and decoded.sampling_params == request.sampling_params
    np.testing.assert_array_equal(decoded.prompt_token_ids, request.prompt_token_ids)
    assert decoded.prompt_token_ids.dtype == np.int32
    assert np.shares_memory(decoded.prompt_token_ids, np.frombuffer(frames[1], dtype=np.uint8))


def test_small_array_is_inline() -> None:
    request = make_request(INLINE_ARRAY_MAX_BYTES // 4 - 1)
    decoded, frames = round_trip(request)
    assert len(frames) == 1
    np.testing.assert_array_equal(decoded.prompt_token_ids, request.prompt_token_ids)


def test_every_ndarray_field_round_trips() -> None:
    """Optional array fields (logprobs) need nothing special: the codec is generic over ndarray."""
    outputs = EngineCoreOutputs(["a", "b"], np.array([5, 6], dtype=np.int32),
                                [FinishedRequest("b", FinishReason.LENGTH)])
    outputs.logprob_token_ids = np.arange(2 * 41, dtype=np.int32).reshape(2, 41)
    outputs.logprobs = -np.random.default_rng(0).random((2, 41), dtype=np.float32)
    decoded, frames = round_trip(outputs)
    assert len(frames) == 1 + 2  # the two 328-byte logprob arrays are frames, the token ids inline
    for name in ("new_token_ids", "logprob_token_ids", "logprobs"):
        np.testing.assert_array_equal(getattr(decoded, name), getattr(outputs, name))
        assert getattr(decoded, name).dtype == getattr(outputs, name).dtype
    assert decoded.finished == outputs.finished and decoded.logprob_ranks is None


def test_non_contiguous_and_2d_arrays() -> None:
    array = np.arange(400, dtype=np.int64).reshape(20, 20)[:, ::2]
    decoded, frames = round_trip({"x": array}, dict)
    assert len(frames) == 2
    np.testing.assert_array_equal(decoded["x"], array)


@pytest.mark.parametrize("message", [
    AbortRequests(["a", "b"]),
    UtilityRequest(3, "get_stats"),
    UtilityResult(3, {"kv_blocks_free": 7, "gc_count": [1, 2, 3]}),
    UtilityResult(4, error="boom"),
    RequestError("r", "too long"),
])
def test_control_messages_round_trip(message) -> None:
    assert round_trip(message)[0] == message


def test_no_pickle_fallback() -> None:
    with pytest.raises(TypeError, match="cannot encode"):
        MsgpackEncoder().encode(UtilityResult(1, {"x": object()}))
    with pytest.raises(TypeError, match="Python objects"):
        MsgpackEncoder().encode({"x": np.array([object()] * 100)})


def test_tags_are_distinct_and_mapped() -> None:
    assert len(REQUEST_STRUCTS) == 3 and len(OUTPUT_STRUCTS) == 4
    assert all(len(tag) == 1 for tag in [*REQUEST_STRUCTS, *OUTPUT_STRUCTS])


@pytest.mark.parametrize("frames", [
    [b"\xc1garbage"],  # never-used msgpack byte
    [b""],
    [],
    [msgspec.msgpack.encode(["id", "not an array", {}, [], 0.0, 1])],  # wrong field types
    [msgspec.msgpack.encode(["id", msgspec.msgpack.Ext(2, msgspec.msgpack.encode(("<i4", (4,), 1))),
                             {}, [], 0.0, 1])],  # points at a missing frame
    [msgspec.msgpack.encode(["id", msgspec.msgpack.Ext(1, msgspec.msgpack.encode(("|O", (1,), b"12345678"))),
                             {}, [], 0.0, 1])],  # object dtype
    [msgspec.msgpack.encode(["id", msgspec.msgpack.Ext(1, msgspec.msgpack.encode(("<i4", (9,), b"1234"))),
                             {}, [], 0.0, 1])],  # shape does not match the bytes
    [msgspec.msgpack.encode(["id", msgspec.msgpack.Ext(9, b""), {}, [], 0.0, 1])],  # unknown ext
])
def test_malformed_input_raises_decode_error(frames) -> None:
    with pytest.raises(msgspec.DecodeError):
        MsgpackDecoder(EngineCoreRequest).decode(frames)


def test_truncated_frame_still_names_its_request() -> None:
    frames = MsgpackEncoder().encode(make_request(16, request_id="truncated-1"))
    cut = frames[0][: len(frames[0]) // 2]
    with pytest.raises(msgspec.DecodeError):
        MsgpackDecoder(EngineCoreRequest).decode([cut])
    assert peek_request_id(cut) == "truncated-1"
    assert peek_request_id(b"\xc1garbage") is None
    assert peek_request_id(frames[0][:3]) is None
    assert peek_request_id(msgspec.msgpack.encode(["x" * 40, 1])) == "x" * 40  # str8


def test_select_requests_splits_rows_finished_and_prompt_logprobs() -> None:
    outputs = EngineCoreOutputs(["a", "b", "c"], np.array([1, 2, 3], dtype=np.int32),
                                [FinishedRequest("c", FinishReason.STOP), FinishedRequest("a", FinishReason.LENGTH)])
    outputs.logprobs = np.array([[0.1], [0.2], [0.3]], dtype=np.float32)
    outputs.prompt_logprobs_req_ids = ["b", "c"]
    outputs.prompt_logprobs_starts = np.array([0, 4], dtype=np.int32)
    outputs.prompt_logprobs_offsets = np.array([0, 2, 5], dtype=np.int32)
    outputs.prompt_logprobs = np.arange(5, dtype=np.float32)[:, None]
    part = select_requests(outputs, {"a", "c"})
    assert part.req_ids == ["a", "c"] and part.new_token_ids.tolist() == [1, 3]
    assert part.logprobs[:, 0].tolist() == pytest.approx([0.1, 0.3])
    assert [f.request_id for f in part.finished] == ["c", "a"]
    assert part.prompt_logprobs_req_ids == ["c"] and part.prompt_logprobs_starts.tolist() == [4]
    assert part.prompt_logprobs_offsets.tolist() == [0, 3] and part.prompt_logprobs[:, 0].tolist() == [2, 3, 4]
    other = select_requests(outputs, {"b"})
    assert other.req_ids == ["b"] and other.finished == [] and other.prompt_logprobs_offsets.tolist() == [0, 2]
    assert select_requests(outputs, {"z"}).prompt_logprobs_req_ids == []


def test_select_requests_knows_every_output_field() -> None:
    """A new EngineCoreOutputs field must be taught to select_requests (or one client could
    receive another client's data)."""
    assert set(EngineCoreOutputs.__struct_fields__) == SELECTED_FIELDS


def step_outputs(req_ids: list[str], first_token: int) -> EngineCoreOutputs:
    return EngineCoreOutputs(list(req_ids), np.arange(first_token, first_token + len(req_ids), dtype=np.int32))


def test_repeated_request_ids_are_left_out_and_put_back() -> None:
    """Steady decode: a client's ids travel once, later messages name that message instead;
    through a change of ids, messages to another client in between, or one without ids, every
    client's rows stay its own."""
    sender, receivers = RequestIdsSender(), {b"A": RequestIdsReceiver(), b"B": RequestIdsReceiver()}
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    sends = [(b"A", ["a1", "a2"]), (b"A", ["a1", "a2"]), (b"A", ["a1", "a2"]), (b"A", []),
             (b"A", ["a1", "a2"]), (b"A", ["a2"]), (b"B", ["b1"]), (b"A", ["a2"]), (b"B", ["b1"]),
             (b"B", ["b1"])]
    left_out = 0
    for token, (client, req_ids) in enumerate(sends):
        frames = encoder.encode(sender.prepare(client, step_outputs(req_ids, 10 * token)))
        wire = decoder.decode(frames)
        left_out += wire.repeats_req_ids_of > 0
        received = receivers[client].restore(wire)
        assert received.req_ids == req_ids
        assert received.new_token_ids.tolist() == list(range(10 * token, 10 * token + len(req_ids)))
    # A's 2nd, 3rd, 5th (past a message without ids) and 8th (past B's), B's 2nd and 3rd
    assert left_out == 6


def test_ids_of_a_lost_message_are_refused_never_guessed() -> None:
    sender, receiver = RequestIdsSender(), RequestIdsReceiver()
    receiver.restore(sender.prepare(b"A", step_outputs(["x", "y"], 0)))
    sender.prepare(b"A", step_outputs(["y", "z"], 0))  # lost on the way
    repeat = sender.prepare(b"A", step_outputs(["y", "z"], 0))
    assert repeat.req_ids == [] and repeat.repeats_req_ids_of
    with pytest.raises(msgspec.DecodeError, match="did not receive"):
        receiver.restore(repeat)
    sender.forget(b"A")  # (what the output thread does when a message could not be encoded)
    assert receiver.restore(sender.prepare(b"A", step_outputs(["y", "z"], 0))).req_ids == ["y", "z"]


def test_a_client_the_sender_no_longer_remembers_gets_its_ids_again() -> None:
    sender = RequestIdsSender(max_clients=1)
    sender.prepare(b"A", step_outputs(["x"], 0))
    sender.prepare(b"B", step_outputs(["y"], 0))
    again = sender.prepare(b"A", step_outputs(["x"], 0))
    assert again.req_ids == ["x"] and not again.repeats_req_ids_of
    # A client whose ids repeat is one heard from lately: another client's message evicts the other.
    sender = RequestIdsSender(max_clients=2)
    for client in (b"A", b"B", b"A"):
        sender.prepare(client, step_outputs([client.decode()], 0))
    sender.prepare(b"C", step_outputs(["c"], 0))
    assert sender.prepare(b"A", step_outputs(["A"], 0)).repeats_req_ids_of
    assert not sender.prepare(b"B", step_outputs(["B"], 0)).repeats_req_ids_of


def test_addresses() -> None:
    assert normalize_address("tcp://:5555") == "tcp://127.0.0.1:5555"
    assert normalize_address("tcp://10.0.0.2:0") == "tcp://10.0.0.2:*"
    assert normalize_address("ipc:///tmp/x.sock") == "ipc:///tmp/x.sock"
    for bad in ("ipc://relative/x.sock", "tcp://host", "http://x:1", "/tmp/x"):
        with pytest.raises(ValueError, match="engine address"):
            normalize_address(bad)
    address = private_ipc_address()
    try:
        assert stat.S_IMODE(os.stat(address.private_dir).st_mode) == 0o700
        assert address.ipc_path.startswith(address.private_dir)
    finally:
        address.cleanup()
    assert not os.path.exists(address.private_dir)
