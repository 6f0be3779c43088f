"""JAX modules, imported on first use: `import torch` with torch_tpu installed must not pay for JAX.

Kernel modules write `from torch_tpu._jax import jax, jnp, lax`; each name is a proxy that imports
its module the first time an attribute is read (at trace time, never on a jit cache hit).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _LazyModule:
    __slots__ = ("_name", "_module")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def _load(self) -> ModuleType:
        if self._module is None:
            from torch_tpu import _runtime

            _runtime.configure_jax()
            self._module = importlib.import_module(self._name)
        return self._module

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._load(), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


jax: Any = _LazyModule("jax")
jnp: Any = _LazyModule("jax.numpy")
lax: Any = _LazyModule("jax.lax")
