"""TORCH_TPU_* settings read while torch_tpu loads, and what a bad value does.

torch_tpu loads at `import torch` (the `torch.backends` entry point), so a bad value must not raise there:
every script, CPU-only ones too, would fail at `import torch`. Nor may it be ignored. A setting read at load
goes through `read` (or passes its parse error to `defer`): a bad value keeps the default for the moment, and
its error, naming the variable, the value and the valid values, is raised by `check()`. The runtime calls
`check()` at the first tpu use and at every later one (`torch_tpu._runtime.start`, `torch.tpu.is_available`),
so the program stops there instead of running with a setting it did not ask for.
"""

from __future__ import annotations

import os
from typing import Callable, TypeVar

T = TypeVar("T")

_errors: dict[str, str] = {}  # variable -> what is wrong with its value


def defer(name: str, message: str) -> None:
    """Records that `name` has a bad value (`message` says which and what is valid), raised by check()."""
    _errors.setdefault(name, message.replace("torch_tpu: ", ""))


def read(name: str, parse: Callable[[str], T], default: T) -> T:
    """The value of `name` parsed by `parse` (which raises ValueError("is not ..."), saying what is valid), or `default`
    when unset or empty; a bad value gives `default` and an error for check()."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return parse(raw)
    except ValueError as e:
        defer(name, f"{name}={raw!r} {e}.")
        return default


def positive_int(raw: str) -> int:
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError("is not a positive integer")
    return n


def one_of(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw.lower() not in choices:
            raise ValueError(f"is not one of {', '.join(choices)} (or unset it)")
        return raw.lower()

    return parse


def check() -> None:
    """Raises the errors of bad TORCH_TPU_* values read at load (see the module doc)."""
    if _errors:
        raise RuntimeError(
            "torch_tpu: " + " ".join(_errors.values())
            + " Fix or unset " + ("it" if len(_errors) == 1 else "them")
            + " (torch_tpu read the environment at `import torch`)."
        )
