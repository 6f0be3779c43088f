"""The selection rule every Pallas-backed kernel uses (see the package doc)."""

from __future__ import annotations

import collections

from torch_tpu import _config, _runtime

PATHS = ("tpu", "interpret", "reference")

# (kernel, path) -> how many times a program traced that path: tests and `torch.tpu` reports read which ran.
CHOSEN: collections.Counter[tuple[str, str]] = collections.Counter()


def path(kernel: str, fits: bool) -> str:
    """The path `kernel` takes for the shapes being traced; `fits` says whether they meet the Pallas kernel's
    constraints (block sizes, head dims, dtypes). TORCH_TPU_PALLAS: auto (the default: the kernel on a TPU where it
    fits, else the reference), interpret (the kernel in Pallas interpret mode where it fits: for tests on CPU),
    reference (always the XLA path)."""
    setting = _config.get("TORCH_TPU_PALLAS")
    if not fits or setting == "reference":
        chosen = "reference"
    elif setting == "interpret":
        chosen = "interpret"
    else:
        chosen = "tpu" if _runtime.platform() == "tpu" else "reference"
    CHOSEN[(kernel, chosen)] += 1
    return chosen


def interpret(chosen: str) -> bool:
    """The `interpret=` argument of `pl.pallas_call` (or a jax Pallas op) for a path from `path`."""
    return chosen == "interpret"
