"""vLLM's `tokenization_kwargs` of `LLM.generate` / `chat` / `embed` / `score` ("overrides for
`tokenizer.encode`"), as vLLM's renderer reads them:

| key | meaning |
|---|---|
| add_special_tokens | the tokenizer's special tokens around a text prompt (generate / embed: on; chat: off, the template writes them) |
| truncate_prompt_tokens | keep this many prompt tokens (-1: max_model_len); text and token prompts alike |
| truncation_side | which end is cut: "left" (the last tokens are kept) or "right"; the default is vLLM's (`default_truncation_side`) |
| truncation, max_length | `truncation: true` (or "longest_first") cuts to `max_length` (default max_model_len) |

Any other key (padding, do_lower_case, ...) is refused by name: vLLM warns and ignores them.
A truncated prompt keeps no text (it is no longer the text given)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_lite.engine.input_processor import PromptType, check_utf8
from vllm_lite.exceptions import VLLMValidationError

KEYS = ("add_special_tokens", "truncate_prompt_tokens", "truncation_side", "truncation", "max_length")


@dataclass(frozen=True, slots=True)
class Tokenization:
    add_special_tokens: bool | None = None  # None: the caller's default
    num_tokens: int | None = None  # keep this many (None: all)
    side: str = "left"

    @staticmethod
    def of(kwargs: dict[str, Any] | None, max_model_len: int, truncate_prompt_tokens: int | None = None, *,
           pooling: bool = False) -> Tokenization | None:
        """From `tokenization_kwargs` (and `LLM.embed`'s older `truncate_prompt_tokens` argument);
        None when neither asks for anything. `pooling`: for an embedding model (the default side)."""
        if kwargs is None and truncate_prompt_tokens is None:
            return None
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - set(KEYS))
        if unknown:
            raise VLLMValidationError(f"tokenization_kwargs key {unknown[0]!r} is not supported by vllm_lite "
                                      f"(supported: {', '.join(KEYS)})", parameter="tokenization_kwargs")
        if truncate_prompt_tokens is not None:
            if kwargs.get("truncate_prompt_tokens", truncate_prompt_tokens) != truncate_prompt_tokens:
                raise VLLMValidationError("truncate_prompt_tokens is given twice with different values "
                                          "(the argument and tokenization_kwargs)", parameter="truncate_prompt_tokens")
            kwargs["truncate_prompt_tokens"] = truncate_prompt_tokens
        special = kwargs.get("add_special_tokens")
        side = kwargs.get("truncation_side") or default_truncation_side(pooling)
        _check(special is None or isinstance(special, bool), "add_special_tokens", f"must be a bool, got {special!r}")
        _check(side in ("left", "right"), "truncation_side", f"must be 'left' or 'right', got {side!r}")
        return Tokenization(special, _num_tokens(kwargs, max_model_len), side)

    def prompt(self, tokenizer: Any, prompt: PromptType, default_special: bool = True) -> dict[str, Any]:
        """`prompt` as a token prompt: its text encoded with these options, its ids truncated."""
        # (the keys that ride along with the tokens)
        salt = ({key: prompt[key] for key in ("cache_salt", "multi_modal_data", "multi_modal_uuids") if key in prompt}
                if isinstance(prompt, dict) else {})
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        else:
            text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
            if not isinstance(text, str):
                raise TypeError("prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}, "
                                f"got {type(prompt).__name__}")
            check_utf8(text, "prompt")
            special = default_special if self.add_special_tokens is None else self.add_special_tokens
            ids = tokenizer.encode(text, add_special_tokens=special)
        if self.num_tokens is not None and len(ids) > self.num_tokens:
            ids, text = truncated(ids, self.num_tokens, self.side), None
        return {"prompt": text, "prompt_token_ids": ids, **salt}


def default_truncation_side(pooling: bool) -> str:
    """vLLM's default when a request names no side: its tokenizer registry sets the tokenizer's
    truncation_side to "left" for generating models (the prompt's end, next to what is generated,
    is kept) and "right" for pooling models (the text's beginning is kept)."""
    return "right" if pooling else "left"


def truncated(token_ids: list[int], num_tokens: int, side: str) -> list[int]:
    """`token_ids` cut to `num_tokens`: "left" drops the first ones, "right" the last ones."""
    if len(token_ids) <= num_tokens:
        return token_ids
    return token_ids[len(token_ids) - num_tokens:] if side == "left" else token_ids[:num_tokens]


def _num_tokens(kwargs: dict[str, Any], max_model_len: int) -> int | None:
    truncation, max_length = kwargs.get("truncation"), kwargs.get("max_length")
    count = kwargs.get("truncate_prompt_tokens")
    _check(truncation in (None, True, False, "longest_first", "do_not_truncate"), "truncation",
           f"must be true, false, 'longest_first' or 'do_not_truncate', got {truncation!r}")
    if truncation in (True, "longest_first"):
        count = max_length if max_length is not None else max_model_len
    _check(count is None or (isinstance(count, int) and not isinstance(count, bool) and count >= -1),
           "truncate_prompt_tokens", f"must be an int >= -1 (-1: max_model_len), got {count!r}")
    if count == -1:
        count = max_model_len
    _check(count is None or count <= max_model_len, "truncate_prompt_tokens",
           f"({count}) is greater than max_model_len ({max_model_len})")
    return count


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise VLLMValidationError(f"tokenization_kwargs {key} {message}", parameter=key)
