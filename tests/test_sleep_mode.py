"""vLLM's sleep mode and pause: `LLM.sleep` / `wake_up` (level 0 pauses; level 1 also forgets the
prefix cache and releases every rank's KV cache on CPU), `AsyncLLM.pause_generation` /
`resume_generation` with vLLM's three modes (abort the requests in flight, wait for them, keep
them frozen), requests added meanwhile held until resumed; level 2 also lets the weights go, for
a trainer to load new ones. What RL trainers do around weight updates; the tokens after waking
are the tokens before (or the new weights')."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from async_streams import stream_to_end
from safetensors.torch import load_file

from hf_reference import build_tiny_model, hf_greedy
from llm_factory import make_llm
from vllm_lite import LLM, SamplingParams
from vllm_lite.config import EngineArgs

EXTENSION = "worker_extensions.WeightSync"
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 140))]  # (the last fills two KV blocks)
NUM_TOKENS = 24
LONG = 160
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def prompts() -> list[dict]:
    return [{"prompt_token_ids": p} for p in PROMPTS]


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama, PROMPTS, NUM_TOKENS)


@pytest.mark.parametrize("multiprocess, tp", [(False, 1), (True, 1), (True, 2)])
def test_level_1_releases_the_kv_cache_and_wake_up_brings_it_back(tiny_llama: Path, expected: list[list[int]],
                                                                  multiprocess: bool, tp: int) -> None:
    llm = make_llm(tiny_llama, multiprocess=multiprocess, worker_extension_cls=EXTENSION, block_size=16,
                   tensor_parallel_size=tp)
    try:
        assert greedy_tokens(llm) == expected
        assert llm.generate(prompts(), GREEDY, use_tqdm=False)[2].num_cached_tokens == 32  # (the prefix cache)
        assert llm.collective_rpc("kv_cache_layers") == [2] * tp
        llm.sleep(level=1)
        assert llm.llm_engine.is_sleeping() and llm.collective_rpc("kv_cache_layers") == [0] * tp
        assert llm.llm_engine.get_stats()["sleep_level"] == 1  # (vllm:engine_sleep_state)
        with pytest.raises(RuntimeError, match="the engine is asleep"):
            llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert llm.wake_up(["scheduling"]) is False  # (the KV cache is still released)
        assert llm.wake_up(["kv_cache"]) is True and not llm.llm_engine.is_sleeping()
        assert llm.collective_rpc("kv_cache_layers") == [2] * tp
        outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        assert outputs[2].num_cached_tokens == 0  # (level 1 forgot the prefix cache)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("multiprocess", [False, True])
def test_release_kv_cache_memory_after_a_completed_pause(tiny_llama: Path, expected: list[list[int]],
                                                         multiprocess: bool) -> None:
    """vLLM's: sleep(level=0) with nothing left, then the KV cache released; wake_up(["kv_cache"])."""
    llm = make_llm(tiny_llama, multiprocess=multiprocess, worker_extension_cls=EXTENSION)
    try:
        with pytest.raises(RuntimeError, match="requires a completed pause first"):
            llm.release_kv_cache_memory()
        llm.sleep(level=0)
        llm.release_kv_cache_memory()
        assert llm.collective_rpc("kv_cache_layers") == [0]
        with pytest.raises(RuntimeError, match="released already"):
            llm.release_kv_cache_memory()
        assert llm.wake_up(["kv_cache"]) is True
        assert greedy_tokens(llm) == expected
    finally:
        llm.shutdown()


def test_keep_freezes_requests_in_flight_and_they_finish_after_wake_up(tiny_llama: Path,
                                                                        expected: list[list[int]]) -> None:
    llm = make_llm(tiny_llama, multiprocess=True)
    try:
        llm.enqueue(prompts(), GREEDY, use_tqdm=False)  # (the engine core starts them at once)
        llm.sleep(level=0, mode="keep")
        assert llm.llm_engine.is_sleeping()
        assert llm.wake_up() is True
        outputs = llm.wait_for_completion(use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    finally:
        llm.shutdown()


def test_abort_ends_the_requests_and_wait_lets_them_finish(tiny_llama: Path, expected: list[list[int]]) -> None:
    llm = make_llm(tiny_llama)  # (in this process: nothing runs until the caller steps it)
    try:
        llm.enqueue(prompts(), GREEDY, use_tqdm=False)
        llm.sleep(level=1, mode="abort")
        llm.wake_up()
        outputs = llm.wait_for_completion(use_tqdm=False)
        assert [o.outputs[0].finish_reason for o in outputs] == ["abort"] * len(PROMPTS)
        with pytest.raises(ValueError, match="'wait' mode can't be used with the engine core in this process"):
            llm.sleep(level=0, mode="wait")
    finally:
        llm.shutdown()
    llm = make_llm(tiny_llama, multiprocess=True)
    try:
        llm.enqueue(prompts(), GREEDY, use_tqdm=False)
        llm.sleep(level=1, mode="wait")  # (returns once they have finished)
        llm.wake_up()
        outputs = llm.wait_for_completion(use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's shapes, other weights (what a trainer's step made)."""
    return build_tiny_model(tmp_path_factory.mktemp("other_llama_sleep"), "llama", tie_word_embeddings=False, seed=7)


@pytest.mark.parametrize("multiprocess, tp", [(False, 1), (True, 2)])
def test_level_2_lets_the_weights_go_and_a_trainer_loads_new_ones(tiny_llama: Path, other_llama: Path,
                                                                   multiprocess: bool, tp: int) -> None:
    """TRL's and verl's colocated cycle: sleep(level=2), wake_up(["weights"]), load the trained
    weights, wake_up(["kv_cache"]), generate. Waking before the weights are loaded is refused
    (they are zeros), a partial load too; the weights' memory is gone while asleep."""
    llm = make_llm(tiny_llama, multiprocess=multiprocess, worker_extension_cls=EXTENSION, block_size=16,
                   tensor_parallel_size=tp)
    try:
        assert all(elements > 0 for elements in llm.collective_rpc("weight_elements"))
        llm.sleep(level=2)
        assert llm.collective_rpc("weight_elements") == [0] * tp and llm.collective_rpc("kv_cache_layers") == [0] * tp
        assert llm.llm_engine.get_stats()["sleep_level"] == 2  # (vllm:engine_sleep_state)
        assert llm.wake_up(["weights"]) is False  # (the KV cache is still released)
        assert all(elements > 0 for elements in llm.collective_rpc("weight_elements"))
        llm.collective_rpc("update_weight", args=("model.norm.weight", load_file(other_llama / "model.safetensors")
                                                  ["model.norm.weight"]))
        with pytest.raises(RuntimeError, match="have not been loaded whole since wake_up"):
            llm.wake_up(["kv_cache"])
        with pytest.raises(RuntimeError, match="the engine is asleep"):
            llm.generate(prompts(), GREEDY, use_tqdm=False)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(other_llama)})
        assert llm.wake_up() is True and not llm.llm_engine.is_sleeping()
        assert greedy_tokens(llm) == hf_greedy(other_llama, PROMPTS, NUM_TOKENS)
    finally:
        llm.shutdown()


def test_level_2_counts_a_fused_layer_loaded_only_when_every_shard_is(tiny_llama: Path, other_llama: Path) -> None:
    """q, k and v load into one fused parameter (gate and up likewise): a trainer's checkpoint
    without k_proj leaves that layer's key rows unloaded, so the engine must not resume; the
    missing shard then makes it whole (and packed again)."""
    checkpoint = load_file(other_llama / "model.safetensors")
    missing_shard = "model.layers.0.self_attn.k_proj.weight"
    llm = make_llm(tiny_llama, worker_extension_cls=EXTENSION)
    try:
        llm.sleep(level=2)
        llm.wake_up(["weights"])
        llm.collective_rpc("update_weights", args=({k: v for k, v in checkpoint.items() if k != missing_shard},))
        with pytest.raises(RuntimeError, match=r"1 parameters \(over the ranks\) have not been loaded whole"):
            llm.wake_up(["kv_cache"])
        llm.collective_rpc("update_weight", args=(missing_shard, checkpoint[missing_shard]))
        assert llm.wake_up() is True
        assert greedy_tokens(llm) == hf_greedy(other_llama, PROMPTS, NUM_TOKENS)
    finally:
        llm.shutdown()


def test_level_2_on_ranks_whose_vocabulary_shard_has_padding_rows(tmp_path: Path) -> None:
    """A vocabulary of 1,001 over two ranks: the last rank's embedding and head shards have a row
    no checkpoint tensor fills. Loading the checkpoint again must count them whole."""
    model = build_tiny_model(tmp_path / "odd_vocab", "llama", tie_word_embeddings=False, seed=3,
                             extra_config={"vocab_size": 1001})
    llm = make_llm(model, multiprocess=True, tensor_parallel_size=2)
    try:
        llm.sleep(level=2)
        llm.wake_up(["weights"])
        llm.collective_rpc("reload_weights")
        assert llm.wake_up() is True
        assert greedy_tokens(llm) == hf_greedy(model, PROMPTS, NUM_TOKENS)
    finally:
        llm.shutdown()


def test_level_2_with_a_tied_head_repacks_it(tiny_llama_tied: Path) -> None:
    """The LM head shares the embedding's weight, packed for the CPU matmul on its own: both are
    back after the load."""
    llm = make_llm(tiny_llama_tied)
    try:
        def packed_layers(model) -> int:
            return sum(getattr(module, "packed_weight", None) is not None for module in model.modules())

        assert llm.apply_model(packed_layers)[0] > 0
        llm.sleep(level=2)
        assert llm.apply_model(packed_layers) == [0]  # (their packed copies let go too)
        llm.wake_up(["weights"])
        llm.collective_rpc("reload_weights")  # (the model's own checkpoint again)
        llm.wake_up()
        assert greedy_tokens(llm) == hf_greedy(tiny_llama_tied, PROMPTS, NUM_TOKENS)
        assert "NoneType" not in llm.apply_model(
            lambda model: type(model.lm_head.packed_weight).__name__)[0]
    finally:
        llm.shutdown()


def test_level_2_is_refused_where_weights_cannot_be_loaded_again(tiny_llama: Path, tiny_qwen3: Path) -> None:
    for model, arguments, message in ((tiny_llama, {"quantization": "int8"}, "quantization='int8' keeps layers "
                                       "quantized"),
                                      (tiny_qwen3, {"model_impl": "transformers"}, "the Transformers fallback's")):
        llm = make_llm(model, **arguments)
        try:
            with pytest.raises(ValueError, match=message):
                llm.sleep(level=2)
            assert not llm.llm_engine.is_sleeping()
        finally:
            llm.shutdown()


@pytest.mark.parametrize("arguments, message", [
    ({"level": 1, "mode": "keep"}, "would release the KV cache of the requests it keeps"),
    ({"level": 3}, "sleep level must be 0, 1 or 2, got 3"),
    ({"level": 0, "mode": "later"}, "pause mode must be one of \\('abort', 'wait', 'keep'\\), got 'later'"),
])
def test_what_sleep_does_not_implement_is_refused(tiny_llama: Path, arguments: dict, message: str) -> None:
    llm = make_llm(tiny_llama)
    try:
        with pytest.raises(ValueError, match=message):
            llm.sleep(**arguments)
        with pytest.raises(ValueError, match="wake_up tags must be among"):
            llm.wake_up(["gpu"])
        assert not llm.llm_engine.is_sleeping()
        with pytest.raises(ValueError, match="reset_running_requests=True"):
            llm.reset_prefix_cache(reset_running_requests=True)
        assert llm.reset_prefix_cache(reset_connector=True) is True
    finally:
        llm.shutdown()


def test_async_pause_modes(tiny_llama: Path, expected: list[list[int]]) -> None:
    from vllm_lite.engine.async_llm import AsyncLLM

    # (long enough that no stream ends before the pause reaches the engine)
    expected_long = hf_greedy(tiny_llama, PROMPTS, LONG)

    def stream(engine: AsyncLLM, request_id: str, prompt: list[int], started: asyncio.Event | None = None,
               max_tokens: int = LONG):
        return stream_to_end(engine, request_id, prompt, max_tokens, started)

    async def go() -> None:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_llama), max_model_len=256, dtype="float32"))
        try:
            # keep: the streams stop mid-way and finish after resume with the same tokens
            started = asyncio.Event()
            tasks = [asyncio.create_task(stream(engine, f"keep-{i}", p, started)) for i, p in enumerate(PROMPTS)]
            await started.wait()
            await engine.pause_generation(mode="keep")
            assert await engine.is_paused()
            held = asyncio.create_task(stream(engine, "held", PROMPTS[0]))  # added while paused: waits
            await asyncio.sleep(0.3)
            assert not any(task.done() for task in (*tasks, held))
            await engine.resume_generation()
            assert not await engine.is_paused()
            results = await asyncio.gather(*tasks, held)
            assert [list(r.token_ids) for r in results] == [*expected_long, expected_long[0]]
            # abort: the streams end at once, finish_reason abort
            started = asyncio.Event()
            tasks = [asyncio.create_task(stream(engine, f"abort-{i}", p, started)) for i, p in enumerate(PROMPTS)]
            await started.wait()
            await engine.pause_generation(mode="abort")
            results = await asyncio.gather(*tasks)
            assert [r.finish_reason for r in results] == ["abort"] * len(PROMPTS)
            await engine.resume_generation()
            # wait: returns once the streams have finished
            tasks = [asyncio.create_task(stream(engine, f"wait-{i}", p, max_tokens=NUM_TOKENS))
                     for i, p in enumerate(PROMPTS)]
            await asyncio.sleep(0)
            await engine.pause_generation(mode="wait")
            stats = await engine.get_stats()
            assert (stats["num_running"], stats["num_waiting"]) == (0, 0)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            assert [list(r.token_ids) for r in results] == expected
            assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
            await engine.resume_generation()
            await engine.sleep(level=1, mode="wait")
            assert await engine.is_sleeping()
            assert await engine.wake_up() is True and not await engine.is_sleeping()
            assert list((await stream(engine, "after", PROMPTS[1], max_tokens=NUM_TOKENS)).token_ids) == expected[1]
        finally:
            engine.shutdown()

    asyncio.run(go())


def test_admission_limits_refuse_requests_past_them(tiny_llama: Path, expected: list[list[int]]) -> None:
    """vLLM's max_num_queued_reqs / max_num_queued_tokens: a request past them is refused with
    vLLM's message (a 503 on the server), the others run; a pause keeps the counts still."""
    from vllm_lite.engine.async_llm import AsyncLLM
    from vllm_lite.entrypoints.openai.errors import describe_error
    from vllm_lite.exceptions import AdmissionRejectedError

    async def go(limits: dict) -> tuple[list, BaseException]:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_llama), max_model_len=256, dtype="float32",
                                                      **limits))
        rejected: list[str] = []  # (the server's vllm:admission_rejections counts them by limit)
        engine.admission_loggers.append(rejected.append)
        try:
            assert (await engine.get_stats())["sleep_level"] is None  # (vllm:engine_sleep_state: awake)
            await engine.pause_generation(mode="keep")  # (nothing runs: the requests stay queued)
            assert (await engine.get_stats())["sleep_level"] == 0
            tasks = [asyncio.create_task(stream_to_end(engine, f"r{i}", p, NUM_TOKENS))
                     for i, p in enumerate(PROMPTS[:2])]
            await asyncio.sleep(0.2)
            with pytest.raises(AdmissionRejectedError) as refused:
                await stream_to_end(engine, "over", PROMPTS[2], NUM_TOKENS)
            await engine.resume_generation()
            assert rejected == [refused.value.limit] == list(limits)
            return [list(r.token_ids) for r in await asyncio.gather(*tasks)], refused.value
        finally:
            engine.shutdown()

    results, refused = asyncio.run(go({"max_num_queued_reqs": 2}))
    assert results == expected[:2] and str(refused).startswith("The engine is currently busy")
    assert describe_error(refused)[0] == 503
    results, refused = asyncio.run(go({"max_num_queued_tokens": len(PROMPTS[0]) + len(PROMPTS[1])}))
    assert results == expected[:2] and "prefill token backlog limit" in str(refused)
