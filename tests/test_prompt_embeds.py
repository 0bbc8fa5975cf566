"""vLLM's prompt embeddings (`enable_prompt_embeds`, `{"prompt_embeds": tensor}`): a prompt given as
the model's input embeddings generates transformers' greedy tokens for the same `inputs_embeds`
(random rows, not any token's), beside token prompts, in chunks, after a preemption, on a spawned
engine and TP=2, on the Transformers fallback; their KV blocks are shared by equal embeddings
only; repetition penalties see no prompt tokens (as transformers' with `inputs_embeds`); what
cannot hold is refused by name, in the client and in the engine core."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from hf_reference import hf_greedy, hf_greedy_from_embeds
from llm_factory import make_llm
from test_parity import assert_no_leaked_blocks
from vllm_lite import SamplingParams
from vllm_lite.config import EngineArgs
from vllm_lite.engine.core import EngineCore
from vllm_lite.engine.input_processor import InputProcessor

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def random_embeds(lengths: tuple[int, ...], width: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, width, generator=generator) for n in lengths]


def width_of(model: Path) -> int:
    return EngineArgs(model=str(model)).create_engine_config().model_config.hf.inputs_embeds_size


def generated(outputs: list) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.fixture(scope="module")
def embeds_llm(tiny_llama: Path):
    llm = make_llm(tiny_llama, enable_prompt_embeds=True, max_num_batched_tokens=16, block_size=16)
    yield llm
    llm.shutdown()


def test_embeds_generate_transformers_tokens_beside_token_prompts(embeds_llm, tiny_llama: Path,
                                                                  prompts_token_ids: list[list[int]]) -> None:
    """Prompts longer than a step's 16 tokens come in chunks; the token prompts in the same steps
    keep their own tokens."""
    embeds = random_embeds((5, 23, 40), width_of(tiny_llama))
    token_prompts = prompts_token_ids[:3]
    outputs = embeds_llm.generate([{"prompt_embeds": e} for e in embeds]
                                  + [{"prompt_token_ids": p} for p in token_prompts], GREEDY, use_tqdm=False)
    assert generated(outputs[:3]) == hf_greedy_from_embeds(tiny_llama, embeds, NEW_TOKENS)
    assert generated(outputs[3:]) == hf_greedy(tiny_llama, token_prompts, NEW_TOKENS)
    first = outputs[0]
    assert first.prompt is None and list(first.prompt_token_ids) == [0] * 5  # (vLLM's placeholders)
    assert first.outputs[0].text == embeds_llm.get_tokenizer().decode(first.outputs[0].token_ids)
    assert_no_leaked_blocks(embeds_llm)


def test_a_batch_of_one_and_other_float_dtypes_are_taken(embeds_llm, tiny_llama: Path) -> None:
    """vLLM's rules: [1, n, hidden] is squeezed; any floating dtype is cast to the model's; a
    sparse COO tensor is made dense (its indices checked first)."""
    embeds = random_embeds((9,), width_of(tiny_llama), seed=1)[0]
    expected = hf_greedy_from_embeds(tiny_llama, [embeds], NEW_TOKENS)
    for given in (embeds[None], embeds.double(), embeds.numpy(), embeds.to_sparse()):
        assert generated(embeds_llm.generate({"prompt_embeds": given}, GREEDY, use_tqdm=False)) == expected


def test_embeddings_of_token_ids_generate_what_the_ids_do(tiny_llama: Path,
                                                          prompts_token_ids: list[list[int]]) -> None:
    """Embeddings that are the model's own of some ids stand for those ids (the splice puts them
    where the embedding layer's rows would be)."""
    from transformers import AutoModelForCausalLM

    layer = AutoModelForCausalLM.from_pretrained(tiny_llama).get_input_embeddings()
    prompts = prompts_token_ids[2:5]
    with torch.no_grad():
        embeds = [layer(torch.tensor(p)) for p in prompts]
    llm = make_llm(tiny_llama, enable_prompt_embeds=True)
    try:
        from_embeds = generated(llm.generate([{"prompt_embeds": e} for e in embeds], GREEDY, use_tqdm=False))
    finally:
        llm.shutdown()
    assert from_embeds == hf_greedy(tiny_llama, prompts, NEW_TOKENS)


@pytest.mark.parametrize(("fixture", "engine_args"), [
    ("tiny_gpt2", {}), ("tiny_opt", {}), ("tiny_qwen3", {}),
    ("tiny_qwen3", {"model_impl": "transformers", "max_num_batched_tokens": 16}),
], ids=["gpt2", "opt", "qwen3", "transformers-fallback"])
def test_other_families_match_transformers(fixture: str, engine_args: dict, request: pytest.FixtureRequest) -> None:
    """Learned absolute positions added to given embeddings (GPT-2), OPT's project_in from its
    narrower word embeddings (the width asked is word_embed_proj_dim), Qwen3, and the Transformers
    fallback (transformers' own `inputs_embeds`), in chunks."""
    model = request.getfixturevalue(fixture)
    embeds = random_embeds((6, 19), width_of(model), seed=2)
    llm = make_llm(model, enable_prompt_embeds=True, **engine_args)
    try:
        outputs = llm.generate([{"prompt_embeds": e} for e in embeds], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert generated(outputs) == hf_greedy_from_embeds(model, embeds, NEW_TOKENS)


def test_preempted_embeds_prompts_resume_with_their_embeddings(tiny_llama_tied: Path) -> None:
    """17 usable blocks of 16 tokens for four prompts of 60-90 rows and 32 tokens each: requests
    are preempted and come back (their embeddings sent to the worker again)."""
    embeds = random_embeds((90, 75, 64, 60), width_of(tiny_llama_tied), seed=4)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm = make_llm(tiny_llama_tied, enable_prompt_embeds=True, num_kv_blocks=18, block_size=16,
                   async_scheduling=True)
    try:
        outputs = llm.generate([{"prompt_embeds": e} for e in embeds], params, use_tqdm=False)
        assert llm.stats()["num_preemptions"] > 0
        assert_no_leaked_blocks(llm)
    finally:
        llm.shutdown()
    assert generated(outputs) == hf_greedy_from_embeds(tiny_llama_tied, embeds, 32)


def test_prefix_cache_blocks_are_shared_by_equal_embeddings_only(embeds_llm, tiny_llama: Path) -> None:
    """Block size 16: a prompt's full blocks are reused by the same embeddings, and by another
    prompt that starts with them, never by other embeddings of the length nor by the token ids
    the placeholders are."""
    width = width_of(tiny_llama)
    base, other = random_embeds((40, 40), width, seed=5)
    shares_a_block = torch.cat([base[:16], other[16:]])

    def cached(prompt: dict) -> int:
        return embeds_llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens

    embeds_llm.reset_prefix_cache()
    first = embeds_llm.generate({"prompt_embeds": base}, GREEDY, use_tqdm=False)[0]
    again = embeds_llm.generate({"prompt_embeds": base}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert generated([again]) == generated([first])
    assert cached({"prompt_embeds": shares_a_block}) == 16
    assert cached({"prompt_embeds": other + 1.0}) == 0
    assert cached({"prompt_token_ids": [0] * 40}) == 0
    assert cached({"prompt_embeds": base, "cache_salt": "apart"}) == 0


def test_repetition_penalty_sees_no_prompt_tokens(embeds_llm, tiny_llama: Path) -> None:
    """The placeholder ids are no prompt tokens: the penalty counts the generated ones only, as
    transformers' does for a prompt given as `inputs_embeds`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    embeds = random_embeds((12,), width_of(tiny_llama), seed=6)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    config = GenerationConfig(do_sample=False, max_new_tokens=24, repetition_penalty=1.8, eos_token_id=None,
                              pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, 12, dtype=torch.long),
                                  generation_config=config)[0].tolist()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.8)
    assert generated(embeds_llm.generate({"prompt_embeds": embeds}, params, use_tqdm=False)) == [expected]


def test_penalty_history_leaves_out_an_embeds_prompt() -> None:
    """The occurrence rows themselves: placeholder ids never enter the prompt mask."""
    from vllm_lite.sample.occurrences import TokenHistory, TokenOccurrences

    token_ids = np.array([[0, 0, 0, 7, 8, 0], [5, 6, 0, 9, 0, 0]], dtype=np.int32)
    history = TokenHistory(token_ids, np.array([3, 2], dtype=np.int32), np.array([5, 4], dtype=np.int32),
                           np.array([True, False]))
    occurrences = TokenOccurrences(torch.device("cpu"))
    prompt_mask, output_counts = occurrences.gather(["embeds", "tokens"], np.array([0, 1]), history, 10)
    assert prompt_mask[0].nonzero().flatten().tolist() == []
    assert prompt_mask[1].nonzero().flatten().tolist() == [5, 6]
    assert output_counts[0].nonzero().flatten().tolist() == [7, 8]
    assert output_counts[1].nonzero().flatten().tolist() == [0, 9]


@pytest.mark.parametrize("engine_args", [{"multiprocess": True}, {"multiprocess": True, "tensor_parallel_size": 2}],
                         ids=["spawned", "tp2"])
def test_spawned_engine_and_tensor_parallel(tiny_llama: Path, engine_args: dict) -> None:
    """The embeddings cross the wire to the engine core and on to every rank."""
    embeds = random_embeds((8, 30), width_of(tiny_llama), seed=7)
    llm = make_llm(tiny_llama, enable_prompt_embeds=True, max_num_batched_tokens=16, **engine_args)
    try:
        outputs = llm.generate([{"prompt_embeds": e} for e in embeds], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert generated(outputs) == hf_greedy_from_embeds(tiny_llama, embeds, NEW_TOKENS)


@pytest.mark.parametrize(("prompt", "params", "message"), [
    ({"prompt_embeds": torch.zeros(4)}, GREEDY,
     r"must be a 2D tensor of shape \(num_tokens, hidden_size\); got shape \(4,\)"),
    ({"prompt_embeds": torch.zeros(2, 3, 64)}, GREEDY, r"must be a 2D tensor"),
    ({"prompt_embeds": torch.zeros(3, 65)}, GREEDY, "hidden_size 65 does not match the model's hidden_size 64"),
    ({"prompt_embeds": torch.zeros(0, 64)}, GREEDY, "prompt_embeds holds no rows"),
    ({"prompt_embeds": torch.zeros(3, 64, dtype=torch.int64)}, GREEDY, "is not a floating-point type"),
    ({"prompt_embeds": torch.full((3, 64), float("nan"))}, GREEDY, "NaN or infinite"),
    ({"prompt_embeds": torch.full((3, 64), 1e39, dtype=torch.float64)}, GREEDY, "NaN or infinite"),
    ({"prompt_embeds": [[0.0] * 64]}, GREEDY, "must be a torch.Tensor, got list"),
    ({"prompt_embeds": torch.sparse_coo_tensor(torch.tensor([[0, 100000], [0, 3]]), torch.ones(2), (4, 64),
                                               check_invariants=False)}, GREEDY,
     "malformed sparse tensor: .*found index 100000"),
    ({"prompt_embeds": torch.zeros(3, 64).to_sparse_csr()}, GREEDY, "must be a dense or sparse COO tensor"),
    ({"prompt_embeds": torch.zeros(3, 64), "prompt_token_ids": [1, 2, 3]}, GREEDY, "takes no prompt_token_ids"),
    ({"prompt_embeds": torch.zeros(300, 64)}, GREEDY, "more than max_model_len=256"),
    ({"prompt_embeds": torch.zeros(3, 64)}, SamplingParams(max_tokens=2, prompt_logprobs=1),
     "prompt_logprobs is not compatible with prompt embeds"),
])
def test_refused_by_name(embeds_llm, prompt: dict, params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        embeds_llm.generate(prompt, params, use_tqdm=False)
    assert embeds_llm.generate({"prompt_embeds": torch.zeros(3, 64)}, GREEDY, use_tqdm=False)[0].finished


def test_beam_search_and_pooling_refuse_embeds_by_name(embeds_llm, tiny_qwen3: Path) -> None:
    from vllm_lite.entrypoints.beam_search import BeamSearchParams

    with pytest.raises(ValueError, match="prompt_embeds are taken by generate only"):
        embeds_llm.beam_search([{"prompt_embeds": torch.zeros(3, 64)}], BeamSearchParams(beam_width=2, max_tokens=2))
    pooling = make_llm(tiny_qwen3, runner="pooling", enable_prompt_embeds=True)
    try:
        with pytest.raises(ValueError, match="prompt_embeds are not implemented for pooling"):
            pooling.embed({"prompt_embeds": torch.zeros(3, width_of(tiny_qwen3))})
    finally:
        pooling.shutdown()


def test_refused_without_the_flag_and_with_a_draft_model(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    try:
        with pytest.raises(ValueError, match="You must set `--enable-prompt-embeds` to input `prompt_embeds`"):
            llm.generate({"prompt_embeds": torch.zeros(3, 64)}, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="a draft model or EAGLE head and enable_prompt_embeds is not implemented"):
        EngineArgs(model=str(tiny_llama), enable_prompt_embeds=True,
                   speculative_config={"model": str(tiny_llama), "num_speculative_tokens": 2}).create_engine_config()


def test_the_engine_core_refuses_embeddings_that_do_not_fit(tiny_llama: Path) -> None:
    """A request off the wire from another client: embeddings of the wrong shape or values fail that
    request alone (the step never sees them)."""
    config = EngineArgs(model=str(tiny_llama), enable_prompt_embeds=True, max_model_len=128,
                        dtype="float32").create_engine_config()
    processor = InputProcessor(config.model_config, None)
    core = EngineCore(config)
    try:
        good = processor.process_prompt("good", {"prompt_embeds": torch.randn(5, 64)}, GREEDY)[2]
        for bad_embeds in (np.zeros((4, 64), np.float32), np.zeros((5, 64), np.float64),
                           np.full((5, 64), np.inf, np.float32)):
            bad = msgspec.structs.replace(good, request_id="bad", prompt_embeds=bad_embeds)
            with pytest.raises(ValueError, match="prompt_embeds"):
                core.add_request(bad)
        core.add_request(good)
        tokens = []
        while core.has_unfinished_requests():
            tokens += core.step().new_token_ids.tolist()
        assert len(tokens) == NEW_TOKENS
    finally:
        core.shutdown()
