"""vLLM's data parallelism (`data_parallel_size`, `-dp`): engine cores that each hold the model,
requests balanced between them (the fewest unfinished first), outputs merged. Greedy tokens as
transformers', every engine serving, aborts reaching the engine that runs the request, calls that
concern all engines (collective_rpc, sleep) on each, each engine's process on its own CPU list."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from async_streams import stream_to_end
from hf_reference import hf_greedy
from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.config import EngineArgs

EXTENSION = "worker_extensions.WeightSync"
PROMPTS = [[5 + i, 6, 7 + i, 8, 9] for i in range(8)]
NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama, PROMPTS, NUM_TOKENS)


def test_two_engines_share_the_requests(tiny_llama: Path, expected: list[list[int]],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    llm = make_llm(tiny_llama, multiprocess=True, data_parallel_size=2, worker_extension_cls=EXTENSION)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        clients = llm.llm_engine.engine_core.clients
        assert all(client.get_stats()["num_steps"] > 0 for client in clients)  # (both engines served)
        assert llm.stats()["num_steps"] == sum(client.get_stats()["num_steps"] for client in clients)
        assert (llm.get_world_size(), llm.get_world_size(include_dp=False)) == (2, 1)
        assert llm.collective_rpc("cpu_affinity") == [[0], [1]]  # (each engine on its own CPU list)
        assert llm.llm_engine.engine_core.balance.load == [0, 0]  # (every request finished on its engine)
        llm.sleep(level=1)
        assert llm.collective_rpc("kv_cache_layers") == [0, 0]
        assert llm.wake_up() is True
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    finally:
        llm.shutdown()


def test_async_engines_stream_and_abort(tiny_llama: Path, expected: list[list[int]]) -> None:
    from vllm_lite.engine.async_llm import AsyncLLM
    from vllm_lite.entrypoints.openai.metrics import ServerMetrics
    from vllm_lite.metrics_reader import snapshot

    def stream(engine: AsyncLLM, request_id: str, prompt: list[int], max_tokens: int = NUM_TOKENS,
               started: asyncio.Event | None = None):
        return stream_to_end(engine, request_id, prompt, max_tokens, started, pace_s=0.05 if started else 0.0)

    async def go() -> None:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_llama), max_model_len=256, dtype="float32",
                                                      data_parallel_size=2))
        metrics = ServerMetrics("m", 256, num_engines=2)  # (the server's: each engine's series by its rank)
        engine.stat_loggers.append(metrics.record_iteration)
        try:
            results = await asyncio.gather(*(stream(engine, f"r{i}", p) for i, p in enumerate(PROMPTS)))
            assert [list(r.token_ids) for r in results] == expected
            served = {m.labels["engine"]: m.count for m in snapshot(metrics.registry)
                      if m.name == "vllm:request_queue_time_seconds"}
            assert sorted(served) == ["0", "1"] and all(served.values()) and sum(served.values()) == len(PROMPTS)
            metrics.render(await engine.get_stats())
            assert {m.labels["engine"] for m in snapshot(metrics.exposition)
                    if m.name == "vllm:num_requests_running"} == {"0", "1"}
            started = asyncio.Event()
            long = asyncio.create_task(stream(engine, "long", PROMPTS[0], max_tokens=240, started=started))
            await started.wait()
            await engine.abort("long")
            assert (await long).finish_reason == "abort"
            assert engine.engine_core.balance.load == [0, 0]
            stats = await engine.get_stats()
            assert stats["num_running"] == 0 and stats["kv_blocks_total"] == 2 * engine.engine_core.num_kv_blocks - 2
        finally:
            engine.shutdown()

    asyncio.run(go())


@pytest.mark.parametrize("arguments, message", [
    ({"data_parallel_size": 0}, "data_parallel_size must be >= 1"),
    ({"data_parallel_size": 2, "multiprocess": False}, "needs multiprocess=True"),
    ({"data_parallel_size": 2, "master_port": 29555}, "each with its own free port"),
])
def test_what_data_parallelism_does_not_take_is_refused(tiny_llama: Path, arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_llama, **arguments)


def test_vllm_flag_forms() -> None:
    from vllm_lite.entrypoints.cli import build_parser
    from vllm_lite.entrypoints.cli_args import engine_args_from

    for argv in (["serve", "-dp", "2"], ["serve", "--data-parallel-size", "2"]):
        assert engine_args_from(build_parser().parse_args(argv)).data_parallel_size == 2
