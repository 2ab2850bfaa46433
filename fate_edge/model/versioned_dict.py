"""A dict that counts its changes: what was built from its contents (a layer plan, a whole-layer program) is built
again once ``version`` moves."""

from __future__ import annotations

from typing import Any


class VersionedDict(dict):
    """A dict whose every change (assignment, deletion, pop, update, setdefault, clear) bumps ``version``."""

    version = 0

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self.version += 1

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self.version += 1

    def pop(self, key: Any, *default: Any) -> Any:
        self.version += 1
        return super().pop(key, *default)

    def update(self, *args: Any, **kw: Any) -> None:
        super().update(*args, **kw)
        self.version += 1

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self.version += 1
        return super().setdefault(key, default)

    def clear(self) -> None:
        super().clear()
        self.version += 1
