"""Elementwise arithmetic, comparisons and predicates with PyTorch's type promotion and broadcasting."""

from __future__ import annotations

from typing import Any

from torch_tpu import _runtime
from torch_tpu._jax import jnp, lax
from torch_tpu.kernels.registry import ALWAYS_BOOL, COMPLEX_TO_FLOAT, DEFAULT, INT_TO_FLOAT, lower


def _is_bool(x: Any) -> bool:
    return jnp.asarray(x).dtype == jnp.bool_


def _is_int(x: Any) -> bool:
    return jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer)


@lower("add.Tensor", "add.Scalar", promote=DEFAULT)
def add(self: Any, other: Any, alpha: Any = 1) -> Any:
    return self + other * alpha if not _is_bool(self) else jnp.logical_or(self, jnp.logical_and(other, alpha))


def _sub_check(self: Any, other: Any, **_: Any) -> None:
    """PyTorch's sub_check, on the operands' own dtypes (promotion would turn bool - 1 into an integer op)."""
    if _is_bool(self) and _is_bool(other):
        raise RuntimeError("Subtraction, the `-` operator, with two bool tensors is not supported. "
                           "Use the `^` or `logical_xor()` operator instead.")
    if _is_bool(self) or _is_bool(other):
        raise RuntimeError("Subtraction, the `-` operator, with a bool tensor is not supported. "
                           "If you are trying to invert a mask, use the `~` or `logical_not()` operator instead.")


@lower("sub.Tensor", "sub.Scalar", promote=DEFAULT, validate=_sub_check)
def sub(self: Any, other: Any, alpha: Any = 1) -> Any:
    if _is_bool(self):
        raise RuntimeError(
            "Subtraction, the `-` operator, with two bool tensors is not supported. "
            "Use the `^` or `logical_xor()` operator instead."
        )
    return self - other * alpha


@lower("rsub.Tensor", "rsub.Scalar", promote=DEFAULT, validate=_sub_check)
def rsub(self: Any, other: Any, alpha: Any = 1) -> Any:
    return sub(other, self, alpha)


@lower("mul.Tensor", "mul.Scalar", promote=DEFAULT)
def mul(self: Any, other: Any) -> Any:
    return jnp.logical_and(self, other) if _is_bool(self) else self * other


def _div_kind(rounding_mode: str | None = None, **_: Any) -> Any:
    return INT_TO_FLOAT if rounding_mode is None else DEFAULT


def _true_divide(self: Any, other: Any) -> Any:
    """self / other, divided as CPU PyTorch divides. XLA's simplifier turns a division by a broadcast value (a
    scalar, a 0-d tensor, a keepdim reduction) into a multiplication by its reciprocal, which differs from the
    quotient by an ulp in ~9% of float32 elements (`x / 0.7`). On XLA:CPU the broadcast divisor sits behind an
    optimization barrier, so the simplifier leaves the division alone (the barrier is gone before fusion: one loop,
    same speed). A TPU divides approximately anyway: plain there."""
    shape = jnp.broadcast_shapes(jnp.shape(self), jnp.shape(other))
    if jnp.shape(other) == shape or _runtime.platform() != "cpu":
        return self / other
    dtype = jnp.result_type(self, other)
    return jnp.broadcast_to(jnp.asarray(self).astype(dtype), shape) / lax.optimization_barrier(
        jnp.broadcast_to(jnp.asarray(other).astype(dtype), shape))


@lower("div.Tensor", "div.Scalar", promote=INT_TO_FLOAT)
def div(self: Any, other: Any) -> Any:
    return _true_divide(self, other)


@lower("div.Tensor_mode", "div.Scalar_mode", promote=_div_kind)
def div_mode(self: Any, other: Any, rounding_mode: str | None = None) -> Any:
    if rounding_mode is None:
        return _true_divide(self, other)
    if rounding_mode == "trunc":
        if _is_int(self):
            a, b = jnp.broadcast_arrays(self, other)
            return lax.div(a, b)
        return jnp.trunc(_true_divide(self, other))
    if rounding_mode == "floor":
        return jnp.floor_divide(self, other)
    raise RuntimeError(
        f"div expected rounding_mode to be one of None, 'trunc', or 'floor' but found '{rounding_mode}'"
    )


@lower("neg", promote=DEFAULT, promote_args=("self",))
def neg(self: Any) -> Any:
    if _is_bool(self):
        raise RuntimeError(
            "Negation, the `-` operator, on a bool tensor is not supported. "
            "If you are trying to invert a mask, use the `~` or `logical_not()` operator instead."
        )
    return -self


@lower("abs", promote=COMPLEX_TO_FLOAT, promote_args=("self",))
def abs_(self: Any) -> Any:
    return self if _is_bool(self) else jnp.abs(self)


@lower("ceil", promote=DEFAULT, promote_args=("self",))
def ceil(self: Any) -> Any:
    return self if _is_int(self) or _is_bool(self) else jnp.ceil(self)


@lower("floor", promote=DEFAULT, promote_args=("self",))
def floor(self: Any) -> Any:
    return self if _is_int(self) or _is_bool(self) else jnp.floor(self)


def _compare(fn: Any) -> Any:
    def compare(self: Any, other: Any) -> Any:
        return fn(self, other)

    return compare


for _name, _fn in (("eq", "equal"), ("ne", "not_equal"), ("lt", "less"), ("le", "less_equal"),
                   ("gt", "greater"), ("ge", "greater_equal")):
    lower(f"{_name}.Tensor", f"{_name}.Scalar", promote=ALWAYS_BOOL)(
        _compare(lambda a, b, _f=_fn: getattr(jnp, _f)(a, b))
    )


def _bitwise(name: str, fn_name: str) -> None:
    def bitwise(self: Any, other: Any) -> Any:
        if not (_is_int(self) or _is_bool(self)):
            raise RuntimeError(f'"{name}_cpu" not implemented for \'{jnp.asarray(self).dtype}\'')
        return getattr(jnp, fn_name)(self, other)

    lower(f"{name}.Tensor", f"{name}.Scalar", promote=DEFAULT)(bitwise)


_bitwise("bitwise_and", "bitwise_and")
_bitwise("bitwise_or", "bitwise_or")
_bitwise("bitwise_xor", "bitwise_xor")


@lower("bitwise_not", promote=None)
def bitwise_not(self: Any) -> Any:
    if not (_is_int(self) or _is_bool(self)):
        raise RuntimeError(f"\"bitwise_not_cpu\" not implemented for '{self.dtype}'")
    return jnp.logical_not(self) if _is_bool(self) else jnp.bitwise_not(self)


@lower("logical_not")
def logical_not(self: Any) -> Any:
    return jnp.logical_not(self)


@lower("isfinite", variants=False)
def isfinite(self: Any) -> Any:
    return jnp.isfinite(self) if jnp.issubdtype(self.dtype, jnp.inexact) else jnp.ones(self.shape, jnp.bool_)


@lower("isnan", variants=False)
def isnan(self: Any) -> Any:
    return jnp.isnan(self) if jnp.issubdtype(self.dtype, jnp.inexact) else jnp.zeros(self.shape, jnp.bool_)


@lower("where.self", promote=DEFAULT, promote_args=("self", "other"))
def where(condition: Any, self: Any, other: Any) -> Any:
    if condition.dtype != jnp.bool_:
        raise RuntimeError(f"where expected condition to be a boolean tensor, but got a tensor with dtype {condition.dtype}")
    return jnp.where(condition, self, other)
