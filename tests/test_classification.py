"""vLLM's classification models on the pooling runner: a `*ForSequenceClassification` checkpoint's
head over the last token's hidden state, held to transformers' own logits on the same weights
(fp32, CPU): `LLM.classify` (vLLM's activations by problem type and label count), `LLM.encode`,
cross-encoder `LLM.score`, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from classifier_models import build_classifier, hf_class_logits
from llm_factory import make_llm
from vllm_lite import PoolingParams
from vllm_lite.config import EngineArgs
from vllm_lite.exceptions import VLLMValidationError


def probs(outputs) -> list[torch.Tensor]:
    return [torch.tensor(output.outputs.probs) for output in outputs]


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama"])
def test_classify_matches_transformers(fixture: str, request: pytest.FixtureRequest, tmp_path: Path,
                                       prompts_token_ids: list[list[int]]) -> None:
    """Softmax over transformers' logits, plainly and in 16-token chunks with prefix-cache hits;
    use_activation=False gives the logits; LLM.encode the same probabilities as tensors."""
    model = build_classifier(request.getfixturevalue(fixture), tmp_path / "classifier", num_labels=3)
    prompts = [{"prompt_token_ids": p} for p in prompts_token_ids]
    expected = [torch.softmax(hf_class_logits(model, p["prompt_token_ids"]), -1) for p in prompts]
    llm = make_llm(model)
    try:
        got = probs(llm.classify(prompts, use_tqdm=False))
        logits = probs(llm.classify(prompts, pooling_params=PoolingParams(use_activation=False), use_tqdm=False))
        encoded = llm.encode(prompts[:2], pooling_task="classify", use_tqdm=False)
    finally:
        llm.shutdown()
    for ours, want in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, want, atol=2e-5, rtol=1e-4)
    for ours, prompt in zip(logits, prompts):
        torch.testing.assert_close(ours, hf_class_logits(model, prompt["prompt_token_ids"]), atol=2e-4, rtol=1e-4)
    for e, g in zip(encoded, got[:2], strict=True):  # (not bit for bit on CUDA: a batch of 2, not 8)
        torch.testing.assert_close(e.outputs.data, g, atol=1e-6, rtol=1e-5)
    llm = make_llm(model, block_size=16, max_num_batched_tokens=16)
    try:
        first, second = probs(llm.classify(prompts, use_tqdm=False)), probs(llm.classify(prompts, use_tqdm=False))
        assert llm.stats()["prefix_cache_hits"] > 0
    finally:
        llm.shutdown()
    for ours, again, want in zip(first, second, expected):
        torch.testing.assert_close(ours, want, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(again, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("changes, activation", [
    ({"num_labels": 1}, torch.sigmoid),
    ({"problem_type": "multi_label_classification"}, torch.sigmoid),
    ({"num_labels": 1, "problem_type": "regression"}, lambda x: x),
])
def test_vllms_activation_by_problem_type(tiny_qwen3: Path, tmp_path: Path, prompts_token_ids: list[list[int]],
                                          changes: dict, activation) -> None:
    labels = changes.pop("num_labels", 3)
    model = build_classifier(tiny_qwen3, tmp_path / "classifier", num_labels=labels, **changes)
    prompt = prompts_token_ids[3]
    llm = make_llm(model)
    try:
        (output,) = llm.classify({"prompt_token_ids": prompt}, use_tqdm=False)
    finally:
        llm.shutdown()
    torch.testing.assert_close(torch.tensor(output.outputs.probs), activation(hf_class_logits(model, prompt)),
                               atol=2e-5, rtol=1e-4)
    assert output.outputs.num_classes == labels


def test_cross_encoder_scores_each_pair_tokenized_together(tiny_qwen3: Path, tmp_path: Path) -> None:
    """A one-label classifier scores a pair as vLLM's cross-encoders do: the sigmoid of its logit
    for `tokenizer(text_1, text_pair=text_2)`."""
    from transformers import AutoTokenizer

    model = build_classifier(tiny_qwen3, tmp_path / "cross_encoder", num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(model)
    query, documents = "what is a cat", ["a cat is an animal", "stocks fell today", "cats purr"]
    llm = make_llm(model)
    try:
        scores = llm.score(query, documents, use_tqdm=False)
    finally:
        llm.shutdown()
    for output, document in zip(scores, documents, strict=True):
        ids = tokenizer(query, text_pair=document)["input_ids"]
        assert output.prompt_token_ids == ids
        assert output.outputs.score == pytest.approx(torch.sigmoid(hf_class_logits(model, ids))[0].item(), abs=2e-5)


def test_classification_refusals(tiny_qwen3: Path, tmp_path: Path, prompts_token_ids: list[list[int]]) -> None:
    model = build_classifier(tiny_qwen3, tmp_path / "classifier", num_labels=3)
    prompt = {"prompt_token_ids": prompts_token_ids[1]}
    llm = make_llm(model)
    try:
        with pytest.raises(VLLMValidationError, match="Embedding API is not supported by this model"):
            llm.embed(prompt, use_tqdm=False)
        with pytest.raises(VLLMValidationError, match="Score API is only enabled for num_labels == 1"):
            llm.score("a", "b", use_tqdm=False)
        with pytest.raises(VLLMValidationError, match="dimensions is for embeddings"):
            llm.classify(prompt, pooling_params=PoolingParams(dimensions=4), use_tqdm=False)
        with pytest.raises(VLLMValidationError, match="this model's task is 'classify'"):
            llm.classify(prompt, pooling_params=PoolingParams(task="embed"), use_tqdm=False)
        with pytest.raises(VLLMValidationError, match=r"LLM.generate\(\) is not supported for pooling models"):
            llm.generate(prompt, use_tqdm=False)
    finally:
        llm.shutdown()
    embedder = make_llm(tiny_qwen3, runner="pooling")
    try:
        with pytest.raises(VLLMValidationError, match="Classification API is not supported by this model"):
            embedder.classify(prompt, use_tqdm=False)
    finally:
        embedder.shutdown()
    with pytest.raises(ValueError, match="has no language-model head: it runs with runner='pooling' "
                                         r"\(a classification model\)"):
        EngineArgs(model=str(model), runner="generate").create_engine_config()
    with pytest.raises(ValueError, match="convert='classify' makes a classifier of a \\*ForSequenceClassification"):
        EngineArgs(model=str(tiny_qwen3), convert="classify").create_engine_config()


@pytest.mark.parametrize("method, tied", [("from_2_way_softmax", True), ("no_post_processing", False)])
def test_classifier_from_language_model_rows(tiny_qwen3: Path, tiny_llama: Path, method: str, tied: bool,
                                             prompts_token_ids: list[list[int]]) -> None:
    """vLLM's classifier_from_token (how it serves Qwen3-Reranker: a causal LM made a classifier by
    hf_overrides): from_2_way_softmax's one label is sigmoid(logit[yes] - logit[no]) of the last
    position, what the reranker's own recipe computes; no_post_processing keeps each token's logit
    (here through the softmax over them). Against transformers' causal-LM logits."""
    from hf_reference import hf_logits

    base = tiny_qwen3 if tied else tiny_llama  # (tied: the rows come from the embedding)
    tokens = ["Ġsong", "Great"]  # (the tiny vocabulary has no "no" / "yes")
    overrides = {"architectures": [("Qwen3" if tied else "Llama") + "ForSequenceClassification"],
                 "classifier_from_token": tokens}
    overrides |= {"is_original_qwen3_reranker": True} if method == "from_2_way_softmax" else {"method": method}
    from tokenizers import Tokenizer

    ids = [Tokenizer.from_file(str(base / "tokenizer.json")).token_to_id(t) for t in tokens]
    prompts = prompts_token_ids[2:5]
    llm = make_llm(base, hf_overrides=overrides)
    try:
        got = probs(llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False))
    finally:
        llm.shutdown()
    for ours, prompt in zip(got, prompts, strict=True):
        logits = hf_logits(base, prompt)[-1][ids]
        want = (torch.sigmoid(logits[1:] - logits[:1]) if method == "from_2_way_softmax"
                else torch.softmax(logits, -1))
        torch.testing.assert_close(ours, want, atol=2e-5, rtol=1e-4)


def test_lora_adapter_with_its_own_classifier_head_matches_peft(tiny_qwen3: Path, tmp_path: Path,
                                                                prompts_token_ids: list[list[int]]) -> None:
    """A PEFT SEQ_CLS adapter (LoRA on q/v and the head saved whole: modules_to_save ['classifier',
    'score'], vLLM takes it): its requests use its head, the others the model's; PeftModel's
    probabilities on the same weights."""
    from peft import LoraConfig, PeftModel, TaskType, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from vllm_lite.lora.request import LoRARequest

    model = build_classifier(tiny_qwen3, tmp_path / "classifier", num_labels=3)
    torch.manual_seed(5)
    peft_model = get_peft_model(AutoModelForSequenceClassification.from_pretrained(model, dtype=torch.float32),
                                LoraConfig(task_type=TaskType.SEQ_CLS, r=4, lora_alpha=8,
                                           target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    with torch.no_grad():
        peft_model.base_model.model.score.modules_to_save["default"].weight.normal_(0.0, 0.5)
    peft_model.save_pretrained(tmp_path / "adapter")
    reference = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(model, dtype=torch.float32),
                                          tmp_path / "adapter").eval()
    prompts = prompts_token_ids[1:4]
    lora = LoRARequest("tuned", 1, str(tmp_path / "adapter"))
    llm = make_llm(model, enable_lora=True)
    try:
        got = probs(llm.classify([{"prompt_token_ids": p} for p in prompts], lora_request=[lora, None, lora],
                                 use_tqdm=False))
    finally:
        llm.shutdown()
    with torch.inference_mode():
        tuned = [torch.softmax(reference(input_ids=torch.tensor([p])).logits[0], -1) for p in prompts]
    torch.testing.assert_close(got[0], tuned[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got[2], tuned[2], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got[1], torch.softmax(hf_class_logits(model, prompts[1]), -1), atol=2e-5, rtol=1e-4)
    assert not torch.allclose(tuned[0], torch.softmax(hf_class_logits(model, prompts[0]), -1), atol=1e-3)
