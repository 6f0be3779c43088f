"""torch_tpu.distributed: the `tpu_dist` torch.distributed backend.

`dist.init_process_group(backend="tpu_dist")` (alias `"tpu"`; also the default backend for tpu tensors) gives a
process group whose collectives are XLA programs over a global JAX mesh spanning all processes
(`jax.distributed`: ICI/DCN on TPU, gloo on XLA:CPU). Registered when torch_tpu loads; nothing here imports JAX
until a group is created.
"""

from __future__ import annotations

from typing import Any

BACKEND = "tpu_dist"
ALIASES = ("tpu",)

_registered = False


def _create(opts: Any, pg_options: Any = None) -> Any:
    from torch_tpu.distributed import process_group

    return process_group.create(opts, pg_options)


def register() -> None:
    """Registers the c10d backend for device `tpu` and the tpu kernels of the functional collectives."""
    global _registered
    if _registered:
        return
    import torch.distributed as dist

    if not dist.is_available():
        return
    for name in (BACKEND, *ALIASES):
        dist.Backend.register_backend(name, _create, extended_api=True, devices=["tpu"])
    from torch_tpu.distributed import _functional

    _functional.install()
    _registered = True
