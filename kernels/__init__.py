"""torch_tpu.kernels: the ATen -> JAX table (registry.py), its helpers (_schema.py, _promote.py) and the kernels,
one module per family.

Importing this package imports every module in it, which defines the lowerings; the eager executor's
`torch_tpu._eager.install()` registers them as PrivateUse1 kernels. Adding a kernel is writing one function with `@lower("aten_overload")` in a module
here (see docs/adding_kernels.md): nothing else needs to change.
"""

import importlib
import pkgutil

from torch_tpu.kernels.registry import DIRECT, LOWERINGS

for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _m.name.startswith("_") and _m.name != "registry":
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["DIRECT", "LOWERINGS"]
