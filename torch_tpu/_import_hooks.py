"""Runs a function on a module right after Python imports it (or at once, if it is imported already), without
importing it: how torch_tpu adjusts PyTorch modules that `import torch` does not load (Dynamo's backend registry,
FlexAttention's device gate), so that `import torch` stays as fast as before.

The finder finds nothing itself: when Python looks for a watched module, it asks the other finders for its spec and
wraps the loader so that the functions run right after the module's code, under Python's import lock (before any
other thread can use the module)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Callable

_WATCHED: dict[str, list[Callable[[Any], None]]] = {}


class _RunWhenImported(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        fns = _WATCHED.pop(name, None)
        if fns is None:
            return None  # (also for the lookup below: the name is no longer watched)
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_and_run(module: Any) -> None:
            exec_module(module)
            for fn in fns:
                fn(module)

        loader.exec_module = exec_and_run  # type: ignore[union-attr]
        return spec


_FINDER = _RunWhenImported()


def when_imported(name: str, fn: Callable[[Any], None]) -> None:
    """Calls fn(module) once module `name` is imported: now if it is, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        fn(module)
        return
    _WATCHED.setdefault(name, []).append(fn)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
