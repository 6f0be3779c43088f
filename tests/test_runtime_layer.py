"""The runtime layer (torch_tpu/_runtime.py, runtime/ C++) is the ground floor: imports point from the executors
down to it, never up (DESIGN.md, "Executors"). Checked on the sources' import statements, so a function-local
import counts too."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXECUTORS = {"_deferred", "_compile", "_eager", "_executor", "_storage", "kernels"}


def _imported(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            mod = node.module.split(".")
            if mod[0] == "torch_tpu":
                names.update(mod[1:2] or [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for a in node.names:
                mod = a.name.split(".")
                if mod[0] == "torch_tpu" and len(mod) > 1:
                    names.add(mod[1])
    return names


def test_runtime_and_program_collector_import_no_executor() -> None:
    for name in ("_runtime.py", "_programs.py", "_rng.py"):
        found = _imported(ROOT / "torch_tpu" / name) & EXECUTORS
        assert not found, f"torch_tpu/{name} imports executor modules {sorted(found)}"


def test_storage_resolves_any_placeholder_through_the_registered_resolver() -> None:
    """The C++ contract (runtime/TpuPython.cpp): a storage holds its concrete array or a placeholder of any type;
    a read asks the registered resolver, and holds what it returns from then on."""
    import torch

    from torch_tpu import _C, _deferred

    class Placeholder:  # not the fused executor's type: the contract is executor-agnostic
        def __init__(self, value) -> None:
            self.value, self.shape, self.dtype = value, value.shape, value.dtype

    calls = []

    def resolver(x):
        if type(x) is Placeholder:
            calls.append(x)
            return x.value
        return _deferred.resolve(x)

    t = torch.arange(6.0, device="tpu")
    arr = _C._array(t)
    _C._set_array(t, Placeholder(arr * 2), torch.float32)
    _C._set_resolver(resolver)
    try:
        assert torch.equal(t.cpu(), torch.arange(6.0) * 2)
        assert len(calls) == 1
        assert torch.equal((t + 1).cpu(), torch.arange(6.0) * 2 + 1)
        assert len(calls) == 1  # swapped for its array on the first read
    finally:
        _C._set_resolver(_deferred.resolve)
