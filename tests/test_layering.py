"""The layers import one way (docs/contributing.md, "Layers"): the table (kernels/registry.py) and the kernels know
no executor, they call the executor interface (torch_tpu/_executor.py); the executors (eager _eager.py, fused
_deferred.py, trace _trace.py/_compile.py) sit above it; _checks and _runtime are the ground floor.

Read from the source tree with `ast`: every import, at module level or inside a function, counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

# Top-level folder -> import path (DESIGN.md: `torch_tpu.<x>` lives in `<x>/`).
_FOLDERS = {"torch_tpu": "torch_tpu", "kernels": "torch_tpu.kernels", "distributed": "torch_tpu.distributed",
            "compile_cache": "torch_tpu.compile_cache"}
_EXECUTORS = {"torch_tpu._deferred", "torch_tpu._eager", "torch_tpu._foreach", "torch_tpu._compile", "torch_tpu._trace"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO)
    parts = [_FOLDERS[rel.parts[0]], *rel.parts[1:]]
    parts[-1] = parts[-1][: -len(".py")]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` (the text of `module`) imports; `from a import b` counts as `a` and `a.b` (b may be
    a submodule)."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _imports(path: Path) -> set[str]:
    return imports_of(path.read_text(), _module_name(path), path.name == "__init__.py")


def _files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def _offending(paths: list[Path], forbidden: set[str]) -> dict[str, list[str]]:
    bad = {}
    for p in paths:
        hits = sorted(m for m in _imports(p) if any(m == f or m.startswith(f + ".") for f in forbidden))
        if hits:
            bad[str(p.relative_to(REPO))] = hits
    return bad


def test_the_checker_sees_every_import_form() -> None:
    src = ("from torch_tpu import _deferred\n"
           "def f():\n    import torch_tpu._eager as e\n"
           "from .. import _compile\n")
    got = imports_of(src, "torch_tpu.kernels.nn")
    assert {"torch_tpu._deferred", "torch_tpu._eager", "torch_tpu._compile"} <= got
    assert imports_of("from . import registry\n", "torch_tpu.kernels", is_package=True) >= {
        "torch_tpu.kernels.registry"}
    assert _offending([REPO / "torch_tpu" / "_eager.py"], {"torch_tpu._executor"})  # _eager does use it


def test_kernels_and_storage_call_only_the_executor_interface() -> None:
    paths = _files("kernels") + [REPO / "torch_tpu" / "_storage.py"] + _files("distributed")
    assert len(paths) > 12
    assert _offending(paths, _EXECUTORS) == {}


def test_registry_is_the_table_only() -> None:
    path = REPO / "kernels" / "registry.py"
    tree = ast.parse(path.read_text())
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(t.id for t in targets if isinstance(t, ast.Name))
    table = {"Lowering", "LOWERINGS", "DIRECT", "DEFERRABLE", "GRAPH_DECOMPOSITIONS", "lower", "direct",
             "HIGHER_ORDER", "higher_order",
             "DEFAULT", "INT_TO_FLOAT", "ALWAYS_BOOL", "COMPLEX_TO_FLOAT", "BOOL_TO_LONG", "NO_OPMATH"}
    assert defined == table
    assert not [m for m in _imports(path) if m.startswith("torch_tpu")]


def test_helpers_beside_the_table_know_no_executor() -> None:
    paths = [REPO / "kernels" / "_schema.py", REPO / "kernels" / "_promote.py"]
    assert _offending(paths, _EXECUTORS | {"torch_tpu._executor"}) == {}


def test_executors_are_peers_behind_the_interface() -> None:
    t = REPO / "torch_tpu"
    # The interface uses the fused executor's recording; it knows neither the eager nor the trace executor.
    assert _offending([t / "_executor.py"], {"torch_tpu._eager", "torch_tpu._compile", "torch_tpu._trace",
                                             "torch_tpu.kernels"}) == {}
    # The eager executor records through the interface, never into _deferred directly; it knows no tracing.
    assert _offending([t / "_eager.py"], {"torch_tpu._deferred", "torch_tpu._compile", "torch_tpu._trace"}) == {}
    assert _offending([t / "_trace.py"], {"torch_tpu._deferred", "torch_tpu._eager", "torch_tpu._compile"}) == {}
    assert _offending([t / "_compile.py"], {"torch_tpu._deferred", "torch_tpu._eager"}) == {}
    # The fused executor sits on the ground floor only.
    assert _offending([t / "_deferred.py"], {"torch_tpu._executor", "torch_tpu._eager", "torch_tpu._compile",
                                             "torch_tpu._trace", "torch_tpu._storage", "torch_tpu.kernels"}) == {}


def test_checks_import_no_executor() -> None:
    from torch_tpu import _checks
    from torch_tpu._deferred import EagerMode

    assert _offending([REPO / "torch_tpu" / "_checks.py"], _EXECUTORS | {"torch_tpu._executor"}) == {}
    assert _checks._LAUNCH_BLOCKING == EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING


def test_runtime_imports_no_executor() -> None:
    assert _offending([REPO / "torch_tpu" / "_runtime.py"], _EXECUTORS | {"torch_tpu._executor"}) == {}


def test_runtime_and_rng_are_ground_floor() -> None:
    """_runtime starts PJRT and nothing else: what runs around the start (joining torchrun's world, the compile
    cache, the program collector) is wired in by torch_tpu/__init__.py; the RNG module keeps the default
    generators itself instead of reaching up into the device module."""
    above = {"torch_tpu.compile_cache", "torch_tpu.distributed", "torch_tpu.device_module", "torch_tpu._programs",
             "torch_tpu._storage", "torch_tpu.kernels", "torch_tpu._executor", *_EXECUTORS}
    assert _offending([REPO / "torch_tpu" / "_runtime.py"], above) == {}
    assert _offending([REPO / "torch_tpu" / "_rng.py"], above) == {}


def test_installed_modules_match_the_layering() -> None:
    """The installed wheel has the same split (a new module that is not packaged would break it)."""
    import torch_tpu._eager
    import torch_tpu._executor
    import torch_tpu._trace
    import torch_tpu.kernels._promote
    import torch_tpu.kernels._schema
    from torch_tpu.kernels import registry

    public = {n for n in vars(registry) if not n.startswith("_")} - {"annotations", "dataclasses", "Any",
                                                                         "Callable", "Sequence",
                                                                         "ELEMENTWISE_TYPE_PROMOTION_KIND"}
    assert public == {"Lowering", "LOWERINGS", "DIRECT", "DEFERRABLE", "GRAPH_DECOMPOSITIONS", "lower", "direct",
                      "HIGHER_ORDER", "higher_order",
                      "DEFAULT",
                      "INT_TO_FLOAT", "ALWAYS_BOOL", "COMPLEX_TO_FLOAT", "BOOL_TO_LONG", "NO_OPMATH"}
    assert torch_tpu._eager.KERNELS and "add.Tensor" in torch_tpu._eager.KERNELS
    assert torch_tpu._trace.traceable("add.Tensor")
    assert callable(torch_tpu._executor.jitted)
    assert issubclass(torch_tpu._eager.OpKernel, torch_tpu.kernels._schema.Signature)
    assert callable(torch_tpu.kernels._promote.write_outs)


def test_the_doctor_is_a_top_layer() -> None:
    """torch_tpu.doctor reads the runtime's metrics; nothing below it imports it (torch.tpu.doctor is a lazy
    attribute of the device module, resolved on first use)."""
    below = [p for p in _files("torch_tpu") + _files("kernels") + _files("compile_cache") + _files("distributed")
             if "doctor" not in p.parts]
    assert _offending(below, {"torch_tpu.doctor"}) == {}
    doctor = _files("torch_tpu/doctor")
    assert doctor and any("torch_tpu._metrics" in _imports(p) or "torch_tpu" in _imports(p) for p in doctor)
