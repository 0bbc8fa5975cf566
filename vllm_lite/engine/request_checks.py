"""The checks a request passes where it enters the engine core (`EngineCore.add_request`): the
one place prompt and engine-dependent limits are written. The client side (`InputProcessor`)
runs the same functions before sending, so a bad prompt fails at once in the caller's thread
rather than one round trip later; nothing behind the boundary re-validates.

`SamplingParams` checks its own ranges (int32 counts, finite float32 values) when it is built,
also when msgspec decodes it off the wire. What needs the engine's knowledge is here:

| field | limit |
|---|---|
| prompt_token_ids | 1 to max_model_len ids, each in [0, vocab) |
| eos_token_ids | at most MAX_EOS_TOKEN_IDS ids, each in [0, vocab) |
| max_tokens | [1, 2**31 - 1] (an int32 count in the worker's batch) |
| sampling_params.n | 1: the client fans n out into n engine-core requests |
| sampling_params.stop_token_ids | at most MAX_STOP_TOKEN_IDS ids, each in [0, vocab) |
| sampling_params.stop | at most MAX_STOP_STRINGS strings |
| sampling_params.logit_bias | at most MAX_LOGIT_BIAS_ENTRIES entries, keys in [0, vocab) |
| sampling_params.allowed_token_ids | ids in [0, vocab) |
| sampling_params.bad_words | tokenized by the client (bad_words_token_ids set), ids in [0, vocab) |
| sampling_params.logprobs, prompt_logprobs | <= the engine's max_logprobs |
| request_id, cache_salt | at most MAX_ID_CHARS characters |
| prompt_embeds | enabled; finite float32, a row of the model's width per prompt token |
| images | taken by the model, at most max_images_per_prompt; finite float32 pixels of the encoder's shape; each image's placeholder tokens inside the prompt, in order, not overlapping; a 32-byte hash each |
"""

from __future__ import annotations

import numpy as np

from vllm_lite.config import ModelConfig
from vllm_lite.exceptions import VLLMValidationError
from vllm_lite.sampling_params import MAX_INT32, SamplingParams
from vllm_lite.structured_output import grammar_spec
from vllm_lite.vision_config import ImageEncoderConfig
from vllm_lite.wire import EngineCoreRequest, ImageInputs, ThinkingBudget

MAX_EOS_TOKEN_IDS = 64
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_STRINGS = 64
MAX_LOGIT_BIAS_ENTRIES = 1024  # a dense bias over the vocabulary is a different feature
MAX_ID_CHARS = 1024


def check_prompt(tokens: np.ndarray, model_config: ModelConfig) -> None:
    """A 1-D integer array of 1 to max_model_len ids inside the vocabulary."""
    max_len, vocab = model_config.max_model_len, model_config.hf.vocab_size
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise VLLMValidationError(f"prompt_token_ids must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
    if len(tokens) == 0:
        raise VLLMValidationError("prompt is empty: at least one prompt token is needed")
    if len(tokens) > max_len:
        raise VLLMValidationError(f"prompt has {len(tokens)} tokens, more than max_model_len={max_len}")
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise VLLMValidationError(f"prompt_token_ids must be in [0, {vocab}) (the vocabulary size)")


def check_request(request: EngineCoreRequest, model_config: ModelConfig) -> None:
    """Requests may come off the wire from any client: what would break a step is refused."""
    vocab = model_config.hf.vocab_size
    _check_chars("request_id", request.request_id)
    if request.cache_salt is not None:
        _check_chars("cache_salt", request.cache_salt)
    check_prompt(request.prompt_token_ids, model_config)
    if not 1 <= request.max_tokens <= MAX_INT32:
        raise VLLMValidationError(f"max_tokens must be in [1, {MAX_INT32}], got {request.max_tokens}")
    check_token_ids("eos_token_ids", request.eos_token_ids, vocab, MAX_EOS_TOKEN_IDS)
    if request.sampling_params.n != 1:
        raise VLLMValidationError(f"SamplingParams.n must be 1 in an engine-core request (the client fans n "
                                  f"out into n requests), got {request.sampling_params.n}")
    check_runner(request.pooling, model_config)
    if request.pooling:
        check_pooling_request(request)
    check_sampling_params(request.sampling_params, model_config)
    check_structured_outputs(request.sampling_params)
    check_something_to_sample(request.sampling_params, request.eos_token_ids)
    if request.thinking is not None:
        check_thinking_budget(request.thinking, model_config)
    if request.prompt_embeds is not None:
        check_prompt_embeds(request, model_config)
    if request.images is not None:
        check_images(request, model_config)


def check_prompt_embeds(request: EngineCoreRequest, model_config: ModelConfig) -> None:
    """Embeddings the worker can splice in: enabled, one finite float32 row of the model's width per
    prompt token (the client makes them so; another client may not)."""
    embeds = request.prompt_embeds
    if not model_config.enable_prompt_embeds:
        raise VLLMValidationError("You must set `--enable-prompt-embeds` to input `prompt_embeds`.",
                                  parameter="prompt_embeds")
    shape = (len(request.prompt_token_ids), model_config.hf.inputs_embeds_size)
    if embeds.dtype != np.float32 or embeds.shape != shape:
        raise VLLMValidationError(f"prompt_embeds must be float32 {shape} (a row per prompt token, the model's width), "
                                  f"got {embeds.dtype} {embeds.shape}", parameter="prompt_embeds")
    if not np.isfinite(embeds).all():
        raise VLLMValidationError("prompt_embeds holds NaN or infinite values", parameter="prompt_embeds")
    if request.pooling or request.sampling_params.prompt_logprobs is not None:
        raise VLLMValidationError("prompt_embeds are for generation requests without prompt_logprobs",
                                  parameter="prompt_embeds")


def check_images(request: EngineCoreRequest, model_config: ModelConfig) -> None:
    """Images the workers can encode and splice in (the client's ImageProcessor makes them so;
    another client may not)."""
    images, encoder = request.images, model_config.image_encoder
    if encoder is None:
        raise VLLMValidationError(f"image inputs are not taken by this model: {model_config.images_refused}",
                                  parameter="multi_modal_data")
    if request.prompt_embeds is not None or request.pooling:
        raise VLLMValidationError("images are for generation requests given as token ids", parameter="multi_modal_data")
    offsets, lengths = images.offsets, images.lengths
    count = len(offsets)
    # (an image's tiles or crops are inputs of their own: their number is bounded by the prompt,
    # where each input's placeholders must lie apart; the client counts the images)
    most = len(request.prompt_token_ids) if encoder.inputs_per_image_vary else model_config.max_images_per_prompt
    if not (1 <= count <= most and offsets.shape == lengths.shape == (count,)
            and offsets.dtype.kind in "iu" and lengths.dtype.kind in "iu" and len(images.hashes) == count):
        raise VLLMValidationError(f"images: 1 to {most} images, each with an offset, a length and a hash",
                                  parameter="multi_modal_data")
    if encoder.mrope:
        check_patches(images.pixel_values, images.patch_grids, count, encoder)
    elif encoder.row_breaks:
        check_whole_images(images.pixel_values, images.image_sizes, count, encoder)
    else:
        check_pixel_values(images.pixel_values, images.image_sizes, count, encoder, alone=count == 1)
    if any(not isinstance(h, bytes) or len(h) != 32 for h in images.hashes):
        raise VLLMValidationError("images: a 32-byte SHA-256 hash per image is needed", parameter="multi_modal_data")
    if lengths.tolist() != _image_lengths(images, count, encoder):
        raise VLLMValidationError("images: each image's length must be the features it becomes",
                                  parameter="multi_modal_data")
    tokens = request.prompt_token_ids
    ends = offsets.astype(np.int64) + lengths
    if offsets[0] < 0 or ends[-1] > len(tokens) or (count > 1 and (offsets[1:] < ends[:-1]).any()):
        raise VLLMValidationError("images: each image's placeholder tokens must lie inside the prompt, in order and "
                                  "apart", parameter="multi_modal_data")
    placeholders = np.concatenate([np.arange(start, end) for start, end in zip(offsets.tolist(), ends.tolist())])
    if encoder.row_breaks:  # (each row of features ends with a token of its own)
        placeholders = placeholders[_feature_positions(images, encoder)]
    if (tokens[placeholders] != encoder.image_token_id).any():
        raise VLLMValidationError(f"images: an image's positions must hold the image placeholder token "
                                  f"{encoder.image_token_id}", parameter="multi_modal_data")


def _feature_positions(images: ImageInputs, encoder: ImageEncoderConfig) -> np.ndarray:
    """Mistral 3: which positions of the images' spans (concatenated) are features, not row ends."""
    kept = []
    for height, width in images.image_sizes.tolist():
        rows, columns = encoder.feature_grid(height, width)
        kept.append((np.arange(rows * (columns + 1)) % (columns + 1)) < columns)
    return np.concatenate(kept)


def _image_lengths(images: ImageInputs, count: int, encoder: ImageEncoderConfig) -> list[int]:
    """The placeholders each image's features fill (Mistral 3: with its row ends)."""
    if encoder.mrope:
        return [encoder.merged_tokens(rows, columns) for rows, columns in images.patch_grids.tolist()]
    if encoder.row_breaks:
        return [encoder.placeholder_span(height, width) for height, width in images.image_sizes.tolist()]
    sizes = images.image_sizes.tolist() if images.image_sizes is not None else [None] * count
    return [encoder.tokens_for(*size, alone=count == 1) if size else encoder.tokens_per_image for size in sizes]


def check_patches(pixels: np.ndarray, grids: np.ndarray | None, count: int, encoder: ImageEncoderConfig) -> None:
    """Qwen2-VL: float32 finite patches of `count` images, [n, patches, values of a patch], with
    each image's (rows, columns) of patches in `grids`, whole merged squares that the patches hold."""
    merge = encoder.spatial_merge
    ok = (grids is not None and grids.shape == (count, 2) and grids.dtype.kind in "iu" and (grids > 0).all()
          and not (grids % merge).any() and pixels.ndim == 3 and pixels.shape[0] == count
          and pixels.shape[2] == encoder.patch_values and pixels.shape[1] >= int(grids.prod(axis=1).max()))
    _check_pixels(pixels, ok, f"[n, patches, {encoder.patch_values}] with each image's (rows, columns) of patches, "
                              f"multiples of {merge}")


def check_whole_images(pixels: np.ndarray, sizes: np.ndarray | None, count: int, encoder: ImageEncoderConfig) -> None:
    """Mistral 3: float32 finite pixel values of `count` images [n, channels, height, width] (each
    zero-padded to the largest), with each image's (height, width) in `sizes`: whole features'
    squares, at most the encoder's size (rounded up to them) on a side."""
    unit = encoder.feature_pixels
    most = -(-encoder.image_size // unit) * unit
    ok = (sizes is not None and sizes.shape == (count, 2) and sizes.dtype.kind in "iu" and pixels.ndim == 4
          and pixels.shape[:2] == (count, encoder.num_channels) and (sizes > 0).all() and not (sizes % unit).any()
          and (sizes <= most).all() and (sizes <= np.array(pixels.shape[2:])).all())
    _check_pixels(pixels, ok, f"[n, {encoder.num_channels}, height, width] with each image's (height, width), "
                              f"multiples of {unit} up to {most}")


def check_pixel_values(pixels: np.ndarray, sizes: np.ndarray | None, count: int, encoder: ImageEncoderConfig,
                       alone: bool = True) -> None:
    """float32 finite pixel values of `count` images in the encoder's tiles (LLaVA-NeXT: as many
    tiles as the largest image needs, with each image's positive (height, width) in `sizes`;
    `alone`: they are their prompt's only image)."""
    tile = (encoder.num_channels, encoder.image_size, encoder.image_size)
    if not encoder.any_resolution:
        ok = sizes is None and pixels.shape == (count, *tile)
    else:
        ok = (sizes is not None and sizes.shape == (count, 2) and sizes.dtype.kind in "iu" and (sizes > 0).all()
              and pixels.ndim == 5 and pixels.shape[0] == count and pixels.shape[2:] == tile
              and pixels.shape[1] >= max(encoder.tiles_for(*size, alone=alone) for size in sizes.tolist()))
    _check_pixels(pixels, ok, f"[n, {', '.join(map(str, tile))}]" if not encoder.any_resolution else
                  f"[n, tiles, {', '.join(map(str, tile))}] with each image's (height, width)")


def _check_pixels(pixels: np.ndarray, ok: bool, layout: str) -> None:
    """float32 pixel values whose layout is `ok` (`layout` says what it must be), all finite."""
    if pixels.dtype != np.float32 or not ok:
        raise VLLMValidationError(f"images: pixel values must be float32 {layout}, got {pixels.dtype} {pixels.shape}",
                                  parameter="multi_modal_data")
    if not np.isfinite(pixels).all():
        raise VLLMValidationError("images: pixel values hold NaN or infinite values", parameter="multi_modal_data")


def check_thinking_budget(thinking: ThinkingBudget, model_config: ModelConfig) -> None:
    """A budget the engine can force: a count, and tag ids the model can sample."""
    if not 0 <= thinking.budget <= MAX_INT32:
        raise VLLMValidationError(f"thinking_token_budget must be in [0, {MAX_INT32}], got {thinking.budget}",
                                  parameter="thinking_token_budget")
    check_token_ids("thinking_token_budget's tags", [thinking.start_id, thinking.end_id],
                    model_config.hf.vocab_size, 2)


def check_runner(pooling: bool, model_config: ModelConfig) -> None:
    """A request for what the engine's runner does: a pooling request (one vector for its prompt,
    one placeholder token) only on the pooling runner, a generation request only on the other."""
    if pooling and model_config.pooler is None:
        raise VLLMValidationError("this model generates text (runner='generate'): embeddings need an embedding model "
                                  "(runner='pooling')")
    if not pooling and model_config.pooler is not None:
        raise VLLMValidationError("this engine runs an embedding model (runner='pooling'): it makes embeddings "
                                  "(LLM.embed, /v1/embeddings), not text")


def check_pooling_request(request: EngineCoreRequest) -> None:
    params = request.sampling_params
    extras = (params.logprobs, params.prompt_logprobs, params.structured_outputs)
    if request.max_tokens != 1 or not params.is_greedy or any(extra is not None for extra in extras):
        raise VLLMValidationError("a pooling request takes one placeholder token (max_tokens=1, greedy, no logprobs "
                                  "or structured outputs): pooling_params.pooling_sampling_params()")


def check_something_to_sample(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> None:
    """allowed_token_ids made only of the tokens min_tokens suppresses (EOS unless ignore_eos, the
    stop_token_ids) leave a step nothing to sample: the draw would return a token outside them."""
    if params.allowed_token_ids is None or params.min_tokens == 0:
        return
    suppressed = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(eos_token_ids))
    if set(params.allowed_token_ids) <= suppressed:
        raise VLLMValidationError(f"allowed_token_ids {sorted(set(params.allowed_token_ids))[:8]} are all stop tokens, "
                                  f"which min_tokens={params.min_tokens} suppresses: nothing could be sampled")


def check_sampling_params(params: SamplingParams, model_config: ModelConfig) -> None:
    """Sizes, token ids and logprob counts of a request's sampling parameters (the client side
    runs this before fanning n out)."""
    vocab = model_config.hf.vocab_size
    check_token_ids("SamplingParams.stop_token_ids", params.stop_token_ids or (), vocab, MAX_STOP_TOKEN_IDS)
    check_token_ids("SamplingParams.logit_bias", list(params.logit_bias or ()), vocab, MAX_LOGIT_BIAS_ENTRIES)
    check_token_ids("SamplingParams.allowed_token_ids", params.allowed_token_ids or (), vocab, vocab)
    if params.bad_words and params.bad_words_token_ids is None:
        raise VLLMValidationError("SamplingParams.bad_words reached the engine core untokenized: the client's "
                                  "input processor fills bad_words_token_ids from them "
                                  "(SamplingParams.with_bad_words_tokenized)")
    if params.stop is not None and len(params.stop) > MAX_STOP_STRINGS:
        raise VLLMValidationError(f"SamplingParams.stop may hold at most {MAX_STOP_STRINGS} strings, "
                                  f"got {len(params.stop)}")
    params.check_engine_limits(vocab, model_config.max_logprobs)
    if model_config.skip_tokenizer_init:
        _check_without_tokenizer(params)


def _check_without_tokenizer(params: SamplingParams) -> None:
    """Stop strings match text and grammars compile against the vocabulary's strings: without
    a tokenizer neither can run, so they are refused rather than ignored."""
    if params.stop:
        raise VLLMValidationError("SamplingParams.stop (stop strings) needs the tokenizer, which is not loaded "
                                  "(skip_tokenizer_init=True); use stop_token_ids")
    if params.structured_outputs is not None:
        raise VLLMValidationError("SamplingParams.structured_outputs needs the tokenizer, which is not loaded "
                                  "(skip_tokenizer_init=True)")


def check_token_ids(field: str, token_ids: object, vocab_size: int, max_count: int) -> None:
    """A sequence of at most `max_count` int token ids, each in [0, vocab_size)."""
    if not isinstance(token_ids, (list, tuple)):
        raise VLLMValidationError(f"{field} must be a list of token ids, got {type(token_ids).__name__}")
    if len(token_ids) > max_count:
        raise VLLMValidationError(f"{field} may hold at most {max_count} token ids, got {len(token_ids)}")
    bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise VLLMValidationError(f"{field} has token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}")


def _check_chars(field: str, value: object) -> None:
    if not isinstance(value, str) or len(value) > MAX_ID_CHARS:
        raise VLLMValidationError(f"{field} must be a string of at most {MAX_ID_CHARS} characters")


def check_structured_outputs(params: SamplingParams) -> None:
    """A schema, regex or grammar that cannot compile is refused with the backend's reason
    (parsing only: compiling against the tokenizer happens later, off the busy loop)."""
    if params.structured_outputs is not None:
        from vllm_lite.structured_output.xgrammar_backend import XgrammarBackend

        XgrammarBackend.validate(grammar_spec(params.structured_outputs))
