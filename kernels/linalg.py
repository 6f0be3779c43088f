"""Matrix products. float32 matmuls run at full precision (PyTorch's default 'highest')."""

from __future__ import annotations

from typing import Any

from torch_tpu import _runtime
from torch_tpu._jax import jax, jnp


from torch_tpu.kernels.registry import lower


def _check_dtypes(a: Any, b: Any, what: str = "m1 and m2") -> None:
    if a.dtype != b.dtype:
        raise RuntimeError(
            f"expected {what} to have the same dtype, but got: "
            f"{_runtime.torch_dtype(a.dtype)} != {_runtime.torch_dtype(b.dtype)}"
        )


def _dot(a: Any, b: Any) -> Any:
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


@lower("mm")
def mm(self: Any, mat2: Any) -> Any:
    if self.ndim != 2:
        raise RuntimeError(f"self must be a matrix, got {self.ndim}-D tensor")
    if mat2.ndim != 2:
        raise RuntimeError(f"mat2 must be a matrix, got {mat2.ndim}-D tensor")
    if self.shape[1] != mat2.shape[0]:
        raise RuntimeError(
            f"mat1 and mat2 shapes cannot be multiplied ({self.shape[0]}x{self.shape[1]} and "
            f"{mat2.shape[0]}x{mat2.shape[1]})"
        )
    _check_dtypes(self, mat2)
    return _dot(self, mat2)


@lower("bmm")
def bmm(self: Any, mat2: Any) -> Any:
    if self.ndim != 3 or mat2.ndim != 3:
        raise RuntimeError(f"batch1 and batch2 must be 3D tensors, got {self.ndim}D and {mat2.ndim}D")
    if self.shape[0] != mat2.shape[0] or self.shape[2] != mat2.shape[1]:
        raise RuntimeError(
            f"Expected size for first two dimensions of batch2 tensor to be: [{self.shape[0]}, {self.shape[2]}] "
            f"but got: [{mat2.shape[0]}, {mat2.shape[1]}]."
        )
    _check_dtypes(self, mat2, "batch1 and batch2")
    return _dot(self, mat2)


@lower("addmm")
def addmm(self: Any, mat1: Any, mat2: Any, beta: Any = 1, alpha: Any = 1) -> Any:
    prod = mm(mat1, mat2)
    _check_dtypes(self, prod, "self and mat2")
    return (beta * self + alpha * prod).astype(prod.dtype)


@lower("dot")
def dot(self: Any, tensor: Any) -> Any:
    if self.ndim != 1 or tensor.ndim != 1:
        raise RuntimeError(f"1D tensors expected, but got {self.ndim}D and {tensor.ndim}D tensors")
    _check_dtypes(self, tensor, "both vectors")
    return _dot(self, tensor)


@lower("mv")
def mv(self: Any, vec: Any) -> Any:
    _check_dtypes(self, vec, "self and vec")
    return _dot(self, vec)
