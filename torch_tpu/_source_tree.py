"""torch_tpu imported from the source tree (the development loop of docs/contributing.md).

From the repository root, `import torch` finds the source folder `torch_tpu/` before the installed wheel (the
current directory comes first on sys.path). The source tree keeps each component in its top-level folder
(DESIGN.md: `torch_tpu.<component>` lives in `<component>/`; tools/build_wheel.py maps them into the wheel),
and the C++ extension `_C` is a build output. `install` adds a finder that resolves exactly those names:
`torch_tpu.kernels`, `torch_tpu.compile_cache`, `torch_tpu.distributed` from their folders (so a Python edit
takes effect without a rebuild), and `torch_tpu._C` from the extension Bazel built (`bazel-bin/runtime/_C.so`)
or the installed wheel's copy, whichever was built from the current `runtime/` sources. A `_C` built from
other sources never loads: the ImportError says to rerun `bash tools/setup.sh`.

The build writes the hash of runtime/*.cpp and *.h beside `_C.so` (`_C.sources.sha256`, runtime/BUILD); this
module computes the same hash of the source folder and compares. The wheel never imports this module.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

COMPONENTS = ("kernels", "compile_cache", "distributed")  # as tools/build_wheel.py
STAMP = "_C.sources.sha256"


def is_source_tree(package_dir: str) -> bool:
    """True for the source folder torch_tpu/ (its components are siblings), False inside the wheel."""
    root = os.path.dirname(package_dir)
    return (os.path.isfile(os.path.join(root, "MODULE.bazel")) and os.path.isdir(os.path.join(root, "runtime"))
            and not os.path.isdir(os.path.join(package_dir, "kernels")))


def runtime_hash(runtime_dir: str) -> str:
    """sha256 over runtime/*.cpp and *.h sorted by name, each as name, newline, content (runtime/BUILD's
    `_C_stamp` rule computes the same with sha256sum)."""
    h = hashlib.sha256()
    for name in sorted(n for n in os.listdir(runtime_dir) if n.endswith((".cpp", ".h"))):
        h.update(name.encode() + b"\n")
        with open(os.path.join(runtime_dir, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _candidates(root: str) -> list[str]:
    """Built `_C.so` files, preferred first: Bazel's output, then installed wheels on sys.path."""
    out = [os.path.join(root, "bazel-bin", "runtime", "_C.so")]
    real_root = os.path.realpath(root)
    for entry in sys.path:
        if not entry or os.path.realpath(entry) == real_root:
            continue
        so = os.path.join(entry, "torch_tpu", "_C.so")
        if so not in out:
            out.append(so)
    return [p for p in out if os.path.isfile(p)]


def _stamp(so: str) -> str | None:
    try:
        with open(os.path.join(os.path.dirname(so), STAMP)) as f:
            return f.read().strip()
    except OSError:
        return None


def extension_path(root: str) -> str:
    """The `_C.so` built from the current runtime/ sources; ImportError saying what to do when there is none."""
    want = runtime_hash(os.path.join(root, "runtime"))
    found = _candidates(root)
    for so in found:
        if _stamp(so) == want:
            return so
    fix = f"run `bash tools/setup.sh` in {root} (it rebuilds the extension with Bazel and installs the wheel)"
    if not found:
        raise ImportError(f"torch_tpu is imported from the source tree ({root}), but its C++ extension _C is not "
                          f"built: {fix}.", name="torch_tpu._C")
    raise ImportError(
        f"torch_tpu is imported from the source tree ({root}), but every built C++ extension _C was built from "
        f"other runtime/ sources than the current ones ({', '.join(found)}): loading it could run old C++ "
        f"with new Python. {fix}.", name="torch_tpu._C")


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        top, _, sub = fullname.partition(".")
        if top != "torch_tpu":
            return None
        if sub == "_C":
            so = extension_path(self.root)
            return importlib.util.spec_from_file_location(
                fullname, so, loader=importlib.machinery.ExtensionFileLoader(fullname, so))
        if sub in COMPONENTS:
            folder = os.path.join(self.root, sub)
            return importlib.util.spec_from_file_location(
                fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])
        return None


class _RootEntryFinder:
    """The path entry finder of the repository root on sys.path: the root's own finder, except that the component
    folders are not top-level packages. Without it, the root on sys.path makes `kernels/` the top-level package
    `kernels` (Hugging Face's kernel hub, which transformers probes for at import: it then imported torch_tpu's
    lowerings a second time and failed) and `distributed/` Dask's `distributed`; with it those names resolve
    from the rest of sys.path, or are absent."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def find_spec(self, fullname: str, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in COMPONENTS:
            return None
        return self.inner.find_spec(fullname, target)

    def invalidate_caches(self) -> None:
        self.inner.invalidate_caches()


def _hide_components(root: str) -> None:
    """Puts a _RootEntryFinder in sys.path_importer_cache for each sys.path entry that is the repository root
    (the current directory's '' among them: PathFinder keys it by os.getcwd())."""
    real_root = os.path.realpath(root)
    for entry in list(sys.path):
        key = entry or os.getcwd()
        if not isinstance(key, str) or os.path.realpath(key) != real_root:
            continue
        inner = sys.path_importer_cache.get(key)
        if isinstance(inner, _RootEntryFinder):
            continue
        if inner is None:
            for hook in sys.path_hooks:
                try:
                    inner = hook(key)
                    break
                except ImportError:
                    continue
        if inner is not None:
            sys.path_importer_cache[key] = _RootEntryFinder(inner)
        for name in COMPONENTS:  # a component already imported as a top-level package (before torch_tpu)
            mod = sys.modules.get(name)
            if os.path.realpath(os.path.dirname(getattr(mod, "__file__", None) or "")) == os.path.join(real_root,
                                                                                                      name):
                del sys.modules[name]


def install(package_dir: str) -> list[tuple[str, str]]:
    """Makes the source tree importable in place; returns the (folder, path inside the wheel) of each Python
    source folder (torch_tpu.`_SOURCE_FOLDERS`)."""
    root = os.path.dirname(package_dir)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(root))
    _hide_components(root)
    return [(package_dir, "")] + [(os.path.join(root, c), c) for c in COMPONENTS]
