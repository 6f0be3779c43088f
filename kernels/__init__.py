"""torch_tpu.kernels: the ATen -> JAX registry (registry.py) and the kernels grouped by family.

Importing this package defines every lowering; `install()` registers them as PrivateUse1 kernels.
Adding a kernel: write one function in the family's module with `@lower("aten_overload")` — see
docs/adding_kernels.md.
"""

from torch_tpu.kernels import copy, creation, elementwise, indexing, linalg, reduction  # noqa: F401
from torch_tpu.kernels.registry import DIRECT, LOWERINGS, install, registered_overloads

__all__ = ["DIRECT", "LOWERINGS", "install", "registered_overloads"]
