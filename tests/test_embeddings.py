"""Embedding models (vLLM's pooling runner): the prompt's vector against transformers' final hidden
states on the same weights (fp32, CPU) pooled by hand: the last token, the mean, the first; with
chunked prefill, preemption and prefix caching; `*Model` checkpoints; sentence-transformers'
pooling config; and what is refused. The HTTP route: tests/entrypoints/test_embeddings_server.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hf_reference import hf_hidden_states
from llm_factory import make_llm
from vllm_lite import LLM, PoolingParams, SamplingParams
from vllm_lite.config import EngineArgs

POOLINGS = {"LAST": lambda h: h[-1], "MEAN": lambda h: h.mean(0), "CLS": lambda h: h[0]}


def hf_embedding(model_dir: Path, prompt: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    vector = POOLINGS[pooling](hf_hidden_states(model_dir, prompt))
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def embeddings(llm: LLM, prompts: list[list[int]], **kwargs) -> list[torch.Tensor]:
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False, **kwargs)
    return [torch.tensor(out.outputs.embedding) for out in outputs]


def assert_close(ours: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("pooling", POOLINGS)
def test_pooled_hidden_states_match_transformers(pooling: str, tiny_qwen3: Path,
                                                 prompts_token_ids: list[list[int]]) -> None:
    """Chunks of 16 tokens: the 90-token prompt takes six steps (MEAN sums across them)."""
    prompts = prompts_token_ids[::2]
    llm = make_llm(tiny_qwen3, runner="pooling", pooler_config={"pooling_type": pooling},
                   max_num_batched_tokens=16)
    try:
        assert_close(embeddings(llm, prompts), [hf_embedding(tiny_qwen3, p, pooling) for p in prompts])
        raw = embeddings(llm, prompts[:2], pooling_params=PoolingParams(use_activation=False))
        assert_close(raw, [hf_embedding(tiny_qwen3, p, pooling, normalize=False) for p in prompts[:2]])
        assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is (pooling == "LAST")
    finally:
        llm.shutdown()


def test_engine_core_process_with_requests_queued_for_blocks(tiny_qwen3: Path,
                                                             prompts_token_ids: list[list[int]]) -> None:
    """The vectors travel from the engine core's process; with seven blocks of 16 for all eight
    prompts, they take turns (admitted as blocks free)."""
    llm = make_llm(tiny_qwen3, runner="pooling", pooler_config={"pooling_type": "MEAN"}, multiprocess=True,
                   num_kv_blocks=7, block_size=16, max_num_batched_tokens=32)
    try:
        expected = [hf_embedding(tiny_qwen3, p, "MEAN") for p in prompts_token_ids]
        assert_close(embeddings(llm, prompts_token_ids), expected)
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    finally:
        llm.shutdown()


def test_prefix_cache_hits_give_the_same_vector(tiny_qwen3: Path, prompts_token_ids: list[list[int]]) -> None:
    prompt = prompts_token_ids[-1]
    llm = make_llm(tiny_qwen3, runner="pooling", block_size=16)
    try:
        first = embeddings(llm, [prompt])
        second = llm.embed([{"prompt_token_ids": prompt}], use_tqdm=False)[0]
        assert second.num_cached_tokens >= 80
        assert_close([torch.tensor(second.outputs.embedding)], first)
    finally:
        llm.shutdown()


def decoder_only_checkpoint(model: Path, folder: Path) -> Path:
    """The checkpoint as an embedding model ships it: `Qwen3Model`, no LM head, no `model.` prefix."""
    from transformers import AutoModel

    out = folder / "qwen3-model"
    AutoModel.from_pretrained(model, dtype=torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model / name).exists():
            shutil.copy(model / name, out / name)
    return out


def test_a_model_architecture_runs_as_an_embedding_model(tiny_qwen3: Path, tmp_path: Path,
                                                          prompts_token_ids: list[list[int]]) -> None:
    checkpoint = decoder_only_checkpoint(tiny_qwen3, tmp_path)
    assert json.loads((checkpoint / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    llm = make_llm(checkpoint)  # runner "auto": a *Model is an embedding model
    try:
        prompts = prompts_token_ids[:3]
        assert_close(embeddings(llm, prompts), [hf_embedding(tiny_qwen3, p, "LAST") for p in prompts])
        with pytest.raises(ValueError, match=r"LLM.generate\(\) is not supported for pooling models"):
            llm.generate("hi", SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="has no language-model head: it runs with runner='pooling'"):
        EngineArgs(model=str(checkpoint), runner="generate").create_engine_config()


def with_sentence_transformers(model: Path, folder: Path, pooling: dict, normalize: bool = True) -> Path:
    out = folder / "st"
    shutil.copytree(model, out)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    return out


def pooler(model: Path, **engine_args) -> tuple[str, bool]:
    config = EngineArgs(model=str(model), runner="pooling", **engine_args).create_engine_config().model_config.pooler
    return config.pooling_type, config.normalize


def test_sentence_transformers_pooling_config_is_read(tiny_qwen3: Path, tmp_path: Path) -> None:
    assert pooler(tiny_qwen3) == ("LAST", True)  # a converted causal LM: vLLM's default
    mean = with_sentence_transformers(tiny_qwen3, tmp_path / "a", {"pooling_mode_mean_tokens": True}, normalize=False)
    assert pooler(mean) == ("MEAN", False)
    assert pooler(mean, pooler_config={"pooling_type": "CLS", "use_activation": True}) == ("CLS", True)
    last = with_sentence_transformers(tiny_qwen3, tmp_path / "b", {"pooling_mode_lasttoken": True,
                                                                    "include_prompt": True})
    assert pooler(last) == ("LAST", True)
    maximum = with_sentence_transformers(tiny_qwen3, tmp_path / "c", {"pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="sentence-transformers pooling 'pooling_mode_max_tokens'.*not implemented"):
        pooler(maximum)
    instructed = with_sentence_transformers(tiny_qwen3, tmp_path / "d", {"pooling_mode_mean_tokens": True,
                                                                          "include_prompt": False})
    with pytest.raises(ValueError, match="include_prompt=false"):
        pooler(instructed)


@pytest.mark.parametrize(("engine_args", "message"), [
    ({"runner": "pooling", "pooler_config": {"normalize": True}}, "`normalize` was removed in vLLM; use `use_activation`"),
    ({"runner": "pooling", "pooler_config": {"dimensions": 8}}, "pooler_config: dimensions not implemented"),
    ({"runner": "pooling", "pooler_config": {"pooling_type": "ALL"}}, "pooling_type must be one of"),
    ({"runner": "pooling", "pooler_config": {"pooling_type": "MEAN"}, "enable_prefix_caching": True},
     "enable_prefix_caching with pooling_type 'MEAN'"),
    ({"runner": "pooling", "convert": "none"}, "convert='none' with runner='pooling'"),
    ({"convert": "classify"}, r"convert='classify' makes a classifier of a \*ForSequenceClassification checkpoint"),
    ({"convert": "reward"}, "convert must be one of"),
    ({"runner": "encode"}, "runner must be one of"),
    ({"pooler_config": {"pooling_type": "LAST"}, "runner": "generate"}, "are for the pooling runner"),
])
def test_pooling_arguments_are_checked(tiny_qwen3: Path, engine_args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(tiny_qwen3), **engine_args).create_engine_config()


def test_each_runner_refuses_the_others_requests(tiny_qwen3: Path) -> None:
    llm = make_llm(tiny_qwen3)
    try:
        with pytest.raises(ValueError, match=r"LLM.embed\(\) is only supported for pooling models"):
            llm.embed("hi")
        with pytest.raises(ValueError, match="embeddings need an embedding model"):
            llm.llm_engine.add_pooling_request("x", "hi")
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="dimensions must be an int or None"):
        PoolingParams(dimensions=8.0)


def test_matryoshka_dimensions_take_the_first_numbers(tiny_qwen3: Path, prompts_token_ids: list[list[int]]) -> None:
    """vLLM's rules: only for a model whose config says it was trained so (here by hf_overrides,
    as vLLM's docs do for Qwen3-Embedding), within its listed sizes; normalized after the cut."""
    prompt = prompts_token_ids[3]
    full = hf_embedding(tiny_qwen3, prompt, "LAST", normalize=False)
    llm = make_llm(tiny_qwen3, runner="pooling", hf_overrides={"matryoshka_dimensions": [16, 32]})
    try:
        cut = embeddings(llm, [prompt], pooling_params=PoolingParams(dimensions=16))
        assert_close(cut, [torch.nn.functional.normalize(full[:16], dim=-1)])
        for dimensions, message in ((20, r"only supports Matryoshka dimensions \[16, 32\], got 20"),
                                    (100, r"only supports dimensions in range \[1, 64\], got 100")):
            with pytest.raises(ValueError, match=message):
                llm.embed([{"prompt_token_ids": prompt}], pooling_params=PoolingParams(dimensions=dimensions))
    finally:
        llm.shutdown()
    llm = make_llm(tiny_qwen3, runner="pooling")
    try:
        with pytest.raises(ValueError, match="does not support Matryoshka embeddings; dimensions must be unset"):
            llm.embed("hi", pooling_params=PoolingParams(dimensions=16))
    finally:
        llm.shutdown()


def test_async_encode_and_abort(tiny_qwen3: Path, prompts_token_ids: list[list[int]]) -> None:
    """AsyncLLM.encode (the server's path): the vector, and for a request aborted before it has
    one, RequestAbortedError in its consumer (not a hang)."""
    import asyncio

    from vllm_lite import AsyncLLM
    from vllm_lite.exceptions import RequestAbortedError

    async def scenario(engine: AsyncLLM) -> tuple[list[float], BaseException | None]:
        prompt = {"prompt_token_ids": prompts_token_ids[-1]}
        outputs = [out async for out in engine.encode(prompt, None, "one")]
        stream = engine.encode(prompt, PoolingParams(use_activation=False), "two")
        pending = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        await engine.abort("two")
        try:
            await pending
        except RequestAbortedError as exc:
            return outputs[0].outputs.embedding, exc
        return outputs[0].outputs.embedding, None

    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_qwen3), runner="pooling", dtype="float32",
                                                  max_model_len=256))
    try:
        vector, aborted = asyncio.run(scenario(engine))
    finally:
        engine.shutdown()
    assert_close([torch.tensor(vector)], [hf_embedding(tiny_qwen3, prompts_token_ids[-1], "LAST")])
    assert isinstance(aborted, RequestAbortedError)



def test_llm_score_is_the_cosine_of_transformers_embeddings(tiny_qwen3: Path) -> None:
    """vLLM's `LLM.score` on an embedding model: 1 : N and N : N pairs, each the cosine similarity
    of the two texts' pooled hidden states (transformers'), with the pair's token ids joined."""
    from vllm_lite import ScoringRequestOutput
    from vllm_lite.exceptions import VLLMValidationError

    llm = make_llm(tiny_qwen3, runner="pooling", pooler_config={"pooling_type": "MEAN"})
    try:
        tokenizer = llm.get_tokenizer()
        texts = ["water", "The river flows to the sea.", "A cat sleeps."]
        ids = [tokenizer.encode(t) for t in texts]
        vectors = [hf_embedding(tiny_qwen3, i, "MEAN") for i in ids]
        one_to_n = llm.score(texts[0], texts[1:], use_tqdm=False)
        assert all(isinstance(out, ScoringRequestOutput) for out in one_to_n)
        want = [torch.nn.functional.cosine_similarity(vectors[0], v, dim=0).item() for v in vectors[1:]]
        assert [out.outputs.score for out in one_to_n] == pytest.approx(want, abs=1e-5)
        pad = [] if tokenizer.pad_token_id is None else [tokenizer.pad_token_id]
        assert one_to_n[1].prompt_token_ids == ids[0] + pad + ids[2]
        pairwise = llm.score(texts[:2], texts[1:], use_tqdm=False)
        assert pairwise[1].outputs.score == pytest.approx(
            torch.nn.functional.cosine_similarity(vectors[1], vectors[2], dim=0).item(), abs=1e-5)
        with pytest.raises(VLLMValidationError, match="either 1:1, 1:N or N:N"):
            llm.score(texts[:2], texts, use_tqdm=False)
        with pytest.raises(VLLMValidationError, match="data_2 must be a text or a list of texts"):
            llm.score("a", {"prompt_token_ids": [1, 2]}, use_tqdm=False)
        # vLLM's default side for an embedding model is "right": the text's first tokens are kept.
        truncated = llm.embed("The river flows to the sea.", truncate_prompt_tokens=3, use_tqdm=False)[0]
        assert truncated.prompt_token_ids == tokenizer.encode("The river flows to the sea.")[:3]
        assert llm.embed("The river flows to the sea.", truncate_prompt_tokens=3, use_tqdm=False,
                         tokenization_kwargs={"truncation_side": "left"})[0].prompt_token_ids == \
            tokenizer.encode("The river flows to the sea.")[-3:]
        assert llm.embed("The river flows to the sea.", tokenization_kwargs={"truncate_prompt_tokens": 3},
                         use_tqdm=False)[0].prompt_token_ids == truncated.prompt_token_ids
        with pytest.raises(ValueError, match="chat_template is not supported"):
            llm.score("a", "b", chat_template="{{ x }}", use_tqdm=False)
    finally:
        llm.shutdown()


def test_llm_encode_is_embed_as_tensors(tiny_qwen3: Path, prompts_token_ids: list[list[int]]) -> None:
    """vLLM's LLM.encode with pooling_task="embed": the embeddings as PoolingOutput tensors; its
    other tasks and a missing task are refused by name."""
    llm = make_llm(tiny_qwen3, runner="pooling")
    try:
        prompts = [{"prompt_token_ids": p} for p in prompts_token_ids[:2]]
        encoded = llm.encode(prompts, pooling_task="embed", use_tqdm=False)
        assert [out.outputs.data.tolist() for out in encoded] == [
            out.outputs.embedding for out in llm.embed(prompts, use_tqdm=False)]
        with pytest.raises(ValueError, match="pooling_task required"):
            llm.encode(prompts, use_tqdm=False)
        with pytest.raises(ValueError, match="pooling_task 'token_embed' is not supported"):
            llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
        with pytest.raises(ValueError, match="Classification API is not supported by this model"):
            llm.encode(prompts, pooling_task="classify", use_tqdm=False)
    finally:
        llm.shutdown()
