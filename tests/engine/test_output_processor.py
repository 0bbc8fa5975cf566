"""Acceptance 5: stop strings across token boundaries, stop_token_ids, min_tokens, ignore_eos
and max_tokens end generation exactly where they should; incremental detokenization
round-trips emoji and CJK fed token by token (and byte by byte)."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from hf_reference import IM_END_ID
from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.engine.detokenizer import FastIncrementalDetokenizer, SlowIncrementalDetokenizer, fast_backend
from vllm_lite.engine.output_processor import OutputProcessor
from vllm_lite.wire import EngineCoreOutputs, FinishedRequest, FinishReason
from vllm_lite.sampling_params import RequestOutputKind

TEXTS = ["🙂🚀🎉 👍🌍✨", "你好世界，今天天气很好。", "안녕하세요 龍龜鑫 東京", "héllo wörld naïve 🇯🇵 x=1.5e-3 ∑"]
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def _byte_token_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte (byte-level BPE's fallback alphabet, GPT-2's byte->char map)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    byte_to_char = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in byte_to_char:
            byte_to_char[b] = chr(256 + extra)
            extra += 1
    return tokenizer.convert_tokens_to_ids([byte_to_char[b] for b in text.encode()])


def _feed(processor: OutputProcessor, request_id: str, token_ids: list[int],
          finished: FinishedRequest | None = None) -> tuple[list, list[str]]:
    """One engine step per token; `finished` arrives with the last one."""
    outputs, to_abort = [], []
    for i, token_id in enumerate(token_ids):
        last = finished is not None and i == len(token_ids) - 1
        step = EngineCoreOutputs([request_id], np.array([token_id], dtype=np.int32), [finished] if last else [])
        states, aborts = processor.process_outputs(step)
        to_abort += aborts
        outputs += [out for state in states if (out := state.make_output()) is not None]
    return outputs, to_abort


def _delta_processor(tokenizer, token_ids_len: int, **params) -> OutputProcessor:
    processor = OutputProcessor(tokenizer)
    params.setdefault("output_kind", RequestOutputKind.DELTA)
    processor.add_request("r", None, PROMPT, SamplingParams(max_tokens=max(token_ids_len, 1), **params))
    return processor


# ---- incremental detokenization ----

@pytest.mark.parametrize("split", ["bpe", "bytes"])
@pytest.mark.parametrize("text", TEXTS)
def test_detokenize_round_trip_token_by_token(tokenizer, text: str, split: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False) if split == "bpe" else _byte_token_ids(tokenizer, text)
    assert tokenizer.decode(ids) == text
    processor = _delta_processor(tokenizer, len(ids), ignore_eos=True)
    outputs, _ = _feed(processor, "r", ids, FinishedRequest("r", FinishReason.LENGTH))
    deltas = [o.outputs[0].text for o in outputs]
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == text
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"


def test_incomplete_utf8_tail_is_flushed_at_the_end(tokenizer) -> None:
    ids = _byte_token_ids(tokenizer, "ok 🙂")[:-2]  # the emoji's last two bytes never come
    processor = _delta_processor(tokenizer, len(ids))
    outputs, _ = _feed(processor, "r", ids, FinishedRequest("r", FinishReason.LENGTH))
    assert "".join(o.outputs[0].text for o in outputs) == tokenizer.decode(ids)


@pytest.mark.parametrize("fast", [True, False])
def test_special_tokens_skipped_or_kept(tokenizer, fast: bool) -> None:
    ids = tokenizer.encode("a b", add_special_tokens=False) + [IM_END_ID] + tokenizer.encode(" c", add_special_tokens=False)
    for skip in (True, False):
        detok = (FastIncrementalDetokenizer(fast_backend(tokenizer), PROMPT, skip_special_tokens=skip) if fast
                 else SlowIncrementalDetokenizer(tokenizer, PROMPT, skip_special_tokens=skip))
        text = "".join(detok.add_tokens([t]) for t in ids) + detok.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=skip)


# ---- stop strings, stop tokens (client side, synthetic engine outputs) ----

def _boundary_stop(tokenizer, text: str) -> tuple[list[int], str, int, int]:
    """Token ids of `text`, a stop string spanning the boundary after token 2, where it starts
    in the text, and the index of the token that completes it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    boundary = len(tokenizer.decode(ids[:3]))
    stop = text[boundary - 2:boundary + 2]
    assert text.find(stop) == boundary - 2
    return ids, stop, boundary - 2, 3


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary(tokenizer, include: bool) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    ids, stop, start, completing = _boundary_stop(tokenizer, text)
    processor = _delta_processor(tokenizer, len(ids), stop=["zzz", stop], include_stop_str_in_output=include)
    outputs, to_abort = _feed(processor, "r", ids)
    final = outputs[-1]
    assert final.finished and to_abort == ["r"]
    completion = final.outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert "".join(o.outputs[0].text for o in outputs) == text[:start + len(stop) if include else start]
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == completing + 1  # later tokens dropped
    if not include:
        assert all(stop[:2] not in o.outputs[0].text for o in outputs)  # nothing of it leaked early


def test_stop_string_ignored_within_min_tokens(tokenizer) -> None:
    ids = tokenizer.encode(" the fox the end", add_special_tokens=False)
    processor = _delta_processor(tokenizer, len(ids), stop=[" the"], min_tokens=2)
    outputs, _ = _feed(processor, "r", ids)
    assert "".join(o.outputs[0].text for o in outputs) == " the fox"
    assert outputs[-1].outputs[0].stop_reason == " the"


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id_text_and_reason(tokenizer, include: bool) -> None:
    ids = tokenizer.encode(" quick brown fox", add_special_tokens=False)
    processor = _delta_processor(tokenizer, len(ids), stop_token_ids=[ids[-1]], include_stop_str_in_output=include)
    outputs, _ = _feed(processor, "r", ids, FinishedRequest("r", FinishReason.STOP, ids[-1]))
    completion = outputs[-1].outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", ids[-1])
    assert "".join(o.outputs[0].text for o in outputs) == tokenizer.decode(ids if include else ids[:-1])
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(ids)


def test_cumulative_and_final_only_kinds(tokenizer) -> None:
    ids = tokenizer.encode(" brown fox jumps", add_special_tokens=False)
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        processor = _delta_processor(tokenizer, len(ids), output_kind=kind)
        outputs, _ = _feed(processor, "r", ids, FinishedRequest("r", FinishReason.LENGTH))
        assert len(outputs) == (len(ids) if kind == RequestOutputKind.CUMULATIVE else 1)
        assert outputs[-1].outputs[0].text == " brown fox jumps" and outputs[-1].outputs[0].token_ids == ids


@pytest.mark.parametrize("finish", ["length", "eos", "abort"])
def test_final_only_is_looked_at_only_at_its_first_and_last_token(tokenizer, finish: str) -> None:
    """A final-only request without stop strings or logprobs costs no Python in the steps
    between its first and last token; its text, decoded once at the end, and its token ids
    equal those of the same tokens streamed (EOS's text left out, as when streamed)."""
    ids = tokenizer.encode(" brown fox jumps over the lazy dog", add_special_tokens=False)
    finished = {"length": FinishedRequest("r", FinishReason.LENGTH),
                "eos": FinishedRequest("r", FinishReason.STOP), "abort": None}[finish]
    results = {}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        processor = _delta_processor(tokenizer, len(ids), output_kind=kind)
        looked_at = []
        for i, token_id in enumerate(ids):
            last = finished is not None and i == len(ids) - 1
            step = EngineCoreOutputs(["r"], np.array([token_id], dtype=np.int32), [finished] if last else [])
            states, _ = processor.process_outputs(step)
            looked_at.append(len(states))
        if finish == "abort":
            states = processor.abort_requests(["r"])
        results[kind] = (looked_at, states[0].make_output().outputs[0])
    streamed, final = results[RequestOutputKind.CUMULATIVE][1], results[RequestOutputKind.FINAL_ONLY][1]
    assert results[RequestOutputKind.CUMULATIVE][0] == [1] * len(ids)
    ends_in_step = finish != "abort"
    assert results[RequestOutputKind.FINAL_ONLY][0] == [1] + [0] * (len(ids) - 2) + [int(ends_in_step)]
    assert (final.text, final.token_ids, final.finish_reason) == (streamed.text, streamed.token_ids,
                                                                  streamed.finish_reason)
    assert final.token_ids == ids
    assert final.text == tokenizer.decode(ids[:-1] if finish == "eos" else ids)


def test_kept_rows_follow_requests_coming_and_going(tokenizer) -> None:
    """The states of a step's rows are kept between steps while no request comes or goes: a
    step naming the same ids after an abort, a finish, or an id taken again by a new request must
    still give each token to its own request (delta outputs, one token per step, in chunks as
    AsyncLLM processes them)."""
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=50, output_kind=RequestOutputKind.DELTA, detokenize=False)
    ids = ["a", "b", "c", "d"]
    for request_id in ids:
        processor.add_request(request_id, None, PROMPT, params)
    received: dict[str, list[int]] = {request_id: [] for request_id in ids}
    rng = np.random.default_rng(0)

    def step(finished: list[FinishedRequest] = ()) -> None:
        outputs = EngineCoreOutputs(ids, rng.integers(100, 1000, len(ids)).astype(np.int32), list(finished))
        processor.begin_step(outputs)
        states = []
        for start in (0, 2):  # two chunks of two rows
            states += processor.process_rows(outputs, start, start + 2)[0]
        states += processor.end_step(outputs)
        for state in states:
            received[state.request_id] += state.make_output().outputs[0].token_ids
        sent = dict(zip(ids, outputs.new_token_ids.tolist()))
        for state in states:
            assert received[state.request_id][-1] == sent[state.request_id]

    step()
    step()
    processor.abort_requests(["b"])
    step()  # "b"'s row is passed over
    assert len(received["b"]) == 2 and len(received["a"]) == 3
    step([FinishedRequest("c", FinishReason.LENGTH)])
    processor.add_request("b", None, PROMPT, params)  # the id again, a new request
    received["b"] = []
    step()
    step()
    assert [len(received[r]) for r in ids] == [6, 2, 4, 6]


def test_abort_finishes_with_reason_abort(tokenizer) -> None:
    processor = _delta_processor(tokenizer, 4)
    (state,) = processor.abort_requests(["r"])
    assert state.make_output().outputs[0].finish_reason == "abort"
    assert not processor.has_unfinished_requests()


def test_logprob_rows_become_dicts(tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, PROMPT, SamplingParams(logprobs=1, prompt_logprobs=1, max_tokens=2))
    step = EngineCoreOutputs(
        ["r"], np.array([11], dtype=np.int32),
        logprob_token_ids=np.array([[11, 12, 13]], dtype=np.int32),
        logprobs=np.array([[-0.5, -0.25, -3.0]], dtype=np.float32),
        logprob_ranks=np.array([[2, 1, 2]], dtype=np.int32),
        prompt_logprobs_req_ids=["r"], prompt_logprobs_starts=np.array([1], dtype=np.int32),
        prompt_logprobs_offsets=np.array([0, 1], dtype=np.int32),
        prompt_logprob_token_ids=np.array([[7, 9, 8]], dtype=np.int32),
        prompt_logprobs=np.array([[-1.0, -0.1, -2.0]], dtype=np.float32),
        prompt_logprob_ranks=np.array([[3, 1, 2]], dtype=np.int32))
    states, _ = processor.process_outputs(step)
    out = states[0].make_output()
    (entry,) = out.outputs[0].logprobs
    assert list(entry) == [11, 12]  # the sampled token, then the top-1
    assert (entry[11].logprob, entry[11].rank, entry[11].decoded_token) == (-0.5, 2, tokenizer.decode([11]))
    assert out.outputs[0].cumulative_logprob == pytest.approx(-0.5)
    assert out.prompt_logprobs[0] is None and out.prompt_logprobs[1] is None  # position 1 not sent
    assert out.prompt_logprobs[2][7].rank == 3 and set(out.prompt_logprobs[2]) == {7, 9}


# ---- end to end through the engine ----

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama)


@pytest.fixture
def greedy(llm, prompts_token_ids):
    """An unconstrained greedy continuation of prompt 4 (no EOS in it)."""
    prompt = prompts_token_ids[4]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                     ignore_eos=True), use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    assert IM_END_ID not in tokens and 0 not in tokens
    return prompt, tokens


def _generate(llm, prompt, **params):
    params = {"temperature": 0.0, "max_tokens": MAX_TOKENS, **params}
    return llm.generate({"prompt_token_ids": prompt}, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def test_max_tokens_exact(llm, greedy) -> None:
    prompt, tokens = greedy
    out = _generate(llm, prompt, max_tokens=5, ignore_eos=True)
    assert out.token_ids == tokens[:5] and (out.finish_reason, out.stop_reason) == ("length", None)


def test_stop_token_ids_exact(llm, greedy, tokenizer) -> None:
    prompt, tokens = greedy
    i = next(i for i in range(3, MAX_TOKENS) if tokens[i] not in tokens[:i])
    out = _generate(llm, prompt, stop_token_ids=[tokens[i]])
    assert out.token_ids == tokens[:i + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", tokens[i])
    assert out.text == tokenizer.decode(tokens[:i])


def test_min_tokens_suppresses_eos_then_eos_stops(llm, greedy, tokenizer) -> None:
    prompt, tokens = greedy
    out = _generate(llm, prompt, min_tokens=5, logit_bias={IM_END_ID: 100.0})
    assert out.token_ids == tokens[:5] + [IM_END_ID]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.text == tokenizer.decode(tokens[:5])
    assert _generate(llm, prompt, logit_bias={IM_END_ID: 100.0}).token_ids == [IM_END_ID]


def test_ignore_eos_runs_to_max_tokens(llm, greedy) -> None:
    prompt, _ = greedy
    out = _generate(llm, prompt, max_tokens=6, ignore_eos=True, logit_bias={IM_END_ID: 100.0})
    assert out.token_ids == [IM_END_ID] * 6 and out.finish_reason == "length"


def test_stop_string_across_tokens_end_to_end(llm, greedy, tokenizer) -> None:
    prompt, tokens = greedy
    full = tokenizer.decode(tokens)
    for i in range(MAX_TOKENS - 1):
        boundary = len(tokenizer.decode(tokens[:i + 1]))
        stop = full[boundary - 1:boundary + 1]
        clean = "\ufffd" not in full[:boundary + 1] and full.startswith(tokenizer.decode(tokens[:i + 1]))
        if clean and len(stop) == 2 and full.find(stop) == boundary - 1 and len(tokenizer.decode(tokens[i + 1:i + 2])) > 1:
            break
    else:
        pytest.skip("no token boundary with a clean two-character stop string")
    out = _generate(llm, prompt, stop=[stop])
    assert out.text == full[:boundary - 1]
    assert out.token_ids == tokens[:i + 2]  # ends at the token that completed the stop string
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
