"""Pallas TPU kernels, each with its XLA (HLO) reference path (DESIGN.md, "Kernels: Pallas and HLO").

One module per kernel (flash attention, paged attention, grouped matmul, fused norms). A module defines its ATen
lowering (`@lower`) or `torch.tpu.ops` custom op once; inside it, `_select.path(kernel, fits)` chooses:
- "tpu": the Pallas kernel, compiled by Mosaic, when the platform is a TPU and the shapes meet its constraints;
- "interpret": the same Pallas kernel in Pallas interpret mode (TORCH_TPU_PALLAS=interpret; for tests on CPU);
- "reference": the XLA path (memory-efficient where the kernel is), everywhere else.
The choice is made while the program is traced, so it is part of what a compiled program does: set
TORCH_TPU_PALLAS before the first call. Tests run every Pallas path in interpret mode against its reference and
against CPU PyTorch (tests/test_pallas_*.py).

Importing this package imports every kernel module in it, which registers its lowerings.
"""

import importlib
import pkgutil

from torch_tpu.kernels.pallas import _select  # noqa: F401

for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")
