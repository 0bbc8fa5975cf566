"""vLLM's stream interval (`--stream-interval`, `SamplingParams.stream_interval`): a streamed
request gets an output at its first token, at its last, and otherwise once that many tokens have
come since the previous output; what is held back arrives whole in the next one (delta text,
token ids, logprobs), so the outputs still add up to the request's whole result."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.config import EngineArgs
from vllm_lite.engine.output_processor import OutputProcessor
from vllm_lite.engine.stats import IterationStats
from vllm_lite.outputs import RequestOutput
from vllm_lite.sampling_params import RequestOutputKind
from vllm_lite.wire import EngineCoreOutputs, FinishedRequest, FinishReason

PROMPT = [5, 6, 7]
TEXT = "The river runs past the old mill, and the stones are cold."
# Characters of several tokens each (byte-level BPE), so that intervals end inside them.
UNICODE_TEXTS = ["🙂🚀🎉 👍🌍✨", "你好世界，今天天气很好。", "héllo wörld naïve 🇯🇵 x=1.5e-3 ∑"]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def _outputs_per_step(processor: OutputProcessor, token_ids: list[int], reason: FinishReason = FinishReason.LENGTH
                      ) -> list[RequestOutput | None]:
    """One engine step per token, the request finished with the last; each step's output or None."""
    per_step = []
    for i, token_id in enumerate(token_ids):
        finished = [FinishedRequest("r", reason)] if i == len(token_ids) - 1 else []
        states, _ = processor.process_outputs(EngineCoreOutputs(["r"], np.array([token_id], dtype=np.int32), finished))
        outputs = [out for state in states if (out := state.make_output()) is not None]
        assert len(outputs) <= 1
        per_step.append(outputs[0] if outputs else None)
        if any(out.finished for out in outputs):
            break
    return per_step


def _processor(tokenizer, engine_interval: int = 1, **params) -> OutputProcessor:
    processor = OutputProcessor(tokenizer, stream_interval=engine_interval)
    params.setdefault("output_kind", RequestOutputKind.DELTA)
    processor.add_request("r", None, PROMPT, SamplingParams(max_tokens=64, ignore_eos=True, **params))
    return processor


def _emitted_at(per_step: list[RequestOutput | None]) -> list[int]:
    return [step + 1 for step, out in enumerate(per_step) if out is not None]


def test_delta_outputs_every_interval_and_add_up(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:10]
    per_step = _outputs_per_step(_processor(tokenizer, stream_interval=4), ids)
    assert _emitted_at(per_step) == [1, 5, 9, 10]  # the first at once, then every 4, the last at once
    outputs = [out for out in per_step if out is not None]
    assert [len(out.outputs[0].token_ids) for out in outputs] == [1, 4, 4, 1]
    assert [t for out in outputs for t in out.outputs[0].token_ids] == ids
    assert "".join(out.outputs[0].text for out in outputs) == tokenizer.decode(ids)
    assert [out.finished for out in outputs] == [False, False, False, True]


def test_cumulative_outputs_every_interval(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:8]
    per_step = _outputs_per_step(_processor(tokenizer, stream_interval=3, output_kind=RequestOutputKind.CUMULATIVE),
                                 ids)
    assert _emitted_at(per_step) == [1, 4, 7, 8]
    for step in _emitted_at(per_step):
        out = per_step[step - 1].outputs[0]
        assert list(out.token_ids) == ids[:step] and out.text == tokenizer.decode(ids[:step])


@pytest.mark.parametrize("interval", [2, 3, 5])
@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_text_decoded_per_interval_equals_the_whole(tokenizer, text: str, kind: RequestOutputKind,
                                                    interval: int) -> None:
    """A stream with an interval and no stop strings is decoded only when an output needs it,
    several tokens at once; its text is the same as decoding everything, with no partial
    characters in any output."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    per_step = _outputs_per_step(_processor(tokenizer, stream_interval=interval, output_kind=kind), ids)
    outputs = [out.outputs[0] for out in per_step if out is not None]
    assert all("\ufffd" not in out.text for out in outputs), [out.text for out in outputs]
    whole = "".join(out.text for out in outputs) if kind == RequestOutputKind.DELTA else outputs[-1].text
    assert whole == tokenizer.decode(ids) == text


def test_an_interval_stream_is_looked_at_only_when_it_sends(tokenizer) -> None:
    """Between outputs the client does not visit the request at all (its tokens go to the
    token store in the step's one scatter): it costs Python only once per interval."""
    processor = _processor(tokenizer, stream_interval=4)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:9]
    visited = []
    for step, token_id in enumerate(ids, 1):
        states, _ = processor.process_outputs(EngineCoreOutputs(["r"], np.array([token_id], dtype=np.int32), []))
        if states:
            visited.append(step)
            states[0].make_output()
    assert visited == [1, 5, 9]


def test_metrics_count_every_token_without_visiting_interval_streams(tokenizer) -> None:
    """With the server's metrics on, the step's tokens and inter-token latencies are counted over
    the rows at once: an interval stream is still visited only when it sends, and the numbers
    are those of a stream visited every token."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:9]
    step_times = [10.0, 10.5, 11.25, 11.5, 13.0, 13.5, 14.0, 14.25, 15.0]
    results = {}
    for interval in (1, 4):
        processor = OutputProcessor(tokenizer)
        for request_id in ("a", "b"):
            processor.add_request(request_id, None, PROMPT, SamplingParams(
                max_tokens=64, ignore_eos=True, stream_interval=interval, output_kind=RequestOutputKind.DELTA))
        visited, generated, prompt_tokens, latencies = [], 0, 0, []
        for step, (token_id, now) in enumerate(zip(ids, step_times), 1):
            rows = ["a", "b"] if step > 1 else ["a"]  # "b" starts a step later
            stats = IterationStats()
            states, _ = processor.process_outputs(EngineCoreOutputs(
                rows, np.full(len(rows), token_id, dtype=np.int32), [], timestamp=now), stats)
            visited.append(sorted(state.request_id for state in states))
            generated += stats.num_generation_tokens
            prompt_tokens += stats.num_prompt_tokens
            latencies += [round(float(x), 6) for batch in stats.inter_token_latencies for x in batch]
        results[interval] = (visited, generated, prompt_tokens, sorted(latencies))
    assert results[1][1:] == results[4][1:]
    assert results[1][1:3] == (17, 6)
    assert results[4][0] == [["a"], ["b"], [], [], ["a"], ["b"], [], [], ["a"]]


def test_eos_text_is_left_out_at_the_end_of_an_interval_stream(tokenizer) -> None:
    """The engine core stopped it on an EOS id: that token's text is not shown (vLLM's rule),
    as for a stream decoded token by token."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:6] + [tokenizer.eos_token_id]
    expected = tokenizer.decode(ids[:-1])
    for interval in (1, 4):
        per_step = _outputs_per_step(_processor(tokenizer, stream_interval=interval), ids, FinishReason.STOP)
        outputs = [out.outputs[0] for out in per_step if out is not None]
        assert "".join(out.text for out in outputs) == expected
        assert [t for out in outputs for t in out.token_ids] == ids


def test_interval_one_is_every_token(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:6]
    assert _emitted_at(_outputs_per_step(_processor(tokenizer), ids)) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(("engine", "request_interval", "effective"), [(4, None, 4), (4, 2, 4), (2, 5, 5)])
def test_the_longer_of_engine_and_request_interval_wins(tokenizer, engine: int, request_interval: int | None,
                                                        effective: int) -> None:
    """vLLM: a request's interval raises the engine's, never lowers it."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:12]
    per_step = _outputs_per_step(_processor(tokenizer, engine, stream_interval=request_interval), ids)
    assert _emitted_at(per_step) == [1, *range(1 + effective, 12, effective), 12]


def test_a_stop_string_ends_the_stream_between_intervals(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    processor = _processor(tokenizer, stream_interval=50, stop=["old mill"])
    per_step = _outputs_per_step(processor, ids)
    outputs = [out for out in per_step if out is not None]
    assert len(outputs) == 2 and outputs[-1].finished  # the first token, then the stop
    assert outputs[-1].outputs[0].finish_reason == "stop"
    assert "".join(out.outputs[0].text for out in outputs) == TEXT[:TEXT.index("old mill")]


def test_final_only_requests_are_unaffected(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:5]
    per_step = _outputs_per_step(_processor(tokenizer, 2, output_kind=RequestOutputKind.FINAL_ONLY), ids)
    assert _emitted_at(per_step) == [5]
    assert per_step[-1].outputs[0].text == tokenizer.decode(ids)


@pytest.mark.parametrize("bad", [0, -3, 2**31])
def test_bad_request_interval_is_refused_by_name(bad: int) -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        SamplingParams(stream_interval=bad)


def test_non_integer_request_interval_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        SamplingParams(stream_interval="4")


def test_engine_interval_below_one_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="stream_interval must be >= 1, got 0"):
        EngineArgs(model=str(tiny_llama), stream_interval=0).create_engine_config()


def test_engine_interval_reaches_the_llm_engine_outputs(tiny_llama: Path) -> None:
    """EngineArgs.stream_interval (`--stream-interval`) through a real engine: a delta request's
    outputs come every 3 tokens and add up to the same tokens as a request without it."""
    llm = make_llm(tiny_llama, stream_interval=3)
    engine = llm.llm_engine
    try:
        for request_id, interval in (("plain", None), ("wider", 5)):
            params = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, stream_interval=interval,
                                    output_kind=RequestOutputKind.DELTA)
            engine.add_request(request_id, {"prompt_token_ids": [3, 9, 27, 81]}, params)
        sizes: dict[str, list[int]] = {"plain": [], "wider": []}
        tokens: dict[str, list[int]] = {"plain": [], "wider": []}
        while engine.has_unfinished_requests():
            for out in engine.step():
                sizes[out.request_id].append(len(out.outputs[0].token_ids))
                tokens[out.request_id] += out.outputs[0].token_ids
    finally:
        llm.shutdown()
    assert sizes == {"plain": [1, 3, 3, 3, 1], "wider": [1, 5, 5]}
    assert tokens["plain"] == tokens["wider"] and len(tokens["plain"]) == 11
