"""Registers `torch.compile(backend="tpu")` with Dynamo's backend registry as soon as that registry is imported.

Dynamo finds backends of other packages through the `torch_dynamo_backends` entry point, loaded on the first
`lookup_backend("tpu")`. That lookup is not thread-safe: two threads whose first `torch.compile(...,
backend="tpu")` runs at the same time both see the name unregistered, both load the entry point, and the second
`register_backend` fails with "AssertionError: duplicate name: tpu". Registering the backend while the registry
module itself is imported (under Python's import lock, before any thread can look a name up) closes that window.

`import torch` must not import `torch._dynamo` (about a second), so this waits for
`torch._dynamo.backends.registry` to be imported (torch_tpu/_import_hooks.py) and registers a thin `tpu` entry
that imports torch_tpu._compile on its first call. The entry point stays: `torch._dynamo.list_backends()` and tools that read entry points still find it.
"""

from __future__ import annotations

from typing import Any, Sequence

_REGISTRY = "torch._dynamo.backends.registry"


def tpu(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """The Dynamo backend "tpu" (torch_tpu._compile.tpu_backend, imported on the first compile)."""
    from torch_tpu._compile import tpu_backend

    return tpu_backend(gm, example_inputs, **kwargs)


def _register(registry: Any) -> None:
    if "tpu" not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=tpu, name="tpu")


def install() -> None:
    """Registers the backend now if Dynamo's registry is already imported, else when it is; and routes default
    torch.compile's tpu graphs (torch_tpu/_inductor_route.py)."""
    from torch_tpu import _import_hooks, _inductor_route

    _inductor_route.install()
    _import_hooks.when_imported(_REGISTRY, _register)
