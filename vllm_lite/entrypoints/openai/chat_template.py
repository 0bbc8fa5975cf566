"""Chat-template rendering with a deadline and a size limit.

transformers renders chat templates in jinja2's ImmutableSandboxedEnvironment (no attribute
writes, no access to Python internals), which bounds what a template can reach but not how long
it runs: `{% for i in range(99999) %}{% for j in range(99999) %}...` loops for hours. Jinja
compiles a template to Python code (file name "<template>"), so a trace function on the
rendering thread sees every line of it and raises once the deadline has passed; code outside
the template (transformers, jinja's runtime) is not traced, which keeps the cost to template
lines only. The server runs this in its tokenizer thread, never on the event loop.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")
JINJA_TEMPLATE_FILENAME = "<template>"


class TemplateRenderTimeout(Exception):
    pass


def call_with_deadline(fn: Callable[[], T], timeout_s: float) -> T:
    """`fn()` on this thread, stopped with TemplateRenderTimeout when template code is still
    running after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s

    def trace_template_lines(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TemplateRenderTimeout(f"the chat template ran longer than {timeout_s:g} s")
        return trace_template_lines

    def trace_calls(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename == JINJA_TEMPLATE_FILENAME:
            return trace_template_lines(frame, event, arg)
        return None

    previous = sys.gettrace()
    sys.settrace(trace_calls)
    try:
        return fn()
    finally:
        sys.settrace(previous)


def render_chat_template(tokenizer: Any, conversation: list[dict[str, str]], *, max_chars: int,
                         timeout_s: float, **kwargs: Any) -> str:
    """`tokenizer.apply_chat_template(..., tokenize=False)` under the deadline; a result longer
    than `max_chars` is refused (ValueError) before anyone tokenizes it."""
    text = call_with_deadline(
        lambda: tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs), timeout_s)
    if len(text) > max_chars:
        raise ValueError(f"the rendered chat prompt has {len(text)} characters, more than the "
                         f"{max_chars} that could fit in max_model_len tokens")
    return text
