"""What the server knows beyond the engine: its limits (`ServerOptions`, one flag each) and the
drain that SIGTERM starts (`ShutdownDrain`)."""

from __future__ import annotations

import asyncio
import codecs
import copy
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_lite.entrypoints.openai.serving_models import LoRAModulePath

logger = logging.getLogger(__name__)

# FastAPI parses and validates JSON on the event loop: a body of 4 MiB of token ids takes ~0.3 s
# there, and the limit bounds that stall. 4 MiB holds a 128k-token prompt several times over.
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
# vLLM bounds `n` with VLLM_MAX_N_SEQUENCES (16384 by default); on a CPU engine a few hundred
# samples already occupy every sequence slot, so the server's default is lower.
DEFAULT_MAX_N_SEQUENCES = 128
# /v1/responses: a stored response holds its conversation (text), so a few thousand stay small.
DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclass(slots=True)
class ServerLoad:
    """vLLM's server load (--enable-server-load-tracking, reported by GET /load): generation
    requests in flight, a streamed one until its stream ends. Stays 0 when not enabled."""

    enabled: bool = False
    in_flight: int = 0

    def start(self) -> None:
        if self.enabled:
            self.in_flight += 1

    def end(self) -> None:
        if self.enabled:
            self.in_flight -= 1


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """| option | flag | meaning |
    |---|---|---|
    | api_key | --api-key (one or more) / VLLM_LITE_API_KEY / vLLM's VLLM_API_KEY | `Authorization: Bearer <key>` (one of the keys) on every route but /health and /ping |
    | max_request_body_bytes | --max-request-body-bytes | larger bodies get 413 before they are parsed |
    | max_n_sequences | --max-n-sequences | the largest `n` a request may ask for |
    | trust_request_chat_template | --trust-request-chat-template | accept `chat_template` in requests |
    | enable_force_include_usage | --enable-force-include-usage | streams end with usage even when not asked |
    | enable_prompt_tokens_details | --enable-prompt-tokens-details | usage carries prompt_tokens_details.cached_tokens |
    | enable_server_load_tracking | --enable-server-load-tracking | /load counts generation requests in flight |
    | enable_request_id_headers | --enable-request-id-headers | responses carry X-Request-Id (the caller's or a new one) |
    | health_check_timeout_s | --health-check-timeout | /health answers 503 when the engine does not answer in time |
    | shutdown_timeout_s | --shutdown-timeout | after SIGTERM, how long in-flight requests may run on |
    | chat_template_timeout_s | --chat-template-timeout | a chat template still running after this is stopped (400) |
    | enable_auto_tool_choice | --enable-auto-tool-choice | tool_choice "auto" (the default with tools) is served |
    | tool_call_parser | --tool-call-parser | how tool calls are read from the text (tool_parsers.py) |
    | reasoning_parser | --reasoning-parser | `<think>` text of chat replies as `reasoning` (reasoning_parsers.py) |
    | enable_tokenizer_info_endpoint | --enable-tokenizer-info-endpoint | GET /tokenizer_info (the tokenizer's configuration) |
    | root_path | --root-path | the path prefix a proxy serves the app under (routes answer with and without it) |
    | max_stored_responses | --max-stored-responses | /v1/responses kept for previous_response_id (oldest forgotten first) |
    | allowed_origins, allowed_methods, allowed_headers, allow_credentials | --allowed-origins ... --allow-credentials | CORS, as vLLM: every origin, method and header by default |
    | disable_fastapi_docs | --disable-fastapi-docs | no /docs, /redoc, /openapi.json |
    | chat_template | --chat-template | the template chat requests use instead of the tokenizer's (a request's own wins, where trusted) |
    | enable_log_requests, max_log_len | --enable-log-requests, --max-log-len | log each generation request (prompt cut to max_log_len) |
    | enable_log_outputs | --enable-log-outputs | with enable_log_requests, log each finished completion's text |
    | disable_log_stats | --disable-log-stats | no periodic throughput / queue / KV cache line (engine/stats_log.py) |
    | response_role | --response-role | the chat reply's role with add_generation_prompt (else the last message's) |
    | chat_template_content_format | --chat-template-content-format | message content as the template reads it (chat_content.py) |
    | middleware | --middleware (repeated) | import paths of ASGI middleware classes / HTTP middleware functions, outermost |
    | default_chat_template_kwargs | --default-chat-template-kwargs | chat template arguments a request's own override |
    | return_tokens_as_token_ids | --return-tokens-as-token-ids | logprob tokens as 'token_id:<int>' unless a request says |
    | exclude_tools_when_tool_choice_none | --exclude-tools-when-tool-choice-none | tool_choice "none": no tools in the template |
    | compact_structured_outputs | --structured-outputs-config disable_any_whitespace | every JSON grammar without whitespace |
    | dev_mode | vLLM's VLLM_SERVER_DEV_MODE=1 | its development routes (here: POST /reset_prefix_cache, /reset_mm_cache, /reset_encoder_cache and the engine-control routes: /collective_rpc, /sleep, /pause, ...) |
    | lora_modules | --lora-modules | LoRA adapters served under their names from the start (needs --enable-lora) |
    | allow_runtime_lora_updating | vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 | POST /v1/load_lora_adapter, /v1/unload_lora_adapter |
    | lora_resolver_cache_dir | vLLM's VLLM_LORA_RESOLVER_CACHE_DIR (with runtime updating) | an unknown model name loads the adapter in that folder's sub-folder of the name |
    """

    api_key: str | tuple[str, ...] | None = None  # one key, or several (vLLM's --api-key k1 k2)
    dev_mode: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_n_sequences: int = DEFAULT_MAX_N_SEQUENCES
    trust_request_chat_template: bool = False
    enable_force_include_usage: bool = False
    enable_prompt_tokens_details: bool = False
    enable_request_id_headers: bool = False
    enable_server_load_tracking: bool = False
    health_check_timeout_s: float = 5.0
    shutdown_timeout_s: float = 30.0
    chat_template_timeout_s: float = 5.0
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # False: the reasoning is split off and left out (gpt-oss's analysis channel without
    # --reasoning-parser, as vLLM)
    show_reasoning: bool = True
    enable_tokenizer_info_endpoint: bool = False
    root_path: str = ""
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    disable_fastapi_docs: bool = False
    chat_template: str | None = None  # the template's text (load_chat_template)
    enable_log_requests: bool = False
    enable_log_outputs: bool = False
    max_log_len: int | None = None
    disable_log_stats: bool = False
    response_role: str = "assistant"
    chat_template_content_format: str = "auto"
    middleware: tuple[str, ...] = ()
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    return_tokens_as_token_ids: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    compact_structured_outputs: bool = False
    lora_modules: tuple[LoRAModulePath, ...] = ()
    allow_runtime_lora_updating: bool = False
    lora_resolver_cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {self.max_log_len}")
        if self.enable_log_outputs and not self.enable_log_requests:
            raise ValueError("--enable-log-outputs logs beside --enable-log-requests: give both")
        for name in ("max_request_body_bytes", "max_n_sequences", "max_stored_responses"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("health_check_timeout_s", "shutdown_timeout_s", "chat_template_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"root_path must start with '/' and not end with one, got {self.root_path!r}")


@dataclass(slots=True)
class BackgroundRun:
    """A background response (`background: true`) being generated: the task that runs it and,
    for a streamed one, its events so far (`more` is set at each new one), which a client can
    read again from any point (GET /v1/responses/{id}?stream=true&starting_after=N)."""

    task: asyncio.Task[None]
    events: list[dict[str, Any]] | None = None  # None: not streamed
    more: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class ResponseStore:
    """Responses of /v1/responses kept for previous_response_id and GET /v1/responses/{id}:
    each one's body and the conversation (chat messages, instructions left out) that a later
    response continues. At most `capacity`; the least recently used are forgotten first.
    `runs`: the background responses still running, and the streamed ones' events while their
    response is kept (a running one stays until it ends: it holds its own task)."""

    capacity: int = DEFAULT_MAX_STORED_RESPONSES
    _entries: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = field(default_factory=OrderedDict)
    runs: dict[str, BackgroundRun] = field(default_factory=dict)

    def put(self, response_id: str, conversation: list[dict[str, Any]], body: dict[str, Any]) -> None:
        self._entries[response_id] = (conversation, body)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            forgotten, _ = self._entries.popitem(last=False)
            run = self.runs.get(forgotten)
            if run is not None and run.task.done():
                del self.runs[forgotten]

    def add_run(self, response_id: str, run: BackgroundRun) -> None:
        """Keeps `run` while it runs, and a streamed one's events while its response is kept."""
        self.runs[response_id] = run

        def ended(_: asyncio.Task[None]) -> None:
            if self.runs.get(response_id) is run and (run.events is None or response_id not in self._entries):
                del self.runs[response_id]
            run.more.set()  # (a reader waiting for more events learns there are none)

        run.task.add_done_callback(ended)

    def history(self, response_id: str | None) -> list[dict[str, Any]] | None:
        """The conversation that `response_id` ends ([] for None; None when not stored)."""
        if response_id is None:
            return []
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return copy.deepcopy(entry[0])

    def body(self, response_id: str) -> dict[str, Any] | None:
        entry = self._entries.get(response_id)
        return None if entry is None else entry[1]

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(slots=True)
class ShutdownDrain:
    """SIGTERM -> `begin`: new requests get 503 while the ones in flight run on; after
    `shutdown_timeout_s`, `expire` aborts those still running, and each of them ends with an
    error (an SSE error event then [DONE], or a 503 body)."""

    in_flight: set[str] = field(default_factory=set)
    stopping: bool = False
    expired: bool = False
    _timer: asyncio.TimerHandle | None = None

    def begin(self, timeout_s: float, abort: Callable[[list[str]], None]) -> None:
        if self.stopping:
            return
        self.stopping = True
        logger.info("draining %d in-flight request(s) for up to %.1f s", len(self.in_flight), timeout_s)
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self.expire, abort)

    def expire(self, abort: Callable[[list[str]], None]) -> None:
        self.expired = True
        if self.in_flight:
            logger.warning("shutdown timeout: aborting %d request(s) still running", len(self.in_flight))
            abort(sorted(self.in_flight))


def load_chat_template(value: str | None) -> str | None:
    """vLLM's --chat-template: a file's path, or the template itself (single-line form: escapes
    such as \\n are decoded). A value with no template characters that names no file is refused."""
    if value is None:
        return None
    try:
        return Path(value).read_text()
    except OSError:  # not a file (a template string may be too long for a file name)
        pass
    if not any(char in value for char in "{}\n"):
        raise ValueError(f"--chat-template {value!r} looks like a path, but no such file exists")
    return codecs.decode(value, "unicode_escape")
