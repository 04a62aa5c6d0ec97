"""Modules: one file each. The registry imports a module's file only when a playbook names it."""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

from sparkprov.modules.base import Module


@lru_cache(maxsize=None)
def registry() -> dict[str, type[Module]]:
    found: dict[str, type[Module]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, Module) and obj is not Module and getattr(obj, "name", None):
                found[obj.name] = obj
    return found


def get(name: str) -> type[Module] | None:
    return registry().get(name)
