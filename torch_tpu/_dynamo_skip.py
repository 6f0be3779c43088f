"""Keeps TorchDynamo out of torch_tpu's Python kernels.

The tpu ATen kernels are Python functions that the dispatcher calls from C++. When an eager region runs inside a
frame that `torch.compile` is handling (a graph break, `loss.backward()` in a compiled function), Dynamo's frame
hook sees those kernel frames like user code and would try to compile them, and the JAX code under them. Marking
each kernel entry's code object "skip, recursively" makes them run as plain Python under any backend.

This runs at `import torch` (from `torch_tpu._setup`), so it touches only the C half of Dynamo
(`torch._C._dynamo`), never the `torch._dynamo` package.
"""

from __future__ import annotations

from typing import Any, Iterable


def _codes(fns: Iterable[Any]) -> set[Any]:
    codes = set()
    for fn in fns:
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None:
            codes.add(code)
    return codes


def skip_kernels() -> None:
    """Marks every Python entry point that C++ calls (the kernels and the runtime callbacks) as skipped by Dynamo."""
    try:
        from torch._C._dynamo import eval_frame
    except ImportError:  # a torch without Dynamo
        return
    from torch_tpu import _deferred, _eager, _executor, _foreach, _runtime, _storage, device_module
    from torch_tpu.kernels import registry

    skip = eval_frame._FrameAction.SKIP
    strategy = eval_frame._FrameExecStrategy(skip, skip)
    entries = [_eager.OpKernel.functional, _eager.OpKernel.inplace, _eager.OpKernel.out, _foreach.ForeachKernel.__call__,
               _runtime.start, device_module._synchronize, _storage.resize_array, _deferred._backward_ended,
               *registry.DIRECT.values()]
    try:  # kernels installed through DEFER_AND_FUSE's boundary wrapper: C++ calls the wrapper (one code object)
        entries.append(_executor.boundary(lambda: None, "dynamo"))
        entries.append(_executor.blocking_after(lambda: None))
    except (ImportError, AttributeError, TypeError):
        pass
    for code in _codes(entries):
        eval_frame.set_code_exec_strategy(code, strategy)
