"""Linear algebra: matrix products (float32 at full precision, PyTorch's default 'highest'), their fused
add forms, and the decompositions and solvers of torch.linalg on jnp.linalg / jax.scipy.linalg."""

from __future__ import annotations

import functools
from typing import Any

import torch

from torch_tpu import _executor, _runtime, _storage
from torch_tpu._checks import report_bad_index
from torch_tpu._jax import jax, jnp, lax
from torch_tpu.kernels._promote import dtype_name, wrap_arrays, write_outs
from torch_tpu.kernels.registry import DEFAULT, direct, lower



def _dot(a: Any, b: Any) -> Any:
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _check_dtypes(a: Any, b: Any, what: str = "m1 and m2") -> None:
    if a.dtype != b.dtype:
        raise RuntimeError(
            f"expected {what} to have the same dtype, but got: "
            f"{_runtime.torch_dtype(a.dtype)} != {_runtime.torch_dtype(b.dtype)}"
        )


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


def _check_vectors(self: Any, other: Any) -> None:
    """dot/vdot's checks, in ATen's words and order."""
    if self.ndim != 1 or other.ndim != 1:
        raise RuntimeError(f"1D tensors expected, but got {self.ndim}D and {other.ndim}D tensors")
    if self.dtype != other.dtype:
        raise RuntimeError(f"dot : expected both vectors to have same dtype, but found {_dname(self)} and "
                           f"{_dname(other)}")
    if self.shape[0] != other.shape[0]:
        raise RuntimeError(f"inconsistent tensor size, expected tensor [{self.shape[0]}] and src [{other.shape[0]}] "
                           "to have the same number of elements, but got "
                           f"{self.shape[0]} and {other.shape[0]} elements respectively")


@lower("dot")
def dot(self: Any, tensor: Any) -> Any:
    _check_vectors(self, tensor)
    return _dot(self, tensor)


@lower("mv")
def mv(self: Any, vec: Any) -> Any:
    _check_dtypes(self, vec, "self and vec")
    return _dot(self, vec)


def _dname(x: Any) -> str:
    return dtype_name(_runtime.torch_dtype(x.dtype))


def _opmath(x: Any) -> Any:
    """Reduced-precision floats are accumulated in float32, as PyTorch's CPU kernels do."""
    return x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x


def _is_int(x: Any) -> bool:
    return x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer)


def _scalar(s: Any, dtype: Any) -> Any:
    """A Scalar as the op computes with it: integer results truncate float scalars (beta=0.5 -> 0)."""
    return jnp.asarray(s).astype(dtype) if _is_int(jnp.zeros((), dtype)) else s


def _scaled_sum(self: Any, prod: Any, beta: Any, alpha: Any, dtype: Any) -> Any:
    """beta * self + alpha * prod; with beta == 0 `self` is ignored (its NaNs do not propagate)."""
    if dtype == jnp.bool_:
        return (jnp.logical_and(self, beta != 0) | jnp.logical_and(prod, alpha != 0)).astype(dtype)
    beta, alpha = _scalar(beta, dtype), _scalar(alpha, dtype)
    self, prod = _opmath(self.astype(dtype)), _opmath(prod)
    scaled = jnp.where(beta == 0, jnp.zeros((), self.dtype), self * beta)
    return (scaled + alpha * prod).astype(dtype)


def _check_int_scalars(dtype: Any, beta: Any, alpha: Any) -> None:
    if _is_int(jnp.zeros((), dtype)):
        for name, s in (("beta", beta), ("alpha", alpha)):
            if jnp.issubdtype(jnp.asarray(s).dtype, jnp.floating):
                raise RuntimeError(f"For integral input tensors, argument {name} must not be a floating point number.")


def _check_broadcast(self: Any, shape: tuple[int, ...], what: str) -> None:
    try:
        if jnp.broadcast_shapes(self.shape, shape) != tuple(shape):
            raise ValueError
    except ValueError:
        raise RuntimeError(
            f"The size of tensor a ({self.shape[-1] if self.ndim else 1}) must match the size of tensor b "
            f"({shape[-1] if shape else 1}) at non-singleton dimension {max(self.ndim, len(shape)) - 1} ({what})"
        ) from None


# ---- products with accumulation ----


def _bmm_product(batch1: Any, batch2: Any) -> Any:
    if batch1.ndim != 3:
        raise RuntimeError(f"batch1 must be a 3D tensor")
    if batch2.ndim != 3:
        raise RuntimeError(f"batch2 must be a 3D tensor")
    if batch1.shape[0] != batch2.shape[0]:
        raise RuntimeError(
            f"batch1 and batch2 must have same number of batches, got {batch1.shape[0]} and {batch2.shape[0]}"
        )
    if batch1.shape[2] != batch2.shape[1]:
        raise RuntimeError(
            f"Incompatible matrix sizes for bmm ({batch1.shape[1]}x{batch1.shape[2]} and "
            f"{batch2.shape[1]}x{batch2.shape[2]})"
        )
    return _dot(_opmath(batch1), _opmath(batch2))


@lower("baddbmm")
def baddbmm(self: Any, batch1: Any, batch2: Any, beta: Any = 1, alpha: Any = 1) -> Any:
    if not (self.dtype == batch1.dtype == batch2.dtype):
        raise RuntimeError(
            f"Input dtypes must be the same, got: input {jnp.dtype(self.dtype).name}, "
            f"batch1: {jnp.dtype(batch1.dtype).name}, batch2: {jnp.dtype(batch2.dtype).name}"
        )
    prod = _bmm_product(batch1, batch2)
    _check_broadcast(self, prod.shape, "baddbmm")
    return _scaled_sum(jnp.broadcast_to(self, prod.shape), prod, beta, alpha, batch1.dtype)


@lower("addbmm")
def addbmm(self: Any, batch1: Any, batch2: Any, beta: Any = 1, alpha: Any = 1) -> Any:
    if not (self.dtype == batch1.dtype == batch2.dtype):
        raise RuntimeError(
            f"self and mat2 must have the same dtype, but got {_dname(self)} and {_dname(batch2)}"
        )
    prods = _bmm_product(batch1, batch2)
    shape = prods.shape[1:]
    _check_broadcast(self, shape, "addbmm")
    out = jnp.broadcast_to(self, shape)
    if batch1.shape[0] == 0 or batch1.dtype not in (jnp.bfloat16, jnp.float16):
        return _scaled_sum(out, jnp.sum(prods, axis=0), beta, alpha, batch1.dtype)
    # Reduced precision: PyTorch accumulates one addmm per batch, rounding after each.
    out = _scaled_sum(out, prods[0], beta, alpha, batch1.dtype)
    return lax.fori_loop(1, batch1.shape[0], lambda i, o: _scaled_sum(o, prods[i], 1, alpha, o.dtype), out)


@lower("addmv")
def addmv(self: Any, mat: Any, vec: Any, beta: Any = 1, alpha: Any = 1) -> Any:
    if not (self.dtype == mat.dtype == vec.dtype):
        raise RuntimeError(
            f"addmv input tensors must have the same dtype, but got {_dname(self)}, {_dname(mat)}, and {_dname(vec)}"
        )
    if mat.ndim != 2 or vec.ndim != 1 or mat.shape[1] != vec.shape[0]:
        raise RuntimeError(
            f"vector + matrix @ vector expected, got {self.ndim}, {mat.ndim}, {vec.ndim}"
            if mat.ndim != 2 or vec.ndim != 1
            else f"size mismatch, got input ({self.shape[0] if self.ndim else 1}), mat ({mat.shape[0]}x{mat.shape[1]}), "
                 f"vec ({vec.shape[0]})"
        )
    prod = _dot(_opmath(mat), _opmath(vec))
    _check_broadcast(self, prod.shape, "addmv")
    return _scaled_sum(jnp.broadcast_to(self, prod.shape), prod, beta, alpha, mat.dtype)


@lower("addr", promote=DEFAULT, promote_args=("self", "vec1", "vec2"), broadcasts=False)
def addr(self: Any, vec1: Any, vec2: Any, beta: Any = 1, alpha: Any = 1) -> Any:
    if vec1.ndim != 1 or vec2.ndim != 1:
        raise RuntimeError(f"addr: Expected 1-d argument vec{1 if vec1.ndim != 1 else 2}, "
                           f"but got vec{1 if vec1.ndim != 1 else 2}.dim() = {vec1.ndim if vec1.ndim != 1 else vec2.ndim}")
    dtype = self.dtype
    if dtype == jnp.bool_:
        for name, s in (("beta", beta), ("alpha", alpha)):
            if not jnp.issubdtype(jnp.asarray(s).dtype, jnp.bool_) and not jnp.issubdtype(jnp.asarray(s).dtype, jnp.integer):
                raise RuntimeError(f"Boolean {name} only supported for Boolean results.")
    else:
        _check_int_scalars(dtype, beta, alpha)
    if dtype == jnp.bool_:
        prod = jnp.logical_and(vec1[:, None], vec2[None, :])
    else:
        prod = _opmath(vec1)[:, None] * _opmath(vec2)[None, :]
    _check_broadcast(self, prod.shape, "addr")
    return _scaled_sum(jnp.broadcast_to(self, prod.shape), prod, beta, alpha, dtype)


@lower("linalg_cross")
def linalg_cross(self: Any, other: Any, dim: int = -1) -> Any:
    if self.ndim != other.ndim:
        raise RuntimeError(
            f"linalg.cross: inputs must have the same number of dimensions. Got {self.ndim} and {other.ndim}"
        )
    if self.dtype != other.dtype:
        raise RuntimeError(f"expected scalar type {_dname(self)} but found {_dname(other)}")
    shape = jnp.broadcast_shapes(self.shape, other.shape)
    n = max(len(shape), 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    axis = dim % n
    if self.shape[axis] != 3 or other.shape[axis] != 3:
        raise RuntimeError(
            f"linalg.cross: inputs dimension {dim} must have length 3. Got {self.shape[axis]} and {other.shape[axis]}"
        )
    a, b = jnp.broadcast_to(self, shape), jnp.broadcast_to(other, shape)
    a0, a1, a2 = (lax.index_in_dim(a, i, axis, keepdims=True) for i in range(3))
    b0, b1, b2 = (lax.index_in_dim(b, i, axis, keepdims=True) for i in range(3))
    return jnp.concatenate([a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0], axis=axis)


# ---- factorizations and solvers ----


def _check_square(op: str, a: Any, name: str = "A") -> None:
    if a.ndim < 2:
        raise RuntimeError(f"{op}: The input tensor {name} must have at least 2 dimensions.")
    if a.shape[-1] != a.shape[-2]:
        raise RuntimeError(
            f"{op}: {name} must be batches of square matrices, but they are {a.shape[-2]} by {a.shape[-1]} matrices"
        )


def _check_float(op: str, a: Any, name: str = "A") -> None:
    if not jnp.issubdtype(a.dtype, jnp.inexact) or a.dtype in (jnp.bfloat16, jnp.float16):
        raise RuntimeError(f"{op}: Expected a floating point or complex tensor as input. Got {_dname(a)}")


def _mT(a: Any) -> Any:
    return jnp.swapaxes(a, -1, -2)


def _mH(a: Any) -> Any:
    return jnp.conj(_mT(a)) if jnp.iscomplexobj(a) else _mT(a)


def _lu(a: Any) -> tuple[Any, Any, Any]:
    """Partial-pivoting LU: (LU, 1-based int32 pivots, int32 info)."""
    if a.size == 0:
        k = min(a.shape[-2], a.shape[-1])
        return a, jnp.ones(a.shape[:-2] + (k,), jnp.int32) * jnp.arange(1, k + 1, dtype=jnp.int32), \
            jnp.zeros(a.shape[:-2], jnp.int32)
    lu, piv, _ = lax.linalg.lu(a)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    zero = diag == 0
    info = jnp.where(jnp.any(zero, axis=-1), jnp.argmax(zero, axis=-1) + 1, 0).astype(jnp.int32)
    return lu, (piv + 1).astype(jnp.int32), info


def _lu_det(lu: Any, piv: Any) -> tuple[Any, Any]:
    """(sign of the permutation times the diagonal's signs, diagonal) of an LU factorization."""
    n = lu.shape[-1]
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(piv != jnp.arange(1, n + 1, dtype=piv.dtype), axis=-1)
    perm_sign = jnp.where(swaps % 2 == 0, 1, -1).astype(lu.dtype)
    return perm_sign, diag


@lower("linalg_lu_factor_ex")
def linalg_lu_factor_ex(A: Any, pivot: bool = True, check_errors: bool = False) -> tuple[Any, Any, Any]:
    if A.ndim < 2:
        raise RuntimeError(f"torch.linalg.lu_factor: Expected tensor with 2 or more dimensions. Got size: "
                           f"{list(A.shape)} instead")
    if not pivot:
        raise RuntimeError("linalg.lu_factor: LU without pivoting is not implemented on the CPU")
    return _lu(A)


@lower("linalg_lu")
def linalg_lu(A: Any, pivot: bool = True) -> tuple[Any, Any, Any]:
    if A.ndim < 2:
        raise RuntimeError(f"linalg.lu: Expected tensor with 2 or more dimensions. Got size: {list(A.shape)} instead")
    if not pivot:
        raise RuntimeError("linalg.lu_factor: LU without pivoting is not implemented on the CPU")
    m, n = A.shape[-2:]
    k = min(m, n)
    if A.size == 0:
        eye = jnp.broadcast_to(jnp.eye(m, dtype=A.dtype), A.shape[:-2] + (m, m))
        return eye, jnp.zeros(A.shape[:-2] + (m, k), A.dtype), jnp.zeros(A.shape[:-2] + (k, n), A.dtype)
    lu, _, perm = lax.linalg.lu(A)
    L = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=A.dtype)
    U = jnp.triu(lu[..., :k, :])
    # A[perm] = L U, so A = P L U with P[perm[i], i] = 1.
    P = _mT(jax.nn.one_hot(perm, m, dtype=A.dtype))
    return P, L, U


# PyTorch's contract for _linalg_det/_linalg_slogdet's LU and pivots (ATen's kernel, which its backward formulas
# read): they factor A^T when A is a contiguous real matrix (det(A^T) = det(A); LAPACK wants column-major), else A,
# and the backward solves with adjoint = not that. So the factorization depends on the input's layout, which a
# lowering (a function of arrays) cannot see: these are direct kernels, calling one jitted program per choice.
def _det_math(A: Any, transposed: bool) -> tuple[Any, Any, Any]:
    _check_float("linalg.det", A)
    _check_square("linalg.det", A)
    lu, piv, _ = _lu(_mT(A) if transposed else A)
    sign, diag = _lu_det(lu, piv)
    return sign * jnp.prod(diag, axis=-1), lu, piv


def _slogdet_math(A: Any, transposed: bool) -> tuple[Any, Any, Any, Any]:
    _check_float("linalg.slogdet", A)
    _check_square("linalg.slogdet", A)
    lu, piv, _ = _lu(_mT(A) if transposed else A)
    sign, diag = _lu_det(lu, piv)
    s = sign * jnp.prod(jnp.sign(diag), axis=-1)
    logabs = jnp.sum(jnp.log(jnp.abs(diag)), axis=-1)
    return s, logabs.astype(jnp.abs(diag).dtype), lu, piv


@functools.lru_cache(maxsize=None)
def _det_program(slog: bool, transposed: bool) -> Any:
    math = _slogdet_math if slog else _det_math
    return _executor.jitted(lambda A: math(A, transposed), key=("slogdet" if slog else "det", transposed))


def _det_arrays(A: torch.Tensor, slog: bool) -> Any:
    if A.device.type != "tpu":
        raise RuntimeError(f"linalg.{'slogdet' if slog else 'det'}: expected a tpu tensor, got one on {A.device}")
    return _det_program(slog, A.is_contiguous() and not A.is_complex())(_storage.read(A))


def _det_graph(A: torch.Tensor, slog: bool) -> tuple[torch.Tensor, ...]:
    """The same contract in lowered ops, for torch.compile graphs (their fake tensors carry the layout)."""
    op = "linalg.slogdet" if slog else "linalg.det"
    if A.dim() < 2 or A.shape[-1] != A.shape[-2] or not (A.is_floating_point() or A.is_complex()):
        raise RuntimeError(f"{op}: expected batches of square floating point or complex matrices, got "
                           f"{list(A.shape)} {A.dtype}")
    LU, piv, _ = torch.ops.aten.linalg_lu_factor_ex(A.mT if A.is_contiguous() and not A.is_complex() else A)
    n = A.shape[-1]
    diag = LU.diagonal(dim1=-2, dim2=-1)
    swaps = (piv != torch.arange(1, n + 1, device=A.device, dtype=piv.dtype)).sum(-1)
    perm_sign = (1 - 2 * (swaps % 2)).to(LU.dtype)
    if not slog:
        return perm_sign * diag.prod(-1), LU, piv
    return perm_sign * diag.sgn().prod(-1), diag.abs().log().sum(-1), LU, piv


@direct("_linalg_det", defer=True, graph=lambda A: _det_graph(A, False))
def linalg_det(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return wrap_arrays(_det_arrays(A, False), A.device.index)


@direct("_linalg_det.result", defer=True)
def linalg_det_out(A: torch.Tensor, *, result: torch.Tensor, LU: torch.Tensor, pivots: torch.Tensor) -> tuple:
    write_outs("_linalg_det", (result, LU, pivots), _det_arrays(A, False))
    return result, LU, pivots


@direct("_linalg_slogdet", defer=True, graph=lambda A: _det_graph(A, True))
def linalg_slogdet(A: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return wrap_arrays(_det_arrays(A, True), A.device.index)


@direct("_linalg_slogdet.sign", defer=True)
def linalg_slogdet_out(A: torch.Tensor, *, sign: torch.Tensor, logabsdet: torch.Tensor, LU: torch.Tensor,
                       pivots: torch.Tensor) -> tuple:
    write_outs("_linalg_slogdet", (sign, logabsdet, LU, pivots), _det_arrays(A, True))
    return sign, logabsdet, LU, pivots


@lower("linalg_inv_ex")
def linalg_inv_ex(A: Any, check_errors: bool = False) -> tuple[Any, Any]:
    _check_float("linalg.inv", A)
    _check_square("linalg.inv", A)
    if A.size == 0:
        return A, jnp.zeros(A.shape[:-2], jnp.int32)
    lu, piv, info = _lu(A)
    eye = jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape)
    return _lu_solve(lu, piv, eye), info


def _lu_solve(lu: Any, piv: Any, b: Any) -> Any:
    """Solves A X = B from A's LU factorization (1-based pivots), for matrix right-hand sides."""
    n = lu.shape[-1]
    perm = lax.linalg.lu_pivots_to_permutation(piv - 1, n)
    pb = jnp.take_along_axis(b, perm[..., :, None], axis=-2)
    y = lax.linalg.triangular_solve(lu, pb, left_side=True, lower=True, unit_diagonal=True)
    return lax.linalg.triangular_solve(lu, y, left_side=True, lower=False)


def _broadcast_batch(a: Any, b: Any) -> tuple[Any, Any]:
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


@lower("_linalg_solve_ex")
def linalg_solve_ex(A: Any, B: Any, left: bool = True, check_errors: bool = False) -> tuple[Any, Any, Any, Any]:
    _check_float("linalg.solve", A)
    _check_square("linalg.solve", A)
    if A.dtype != B.dtype:
        raise RuntimeError(
            f"linalg.solve: Expected A and B to have the same dtype, but found A of type {_dname(A)} and B of "
            f"type {_dname(B)} instead"
        )
    vector = B.ndim == 1 or (left and B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])
    b = B[..., None] if vector else B
    if not left:
        b = _mT(b)
    if b.shape[-2] != A.shape[-1]:
        raise RuntimeError(
            f"linalg.solve: Incompatible shapes of A and B for the equation "
            f"{'AX = B' if left else 'XA = B'} ({A.shape[-2]}x{A.shape[-1]} and {B.shape[-2]}x{B.shape[-1]})"
        )
    a = A if left else _mT(A)
    lu, piv, info = _lu(A)
    a_lu, a_piv = (lu, piv) if left else _lu(a)[:2]
    a_lu, b = _broadcast_batch(a_lu, b)
    a_piv = jnp.broadcast_to(a_piv, a_lu.shape[:-1])
    x = _lu_solve(a_lu, a_piv, b) if b.size else b
    if not left:
        x = _mT(x)
    return (x[..., 0] if vector else x), lu, piv, info


@lower("linalg_cholesky_ex")
def linalg_cholesky_ex(self: Any, upper: bool = False, check_errors: bool = False) -> tuple[Any, Any]:
    _check_float("linalg.cholesky", self)
    _check_square("linalg.cholesky", self)
    if self.size == 0:
        return self, jnp.zeros(self.shape[:-2], jnp.int32)
    # LAPACK reads one triangle: the lower for L, the upper (i.e. the lower of A^H) for U.
    a = _mH(self) if upper else self
    L = jnp.tril(lax.linalg.cholesky(a, symmetrize_input=False))
    failed = jnp.any(jnp.isnan(L))
    info = lax.cond(failed, _cholesky_info, lambda x: jnp.zeros(x.shape[:-2], jnp.int32), a)
    return (_mH(L) if upper else L), info


def _cholesky_info(a: Any) -> Any:
    """LAPACK potrf's info: the order of the first leading minor that is not positive-definite (0 if none)."""
    n = a.shape[-1]
    rows = jnp.arange(n)
    a = jnp.tril(a) + _mH(jnp.tril(a, -1))

    def body(k: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
        m, info = carry
        d = jnp.real(m[..., k, k])
        bad = ~(d > 0)
        info = jnp.where((info == 0) & bad, k + 1, info)
        col = m[..., :, k] / jnp.sqrt(jnp.where(bad, 1, d))[..., None]
        col = jnp.where(rows > k, col, 0)
        m = m - col[..., :, None] * jnp.conj(col[..., None, :])
        return m, info

    return lax.fori_loop(0, n, body, (a, jnp.zeros(a.shape[:-2], jnp.int32)))[1]


@lower("linalg_qr")
def linalg_qr(A: Any, mode: str = "reduced") -> tuple[Any, Any]:
    if mode not in ("reduced", "complete", "r"):
        raise RuntimeError(f"qr received unrecognized mode '{mode}' but expected one of 'reduced' (default), "
                           "'r', or 'complete'")
    if A.ndim < 2:
        raise RuntimeError(f"linalg.qr: The input tensor A must have at least 2 dimensions.")
    _check_float("linalg.qr", A)
    m, n = A.shape[-2:]
    k = min(m, n)
    if mode == "r":
        r = jnp.linalg.qr(A, mode="r") if A.size else jnp.zeros(A.shape[:-2] + (k, n), A.dtype)
        return jnp.zeros((0,), A.dtype), r
    full = mode == "complete"
    if A.size == 0:
        q_cols = m if full else k
        q = jnp.broadcast_to(jnp.eye(m, q_cols, dtype=A.dtype), A.shape[:-2] + (m, q_cols))
        return q, jnp.zeros(A.shape[:-2] + (q_cols, n), A.dtype)
    q, r = lax.linalg.qr(A, full_matrices=full)
    return q, r


@lower("_linalg_eigh")
def linalg_eigh(A: Any, UPLO: str = "L", compute_v: bool = True) -> tuple[Any, Any]:
    if UPLO not in ("L", "U"):
        raise RuntimeError(f"Expected UPLO argument to be 'L' or 'U', but got {UPLO}")
    _check_float("linalg.eigh", A)
    _check_square("linalg.eigh", A)
    if A.size == 0:
        w = jnp.zeros(A.shape[:-1], jnp.real(A).dtype)
        return w, (A if compute_v else jnp.zeros((0,), A.dtype))
    v, w = lax.linalg.eigh(A, lower=UPLO == "L", symmetrize_input=False)
    return w, (v if compute_v else jnp.zeros((0,), A.dtype))


@lower("_linalg_svd")
def linalg_svd(A: Any, full_matrices: bool = False, compute_uv: bool = True, driver: str | None = None
               ) -> tuple[Any, Any, Any]:
    if A.ndim < 2:
        raise RuntimeError(f"linalg.svd: The input tensor A must have at least 2 dimensions.")
    _check_float("linalg.svd", A)
    if driver is not None:
        raise RuntimeError("torch.linalg.svd: keyword argument `driver=` is only supported on CUDA inputs with "
                           "cuSOLVER backend.")
    m, n = A.shape[-2:]
    k = min(m, n)
    real = jnp.real(A).dtype
    if not compute_uv:
        s = jnp.linalg.svd(A, compute_uv=False) if A.size else jnp.zeros(A.shape[:-2] + (k,), real)
        return jnp.zeros((0,), A.dtype), s, jnp.zeros((0,), A.dtype)
    if A.size == 0:
        uc, vr = (m, n) if full_matrices else (k, k)
        batch = A.shape[:-2]
        return (jnp.broadcast_to(jnp.eye(m, uc, dtype=A.dtype), batch + (m, uc)), jnp.zeros(batch + (k,), real),
                jnp.broadcast_to(jnp.eye(vr, n, dtype=A.dtype), batch + (vr, n)))
    u, s, vh = jnp.linalg.svd(A, full_matrices=full_matrices)
    return u, s, vh


@lower("triangular_solve")
def triangular_solve(self: Any, A: Any, upper: bool = True, transpose: bool = False,
                     unitriangular: bool = False) -> tuple[Any, Any]:
    if self.ndim < 2:
        raise RuntimeError(f"torch.triangular_solve: The input tensor b must have at least 2 dimensions.")
    _check_square("torch.triangular_solve", A)
    if self.dtype != A.dtype:
        raise RuntimeError(f"Expected b and A to have the same dtype, but found b of type {_dname(self)} and A of "
                           f"type {_dname(A)} instead.")
    a, b = _broadcast_batch(A, self)
    if b.size == 0 or a.size == 0:
        return jnp.zeros(b.shape, b.dtype), a
    x = lax.linalg.triangular_solve(a, b, left_side=True, lower=not upper, transpose_a=transpose,
                                    unit_diagonal=unitriangular)
    return x, a


@lower("linalg_solve_triangular")
def linalg_solve_triangular(self: Any, B: Any, upper: bool, left: bool = True,
                            unitriangular: bool = False) -> Any:
    _check_float("linalg.solve_triangular", self)
    if B.ndim < 2:
        raise RuntimeError("linalg.solve_triangular: The input tensor B must have at least 2 dimensions.")
    _check_square("linalg.solve_triangular", self)
    if self.dtype != B.dtype:
        raise RuntimeError(f"linalg.solve_triangular: Expected A and B to have the same dtype, but found A of "
                           f"type {_dname(self)} and B of type {_dname(B)} instead")
    a, b = _broadcast_batch(self, B)
    if b.size == 0 or a.size == 0:
        return jnp.zeros(b.shape, b.dtype)
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=not upper, unit_diagonal=unitriangular)


# Bader, Blanes & Casas (2019), "Computing the Matrix Exponential with an Optimized Taylor Polynomial
# Approximation": the algorithm PyTorch uses, so float32 results agree with CPU beyond what the conditioning of
# exp allows between two different methods. Degrees 1, 2, 4, 8, 12 by 1-norm; above, degree 18 with scaling.
_MEXP_THETAS = {
    "float32": (1.192092800768788e-07, 5.978858893805233e-04, 5.116619363445086e-02, 5.800524627688768e-01,
                1.461661507209034e+00, 3.010066362817634e+00),
    "float64": (2.220446049250313e-16, 2.580956802971767e-08, 3.397168839976962e-04, 4.991228871115323e-02,
                2.996158913811580e-01, 1.090863719290036e+00),
}
_T12_B = ((9.0198e-16, 0.46932117595418237389, -0.20099424927047284052, -0.04623946134063071740),
          (5.31597895759871264183, 1.19926790417132231573, 0.01179296240992997031, 0.01108844528519167989),
          (0.18188869982170434744, 0.05502798439925399070, 0.09351590770535414968, 0.00610700528898058230),
          (-2.0861320e-13, -0.13181061013830184015, -0.02027855540589259079, -0.00675951846863086359))
_T18_B = ((0., -1.00365581030144618291e-01, -8.02924648241156932449e-03, -8.92138498045729985177e-04, 0.),
          (0., 3.97849749499645077844e-01, 1.36783778460411720168e+00, 4.98289622525382669416e-01,
           -6.37898194594723280150e-04),
          (-1.09676396052962061844e+01, 1.68015813878906206114e+00, 5.71779846478865511061e-02,
           -6.98210122488052056106e-03, 3.34975017086070470649e-05),
          (-9.04316832390810593223e-02, -6.76404519071381882256e-02, 6.75961301770459654925e-02,
           2.95552570429315521194e-02, -1.39180257516060693404e-05),
          (0., 0., -9.23364619367118555360e-02, -1.69364939002081722752e-02, -1.40086798182036094347e-05))


def _combo(mats: list, coeffs: Any) -> Any:
    out = mats[0] * coeffs[0]
    for m, c in zip(mats[1:], coeffs[1:]):
        out = out + m * c
    return out


def _mexp_taylor(a: Any) -> list:
    """The degree 1, 2, 4, 8, 12 and 18 approximants of exp(a)."""
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    a2 = _dot(a, a)
    a3 = _dot(a, a2)
    a6 = _dot(a3, a3)
    t1 = eye + a
    t2 = eye + a + a2 / 2
    t4 = _combo([eye, a, a2, _dot(a2, _combo([eye, a, a2], (1 / 2, 1 / 6, 1 / 24)))], (1, 1, 0, 1))
    sqrt_177 = 0.1330413469565007072504e+2
    x3 = 2 / 3
    x1, x2 = x3 * ((1 + sqrt_177) / 88), x3 * ((1 + sqrt_177) / 352)
    x4, x5 = (-271 + 29 * sqrt_177) / (315 * x3), (-11 + 11 * sqrt_177) / (1260 * x3)
    x6, x7 = (-99 + 11 * sqrt_177) / (5040 * x3), (89 - sqrt_177) / (5040 * x3)
    y2 = (857 - 58 * sqrt_177) / 630
    a4 = _dot(a2, _combo([a, a2], (x1, x2)))
    a8 = _dot(_combo([a2, a4], (x3, 1)), _combo([eye, a, a2, a4], (x4, x5, x6, x7)))
    t8 = _combo([eye, a, a2, a8], (1, 1, y2, 1))
    powers = [eye, a, a2, a3]
    b12 = [_combo(powers, row) for row in _T12_B]
    b12[2] = b12[2] + _dot(b12[3], b12[3])
    t12 = b12[0] + _dot(b12[1] + b12[2], b12[2])
    powers = [eye, a, a2, a3, a6]
    b18 = [_combo(powers, row) for row in _T18_B]
    b18[3] = b18[3] + _dot(b18[0], b18[4])
    t18 = b18[1] + _dot(b18[2] + b18[3], b18[3])
    return [t1, t2, t4, t8, t12, t18]


@lower("linalg_matrix_exp")
def linalg_matrix_exp(self: Any) -> Any:
    _check_square("linalg.matrix_exp", self)
    if self.size == 0:
        return self
    if self.shape[-1] == 1:
        return jnp.exp(self)
    if self.dtype not in (jnp.float32, jnp.float64):
        raise RuntimeError(f"matrix_exp: {_dname(self)} is not supported on tpu (PyTorch's CPU result is not "
                           "reliable for it either)")
    thetas = _MEXP_THETAS[jnp.dtype(self.dtype).name]
    norm = jnp.max(jnp.sum(jnp.abs(self), axis=-2), axis=-1)[..., None, None]
    # Large norms: scale by 2^-s into degree 18's range, then square s times.
    s = jnp.maximum(0, jnp.ceil(jnp.log2(norm / thetas[5]))).astype(jnp.int32)
    scaled = jnp.where(norm >= thetas[4], self / (2.0 ** s).astype(self.dtype), self)
    ts = _mexp_taylor(scaled)

    def square(i: Any, m: Any) -> Any:
        return jnp.where(i < s, _dot(m, m), m)

    big = lax.fori_loop(0, jnp.max(jnp.where(norm >= thetas[4], s, 0)), square, ts[5])
    out = big
    for i in reversed(range(5)):
        lo = -1 if i == 0 else thetas[i - 1]
        out = jnp.where((norm > lo) & (norm <= thetas[i]), ts[i], out)
    return out


@lower("cholesky")
def cholesky(self: Any, upper: bool = False) -> Any:
    """The deprecated torch.cholesky: a non positive-definite input gives NaNs rather than an error."""
    return linalg_cholesky_ex(self, upper)[0]


def _tri_inv(t: Any, lower: bool) -> Any:
    eye = jnp.broadcast_to(jnp.eye(t.shape[-1], dtype=t.dtype), t.shape)
    return lax.linalg.triangular_solve(t, eye, left_side=True, lower=lower)


@lower("cholesky_inverse")
def cholesky_inverse(self: Any, upper: bool = False) -> Any:
    """inv(A) for A = L L^H (or U^H U) given the factor."""
    _check_float("cholesky_inverse", self)
    _check_square("cholesky_inverse", self, "input")
    if self.size == 0:
        return self
    inv = _tri_inv(self, lower=not upper)
    return _dot(inv, _mH(inv)) if upper else _dot(_mH(inv), inv)


@lower("_cholesky_solve_helper")
def cholesky_solve_helper(self: Any, A: Any, upper: bool) -> Any:
    """Solves (L L^H) X = B (or (U^H U) X = B) for already-broadcast B (self) and factor A."""
    if self.size == 0 or A.size == 0:
        return jnp.zeros(self.shape, self.dtype)
    L = _mH(A) if upper else A
    y = lax.linalg.triangular_solve(L, self, left_side=True, lower=True)
    return lax.linalg.triangular_solve(L, y, left_side=True, lower=True, transpose_a=True,
                                       conjugate_a=jnp.iscomplexobj(L))


def _perm(piv: Any, m: int) -> Any:
    return lax.linalg.lu_pivots_to_permutation(piv.astype(jnp.int32) - 1, m)


@lower("linalg_lu_solve")
def linalg_lu_solve(LU: Any, pivots: Any, B: Any, left: bool = True, adjoint: bool = False) -> Any:
    _check_square("linalg.lu_solve", LU, "LU")
    if B.ndim < 2:
        raise RuntimeError("linalg.lu_solve: The input tensor B must have at least 2 dimensions.")
    if pivots.dtype != jnp.int32:
        raise RuntimeError("linalg.lu_solve: pivots should be a Tensor of scalar type torch.int32")
    n = LU.shape[-1]
    if (B.shape[-2] if left else B.shape[-1]) != n:
        raise RuntimeError(
            f"linalg.lu_solve: Incompatible shapes of A and B for the equation "
            f"{'AX = B' if left else 'XA = B'} ({n}x{n} and {B.shape[-2]}x{B.shape[-1]})"
        )
    # X A = B  <=>  A^H X^H = B^H: the right-side solves are left solves with the adjoint flipped.
    b = B if left else _mH(B)
    adj = adjoint if left else not adjoint
    lu, b = _broadcast_batch(LU, b)
    piv = jnp.broadcast_to(pivots, lu.shape[:-1])
    if b.size == 0 or lu.size == 0:
        x = jnp.zeros(b.shape, b.dtype)
    elif not adj:
        x = _lu_solve(lu, piv, b)
    else:  # A^H = U^H L^H P^T
        conj = jnp.iscomplexobj(lu)
        y = lax.linalg.triangular_solve(lu, b, left_side=True, lower=False, transpose_a=True, conjugate_a=conj)
        z = lax.linalg.triangular_solve(lu, y, left_side=True, lower=True, transpose_a=True, conjugate_a=conj,
                                        unit_diagonal=True)
        inv_perm = jnp.argsort(_perm(piv, n), axis=-1)
        x = jnp.take_along_axis(z, inv_perm[..., :, None], axis=-2)
    return x if left else _mH(x)


@lower("lu_unpack")
def lu_unpack(LU_data: Any, LU_pivots: Any, unpack_data: bool = True, unpack_pivots: bool = True
              ) -> tuple[Any, Any, Any]:
    if LU_data.ndim < 2:
        raise RuntimeError(f"torch.lu_unpack: Expected tensor with 2 or more dimensions. Got size: "
                           f"{list(LU_data.shape)} instead")
    if LU_pivots.dtype != jnp.int32:
        raise RuntimeError("torch.lu_unpack: LU_pivots is expected to be a contiguous tensor of torch.int32 dtype.\n"
                           "Note: this function is intended to be used with the output produced by torch.linalg.lu_factor")
    m, n = LU_data.shape[-2:]
    k = min(m, n)
    empty = jnp.zeros((0,), LU_data.dtype)
    if unpack_data:
        L = jnp.tril(LU_data[..., :, :k], -1) + jnp.eye(m, k, dtype=LU_data.dtype)
        U = jnp.triu(LU_data[..., :k, :])
    else:
        L = U = empty
    if unpack_pivots:
        if LU_data.size == 0 or m == 0:
            P = jnp.broadcast_to(jnp.eye(m, dtype=LU_data.dtype), LU_pivots.shape[:-1] + (m, m))
        else:
            P = _mT(jax.nn.one_hot(_perm(LU_pivots, m), m, dtype=LU_data.dtype))
    else:
        P = empty
    return P, L, U


@lower("geqrf")
def geqrf(self: Any) -> tuple[Any, Any]:
    if self.ndim < 2:
        raise RuntimeError(f"torch.geqrf: input must have at least 2 dimensions.")
    _check_float("geqrf", self, "input")
    if self.size == 0:
        return self, jnp.zeros(self.shape[:-2] + (min(self.shape[-2:]),), self.dtype)
    # jax exposes geqrf (LAPACK's, as PyTorch's) only privately; it is a stable primitive behind jnp.linalg.qr.
    from jax._src.lax import linalg as lax_linalg

    return lax_linalg.geqrf(self)


@lower("linalg_householder_product")
def linalg_householder_product(input: Any, tau: Any) -> Any:
    if input.ndim < 2:
        raise RuntimeError("torch.linalg.householder_product: input must have at least 2 dimensions.")
    m, n = input.shape[-2:]
    if m < n:
        raise RuntimeError("torch.linalg.householder_product: input.shape[-2] must be greater than or equal to "
                           "input.shape[-1]")
    if tau.shape[-1] > n:
        raise RuntimeError("torch.linalg.householder_product: input.shape[-1] must be greater than or equal to "
                           "tau.shape[-1]")
    if input.size == 0:
        return input
    tau = jnp.concatenate([tau, jnp.zeros(tau.shape[:-1] + (n - tau.shape[-1],), tau.dtype)], axis=-1)
    return lax.linalg.householder_product(input, tau)


def _ormqr_check(a: Any, tau: Any, c: Any, left: bool) -> None:
    """ATen's ormqr checks, in its order."""
    if a.ndim < 2:
        raise RuntimeError("torch.ormqr: input must have at least 2 dimensions.")
    if c.ndim < 2:
        raise RuntimeError("torch.ormqr: other must have at least 2 dimensions.")
    side = -2 if left else -1
    if c.shape[side] != a.shape[-2]:
        raise RuntimeError(f"torch.ormqr: other.shape[{side}] must be equal to input.shape[-2]")
    if tau.ndim == 0:
        raise IndexError("Dimension specified as -1 but tensor has no dimensions")
    if tau.shape[-1] != min(c.shape[side], a.shape[-1]):
        raise RuntimeError(f"torch.ormqr: tau.shape[-1] must be equal to min(other.shape[{side}], input.shape[-1])")
    if a.ndim - tau.ndim != 1:
        raise RuntimeError("torch.ormqr: Expected tau to have one dimension less than input, but got tau.ndim equal "
                           f"to {tau.ndim} and input.ndim is equal to {a.ndim}")
    if a.ndim != c.ndim:
        raise RuntimeError("torch.ormqr: Expected other to have the same number of dimensions as input, but got "
                           f"other.ndim equal to {c.ndim} and input.ndim is equal to {a.ndim}")
    for name, batch in (("tau", tau.shape[:-1]), ("other", c.shape[:-2])):
        if batch != a.shape[:-2]:
            raise RuntimeError(f"torch.ormqr: Expected batch dimensions of {name} to be equal to input.shape[:-2], "
                               f"but got {list(batch)}")
    for name, t in (("tau", tau), ("other", c)):
        if t.dtype != a.dtype:
            raise RuntimeError(f"torch.ormqr: Expected input and {name} to have the same dtype, but input has dtype"
                               f"{_dname(a)} and {name} has dtype {_dname(t)}")
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        raise NotImplementedError(f"\"ormqr_cpu\" not implemented for '{_dname(a)}'")


@lower("ormqr")
def ormqr(self: Any, input2: Any, input3: Any, left: bool = True, transpose: bool = False) -> Any:
    """op(Q) C or C op(Q), Q the m-by-m product of the Householder reflectors stored in (self, input2)."""
    a, tau, c = self, input2, input3
    _ormqr_check(a, tau, c, left)
    m = c.shape[-2] if left else c.shape[-1]
    k = tau.shape[-1]
    if c.size == 0:
        return c
    full = jnp.concatenate([a[..., :, :k], jnp.zeros(a.shape[:-1] + (m - k,), a.dtype)], axis=-1)
    taus = jnp.concatenate([tau, jnp.zeros(tau.shape[:-1] + (m - k,), tau.dtype)], axis=-1)
    q = lax.linalg.householder_product(full, taus)
    if transpose:
        q = _mH(q)
    return _dot(q, c) if left else _dot(c, q)


@lower("vdot")
def vdot(self: Any, other: Any) -> Any:
    """sum(conj(self) * other) of two 1-D tensors."""
    _check_vectors(self, other)
    return jnp.sum(_opmath(jnp.conj(self)) * _opmath(other)).astype(self.dtype)


# ---- least squares and the non-symmetric eigenproblem ----

_LSTSQ_DRIVERS = ("gels", "gelsy", "gelsd", "gelss")


@lower("linalg_lstsq", jit=False)
def linalg_lstsq(self: Any, b: Any, rcond: float | None = None, driver: str | None = None
                 ) -> tuple[Any, Any, Any, Any]:
    """torch.linalg.lstsq with CPU's drivers and outputs, by one SVD for every driver: the minimum-norm solution
    over the singular values above rcond * s_max (gels: all of them, as it assumes full rank; CPU's gelsy finds
    the rank by pivoted QR, which agrees except for singular values within rounding of the threshold).
    residuals (squared column norms of A X - B) when m > n, the driver is not gelsy and every matrix has full
    rank (gels: always); rank for gelsy/gelsd/gelss; singular values for gelsd/gelss; else empty, as on CPU.
    Run eagerly (jit=False) because the residuals' shape of gelsd/gelss depends on the ranks: the numerical
    work is one cached jitted program, and only gelsd/gelss with m > n read the ranks on the host."""
    op = "torch.linalg.lstsq"
    driver = "gelsy" if driver is None else driver
    if driver not in _LSTSQ_DRIVERS:
        raise RuntimeError(f"{op}: parameter `driver` should be one of (gels, gelsy, gelsd, gelss)")
    if self.ndim < 2:
        raise RuntimeError(f"{op}: input must have at least 2 dimensions.")
    if b.ndim < 1:
        raise RuntimeError(f"{op}: other must have at least 1 dimension.")
    if self.dtype != b.dtype:
        raise RuntimeError(f"{op}: Expected input and other to have the same dtype, but got input's dtype "
                           f"{_dname(self)} and other's dtype {_dname(b)}")
    if not jnp.issubdtype(self.dtype, jnp.inexact) or self.dtype in (jnp.bfloat16, jnp.float16):
        raise RuntimeError("This function doesn't handle types other than float and double")
    if not (self.ndim >= b.ndim and self.ndim - b.ndim <= 1):
        raise RuntimeError(f"{op}: input.dim() must be greater or equal to other.dim() and "
                           "(input.dim() - other.dim()) <= 1")
    vector = b.ndim == self.ndim - 1
    if (b.shape[-1] if vector else b.shape[-2]) != self.shape[-2]:
        raise RuntimeError(f"{op}: input.size(-2) should match other.size(-2)")
    m, n = self.shape[-2:]
    real = jnp.real(jnp.zeros((), self.dtype)).dtype
    eps = float(jnp.finfo(real).eps)
    rcond = eps * max(m, n) if rcond is None else (eps if rcond < 0 else float(rcond))
    x, residuals, rank, sv = _lstsq_program(driver, rcond, vector)(self, b)
    if m > n and driver in ("gelsd", "gelss"):
        if isinstance(rank, jax.core.Tracer):
            raise RuntimeError(
                f"{op}: driver '{driver}' returns residuals only when every matrix has full rank, a shape that "
                f"depends on the values of A {tuple(self.shape)}: it cannot be part of a traced graph "
                "(torch.compile). Use driver='gels' or 'gelsy' there, or call it outside the compiled region.")
        if not bool(jnp.all(rank == n)):
            residuals = jnp.zeros((0,), real)  # CPU gives them only when every matrix has full rank
    return x, residuals, rank, sv


@functools.lru_cache(maxsize=None)
def _lstsq_program(driver: str, rcond: float, vector: bool) -> Any:
    def run(a: Any, b: Any) -> tuple[Any, Any, Any, Any]:
        rhs = b[..., None] if vector else b
        m, n = a.shape[-2:]
        k = rhs.shape[-1]
        batch = tuple(jnp.broadcast_shapes(a.shape[:-2], rhs.shape[:-2]))
        rhs = jnp.broadcast_to(rhs, batch + (m, k))
        real = jnp.real(a).dtype
        own = a.shape[:-2]  # rank and singular values keep A's own batch shape, as on CPU
        if a.size == 0 or k == 0:
            s = jnp.zeros(own + (min(m, n),), real)
            x = jnp.zeros(batch + (n, k), a.dtype)
            rank = jnp.zeros(own, jnp.int64)
        else:
            u, s, vh = jnp.linalg.svd(a, full_matrices=False)
            keep = (s > rcond * s[..., :1]) if driver != "gels" else jnp.ones(s.shape, bool)
            inv = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0).astype(a.dtype)
            x = _dot(_mH(vh), inv[..., :, None] * _dot(_mH(u), rhs))
            rank = jnp.sum(keep, axis=-1).astype(jnp.int64)
        if m > n and driver != "gelsy":
            r = _dot(a, x) - rhs
            residuals = jnp.sum(jnp.real(r * jnp.conj(r)), axis=-2)
        else:
            residuals = jnp.zeros((0,), real)
        rank = rank if driver != "gels" else jnp.zeros((0,), jnp.int64)
        sv = s if driver in ("gelsd", "gelss") else jnp.zeros((0,), real)
        return (x[..., 0] if vector else x), residuals, rank, sv

    return jax.jit(run)


def _check_eig_platform(op: str, a: Any) -> None:
    if _runtime.platform() == "tpu":
        raise NotImplementedError(
            f"torch_tpu: {op} (a general, non-symmetric eigendecomposition) is not available on TPU: XLA's TPU "
            f"backend has no such solver (input {tuple(a.shape)} {_dname(a)}). Ways out: compute it on the CPU, "
            f"e.g. torch.linalg.eig(A.cpu()), and move the result back with .to('tpu'); or, if A is symmetric "
            "(Hermitian), use torch.linalg.eigh / eigvalsh, which run on TPU.")


def _eig(op: str, a: Any, vectors: bool) -> tuple[Any, Any]:
    _check_square(op, a, "A")
    _check_float(op, a, "A")
    _check_eig_platform(op, a)
    complex_dtype = jnp.result_type(a.dtype, jnp.complex64)
    if a.size == 0:
        return jnp.zeros(a.shape[:-1], complex_dtype), jnp.zeros(a.shape, complex_dtype)
    # CPU refuses non-finite input (its check reads the values): the device-side check raises its error at the next
    # synchronization point instead of returning NaNs (kernels/registry.py `checks`).
    report_bad_index(op, jnp.where(jnp.all(jnp.isfinite(a)), 0, 1), 1, error=RuntimeError,
                     message=f"torch.{op}: input tensor should not contain infs or NaNs.")
    # LAPACK geev, as CPU PyTorch: eigenvectors of unit 2-norm with their largest component real.
    out = lax.linalg.eig(a, compute_left_eigenvectors=False, compute_right_eigenvectors=vectors)
    return out[0].astype(complex_dtype), (out[1].astype(complex_dtype) if vectors else None)


@lower("linalg_eig", checks=True)
def linalg_eig(self: Any) -> tuple[Any, Any]:
    """Eigenvalues and right eigenvectors, complex (XLA:CPU's LAPACK geev, the routine CPU PyTorch calls); not
    available on TPU (see _check_eig_platform)."""
    return _eig("linalg.eig", self, True)


@lower("_linalg_eigvals", checks=True)
def linalg_eigvals(self: Any) -> Any:
    return _eig("linalg.eigvals", self, False)[0]


@direct("linalg_eigvals.out")
def linalg_eigvals_out(self: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """linalg_eigvals itself stays PyTorch's composite (linalg_eig when a gradient is needed, so autograd sees
    LinalgEigBackward; _linalg_eigvals above otherwise); its out= form computes the values and writes `out`."""
    write_outs("linalg_eigvals", [out], [_storage.read(torch.ops.aten._linalg_eigvals(self))])
    return out


# ---- LDL^T (Bunch-Kaufman), in LAPACK sytrf's format ----

_BK_ALPHA = (1 + 17 ** 0.5) / 8


def _ldl_factor_one(a: Any) -> tuple[Any, Any, Any]:
    """LAPACK sytf2 (lower) on one real symmetric matrix: Bunch-Kaufman diagonal pivoting with 1x1 and 2x2
    blocks. Returns (the factor in the lower triangle, 1-based int32 pivots: k for a 1x1 block, -p twice for a
    2x2, info: the first zero pivot block)."""
    n = a.shape[-1]
    rows = jnp.arange(n)
    a = jnp.tril(a)
    a = a + jnp.tril(a, -1).T  # work on the full symmetric matrix: the swaps and updates stay simple

    def swap(m: Any, k: Any, i: Any, j: Any) -> Any:
        """Symmetric interchange of rows and columns i and j of the trailing block m[k:, k:] only: the columns of
        L before k keep their rows (LAPACK's L is a product of interchanges and unit factors)."""
        perm = jnp.where(rows == i, j, jnp.where(rows == j, i, rows))
        trailing = (rows[:, None] >= k) & (rows[None, :] >= k)
        return jnp.where(trailing, m[perm][:, perm], m)

    def cond(state: tuple) -> Any:
        return state[0] < n

    def body(state: tuple) -> tuple:
        k, m, piv, info = state
        col = jnp.where(rows > k, jnp.abs(m[:, k]), -1.0)
        imax = jnp.argmax(col)
        colmax = jnp.where(k < n - 1, jnp.max(col), 0.0)
        absakk = jnp.abs(m[k, k])
        zero = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
        row = jnp.where((rows >= k) & (rows != imax), jnp.abs(m[imax, :]), -1.0)
        rowmax = jnp.max(row)
        one_no_swap = zero | (absakk >= _BK_ALPHA * colmax) | (absakk >= _BK_ALPHA * colmax * (colmax / rowmax))
        one_swap = ~one_no_swap & (jnp.abs(m[imax, imax]) >= _BK_ALPHA * rowmax)
        two = ~one_no_swap & ~one_swap
        kstep = jnp.where(two, 2, 1)
        kp = jnp.where(one_no_swap, k, imax)
        kk = k + kstep - 1
        m = swap(m, k, kk, kp)
        # 1x1 block: L(:, k) = A(:, k) / d, trailing A -= x x^T / d.
        d = jnp.where(zero, 1.0, m[k, k])
        x1 = jnp.where(rows > k, m[:, k], 0.0)
        m1 = m - jnp.outer(x1, x1) / d
        m1 = m1.at[:, k].set(jnp.where(rows > k, x1 / d, m[:, k]))
        m1 = jnp.where(zero, m, m1)
        # 2x2 block at (k, k+1): [W_k W_k+1] = A(:, k:k+2) D^-1, trailing A -= W D W^T.
        kn = jnp.minimum(k + 1, n - 1)
        d21 = m[kn, k]
        d11 = m[kn, kn] / d21
        d22 = m[k, k] / d21
        t = 1 / (d11 * d22 - 1)
        d21 = t / d21
        below = rows > kn
        ak, ak1 = jnp.where(below, m[:, k], 0.0), jnp.where(below, m[:, kn], 0.0)
        wk = d21 * (d11 * ak - ak1)
        wk1 = d21 * (d22 * ak1 - ak)
        m2 = m - jnp.outer(ak, wk) - jnp.outer(ak1, wk1)
        m2 = m2.at[:, k].set(jnp.where(below, wk, m[:, k])).at[:, kn].set(jnp.where(below, wk1, m[:, kn]))
        m = jnp.where(two, m2, m1)
        p1 = (kp + 1).astype(jnp.int32)
        piv = jnp.where(two, piv.at[k].set(-p1).at[kn].set(-p1), piv.at[k].set(p1))
        info = jnp.where((info == 0) & zero, (k + 1).astype(jnp.int32), info)
        return k + kstep, m, piv, info

    init = (jnp.asarray(0), a, jnp.zeros((n,), jnp.int32), jnp.asarray(0, jnp.int32))
    _, m, piv, info = lax.while_loop(cond, body, init)
    return jnp.tril(m), piv, info


def _ldl_solve_one(ld: Any, piv: Any, b: Any) -> Any:
    """LAPACK sytrs (lower) on one factorization: L D L^T X = B with the interchanges, then X."""
    n = ld.shape[-1]
    rows = jnp.arange(n)

    def swap_rows(x: Any, i: Any, j: Any) -> Any:
        perm = jnp.where(rows == i, j, jnp.where(rows == j, i, rows))
        return x[perm]

    def forward(state: tuple) -> tuple:
        k, x = state
        two = piv[k] < 0
        kn = jnp.minimum(k + 1, n - 1)
        # 1x1: interchange k with piv-1, eliminate below, divide by d.
        x1 = swap_rows(x, k, piv[k] - 1)
        x1 = x1 - jnp.where(rows > k, ld[:, k], 0)[:, None] * x1[k][None, :]
        x1 = x1.at[k].set(x1[k] / ld[k, k])
        # 2x2: interchange k+1 with -piv-1, eliminate below both, solve the 2x2 block.
        x2 = swap_rows(x, kn, -piv[k] - 1)
        below = rows > kn
        x2 = (x2 - jnp.where(below, ld[:, k], 0)[:, None] * x2[k][None, :]
              - jnp.where(below, ld[:, kn], 0)[:, None] * x2[kn][None, :])
        akm1k = ld[kn, k]
        akm1 = ld[k, k] / akm1k
        ak = ld[kn, kn] / akm1k
        denom = akm1 * ak - 1
        bkm1, bk = x2[k] / akm1k, x2[kn] / akm1k
        x2 = x2.at[k].set((ak * bkm1 - bk) / denom).at[kn].set((akm1 * bk - bkm1) / denom)
        return k + jnp.where(two, 2, 1), jnp.where(two, x2, x1)

    def backward(state: tuple) -> tuple:
        k, x = state  # k: the last row of the current block
        two = piv[k] < 0
        kp = jnp.maximum(k - 1, 0)
        below = rows > k
        x1 = x.at[k].add(-(jnp.where(below, ld[:, k], 0) @ x))
        x1 = swap_rows(x1, k, piv[k] - 1)
        x2 = x.at[k].add(-(jnp.where(below, ld[:, k], 0) @ x)).at[kp].add(-(jnp.where(below, ld[:, kp], 0) @ x))
        x2 = swap_rows(x2, k, -piv[k] - 1)
        return k - jnp.where(two, 2, 1), jnp.where(two, x2, x1)

    _, x = lax.while_loop(lambda s: s[0] < n, forward, (jnp.asarray(0), b))
    _, x = lax.while_loop(lambda s: s[0] >= 0, backward, (jnp.asarray(n - 1), x))
    return x


def _check_ldl_dtype(op: str, a: Any) -> None:
    _check_float(op, a)
    if jnp.iscomplexobj(a):
        raise NotImplementedError(f"torch_tpu: {op} supports real floating inputs on tpu, got {_dname(a)} of shape "
                                  f"{tuple(a.shape)}. Way out: run it on the CPU (A.cpu()) for complex matrices.")


def _batched(fn: Any, *arrays: Any) -> Any:
    """fn on each matrix of the (equal) leading batch dimensions."""
    batch = arrays[0].shape[:-2] if arrays[0].ndim > 2 else ()
    flat = [x.reshape((-1,) + x.shape[len(batch):]) for x in arrays]
    outs = jax.vmap(fn)(*flat)
    return jax.tree_util.tree_map(lambda o: o.reshape(batch + o.shape[1:]), outs)


@lower("linalg_ldl_factor_ex")
def linalg_ldl_factor_ex(self: Any, hermitian: bool = False, check_errors: bool = False) -> tuple[Any, Any, Any]:
    """torch.linalg.ldl_factor_ex as CPU computes it with LAPACK sytrf (lower triangle, Bunch-Kaufman pivoting):
    the same compact LD (upper triangle zero), pivots and info. For real input `hermitian` changes nothing."""
    op = "torch.linalg.ldl_factor_ex"
    _check_square(op, self)
    _check_ldl_dtype(op, self)
    n = self.shape[-1]
    if self.size == 0:
        return self, jnp.zeros(self.shape[:-1], jnp.int32), jnp.zeros(self.shape[:-2], jnp.int32)
    return _batched(_ldl_factor_one, self)


@lower("linalg_ldl_solve")
def linalg_ldl_solve(LD: Any, pivots: Any, B: Any, hermitian: bool = False) -> Any:
    op = "torch.linalg.ldl_solve"
    _check_square(op, LD, "LD")
    _check_ldl_dtype(op, LD)
    if B.ndim < 2:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-max(B.ndim, 1)}, "
                         f"{max(B.ndim, 1) - 1}], but got -2)")
    if LD.dtype != B.dtype:
        raise RuntimeError(f"Expected b and A to have the same dtype, but found b of type {_dname(B)} and A of type "
                           f"{_dname(LD)} instead.")
    if B.shape[-2] != LD.shape[-1]:
        raise RuntimeError(f"Incompatible matrix sizes for {op}: each A matrix is {LD.shape[-2]} by {LD.shape[-1]} "
                           f"but each b matrix is {B.shape[-2]} by {B.shape[-1]}")
    pivots = pivots.astype(jnp.int32)
    batch = tuple(jnp.broadcast_shapes(LD.shape[:-2], pivots.shape[:-1], B.shape[:-2]))
    ld = jnp.broadcast_to(LD, batch + LD.shape[-2:])
    piv = jnp.broadcast_to(pivots, batch + pivots.shape[-1:])
    b = jnp.broadcast_to(B, batch + B.shape[-2:])
    if b.size == 0:
        return b
    if not batch:
        return _ldl_solve_one(ld, piv, b)
    flat = [x.reshape((-1,) + x.shape[len(batch):]) for x in (ld, piv, b)]
    return jax.vmap(_ldl_solve_one)(*flat).reshape(b.shape)
