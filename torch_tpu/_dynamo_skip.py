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
    from torch_tpu.kernels import copy as copy_kernels, registry

    skip = eval_frame._FrameAction.SKIP
    strategy = eval_frame._FrameExecStrategy(skip, skip)
    entries = [_eager.OpKernel.functional, _eager.OpKernel.inplace, _eager.OpKernel.out, _foreach.ForeachKernel.__call__,
               _runtime.start, device_module._synchronize, _storage.resize_array, _deferred._backward_ended,
               # (called by the C++ kernels: runtime/TpuDispatch.cpp's recorded entries, TpuMode.cpp's recorder)
               _deferred.record, _deferred._recorded, _deferred._task_started,
               *registry.DIRECT.values(),
               # (aten::_to_copy's and _local_scalar_dense's Python halves and the host read, runtime/TpuCast.cpp)
               *copy_kernels.CASTS, copy_kernels._item_host]
    try:  # kernels installed through DEFER_AND_FUSE's boundary wrapper: C++ calls the wrapper (one code object)
        entries.append(_executor.boundary(lambda: None, "dynamo"))
        entries.append(_executor.blocking_after(lambda: None))
    except (ImportError, AttributeError, TypeError):
        pass
    for code in _codes(entries):
        eval_frame.set_code_exec_strategy(code, strategy)
    from torch_tpu import _import_hooks

    _import_hooks.when_imported("torch._dynamo.trace_rules", _skip_jax)
    _import_hooks.when_imported("torch._dynamo.config", _ignore_optimizer_hooks)
    # JAX's API boundary (one code object): the first Python frame of a jitted call's cache miss. When JAX loads
    # (not before: `import torch` does not import JAX).
    _import_hooks.when_imported(
        "jax._src.traceback_util",
        lambda tb: eval_frame.set_code_exec_strategy(tb.api_boundary(lambda: None).__code__, strategy))


# JAX's own Python code is reached from C++ without a kernel frame above it: the C++ eager path calls a jitted
# function, whose first call of new shapes (a cache miss) runs JAX's tracing in Python. Inside a frame that Dynamo
# handles (after a graph break), Dynamo then compiled JAX's frames as user code, and the transformed frames computed
# wrong values: a fresh process's `torch.compile`d training step with `opt.zero_grad()` inside (a graph break)
# failed in GELU's first call ("multiply requires ndarray or scalar arguments, got DynamicJaxprTracer"). Dynamo's
# skip list already holds numpy and other libraries that are never traced; JAX's packages join it when Dynamo loads.
_NEVER_TRACED = ("jax", "jaxlib", "ml_dtypes", "opt_einsum")


def _skip_jax(trace_rules: Any) -> None:
    for name in _NEVER_TRACED:
        try:
            trace_rules.add(name)
        except (ImportError, ValueError):  # not installed
            pass


def _ignore_optimizer_hooks(config: Any) -> None:
    """torch_tpu's global optimizer step hooks (torch_tpu/_deferred.py) do nothing under torch.compile. Traced as
    calls into torch_tpu (skipped), each would break the graph of a compiled step there, and run eagerly in the
    middle of it; as ignored functions, Dynamo leaves them out of the graph without a break."""
    from torch_tpu import _deferred

    config.ignore_logging_functions.update((_deferred.optimizer_step_starts, _deferred.optimizer_step_ended))
