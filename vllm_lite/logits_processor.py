"""vLLM's V1 custom logits processor interface (vllm.v1.sample.logits_processor), for the classes
given as `LLM(..., logits_processors=[...])` / `--logits-processors`: one instance per worker,
told how the persistent batch changed before each step (`update_state`) and handed the logits of
the batch's rows (`apply`: row i is the request in batch row i) where the sampler applies them.

A request's `SamplingParams.extra_args` (the server's `vllm_xargs`) is how a processor gets its
per-request arguments; `validate_params` checks them when the request arrives (a ValueError there
is the request's 400). The worker side is worker/logits_processors.py."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from vllm_lite.sampling_params import SamplingParams


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # the request in index 1 moves to index 2 (index 1 is left empty)
    SWAP = auto()  # the requests in the two indices trade places


RemovedRequest = int  # its batch index
# (index, params, prompt token ids, output token ids: the request's own list, appended to as it generates)
AddedRequest = tuple[int, "SamplingParams", "list[int] | None", "list[int]"]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the persistent batch changed since the last step; apply in this order: removed,
    added, moved (an added or moved request may take an index another left)."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """vLLM's interface, unchanged: a subclass written for vLLM runs here."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError for params (their extra_args) this processor cannot serve."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's logits [batch_size, vocab] (float32), processed; may edit them in place."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes a row's argmax: it is then applied for random
        sampling only (after temperature and min-p), never for greedy rows."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Before each step; `batch_update` is None when the batch did not change."""
        raise NotImplementedError


def process_dict_updates(req_entries: dict[int, Any], batch_update: BatchUpdate | None,
                         new_state: Callable[[SamplingParams, list[int] | None, list[int]], Any]) -> bool:
    """vLLM's helper for a processor that keeps a state per batch row (`req_entries`): a joining
    request's state from `new_state(params, prompt ids, output ids)` (None: it has none), removed
    rows dropped, moved rows carried (swaps swapped). True when the states changed."""
    if not batch_update:
        return False
    updated = False
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            updated = True
        elif req_entries.pop(index, None) is not None:
            updated = True
    for index in batch_update.removed:
        if req_entries.pop(index, None) is not None:
            updated = True
    for src, dst, direction in batch_update.moved:
        moving, staying = req_entries.pop(src, None), req_entries.pop(dst, None)
        if moving is not None:
            req_entries[dst] = moving
            updated = True
        if staying is not None:
            updated = True
            if direction == MoveDirectionality.SWAP:
                req_entries[src] = staying
    return updated


def processor_name(processor: str | type) -> str:
    """A processor as vLLM's fully qualified class name `module:Class`: a class given as such
    travels to the engine's processes by name. One defined in the script that runs (`__main__`)
    is named by the script's path (`/path/script.py:Class`), which those processes load as
    multiprocessing's spawn loads a main module (its `if __name__ == "__main__":` part not run)."""
    if isinstance(processor, type):
        module = processor.__module__
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        if module in ("__main__", "__mp_main__") and main_file:
            module = str(Path(main_file).resolve())
        return f"{module}:{processor.__qualname__}"
    if not isinstance(processor, str):
        raise ValueError(f"logits_processors entries must be classes or 'module:Class' names, got "
                         f"{type(processor).__name__}")
    return processor


def load_logits_processors(names: Sequence[str]) -> list[type[LogitsProcessor]]:
    """The classes `names` (vLLM's FQCN form `module:Class`) stand for, each a LogitsProcessor."""
    classes = []
    for name in names:
        module_path, _, qualname = name.partition(":")
        if not module_path or not qualname or ":" in qualname:
            raise ValueError(f"Invalid logits processor FQCN {name!r}. Expected format: '<module>:<type>'")
        try:
            target: Any = _module(module_path)
            for part in qualname.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError, OSError) as exc:
            raise ValueError(f"logits processor {name!r} cannot be imported: {exc}") from None
        if not (isinstance(target, type) and issubclass(target, LogitsProcessor)):
            raise ValueError(f"logits processor {name!r} is not a subclass of vllm_lite.logits_processor."
                             "LogitsProcessor")
        if inspect.isabstract(target):
            raise ValueError(f"logits processor {name!r} is abstract: it does not implement "
                             f"{', '.join(sorted(target.__abstractmethods__))}")
        classes.append(target)
    return classes


def _module(module_path: str) -> Any:
    """A module by import path, or a script by its file path (the running script itself when it
    is this process's main module)."""
    if not module_path.endswith(".py"):
        return importlib.import_module(module_path)
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", None) and str(Path(main.__file__).resolve()) == module_path:
        return main
    name = f"__vllm_lite_script_{abs(hash(module_path))}__"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, module_path)
        if spec is None or spec.loader is None:
            raise ImportError(f"no script at {module_path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
