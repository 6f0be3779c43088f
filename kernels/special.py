"""torch.special's Bessel, Airy and orthogonal-polynomial functions (JAX has none of them but i0/i1).

Behaviour follows PyTorch's CPU kernels (ATen's Math.h): the polynomials take n as a tensor of the result's
dtype truncated to an integer, return 0 for negative n, use the same closed forms at |x| == 1 (x == 0 or 1 for
the shifted ones) and the same trigonometric forms for large n inside (-1, 1), otherwise the three-term
recurrence, computed in the result's dtype as the CPU loop does (so overflow to inf/nan happens where CPU's does).
With a tensor n the recurrence is one vectorised loop up to the largest n, each element stopping at its own n.

I0 and I1 are JAX's, in the input's dtype. The other Bessel functions and Airy's are computed in float64 whatever
the input's floating dtype, then cast: power series where they converge without too much cancellation, asymptotic
(Hankel) expansions for large arguments, and for K_nu in between the integral
K_nu(x) = int_0^inf exp(-x cosh t) cosh(nu t) dt by the trapezoid rule (exponentially convergent). Measured
against scipy in float64: J0/J1/Y0/Y1 within 3e-12 absolute (CPU's: 9e-7, its phase x - pi/4 is rounded for
large x), K and scaled K within 5e-15 relative of CPU, Airy within 3e-11 absolute (CPU's: 3e-6 on (-8, -2)). In
float32 they agree with CPU to float32 rounding. On TPU float64 is emulated: correct there but slower than
float32 arithmetic.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from torch_tpu._jax import jax, jnp, lax
from torch_tpu.kernels.registry import INT_TO_FLOAT, lower

# ---- orthogonal polynomials ----


def _int_n(n: Any) -> Any:
    """n truncated to an integer as C++'s static_cast<int64_t> on x86: NaN, +-inf and |n| >= 2^63 give INT64_MIN,
    a negative n (result 0). XLA would saturate +inf to INT64_MAX: a loop without end."""
    bad = jnp.isnan(n) | (jnp.abs(n) >= 2.0 ** 63)
    return jnp.where(bad, -1, jnp.trunc(jnp.where(bad, 0, n)).astype(jnp.int64))


def _recurrence(x: Any, n: Any, q0: Any, step: Callable[[Any, Any, Any], Any], closed: Any = False) -> Any:
    """p = 1, q = q0, then for j = 1 .. n-1: p, q = q, step(j, p, q); returns q (1 where n == 0).

    One loop up to the largest n of the elements that use it (not those with a `closed` form); every element
    keeps its value once j >= n."""
    one = jnp.ones_like(x)
    active_n = jnp.where((n >= 2) & ~jnp.asarray(closed), n, 0)
    last = jnp.max(active_n, initial=0)

    def cond(state: tuple) -> Any:
        return state[0] < last

    def body(state: tuple) -> tuple:
        j, p, q = state
        r = step(j.astype(x.dtype), p, q)
        go = j < n
        return j + 1, jnp.where(go, q, p), jnp.where(go, r, q)

    _, _, q = lax.while_loop(cond, body, (jnp.asarray(1, jnp.int64), one, q0))
    return jnp.where(n == 0, one, q)


def _odd(n: Any) -> Any:
    return (n % 2) != 0


def _polynomial(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        def kernel(x: Any, n: Any) -> Any:
            x, n = jnp.broadcast_arrays(x, n)
            return fn(x, _int_n(n)).astype(x.dtype)

        kernel.__name__ = kernel.__qualname__ = fn.__name__
        base = names[0]
        return lower(base, f"{base}.x_scalar", f"{base}.n_scalar", promote=INT_TO_FLOAT,
                     promote_args=("x", "n"))(kernel)

    return deco


def _signed(odd: Any, value: Any) -> Any:
    return jnp.where(odd, -value, value)


@_polynomial("special_chebyshev_polynomial_t")
def chebyshev_polynomial_t(x: Any, n: Any) -> Any:
    nf = n.astype(x.dtype)
    rec = _recurrence(x, n, x, lambda j, p, q: (x + x) * q - p, closed=(n > 6) & (jnp.abs(x) <= 1))
    trig = jnp.cos(nf * jnp.arccos(x))
    out = jnp.where((n > 6) & (jnp.abs(x) < 1), trig, rec)
    out = jnp.where(jnp.abs(x) == 1, jnp.where((x > 0) | ~_odd(n), 1.0, -1.0).astype(x.dtype), out)
    return jnp.where(n < 0, 0, out)


@_polynomial("special_chebyshev_polynomial_u")
def chebyshev_polynomial_u(x: Any, n: Any) -> Any:
    nf = n.astype(x.dtype)
    rec = _recurrence(x, n, x + x, lambda j, p, q: (x + x) * q - p, closed=(n > 8) & (jnp.abs(x) <= 1))
    theta = jnp.arccos(x)
    s = jnp.sin(theta)
    trig = jnp.where(s != 0, jnp.sin((nf + 1) * theta) / s, (nf + 1) * jnp.cos((nf + 1) * theta) / x)
    out = jnp.where((n > 8) & (jnp.abs(x) < 1), trig, rec)
    out = jnp.where(jnp.abs(x) == 1, jnp.where((x > 0) | ~_odd(n), nf + 1, -(nf + 1)), out)
    return jnp.where(n < 0, 0, out)


@_polynomial("special_chebyshev_polynomial_v")
def chebyshev_polynomial_v(x: Any, n: Any) -> Any:
    nf = n.astype(x.dtype)
    rec = _recurrence(x, n, x + x - 1, lambda j, p, q: (x + x) * q - p, closed=(n > 8) & (jnp.abs(x) <= 1))
    theta = jnp.arccos(x)
    odd_value = _signed(_odd(n), nf + nf + 1)
    trig = jnp.where(jnp.sin(theta / 2) != 1, jnp.cos((nf + 0.5) * theta) / jnp.cos(theta / 2), odd_value)
    out = jnp.where((n > 8) & (jnp.abs(x) < 1), trig, rec)
    out = jnp.where(jnp.abs(x) == 1, jnp.where(x > 0, jnp.ones_like(x), odd_value), out)
    return jnp.where(n < 0, 0, out)


@_polynomial("special_chebyshev_polynomial_w")
def chebyshev_polynomial_w(x: Any, n: Any) -> Any:
    nf = n.astype(x.dtype)
    rec = _recurrence(x, n, x + x + 1, lambda j, p, q: (x + x) * q - p, closed=(n > 8) & (jnp.abs(x) <= 1))
    theta = jnp.arccos(x)
    edge = jnp.where(x > 0, nf + nf + 1, _signed(_odd(n), jnp.ones_like(x)))
    trig = jnp.where(jnp.sin(theta / 2) != 0, jnp.sin((nf + 0.5) * theta) / jnp.sin(theta / 2), edge)
    out = jnp.where((n > 8) & (jnp.abs(x) < 1), trig, rec)
    out = jnp.where(jnp.abs(x) == 1, edge, out)
    return jnp.where(n < 0, 0, out)


@_polynomial("special_shifted_chebyshev_polynomial_t")
def shifted_chebyshev_polynomial_t(x: Any, n: Any) -> Any:
    nf = n.astype(x.dtype)
    y = x + x - 1
    rec = _recurrence(x, n, y, lambda j, p, q: (y + y) * q - p, closed=(n > 6) & (jnp.abs(y) < 1))
    out = jnp.where((n > 6) & (jnp.abs(y) < 1), jnp.cos(nf * jnp.arccos(y)), rec)
    out = jnp.where(x == 0, _signed(_odd(n), jnp.ones_like(x)), out)
    out = jnp.where(x == 1, jnp.ones_like(x), out)
    return jnp.where(n < 0, 0, out)


@_polynomial("special_shifted_chebyshev_polynomial_u")
def shifted_chebyshev_polynomial_u(x: Any, n: Any) -> Any:
    nf = n.astype(x.dtype)
    y = x + x - 1
    rec = _recurrence(x, n, y + y, lambda j, p, q: (y + y) * q - p, closed=(n > 6) & (jnp.abs(y) < 1))
    theta = jnp.arccos(y)
    s = jnp.sin(theta)
    trig = jnp.where(s != 0, jnp.sin((nf + 1) * theta) / s, (nf + 1) * jnp.cos((nf + 1) * theta) / y)
    out = jnp.where((n > 6) & (jnp.abs(y) < 1), trig, rec)
    out = jnp.where(x == 0, _signed(_odd(n), nf + 1), out)
    out = jnp.where(x == 1, nf + 1, out)
    return jnp.where(n < 0, 0, out)


@_polynomial("special_shifted_chebyshev_polynomial_v")
def shifted_chebyshev_polynomial_v(x: Any, n: Any) -> Any:
    nf = n.astype(x.dtype)
    y = x + x - 1
    rec = _recurrence(x, n, y + y - 1, lambda j, p, q: (y + y) * q - p, closed=(n > 6) & (jnp.abs(y) < 1))
    theta = jnp.arccos(y)
    odd_value = _signed(_odd(n), nf + nf + 1)
    trig = jnp.where(jnp.sin(theta / 2) != 1, jnp.cos((nf + 0.5) * theta) / jnp.cos(theta / 2), odd_value)
    out = jnp.where((n > 6) & (jnp.abs(y) < 1), trig, rec)
    out = jnp.where(x == 0, odd_value, out)
    out = jnp.where(x == 1, jnp.ones_like(x), out)
    return jnp.where(n < 0, 0, out)


@_polynomial("special_shifted_chebyshev_polynomial_w")
def shifted_chebyshev_polynomial_w(x: Any, n: Any) -> Any:
    nf = n.astype(x.dtype)
    y = x + x - 1
    rec = _recurrence(x, n, y + y + 1, lambda j, p, q: (y + y) * q - p, closed=(n > 4) & (jnp.abs(y) < 1))
    theta = jnp.arccos(y)
    odd_value = _signed(_odd(n), jnp.ones_like(x))
    trig = jnp.where(jnp.sin(theta / 2) != 0, jnp.sin((nf + 0.5) * theta) / jnp.sin(theta / 2), nf + nf + 1)
    out = jnp.where((n > 4) & (jnp.abs(y) < 1), trig, rec)
    out = jnp.where(x == 0, odd_value, out)
    out = jnp.where(x == 1, nf + nf + 1, out)
    return jnp.where(n < 0, 0, out)


@_polynomial("special_hermite_polynomial_h")
def hermite_polynomial_h(x: Any, n: Any) -> Any:
    # CPU's loop runs k = 2, 4, .., 2n - 2: step j uses k = 2j.
    return jnp.where(n < 0, 0, _recurrence(x, n, x + x, lambda j, p, q: (x + x) * q - (j + j) * p))


@_polynomial("special_hermite_polynomial_he")
def hermite_polynomial_he(x: Any, n: Any) -> Any:
    return jnp.where(n < 0, 0, _recurrence(x, n, x, lambda j, p, q: x * q - j * p))


@_polynomial("special_laguerre_polynomial_l")
def laguerre_polynomial_l(x: Any, n: Any) -> Any:
    rec = _recurrence(x, n, 1 - x, lambda j, p, q: (((j + j) + (1 - x)) * q - j * p) / (j + 1))
    out = jnp.where(jnp.abs(x) == 0, jnp.ones_like(x), rec)
    return jnp.where(n < 0, 0, out)


@_polynomial("special_legendre_polynomial_p")
def legendre_polynomial_p(x: Any, n: Any) -> Any:
    rec = _recurrence(x, n, x, lambda j, p, q: ((j + j + 1) * x * q - j * p) / (j + 1))
    edge = jnp.where((x > 0) | ~_odd(n), 1.0, -1.0).astype(x.dtype)
    out = jnp.where(jnp.abs(x) == 1, edge, rec)
    return jnp.where(n < 0, 0, out)


# ---- Bessel, modified Bessel and Airy functions (float64 inside) ----

_EULER = 0.57721566490153286061
_SERIES_TERMS = 48  # power series below |x| = 12: terms fall under 1e-17 of the largest by k = 40


def _f64(x: Any) -> Any:
    return x.astype(jnp.float64)


def _bessel(name: str, arg: str = "self") -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
    """Registers fn(x in float64) for the one-argument op `name` (its schema calls the argument `arg`)."""

    def deco(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def kernel(**kwargs: Any) -> Any:
            x = kwargs[arg]
            return fn(_f64(x)).astype(x.dtype)

        kernel.__name__ = kernel.__qualname__ = fn.__name__
        return lower(name, promote=INT_TO_FLOAT, promote_args=(arg,))(kernel)

    return deco


def _hankel_coefficients(nu: float, count: int) -> list[float]:
    """a_k(nu) = prod_{j<=k} (4 nu^2 - (2j-1)^2) / (k! 8^k), the terms of the Hankel expansions."""
    out, a = [1.0], 1.0
    for k in range(1, count):
        a = a * (4 * nu * nu - (2 * k - 1) ** 2) / (k * 8)
        out.append(a)
    return out


_HANKEL_TERMS = 24  # above |x| = 12 the smallest Hankel term is below 1e-17


def _hankel_pq(nu: float, x: Any) -> tuple[Any, Any]:
    """P and Q of J_nu = sqrt(2/(pi x)) (P cos chi - Q sin chi), Y_nu = sqrt(2/(pi x)) (P sin chi + Q cos chi)."""
    a = _hankel_coefficients(nu, _HANKEL_TERMS)
    inv = 1 / x
    p, q = jnp.zeros_like(x), jnp.zeros_like(x)
    power = jnp.ones_like(x)
    for k, ak in enumerate(a):
        sign = -1.0 if (k // 2) % 2 else 1.0
        if k % 2 == 0:
            p = p + sign * ak * power
        else:
            q = q + sign * ak * power
        power = power * inv
    return p, q


def _jy_large(nu: float, x: Any) -> tuple[Any, Any]:
    """J_nu and Y_nu for x > 12 by the Hankel expansion; chi = x - (nu/2 + 1/4) pi, its cosine and sine taken as
    cos(x) cos(phi) + sin(x) sin(phi) so the reduction of a large x is exact."""
    p, q = _hankel_pq(nu, x)
    phi = (nu / 2 + 0.25) * math.pi
    c, s = jnp.cos(x), jnp.sin(x)
    cos_chi = c * math.cos(phi) + s * math.sin(phi)
    sin_chi = s * math.cos(phi) - c * math.sin(phi)
    scale = jnp.sqrt(2 / (math.pi * x))
    return scale * (p * cos_chi - q * sin_chi), scale * (p * sin_chi + q * cos_chi)


def _harmonic(k: int) -> float:
    return sum(1.0 / j for j in range(1, k + 1))


def _j0_y0_series(x: Any) -> tuple[Any, Any]:
    """J0 = sum (-z)^k / k!^2 and Y0 = 2/pi (ln(x/2) + gamma) J0 + 2/pi sum (-1)^(k+1) H_k z^k / k!^2, z = x^2/4."""
    z = x * x / 4
    term = jnp.ones_like(x)
    j0, tail = term, jnp.zeros_like(x)
    for k in range(1, _SERIES_TERMS):
        term = term * (-z) / (k * k)
        j0 = j0 + term
        tail = tail - _harmonic(k) * term
    y0 = (2 / math.pi) * ((jnp.log(x / 2) + _EULER) * j0 + tail)
    return j0, y0


def _j1_y1_series(x: Any) -> tuple[Any, Any]:
    """J1 = sum (-1)^k (x/2)^(2k+1) / (k!(k+1)!) and
    Y1 = 2/pi ln(x/2) J1 - 2/(pi x) - 1/pi sum (-1)^k (psi(k+1) + psi(k+2)) (x/2)^(2k+1) / (k!(k+1)!)."""
    z = x * x / 4
    term = x / 2
    j1 = term
    tail = (2 * -_EULER + 1.0) * term
    for k in range(1, _SERIES_TERMS):
        term = term * (-z) / (k * (k + 1))
        j1 = j1 + term
        tail = tail + (_harmonic(k) + _harmonic(k + 1) - 2 * _EULER) * term
    y1 = (2 / math.pi) * jnp.log(x / 2) * j1 - 2 / (math.pi * x) - tail / math.pi
    return j1, y1


_JY_SWITCH = 12.0


@_bessel("special_bessel_j0")
def bessel_j0(x: Any) -> Any:
    a = jnp.abs(x)
    small = jnp.minimum(a, _JY_SWITCH)
    large = jnp.maximum(a, _JY_SWITCH)
    j_large, _ = _jy_large(0.0, large)
    return jnp.where(a <= _JY_SWITCH, _j0_y0_series(small)[0], j_large)  # nan at +-inf, as CPU


@_bessel("special_bessel_j1")
def bessel_j1(x: Any) -> Any:
    a = jnp.abs(x)
    small = jnp.minimum(a, _JY_SWITCH)
    large = jnp.maximum(a, _JY_SWITCH)
    j_large, _ = _jy_large(1.0, large)
    out = jnp.where(a <= _JY_SWITCH, _j1_y1_series(small)[0], j_large)  # nan at +-inf, as CPU
    return jnp.where(x < 0, -out, out)


def _y(nu: float, series: Callable[[Any], tuple[Any, Any]], x: Any) -> Any:
    small = jnp.clip(x, 1e-300, _JY_SWITCH)
    large = jnp.maximum(x, _JY_SWITCH)
    out = jnp.where(x <= _JY_SWITCH, series(small)[1], _jy_large(nu, large)[1])
    out = jnp.where(x == 0, -jnp.inf, out)  # nan at inf, as CPU
    return jnp.where(x < 0, jnp.nan, out)


@_bessel("special_bessel_y0")
def bessel_y0(x: Any) -> Any:
    return _y(0.0, _j0_y0_series, x)


@_bessel("special_bessel_y1")
def bessel_y1(x: Any) -> Any:
    return _y(1.0, _j1_y1_series, x)


# I0 and I1: JAX's Cephes ports, in the input's dtype as CPU computes them (so float32 overflows where CPU's does).
@lower("special_modified_bessel_i0", promote=INT_TO_FLOAT, promote_args=("self",))
def modified_bessel_i0(self: Any) -> Any:
    return jax.scipy.special.i0(self)


@lower("special_modified_bessel_i1", promote=INT_TO_FLOAT, promote_args=("self",))
def modified_bessel_i1(self: Any) -> Any:
    return jax.scipy.special.i1(self)


_K_SERIES_TERMS = 30  # the K series below x = 2: terms under 1e-17 by k = 25
_K_SERIES_SWITCH = 2.0
_K_ASYMPTOTIC_SWITCH = 50.0
# Trapezoid step in t (as accurate as 1/32 against scipy: 3e-15 relative; 1/8 gives 1e-12); past t = 7 the
# integrand is below 1e-200 of its value at 0 for x >= 1.
_K_STEP = 1 / 12
_K_NODES = 84


def _scaled_k_integral(nu: float, x: Any) -> Any:
    """exp(x) K_nu(x) = int_0^inf exp(-x (cosh t - 1)) cosh(nu t) dt by the trapezoid rule (its error falls
    exponentially with 1/step for this analytic, doubly decaying integrand)."""

    def body(j: Any, acc: Any) -> Any:
        t = j.astype(jnp.float64) * _K_STEP
        weight = jnp.where(j == 0, 0.5, 1.0)
        return acc + weight * jnp.exp(-x * (jnp.cosh(t) - 1)) * jnp.cosh(nu * t)

    return lax.fori_loop(0, _K_NODES, body, jnp.zeros_like(x)) * _K_STEP


def _scaled_k_asymptotic(nu: float, x: Any) -> Any:
    """exp(x) K_nu(x) ~ sqrt(pi / (2x)) sum a_k(nu) / x^k, for x above 50 (terms under 1e-17 by k = 20)."""
    total, power = jnp.zeros_like(x), jnp.ones_like(x)
    for ak in _hankel_coefficients(nu, 24):
        total = total + ak * power
        power = power / x
    return jnp.sqrt(math.pi / (2 * x)) * total


def _scaled_k_middle(nu: float, x: Any) -> Any:
    mid = jnp.clip(x, 1.0, _K_ASYMPTOTIC_SWITCH)  # the integral's nodes suffice from x = 1
    large = jnp.maximum(x, _K_ASYMPTOTIC_SWITCH)
    return jnp.where(x <= _K_ASYMPTOTIC_SWITCH, _scaled_k_integral(nu, mid), _scaled_k_asymptotic(nu, large))


def _k0_series(x: Any) -> Any:
    """K0 = -(ln(x/2) + gamma) I0(x) + sum H_k z^k / k!^2, z = x^2/4."""
    z = x * x / 4
    term = jnp.ones_like(x)
    i0, tail = term, jnp.zeros_like(x)
    for k in range(1, _K_SERIES_TERMS):
        term = term * z / (k * k)
        i0 = i0 + term
        tail = tail + _harmonic(k) * term
    return -(jnp.log(x / 2) + _EULER) * i0 + tail


def _k1_series(x: Any) -> Any:
    """K1 = 1/x + ln(x/2) I1(x) - x/4 sum (psi(k+1) + psi(k+2)) z^k / (k!(k+1)!), z = x^2/4."""
    z = x * x / 4
    term = jnp.ones_like(x)
    i1 = term
    tail = (1.0 - 2 * _EULER) * term
    for k in range(1, _K_SERIES_TERMS):
        term = term * z / (k * (k + 1))
        i1 = i1 + term
        tail = tail + (_harmonic(k) + _harmonic(k + 1) - 2 * _EULER) * term
    return 1 / x + jnp.log(x / 2) * (x / 2) * i1 - (x / 4) * tail


def _k(nu: float, series: Callable[[Any], Any], x: Any, scaled: bool) -> Any:
    small = jnp.clip(x, 1e-300, _K_SERIES_SWITCH)
    series_value = series(small)
    middle = _scaled_k_middle(nu, x)
    if scaled:
        out = jnp.where(x <= _K_SERIES_SWITCH, series_value * jnp.exp(small), middle)
    else:
        out = jnp.where(x <= _K_SERIES_SWITCH, series_value, middle * jnp.exp(-jnp.maximum(x, _K_SERIES_SWITCH)))
    out = jnp.where(x == jnp.inf, 0.0, out)
    out = jnp.where(x == 0, jnp.inf, out)
    return jnp.where(x < 0, jnp.nan, out)


@_bessel("special_modified_bessel_k0")
def modified_bessel_k0(x: Any) -> Any:
    return _k(0.0, _k0_series, x, scaled=False)


@_bessel("special_modified_bessel_k1")
def modified_bessel_k1(x: Any) -> Any:
    return _k(1.0, _k1_series, x, scaled=False)


@_bessel("special_scaled_modified_bessel_k0", "x")
def scaled_modified_bessel_k0(x: Any) -> Any:
    return _k(0.0, _k0_series, x, scaled=True)


@_bessel("special_scaled_modified_bessel_k1", "x")
def scaled_modified_bessel_k1(x: Any) -> Any:
    return _k(1.0, _k1_series, x, scaled=True)


_AI0 = 1 / (3 ** (2 / 3) * math.gamma(2 / 3))  # Ai(0)
_AIP0 = 1 / (3 ** (1 / 3) * math.gamma(1 / 3))  # -Ai'(0)
_AIRY_SERIES_TERMS = 30  # Maclaurin series on (-8, 2): terms under 1e-17 of the largest by k = 25
_AIRY_NEGATIVE = -8.0
_AIRY_POSITIVE = 2.0
# u_k = Gamma(3k + 1/2) / (54^k k! Gamma(k + 1/2)), the terms of Ai's expansions in zeta = 2/3 |x|^(3/2).
_AIRY_U = [math.prod(j + 0.5 for j in range(k, 3 * k)) / (54 ** k * math.factorial(k)) for k in range(16)]


def _airy_series(x: Any) -> Any:
    """Ai(x) = Ai(0) f(x) + Ai'(0) g(x), f = 1 + x^3/3! + 1*4 x^6/6! + ..., g = x + 2 x^4/4! + 2*5 x^7/7! + ..."""
    x3 = x * x * x
    f_term, g_term = jnp.ones_like(x), x
    f, g = f_term, g_term
    for k in range(1, _AIRY_SERIES_TERMS):
        f_term = f_term * x3 / ((3 * k - 1) * (3 * k))
        g_term = g_term * x3 / ((3 * k) * (3 * k + 1))
        f, g = f + f_term, g + g_term
    return _AI0 * f - _AIP0 * g


def _airy_negative(x: Any) -> Any:
    """Ai(-z) ~ (sin(zeta + pi/4) P - cos(zeta + pi/4) Q) / (sqrt(pi) z^(1/4)), P = sum (-1)^k u_2k zeta^-2k,
    Q = sum (-1)^k u_(2k+1) zeta^-(2k+1), for z >= 8 (zeta >= 15: the smallest term is under 1e-17)."""
    z = -x
    zeta = (2 / 3) * z * jnp.sqrt(z)
    p, q, power = jnp.zeros_like(x), jnp.zeros_like(x), jnp.ones_like(x)
    for k, uk in enumerate(_AIRY_U):
        sign = -1.0 if (k // 2) % 2 else 1.0
        if k % 2 == 0:
            p = p + sign * uk * power
        else:
            q = q + sign * uk * power
        power = power / zeta
    s, c = jnp.sin(zeta), jnp.cos(zeta)
    sin_shift = (s + c) * math.sqrt(0.5)
    cos_shift = (c - s) * math.sqrt(0.5)
    return (sin_shift * p - cos_shift * q) / (math.sqrt(math.pi) * jnp.sqrt(jnp.sqrt(z)))


def _airy_positive(x: Any) -> Any:
    """Ai(x) = sqrt(x/3) K_(1/3)(zeta) / pi, zeta = 2/3 x^(3/2)."""
    zeta = (2 / 3) * x * jnp.sqrt(x)
    return jnp.sqrt(x / 3) / math.pi * jnp.exp(-zeta) * _scaled_k_middle(1 / 3, zeta)


@lower("special_airy_ai", promote=INT_TO_FLOAT, promote_args=("x",))
def special_airy_ai(x: Any) -> Any:
    v = _f64(x)
    series = _airy_series(jnp.clip(v, _AIRY_NEGATIVE, _AIRY_POSITIVE))
    negative = _airy_negative(jnp.minimum(v, _AIRY_NEGATIVE))
    positive = _airy_positive(jnp.maximum(v, _AIRY_POSITIVE))
    out = jnp.where(v < _AIRY_NEGATIVE, negative, jnp.where(v <= _AIRY_POSITIVE, series, positive))
    return out.astype(x.dtype)
