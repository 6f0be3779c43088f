"""Registers `torch.compile(backend="tpu")` with Dynamo's backend registry as soon as that registry is imported.

Dynamo finds backends of other packages through the `torch_dynamo_backends` entry point, loaded on the first
`lookup_backend("tpu")`. That lookup is not thread-safe: two threads whose first `torch.compile(...,
backend="tpu")` runs at the same time both see the name unregistered, both load the entry point, and the second
`register_backend` fails with "AssertionError: duplicate name: tpu". Registering the backend while the registry
module itself is imported (under Python's import lock, before any thread can look a name up) closes that window.

`import torch` must not import `torch._dynamo` (about a second), so this installs an import hook that waits for
`torch._dynamo.backends.registry` and registers a thin `tpu` entry that imports torch_tpu._compile on its first
call. The entry point stays: `torch._dynamo.list_backends()` and tools that read entry points still find it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Sequence

_REGISTRY = "torch._dynamo.backends.registry"


def tpu(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """The Dynamo backend "tpu" (torch_tpu._compile.tpu_backend, imported on the first compile)."""
    from torch_tpu._compile import tpu_backend

    return tpu_backend(gm, example_inputs, **kwargs)


def _register(registry: Any) -> None:
    if "tpu" not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=tpu, name="tpu")


class _RegisterWhenImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when Python looks for Dynamo's registry module, it asks the other finders for its
    spec and wraps the loader so that the backend is registered right after the module runs."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _REGISTRY:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once; also keeps the lookup below from coming back here
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_and_register(module: Any) -> None:
            exec_module(module)
            _register(module)

        loader.exec_module = exec_and_register  # type: ignore[union-attr]
        return spec


def install() -> None:
    """Registers the backend now if Dynamo's registry is already imported, else when it is; and routes default
    torch.compile's tpu graphs (torch_tpu/_inductor_route.py)."""
    from torch_tpu import _inductor_route

    _inductor_route.install()
    registry = sys.modules.get(_REGISTRY)
    if registry is not None:
        _register(registry)
    elif not any(isinstance(f, _RegisterWhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenImported())
