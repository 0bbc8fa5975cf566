"""Backpressure (issue 12, finding 10 and acceptance 4): a slow consumer's outputs are merged
into one pending output, never queued step by step; consumers that stop reading have their
requests aborted in the engine core, and a client reading normally beside them gets the same
greedy tokens as alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine_utils import ENGINE_ARGS, wait_until
from vllm_lite import AsyncLLM, EngineArgs, SamplingParams
from vllm_lite.engine.output_collector import ConsumerStoppedReadingError, RequestOutputCollector
from vllm_lite.entrypoints.openai.serving import merge_streams
from vllm_lite.outputs import CompletionOutput, RequestOutput
from vllm_lite.sampling_params import RequestOutputKind

DELTA = RequestOutputKind.DELTA


def _output(index: int, token: int, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(index, f"<{token}>", [token], finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1, 2], [completion], finished)


def test_collector_merges_for_a_slow_consumer() -> None:
    """Delta outputs merge per completion index (n > 1 shares a collector); cumulative ones are
    replaced; past max_unread, put reports the consumer as stopped."""
    collector = RequestOutputCollector(DELTA, max_unread=5)
    for step in range(5):
        assert collector.put(_output(step % 2, 10 + step))
    assert not collector.put(_output(0, 99, finished=True))
    merged = asyncio.run(collector.get())
    assert merged.finished and [c.index for c in merged.outputs] == [0, 1]
    assert merged.outputs[0].token_ids == [10, 12, 14, 99] and merged.outputs[0].text == "<10><12><14><99>"
    assert merged.outputs[1].token_ids == [11, 13] and merged.outputs[0].finish_reason == "length"
    cumulative = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
    cumulative.put(_output(0, 1))
    cumulative.put(_output(0, 2))
    assert asyncio.run(cumulative.get()).outputs[0].token_ids == [2]


def test_unread_streams_are_aborted_beside_a_normal_client(tiny_llama: Path) -> None:
    """Acceptance 4: 100 streams never read, beside one client that reads: the reader's tokens
    equal those it got alone, each unread stream holds one pending item (an error) and is
    aborted in the engine core: nothing running or waiting, every KV block free."""
    loop = asyncio.new_event_loop()
    engine = AsyncLLM(EngineArgs(model=str(tiny_llama), **ENGINE_ARGS).create_engine_config(),
                      max_unread_outputs=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, output_kind=DELTA)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}

    async def read(request_id: str) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(prompt, params, request_id):
            tokens += out.outputs[0].token_ids
        return tokens

    async def scenario() -> tuple[list[int], list[int], list[RequestOutputCollector]]:
        alone = await read("alone")
        unread = [await engine.add_request(f"unread-{i}", {"prompt_token_ids": [3 + i % 50, 4, 5]},
                                           params.clone_with(max_tokens=200)) for i in range(100)]
        beside = await read("beside")
        await asyncio.sleep(0)
        return alone, beside, unread

    try:
        alone, beside, unread = loop.run_until_complete(scenario())
        assert beside == alone and len(alone) == 24
        assert all(isinstance(c.pending, ConsumerStoppedReadingError) for c in unread)
        assert not engine.output_processor.request_states

        def engine_idle() -> bool:
            stats = loop.run_until_complete(engine.get_stats())
            return (stats["num_running"] == stats["num_waiting"] == 0
                    and stats["kv_blocks_free"] == stats["kv_blocks_total"])

        assert wait_until(engine_idle, timeout_s=30)
        assert loop.run_until_complete(read("after")) == alone
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


def test_an_unread_merged_stream_is_aborted_beside_a_normal_client(tiny_llama: Path) -> None:
    """The server merges the streams of a completion request with several prompts: when its
    client stops reading, the merge stops reading too, so the requests are aborted as a single
    unread stream is, and reading again raises the error; the client beside it is unaffected."""
    loop = asyncio.new_event_loop()
    engine = AsyncLLM(EngineArgs(model=str(tiny_llama), **ENGINE_ARGS).create_engine_config(),
                      max_unread_outputs=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, output_kind=DELTA)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}

    async def read(request_id: str) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(prompt, params, request_id):
            tokens += out.outputs[0].token_ids
        return tokens

    long_run = params.clone_with(max_tokens=200)
    merged = merge_streams([engine.generate({"prompt_token_ids": [3 + i, 4, 5]}, long_run, f"merged-{i}")
                            for i in range(3)])

    async def scenario() -> tuple[list[int], list[int]]:
        alone = await read("alone")
        await anext(merged)  # then nothing: the client stopped reading
        beside = await read("beside")
        return alone, beside

    def engine_idle() -> bool:
        stats = loop.run_until_complete(engine.get_stats())
        return (stats["num_running"] == stats["num_waiting"] == 0
                and stats["kv_blocks_free"] == stats["kv_blocks_total"])

    async def read_the_rest() -> None:
        async for _ in merged:
            pass

    try:
        alone, beside = loop.run_until_complete(scenario())
        assert beside == alone and len(alone) == 24
        assert wait_until(engine_idle, timeout_s=30)
        with pytest.raises(ConsumerStoppedReadingError):
            loop.run_until_complete(read_the_rest())
    finally:
        loop.run_until_complete(merged.aclose())
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
