"""A cache of values by key within a budget of their summed sizes, the least recently used
dropped first (the worker's image features, the client's processed images)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

Value = TypeVar("Value")


class SizedLru(Generic[Value]):
    """`size(value)` counts against `budget`; a value larger than the whole budget is not kept."""

    def __init__(self, budget: int, size: Callable[[Value], int]) -> None:
        self.budget = budget
        self.size = size
        self.used = 0
        self.entries: OrderedDict[Hashable, Value] = OrderedDict()

    def get(self, key: Hashable) -> Value | None:
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Value) -> None:
        size = self.size(value)
        if size > self.budget or key in self.entries:
            return
        while self.used + size > self.budget:
            _, dropped = self.entries.popitem(last=False)
            self.used -= self.size(dropped)
        self.entries[key] = value
        self.used += size

    def clear(self) -> None:
        self.entries.clear()
        self.used = 0
