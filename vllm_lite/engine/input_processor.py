"""Prompt -> validated EngineCoreRequest (tokenize, check limits, resolve max_tokens)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, TypedDict, Union

import numpy as np

from vllm_lite.config import LoRAConfig, ModelConfig
from vllm_lite.exceptions import LoRAAdapterNotFoundError, VLLMValidationError
from vllm_lite.engine.image_inputs import (ImageProcessor, ProcessedImage, check_multi_modal_data,
                                           request_processor_kwargs)
from vllm_lite.engine.request_checks import (check_prompt, check_runner, check_sampling_params,
                                             check_structured_outputs, check_thinking_budget)
from vllm_lite.engine.tokenizer import end_token_ids
from vllm_lite.logits_processor import load_logits_processors
from vllm_lite.lora.peft import CONFIG_FILE, PEFTAdapter, check_against_checkpoint, read_adapter
from vllm_lite.lora.request import LoRARequest
from vllm_lite.pooling_params import PoolingParams, pooling_sampling_params, resolve_pooling
from vllm_lite.reasoning_tags import REASONING_FORMATS, ThinkTokens, think_tokens
from vllm_lite.wire import EngineCoreRequest, ThinkingBudget
from vllm_lite.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

class TextPrompt(TypedDict, total=False):
    """vLLM's: a text prompt (the keys this engine takes), with images where the model takes them."""

    prompt: str
    multi_modal_data: dict[str, Any]
    multi_modal_uuids: dict[str, Any]
    mm_processor_kwargs: dict[str, Any]  # the image processor's keyword arguments for its images
    cache_salt: str


class TokensPrompt(TypedDict, total=False):
    """vLLM's: a prompt as token ids (`prompt`, when given, is only echoed in the output)."""

    prompt_token_ids: list[int]
    prompt: str
    multi_modal_data: dict[str, Any]
    multi_modal_uuids: dict[str, Any]
    mm_processor_kwargs: dict[str, Any]
    cache_salt: str


class EmbedsPrompt(TypedDict, total=False):
    """vLLM's: a prompt as the model's input embeddings, a float tensor [num_tokens, hidden_size]
    (the output of the model's input embedding layer), with enable_prompt_embeds."""

    prompt_embeds: Any  # torch.Tensor
    cache_salt: str


PromptType = Union[str, TextPrompt, TokensPrompt, EmbedsPrompt, dict[str, Any]]
# of vLLM's TextPrompt / TokensPrompt / EmbedsPrompt
PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds", "multi_modal_data", "multi_modal_uuids",
               "mm_processor_kwargs", "cache_salt")


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any, lora_config: LoRAConfig | None = None) -> None:
        self.model_config = model_config
        self.lora_config = lora_config
        # LoRA adapters checked so far, by lora_int_id: one id is one adapter folder for the engine's life
        self._adapters: dict[int, tuple[LoRARequest, PEFTAdapter]] = {}
        self._logits_processors = load_logits_processors(model_config.logits_processors)  # (their validate_params)
        self.tokenizer = tokenizer
        self.eos_token_ids = end_token_ids(model_config.hf.eos_token_ids, tokenizer, model_config.hf.vocab_size)
        self._think_tokens: ThinkTokens | None = None  # resolved by the first request with a budget
        self._images = ImageProcessor(model_config, tokenizer)

    def process_prompt(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                       lora_request: LoRARequest | None = None,
                       processed_images: list[ProcessedImage] | None = None
                       ) -> tuple[str | None, list[int], EngineCoreRequest]:
        """A generate request from any of vLLM's prompt forms: its text (None when it came as ids or
        embeddings), its token ids (placeholders 0 for embeddings, as vLLM reports them) and the
        engine-core request. `processed_images`: the prompt's images as `process_images` gave them
        (AsyncLLM's, made off its event loop); None: made here."""
        embeds = self.prompt_embeds(prompt)
        images = processed_images if processed_images is not None else self.process_images(*self.images(prompt))
        if embeds is None:
            text, token_ids = self.tokenize(prompt, images_allowed=True)
        else:
            text, token_ids = None, [0] * len(embeds)
            refuse_with_prompt_embeds(params)
        image_inputs = None
        if images:
            token_ids, image_inputs = self._images.inputs(images, token_ids)
        request = self.process(request_id, token_ids, params, self.cache_salt(prompt), priority,
                               lora_request=lora_request)
        request.prompt_embeds = embeds
        request.images = image_inputs
        return text, token_ids, request

    def process_images(self, images: list[Any], uuids: list[str | None],
                       kwargs: dict[str, Any] | None = None) -> list[ProcessedImage]:
        """The images' pixel values by the model's image processor (or its cache), with the
        prompt's mm_processor_kwargs: the costly part of a prompt with images, which AsyncLLM runs
        off its event loop (it uses no tokenizer), passing the result to `process_prompt`."""
        return self._images.processed(images, uuids, kwargs) if images else []

    def expanded_image_prompt(self, token_ids: list[int], images: list[Any], uuids: list[str | None],
                              kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt's token ids with each image's placeholder expanded as `process_prompt` will
        expand it (an image left out, None, sized by its uuid's), before its images are processed."""
        return self._images.expanded(token_ids, images, uuids, kwargs)

    def mm_cache_stats(self) -> dict[str, int]:
        """The processor cache's lookups and hits, in images (vLLM's vllm:mm_cache_queries / _hits)."""
        return {"mm_cache_queries": self._images.cache_queries, "mm_cache_hits": self._images.cache_hits}

    def reset_mm_cache(self) -> None:
        self._images.reset_cache()

    def images(self, prompt: PromptType) -> tuple[list[Any], list[str | None], dict[str, Any] | None]:
        """The images of a prompt's vLLM `multi_modal_data`, their `multi_modal_uuids` (checked
        against the model) and its `mm_processor_kwargs` (a prompt without images: nothing for
        them to act on, checked all the same)."""
        kwargs = request_processor_kwargs(prompt.get("mm_processor_kwargs")) if isinstance(prompt, dict) else None
        if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
            if isinstance(prompt, dict) and prompt.get("multi_modal_uuids") is not None:
                raise VLLMValidationError("multi_modal_uuids without multi_modal_data: give the images they name "
                                          "(None for those processed before)", parameter="multi_modal_uuids")
            return [], [], None
        if prompt.get("prompt_embeds") is not None:
            raise VLLMValidationError("a prompt with prompt_embeds takes no multi_modal_data",
                                      parameter="multi_modal_data")
        images, uuids = check_multi_modal_data(prompt["multi_modal_data"], self.model_config,
                                               prompt.get("multi_modal_uuids"))
        return images, uuids, kwargs

    def prompt_embeds(self, prompt: PromptType) -> np.ndarray | None:
        """A prompt's `prompt_embeds` checked against the model (vLLM's rules: 2-D, or 3-D with a
        batch of one; the model's embedding width; floating point, cast to the model's dtype), as
        float32 for the wire; None for a prompt without them."""
        if not isinstance(prompt, dict) or prompt.get("prompt_embeds") is None:
            return None
        _check_prompt_keys(prompt)
        self.require_prompt_embeds()
        given = [key for key in ("prompt", "prompt_token_ids") if prompt.get(key) is not None]
        if given:
            raise VLLMValidationError(f"a prompt with prompt_embeds takes no {' or '.join(given)}: the embeddings are "
                                      "the whole prompt", parameter="prompt_embeds")
        return embeds_array(prompt["prompt_embeds"], self.model_config)

    def require_prompt_embeds(self) -> None:
        if not self.model_config.enable_prompt_embeds:
            raise VLLMValidationError("You must set `--enable-prompt-embeds` to input `prompt_embeds` (LLM: "
                                      "enable_prompt_embeds=True).", parameter="prompt_embeds")

    def tokenize(self, prompt: PromptType, images_allowed: bool = False) -> tuple[str | None, list[int]]:
        """`images_allowed`: the caller takes the prompt's multi_modal_data (generate does)."""
        if isinstance(prompt, dict):
            _check_prompt_keys(prompt)
            if not images_allowed and prompt.get("multi_modal_data") is not None:
                raise VLLMValidationError("multi_modal_data is taken by generate only (not by beam search, pooling "
                                          "or tokenizing)", parameter="multi_modal_data")
            if prompt.get("prompt_embeds") is not None:
                raise VLLMValidationError("prompt_embeds are taken by generate only (not by beam search, pooling or "
                                          "tokenizing): give this prompt as text or token ids",
                                          parameter="prompt_embeds")
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        if isinstance(text, str):
            return text, self.encode(text)
        raise TypeError("prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}, "
                        f"got {type(prompt).__name__}")

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise VLLMValidationError("You cannot pass text prompts when `skip_tokenizer_init=True`: "
                                      "give {'prompt_token_ids': [...]}")
        check_utf8(text, "prompt")
        return self.tokenizer.encode(text)

    def _encode_plain(self, text: str) -> list[int]:
        check_utf8(text, "bad_words")
        return self.tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def cache_salt(prompt: PromptType) -> str | None:
        """vLLM's optional `cache_salt` prompt key: a non-empty string that keeps this prompt's
        prefix-cache entries apart from those of prompts without the same salt."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and not (isinstance(salt, str) and salt):
            raise VLLMValidationError(f"cache_salt must be a non-empty string, got {salt!r}")
        return salt

    def process_pooling(self, request_id: str, prompt: PromptType, params: PoolingParams | None,
                        priority: int = 0, lora_request: LoRARequest | None = None
                        ) -> tuple[str | None, list[int], EngineCoreRequest, PoolingParams]:
        """An embedding request: its prompt's text and ids, the engine-core request (one
        placeholder token) and its pooling resolved against the model."""
        if isinstance(prompt, dict) and prompt.get("prompt_embeds") is not None:
            raise VLLMValidationError("prompt_embeds are not implemented for pooling (embedding, classification) "
                                      "requests: give the prompt as text or token ids", parameter="prompt_embeds")
        text, token_ids = self.tokenize(prompt)
        request = self.process(request_id, token_ids, pooling_sampling_params(), self.cache_salt(prompt), priority,
                               pooling=True, lora_request=lora_request)
        return text, token_ids, request, resolve_pooling(params, self.model_config)

    def process(self, request_id: str, prompt_token_ids: list[int],
                params: SamplingParams, cache_salt: str | None = None, priority: int = 0,
                pooling: bool = False, lora_request: LoRARequest | None = None) -> EngineCoreRequest:
        """`pooling`: an embedding request (`params`: pooling_sampling_params()). `lora_request`:
        the LoRA adapter it runs with (vLLM's)."""
        tokens = np.asarray(prompt_token_ids, dtype=np.int64)
        check_prompt(tokens, self.model_config)  # the engine core's own checks, run early
        check_runner(pooling, self.model_config)
        params = params.with_bad_words_tokenized(self._encode_plain if self.tokenizer is not None else None)
        check_sampling_params(params, self.model_config)
        check_structured_outputs(params)
        self._check_logits_processor_params(params)
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if not INT64_MIN <= priority <= INT64_MAX:
            raise VLLMValidationError(f"priority must be within [-2**63, 2**63 - 1] (a 64-bit int), got {priority}")
        remaining = self.model_config.max_model_len - len(tokens)
        max_tokens = remaining if params.max_tokens is None else min(params.max_tokens, max(remaining, 1))
        thinking = self._thinking_budget(params) if params.thinking_token_budget is not None else None
        if lora_request is not None:
            self.check_lora(lora_request)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=tokens.astype(np.int32),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.time(),
            max_tokens=max_tokens,
            cache_salt=cache_salt,
            priority=int(priority),
            pooling=pooling,
            thinking=thinking,
            lora_request=lora_request,
        )

    def _check_logits_processor_params(self, params: SamplingParams) -> None:
        """Each custom logits processor's `validate_params` (vLLM's: a ValueError is the request's);
        `extra_args`, which only they read, is refused without one."""
        if params.extra_args and not self._logits_processors:
            raise VLLMValidationError("extra_args (vllm_xargs) are read by custom logits processors only, and this "
                                      "engine has none (logits_processors=...)", parameter="extra_args")
        for processor in self._logits_processors:
            try:
                processor.validate_params(params)
            except VLLMValidationError:
                raise
            except ValueError as exc:
                raise VLLMValidationError(str(exc)) from None

    def check_lora(self, lora_request: LoRARequest) -> PEFTAdapter:
        """The adapter a request names, read and checked once per lora_int_id (its config, its
        tensors' names and shapes against the base checkpoint's, its rank against max_lora_rank);
        the workers map it onto the model's layers when a request with it first joins their batch."""
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a vllm_lite.lora.request.LoRARequest, got "
                            f"{type(lora_request).__name__}")
        if self.lora_config is None:
            raise VLLMValidationError(f"lora_request {lora_request.lora_name!r}: LoRA is not enabled (start the "
                                      "engine with enable_lora=True / --enable-lora)", parameter="lora_request")
        known = self._adapters.get(lora_request.lora_int_id)
        if known is not None:
            if known[0].lora_path != lora_request.lora_path:
                raise VLLMValidationError(
                    f"lora_int_id {lora_request.lora_int_id} is adapter '{known[0].lora_path}' in this engine; "
                    f"'{lora_request.lora_path}' needs an id of its own", parameter="lora_request")
            return known[1]
        if not (Path(lora_request.lora_path) / CONFIG_FILE).is_file():
            raise LoRAAdapterNotFoundError(lora_request.lora_name, lora_request.lora_path)
        adapter = read_adapter(lora_request.lora_path, self.lora_config.max_lora_rank)
        pooler = self.model_config.pooler
        head_shape = ((len(pooler.labels), self.model_config.hf.hidden_size)
                      if pooler is not None and pooler.task == "classify" else None)
        check_against_checkpoint(adapter, self.model_config.model, head_shape, self.model_config.hf.checkpoint_architecture)
        self._adapters[lora_request.lora_int_id] = (lora_request, adapter)
        return adapter

    def forget_lora(self, lora_int_id: int) -> bool:
        """The id may name another folder from now on (the adapter was removed)."""
        return self._adapters.pop(lora_int_id, None) is not None

    def lora_ids(self) -> set[int]:
        return set(self._adapters)

    def _thinking_budget(self, params: SamplingParams) -> ThinkingBudget:
        """vLLM's thinking_token_budget with the reasoning parser's tag ids, which it needs."""
        parser = self.model_config.reasoning_parser
        if parser is None:
            raise VLLMValidationError("thinking_token_budget is set but reasoning_config is not configured. Please "
                                      "set --reasoning-parser (LLM: reasoning_parser=...) to use "
                                      "thinking_token_budget.", parameter="thinking_token_budget")
        if params.structured_outputs is not None:
            raise VLLMValidationError("thinking_token_budget cannot be combined with structured outputs here (the "
                                      "grammar constrains the reply from its first token)",
                                      parameter="thinking_token_budget")
        if self._think_tokens is None:
            tokens = think_tokens(self.tokenizer, parser) if self.tokenizer is not None else None
            if tokens is None:
                tags = REASONING_FORMATS[parser]
                lacking = ("are text, not tokens" if not tags.single_tokens
                           else "are not single tokens of this tokenizer")
                raise VLLMValidationError(f"thinking_token_budget needs the {tags.starts[0]!r} and {tags.ends[0]!r} "
                                          f"tags of reasoning parser {parser!r} as single tokens; they {lacking}",
                                          parameter="thinking_token_budget")
            self._think_tokens = tokens
        thinking = ThinkingBudget(params.thinking_token_budget, self._think_tokens.start, self._think_tokens.end)
        check_thinking_budget(thinking, self.model_config)
        return thinking


def embeds_array(embeds: Any, model_config: ModelConfig) -> np.ndarray:
    """`prompt_embeds` as the engine takes them: float32 [num_tokens, width] holding the values of
    the model's dtype (the cast vLLM makes), every one finite."""
    import torch

    if isinstance(embeds, np.ndarray):
        embeds = torch.from_numpy(embeds)
    if not isinstance(embeds, torch.Tensor):
        raise VLLMValidationError(f"prompt_embeds must be a torch.Tensor, got {type(embeds).__name__}",
                                  parameter="prompt_embeds")
    embeds = dense_embeds(embeds)
    if embeds.dim() == 3 and embeds.shape[0] == 1:  # a batch of one
        embeds = embeds.squeeze(0)
    width = model_config.hf.inputs_embeds_size
    if embeds.dim() != 2:
        raise VLLMValidationError(f"`prompt_embeds` must be a 2D tensor of shape (num_tokens, hidden_size); got "
                                  f"shape {tuple(embeds.shape)}.", parameter="prompt_embeds")
    if embeds.shape[1] != width:
        raise VLLMValidationError(f"`prompt_embeds` hidden_size {embeds.shape[1]} does not match the model's "
                                  f"hidden_size {width}.", parameter="prompt_embeds")
    if embeds.shape[0] == 0:
        raise VLLMValidationError("prompt_embeds holds no rows: a prompt needs at least one token",
                                  parameter="prompt_embeds")
    if not embeds.is_floating_point():
        raise VLLMValidationError(f"`prompt_embeds` dtype {embeds.dtype} is not a floating-point type, cannot safely "
                                  f"cast to the model's dtype {model_config.dtype}.", parameter="prompt_embeds")
    embeds = embeds.detach().to("cpu", getattr(torch, model_config.dtype))
    if not bool(torch.isfinite(embeds).all()):
        raise VLLMValidationError("prompt_embeds holds NaN or infinite values (in the model's dtype "
                                  f"{model_config.dtype})", parameter="prompt_embeds")
    return embeds.float().numpy()


def dense_embeds(embeds: Any) -> Any:
    """A sparse COO tensor made dense once its indices are checked against its shape (an index out
    of range would make `to_dense` write out of bounds); other sparse layouts are refused."""
    import torch

    if embeds.layout == torch.strided:
        return embeds
    if embeds.layout != torch.sparse_coo:
        raise VLLMValidationError(f"prompt_embeds must be a dense or sparse COO tensor, got layout {embeds.layout}",
                                  parameter="prompt_embeds")
    try:
        checked = torch.sparse_coo_tensor(embeds._indices(), embeds._values(), embeds.shape, check_invariants=True)
    except RuntimeError as exc:
        raise VLLMValidationError(f"prompt_embeds is a malformed sparse tensor: {exc}",
                                  parameter="prompt_embeds") from None
    return checked.to_dense()


def refuse_with_prompt_embeds(params: SamplingParams) -> None:
    """What a prompt given as embeddings cannot have: its token ids are placeholders."""
    if params.prompt_logprobs is not None:
        raise VLLMValidationError("prompt_logprobs is not compatible with prompt embeds.", parameter="prompt_logprobs")


def check_utf8(text: str, field: str) -> None:
    """Text a tokenizer can read: a JSON escape such as "\\ud83d" decodes to half of a surrogate
    pair, which no UTF-8 text holds (the tokenizer would fail with an unrelated message)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise VLLMValidationError(f"{field} holds an unpaired UTF-16 surrogate {text[exc.start]!r} at character "
                                      f"{exc.start}: not text") from None


def _check_prompt_keys(prompt: dict[str, Any]) -> None:
    """A prompt key this engine does not implement (vLLM's `multi_modal_data`, `prompt_embeds`,
    ... or a misspelt key) is refused by name: dropping it would answer another prompt. None
    stands for an absent key."""
    unknown = sorted(str(key) for key, value in prompt.items() if key not in PROMPT_KEYS and value is not None)
    if unknown:
        raise VLLMValidationError(f"prompt keys {unknown} are not supported: a prompt dict takes "
                                  f"{', '.join(repr(key) for key in PROMPT_KEYS)}")
