"""Package exports imported on first use, so that importing a package costs only what its user touches (a notebook
reading run folders needs no JAX; `import ipa_jax.envs` needs no transformers)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` for `package`: `name` comes from its submodule `exports[name]`, imported on first
    use and then kept as the package's attribute."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
