"""AsyncLLM over a spawned engine core: many concurrent streams in every output kind, abort
(explicit and by cancelling the consumer) frees the KV blocks, a SIGKILLed engine core fails
every pending generator with EngineDeadError within 2 s and leaves no process behind."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_utils import ENGINE_ARGS, process_gone, token_prompts
from vllm_lite import LLM, AsyncLLM, EngineArgs, EngineDeadError, SamplingParams
from vllm_lite.sampling_params import RequestOutputKind

MAX_TOKENS = 16
KINDS = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    event_loop = asyncio.new_event_loop()
    yield event_loop
    event_loop.close()


def start_engine(model: Path) -> AsyncLLM:
    return AsyncLLM.from_engine_args(EngineArgs(model=str(model), **ENGINE_ARGS))


def stop_engine(engine: AsyncLLM, loop: asyncio.AbstractEventLoop) -> None:
    engine.shutdown()
    loop.run_until_complete(asyncio.sleep(0))  # let cancelled tasks finish


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, loop: asyncio.AbstractEventLoop) -> Iterator[AsyncLLM]:
    async_llm = start_engine(tiny_llama)
    yield async_llm
    stop_engine(async_llm, loop)


@pytest.fixture(scope="module")
def prompts(_prompt_ids: tuple[tuple[int, ...], ...]) -> list[dict[str, list[int]]]:
    return token_prompts(_prompt_ids, 64)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, prompts: list[dict[str, list[int]]]) -> list[tuple[str, list[int]]]:
    llm = LLM(str(tiny_llama), multiprocess=False, **ENGINE_ARGS)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    return [(out.outputs[0].text, out.outputs[0].token_ids) for out in outputs]


def greedy(kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


def test_64_concurrent_streams(engine: AsyncLLM, loop: asyncio.AbstractEventLoop,
                               prompts: list[dict[str, list[int]]],
                               reference: list[tuple[str, list[int]]]) -> None:
    async def stream(i: int) -> list:
        return [out async for out in engine.generate(prompts[i], greedy(KINDS[i % 3]), f"stream-{i}")]

    async def run_all() -> list[list]:
        return await asyncio.gather(*(stream(i) for i in range(64)))

    results = loop.run_until_complete(run_all())
    for i, (outputs, (text, token_ids)) in enumerate(zip(results, reference)):
        completions = [out.outputs[0] for out in outputs]
        assert [out.finished for out in outputs] == [False] * (len(outputs) - 1) + [True]
        assert completions[-1].finish_reason == "length"
        if KINDS[i % 3] == RequestOutputKind.DELTA:
            assert "".join(c.text for c in completions) == text
            assert [t for c in completions for t in c.token_ids] == token_ids
            assert len(outputs) > 1
        elif KINDS[i % 3] == RequestOutputKind.CUMULATIVE:
            assert all(b.text.startswith(a.text) for a, b in zip(completions, completions[1:]))
            assert (completions[-1].text, completions[-1].token_ids) == (text, token_ids)
        else:
            assert len(outputs) == 1 and (completions[0].text, completions[0].token_ids) == (text, token_ids)
    stats = loop.run_until_complete(engine.get_stats())
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_step_processed_in_chunks_with_aborts_between_them(
        tiny_llama: Path, loop: asyncio.AbstractEventLoop, prompts: list[dict[str, list[int]]],
        reference: list[tuple[str, list[int]]]) -> None:
    """With one request per chunk, consumers run between the rows of a step: outputs still equal
    the in-process reference, and a request aborted by another consumer mid-step (its row not
    processed yet) ends with 'abort' and frees its blocks."""
    engine = AsyncLLM(EngineArgs(model=str(tiny_llama), **ENGINE_ARGS).create_engine_config(), output_chunk_size=1)
    victim = "chunk-victim"

    async def stream(i: int) -> list:
        outputs = []
        async for out in engine.generate(prompts[i], greedy(KINDS[i % 3]), f"chunk-{i}"):
            outputs.append(out)
            if i == 0 and len(outputs) == 2:
                await engine.abort(victim)
        return outputs

    async def victim_stream() -> list:
        long = greedy(RequestOutputKind.DELTA, max_tokens=200)
        return [out async for out in engine.generate({"prompt_token_ids": [9, 10, 11]}, long, victim)]

    async def run_all() -> tuple[list[list], list]:
        victim_task = asyncio.ensure_future(victim_stream())
        results = await asyncio.gather(*(stream(i) for i in range(12)))
        return results, await victim_task

    try:
        results, victim_outputs = loop.run_until_complete(run_all())
        for i, (outputs, (text, token_ids)) in enumerate(zip(results, reference)):
            last = outputs[-1].outputs[0]
            if KINDS[i % 3] == RequestOutputKind.DELTA:
                assert "".join(o.outputs[0].text for o in outputs) == text
                assert [t for o in outputs for t in o.outputs[0].token_ids] == token_ids
            else:
                assert (last.text, last.token_ids) == (text, token_ids)
        assert victim_outputs[-1].outputs[0].finish_reason == "abort"
        assert sum(len(o.outputs[0].token_ids) for o in victim_outputs) < 200
        stats = loop.run_until_complete(engine.get_stats())
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    finally:
        stop_engine(engine, loop)


def test_abort_and_cancel_free_kv_blocks(engine: AsyncLLM, loop: asyncio.AbstractEventLoop) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    received: dict[str, list] = {"aborted": [], "cancelled": [], "closed": []}

    async def consume(request_id: str) -> None:
        async for out in engine.generate({"prompt_token_ids": [5, 6, 7, 8]}, long, request_id):
            received[request_id].append(out)

    async def scenario() -> tuple[dict, dict]:
        tasks = {rid: asyncio.create_task(consume(rid)) for rid in ("aborted", "cancelled")}
        closed = engine.generate({"prompt_token_ids": [9, 10]}, long, "closed")
        await closed.__anext__()
        while not all(received[rid] for rid in tasks):
            await asyncio.sleep(0.01)
        busy = await engine.get_stats()
        await engine.abort("aborted")
        await tasks["aborted"]
        tasks["cancelled"].cancel()
        await asyncio.gather(tasks["cancelled"], return_exceptions=True)
        await closed.aclose()
        return busy, await engine.get_stats()

    busy, idle = loop.run_until_complete(scenario())
    assert busy["num_running"] == 3 and busy["kv_blocks_free"] < busy["kv_blocks_total"]
    last = received["aborted"][-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert not received["cancelled"][-1].finished
    assert idle["num_running"] == idle["num_waiting"] == 0
    assert idle["kv_blocks_free"] == idle["kv_blocks_total"]
    assert not engine.output_processor.has_unfinished_requests()


def test_engine_side_rejection_reaches_the_generator(engine: AsyncLLM, loop: asyncio.AbstractEventLoop) -> None:
    """A second client attached to the same engine core reuses a running request id: the engine
    core refuses it and only that generator raises (a ValueError); both keep working."""
    other = AsyncLLM.connect(engine.engine_core.address)
    long = greedy(RequestOutputKind.DELTA, max_tokens=100)

    async def scenario() -> list:
        first = engine.generate({"prompt_token_ids": [5, 6]}, long, "same-id")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            async for _ in other.generate({"prompt_token_ids": [7, 8]}, long, "same-id"):
                pass
        await first.aclose()
        assert (await engine.get_stats())["num_running"] == 0  # the abort landed (same socket, in order)
        return [out async for out in other.generate({"prompt_token_ids": [7, 8]}, greedy(), "same-id")]

    try:
        outputs = loop.run_until_complete(scenario())
        assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == MAX_TOKENS
    finally:
        stop_engine(other, loop)
    loop.run_until_complete(engine.check_health())  # the attached client's shutdown left it running


def test_output_handler_failure_fails_every_request_and_later_calls(
        tiny_llama: Path, loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only EngineDeadError: any exception in the output handler reaches every waiting
    generator and every later call at once, and the engine reports itself errored."""
    engine = start_engine(tiny_llama)

    def broken(*args: object) -> None:
        raise RuntimeError("detokenizer exploded")

    monkeypatch.setattr(engine.output_processor, "process_rows", broken)

    async def consume(i: int) -> BaseException | None:
        try:
            async for _ in engine.generate({"prompt_token_ids": [5, 6, 7 + i]}, greedy(), f"h-{i}"):
                pass
        except BaseException as exc:  # noqa: BLE001 - returned for the assertions
            return exc
        return None

    async def scenario() -> list[BaseException | None]:
        errors = await asyncio.wait_for(asyncio.gather(*(consume(i) for i in range(3))), 60)
        errors.append(await consume(99))
        with pytest.raises(EngineDeadError, match="output handler failed"):
            await engine.check_health()
        return errors

    try:
        errors = loop.run_until_complete(scenario())
        assert all(isinstance(e, EngineDeadError) and "detokenizer exploded" in str(e) for e in errors), errors
        assert engine.errored and "detokenizer exploded" in str(engine.dead_error)
    finally:
        stop_engine(engine, loop)


def test_sigkill_fails_every_pending_generator_within_2s(tiny_llama: Path,
                                                         loop: asyncio.AbstractEventLoop) -> None:
    engine = start_engine(tiny_llama)
    pid = engine.engine_core.engine_pid
    ipc_dir = os.path.dirname(engine.engine_core.address[len("ipc://"):])
    failed_at: dict[int, float] = {}
    started: dict[int, asyncio.Event] = {}

    async def stream(i: int) -> None:
        try:
            async for _ in engine.generate({"prompt_token_ids": [5 + i, 6]}, greedy(RequestOutputKind.DELTA, 240),
                                           f"doomed-{i}"):
                started[i].set()
        except EngineDeadError:
            failed_at[i] = time.monotonic()
            raise

    async def scenario() -> tuple[float, list]:
        for i in range(8):
            started[i] = asyncio.Event()
        tasks = [asyncio.create_task(stream(i)) for i in range(8)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started.values())), 30)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
        return killed_at, results

    try:
        killed_at, results = loop.run_until_complete(scenario())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert max(failed_at.values()) - killed_at < 2.0
        assert engine.errored

        async def new_calls() -> None:
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate({"prompt_token_ids": [5]}, greedy(), "late"):
                    pass
            with pytest.raises(EngineDeadError):
                await engine.get_stats()

        start = time.monotonic()
        loop.run_until_complete(new_calls())
        assert time.monotonic() - start < 0.5
    finally:
        stop_engine(engine, loop)
    assert process_gone(pid) and not os.path.exists(ipc_dir)
    assert pid not in {p.pid for p in multiprocessing.active_children()}


def test_vllms_engine_queries(tiny_llama: Path, loop: asyncio.AbstractEventLoop) -> None:
    """vLLM's AsyncLLM.from_vllm_config, is_running / is_stopped, get_supported_tasks and
    get_num_unfinished_requests, as code written against vLLM's AsyncLLM reads them."""
    engine = AsyncLLM.from_vllm_config(EngineArgs(model=str(tiny_llama), **ENGINE_ARGS).create_engine_config())

    async def during_a_stream() -> list[int]:
        counts = []
        params = SamplingParams(max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "query-1"):
            counts.append(engine.get_num_unfinished_requests())
        return counts

    try:
        assert engine.is_running and not engine.is_stopped
        assert loop.run_until_complete(engine.get_supported_tasks()) == ("generate",)
        counts = loop.run_until_complete(during_a_stream())
        assert counts[:-1] == [1] * (len(counts) - 1) and engine.get_num_unfinished_requests() == 0
    finally:
        stop_engine(engine, loop)
    assert engine.is_stopped and not engine.is_running
