"""The LoRA adapters an engine holds: each name in a device slot of the executor's (at most
``max_loras``), with an id of its own that keys its prefix-cache blocks. Ids are never reused,
so blocks cached under an adapter since unloaded (or reloaded under its name) are never served
to another; they age out of the LRU like any other."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hf_paged.engine.sequence import Sequence
    from hf_paged.lora.adapter import LoraAdapter
    from hf_paged.worker.executor import Executor

BASE = (-1, 0)  # the base model: no slot, the base prefix-cache chain


class Adapters:
    def __init__(self, executor: Executor, max_loras: int):
        self.executor, self.max_loras = executor, max_loras
        self.loaded: dict[str, tuple[int, int]] = {}  # name -> (slot, id)
        # For a caller that keeps adapters elsewhere (peft's layers on the drop-in model):
        # what each was loaded from, to tell when it changed.
        self.sources: dict[str, object] = {}
        self._ids = itertools.count(1)

    def names(self) -> list[str]:
        return list(self.loaded)

    def resolve(self, name: str | None) -> tuple[int, int]:
        """The slot and id of adapter ``name`` (None: the base model's); a ValueError naming
        it when the engine does not hold it."""
        if name is None:
            return BASE
        if name not in self.loaded:
            held = ", ".join(map(repr, self.loaded)) or "none"
            raise ValueError(f"adapter {name!r} is not loaded (loaded adapters: {held})")
        return self.loaded[name]

    def add(self, name: str, adapter: LoraAdapter) -> None:
        """Load ``adapter`` under ``name`` into a free slot."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter name must be a non-empty string, got {name!r}")
        if name in self.loaded:
            raise ValueError(f"adapter {name!r} is already loaded; remove it first")
        free = sorted(set(range(self.max_loras)) - {slot for slot, _ in self.loaded.values()})
        if not free:
            raise ValueError(f"max_loras={self.max_loras} adapters are loaded already "
                             f"({', '.join(map(repr, self.loaded))}); remove one or raise "
                             f"max_loras")
        self.executor.load_lora(free[0], adapter)
        self.loaded[name] = (free[0], next(self._ids))

    def remove(self, name: str, live: Iterable[Sequence]) -> None:
        """Unload adapter ``name``; a ValueError while requests of ``live`` still use it."""
        slot, _ = self.resolve(name)
        users = sum(1 for seq in live if seq.lora_slot == slot)
        if users:
            raise ValueError(f"adapter {name!r} is in use by {users} running or waiting "
                             f"request(s); remove it once they finish")
        self.executor.unload_lora(slot)
        del self.loaded[name]
        self.sources.pop(name, None)
