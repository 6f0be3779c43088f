"""PyTorch's rules around a lowering's call, shared by every executor: elementwise type promotion, the broadcast
check, result casts, the out= convention, wrapping result arrays as tensors, and the errors PyTorch users know
for the same mistakes. Helpers beside the table (kernels/registry.py); kernels may call them too.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch._prims_common import elementwise_dtypes
from torch._prims_common.wrappers import _maybe_resize_out

from torch_tpu import _C, _checks, _runtime, _storage
from torch_tpu._jax import jnp
from torch_tpu.kernels.registry import DEFAULT


# ---- errors PyTorch users know ----

def _device_mismatch(op: str, a: torch.device, b: torch.device) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}! "
        f"(when checking arguments for aten::{op})"
    )


# ---- promotion, broadcasting, casts ----

def _meta_proxy(ndim: int, dtype: Any) -> torch.Tensor:
    """A promotion proxy, made while a lowering is traced: no user dispatch mode may see it (see _checks.collecting,
    inside which every executor traces; this holds for a caller outside it too)."""
    with _checks.outside_python_dispatch():
        return torch.empty((1,) * ndim, dtype=_runtime.torch_dtype(dtype), device="meta")


def _promote(operands: list, static: tuple, idx: tuple, kind: Any) -> tuple[Any, Any]:
    """PyTorch's elementwise type promotion, computed at trace time from avals (never on a cache hit)."""
    proxies = []
    for i, x in zip(idx, operands):
        scalar_type = static[i]
        if isinstance(scalar_type, type) and scalar_type in (bool, int, float, complex):
            proxies.append(scalar_type(0))
        else:
            proxies.append(_meta_proxy(x.ndim, x.dtype))
    compute, result = elementwise_dtypes(*proxies, type_promotion_kind=kind)
    return _runtime.jax_dtype(compute), _runtime.jax_dtype(result)


def _check_broadcast(op: str, operands: list) -> None:
    """PyTorch's broadcast error for elementwise operands whose shapes do not broadcast."""
    shapes = [tuple(jnp.shape(x)) for x in operands]
    if len(shapes) < 2:
        return
    acc = shapes[0]
    for other in shapes[1:]:
        n = max(len(acc), len(other))
        a = (1,) * (n - len(acc)) + acc
        b = (1,) * (n - len(other)) + other
        for i in range(n - 1, -1, -1):
            if a[i] != b[i] and a[i] != 1 and b[i] != 1:
                raise RuntimeError(
                    f"The size of tensor a ({a[i]}) must match the size of tensor b ({b[i]}) at non-singleton "
                    f"dimension {i}"
                )
        acc = tuple(max(x, y) if min(x, y) != 0 else 0 for x, y in zip(a, b))


def result_dtype(*arrays: Any, kind: Any = DEFAULT) -> Any:
    """PyTorch's promoted dtype of several arrays (all treated as dimensioned tensors), as a JAX dtype."""
    proxies = [_meta_proxy(max(a.ndim, 1), a.dtype) for a in arrays]
    return _runtime.jax_dtype(elementwise_dtypes(*proxies, type_promotion_kind=kind)[1])


def _cast_tree(out: Any, dtype: Any) -> Any:
    if isinstance(out, (tuple, list)):
        return type(out)(_cast_tree(o, dtype) for o in out)
    return out if out.dtype == dtype else out.astype(dtype)


def wrap_arrays(out: Any, index: int) -> Any:
    """New tpu tensors on tpu:`index` owning the device array(s) `out` (a tuple of arrays gives a tuple). None (an
    output a lowering leaves undefined, as ATen does for one masked off by `output_mask`) stays None: the
    dispatcher turns it into an undefined tensor."""
    if out is None:
        return None
    if isinstance(out, (tuple, list)):
        return tuple(wrap_arrays(o, index) for o in out)
    return _C._wrap(out, _runtime.torch_dtype(out.dtype), index)


def write_outs(op: str, outs: Sequence[torch.Tensor], arrays: Sequence[Any]) -> None:
    """PyTorch's out= convention: check each result can be cast to its out tensor's dtype, resize the out tensor
    (warning when a non-empty one changes shape), and write the result into it. An undefined result (None) leaves
    its out tensor untouched, as ATen's out= kernels do for an output masked off."""
    for o, r in zip(outs, arrays):
        if r is None:
            continue
        _check_cast(op, _runtime.torch_dtype(r.dtype), o.dtype)
        _maybe_resize_out(o, tuple(r.shape))
        _storage.write(o, r)


def _check_same_shape(op: str, target: torch.Tensor, out: Any) -> None:
    if tuple(out.shape) != tuple(target.shape):
        raise RuntimeError(
            f"output with shape {list(target.shape)} doesn't match the broadcast shape {list(out.shape)} "
            f"(aten::{op})"
        )


def _check_cast(op: str, result: torch.dtype, target: torch.dtype) -> None:
    if not torch.can_cast(result, target):
        raise RuntimeError(f"result type {dtype_name(result)} can't be cast to the desired output type {dtype_name(target)}")


def dtype_name(dtype: torch.dtype) -> str:
    """PyTorch's short dtype name used in its error messages ("Float", "Long", ...)."""
    return {
        torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
        torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
        torch.uint8: "Byte", torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
    }.get(dtype, str(dtype))
