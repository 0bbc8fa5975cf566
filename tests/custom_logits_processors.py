"""Custom logits processors written against vLLM's V1 interface (as its docs' examples are), for
tests/test_logits_processors.py and the server test: importable by name from the engine's
processes (`custom_logits_processors:ForcedToken`, or `tests.custom_logits_processors:...` from
the repository root)."""

from __future__ import annotations

from typing import Any

import torch

from vllm_lite.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates


class ForcedToken(LogitsProcessor):
    """vLLM's DummyLogitsProcessor: a request with extra_args {"target_token": t} gets only t."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        target = (sampling_params.extra_args or {}).get("target_token")
        if target is not None and (isinstance(target, bool) or not isinstance(target, int)):
            raise ValueError(f"target_token must be an int, got {target!r}")

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.targets: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.targets, batch_update,
                             lambda params, prompt, outputs: (params.extra_args or {}).get("target_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, target in self.targets.items():
            kept = logits[index, target].item()
            logits[index].fill_(float("-inf"))
            logits[index, target] = kept
        return logits


class ForcedSequence(LogitsProcessor):
    """A request with extra_args {"forced_tokens": [t0, t1, ...]} gets t0, then t1, ...: a reply
    written out token by token (special tokens included), for the server's parsers."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        forced = (sampling_params.extra_args or {}).get("forced_tokens")
        if forced is not None and not (isinstance(forced, list) and all(type(t) is int for t in forced)):
            raise ValueError(f"forced_tokens must be a list of ints, got {forced!r}")

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[list[int], list[int]]] = {}  # row -> (forced, outputs)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, lambda params, prompt, outputs:
                             ((params.extra_args or {})["forced_tokens"], outputs)
                             if (params.extra_args or {}).get("forced_tokens") else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (forced, outputs) in self.rows.items():
            if len(outputs) < len(forced):
                logits[index].fill_(float("-inf"))
                logits[index, forced[len(outputs)]] = 0.0
        return logits


class EchoPrompt(LogitsProcessor):
    """A request with extra_args {"echo": true} gets its prompt again, token by token: its next
    token is prompt[len(outputs) % len(prompt)], read from the prompt and output lists the batch
    updates handed over. Its tokens are right only if this processor's picture of the batch (which
    request is in which row, how many tokens each has) is: joinings, departures, preemption,
    chunked prefill and the row moves that fill holes all show in the output."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[list[int], list[int]]] = {}  # row -> (prompt, outputs)
        self.batch_size = 0

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, prompt, outputs in batch_update.added:
            if (params.extra_args or {}).get("echo"):
                self.rows[index] = (prompt, outputs)
            else:
                self.rows.pop(index, None)
        for src, dst, _ in batch_update.moved:  # (a moved-to row is not listed as removed: vLLM's rule)
            moving = self.rows.pop(src, None)
            self.rows.pop(dst, None)
            if moving is not None:
                self.rows[dst] = moving
        self.batch_size = batch_update.batch_size

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[0] == self.batch_size, (logits.shape, self.batch_size)
        for index, (prompt, outputs) in self.rows.items():
            logits[index].fill_(float("-inf"))
            logits[index, prompt[len(outputs) % len(prompt)]] = 0.0
        return logits


class Sharpen(LogitsProcessor):
    """Argmax-invariant: a request with extra_args {"sharpen": true} has its logits multiplied by
    1,000 (a random draw then picks the argmax). vLLM applies such processors for random sampling
    only, after temperature."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, bool] = {}

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update,
                             lambda params, prompt, outputs: True if (params.extra_args or {}).get("sharpen") else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index in self.rows:
            logits[index] *= 1000.0
        return logits


class NotAProcessor:
    pass


class EchoPromptByDict(EchoPrompt):
    """EchoPrompt keeping its rows with vLLM's process_dict_updates (which reads `added` before
    `removed`: right only if a row a joining fills is not also listed as removed, vLLM's rule)."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, lambda params, prompt, outputs:
                             (prompt, outputs) if (params.extra_args or {}).get("echo") else None)
        if batch_update is not None:
            self.batch_size = batch_update.batch_size
