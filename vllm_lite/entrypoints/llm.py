"""`LLM`: offline batched generation, vLLM's interface."""

from __future__ import annotations

import functools
import itertools
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
from tqdm import tqdm

from vllm_lite.entrypoints.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from vllm_lite.entrypoints.chat_content import (conversation_images, developer_as_system, image_placeholder,
                                               image_uuids, resolve_content_format, with_content_format)
from vllm_lite.entrypoints.scoring import cosine_scores, pair_indices
from vllm_lite.entrypoints.tokenization import Tokenization
from vllm_lite.config import EngineArgs
from vllm_lite.engine.image_inputs import request_processor_kwargs
from vllm_lite.engine.input_processor import PromptType
from vllm_lite.engine.launch import attached_engine_args
from vllm_lite.engine.llm_engine import LLMEngine
from vllm_lite.engine.stats_log import StatsLog, log_stats_interval
from vllm_lite.entrypoints.openai.metrics import ServerMetrics, cache_config_info, num_engines, num_speculative_tokens
from vllm_lite.metrics_reader import Metric, snapshot
from vllm_lite.exceptions import VLLMValidationError
from vllm_lite.lora.request import LoRARequest
from vllm_lite.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingOutput,
                               PoolingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput)
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")


def in_process_default(backend: str | None, multiprocess: bool | None) -> bool:
    """vLLM's external_launcher runs the engine in the launcher's process (as vLLM turns its
    multiprocessing off for it); elsewhere the engine core gets a process of its own by default."""
    if backend != "external_launcher":
        return True if multiprocess is None else multiprocess
    if multiprocess:
        raise ValueError("distributed_executor_backend='external_launcher' runs the engine in this process (one rank "
                         "of the launcher's job): multiprocess=True cannot hold")
    return False


class LLM:
    """`multiprocess=True` (the default, except with vLLM's external_launcher) runs the engine core
    in its own process; False keeps it in this one. `engine_address` attaches to an engine core
    started on its own (`vllm-lite engine --address ...`); the model, tokenizer and max_model_len
    left out are then the engine's.
    `shutdown()` stops a spawned engine core (so does garbage collection or interpreter exit)."""

    def __init__(self, model: str | None = None, *, multiprocess: bool | None = None,
                 engine_address: str | None = None, **engine_args: Any) -> None:
        unknown = set(engine_args) - set(EngineArgs.field_names())
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments: {sorted(unknown)}")
        multiprocess = in_process_default(engine_args.get("distributed_executor_backend"), multiprocess)
        if engine_address is not None:
            args = attached_engine_args(engine_address, model, engine_args)
        else:
            args = EngineArgs(model=model, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(args, multiprocess, engine_address)
        # vLLM's LLM keeps no stats unless disable_log_stats=False: then the periodic stats line
        # (checked after each step) and the metrics of `get_metrics()`.
        self._metrics: ServerMetrics | None = None
        self._stats_log: StatsLog | None = None
        if args.disable_log_stats is False:
            self._keep_stats()
        self._request_counter = itertools.count()
        # Request ids are unique per engine core, and an attached one may serve other clients.
        self._request_prefix = f"{uuid.uuid4().hex[:12]}-" if engine_address is not None else ""
        # enqueue()'d requests, in order: request id -> its final output once finished.
        self._enqueued: dict[str, RequestOutput | None] = {}
        self._asleep = False  # between sleep() and a wake_up() that woke it fully

    def _keep_stats(self) -> None:
        config = self.llm_engine.vllm_config
        model_config = config.model_config
        self._metrics = ServerMetrics(model_config.model, model_config.max_model_len, cache_config_info(config),
                                      num_speculative_tokens(config), num_engines(config))
        self._stats_log = StatsLog(log_stats_interval())
        self.llm_engine.stat_loggers += [self._metrics.record_iteration, self._metrics.record_requests,
                                         self._stats_log.record_iteration]

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **client_options: Any) -> LLM:
        """vLLM's: an LLM from EngineArgs (`client_options`: multiprocess, engine_address)."""
        return cls(**{name: getattr(engine_args, name) for name in EngineArgs.field_names()}, **client_options)

    def get_tokenizer(self) -> Any:
        if self.llm_engine.tokenizer is None:
            raise ValueError("Unable to get tokenizer because `skip_tokenizer_init=True`")
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
                 priority: int | Sequence[int] | None = None, tokenization_kwargs: dict[str, Any] | None = None,
                 mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """`priority`: vLLM's, one per prompt (or one for all), lower first; only under
        scheduling_policy="priority". `lora_request`: the LoRA adapter the prompts run with, one
        for all or one per prompt (None: the base model), with enable_lora. `tokenization_kwargs`:
        vLLM's (entrypoints/tokenization.py). `mm_processor_kwargs`: the image processor's keyword
        arguments for every prompt's images (a prompt's own `mm_processor_kwargs` over them)."""
        prompts = _with_processor_kwargs(prompts, mm_processor_kwargs)
        adds = self._generation_adds(prompts, sampling_params, priority, "generate", tokenization_kwargs,
                                     lora_request)
        return self._run_requests(adds, use_tqdm)

    def enqueue(self, prompts: PromptType | Sequence[PromptType],
                sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
                priority: int | Sequence[int] | None = None, use_tqdm: bool = True,
                tokenization_kwargs: dict[str, Any] | None = None,
                mm_processor_kwargs: dict[str, Any] | None = None) -> list[str]:
        """vLLM's: adds the prompts' requests (as `generate` would) without running them; returns
        their request ids. `wait_for_completion()` runs them (a `generate` meanwhile runs them
        too, and keeps their outputs for it)."""
        prompts = _with_processor_kwargs(prompts, mm_processor_kwargs)
        adds = self._generation_adds(prompts, sampling_params, priority, "enqueue", tokenization_kwargs,
                                     lora_request)
        request_ids = self._add_all(adds, use_tqdm)
        self._enqueued.update(dict.fromkeys(request_ids))
        return request_ids

    def wait_for_completion(self, output_type: type | tuple[type, ...] | None = None, *,
                            use_tqdm: bool = True) -> list[RequestOutput]:
        """vLLM's: runs the engine until every enqueued request has finished; their final
        outputs, in the order they were enqueued. `output_type`: what they must be (vLLM's check)."""
        pending = sum(output is None for output in self._enqueued.values())
        if pending:
            self._run_engine(pending, use_tqdm)
        outputs, self._enqueued = list(self._enqueued.values()), {}
        wrong = [type(output).__name__ for output in outputs if output_type is not None
                 and not isinstance(output, output_type)]
        if wrong:
            raise TypeError(f"wait_for_completion: expected {output_type}, got {wrong[0]}")
        return outputs

    def _generation_adds(self, prompts: PromptType | Sequence[PromptType],
                         sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                         priority: int | Sequence[int] | None, method: str,
                         tokenization_kwargs: dict[str, Any] | None = None,
                         lora_request: LoRARequest | Sequence[LoRARequest] | None = None) -> list[Callable[[str], None]]:
        """One `add(request_id)` per prompt: its request with its params (final output only),
        priority and LoRA adapter."""
        if self.llm_engine.vllm_config.model_config.pooler is not None:
            raise VLLMValidationError(f"LLM.{method}() is not supported for pooling models (runner='pooling'): "
                                      "use LLM.embed() or, for a classification model, LLM.classify()")
        prompt_list = self._tokenized(_prompt_list(prompts), tokenization_kwargs)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        priorities = _per_prompt_priority(priority, len(prompt_list))
        loras = _per_prompt_lora(lora_request, len(prompt_list))
        add = self.llm_engine.add_request
        return [functools.partial(add, prompt=prompt, priority=request_priority, params=params, lora_request=lora)
                for prompt, params, request_priority, lora in zip(prompt_list, _final_only(params_list), priorities,
                                                                 loras)]

    def embed(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
              tokenization_kwargs: dict[str, Any] | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One vector per prompt from an embedding model (runner='pooling'), vLLM's interface:
        the pooler config's pooling of the final hidden states, L2-normalized unless
        `pooling_params.use_activation` is False (or the pooler config's is); `lora_request`
        as `generate`'s."""
        return self._pool(prompts, "embed", use_tqdm, pooling_params, lora_request, tokenization_kwargs,
                          truncate_prompt_tokens)

    def classify(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
                 tokenization_kwargs: dict[str, Any] | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's: each prompt's class probabilities from a classification model (a
        `*ForSequenceClassification` checkpoint): its head over the last token's hidden state,
        through the model's activation (softmax; sigmoid for one label or multi-label; the
        logits for regression or `use_activation=False`)."""
        return self._pool(prompts, "classify", use_tqdm, pooling_params, lora_request, tokenization_kwargs)

    def _pool(self, prompts: PromptType | Sequence[PromptType], task: str, use_tqdm: bool,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None,
              lora_request: LoRARequest | Sequence[LoRARequest] | None,
              tokenization_kwargs: dict[str, Any] | None, truncate_prompt_tokens: int | None = None) -> list[Any]:
        """One pooling request per prompt (`embed` / `classify`); the model's task must be `task`."""
        pooler = self.llm_engine.vllm_config.model_config.pooler
        if pooler is None:
            raise VLLMValidationError(f"LLM.{task}() is only supported for pooling models (runner='pooling'); this "
                                      "engine generates text")
        if pooler.task != task:
            api = {"embed": "Embedding", "classify": "Classification"}[task]
            raise VLLMValidationError(f"{api} API is not supported by this model (its task is {pooler.task!r}). "
                                      f"Try converting the model using `--convert {task}`.")
        prompt_list = self._tokenized(_prompt_list(prompts), tokenization_kwargs, truncate_prompt_tokens)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params] * len(prompt_list)
        else:
            params_list = _one_per_prompt("pooling_params", pooling_params, len(prompt_list))
        loras = _per_prompt_lora(lora_request, len(prompt_list))
        return self._run_requests([functools.partial(self.llm_engine.add_pooling_request, prompt=prompt, params=params,
                                                     lora_request=lora)
                                   for prompt, params, lora in zip(prompt_list, params_list, loras)], use_tqdm)

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *, use_tqdm: bool = True,
               lora_request: LoRARequest | Sequence[LoRARequest] | None = None, pooling_task: str | None = None,
               tokenization_kwargs: dict[str, Any] | None = None) -> list[PoolingRequestOutput]:
        """vLLM's: the pooled output per prompt as a tensor (`outputs.data`); `pooling_task` must be
        given: "embed" (the vectors `embed` returns) or "classify" (the probabilities `classify`
        returns); the token-wise tasks are not implemented."""
        if pooling_task is None:
            raise VLLMValidationError("pooling_task required for `LLM.encode`: use `LLM.embed(...)` / "
                                      '`LLM.classify(...)` or pooling_task="embed" / "classify"',
                                      parameter="pooling_task")
        if pooling_task not in ("embed", "classify"):
            raise VLLMValidationError(f"pooling_task {pooling_task!r} is not supported by vllm_lite (only 'embed' and "
                                      "'classify': token_embed and token_classify are not implemented)",
                                      parameter="pooling_task")
        import torch  # (only here: the CLI and the server import this module without torch)

        outputs = self._pool(prompts, pooling_task, use_tqdm, pooling_params, lora_request, tokenization_kwargs)
        data = [output.outputs.embedding if pooling_task == "embed" else output.outputs.probs for output in outputs]
        return [PoolingRequestOutput(output.request_id, PoolingOutput(torch.tensor(values)),
                                     output.prompt_token_ids, output.num_cached_tokens, output.finished)
                for output, values in zip(outputs, data)]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request: LoRARequest | None = None,
              tokenization_kwargs: dict[str, Any] | None = None,
              chat_template: None = None) -> list[ScoringRequestOutput]:
        """vLLM's: a score per pair of texts, 1 : N (one `data_1` text against each of `data_2`) or
        N : N. With an embedding model (runner='pooling'), the pair's cosine similarity (each text
        embedded once); with a cross-encoder (a classification model of one label), its
        probability for the pair tokenized together (the tokenizer's text pair). The LoRA
        adapter `lora_request` applies to every text. Score templates are not implemented (only
        None)."""
        _refuse_unless_none(chat_template=chat_template)
        if isinstance(lora_request, (list, tuple)):
            raise VLLMValidationError("LLM.score takes one lora_request for every text (as vLLM's)",
                                      parameter="lora_request")
        pooler = self.llm_engine.vllm_config.model_config.pooler
        if pooler is None:
            raise VLLMValidationError("LLM.score() needs a pooling model (runner='pooling'): an embedding model or "
                                      "a cross-encoder")
        first, second = _score_texts(data_1, "data_1"), _score_texts(data_2, "data_2")
        pairs = pair_indices(len(first), len(second))
        if pooler.task == "classify":
            return self._cross_encoder_scores(first, second, pairs, use_tqdm, pooling_params, lora_request,
                                              tokenization_kwargs)
        embedded = self.embed(first + second, use_tqdm=use_tqdm, pooling_params=pooling_params,
                              lora_request=lora_request, tokenization_kwargs=tokenization_kwargs)
        vectors = np.asarray([output.outputs.embedding for output in embedded], dtype=np.float32)
        scores = cosine_scores(vectors[:len(first)], vectors[len(first):], pairs)
        pad = self.get_tokenizer().pad_token_id
        between = [] if pad is None else [pad]
        return [ScoringRequestOutput(f"{embedded[i].request_id}_{embedded[len(first) + j].request_id}",
                                     ScoringOutput(score), embedded[i].prompt_token_ids + between
                                     + embedded[len(first) + j].prompt_token_ids)
                for (i, j), score in zip(pairs, scores)]

    def _cross_encoder_scores(self, first: list[str], second: list[str], pairs: list[tuple[int, int]],
                              use_tqdm: bool, pooling_params: PoolingParams | None, lora_request: LoRARequest | None,
                              tokenization_kwargs: dict[str, Any] | None) -> list[ScoringRequestOutput]:
        """Each pair tokenized together (`tokenizer(text_1, text_pair=text_2)`, vLLM's) and
        classified; the score is the one label's probability."""
        labels = self.llm_engine.vllm_config.model_config.pooler.labels
        if len(labels) != 1:
            raise VLLMValidationError(f"Score API is only enabled for num_labels == 1 (this classifier has "
                                      f"{len(labels)} labels)")
        tokenizer = self.get_tokenizer()
        prompts = [{"prompt_token_ids": tokenizer(first[i], text_pair=second[j])["input_ids"]} for i, j in pairs]
        outputs = self._pool(prompts, "classify", use_tqdm, pooling_params, lora_request, tokenization_kwargs)
        return [ScoringRequestOutput(output.request_id, ScoringOutput(output.outputs.probs[0]), output.prompt_token_ids)
                for output in outputs]

    @property
    def _max_model_len(self) -> int:
        return self.llm_engine.vllm_config.model_config.max_model_len

    def _tokenized(self, prompts: list[PromptType], tokenization_kwargs: dict[str, Any] | None,
                   truncate_prompt_tokens: int | None = None) -> list[PromptType]:
        """The prompts as token prompts under vLLM's `tokenization_kwargs` (unchanged without)."""
        pooling = self.llm_engine.vllm_config.model_config.pooler is not None
        tokenization = Tokenization.of(tokenization_kwargs, self._max_model_len, truncate_prompt_tokens,
                                       pooling=pooling)
        if tokenization is None:
            return prompts
        return [tokenization.prompt(self.llm_engine.tokenizer, prompt) for prompt in prompts]

    def _run_requests(self, adds: list[Callable[[str], None]], use_tqdm: bool) -> list[Any]:
        """Adds each request under a fresh id (`add(request_id)`), runs the engine until all have
        finished and returns their final outputs in order; if anything fails, every request
        already added is aborted."""
        request_ids = self._add_all(adds)
        try:
            results = self._run_engine(len(request_ids), use_tqdm)
        except BaseException:
            self.llm_engine.abort_request(request_ids)
            raise
        return [results[request_id] for request_id in request_ids]

    def _add_all(self, adds: list[Callable[[str], None]], use_tqdm: bool = False) -> list[str]:
        """Each request added under a fresh id; if one fails, those already added are aborted."""
        request_ids: list[str] = []
        try:
            for add in tqdm(adds, desc="Adding requests", disable=not use_tqdm):
                request_id = f"{self._request_prefix}{next(self._request_counter)}"
                add(request_id)
                request_ids.append(request_id)
        except BaseException:
            self.llm_engine.abort_request(request_ids)
            raise
        return request_ids

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
             priority: int | Sequence[int] | None = None,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             tokenization_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: each conversation through the chat template (its content in the
        template's format: `chat_content`), then `generate` (`priority`, `lora_request` and
        `mm_processor_kwargs` as there). Image parts (`image_url`, `image_pil`) where the model
        takes images."""
        return self.generate(self._chat_prompts(messages, chat_template, chat_template_content_format,
                                                add_generation_prompt, continue_final_message, tools,
                                                chat_template_kwargs, tokenization_kwargs),
                             sampling_params, use_tqdm=use_tqdm, priority=priority, lora_request=lora_request,
                             mm_processor_kwargs=mm_processor_kwargs)

    def enqueue_chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
                     sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                     use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
                     priority: int | Sequence[int] | None = None,
                     chat_template: str | None = None, chat_template_content_format: str = "auto",
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                     tokenization_kwargs: dict[str, Any] | None = None,
                     mm_processor_kwargs: dict[str, Any] | None = None) -> list[str]:
        """vLLM's: `chat`'s conversations enqueued as `enqueue` does; returns their request ids."""
        prompts = self._chat_prompts(messages, chat_template, chat_template_content_format, add_generation_prompt,
                                     continue_final_message, tools, chat_template_kwargs, tokenization_kwargs)
        return self.enqueue(prompts, sampling_params, priority=priority, use_tqdm=use_tqdm, lora_request=lora_request,
                            mm_processor_kwargs=mm_processor_kwargs)

    def _chat_prompts(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
                      chat_template: str | None, chat_template_content_format: str, add_generation_prompt: bool,
                      continue_final_message: bool, tools: list[dict[str, Any]] | None,
                      chat_template_kwargs: dict[str, Any] | None,
                      tokenization_kwargs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Each conversation through the chat template: its prompt (text and token ids; the
        template writes the special tokens, `tokenization_kwargs` may add the tokenizer's)."""
        tokenization = Tokenization.of(tokenization_kwargs, self._max_model_len) or Tokenization()
        if add_generation_prompt and continue_final_message:
            raise VLLMValidationError("continue_final_message and add_generation_prompt cannot both be True")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer()
        template = chat_template if chat_template is not None else tokenizer.chat_template
        content_format = resolve_content_format(chat_template_content_format, template)
        model_config = self.llm_engine.vllm_config.model_config
        placeholder = image_placeholder(tokenizer, model_config.image_encoder)
        prompts = []
        for conversation in conversations:
            try:
                messages = with_content_format(developer_as_system(conversation, template), content_format, placeholder,
                                               model_config.images_refused)
                images = conversation_images(conversation, model_config.media_access) if placeholder is not None else []
                uuids = image_uuids(conversation) if images else []
            except ValueError as exc:
                raise VLLMValidationError(str(exc), parameter="messages") from None
            text = tokenizer.apply_chat_template(
                messages, chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **({"tools": tools} if tools else {}), **(chat_template_kwargs or {}))
            prompt = tokenization.prompt(tokenizer, text, default_special=False)
            if images:
                prompt = {**prompt, "multi_modal_data": {"image": images},
                          **({"multi_modal_uuids": {"image": uuids}} if any(uuids) else {})}
            prompts.append(prompt)
        return prompts

    def beam_search(self, prompts: Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest] | None = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: per prompt, the `beam_width` best sequences (best first), found
        by stepping every live beam one token at a time through `generate` (see beam_search.py),
        each prompt's with its LoRA adapter (one for all or one per prompt), at most
        `concurrency_limit` prompts searched at once (vLLM's; the results are the same). A
        sequence's `text` is its prompt's and its output's, as vLLM's."""
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or not isinstance(concurrency_limit, int)
                                              or concurrency_limit < 1):
            raise VLLMValidationError(f"concurrency_limit must be an int >= 1 or None, got {concurrency_limit!r}")
        loras = _per_prompt_lora(lora_request, len(prompts))
        size = concurrency_limit or max(len(prompts), 1)
        return [output for start in range(0, len(prompts), size)
                for output in self._beam_search(prompts[start:start + size], params, loras[start:start + size],
                                                use_tqdm)]

    def _beam_search(self, prompts: Sequence[PromptType], params: BeamSearchParams,
                     loras: list[LoRARequest | None], use_tqdm: bool) -> list[BeamSearchOutput]:
        tokenizer = self.get_tokenizer()
        token_prompts = [self._prompt_token_ids(prompt) for prompt in prompts]
        search = BeamSearch(token_prompts, params, tokenizer.eos_token_id)
        step = params.step_params()
        while batch := search.pending():
            outputs = self.generate([{"prompt_token_ids": tokens} for tokens in batch], step, use_tqdm=use_tqdm,
                                    lora_request=[loras[index] for index in search.pending_prompts()])
            search.advance([output.outputs[0].logprobs[0] for output in outputs])
        results = []
        for beams in search.results():
            for beam in beams:
                beam.text = tokenizer.decode(beam.tokens, skip_special_tokens=params.skip_special_tokens)
            results.append(BeamSearchOutput(beams))
        return results

    def _prompt_token_ids(self, prompt: PromptType) -> list[int]:
        return self.llm_engine.input_processor.tokenize(prompt)[1]

    def stats(self) -> dict[str, Any]:
        return self.llm_engine.get_stats()

    def get_metrics(self) -> list[Metric]:
        """vLLM's: a snapshot of the `vllm:` metrics (vllm_lite.metrics_reader's Counter, Gauge,
        Histogram), those `/metrics` serves, over this LLM's requests so far. Needs
        `disable_log_stats=False`, as in vLLM."""
        if self._metrics is None:
            raise RuntimeError("LLM.get_metrics() needs the stats on: LLM(..., disable_log_stats=False)")
        self._metrics.engine_stats.stats = self.llm_engine.get_stats()
        return snapshot(self._metrics.registry)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: forget the prefix cache's blocks (after a weight update); False while requests
        hold blocks. There is no KV connector to reset; preempting the running requests to reset
        the cache under them (`reset_running_requests=True`) is refused by name."""
        if reset_running_requests:
            raise ValueError("reset_prefix_cache(reset_running_requests=True) is not supported; call it when the "
                             "running requests have finished (or after LLM.sleep)")
        return self.llm_engine.reset_prefix_cache()

    def reset_mm_cache(self) -> None:
        """vLLM's: forget the processed images this client keeps by their content (up to
        `mm_processor_cache_gb`); an image seen again is processed again."""
        self.llm_engine.input_processor.reset_mm_cache()

    def reset_encoder_cache(self) -> None:
        """vLLM's: every worker forgets the image features it keeps for reuse (by image hash, up to
        a step's token budget of them); a weight update through `load_weights` does it itself."""
        self.collective_rpc("reset_encoder_cache")

    def start_profile(self, profile_prefix: str | None = None, *, delay_iterations: int | None = None,
                      max_iterations: int | None = None) -> None:
        """vLLM's: every rank's torch profiler records from now until `stop_profile` (or
        `max_iterations` engine steps), into profiler_config's torch_profiler_dir."""
        self.llm_engine.start_profile(profile_prefix, delay_iterations=delay_iterations,
                                      max_iterations=max_iterations)

    def stop_profile(self) -> None:
        self.llm_engine.stop_profile()

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's: the engine stops running requests until `wake_up`. Level 0 pauses (the prefix
        cache kept); level 1 also forgets the prefix cache and releases the KV cache's memory (on
        CPU; the weights stay in host memory, where level 1 keeps them). `mode`: enqueued
        requests are aborted ("abort"), finished first ("wait", with the engine core in its own
        process) or kept for after `wake_up` ("keep", level 0). Level 2 (weights discarded) and
        level 1 on CUDA are not implemented: refused."""
        self.llm_engine.sleep(level, mode)
        self._asleep = True

    def update_weight_version(self, new_version: str) -> None:
        """vLLM's: the label of the engine's weights from its next step on (a trainer sets it after
        `collective_rpc` updated them); each finished output's `weight_versions` says which label
        sampled which of its tokens ("default" until set)."""
        self.llm_engine.set_weight_version(new_version)

    def get_weight_version(self) -> str:
        return self.llm_engine.get_weight_version()

    def release_kv_cache_memory(self) -> None:
        """vLLM's: after `sleep(level=0)` with no request left, the KV cache's memory is released
        as level 1 releases it; `wake_up(tags=["kv_cache"])` (or `wake_up()`) brings it back."""
        self.llm_engine.release_kv_cache_memory()

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """vLLM's: what `sleep` released comes back (`tags`: "weights", "kv_cache", "scheduling";
        None: all); returns whether the engine is fully awake (and runs requests again)."""
        awake = self.llm_engine.wake_up(tags)
        self._asleep = not awake
        return awake

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's: run `method` on every worker, between engine steps; the results in rank order.
        `method` is a worker method's name (the worker's own, e.g. `get_model`'s callers, or one a
        `worker_extension_cls` adds) or a function taking the worker first. Arguments and results
        cross processes as msgpack with tensors and arrays; a function or another object needs
        VLLM_ALLOW_INSECURE_SERIALIZATION=1 (pickle), as in vLLM. `timeout` (seconds): TimeoutError
        when the call takes longer (the engine core in its own process only)."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """vLLM's: `func(model)` on every worker; the results in rank order."""
        return self.llm_engine.collective_rpc("apply_model", args=(func,))

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's: the processes running the model (tensor parallel; with `include_dp`, times the
        data-parallel engines; no pipeline parallelism here)."""
        parallel = self.llm_engine.vllm_config.parallel_config
        return parallel.tensor_parallel_size * (parallel.data_parallel_size if include_dp else 1)

    def _run_engine(self, num_requests: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        """Steps the engine until no request is left: the final outputs by request id, but those
        of enqueued requests, which are kept for `wait_for_completion` (the bar counts
        `num_requests`, the caller's)."""
        if self._asleep:
            raise RuntimeError("the engine is asleep (LLM.sleep): its requests would never finish; call "
                               "LLM.wake_up() first")
        results: dict[str, RequestOutput] = {}
        enqueued = self._enqueued
        with tqdm(total=num_requests, desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.llm_engine.has_unfinished_requests():
                outputs = self.llm_engine.step()
                if self._stats_log is not None:
                    self._stats_log.log_if_due(self.llm_engine.get_stats)
                for output in outputs:
                    if not output.finished:
                        continue
                    if output.request_id in enqueued:
                        enqueued[output.request_id] = output
                    else:
                        results[output.request_id] = output
                    bar.update(1)
        return results

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` / `chat` use without SamplingParams: the model's generation-config
        sampling values (`--generation-config`, vLLM's rule), SamplingParams' defaults elsewhere."""
        return SamplingParams(**self.llm_engine.vllm_config.model_config.sampling_defaults)

    def _params_per_prompt(self, sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                           num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        return _one_per_prompt("sampling_params", sampling_params, num_prompts)


def _final_only(params_list: list[SamplingParams]) -> list[SamplingParams]:
    """Each prompt's params asking for its final output only (what `generate` returns), copied
    once per distinct object: one SamplingParams for 1,024 prompts is one copy (and one
    validation), not 1,024; the engine only reads them."""
    copies: dict[int, SamplingParams] = {}
    for params in params_list:
        if id(params) not in copies:
            copies[id(params)] = params.clone_with(output_kind=RequestOutputKind.FINAL_ONLY)
    return [copies[id(params)] for params in params_list]


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if not isinstance(prompts, Iterable):  # (a string and a prompt dict are iterable too)
        raise TypeError(f"prompts must be a string, a prompt dict or a list of them, got {type(prompts).__name__}")
    return [prompts] if isinstance(prompts, (str, dict)) else list(prompts)


def _with_processor_kwargs(prompts: PromptType | Sequence[PromptType],
                           kwargs: dict[str, Any] | None) -> PromptType | Sequence[PromptType]:
    """The prompts with `kwargs` (vLLM's mm_processor_kwargs of a call) as each one's
    `mm_processor_kwargs`, a prompt's own over them; the prompts themselves without any."""
    kwargs = request_processor_kwargs(kwargs)
    if kwargs is None:
        return prompts
    out = []
    for prompt in _prompt_list(prompts):
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if isinstance(prompt, dict):
            prompt = {**prompt, "mm_processor_kwargs": {**kwargs, **(prompt.get("mm_processor_kwargs") or {})}}
        out.append(prompt)
    return out


def _score_texts(data: str | Sequence[str], name: str) -> list[str]:
    texts = [data] if isinstance(data, str) else list(data) if isinstance(data, (list, tuple)) else None
    if texts is None or not all(isinstance(text, str) for text in texts):
        raise VLLMValidationError(f"{name} must be a text or a list of texts (multimodal score inputs are not "
                                  f"supported), got {type(data).__name__}", parameter=name)
    return texts


def _refuse_unless_none(**arguments: Any) -> None:
    """vLLM arguments of features this engine does not have: taken only as None."""
    for name, value in arguments.items():
        if value is not None:
            raise VLLMValidationError(f"{name} is not supported by vllm_lite (got {value!r}); "
                                      "pass None or leave it out")


def _per_prompt_lora(lora_request: LoRARequest | Sequence[LoRARequest] | None,
                     num_prompts: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, (list, tuple)):
        raise TypeError(f"lora_request must be a LoRARequest, a list of them (one per prompt) or None, got "
                        f"{type(lora_request).__name__}")
    return _one_per_prompt("lora_request", lora_request, num_prompts)


def _per_prompt_priority(priority: int | Sequence[int] | None, num_prompts: int) -> list[int]:
    if priority is None or isinstance(priority, int):
        return [priority or 0] * num_prompts
    return _one_per_prompt("priority", priority, num_prompts)


def _one_per_prompt(name: str, values: Iterable[T], num_prompts: int) -> list[T]:
    """A per-prompt argument given as a list: one entry per prompt."""
    values = list(values)
    if len(values) != num_prompts:
        raise VLLMValidationError(f"{name} has {len(values)} entries but there are {num_prompts} prompts")
    return values
