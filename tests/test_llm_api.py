"""The LLM API surface: prompts of both forms, params lists, output order, chat."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from llm_factory import make_llm
from vllm_lite import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path) -> LLM:
    return LLM(str(tiny_qwen3), max_model_len=128, dtype="float32", multiprocess=False)


def test_string_and_token_prompts_agree(llm: LLM) -> None:
    text = "The quick brown fox"
    token_ids = llm.get_tokenizer().encode(text)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    by_text, by_ids = llm.generate([text, {"prompt_token_ids": token_ids}], params, use_tqdm=False)
    assert by_text.prompt == text and by_text.prompt_token_ids == token_ids
    assert by_ids.prompt is None
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == llm.get_tokenizer().decode(by_text.outputs[0].token_ids)
    assert by_text.outputs[0].finish_reason == "length"


def test_outputs_in_input_order_with_param_list(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": [5 + i] * (i + 1)} for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=i + 1, ignore_eos=True) for i in range(6)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3, 4, 5, 6]
    assert [o.prompt_token_ids for o in outputs] == [p["prompt_token_ids"] for p in prompts]


def test_shared_params_serve_every_prompt_and_stay_the_callers(llm: LLM) -> None:
    """One SamplingParams object for many prompts (and one repeated in a list beside another):
    each request gets its own outputs, and the caller's objects keep their output kind."""
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [9 + i, 20 + i]} for i in range(5)]
    outputs = llm.generate(prompts, [short, long, short, long, short], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 7, 3, 7, 3]
    assert [o.outputs[0].logprobs is not None for o in outputs] == [False, True, False, True, False]
    alone = llm.generate(prompts[1], long, use_tqdm=False)[0].outputs[0].token_ids
    assert outputs[1].outputs[0].token_ids == alone
    assert short.output_kind == long.output_kind == SamplingParams().output_kind


def test_param_list_length_mismatch(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling_params has 2 entries but there are 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_validation_errors_are_vllms_class_and_value_errors(llm: LLM) -> None:
    """Code written against vLLM catches `vllm.exceptions.VLLMValidationError` (not a ValueError
    there): SamplingParams, the per-prompt lists of `generate`, the prompt's checks and the engine
    core's refusals all raise it here, and it is a ValueError too."""
    from vllm_lite.exceptions import VLLMClientError, VLLMError, VLLMValidationError

    with pytest.raises(VLLMValidationError, match="top_p") as caught:
        SamplingParams(top_p=2.0)
    assert caught.value.parameter == "top_p" and isinstance(caught.value, ValueError)
    assert issubclass(VLLMValidationError, VLLMClientError) and issubclass(VLLMClientError, VLLMError)
    with pytest.raises(VLLMValidationError, match="sampling_params has 1 entries"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(VLLMValidationError, match="priority has 0 entries"):
        llm.generate(["a", "b"], priority=[], use_tqdm=False)
    with pytest.raises(VLLMValidationError, match="more than max_model_len=128"):
        llm.generate({"prompt_token_ids": [5] * 200}, use_tqdm=False)
    with pytest.raises(VLLMValidationError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [10**7]}, use_tqdm=False)
    assert len(llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False)) == 2  # still serving


def test_chat_applies_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>user\nhello<|im_end|>")
    assert out.prompt.endswith("<|im_start|>assistant\n")


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    first = llm.generate("Once upon", params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)] * 3 + [params]
    batch = llm.generate(["x", "y z", "w", "Once upon"], crowd, use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == first


def test_stats_fields(llm: LLM) -> None:
    stats = llm.stats()
    for key in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
                "kv_blocks_total", "kv_blocks_free"):
        assert isinstance(stats[key], int)


@pytest.mark.parametrize("multiprocess", [False, True])
def test_num_cached_tokens_and_metrics(tiny_qwen3: Path, multiprocess: bool) -> None:
    """num_cached_tokens is the prompt's prefix-cache hits (whole blocks), carried from the
    engine core; metrics are vLLM's RequestStateStats fields, filled on the client."""
    engine = LLM(str(tiny_qwen3), max_model_len=128, multiprocess=multiprocess, block_size=16,
                 enable_prefix_caching=True)
    try:
        prompt = {"prompt_token_ids": list(range(5, 5 + 40))}  # 2 full blocks + 8 tokens
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        started = time.time()
        first = engine.generate(prompt, params, use_tqdm=False)[0]
        second = engine.generate(prompt, params, use_tqdm=False)[0]
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == 32
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
        # vLLM's skip_reading_prefix_cache: the prompt computed whole, none of it read from the cache.
        skipped = engine.generate(prompt, params.clone_with(skip_reading_prefix_cache=True), use_tqdm=False)[0]
        assert skipped.num_cached_tokens == 0 and skipped.outputs[0].token_ids == first.outputs[0].token_ids
        stats = second.metrics
        assert stats.num_generation_tokens == 6
        assert started <= first.metrics.arrival_time <= stats.arrival_time <= time.time()
        # The engine core's times (one monotonic clock on one host): queued, scheduled, tokens.
        assert stats.arrival_ts <= stats.queued_ts <= stats.scheduled_ts <= stats.first_token_ts <= stats.last_token_ts
        assert 0 < stats.first_token_latency <= time.monotonic() - stats.arrival_ts
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("engine_args", "block_size"), [
    ({}, 128),  # vLLM's CPU default
    ({"attention_backend": "triton"}, 16),  # the Triton kernels' (vLLM's CUDA default)
    ({"block_size": 16}, 16),  # a given size is kept
    ({"block_size": 256}, 256),
])
def test_default_block_size_follows_the_platform(tiny_llama: Path, engine_args: dict, block_size: int) -> None:
    from vllm_lite.config import EngineArgs

    config = EngineArgs(model=str(tiny_llama), device="cpu", **engine_args).create_engine_config()
    assert config.cache_config.block_size == block_size


def test_max_num_seqs_full_length_requests_fit_the_capped_cache(tiny_llama: Path) -> None:
    """A large memory budget is capped at what max_num_seqs sequences of max_model_len tokens can
    use, and that cap counts the block the pool reserves: all of them run to the end together,
    none is preempted."""
    llm = make_llm(tiny_llama, max_num_seqs=4, max_model_len=64, block_size=16, kv_cache_memory_bytes=1 << 30)
    try:
        assert llm.stats()["kv_blocks_total"] == 4 * (64 // 16)
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": list(range(3, 19))}] * 4, params, use_tqdm=False)
        assert [len(out.outputs[0].token_ids) for out in outputs] == [48] * 4
        assert llm.stats()["num_preemptions"] == 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("engine_args", "async_scheduling"), [
    ({}, False),  # vLLM's CPU platform turns it off: the model already takes every core
    ({"async_scheduling": True}, True),  # asked for, it runs on CPU too
    ({"async_scheduling": False}, False),
])
def test_default_async_scheduling_follows_the_platform(tiny_llama: Path, engine_args: dict,
                                                       async_scheduling: bool) -> None:
    from vllm_lite.config import EngineArgs

    config = EngineArgs(model=str(tiny_llama), device="cpu", **engine_args).create_engine_config()
    assert config.scheduler_config.async_scheduling is async_scheduling


@pytest.mark.parametrize(("flags", "value"), [([], None), (["--async-scheduling"], True),
                                              (["--no-async-scheduling"], False)])
def test_async_scheduling_flag_leaves_the_default_to_the_platform(flags: list[str], value: bool | None) -> None:
    from vllm_lite.entrypoints.cli import build_parser
    from vllm_lite.entrypoints.cli_args import engine_args_from

    args = build_parser().parse_args(["serve", "some/model", *flags])
    assert engine_args_from(args).async_scheduling is value


def test_text_with_an_unpaired_surrogate_is_refused_by_field(llm: LLM) -> None:
    """Half of a surrogate pair (a "\\ud83d" JSON escape decodes to one) is no text: the tokenizer
    would fail with an unrelated message."""
    with pytest.raises(ValueError, match="prompt holds an unpaired UTF-16 surrogate '\\\\ud83d' at character 1"):
        llm.generate("a\ud83d", use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words holds an unpaired UTF-16 surrogate"):
        llm.generate("a", SamplingParams(bad_words=["\udc00"]), use_tqdm=False)


def test_a_prompt_key_this_engine_does_not_take_is_refused_by_name(llm: LLM) -> None:
    """A misspelt key (or vLLM's multi_modal_data for a text model) would otherwise be dropped:
    another prompt answered. None stands for an absent key."""
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(ValueError, match=r"prompt keys \['promt'\] are not supported"):
        llm.generate({"prompt": "hi", "promt": {"image": 1}}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="You must set `--enable-prompt-embeds`"):  # (tests/test_prompt_embeds.py)
        llm.generate({"prompt_embeds": {"image": 1}}, params, use_tqdm=False)
    # (tests/test_image_inputs.py: a model that takes images)
    with pytest.raises(ValueError, match="image inputs are not taken by this model: .*ForCausalLM is a text model"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": 1}}, params, use_tqdm=False)
    plain = llm.generate({"prompt": "hi"}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate({"prompt": "hi", "multi_modal_data": None}, params,
                        use_tqdm=False)[0].outputs[0].token_ids == plain
    for prompts in (None, 5):
        with pytest.raises(TypeError, match="prompts must be a string, a prompt dict or a list of them"):
            llm.generate(prompts, params, use_tqdm=False)


def test_enqueue_then_wait_for_completion(llm: LLM) -> None:
    """vLLM's enqueue / enqueue_chat add requests without running them; wait_for_completion runs
    them and returns their outputs in enqueue order; a generate meanwhile runs them too but
    returns only its own, and keeps theirs for wait_for_completion."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    conversation = [{"role": "user", "content": "hi"}]
    enqueued = llm.enqueue(["The quick", "brown fox"], params, use_tqdm=False)
    enqueued += llm.enqueue_chat(conversation, params, use_tqdm=False)
    (own,) = llm.generate(["jumps over"], params, use_tqdm=False)
    assert own.prompt == "jumps over"
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [output.request_id for output in outputs] == enqueued and all(output.finished for output in outputs)
    expected = llm.generate(["The quick", "brown fox"], params, use_tqdm=False) + llm.chat(conversation, params,
                                                                                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert llm.wait_for_completion(use_tqdm=False) == []
    llm.enqueue("The quick", params, use_tqdm=False)
    with pytest.raises(TypeError, match="expected"):
        llm.wait_for_completion(output_type=str, use_tqdm=False)


def test_from_engine_args_and_world_size(tiny_llama: Path) -> None:
    from vllm_lite.config import EngineArgs

    llm = LLM.from_engine_args(EngineArgs(model=str(tiny_llama), max_model_len=64, dtype="float32"),
                               multiprocess=False)
    try:
        assert llm.get_world_size() == llm.get_world_size(include_dp=False) == 1
        assert llm.llm_engine.vllm_config.model_config.max_model_len == 64
    finally:
        llm.shutdown()


def test_vllms_top_level_names_are_there(llm: LLM) -> None:
    """`from vllm import TokensPrompt, AsyncEngineArgs, ...` ported to vllm_lite: the names exist
    and mean what they do in vLLM (a TokensPrompt is a plain dict prompt)."""
    import vllm_lite
    from vllm_lite import (AsyncEngineArgs, AsyncLLM, AsyncLLMEngine, EngineArgs, LLMEngine, PromptType,  # noqa: F401
                           TextPrompt, TokensPrompt)

    assert AsyncLLMEngine is AsyncLLM and AsyncEngineArgs is EngineArgs
    assert LLMEngine is type(llm.llm_engine)
    assert set(vllm_lite.__all__) >= {"TextPrompt", "TokensPrompt", "PromptType", "LLMEngine", "AsyncLLMEngine"}
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    token_ids = llm.get_tokenizer().encode("The quick")
    by_ids, by_text = llm.generate([TokensPrompt(prompt_token_ids=token_ids), TextPrompt(prompt="The quick")],
                                   params, use_tqdm=False)
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    with pytest.raises(TypeError):
        AsyncEngineArgs(model="x", enable_log_requests=True)


def test_tokenization_kwargs_as_vllm_reads_them(tiny_qwen3: Path) -> None:
    """vLLM's `tokenization_kwargs` ("overrides for tokenizer.encode"): special tokens, and
    truncation of text and token prompts (the last tokens kept by default); other keys refused."""
    from tokenizers.processors import TemplateProcessing

    from vllm_lite.exceptions import VLLMValidationError

    llm = LLM(str(tiny_qwen3), max_model_len=64, dtype="float32", multiprocess=False)
    try:
        tokenizer = llm.get_tokenizer()
        bos = tokenizer.bos_token  # a tokenizer that adds a BOS, so the flag shows
        tokenizer._tokenizer.post_processor = TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))])
        text, params = "The quick brown fox jumps over the lazy dog", SamplingParams(max_tokens=1)
        plain = llm.generate(text, params, use_tqdm=False)[0]
        no_special = llm.generate(text, params, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False})[0]
        assert plain.prompt_token_ids == tokenizer.encode(text)
        assert no_special.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
        assert no_special.prompt == text
        ids = tokenizer.encode(text)
        left = llm.generate(text, params, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 3})[0]
        assert left.prompt_token_ids == ids[-3:] and left.prompt is None  # (truncated: no longer the text)
        right = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False, tokenization_kwargs={
            "truncation": True, "max_length": 4, "truncation_side": "right"})[0]
        assert right.prompt_token_ids == ids[:4]
        chat = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False,
                        tokenization_kwargs={"add_special_tokens": True})[0]
        assert chat.prompt_token_ids[0] == tokenizer.bos_token_id
        assert llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)[0].prompt_token_ids[0] \
            != tokenizer.bos_token_id
        for kwargs, message in (({"padding": "max_length"}, "key 'padding' is not supported"),
                                ({"truncate_prompt_tokens": 65}, "greater than max_model_len"),
                                ({"truncation_side": "middle"}, "truncation_side must be")):
            with pytest.raises(VLLMValidationError, match=message):
                llm.generate(text, params, use_tqdm=False, tokenization_kwargs=kwargs)
    finally:
        llm.shutdown()


def test_an_eos_id_outside_the_vocabulary_ends_nothing_and_fails_no_request(
        tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A generation_config.json whose eos_token_id lists an id the model cannot produce (past its
    vocabulary): every request was refused (the engine core checks each request's eos ids); the id
    is left out of the ends, with a warning naming it, and the others still end replies."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    reference = make_llm(tiny_llama)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=8)
        [first] = reference.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=1),
                                     use_tqdm=False)[0].outputs
    finally:
        reference.shutdown()
    ending = first.token_ids[0]  # (the reply's first token, made an end: the reply stops at once)
    generation = json.loads((model / "generation_config.json").read_text())
    generation["eos_token_id"] = [ending, vocab + 5]
    (model / "generation_config.json").write_text(json.dumps(generation))
    with caplog.at_level("WARNING", logger="vllm_lite.engine.tokenizer"):
        llm = make_llm(model)
    try:
        [output] = llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy, use_tqdm=False)[0].outputs
    finally:
        llm.shutdown()
    assert list(output.token_ids) == [ending] and output.finish_reason == "stop"
    assert any(f"eos_token_id [{vocab + 5}]" in record.getMessage() for record in caplog.records)
