"""Elementwise math: transcendental and special functions, rounding, powers, min/max/clamp, shifts and the
other pointwise ops of PyTorch's math library, with PyTorch's promotion, integer and NaN semantics.

Kernels that PyTorch's CPU backend rejects for a dtype raise the same error (the CPU kernel's name, e.g.
`"hypot_cpu" not implemented for 'Long'`). Errors that depend on values (integer division by zero, integer
powers with a negative Scalar exponent) cannot be raised from a traced kernel and are not.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch._prims_common.wrappers import _maybe_resize_out

from torch_tpu import _runtime
from torch_tpu._jax import jax, jnp, lax
from torch_tpu.kernels._promote import dtype_name
from torch_tpu.kernels.registry import (
    DEFAULT,
    INT_TO_FLOAT,
    NO_OPMATH,
    direct,
    lower,
)

# ---- helpers ----


def _is_bool(x: Any) -> bool:
    return jnp.asarray(x).dtype == jnp.bool_


def _is_int(x: Any) -> bool:
    return jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer)


def _is_integral(x: Any) -> bool:
    """Integer or bool, as PyTorch's isIntegralType(t, includeBool=True)."""
    return _is_int(x) or _is_bool(x)


def _is_complex(x: Any) -> bool:
    return jnp.issubdtype(jnp.asarray(x).dtype, jnp.complexfloating)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)


def _type_name(x: Any) -> str:
    """PyTorch's name of an array's dtype ('Long', 'Bool', 'Float', ...)."""
    return dtype_name(_runtime.torch_dtype(jnp.asarray(x).dtype))


def _not_implemented(kernel: str, x: Any) -> NotImplementedError:
    return NotImplementedError(f"\"{kernel}\" not implemented for '{_type_name(x)}'")


def _require_float(kernel: str, *xs: Any) -> None:
    """PyTorch's floating-only CPU kernels (AT_DISPATCH_FLOATING_TYPES...) reject integral inputs."""
    for x in xs:
        if _is_integral(x):
            raise _not_implemented(kernel, x)


def _require_int(kernel: str, *xs: Any) -> None:
    """PyTorch's integer-only CPU kernels reject bool and floating inputs."""
    for x in xs:
        if not _is_int(x):
            raise _not_implemented(kernel, x)


def _to_float(x: Any) -> Any:
    """Integral arrays as the default float dtype (float32), others unchanged."""
    return x.astype(jnp.float32) if _is_integral(x) else x


def _where(cond: Any, a: Any, b: Any) -> Any:
    """jnp.where keeping b's dtype (a may be a Python number)."""
    return jnp.where(cond, jnp.asarray(a, b.dtype), b)


_PI = math.pi


def _sps() -> Any:
    return jax.scipy.special


def _inplace(op: Callable[..., torch.Tensor], self: torch.Tensor, other: Any, dtype: torch.dtype | None = None
             ) -> torch.Tensor:
    """`self.op_(other)` through the functional op, with PyTorch's in-place dtype and shape checks (for in-place
    overloads the registry cannot derive from a functional one). `dtype`: the result dtype, when it is not
    the promotion of self and other."""
    dtype = dtype or torch.result_type(self, other)
    if not torch.can_cast(dtype, self.dtype):
        raise RuntimeError(f"result type {dtype_name(dtype)} can't be cast to the desired output type {dtype_name(self.dtype)}")
    if isinstance(other, torch.Tensor):
        shape = torch.broadcast_shapes(self.shape, other.shape)
        if shape != self.shape:
            raise RuntimeError(f"output with shape {list(self.shape)} doesn't match the broadcast shape {list(shape)}")
    return self.copy_(op(self, other))


# ---- unary floating functions (integral inputs promote to float32) ----


def _unary(name: str, fn: Callable[[Any], Any]) -> None:
    """Registers a one-argument floating function; integral inputs are promoted to the default float."""

    def kernel(self: Any) -> Any:
        return fn(self)

    kernel.__name__ = kernel.__qualname__ = name
    lower(name, promote=INT_TO_FLOAT, promote_args=("self",))(kernel)


_unary("exp", lambda x: jnp.exp(x))
_unary("exp2", lambda x: jnp.exp2(x))
_unary("expm1", lambda x: jnp.expm1(x))
_unary("log", lambda x: jnp.log(x))
_unary("log2", lambda x: jnp.log2(x))
_unary("log10", lambda x: jnp.log10(x))
_unary("log1p", lambda x: jnp.log1p(x))


def _sqrt(x: Any) -> Any:
    """sqrt. On XLA:CPU behind an optimization barrier, so that XLA's simplifier cannot turn `a / sqrt(b)` (a
    hand-written layer norm's `(x - u) / torch.sqrt(s + eps)`, or `rsqrt` below) into `a * rsqrt(b)`: XLA:CPU's
    rsqrt differs from CPU's `1 / sqrt` in a third of float32 elements, and a lone rsqrt took ~150 us on a
    (4, 64, 256) array where sqrt and a divide take ~40 us. XLA removes the barrier before fusion, so the loops fuse
    as before. Not on TPU, where rsqrt is native."""
    if _is_complex(x) or _runtime.platform() != "cpu":
        return jnp.sqrt(x)
    return lax.optimization_barrier(jnp.sqrt(x))


def _rsqrt(x: Any) -> Any:
    """1 / sqrt(x), as PyTorch's CPU kernel computes it (two roundings): on XLA:CPU it equals CPU's values bit for
    bit except for subnormal inputs (flushed to zero)."""
    if _is_complex(x):
        return 1 / jnp.sqrt(x)
    if _runtime.platform() != "cpu":
        return lax.rsqrt(x)
    return 1 / _sqrt(x)


_unary("sqrt", _sqrt)
_unary("rsqrt", _rsqrt)
_unary("sin", lambda x: jnp.sin(x))
_unary("cos", lambda x: jnp.cos(x))
_unary("tan", lambda x: jnp.tan(x))
_unary("asin", lambda x: jnp.arcsin(x))
_unary("acos", lambda x: jnp.arccos(x))
_unary("atan", lambda x: jnp.arctan(x))
_unary("sinh", lambda x: jnp.sinh(x))
_unary("cosh", lambda x: jnp.cosh(x))
_unary("tanh", lambda x: jnp.tanh(x))
_unary("asinh", lambda x: jnp.arcsinh(x))
_unary("acosh", lambda x: jnp.arccosh(x))
_unary("atanh", lambda x: jnp.arctanh(x))
_unary("sigmoid", lambda x: 1 / (1 + jnp.exp(-x)) if _is_complex(x) else lax.logistic(x))
_unary("erf", lambda x: lax.erf(x))
_unary("erfc", lambda x: lax.erfc(x))
_unary("erfinv", lambda x: lax.erf_inv(x))
_unary("reciprocal", lambda x: 1 / x)
_unary("lgamma", lambda x: lax.lgamma(x))
_unary("i0", lambda x: _sps().i0(x))
_unary("special_i0e", lambda x: _sps().i0e(x))
_unary("special_i1", lambda x: _sps().i1(x))
_unary("special_i1e", lambda x: _sps().i1e(x))
_unary("special_ndtri", lambda x: _sps().ndtri(x))
_unary("special_log_ndtr", lambda x: _sps().log_ndtr(x))
_unary("special_erfcx", lambda x: _sps().erfcx(x))
_unary("special_entr", lambda x: _sps().entr(x))


@lower("sinc", promote=INT_TO_FLOAT, promote_args=("self",))
def sinc(self: Any) -> Any:
    product = _PI * self
    return jnp.where(self == 0, jnp.ones_like(self), jnp.sin(product) / product)


@lower("special_spherical_bessel_j0", promote=INT_TO_FLOAT, promote_args=("x",))
def special_spherical_bessel_j0(x: Any) -> Any:
    """sin(x) / x, by its Taylor series below |x| = 0.5 and 0 at +-inf, as PyTorch computes it."""
    x2 = x * x
    series = 1.0 + x2 * (-1.0 / 6 + x2 * (1.0 / 120 + x2 * (-1.0 / 5040 + x2 * (
        1.0 / 362880 + x2 * (-1.0 / 39916800 + x2 * (1.0 / 6227020800))))))
    out = jnp.where(jnp.abs(x) < 0.5, series, jnp.sin(x) / x)
    return jnp.where(jnp.isinf(x), jnp.zeros_like(x), out)


@lower("digamma", promote=INT_TO_FLOAT, promote_args=("self",))
def digamma(self: Any) -> Any:
    return _digamma(self)


def _digamma(x: Any) -> Any:
    """PyTorch's digamma: -inf at +0, +inf at -0, NaN at negative integers."""
    out = lax.digamma(x)
    out = jnp.where((x < 0) & (x == jnp.trunc(x)), jnp.nan, out)
    return jnp.where(x == 0, jnp.copysign(jnp.asarray(jnp.inf, x.dtype), -x), out)


def _trigamma(x: Any) -> Any:
    """PyTorch's trigamma (reflection below 0.5, six recurrence steps, then the asymptotic series)."""
    reflect = x < 0.5
    sin_pi_x = jnp.sin(_PI * x)
    result = jnp.where(reflect, -(_PI * _PI) / (sin_pi_x * sin_pi_x), jnp.zeros_like(x))
    x = jnp.where(reflect, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1.0 / 6 - ixx * (1.0 / 30 - ixx * (1.0 / 42)))) / x
    return jnp.where(reflect, -result, result)


@lower("polygamma", promote=INT_TO_FLOAT, promote_args=("self",))
def polygamma(n: int, self: Any) -> Any:
    if n < 0:
        raise RuntimeError("polygamma(n, x) does not support negative n.")
    if n == 0:
        return _digamma(self)
    if n == 1:
        return _trigamma(self)
    sign = 1.0 if n % 2 else -1.0
    factorial = math.exp(math.lgamma(n + 1.0))
    return (sign * factorial * _zeta(jnp.full(self.shape, n + 1.0, jnp.float64), self)).astype(self.dtype)


@direct("polygamma_")
def polygamma_(self: torch.Tensor, n: int) -> torch.Tensor:
    """In-place polygamma (its arguments are (self, n), the functional's (n, self))."""
    dtype = torch.get_default_dtype() if not (self.is_floating_point() or self.is_complex()) else self.dtype
    return _inplace(lambda x, k: torch.polygamma(k, x), self, n, dtype)


@lower("special_zeta", "special_zeta.self_scalar", "special_zeta.other_scalar", promote=INT_TO_FLOAT)
def special_zeta(self: Any, other: Any) -> Any:
    x, q = jnp.broadcast_arrays(self, other)
    return _zeta(x, q).astype(x.dtype)


# Euler-Maclaurin coefficients of Cephes' zeta, as in PyTorch's Math.h.
_ZETA_A = (12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
           -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
           1.8152105401943546773e17, -7.1661652561756670113e18)
_MACHEP = 1.11022302462515654042e-16


def _zeta(x: Any, q: Any) -> Any:
    """Hurwitz zeta as PyTorch computes it (Cephes, in float64): a direct sum until a > 9 and at least nine
    terms, then the Euler-Maclaurin tail. XLA's zeta differs for negative q, so this is a port."""
    x = x.astype(jnp.float64)
    q = q.astype(jnp.float64)
    s = jnp.power(q, -x)
    special = jnp.where(x == 1, jnp.inf, jnp.where(x < 1, jnp.nan, jnp.where(
        (q <= 0) & (q == jnp.floor(q)), jnp.inf, jnp.where((q <= 0) & (x != jnp.floor(x)), jnp.nan, 0.0))))
    is_special = (x <= 1) | ((q <= 0) & ((q == jnp.floor(q)) | (x != jnp.floor(x))))

    def cond(state: tuple) -> Any:
        i, a, _, _, done = state
        return jnp.any(~done & ((i < 9) | (a <= 9.0)))

    def body(state: tuple) -> tuple:
        i, a, b, s, done = state
        step = ~done & ((i < 9) | (a <= 9.0))
        a_next = a + 1
        b_next = jnp.power(a_next, -x)
        s_next = s + b_next
        converged = step & (-_MACHEP * s_next < b_next) & (b_next < _MACHEP * s_next)
        return (jnp.where(step, i + 1, i), jnp.where(step, a_next, a), jnp.where(step, b_next, b),
                jnp.where(step, s_next, s), done | converged)

    zeros = jnp.zeros_like(x)
    _, a, b, s, done = lax.while_loop(cond, body, (jnp.zeros(x.shape, jnp.int32), q, zeros, s, is_special))
    w = a
    tail = jnp.where(done, s, s + b * w / (x - 1) - 0.5 * b)  # done: converged in the direct sum (or special)
    a = jnp.ones_like(x)
    k = zeros
    for coeff in _ZETA_A:
        a = a * (x + k)
        b = b / w
        t = a * b / coeff
        tail_next = tail + t
        done_here = ~done & (jnp.abs(t / tail_next) < _MACHEP)
        tail = jnp.where(done, tail, tail_next)
        done = done | done_here
        k = k + 1
        a = a * (x + k)
        b = b / w
        k = k + 1
    return jnp.where(is_special, special, tail)


@lower("mvlgamma", promote=None)
def mvlgamma(self: Any, p: int) -> Any:
    """Multivariate log-gamma: sum_j lgamma(x - j/2) for j < p, plus p(p-1)/4 log(pi)."""
    if _is_bool(self):
        raise RuntimeError("The input tensor may not be a boolean tensor.")
    if p < 1:
        raise RuntimeError("p has to be greater than or equal to 1")
    x = _to_float(self)
    compute = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else x.dtype
    xc = x.astype(compute)
    total = sum(lax.lgamma(xc - 0.5 * j) for j in range(p))
    return (total + p * (p - 1) * 0.25 * math.log(_PI)).astype(x.dtype)


@lower("logit", promote=INT_TO_FLOAT, promote_args=("self",))
def logit(self: Any, eps: float | None = None) -> Any:
    x = self
    if eps is not None and eps >= 0:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


@lower("angle", promote=None)
def angle(self: Any) -> Any:
    if _is_complex(self):
        return jnp.angle(self)
    x = _to_float(self)
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.asarray(_PI, x.dtype), jnp.zeros_like(x)))


@lower("_conj_physical", promote=None)
def _conj_physical(self: Any) -> Any:
    return jnp.conj(self) if _is_complex(self) else self


@direct("conj_physical.out")
def conj_physical_out(self: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """conj_physical's out= form (the functional is composite: it returns `self` for real tensors)."""
    result = torch.ops.aten._conj_physical(self) if self.is_complex() else self
    if not torch.can_cast(result.dtype, out.dtype):
        raise RuntimeError(
            f"result type {dtype_name(result.dtype)} can't be cast to the desired output type {dtype_name(out.dtype)}"
        )
    _maybe_resize_out(out, result.shape)
    return out.copy_(result)


# ---- sign, rounding and classification ----


@lower("sign", promote=DEFAULT, promote_args=("self",))
def sign(self: Any) -> Any:
    if _is_complex(self):
        raise NotImplementedError(
            "Unlike NumPy, torch.sign is not intended to support complex numbers. Please use torch.sgn instead."
        )
    return _sign(self)


def _sign(x: Any) -> Any:
    """(0 < x) - (x < 0): 0 for NaN and for -0.0, as PyTorch's sign."""
    if _is_bool(x):
        return x
    return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)


@lower("sgn", promote=DEFAULT, promote_args=("self",))
def sgn(self: Any) -> Any:
    if not _is_complex(self):
        return _sign(self)
    magnitude = jnp.abs(self)
    safe = jnp.where(magnitude == 0, jnp.ones_like(magnitude), magnitude)
    return jnp.where(magnitude == 0, jnp.zeros_like(self), self / safe.astype(self.dtype))


@lower("signbit", promote=None)
def signbit(self: Any) -> Any:
    if _is_complex(self):
        raise NotImplementedError("signbit is not implemented for complex tensors.")
    if _is_bool(self):
        return jnp.zeros(self.shape, jnp.bool_)
    return self < 0 if _is_int(self) else jnp.signbit(self)


@lower("trunc", promote=DEFAULT, promote_args=("self",))
def trunc(self: Any) -> Any:
    if _is_bool(self):
        raise _not_implemented("trunc_vml_cpu", self)
    return self if _is_int(self) else jnp.trunc(self)


@lower("round", promote=DEFAULT, promote_args=("self",))
def round_(self: Any) -> Any:
    if _is_bool(self):
        raise _not_implemented("round_vml_cpu", self)
    return self if _is_int(self) else jnp.round(self)


@lower("round.decimals", promote=DEFAULT, promote_args=("self",))
def round_decimals(self: Any, decimals: int) -> Any:
    _require_float("round_cpu", self)
    if decimals > 0:
        scale = jnp.asarray(10.0**decimals, self.dtype)
        return jnp.round(self * scale) / scale
    scale = jnp.asarray(10.0 ** (-decimals), self.dtype)
    return jnp.round(self / scale) * scale


@lower("frac", promote=DEFAULT, promote_args=("self",))
def frac(self: Any) -> Any:
    _require_float("frac_cpu", self)
    return self - jnp.trunc(self)


@lower("nan_to_num", promote=None)
def nan_to_num(self: Any, nan: float | None = None, posinf: float | None = None, neginf: float | None = None) -> Any:
    if not jnp.issubdtype(self.dtype, jnp.inexact):
        return self
    if _is_complex(self):
        real = nan_to_num(jnp.real(self), nan, posinf, neginf)
        imag = nan_to_num(jnp.imag(self), nan, posinf, neginf)
        return lax.complex(real, imag)
    info = jnp.finfo(self.dtype)
    x = jnp.where(jnp.isnan(self), jnp.asarray(0.0 if nan is None else nan, self.dtype), self)
    x = jnp.where(jnp.isposinf(x), jnp.asarray(info.max if posinf is None else posinf, self.dtype), x)
    return jnp.where(jnp.isneginf(x), jnp.asarray(info.min if neginf is None else neginf, self.dtype), x)


# (total bits, fraction bits, exponent bias, unsigned type of the same width) of each floating dtype.
_FLOAT_LAYOUT = {"float64": (64, 52, 1023, "uint64"), "float32": (32, 23, 127, "uint32"),
                 "bfloat16": (16, 7, 127, "uint16"), "float16": (16, 10, 15, "uint16")}


@lower("frexp.Tensor", promote=None)
def frexp(self: Any) -> tuple[Any, Any]:
    """(mantissa in [0.5, 1) with self's dtype, int32 exponent); 0, inf and NaN give (self, 0).

    Computed on the bit pattern: XLA:CPU flushes subnormals to zero in arithmetic, and frexp must not."""
    if not _is_float(self):
        raise RuntimeError("torch.frexp() only supports floating-point dtypes")
    nbits, mbits, bias, utype = _FLOAT_LAYOUT[jnp.dtype(self.dtype).name]
    udt = jnp.dtype(utype)
    bits = lax.bitcast_convert_type(self, udt)
    frac_mask = jnp.asarray((1 << mbits) - 1, udt)
    exp_mask = (1 << (nbits - 1 - mbits)) - 1
    sign = bits & jnp.asarray(1 << (nbits - 1), udt)
    e = ((bits >> jnp.asarray(mbits, udt)) & jnp.asarray(exp_mask, udt)).astype(jnp.int32)
    m = bits & frac_mask
    half_exponent = jnp.asarray((bias - 1) << mbits, udt)  # exponent field of [0.5, 1)
    # Subnormals: normalise the fraction by its leading bit at position p.
    p = (nbits - 1) - lax.clz(m).astype(jnp.int32)
    shift = jnp.clip(mbits - p, 0, mbits).astype(udt)
    sub_frac = (m << shift) & frac_mask
    normal = (e > 0) & (e < exp_mask)
    subnormal = (e == 0) & (m != 0)
    mant_bits = jnp.where(normal, sign | half_exponent | m, sign | half_exponent | sub_frac)
    mantissa = lax.bitcast_convert_type(mant_bits, self.dtype)
    exponent = jnp.where(normal, e - (bias - 1), jnp.where(subnormal, p - mbits - (bias - 2), 0))
    finite_nonzero = normal | subnormal
    return jnp.where(finite_nonzero, mantissa, self), exponent.astype(jnp.int32)


@lower("isposinf", promote=None)
def isposinf(self: Any) -> Any:
    if _is_complex(self):
        raise RuntimeError("isposinf does not support complex inputs.")
    return jnp.isposinf(self) if _is_float(self) else jnp.zeros(self.shape, jnp.bool_)


@lower("isneginf", promote=None)
def isneginf(self: Any) -> Any:
    if _is_complex(self):
        raise RuntimeError("isneginf does not support complex inputs.")
    return jnp.isneginf(self) if _is_float(self) else jnp.zeros(self.shape, jnp.bool_)


# ---- powers ----


def _int_pow(base: Any, exponent: Any) -> Any:
    """Integer power as PyTorch's powi: a negative exponent gives 0, except for bases 1 and -1."""
    exponent = jnp.broadcast_to(exponent, jnp.broadcast_shapes(jnp.shape(base), jnp.shape(exponent)))
    base = jnp.broadcast_to(base, exponent.shape)
    positive = jnp.power(base, jnp.maximum(exponent, 0))
    odd = (exponent & 1) == 1
    negative = jnp.where(base == 1, 1, jnp.where(base == -1, jnp.where(odd, -1, 1), 0)).astype(base.dtype)
    return jnp.where(exponent < 0, negative, positive)


def _pow(self: Any, exponent: Any) -> Any:
    if _is_bool(self):
        raise NotImplementedError("\"pow\" not implemented for 'Bool'")
    if _is_int(self):
        return _int_pow(self, exponent)
    return jnp.power(self, exponent)


@lower("pow.Tensor_Tensor", promote=DEFAULT, promote_args=("self", "exponent"))
def pow_tensor(self: Any, exponent: Any) -> Any:
    return _pow(self, exponent)


# pow(tensor, scalar) at the exponents PyTorch's CPU kernel (aten/src/ATen/native/cpu/PowKernel.cpp, and Pow.cpp for
# 0 and 1) computes with exact forms instead of std::pow: x * x, x * x * x, 1 / (x * x), sqrt, 1 / sqrt, 1 / x, a copy
# and ones. On XLA:CPU, XLA's general power (exp/log based) is ~20x slower than x * x (RMSNorm's `x.pow(2)` took
# 240 us where x * x takes 13 us) and an ulp off CPU's values, so there the form is chosen on the device by
# lax.switch on the traced exponent (a new value does not recompile). On TPU power is cheap and fuses with its
# neighbours, which a conditional prevents: measured on a v5e, RMSNorm of an (8, 2048, 4096) bfloat16 activation took
# 1204 us with power, 1425 us with the switch (and 1937 us selecting among all forms), so other platforms keep power.
# float16 and bfloat16 arrive here as float32 (opmath), so each form rounds once: CPU's bfloat16 x * x * x and
# 1 / (x * x) round x * x to bfloat16 first (one bfloat16 ulp apart at times), and CPU's float16 0.5 / -0.5 use pow,
# whose C semantics at -0 and -inf (pow(-0, 0.5) = +0, pow(-inf, 0.5) = +inf) differ from sqrt's (as XLA's power's
# did before these forms).
_POW_FORMS: tuple[tuple[float, Callable[[Any, Any], Any]], ...] = (
    (2.0, lambda x, e: x * x),
    (3.0, lambda x, e: x * x * x),
    (-2.0, lambda x, e: 1 / (x * x)),
    (0.5, lambda x, e: _sqrt(x)),
    (-0.5, lambda x, e: _rsqrt(x)),
    (-1.0, lambda x, e: 1 / x),
    (1.0, lambda x, e: x),
    (0.0, lambda x, e: jnp.ones(x.shape, x.dtype)),
)


def _pow_scalar_exponent(self: Any, exponent: Any) -> Any:
    if not _is_float(self) or jnp.ndim(exponent) != 0 or _runtime.platform() != "cpu":
        return _pow(self, exponent)
    index = jnp.int32(0)
    for k, (e, _) in enumerate(_POW_FORMS, 1):
        index = jnp.where(exponent == e, jnp.int32(k), index)
    return lax.switch(index, [_pow] + [form for _, form in _POW_FORMS], self, exponent)


@lower("pow.Tensor_Scalar", promote=DEFAULT, promote_args=("self", "exponent"))
def pow_tensor_scalar(self: Any, exponent: Any) -> Any:
    return _pow_scalar_exponent(self, exponent)


@lower("pow.Scalar", promote=DEFAULT, promote_args=("self", "exponent"))
def pow_scalar(self: Any, exponent: Any) -> Any:
    return _pow(self, exponent)


# ---- binary floating functions ----


@lower("atan2", promote=INT_TO_FLOAT, promote_args=("self", "other"))
def atan2(self: Any, other: Any) -> Any:
    if _is_complex(self):
        raise _not_implemented("atan2_cpu", self)
    return jnp.arctan2(self, other)


@lower("hypot", promote=DEFAULT, promote_args=("self", "other"))
def hypot(self: Any, other: Any) -> Any:
    _require_float("hypot_cpu", self)
    return jnp.hypot(self, other)


@lower("copysign.Tensor", "copysign.Scalar", promote=INT_TO_FLOAT, promote_args=("self", "other"))
def copysign(self: Any, other: Any) -> Any:
    if _is_complex(self):
        raise _not_implemented("copysign_cpu", self)
    return jnp.copysign(self, other)


@lower("logaddexp", promote=DEFAULT, promote_args=("self", "other"))
def logaddexp(self: Any, other: Any) -> Any:
    _require_float("logaddexp_cpu", self)
    if _is_complex(self):
        return _complex_logaddexp(*jnp.broadcast_arrays(self, other))
    return jnp.logaddexp(self, other)


def _complex_logaddexp(x: Any, y: Any) -> Any:
    """PyTorch's complex log(exp(x) + exp(y)): log1p(exp(min - max)) + max, ordered by real part."""
    x_first = jnp.real(x) < jnp.real(y)
    lo, hi = jnp.where(x_first, x, y), jnp.where(x_first, y, x)
    out = jnp.log1p(jnp.exp(lo - hi)) + hi
    both_inf = jnp.isinf(jnp.real(lo)) & (jnp.real(lo) == jnp.real(hi))
    out = jnp.where(both_inf, jnp.where(jnp.real(lo) < 0, lo, jnp.log(jnp.exp(lo) + jnp.exp(hi))), out)
    nan = jnp.isnan(x) | jnp.isnan(y)
    return jnp.where(nan, jnp.asarray(complex(jnp.nan, jnp.nan), x.dtype), out)


@lower("logaddexp2", promote=DEFAULT, promote_args=("self", "other"))
def logaddexp2(self: Any, other: Any) -> Any:
    _require_float("logaddexp2_cpu", self)
    return jnp.logaddexp2(self, other)


@lower("xlogy.Tensor", "xlogy.Scalar_Self", "xlogy.Scalar_Other", promote=INT_TO_FLOAT)
def xlogy(self: Any, other: Any) -> Any:
    """x * log(y), 0 where x == 0 unless y is NaN."""
    x, y = jnp.broadcast_arrays(self, other)
    out = jnp.where(x == 0, jnp.zeros_like(x), x * jnp.log(y))
    return jnp.where(jnp.isnan(y), y, out)


@lower("special_xlog1py", "special_xlog1py.self_scalar", "special_xlog1py.other_scalar", promote=INT_TO_FLOAT)
def special_xlog1py(self: Any, other: Any) -> Any:
    """x * log1p(y), 0 where x == 0 unless y is NaN."""
    x, y = jnp.broadcast_arrays(self, other)
    out = jnp.where(x == 0, jnp.zeros_like(x), x * jnp.log1p(y))
    return jnp.where(jnp.isnan(y), y, out)


@lower("nextafter", promote=NO_OPMATH, promote_args=("self", "other"))
def nextafter(self: Any, other: Any) -> Any:
    _require_float("nextafter_cpu", self)
    return jnp.nextafter(self, other)


@lower("igamma", promote=DEFAULT, promote_args=("self", "other"))
def igamma(self: Any, other: Any) -> Any:
    """Regularized lower incomplete gamma P(a, x) with PyTorch's values at the domain edges."""
    _require_float("igamma_cpu", self)
    a, x = jnp.broadcast_arrays(self, other)
    return _igamma_edges(a, x, _gammainc(a, x, upper=False), lower_tail=True)


@lower("igammac", promote=DEFAULT, promote_args=("self", "other"))
def igammac(self: Any, other: Any) -> Any:
    """Regularized upper incomplete gamma Q(a, x) with PyTorch's values at the domain edges."""
    _require_float("igammac_cpu", self)
    a, x = jnp.broadcast_arrays(self, other)
    return _igamma_edges(a, x, _gammainc(a, x, upper=True), lower_tail=False)


def _gammainc(a: Any, x: Any, upper: bool) -> Any:
    """JAX's regularized incomplete gamma, computed in float64 for narrower floats and rounded back. In float32
    JAX's series loses precision as `a` grows: P(5000, 5000) is 0.50188; float32 gave 0.50002 on XLA:CPU and 0.777
    on a TPU v5e (P(100, 100): 0.51330, TPU float32 0.51134), where CPU PyTorch, which switches to an asymptotic
    expansion for large `a`, is right to float32's precision. In float64 JAX's is right on both (the TPU emulates
    float64: 5x the time of the float32 program for a million elements)."""
    fn = _sps().gammaincc if upper else _sps().gammainc
    if a.dtype == jnp.float64:
        return fn(a, x)
    return fn(a.astype(jnp.float64), x.astype(jnp.float64)).astype(a.dtype)


def _igamma_edges(a: Any, x: Any, out: Any, lower_tail: bool) -> Any:
    one, zero = (1.0, 0.0) if lower_tail else (0.0, 1.0)
    out = _where(jnp.isinf(x), one, out)
    out = _where(jnp.isinf(a), jnp.where(jnp.isinf(x), jnp.nan, zero), out)
    out = _where(x == 0, zero, out)
    out = _where(a == 0, jnp.where(x > 0, one, jnp.nan), out)
    return _where((x < 0) | (a < 0), jnp.nan, out)


# ---- division-like integer/float ops ----


@lower("fmod.Tensor", "fmod.Scalar", promote=DEFAULT, promote_args=("self", "other"))
def fmod(self: Any, other: Any) -> Any:
    if _is_bool(self):
        raise _not_implemented("fmod_cpu", self)
    return jnp.fmod(self, other)


@lower("remainder.Tensor", "remainder.Scalar", "remainder.Scalar_Tensor", promote=DEFAULT,
       promote_args=("self", "other"))
def remainder(self: Any, other: Any) -> Any:
    """Python-style modulo: the result takes the divisor's sign."""
    if _is_bool(self):
        raise _not_implemented("remainder_cpu", self)
    return jnp.remainder(self, other)


@lower("floor_divide", "floor_divide.Scalar", promote=DEFAULT, promote_args=("self", "other"))
def floor_divide(self: Any, other: Any) -> Any:
    if _is_bool(self):
        raise _not_implemented("div_floor_cpu", self)
    return jnp.floor_divide(self, other)


# ---- min / max / clamp ----


def _no_complex_minmax(name: str, x: Any) -> None:
    if _is_complex(x):
        raise RuntimeError(f"{name} not implemented for complex tensors.")


@lower("maximum", promote=DEFAULT, promote_args=("self", "other"))
def maximum(self: Any, other: Any) -> Any:
    """Elementwise max; NaN propagates."""
    _no_complex_minmax("maximum", self)
    return jnp.maximum(self, other)


@lower("minimum", promote=DEFAULT, promote_args=("self", "other"))
def minimum(self: Any, other: Any) -> Any:
    """Elementwise min; NaN propagates."""
    _no_complex_minmax("minimum", self)
    return jnp.minimum(self, other)


@lower("fmax", promote=DEFAULT, promote_args=("self", "other"))
def fmax(self: Any, other: Any) -> Any:
    """Elementwise max ignoring NaN (NaN only where both are NaN)."""
    _no_complex_minmax("fmax", self)
    return jnp.fmax(self, other) if _is_float(self) else jnp.maximum(self, other)


@lower("fmin", promote=DEFAULT, promote_args=("self", "other"))
def fmin(self: Any, other: Any) -> Any:
    """Elementwise min ignoring NaN (NaN only where both are NaN)."""
    _no_complex_minmax("fmin", self)
    return jnp.fmin(self, other) if _is_float(self) else jnp.minimum(self, other)


def _clamp(x: Any, lo: Any, hi: Any) -> Any:
    if _is_complex(x):
        raise NotImplementedError("clamp is not supported for complex types")
    if lo is not None:
        x = jnp.maximum(x, lo)
    if hi is not None:
        x = jnp.minimum(x, hi)
    return x


@lower("clamp", "clamp.Tensor", promote=DEFAULT, promote_args=("self", "min", "max"))
def clamp(self: Any, min: Any = None, max: Any = None) -> Any:  # noqa: A002 (schema names)
    """min(max(x, min), max): NaN in any operand propagates; min > max gives max."""
    if min is None and max is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
    return _clamp(self, min, max)


@lower("clamp_min", "clamp_min.Tensor", promote=DEFAULT, promote_args=("self", "min"))
def clamp_min(self: Any, min: Any) -> Any:  # noqa: A002
    return _clamp(self, min, None)


@lower("clamp_max", "clamp_max.Tensor", promote=DEFAULT, promote_args=("self", "max"))
def clamp_max(self: Any, max: Any) -> Any:  # noqa: A002
    return _clamp(self, None, max)


# ---- lerp, addcmul, addcdiv ----


def _lerp(kernel: str, self: Any, end: Any, weight: Any, weight_is_tensor: bool) -> Any:
    """self + weight * (end - self), evaluated from the nearer end as PyTorch does (in float32 for bfloat16)."""
    checks = (("end", end), ("weight", weight)) if weight_is_tensor else (("end", end),)
    for name, other in checks:
        if other.dtype != self.dtype:
            raise RuntimeError(f"expected dtype {_meta_name(self)} for `{name}` but got dtype {_meta_name(other)}")
    _require_float(kernel, self)
    compute = jnp.float32 if self.dtype in (jnp.bfloat16, jnp.float16) else self.dtype
    start, end = self.astype(compute), end.astype(compute)
    weight = jnp.asarray(weight).astype(compute)
    diff = end - start
    out = jnp.where(jnp.abs(weight) < 0.5, start + weight * diff, end - diff * (1 - weight))
    return out.astype(self.dtype)


_META_NAMES = {"float32": "float", "float64": "double", "float16": "c10::Half", "bfloat16": "c10::BFloat16",
               "int64": "long int", "int32": "int", "int16": "short int", "int8": "signed char",
               "uint8": "unsigned char", "bool": "bool", "complex64": "c10::complex<float>",
               "complex128": "c10::complex<double>"}


def _meta_name(x: Any) -> str:
    """The C++ type name PyTorch prints for a dtype in TypeMeta messages ('float', 'double', 'long int')."""
    name = jnp.dtype(x.dtype).name
    return _META_NAMES.get(name, name)


@lower("lerp.Scalar", promote=None)
def lerp_scalar(self: Any, end: Any, weight: Any) -> Any:
    return _lerp("lerp_kernel_scalar", self, end, weight, weight_is_tensor=False)


@lower("lerp.Tensor", promote=None)
def lerp_tensor(self: Any, end: Any, weight: Any) -> Any:
    return _lerp("lerp_kernel_tensor", self, end, weight, weight_is_tensor=True)


@lower("addcmul", promote=DEFAULT, promote_args=("self", "tensor1", "tensor2"))
def addcmul(self: Any, tensor1: Any, tensor2: Any, value: Any = 1) -> Any:
    """self + value * tensor1 * tensor2."""
    if _is_bool(self):
        raise _not_implemented("addcmul_cpu_out", self)
    return self + jnp.asarray(value).astype(self.dtype) * tensor1 * tensor2


@lower("addcdiv", promote=DEFAULT, promote_args=("self", "tensor1", "tensor2"))
def addcdiv(self: Any, tensor1: Any, tensor2: Any, value: Any = 1) -> Any:
    """self + value * tensor1 / tensor2 (integer tensor1 and tensor2 are an error)."""
    if _is_integral(self):
        raise RuntimeError(
            "Integer division with addcdiv is no longer supported, and in a future  release addcdiv will perform "
            "a true division of tensor1 and tensor2. The historic addcdiv behavior can be implemented as "
            "(input + value * torch.trunc(tensor1 / tensor2)).to(input.dtype) for integer inputs and as "
            "(input + value * tensor1 / tensor2) for float inputs. The future addcdiv behavior is just the latter "
            "implementation: (input + value * tensor1 / tensor2), for all dtypes."
        )
    return self + jnp.asarray(value).astype(self.dtype) * tensor1 / tensor2


# ---- logical, shifts, gcd/lcm, heaviside ----


def _truth(x: Any) -> Any:
    return x if _is_bool(x) else x != 0


@lower("logical_and")
def logical_and(self: Any, other: Any) -> Any:
    return jnp.logical_and(_truth(self), _truth(other))


@lower("logical_or")
def logical_or(self: Any, other: Any) -> Any:
    return jnp.logical_or(_truth(self), _truth(other))


@lower("logical_xor")
def logical_xor(self: Any, other: Any) -> Any:
    return jnp.logical_xor(_truth(self), _truth(other))


def _shift_amount(self: Any, other: Any) -> tuple[Any, Any, Any]:
    """(a, b, out of range) broadcast: shifts below 0 or of at least the bit width are out of range."""
    a, b = jnp.broadcast_arrays(self, other)
    bits = jnp.iinfo(a.dtype).bits
    out_of_range = (b < 0) | (b >= bits) if jnp.issubdtype(b.dtype, jnp.signedinteger) else b >= bits
    return a, jnp.where(out_of_range, jnp.zeros_like(b), b), out_of_range


@lower("bitwise_left_shift.Tensor", "bitwise_left_shift.Tensor_Scalar", "bitwise_left_shift.Scalar_Tensor",
       "__lshift__.Tensor", "__lshift__.Scalar", promote=DEFAULT, promote_args=("self", "other"))
def bitwise_left_shift(self: Any, other: Any) -> Any:
    """a << b, 0 when b is negative or at least the bit width."""
    _require_int("lshift_cpu", self)
    a, b, out_of_range = _shift_amount(self, other)
    return jnp.where(out_of_range, jnp.zeros_like(a), jnp.left_shift(a, b))


@lower("bitwise_right_shift.Tensor", "bitwise_right_shift.Tensor_Scalar", "bitwise_right_shift.Scalar_Tensor",
       "__rshift__.Tensor", "__rshift__.Scalar", promote=DEFAULT, promote_args=("self", "other"))
def bitwise_right_shift(self: Any, other: Any) -> Any:
    """a >> b (arithmetic for signed types); the sign fill (-1 or 0) when b is negative or at least the bit width."""
    _require_int("rshift_cpu", self)
    a, b, out_of_range = _shift_amount(self, other)
    fill = jnp.where(a < 0, -1, 0).astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.signedinteger) else jnp.zeros_like(a)
    return jnp.where(out_of_range, fill, jnp.right_shift(a, b))


@direct("__ilshift__.Scalar", "__ilshift__.Tensor")
def ilshift(self: torch.Tensor, other: Any) -> torch.Tensor:
    """`x <<= y` (the in-place form of __lshift__ is named __ilshift__, so the registry does not derive it)."""
    return _inplace(torch.bitwise_left_shift, self, other)


@direct("__irshift__.Scalar", "__irshift__.Tensor")
def irshift(self: torch.Tensor, other: Any) -> torch.Tensor:
    """`x >>= y`."""
    return _inplace(torch.bitwise_right_shift, self, other)


@lower("gcd", promote=DEFAULT, promote_args=("self", "other"))
def gcd(self: Any, other: Any) -> Any:
    _require_int("gcd_cpu", self)
    return jnp.gcd(self, other)


@lower("lcm", promote=DEFAULT, promote_args=("self", "other"))
def lcm(self: Any, other: Any) -> Any:
    _require_int("lcm_cpu", self)
    return jnp.lcm(self, other)


@lower("heaviside", promote=None)
def heaviside(self: Any, values: Any) -> Any:
    """values where x == 0, else x > 0 (so 0 for NaN)."""
    if _is_complex(self) or _is_complex(values):
        raise RuntimeError("heaviside is not yet implemented for complex tensors.")
    if self.dtype != values.dtype:
        raise RuntimeError("heaviside is not yet implemented for tensors with different dtypes.")
    x, v = jnp.broadcast_arrays(self, values)
    return jnp.where(x == 0, v, (x > 0).astype(x.dtype))


# ---- building complex numbers ----


@lower("complex")
def complex_(real: Any, imag: Any) -> Any:
    names = [dtype_name(_runtime.torch_dtype(x.dtype)) for x in (real, imag)]
    if any(x.dtype not in (jnp.float32, jnp.float64, jnp.float16) for x in (real, imag)):
        raise RuntimeError(f"Expected both inputs to be Half, Float or Double tensors but got {names[0]} and "
                           f"{names[1]}")
    if real.dtype != imag.dtype:
        raise RuntimeError(f"Expected object of scalar type {names[0]} but got scalar type {names[1]} for second "
                           "argument")
    if real.dtype == jnp.float16:
        _runtime.jax_dtype(torch.complex32)  # raises, naming the dtypes tpu has
    r, i = jnp.broadcast_arrays(real, imag)
    return lax.complex(r, i)


@lower("polar")
def polar(abs: Any, angle: Any) -> Any:  # noqa: A002 - ATen's argument name
    return complex_(abs * jnp.cos(angle), abs * jnp.sin(angle))


# ---- backward ops of unary functions that autograd calls by name ----


@lower("tanh_backward")
def tanh_backward(grad_output: Any, output: Any) -> Any:
    return grad_output * (1 - output * jnp.conj(output))


@lower("sigmoid_backward")
def sigmoid_backward(grad_output: Any, output: Any) -> Any:
    return grad_output * jnp.conj(output * (1 - output))


@lower("logit_backward")
def logit_backward(grad_output: Any, self: Any, eps: float | None = None) -> Any:
    if eps is None:
        inside = (self >= 0) & (self <= 1)
        return jnp.where(inside, grad_output / (self * (1 - self)), jnp.nan)
    inside = (self >= eps) & (self <= 1 - eps)
    return jnp.where(inside, grad_output / (self * (1 - self)), 0)
