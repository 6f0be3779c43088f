"""Creation and filling: fill_, zero_, arange, and the random fills (normal_, uniform_) driven by the tpu
generator's (seed, offset) state."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from torch_tpu import _executor, _rng, _runtime, _storage
from torch_tpu._jax import jax, jnp
from torch._prims_common.wrappers import _maybe_resize_out

from torch_tpu.kernels._promote import dtype_name, wrap_arrays
from torch_tpu.kernels.registry import direct


def _on(index: int) -> Any:
    return jax.sharding.SingleDeviceSharding(_runtime.device(index))


def _num(v: Any) -> str:
    """A number as ATen's messages print it (C++ stream formatting: 3, -1.5, 1e+07)."""
    return f"{v:g}" if isinstance(v, float) else str(v)


@functools.lru_cache(maxsize=1024)
def _full(shape: tuple[int, ...], dtype: Any, index: int) -> Any:
    return _executor.jitted(lambda value: jnp.full(shape, value, dtype), index, key=(shape, dtype, index))


def _fill_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise RuntimeError(
                f"fill_ only supports 0-dimension value tensor but got tensor with {value.dim()} dimensions."
            )
        return value.item()
    return value


@direct("fill_.Scalar", "fill_.Tensor", defer=True)
def fill_(self: torch.Tensor, value: Any) -> torch.Tensor:
    dtype = _runtime.jax_dtype(self.dtype)
    _storage.write(self, _full(tuple(self.shape), dtype, self.device.index)(_fill_value(value)))
    return self


@direct("zero_", defer=True)
def zero_(self: torch.Tensor) -> torch.Tensor:
    return fill_(self, 0)


@functools.lru_cache(maxsize=1024)
def _arange(n: int, dtype: Any, index: int, integral: bool) -> Any:
    def arange(start: Any, step: Any) -> Any:
        if integral:
            return (start + step * jnp.arange(n, dtype=jnp.int64)).astype(dtype)
        return (start + step * jnp.arange(n, dtype=jnp.float64)).astype(dtype)

    return _executor.jitted(arange, index, key=(n, dtype, index, integral))


# Deferrable: its size comes from host numbers (a tensor bound is read with .item(), which computes just that value),
# so under DEFER_AND_FUSE it is recorded like any op instead of running every pending graph first.
@direct("arange.start_out", defer=True)
def arange_start_out(start: Any, end: Any, step: Any = 1, *, out: torch.Tensor) -> torch.Tensor:
    start, end, step = (v.item() if isinstance(v, torch.Tensor) else v for v in (start, end, step))
    if step == 0:
        raise RuntimeError("step must be nonzero")
    if not all(math.isfinite(float(v)) for v in (start, end)):
        raise RuntimeError(f"unsupported range: {_num(float(start))} -> {_num(float(end))}")
    if (step > 0 and start > end) or (step < 0 and start < end):
        raise RuntimeError("upper bound and lower bound inconsistent with step sign")
    integral = not out.dtype.is_floating_point and not out.dtype.is_complex
    n = math.ceil((float(end) - float(start)) / float(step))
    if integral:  # CPU steps in int64: the start and step (and int64's end) truncate toward zero
        start, step = int(start), int(step)
        if out.dtype == torch.int64:
            if step == 0:
                raise ValueError("step must be nonzero")
            n = (int(end) - start + step - (1 if step > 0 else -1)) // step
    n = max(int(n), 0)
    if tuple(out.shape) != (n,):
        out.resize_((n,))
    dtype = _runtime.jax_dtype(out.dtype)
    _storage.write(out, _arange(n, dtype, out.device.index, integral)(start, step))
    return out


# ---- random ----

# Generator state -> JAX keys lives in torch_tpu/_rng.py (shared with traced programs); these names are the
# kernels' short names.
generator_for = _rng.generator_for
_key = _rng.key
_philox = _rng.draw


def _sample_dtype(dtype: Any) -> Any:
    return dtype if dtype in (jnp.float32, jnp.float64) else jnp.float32


# Each sampler maps (key, shape, dtype, *params) to values; params are traced, so new values do not recompile.

def _normal_sampler(key: Any, shape: tuple, dtype: Any, mean: Any, std: Any) -> Any:
    return jax.random.normal(key, shape, _sample_dtype(dtype)) * std + mean


def _uniform_sampler(key: Any, shape: tuple, dtype: Any, low: Any, high: Any) -> Any:
    return jax.random.uniform(key, shape, _sample_dtype(dtype)) * (high - low) + low


def _integers_sampler(key: Any, shape: tuple, dtype: Any, low: Any, high: Any) -> Any:
    # [low, high) in int64 arithmetic (high - low may exceed int32), then cast.
    return jax.random.randint(key, shape, low, high, dtype=jnp.int64)


def _bernoulli_sampler(key: Any, shape: tuple, dtype: Any, p: Any) -> Any:
    return jax.random.uniform(key, shape, jnp.float64 if dtype == jnp.float64 else jnp.float32) < p


def _exponential_sampler(key: Any, shape: tuple, dtype: Any, lambd: Any) -> Any:
    return jax.random.exponential(key, shape, _sample_dtype(dtype)) / lambd


def _geometric_sampler(key: Any, shape: tuple, dtype: Any, p: Any) -> Any:
    u = jax.random.uniform(key, shape, jnp.float64, minval=jnp.finfo(jnp.float64).tiny)
    return jnp.ceil(jnp.log(u) / jnp.log1p(-p))


def _log_normal_sampler(key: Any, shape: tuple, dtype: Any, mean: Any, std: Any) -> Any:
    return jnp.exp(jax.random.normal(key, shape, _sample_dtype(dtype)) * std + mean)


def _cauchy_sampler(key: Any, shape: tuple, dtype: Any, median: Any, sigma: Any) -> Any:
    return median + sigma * jax.random.cauchy(key, shape, _sample_dtype(dtype))


@functools.lru_cache(maxsize=1024)
def _sampler(fn: Any, shape: tuple[int, ...], dtype: Any, index: int) -> Any:
    def sample(seed: Any, offset: Any, *params: Any) -> Any:
        return fn(_key(seed, offset), shape, dtype, *params).astype(dtype)

    return _executor.jitted(sample, index, key=(fn.__qualname__, shape, dtype, index))


def _fill_random(self: torch.Tensor, generator: Any, fn: Any, *params: Any) -> torch.Tensor:
    seed, offset = _philox(generator, self)
    sampler = _sampler(fn, tuple(self.shape), _runtime.jax_dtype(self.dtype), self.device.index)
    _storage.write(self, sampler(seed, offset, *params))
    return self


def _check_float(op: str, t: torch.Tensor) -> None:
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        raise RuntimeError(f"{op} expects floating point dtypes, got {t.dtype}")


@direct("normal_", defer=True)
def normal_(self: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, generator: Any = None) -> torch.Tensor:
    _check_float("normal_", self)
    if std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {_num(std)}")
    return _fill_random(self, generator, _normal_sampler, float(mean), float(std))


_CPP_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
              torch.bfloat16: "c10::BFloat16"}


def _check_uniform_bounds(self: torch.Tensor, from_: float, to: float) -> None:
    """ATen's check_uniform_bounds: a float (or complex's component) dtype, bounds and width it can hold."""
    dtype = self.dtype.to_real() if self.dtype.is_complex else self.dtype
    if not dtype.is_floating_point:
        raise NotImplementedError(f"\"check_uniform_bounds\" not implemented for '{dtype_name(self.dtype)}'")
    info = torch.finfo(dtype)
    for name, v in (("from", from_), ("to", to)):
        if not info.min <= v <= info.max:
            raise RuntimeError(f"{name} is out of bounds for {_CPP_NAMES.get(dtype, dtype_name(dtype))}")
    if from_ > to:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={_num(from_)} > "
                           f"to={_num(to)}")
    if to - from_ > info.max:
        raise RuntimeError(f"uniform_ expects to-from <= std::numeric_limits<{dtype_name(dtype)}>::max(), but found "
                           f"to={_num(to)} and from={_num(from_)} which result in to-from to exceed the limit")


@direct("uniform_", defer=True)
def uniform_(self: torch.Tensor, from_: float = 0.0, to: float = 1.0, *, generator: Any = None) -> torch.Tensor:
    _check_uniform_bounds(self, from_, to)
    return _fill_random(self, generator, _uniform_sampler, float(from_), float(to))


def _random_bounds(dtype: torch.dtype) -> tuple[int, int]:
    """[0, n) of Tensor.random_() with no bounds, as PyTorch defines it per dtype."""
    if dtype == torch.bool:
        return 0, 2
    if dtype.is_floating_point:
        digits = {torch.float32: 24, torch.float64: 53, torch.float16: 11, torch.bfloat16: 8}.get(dtype, 24)
        return 0, 2**digits + 1
    return 0, torch.iinfo(dtype).max  # PyTorch's default excludes the maximum itself


@direct("random_", defer=True)
def random_(self: torch.Tensor, *, generator: Any = None) -> torch.Tensor:
    low, high = _random_bounds(self.dtype)
    return _fill_random(self, generator, _integers_sampler, low, high)


@direct("random_.to", defer=True)
def random_to(self: torch.Tensor, to: int, *, generator: Any = None) -> torch.Tensor:
    return random_from(self, 0, to, generator=generator)


@direct("random_.from", defer=True)
def random_from(self: torch.Tensor, from_: int, to: int | None = None, *, generator: Any = None) -> torch.Tensor:
    if to is None:
        to = _random_bounds(self.dtype)[1] if self.dtype.is_floating_point else torch.iinfo(self.dtype).max + 1
    if from_ >= to:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={from_} >= to={to}")
    return _fill_random(self, generator, _integers_sampler, int(from_), int(to))


@direct("bernoulli_.float", defer=True)
def bernoulli_float_(self: torch.Tensor, p: float = 0.5, *, generator: Any = None) -> torch.Tensor:
    if not 0 <= p <= 1:
        raise RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got p={_num(p)}")
    return _fill_random(self, generator, _bernoulli_sampler, float(p))


@direct("bernoulli_.Tensor")
def bernoulli_tensor_(self: torch.Tensor, p: torch.Tensor, *, generator: Any = None) -> torch.Tensor:
    probs = _storage.read(p.to(self.device).expand(self.shape)).astype(jnp.float64)
    return _fill_random(self, generator, _bernoulli_sampler, probs)


@direct("bernoulli")
def bernoulli(self: torch.Tensor, *, generator: Any = None) -> torch.Tensor:
    out = torch.empty_like(self)
    return bernoulli_tensor_(out, self, generator=generator)


@direct("bernoulli.p", defer=True)
def bernoulli_p(self: torch.Tensor, p: float, *, generator: Any = None) -> torch.Tensor:
    return bernoulli_float_(torch.empty_like(self), p, generator=generator)


@direct("exponential_", defer=True)
def exponential_(self: torch.Tensor, lambd: float = 1.0, *, generator: Any = None) -> torch.Tensor:
    _check_float("exponential_", self)
    if lambd <= 0:
        raise RuntimeError(f"exponential_ expects lambda > 0.0, but found lambda={_num(lambd)}")
    return _fill_random(self, generator, _exponential_sampler, float(lambd))


@direct("geometric_", defer=True)
def geometric_(self: torch.Tensor, p: float, *, generator: Any = None) -> torch.Tensor:
    if not 0 < p < 1:
        raise RuntimeError(f"geometric_ expects p to be in (0, 1), but got p={_num(p)}")
    return _fill_random(self, generator, _geometric_sampler, float(p))


@direct("log_normal_", defer=True)
def log_normal_(self: torch.Tensor, mean: float = 1.0, std: float = 2.0, *, generator: Any = None) -> torch.Tensor:
    _check_float("log_normal_", self)
    if std <= 0:
        raise RuntimeError(f"log_normal_ expects std > 0.0, but found std={_num(std)}")
    return _fill_random(self, generator, _log_normal_sampler, float(mean), float(std))


@direct("cauchy_", defer=True)
def cauchy_(self: torch.Tensor, median: float = 0.0, sigma: float = 1.0, *, generator: Any = None) -> torch.Tensor:
    _check_float("cauchy_", self)
    if not sigma > 0:
        raise RuntimeError(f"cauchy_ expects sigma > 0.0, but found sigma={_num(sigma)}")
    return _fill_random(self, generator, _cauchy_sampler, float(median), float(sigma))


def _normal_tensors(mean: Any, std: Any, generator: Any) -> torch.Tensor:
    ref = mean if isinstance(mean, torch.Tensor) else std
    shape = torch.broadcast_shapes(*(t.shape for t in (mean, std) if isinstance(t, torch.Tensor)))
    dtype = ref.dtype
    out = torch.empty(shape, dtype=dtype, device=ref.device)
    normal_(out, 0.0, 1.0, generator=generator)
    if isinstance(std, torch.Tensor) and bool((std < 0).any().item()):
        raise RuntimeError("normal expects all elements of std >= 0.0")
    return out.mul_(std).add_(mean)


@direct("normal.Tensor_float")
def normal_tensor_float(mean: torch.Tensor, std: float = 1.0, *, generator: Any = None) -> torch.Tensor:
    return _normal_tensors(mean, std, generator)


@direct("normal.float_Tensor")
def normal_float_tensor(mean: float, std: torch.Tensor, *, generator: Any = None) -> torch.Tensor:
    return _normal_tensors(mean, std, generator)


@direct("normal.Tensor_Tensor")
def normal_tensor_tensor(mean: torch.Tensor, std: torch.Tensor, *, generator: Any = None) -> torch.Tensor:
    return _normal_tensors(mean, std, generator)


@functools.lru_cache(maxsize=256)
def _permutation(n: int, index: int) -> Any:
    return jax.jit(lambda seed, offset: jax.random.permutation(_key(seed, offset), n), out_shardings=_on(index))


@direct("randperm.generator_out")
def randperm_out(n: int, *, generator: Any = None, out: torch.Tensor) -> torch.Tensor:
    if n < 0:
        raise RuntimeError(f"n must be non-negative, got{n}")
    if tuple(out.shape) != (n,):
        out.resize_((n,))
    seed, offset = _philox(generator, out)
    _storage.write(out, _permutation(n, out.device.index)(seed, offset).astype(_runtime.jax_dtype(out.dtype)))
    return out


@direct("randperm.out")
def randperm_out_default(n: int, *, out: torch.Tensor) -> torch.Tensor:
    return randperm_out(n, generator=None, out=out)


def _check_no_internal_overlap(out: torch.Tensor) -> None:
    """ATen's out= check for a written-to tensor whose elements share memory (an expanded tensor)."""
    if any(stride == 0 and size > 1 for size, stride in zip(out.shape, out.stride())):
        raise RuntimeError("unsupported operation: more than one element of the written-to tensor refers to a single "
                           "memory location. Please clone() the tensor before performing the operation.")


def _out_form(fn: Any) -> Any:
    """The out= overload of a direct functional kernel: compute, resize `out` like PyTorch, copy in."""

    def out_kernel(*args: Any, out: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        _check_no_internal_overlap(out)
        result = fn(*args, **kwargs)
        _maybe_resize_out(out, tuple(result.shape))
        return out.copy_(result)

    return out_kernel


direct("bernoulli.out")(_out_form(bernoulli))
direct("normal.Tensor_float_out")(_out_form(normal_tensor_float))
direct("normal.float_Tensor_out")(_out_form(normal_float_tensor))
direct("normal.Tensor_Tensor_out")(_out_form(normal_tensor_tensor))


# ---- ranges and eye ----

@functools.lru_cache(maxsize=1024)
def _linspace(n: int, dtype: Any, index: int, log: bool) -> Any:
    def linspace(start: Any, end: Any, base: Any) -> Any:
        # PyTorch computes the first half from `start` and the second half from `end` (symmetric rounding).
        step = (end - start) / max(n - 1, 1)
        i = jnp.arange(n, dtype=jnp.float64)
        half = n // 2
        vals = jnp.where(i < half, start + step * i, end - step * (n - 1 - i)) if n > 1 else jnp.full((n,), start)
        if log:
            vals = jnp.power(base, vals)
        if jnp.issubdtype(dtype, jnp.integer):
            vals = jnp.trunc(vals)
        return vals.astype(dtype)

    return jax.jit(linspace, out_shardings=_on(index))


def _scalar(v: Any) -> Any:
    return v.item() if isinstance(v, torch.Tensor) else v


def _linspace_out(start: Any, end: Any, steps: int, out: torch.Tensor, log: bool, base: float = 10.0) -> torch.Tensor:
    if steps < 0:
        raise RuntimeError("number of steps must be non-negative")
    if tuple(out.shape) != (steps,):
        out.resize_((steps,))
    dtype = _runtime.jax_dtype(out.dtype)
    start, end = _scalar(start), _scalar(end)
    if not log and not out.dtype.is_floating_point and not out.dtype.is_complex:
        # Integer linspace: PyTorch steps in integer arithmetic from start.
        step = (end - start) / max(steps - 1, 1)
        vals = torch.tensor([int(start + step * i) for i in range(steps)], dtype=out.dtype)
        return out.copy_(vals)
    _storage.write(out, _linspace(steps, dtype, out.device.index, log)(float(start), float(end), float(base)))
    return out


@direct("linspace.out")
def linspace_out(start: Any, end: Any, steps: int, *, out: torch.Tensor) -> torch.Tensor:
    return _linspace_out(start, end, steps, out, log=False)


@direct("logspace.out")
def logspace_out(start: Any, end: Any, steps: int, base: float = 10.0, *, out: torch.Tensor) -> torch.Tensor:
    return _linspace_out(start, end, steps, out, log=True, base=base)


@functools.lru_cache(maxsize=256)
def _eye(n: int, m: int, dtype: Any, index: int) -> Any:
    return jax.jit(lambda: jnp.eye(n, m, dtype=dtype), out_shardings=_on(index))


@direct("eye.m_out")
def eye_m_out(n: int, m: int, *, out: torch.Tensor) -> torch.Tensor:
    if n < 0:
        raise RuntimeError(f"n must be greater or equal to 0, got {n}")
    if m < 0:
        raise RuntimeError(f"m must be greater or equal to 0, got {m}")
    if tuple(out.shape) != (n, m):
        out.resize_((n, m))
    _storage.write(out, _eye(n, m, _runtime.jax_dtype(out.dtype), out.device.index)())
    return out


@direct("eye.out")
def eye_out(n: int, *, out: torch.Tensor) -> torch.Tensor:
    return eye_m_out(n, n, out=out)


@functools.lru_cache(maxsize=256)
def _multinomial(rows: int, cats: int, num_samples: int, replacement: bool, index: int) -> Any:
    def draw(seed: Any, offset: Any, probs: Any) -> Any:
        key = _key(seed, offset)
        logits = jnp.log(probs.astype(jnp.float64))
        if replacement:
            return jax.random.categorical(key, logits, axis=-1, shape=(num_samples, rows)).T
        # Without replacement: the top num_samples of logits + Gumbel noise (the Gumbel-top-k trick).
        noisy = logits + jax.random.gumbel(key, (rows, cats), jnp.float64)
        return jnp.argsort(-noisy, axis=-1, stable=True)[:, :num_samples]

    return jax.jit(draw, out_shardings=_on(index))


def _multinomial_checks(self: torch.Tensor, num_samples: int, replacement: bool, out_dtype: torch.dtype) -> None:
    """ATen's argument checks, in its order (the out= dtype among them)."""
    if self.dim() not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    if not self.dtype.is_floating_point:
        raise RuntimeError(f"multinomial only supports floating-point dtypes for input, got: {dtype_name(self.dtype)}")
    if out_dtype != torch.int64:
        raise RuntimeError(f"multinomial expects Long tensor out, got: {dtype_name(out_dtype)}")
    if num_samples <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and num_samples > self.shape[-1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    if self.shape[-1] > 2**24:
        raise RuntimeError("number of categories cannot exceed 2^24")


@direct("multinomial")
def multinomial(self: torch.Tensor, num_samples: int, replacement: bool = False, *,
                generator: Any = None) -> torch.Tensor:
    _multinomial_checks(self, num_samples, replacement, torch.int64)
    cats = self.shape[-1]
    probs = self.reshape(-1, cats)
    # Value checks PyTorch makes (one host round trip).
    if bool(((probs < 0) | ~torch.isfinite(probs)).any().item()):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if bool((probs.sum(-1) <= 0).any().item()):
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    seed, offset = _philox(generator, self)
    fn = _multinomial(probs.shape[0], cats, num_samples, replacement, self.device.index)
    out = wrap_arrays(fn(seed, offset, _storage.read(probs)).astype(jnp.int64), self.device.index)
    return out.reshape(num_samples) if self.dim() == 1 else out


_multinomial_into = _out_form(multinomial)


@direct("multinomial.out")
def multinomial_out(self: torch.Tensor, num_samples: int, replacement: bool = False, *, generator: Any = None,
                    out: torch.Tensor) -> torch.Tensor:
    _multinomial_checks(self, num_samples, replacement, out.dtype)
    return _multinomial_into(self, num_samples, replacement, generator=generator, out=out)


@direct("_efficientzerotensor", defer=True)
def _efficientzerotensor(size: Any, dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
                         pin_memory: Any = None) -> torch.Tensor:
    """The zeros autograd makes for a gradient it knows is zero (sgn's backward of a real input, undefined
    gradients of linalg backwards). CPU/CUDA return a ZeroTensor (a tensor without storage that ops skip); here
    it is an ordinary tensor of zeros: the same values, without that shortcut."""
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    dev = torch.device(device) if device is not None else torch.device("tpu")
    index = dev.index if dev.index is not None else torch.tpu.current_device()
    shape = tuple(int(s) for s in size)
    return wrap_arrays(_full(shape, _runtime.jax_dtype(dtype), index)(0), index)
