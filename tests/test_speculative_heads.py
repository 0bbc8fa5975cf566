"""vLLM's EAGLE and Medusa speculative decoding (speculative_config={"method": "eagle" | "eagle3" |
"medusa", "model": HEAD, ...}): a head drafts each request's next k tokens from the model's hidden
states (EAGLE-1: the last layer's; EAGLE-3: the residual stream at three layers; Medusa: the last
layer's at one position, one LM head per draft), and the step keeps the drafts the model itself
samples.

The model is the draft-model tests' cycling Llama; the heads (tests/speculative_heads.py) draft its
walk, perturbed by the hidden states they read. Greedy tokens must be transformers' under every
schedule, and the drafts kept at each position must be those a reference head computed from
transformers' hidden states keeps: a head reading the wrong states, positions or tokens keeps
others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculative_heads import ReferenceHead, ReferenceMedusa, build_eagle1_head, build_eagle3_head, build_medusa_head
from hf_reference import build_cycling_model, build_tiny_model, hf_greedy
from llm_factory import make_llm
from vllm_lite import EngineArgs, SamplingParams

PROMPTS = [list(range(10 + 7 * i, 30 + 7 * i)) for i in range(4)]
NUM_TOKENS = 40
K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
AUX_LAYERS = [1, 2, 0]  # (2: the stream after the last layer; 0: the embeddings)
METHODS = ["eagle", "eagle3", "medusa"]
REFERENCE_METHODS = [*METHODS, "eagle3_qwen3"]  # (method, or the head's name where the method is another's)


@pytest.fixture(scope="module")
def cycling_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cycling_model(tmp_path_factory.mktemp("cycling"), 0.05)


@pytest.fixture(scope="module")
def heads(cycling_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    vocab = json.loads((cycling_model / "config.json").read_text())["vocab_size"]
    root = tmp_path_factory.mktemp("heads")
    return {"eagle": build_eagle1_head(root / "eagle1", cycling_model, mix=0.5),
            "eagle3": build_eagle3_head(root / "eagle3", cycling_model, mix=33.0, aux_layer_ids=AUX_LAYERS,
                                        draft_vocab_size=vocab * 3 // 4),
            "eagle3_qwen3": build_eagle3_head(root / "eagle3_qwen3", cycling_model, mix=33.0,
                                              aux_layer_ids=AUX_LAYERS, draft_vocab_size=vocab * 3 // 4, qwen3=True),
            "medusa": build_medusa_head(root / "medusa", cycling_model, mix=1.0, num_heads=K),
            "medusa_old_names": build_medusa_head(root / "medusa_old", cycling_model, mix=1.0, num_heads=K,
                                                  old_names=True)}


@pytest.fixture(scope="module")
def greedy_reference(cycling_model: Path) -> list[list[int]]:
    return hf_greedy(cycling_model, PROMPTS, NUM_TOKENS)


def spec(method: str, head: Path, k: int = K) -> dict:
    return {"speculative_config": {"method": method, "model": str(head), "num_speculative_tokens": k}}


def run(llm) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def kept_per_position(llm) -> list[int]:
    metrics = {metric.name: metric for metric in llm.get_metrics()}
    return [int(v) for v in metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values]


def reference_kept_per_position(method: str, head: Path, model: Path, continuations: list[list[int]]) -> list[int]:
    """Each request decoded as the engine decodes it: k drafts a step (fewer near max_tokens) from
    the reference head, kept while they are the model's tokens, then the model's next token."""
    from transformers import AutoModelForCausalLM

    reference = (ReferenceMedusa if method == "medusa" else ReferenceHead)(
        head, AutoModelForCausalLM.from_pretrained(model).eval())
    kept = [0] * K
    for prompt, continuation in zip(PROMPTS, continuations):
        generated = 1  # (the prompt's step samples the first token, without drafts)
        while generated < NUM_TOKENS:
            k = min(K, NUM_TOKENS - generated - 1)
            accepted = 0
            if k > 0:
                drafts = reference.drafts(prompt + continuation[:generated], k)
                while accepted < k and drafts[accepted] == continuation[generated + accepted]:
                    kept[accepted] += 1
                    accepted += 1
            generated += accepted + 1
    return kept


@pytest.mark.parametrize("head", REFERENCE_METHODS)
def test_greedy_tokens_equal_transformers_and_kept_drafts_equal_the_reference(
        cycling_model: Path, heads: dict[str, Path], greedy_reference: list[list[int]], head: str) -> None:
    method = head.split("_")[0]
    llm = make_llm(cycling_model, disable_log_stats=False, **spec(method, heads[head]))
    try:
        assert run(llm) == greedy_reference
        kept = kept_per_position(llm)
    finally:
        llm.shutdown()
    expected = reference_kept_per_position(method, heads[head], cycling_model, greedy_reference)
    assert kept == expected
    assert 0 < expected[-1] < expected[0] < len(PROMPTS) * NUM_TOKENS // 2  # (mostly kept, not always)


@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 9},  # prompts chunked beside drafting requests; drafts cut by the budget
    {"block_size": 16, "num_kv_blocks": 12, "enable_prefix_caching": False},  # preempted and resumed
    {"block_size": 16},  # the second run hits the prefix cache (its last block computed again)
    {"attention_backend": "torch"},
    {"multiprocess": True, "tensor_parallel_size": 2},
])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_tokens_under_every_schedule(cycling_model: Path, heads: dict[str, Path],
                                            greedy_reference: list[list[int]], method: str,
                                            engine_args: dict) -> None:
    llm = make_llm(cycling_model, disable_log_stats=False, **spec(method, heads[method]), **engine_args)
    try:
        assert run(llm) == greedy_reference
        if "num_kv_blocks" in engine_args:
            assert llm.stats()["num_preemptions"] > 0
        first = kept_per_position(llm)
        assert first[0] > 0
        assert run(llm) == greedy_reference
        if engine_args == {"block_size": 16}:  # (hits read again as a first run: the same drafts kept)
            assert kept_per_position(llm) == [2 * n for n in first]
    finally:
        llm.shutdown()


def test_the_method_is_read_from_the_heads_name(cycling_model: Path, heads: dict[str, Path],
                                                greedy_reference: list[list[int]], tmp_path: Path) -> None:
    named = tmp_path / "my-eagle3-head"
    named.symlink_to(heads["eagle3"], target_is_directory=True)
    config = EngineArgs(model=str(cycling_model), speculative_config={
        "model": str(named), "num_speculative_tokens": 2, "enforce_eager": True}).create_engine_config()
    assert config.speculative_config.method == "eagle3"  # (and enforce_eager=True is what a head does here)
    assert config.speculative_config.eagle.aux_layer_ids == tuple(AUX_LAYERS)


def test_what_a_head_cannot_be_is_refused(cycling_model: Path, heads: dict[str, Path], tmp_path: Path) -> None:
    gpt2 = build_tiny_model(tmp_path / "gpt2", "gpt2", tie_word_embeddings=True)

    def changed(head: Path, name: str, **changes: object) -> Path:
        """A folder with `head`'s config.json changed so (weights are not read by these checks)."""
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**json.loads((head / "config.json").read_text()),
                                                        **changes}))
        return folder

    def head_with(name: str, **changes: object) -> Path:
        return changed(heads["eagle"], name, **changes)

    def medusa_with(name: str, **changes: object) -> Path:
        return changed(heads["medusa"], name, **changes)

    cases = [
        (cycling_model, spec("eagle", heads["eagle3"]), "architectures=\\['LlamaForCausalLMEagle3'\\]"),
        (cycling_model, spec("eagle3", head_with("wide", hidden_size=128, architectures=["LlamaForCausalLMEagle3"],
                                                 target_hidden_size=96)),
         "hidden states of width 96"),
        (cycling_model, spec("eagle", head_with("vocab", vocab_size=7)), "vocab_size=7 is not the model's"),
        (cycling_model, spec("eagle", head_with("eagle3_fields", draft_vocab_size=10)),
         "draft_vocab_size are EAGLE-3 fields"),
        (cycling_model, spec("eagle3", head_with("speculators", speculators_model_type="eagle3")),
         "speculators format"),
        (cycling_model, spec("eagle3", head_with("layers", architectures=["LlamaForCausalLMEagle3"],
                                                 eagle_aux_hidden_state_layer_ids=[1, 5])),
         r"layers \[1, 5\]"),
        (cycling_model, spec("eagle3", head_with("unknown", architectures=["LlamaForCausalLMEagle3"],
                                                 eagle_config={"parallel_drafting": True})),
         "'parallel_drafting' not implemented"),
        (cycling_model, spec("eagle", head_with("field", rope_type_x=1)), "rope_type_x"),
        (cycling_model, spec("eagle", head_with("tied", tie_word_embeddings=True)), "tie_word_embeddings=true"),
        (gpt2, spec("eagle", heads["eagle"]), "not GPT2LMHeadModel"),
        (cycling_model, {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 2}},
         "needs the draft's `model`"),
        (cycling_model, spec("medusa", medusa_with("medusa_vocab", truncated_vocab_size=100)),
         "truncated_vocab_size"),
        (cycling_model, spec("medusa", medusa_with("medusa_width", hidden_size=32)), "does not fit the model"),
        (cycling_model, spec("medusa", heads["eagle"]), "the Medusa head's config.json field"),
        (cycling_model, {"speculative_config": {**spec("eagle3", heads["eagle3"])["speculative_config"],
                                                "draft_tensor_parallel_size": 2}}, "draft_tensor_parallel_size=2"),
        (cycling_model, {"speculative_config": {**spec("eagle", heads["eagle"])["speculative_config"],
                                                "enforce_eager": False}}, "enforce_eager for a draft model"),
    ]
    for model, arguments, message in cases:
        with pytest.raises(ValueError, match=message.replace("`", ".")):
            EngineArgs(model=str(model), **arguments).create_engine_config()
    with pytest.raises(ValueError, match="num_attention_heads=3 is not divisible by tensor_parallel_size=2"):
        EngineArgs(model=str(cycling_model), tensor_parallel_size=2, **spec("eagle", head_with(
            "odd_heads", num_attention_heads=3, num_key_value_heads=1, head_dim=16))).create_engine_config()


def test_every_eagle_target_keeps_the_residual_where_the_head_reads_it() -> None:
    """EAGLE-3's hooks read (hidden, residual) at the model's layers and norm: the targets the
    config takes must be Llama-family classes (their layers' form)."""
    from vllm_lite.eagle_config import EAGLE_TARGET_ARCHITECTURES
    from vllm_lite.model.models.llama import LlamaForCausalLM
    from vllm_lite.model.registry import get_model_class

    for architecture in EAGLE_TARGET_ARCHITECTURES:
        assert issubclass(get_model_class(architecture), LlamaForCausalLM), architecture


def test_seeded_sampling_repeats_and_grammars_decode_beside_drafting_requests(
        cycling_model: Path, heads: dict[str, Path]) -> None:
    """Sampled drafts are verified by the sampler (the same seeded tokens in any batch order); a
    request with a grammar decodes without drafts while the head still reads its steps."""
    from vllm_lite.sampling_params import StructuredOutputsParams

    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [SamplingParams(temperature=0.8, top_k=50, max_tokens=30, ignore_eos=True, seed=i)
              for i in range(len(PROMPTS))]
    choice = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["alpha", "beta"]))
    plain = make_llm(cycling_model)
    try:
        expected_choice = plain.generate("pick one:", choice, use_tqdm=False)[0].outputs[0].text
    finally:
        plain.shutdown()
    llm = make_llm(cycling_model, **spec("eagle3", heads["eagle3"]))
    try:
        first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        again = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[::-1], params[::-1], use_tqdm=False)]
        assert again == first[::-1]
        mixed = llm.generate(["pick one:", *prompts], [choice, *params], use_tqdm=False)
        assert mixed[0].outputs[0].text == expected_choice
        assert [list(o.outputs[0].token_ids) for o in mixed[1:]] == first
    finally:
        llm.shutdown()


def test_medusa_in_fasterdecodings_form_drafts_as_in_vllms(cycling_model: Path, heads: dict[str, Path],
                                                           greedy_reference: list[list[int]]) -> None:
    """FasterDecoding's tensor names and config fields (medusa_num_heads, no model_type) read as
    vLLM reads them; k defaults to the head count; the method comes from model_type."""
    config = EngineArgs(model=str(cycling_model), speculative_config={
        "model": str(heads["medusa"]), "num_speculative_tokens": 2}).create_engine_config()
    assert config.speculative_config.method == "medusa"
    old = EngineArgs(model=str(cycling_model), speculative_config={
        "method": "medusa", "model": str(heads["medusa_old_names"])}).create_engine_config()
    assert old.speculative_config.num_speculative_tokens == K
    kept = []
    for head in (heads["medusa"], heads["medusa_old_names"]):
        llm = make_llm(cycling_model, disable_log_stats=False, **spec("medusa", head))
        try:
            assert run(llm) == greedy_reference
            kept.append(kept_per_position(llm))
        finally:
            llm.shutdown()
    assert kept[0] == kept[1]
    with pytest.raises(ValueError, match="num_speculative_tokens=4 is more than the Medusa head's 3 heads"):
        EngineArgs(model=str(cycling_model), **spec("medusa", heads["medusa"], k=4)).create_engine_config()


def test_medusa_drafts_for_prompts_given_as_embeddings(cycling_model: Path, heads: dict[str, Path]) -> None:
    """A Medusa head reads only the model's hidden states, so prompt embeddings take it (vLLM
    refuses none of it); the tokens are those of decoding without drafts."""
    import torch

    from safetensors.torch import load_file

    embeddings = load_file(cycling_model / "model.safetensors")["model.embed_tokens.weight"]
    prompts = [{"prompt_embeds": embeddings[p] + 0.01 * torch.randn(len(p), embeddings.shape[1],
                                                                    generator=torch.Generator().manual_seed(i))}
               for i, p in enumerate(PROMPTS)]
    outputs = []
    for arguments in ({}, spec("medusa", heads["medusa"])):
        llm = make_llm(cycling_model, enable_prompt_embeds=True, disable_log_stats=False, **arguments)
        try:
            outputs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
            if arguments:
                assert kept_per_position(llm)[0] > 0
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("method", METHODS)
def test_sleep_level_1_and_a_wake_up_keep_the_heads_drafting(cycling_model: Path, heads: dict[str, Path],
                                                              greedy_reference: list[list[int]], method: str) -> None:
    """vLLM's sleep(level=1) lets the KV cache go (the heads' KV and kept states with it); after
    wake_up the heads read the model's steps again from the start of each prompt."""
    llm = make_llm(cycling_model, disable_log_stats=False, enable_sleep_mode=True, **spec(method, heads[method]))
    try:
        assert run(llm) == greedy_reference
        first = kept_per_position(llm)
        llm.sleep(level=1)
        assert llm.wake_up() is True
        assert run(llm) == greedy_reference
        assert kept_per_position(llm) == [2 * n for n in first]  # (the same drafts kept as before the sleep)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_heads_keep_reading_while_drafts_are_off_by_batch_size(cycling_model: Path, heads: dict[str, Path],
                                                              greedy_reference: list[list[int]], method: str) -> None:
    """vLLM's disable_by_batch_size: no drafts while more requests run than that; the heads still
    read every step, so the requests left draft again once the batch is small enough."""
    config = {**spec(method, heads[method])["speculative_config"], "disable_by_batch_size": 2}
    llm = make_llm(cycling_model, disable_log_stats=False, speculative_config=config)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               [SamplingParams(temperature=0, max_tokens=NUM_TOKENS - 10 * i, ignore_eos=True)
                                for i in range(len(PROMPTS))], use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == [
            reference[:NUM_TOKENS - 10 * i] for i, reference in enumerate(greedy_reference)]
        assert 0 < kept_per_position(llm)[0]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("precision", [{"dtype": "bfloat16"}, {"quantization": "int8"}])
@pytest.mark.parametrize("method", METHODS)
def test_reduced_precision_drafted_steps_give_the_tokens_of_decoding_without_drafts(
        cycling_model: Path, heads: dict[str, Path], method: str, precision: dict) -> None:
    """In bf16 (the CPU's native precision here) and with the model's linear layers in int8 (W8A8,
    the heads staying float), a drafted step's rows round as one decode row's do: the tokens are
    those of decoding without drafts in the same precision."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("reduced precision on CUDA: a drafted step's several rows round otherwise than one decode row")
    plain = make_llm(cycling_model, **precision)
    try:
        expected = run(plain)
    finally:
        plain.shutdown()
    llm = make_llm(cycling_model, disable_log_stats=False, **precision, **spec(method, heads[method]))
    try:
        assert run(llm) == expected
        assert kept_per_position(llm)[0] > 0
    finally:
        llm.shutdown()
