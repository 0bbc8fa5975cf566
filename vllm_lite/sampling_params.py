"""SamplingParams with vLLM's field names and meaning, validated on construction.

Limits that depend on the engine (`logprobs` <= the engine's `max_logprobs`, token ids inside
the vocabulary) are checked by the InputProcessor, which knows them.
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from vllm_lite.exceptions import VLLMValidationError

logger = logging.getLogger(__name__)

# Below this temperature a request is greedy; vLLM's _SAMPLING_EPS.
SAMPLING_EPS = 1e-5
# Positive temperatures are raised to this: dividing logits by less overflows float32.
MIN_RANDOM_TEMPERATURE = 1e-2
# OpenAI's range for logit_bias values; larger values are clamped.
MAX_LOGIT_BIAS = 100.0
_SEED_RANGE = (-(2**63), 2**64 - 1)  # 64 bits, signed or not (torch.Generator.manual_seed's range, as vLLM takes)
# Counts live in int32 arrays of the worker's batch (top_k, min_tokens, max_tokens, ...).
MAX_INT32 = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # a request's priority (and a server seed) travel as 64-bit ints
# vLLM 0.32's (and OpenAI's) upper limit on temperature.
MAX_TEMPERATURE = 2.0
# repetition_penalty divides or multiplies logits: vLLM asks only > 0; these bounds keep the
# products finite in float32.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# vLLM's bound on `logprob_token_ids` (the width of the logprob rows a request can ask for).
MAX_LOGPROB_TOKEN_IDS = 128
# vLLM's VLLM_MAX_NUM_BAD_WORDS and VLLM_MAX_BAD_WORDS_TOTAL_TOKENS defaults: a bound on the
# sampler's per-step prefix checks for one request
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_TOTAL_TOKENS = 1024
# logprobs / prompt_logprobs of -1: every token of the vocabulary (vLLM's rule; the engine's
# max_logprobs still bounds it).
ALL_VOCAB_LOGPROBS = -1
_NUMBER_FIELDS = ("n", "top_k", "min_tokens", "seed", "max_tokens", "logprobs", "prompt_logprobs", "stream_interval",
                  "temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries all text/tokens so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """vLLM's form of a structured-output constraint: exactly one of the kinds is set.

    | field | constraint |
    |---|---|
    | json | a JSON schema (dict or JSON text) |
    | json_object | any JSON object |
    | regex | a regular expression the whole output matches |
    | choice | one of these strings |
    | grammar | an EBNF/GBNF grammar (`root ::= ...`) |
    | structural_tag | xgrammar's structural tag (JSON text) |

    `disable_any_whitespace`: JSON without free whitespace between tokens. Whether a schema,
    regex or grammar compiles is checked where the request enters the engine (and before
    sending, by the client), with the grammar backend.
    """

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            raise VLLMValidationError("SamplingParams.structured_outputs must set exactly one of json, json_object, "
                                      f"regex, choice, grammar, structural_tag; got {kinds or 'none'}")
        _require(self.json_object in (None, True), "structured_outputs.json_object",
                 f"must be true when set, got {self.json_object!r}")
        _require(self.choice is None or (isinstance(self.choice, list) and self.choice
                                         and all(isinstance(c, str) and c for c in self.choice)),
                 "structured_outputs.choice", f"must be a non-empty list of non-empty strings, got {self.choice!r}")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, str) and value), f"structured_outputs.{name}",
                     f"must be a non-empty string, got {value!r}")
        _require(self.json is None or isinstance(self.json, (str, dict)), "structured_outputs.json",
                 f"must be a JSON schema (dict or JSON text), got {type(self.json).__name__}")
        _require(isinstance(self.disable_any_whitespace, bool), "structured_outputs.disable_any_whitespace",
                 f"must be a bool, got {self.disable_any_whitespace!r}")

    def kinds(self) -> list[str]:
        return [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) is not None]

    @property
    def kind(self) -> str:
        return self.kinds()[0]


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class RepetitionDetectionParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True,
                                frozen=True):
    """vLLM's: the request stops (finish_reason "repetition", stop_reason "repetition_detected")
    once its output ends with `min_count` equal runs of some length in [min_pattern_size,
    max_pattern_size] tokens (min_pattern_size 0: 1). max_pattern_size 0 turns it off."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            _require(_is_int(value) and 0 <= value <= MAX_INT32, f"repetition_detection.{name}",
                     f"must be an int in [0, {MAX_INT32}], got {value!r}")
        _require(self.min_pattern_size <= self.max_pattern_size, "repetition_detection",
                 "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= max_pattern_size. Set "
                 "both to 0 to disable repetitive pattern detection.")
        _require(self.max_pattern_size == 0 or self.min_count >= 2, "repetition_detection.min_count",
                 "must be >= 2 to detect repetitive patterns in engine output. If you do not wish to detect "
                 "repetitive patterns, set max_pattern_size to 0.")

    @property
    def enabled(self) -> bool:
        return self.max_pattern_size > 0

    def repeats(self, output: np.ndarray) -> bool:
        """Whether `output` (the request's output tokens) ends with `min_count` equal runs of one
        of the pattern lengths (vLLM's check_sequence_repetition)."""
        count, length = self.min_count, len(output)
        for size in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            if size * count > length:
                return False
            tail = output[length - size * count:]
            if tail[-1] == tail[-1 - size] and bool((tail.reshape(count, size) == tail[-size:]).all()):
                return True
        return False


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, dict=False):
    """Field meanings follow vLLM:

    | field | meaning | allowed |
    |---|---|---|
    | n | samples returned for the prompt | >= 1 |
    | temperature | 0 = greedy | [0, 2] (vLLM's) |
    | top_p | smallest set of tokens whose probability sum reaches top_p | (0, 1] |
    | top_k | keep the k most likely tokens; 0 or -1 = off | -1, 0 or >= 1 |
    | min_p | drop tokens below min_p * p(most likely token) | [0, 1] |
    | repetition_penalty | divides positive / multiplies negative logits of tokens seen before | [0.01, 100] |
    | frequency_penalty | subtracted once per occurrence in the output | [-2, 2] |
    | presence_penalty | subtracted once if the token occurs in the output | [-2, 2] |
    | seed | per-request random seed; -1 = none (as vLLM) | 64-bit |
    | max_tokens | most output tokens; None = up to max_model_len | >= 1 or None |
    | min_tokens | EOS and stop_token_ids are suppressed before this many outputs | [0, max_tokens] |

    Every count (n, top_k, max_tokens, min_tokens, logprobs, prompt_logprobs, stream_interval) is
    at most 2**31 - 1: they are stored in int32 arrays.
    | logprobs | top-N logprobs per output token, plus the sampled token | >= 0, or -1 = the whole vocabulary (<= engine max_logprobs) |
    | prompt_logprobs | top-N logprobs per prompt token, plus the prompt token | >= 0, or -1 = the whole vocabulary (<= engine max_logprobs) |
    | logprob_token_ids | per output token, the sampled token and these ids (vLLM's) | 1 to 128 ids in the vocabulary |
    | logit_bias | token id -> bias added to its logit | values clamped to [-100, 100] |
    | allowed_token_ids | only these tokens may be sampled (vLLM's) | a non-empty list of ids in the vocabulary |
    | bad_words | words never generated (vLLM's): each is tokenized as at the start of the text and after a space; a word's last token is banned wherever the output ends with the rest of it | non-empty strings |
    | bad_words_token_ids | bad_words as token sequences: filled from bad_words by the engine, or given instead of them | at most 128 non-empty lists of ids in the vocabulary, 1,024 ids in all |
    | structured_outputs | the output follows a JSON schema, regex, choice or grammar | StructuredOutputsParams or its dict |
    | stream_interval | a streamed (cumulative or delta) output every this many new tokens; the first and last come at once; raised to the engine's `stream_interval` | None or >= 1 |
    | skip_reading_prefix_cache | the prompt is computed whole, none of it read from the prefix cache (vLLM's); None: only with prompt_logprobs (every prompt position needs its logits) | bool or None |
    | thinking_token_budget | most tokens of a thinking section (after the reasoning parser's start tag); then the end tag is forced (vLLM's; needs the engine's reasoning_parser) | >= 0, -1 or None = no limit |
    | extra_args | arguments for the engine's custom logits processors (vLLM's; the server's `vllm_xargs`); refused when the engine has none | a JSON-like dict with string keys, or None |
    | spaces_between_special_tokens | False: an added token right after another is its bare text, without a space the decoder puts before it (vLLM's; only with skip_special_tokens False) | bool |
    | repetition_detection | stop once the output ends with a repeated token pattern (vLLM's RepetitionDetectionParams: finish_reason "repetition") | RepetitionDetectionParams, its dict or None |

    With `logprob_token_ids`, `logprobs` (None or equal to their count) becomes their count.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    stream_interval: int | None = None
    thinking_token_budget: int | None = None
    skip_reading_prefix_cache: bool | None = None
    extra_args: dict[str, Any] | None = None
    repetition_detection: RepetitionDetectionParams | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.repetition_detection, dict):
            try:
                self.repetition_detection = RepetitionDetectionParams(**self.repetition_detection)
            except TypeError as exc:
                raise VLLMValidationError(f"SamplingParams.repetition_detection: {exc}",
                                          parameter="repetition_detection") from None
        _require(self.repetition_detection is None or isinstance(self.repetition_detection, RepetitionDetectionParams),
                 "repetition_detection", f"must be a RepetitionDetectionParams, its dict or None, got "
                 f"{type(self.repetition_detection).__name__}")
        if self.repetition_detection is not None and not self.repetition_detection.enabled:
            self.repetition_detection = None  # (vLLM's "off": max_pattern_size 0)
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise VLLMValidationError(f"SamplingParams.structured_outputs: {exc}") from None
        _require(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                 "structured_outputs", f"must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:  # vLLM's rule: -1 asks for no seed (a client's "random")
            self.seed = None
        if self.thinking_token_budget == -1:  # vLLM's: unlimited
            self.thinking_token_budget = None
        # (prompt logprobs need every prompt position's logits: the cache is never read for them)
        _require(self.prompt_logprobs is None or self.skip_reading_prefix_cache is not False,
                 "skip_reading_prefix_cache", "must not be False with prompt_logprobs (every prompt position "
                 "needs its logits, which cached positions do not have)")
        if self.skip_reading_prefix_cache is None:  # vLLM's default
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None
        if self.logit_bias is not None:
            self.logit_bias = _normalize_logit_bias(self.logit_bias)
        self._validate()
        if self.logprob_token_ids is not None:
            self._take_logprob_token_ids()
        if 0.0 < self.temperature < MIN_RANDOM_TEMPERATURE:
            logger.warning("temperature %s is below %s; it is raised to %s to avoid overflow",
                           self.temperature, MIN_RANDOM_TEMPERATURE, MIN_RANDOM_TEMPERATURE)
            self.temperature = MIN_RANDOM_TEMPERATURE
        if self.is_greedy:
            # Truncation cannot change an argmax; clearing it keeps greedy rows off those paths.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_types(self) -> None:
        for name in _NUMBER_FIELDS:  # numpy scalars (a sweep over np.linspace) count as Python numbers
            setattr(self, name, _plain_number(getattr(self, name)))
        for name in ("stop_token_ids", "logprob_token_ids", "allowed_token_ids"):
            if isinstance(getattr(self, name), (list, tuple)):
                setattr(self, name, [_plain_number(t) for t in getattr(self, name)])
        for name in ("n", "top_k", "min_tokens"):
            _require(_is_int(getattr(self, name)), name, f"must be an int, got {getattr(self, name)!r}")
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "stream_interval", "thinking_token_budget"):
            value = getattr(self, name)
            _require(value is None or _is_int(value), name, f"must be an int or None, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            value = getattr(self, name)
            _require(_is_number(value) and math.isfinite(value), name,
                     f"must be a finite number, got {value!r}")
        _require(self.extra_args is None or (isinstance(self.extra_args, dict)
                                             and all(isinstance(key, str) for key in self.extra_args)),
                 "extra_args", f"must be a dict with string keys or None, got {self.extra_args!r}")
        _require(self.skip_reading_prefix_cache is None or isinstance(self.skip_reading_prefix_cache, bool),
                 "skip_reading_prefix_cache", f"must be a bool or None, got {self.skip_reading_prefix_cache!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                     "detokenize"):
            _require(isinstance(getattr(self, name), bool), name, f"must be a bool, got {getattr(self, name)!r}")
        _require(self.stop is None or isinstance(self.stop, (str, list, tuple)), "stop",
                 f"must be a string or a list of strings, got {self.stop!r}")
        _require(self.stop_token_ids is None or (isinstance(self.stop_token_ids, (list, tuple))
                                                 and all(_is_int(t) and t >= 0 for t in self.stop_token_ids)),
                 "stop_token_ids", f"must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        _require(self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                                                    and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
                 "allowed_token_ids", f"must be a non-empty list of token ids >= 0, got {self.allowed_token_ids!r}")
        self._check_bad_words()
        _require(self.logit_bias is None or isinstance(self.logit_bias, dict), "logit_bias",
                 f"must be a dict of token id -> bias, got {self.logit_bias!r}")
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise VLLMValidationError(f"SamplingParams.output_kind must be a RequestOutputKind, "
                                      f"got {self.output_kind!r}", parameter="output_kind") from None

    def _check_bad_words(self) -> None:
        """vLLM's rules (non-empty strings, repeats dropped), and its bounds on the token sequences."""
        words = self.bad_words
        _require(words is None or (isinstance(words, (list, tuple)) and all(isinstance(w, str) and w for w in words)),
                 "bad_words", f"must be a list of non-empty strings, got {words!r}")
        if words is not None:
            self.bad_words = list(dict.fromkeys(words)) or None
        sequences = self.bad_words_token_ids
        if sequences is None:
            return
        _require(isinstance(sequences, (list, tuple)) and all(
            isinstance(seq, (list, tuple)) and seq and all(_is_int(t) and t >= 0 for t in seq) for seq in sequences),
            "bad_words_token_ids", f"must be a list of non-empty lists of token ids >= 0, got {sequences!r}")
        _check_bad_word_limits(sequences, "bad_words" if self.bad_words else "bad_words_token_ids")
        self.bad_words_token_ids = [[int(t) for t in seq] for seq in sequences] or None

    def _validate(self) -> None:
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "stream_interval"):
            value = getattr(self, name)
            _require(value is None or value <= MAX_INT32, name, f"must be <= {MAX_INT32}, got {value}")
        _require(self.thinking_token_budget is None or 0 <= self.thinking_token_budget <= MAX_INT32,
                 "thinking_token_budget", f"must be a non-negative integer or -1 for unlimited, got "
                 f"{self.thinking_token_budget}")
        _require(self.stream_interval is None or self.stream_interval >= 1, "stream_interval",
                 f"must be >= 1 or None, got {self.stream_interval}")
        _require(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _require(0.0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
                 f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= 0, "top_k", f"must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        _require(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        _require(low <= self.repetition_penalty <= high, "repetition_penalty",
                 f"must be in [{low:g}, {high:g}], got {self.repetition_penalty}")
        _require(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
                 f"must be in [-2, 2], got {self.frequency_penalty}")
        _require(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
                 f"must be in [-2, 2], got {self.presence_penalty}")
        _require(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
                 f"must be >= 1 or None, got {self.max_tokens}")
        _require(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or value >= 0 or value == ALL_VOCAB_LOGPROBS, name,
                     f"must be >= 0, -1 (the whole vocabulary) or None, got {value}")
        _require(not self.stop or all(isinstance(s, str) and s for s in self.stop), "stop",
                 f"must be a list of non-empty strings, got {self.stop!r}")
        _require(not self.stop or self.detokenize, "stop",
                 "needs detokenize=True (stop strings are matched on the text)")
        _require(self.seed is None or _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1], "seed",
                 f"must be in [{_SEED_RANGE[0]}, {_SEED_RANGE[1]}], got {self.seed}")

    def _take_logprob_token_ids(self) -> None:
        """vLLM's rules: a non-empty list of at most MAX_LOGPROB_TOKEN_IDS ids; `logprobs`, when
        given, equals its length. `logprobs` is then that length: each output token carries the
        sampled token plus these ids (instead of the top-k)."""
        ids = self.logprob_token_ids
        _require(isinstance(ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in ids), "logprob_token_ids",
                 f"must be a list of token ids >= 0, got {ids!r}")
        _require(0 < len(ids) <= MAX_LOGPROB_TOKEN_IDS, "logprob_token_ids",
                 f"must hold 1 to {MAX_LOGPROB_TOKEN_IDS} token ids, got {len(ids)}")
        _require(self.logprobs is None or self.logprobs == len(ids), "logprob_token_ids",
                 f"needs logprobs=None or logprobs=len(logprob_token_ids)={len(ids)}, got logprobs={self.logprobs}")
        self.logprob_token_ids = list(ids)
        self.logprobs = len(ids)

    def check_engine_limits(self, vocab_size: int, max_logprobs: int) -> None:
        """The limits that depend on the engine: logprobs counts (-1 becomes the vocabulary size
        here, as in vLLM) and token ids in the vocabulary.
        (`logprobs` set by `logprob_token_ids` is bounded by MAX_LOGPROB_TOKEN_IDS instead.)"""
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) == ALL_VOCAB_LOGPROBS:
                setattr(self, name, vocab_size)
            value = getattr(self, name)
            if name == "logprobs" and self.logprob_token_ids is not None:
                continue
            _require(value is None or value <= max_logprobs, name,
                     f"must be <= {max_logprobs} (the engine's max_logprobs; raise it with "
                     f"EngineArgs.max_logprobs), got {value}")
        for name in ("logit_bias", "stop_token_ids", "logprob_token_ids", "allowed_token_ids"):
            bad = sorted(t for t in getattr(self, name) or () if t >= vocab_size)
            _require(not bad, name, f"has token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}")
        bad = sorted(t for seq in self.bad_words_token_ids or () for t in seq if t >= vocab_size)
        _require(not bad, "bad_words" if self.bad_words else "bad_words_token_ids",
                 f"has token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}")

    def with_bad_words_tokenized(self, encode: Callable[[str], list[int]] | None) -> SamplingParams:
        """vLLM's tokenization of `bad_words` (`encode`: text -> ids without special tokens):
        each word as written with its leading spaces removed, and after a space when that makes
        a different first token of the same length (the word inside a text)."""
        if not self.bad_words:
            return self
        _require(self.bad_words_token_ids is None, "bad_words_token_ids",
                 "is filled from bad_words: give one of them, not both")
        _require(encode is not None, "bad_words", "needs the tokenizer (skip_tokenizer_init=True): give "
                 "bad_words_token_ids instead")
        sequences: list[list[int]] = []
        for word in self.bad_words:
            alone = encode(word.lstrip())
            _require(bool(alone), "bad_words", f"entries must tokenize to at least one token, got {word!r}")
            sequences.append(alone)
            inside = encode(" " + word.lstrip())
            if inside and inside[0] != alone[0] and len(inside) == len(alone):
                sequences.append(inside)
        _check_bad_word_limits(sequences, "bad_words")
        return self.clone_with(bad_words_token_ids=sequences)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def clone_with(self, **changes: object) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _plain_number(value: object) -> object:
    """A numpy (or other `numbers`) scalar as the Python int / float it equals; anything else as
    it is (bools stay bools, and are refused where a number is wanted)."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _normalize_logit_bias(bias: dict) -> dict[int, float]:
    """Keys may arrive as strings (OpenAI JSON); values are clamped to OpenAI's [-100, 100]."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise VLLMValidationError(f"SamplingParams.logit_bias keys must be token ids, got {key!r}") from None
        _require(token_id >= 0 and not isinstance(key, (bool, float)), "logit_bias",
                 f"keys must be token ids >= 0, got {key!r}")
        _require(_is_number(value) and math.isfinite(value), "logit_bias",
                 f"values must be finite numbers, got {value!r} for token {key!r}")
        out[token_id] = max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(value)))
    return out


def _check_bad_word_limits(sequences: list[list[int]], field: str) -> None:
    _require(len(sequences) <= MAX_BAD_WORDS, field, f"must make at most {MAX_BAD_WORDS} token sequences (vLLM's "
             f"VLLM_MAX_NUM_BAD_WORDS; a word can make two), got {len(sequences)}")
    total = sum(len(seq) for seq in sequences)
    _require(total <= MAX_BAD_WORDS_TOTAL_TOKENS, field,
             f"must make at most {MAX_BAD_WORDS_TOTAL_TOKENS} token ids in all, got {total}")


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise VLLMValidationError(f"SamplingParams.{field} {message}", parameter=field)
