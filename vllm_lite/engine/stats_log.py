"""vLLM's periodic stats line (its LoggingStatLogger): every `VLLM_LOG_STATS_INTERVAL` seconds
(vLLM's variable, default 10) while the engine has work, the prompt and generation throughput over
the interval, the running and waiting requests, the KV cache in use and the prefix-cache hit rate
over the interval; one more line once it has gone idle. With speculative decoding, vLLM's
"SpecDecoding metrics" line after it (acceptance length and rates of the interval's drafts). Off with --disable-log-stats (the
/metrics endpoint counts either way). `LLM(disable_log_stats=False)` writes it too, checked after
each engine step; an application's AsyncLLM writes one when it calls `do_log_stats()`."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_lite.engine.stats import IterationStats, SpecDecodingStats, kv_cache_usage

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0


def log_stats_interval() -> float:
    raw = os.environ.get("VLLM_LOG_STATS_INTERVAL", str(DEFAULT_INTERVAL_S))
    try:
        interval = float(raw)
    except ValueError:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL must be a number of seconds, got {raw!r}") from None
    if not interval > 0:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL must be > 0, got {raw!r}")
    return interval


@dataclass(slots=True)
class StatsLog:
    interval_s: float
    prompt_tokens: int = 0  # since the last line
    generation_tokens: int = 0
    _queries: int = 0  # the engine's prefix-cache counters at the last line
    _hits: int = 0
    _mm_queries: int = 0  # the client's processor-cache counters at the last line
    _mm_hits: int = 0
    _was_busy: bool = False
    _last_ts: float = field(default_factory=time.monotonic)
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)  # since the last line

    def record_iteration(self, stats: IterationStats) -> None:
        """A stat logger of the engine client (called with each step's stats)."""
        self.prompt_tokens += stats.num_prompt_tokens
        self.generation_tokens += stats.num_generation_tokens
        if stats.spec_decoding is not None:
            self.spec_decoding.add(stats.spec_decoding)

    async def run(self, get_stats: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        """Until cancelled (the server's lifespan) or the engine stops answering."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                stats = await get_stats()
            except Exception:  # the engine is gone: the server reports that elsewhere
                return
            self.log(stats)

    def log_if_due(self, get_stats: Callable[[], dict[str, Any]]) -> None:
        """The synchronous form, called after each engine step (LLM's, as vLLM's LLMEngine does):
        a line once the interval has passed since the last."""
        if time.monotonic() - self._last_ts >= self.interval_s:
            self.log(get_stats())

    def log(self, stats: dict[str, Any]) -> None:
        """The line for the time since the last one (none while the engine stays idle)."""
        now = time.monotonic()
        line, spec_line = self.line(stats, now - self._last_ts), self.spec_decoding_line(now - self._last_ts)
        self._last_ts = now
        if line is not None:
            logger.info("%s", line)
        if spec_line is not None:
            logger.info("%s", spec_line)

    def spec_decoding_line(self, elapsed_s: float) -> str | None:
        """vLLM's speculative decoding line for the interval; None without drafts in it."""
        spec, self.spec_decoding = self.spec_decoding, SpecDecodingStats()
        if not spec.num_drafts:
            return None
        rates = ", ".join(f"{accepted / spec.num_drafts:.3f}" for accepted in spec.num_accepted_tokens_per_pos)
        return (f"SpecDecoding metrics: Mean acceptance length: {1 + spec.num_accepted_tokens / spec.num_drafts:.2f}, "
                f"Accepted throughput: {spec.num_accepted_tokens / elapsed_s:.2f} tokens/s, "
                f"Drafted throughput: {spec.num_draft_tokens / elapsed_s:.2f} tokens/s, "
                f"Accepted: {spec.num_accepted_tokens} tokens, Drafted: {spec.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {rates}, "
                f"Avg Draft acceptance rate: {100.0 * spec.num_accepted_tokens / spec.num_draft_tokens:.1f}%")

    def line(self, stats: dict[str, Any], elapsed_s: float) -> str | None:
        """The interval's line; None while the engine stays idle."""
        prompt, generation = self.prompt_tokens, self.generation_tokens
        self.prompt_tokens = self.generation_tokens = 0
        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        new_queries, new_hits = queries - self._queries, hits - self._hits
        self._queries, self._hits = queries, hits
        running, waiting = stats.get("num_running", 0), stats.get("num_waiting", 0)
        busy = bool(prompt or generation or running or waiting)
        if not (busy or self._was_busy):
            return None
        self._was_busy = busy
        hit_rate = 100.0 * new_hits / new_queries if new_queries > 0 else 0.0
        text = (f"Avg prompt throughput: {prompt / elapsed_s:.1f} tokens/s, Avg generation throughput: "
                f"{generation / elapsed_s:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {100.0 * kv_cache_usage(stats):.1f}%, Prefix cache hit rate: {hit_rate:.1f}%")
        return text + self._mm_cache_part(stats)

    def _mm_cache_part(self, stats: dict[str, Any]) -> str:
        """vLLM's ", MM cache hit rate" of the interval's image lookups; nothing without any."""
        queries, hits = stats.get("mm_cache_queries", 0), stats.get("mm_cache_hits", 0)
        new_queries, new_hits = queries - self._mm_queries, hits - self._mm_hits
        self._mm_queries, self._mm_hits = queries, hits
        return f", MM cache hit rate: {100.0 * new_hits / new_queries:.1f}%" if new_queries > 0 else ""
