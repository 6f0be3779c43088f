"""Fused optimizer kernels: `_fused_adam_` / `_fused_adamw_` / `_fused_sgd_` (what `torch.optim.Adam(...,
fused=True)`, `AdamW(..., fused=True)` and `SGD(..., fused=True)` call), one program over all of a parameter
group's lists; and GradScaler's two kernels, `_amp_foreach_non_finite_check_and_unscale_` and `_amp_update_scale_`,
each one program too (their results stay on the device: GradScaler reads found_inf only where CUDA does).

The arithmetic follows ATen's CPU fused kernels (aten/src/ATen/native/cpu/FusedAdamKernel.cpp and
FusedSGDKernel.cpp, AmpKernels.cpp): for Adam, per parameter the bias corrections come from its own step count,
computed in float64 like the CPU kernel's doubles; each element is computed in its tensor's dtype (float32 for
float32 tensors, float32 for bfloat16/half as CPU's opmath); with `grad_scale` the gradients are unscaled and
written back unscaled; with `found_inf` equal to 1 nothing changes. The step counts are not incremented here (the
optimizer does it before the call).

Hyperparameters are dynamic values of the program: a learning-rate schedule does not recompile. There is no trace
lowering of the optimizers' functional forms (`_fused_adam`, `_fused_sgd`): PyTorch runs fused optimizers outside
compiled graphs (`torch.compiler.disable`), and functionalizing a direct call of `_fused_adam_` fails in PyTorch
2.13 itself ("mutating a non-functional tensor with a functional tensor").
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from torch_tpu import _executor, _storage
from torch_tpu._jax import jnp
from torch_tpu.kernels.registry import direct, lower


def _adam_update(adamw: bool, amsgrad: bool, maximize: bool, decay: bool, params: list, grads: list,
                 exp_avgs: list, exp_avg_sqs: list, max_exp_avg_sqs: list, steps: list, lr: Any, beta1: Any,
                 beta2: Any, weight_decay: Any, eps: Any, grad_scale: Any, found_inf: Any) -> tuple:
    """New (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs) of one fused Adam(W) step (pure function)."""
    lr64 = jnp.asarray(lr, jnp.float64).reshape(())
    beta1 = jnp.asarray(beta1, jnp.float64)
    beta2 = jnp.asarray(beta2, jnp.float64)
    new_p, new_g, new_m, new_v, new_vmax = [], [], [], [], []
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        dt = p.dtype
        op = jnp.float32 if dt in (jnp.bfloat16, jnp.float16) else dt  # CPU's opmath type
        step = jnp.asarray(steps[i], jnp.float64).reshape(())
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = jnp.sqrt(1 - beta2 ** step)
        step_size = (lr64 / bias_correction1).astype(op)
        c = lambda x: jnp.asarray(x).astype(op)  # noqa: E731
        grad = g.astype(op)
        if grad_scale is not None:
            grad = grad / grad_scale.reshape(()).astype(op)
            g_out = grad.astype(g.dtype)
        else:
            g_out = g
        if maximize:
            grad = -grad
        param = p.astype(op)
        if decay:
            if adamw:
                param = param - c(lr64 * weight_decay) * param
            else:
                grad = grad + param * c(weight_decay)
        exp_avg = m.astype(op)
        exp_avg = exp_avg + c(1 - beta1) * (grad - exp_avg)
        exp_avg_sq = v.astype(op) * c(beta2) + c(1 - beta2) * grad * grad
        if amsgrad:
            vmax = jnp.maximum(max_exp_avg_sqs[i].astype(op), exp_avg_sq)
            denom = jnp.sqrt(vmax) / c(bias_correction2_sqrt) + c(eps)
            new_vmax.append(vmax.astype(max_exp_avg_sqs[i].dtype))
        else:
            denom = jnp.sqrt(exp_avg_sq) / c(bias_correction2_sqrt) + c(eps)
        param = param - step_size * exp_avg / denom
        new_p.append(param.astype(dt))
        new_g.append(g_out)
        new_m.append(exp_avg.astype(m.dtype))
        new_v.append(exp_avg_sq.astype(v.dtype))
    outs = (new_p, new_g, new_m, new_v, new_vmax)
    if found_inf is not None:  # an inf/nan gradient was found (GradScaler): the step is skipped
        skip = found_inf.reshape(()) == 1
        olds = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [])
        outs = tuple([jnp.where(skip, o, n) for o, n in zip(old, new)] for old, new in zip(olds, outs))
    return outs


# ---- the eager in-place kernels ----

@functools.lru_cache(maxsize=256)
def _program(adamw: bool, amsgrad: bool, maximize: bool, decay: bool, scaled: bool, checked: bool) -> Any:
    def step(lists: tuple, hyper: tuple, grad_scale: Any, found_inf: Any) -> tuple:
        return _adam_update(adamw, amsgrad, maximize, decay, *lists, *hyper, grad_scale, found_inf)

    step.__qualname__ = f"fused_adam{'w' if adamw else ''}"
    return _executor.jitted(step, key=("fused_adam", adamw, amsgrad, maximize, decay, scaled, checked))


def _check(name: str, lists: dict[str, list], amsgrad: bool) -> int:
    params = lists["self"]
    n = len(params)
    for k, ts in lists.items():
        if k == "max_exp_avg_sqs" and not amsgrad:
            continue
        if len(ts) != n:
            raise RuntimeError(f"aten::{name}: Tensor lists must have the same number of tensors, got {n} params "
                               f"and {len(ts)} {k}")
    index = None
    for k, ts in lists.items():
        if k == "max_exp_avg_sqs" and not amsgrad:
            continue
        for i, t in enumerate(ts):
            if t.device.type != "tpu" or (index is not None and t.device.index != index):
                raise RuntimeError(f"aten::{name}: every tensor must be on one tpu device, but {k}[{i}] is on "
                                   f"{t.device} (params[0] on {params[0].device}); move them with .to()")
            index = t.device.index
            if k != "state_steps":
                if not t.dtype.is_floating_point:
                    raise RuntimeError(f"aten::{name}: {k}[{i}] has dtype {t.dtype}; fused optimizers need "
                                       "floating point tensors")
                if tuple(t.shape) != tuple(params[i].shape):
                    raise RuntimeError(f"aten::{name}: {k}[{i}] has shape {list(t.shape)} but params[{i}] has "
                                       f"{list(params[i].shape)}")
            elif t.numel() != 1:
                raise RuntimeError(f"aten::{name}: state_steps[{i}] must have one element, got shape "
                                   f"{list(t.shape)}")
    return index or 0


def _write_lists(outs: list[tuple[list, Any]]) -> None:
    """Writes a fused step's new arrays back into the tensors of each list, in place (pairs of tensors, arrays)."""
    for ts, vals in outs:
        for t, val in zip(ts, vals):
            _storage.write(t, val)


def _in_place(adamw: bool):
    name = f"_fused_adam{'w' if adamw else ''}_"

    def fused_adam_(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                    weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
        lists = {"self": list(self), "grads": list(grads), "exp_avgs": list(exp_avgs),
                 "exp_avg_sqs": list(exp_avg_sqs), "max_exp_avg_sqs": list(max_exp_avg_sqs),
                 "state_steps": list(state_steps)}
        if not lists["self"]:
            return None
        _check(name, lists, amsgrad)
        if isinstance(lr, torch.Tensor) and lr.device.type == "cpu" and lr.numel() == 1:
            lr = lr.item()  # a host learning rate is a number of the program
        for what, t in (("grad_scale", grad_scale), ("found_inf", found_inf),
                        ("lr", lr if isinstance(lr, torch.Tensor) else None)):
            if t is not None and (t.device.type != "tpu" or t.numel() != 1):
                raise RuntimeError(f"aten::{name}: {what} must be a one-element tpu tensor, got shape "
                                   f"{list(t.shape)} on {t.device}")
        read = _storage.read
        arrays = tuple([read(t) for t in ts] for k, ts in lists.items())
        lr_v = read(lr) if isinstance(lr, torch.Tensor) else float(lr)
        hyper = (lr_v, float(beta1), float(beta2), float(weight_decay), float(eps))
        prog = _program(adamw, bool(amsgrad), bool(maximize), weight_decay != 0, grad_scale is not None,
                        found_inf is not None)
        p, g, m, v, vmax = prog(arrays, hyper, None if grad_scale is None else read(grad_scale),
                                None if found_inf is None else read(found_inf))
        outs = [(lists["self"], p), (lists["exp_avgs"], m), (lists["exp_avg_sqs"], v)]
        if grad_scale is not None:
            outs.append((lists["grads"], g))
        if amsgrad:
            outs.append((lists["max_exp_avg_sqs"], vmax))
        _write_lists(outs)
        return None

    fused_adam_.__name__ = name
    return fused_adam_


direct("_fused_adam_", "_fused_adam_.tensor_lr", defer=True)(_in_place(False))
direct("_fused_adamw_", "_fused_adamw_.tensor_lr", defer=True)(_in_place(True))



# ---- SGD ----

def _sgd_update(momentum_on: bool, maximize: bool, decay: bool, nesterov: bool, first: bool, params: list,
                grads: list, bufs: list, lr: Any, weight_decay: Any, momentum: Any, dampening: Any, grad_scale: Any,
                found_inf: Any) -> tuple:
    """New (params, grads, momentum buffers) of one fused SGD step (pure function), in CPU's order of operations."""
    new_p, new_g, new_b = [], [], []
    for i, (p, g) in enumerate(zip(params, grads)):
        dt = p.dtype
        op = jnp.float32 if dt in (jnp.bfloat16, jnp.float16) else dt  # CPU's opmath type
        c = lambda x: jnp.asarray(x).reshape(()).astype(op)  # noqa: E731
        grad = g.astype(op)
        if grad_scale is not None:
            grad = grad / grad_scale.reshape(()).astype(op)
            new_g.append(grad.astype(g.dtype))
        else:
            new_g.append(g)
        if maximize:
            grad = -grad
        param = p.astype(op)
        if decay:
            grad = grad + param * c(weight_decay)
        if momentum_on:
            if first:
                buf = grad
            else:
                buf = bufs[i].astype(op) * c(momentum) + grad * (c(1.0) - c(dampening))
            new_b.append(buf.astype(bufs[i].dtype))
            grad = grad + buf * c(momentum) if nesterov else buf
        param = param - grad * c(lr)
        new_p.append(param.astype(dt))
    outs = (new_p, new_g, new_b)
    if found_inf is not None:  # GradScaler found an inf/nan gradient: the step is skipped
        skip = found_inf.reshape(()) == 1
        olds = (params, grads, bufs if momentum_on else [])
        outs = tuple([jnp.where(skip, o, n) for o, n in zip(old, new)] for old, new in zip(olds, outs))
    return outs


@functools.lru_cache(maxsize=256)
def _sgd_program(momentum_on: bool, maximize: bool, decay: bool, nesterov: bool, first: bool, scaled: bool,
                 checked: bool) -> Any:
    def step(lists: tuple, hyper: tuple, grad_scale: Any, found_inf: Any) -> tuple:
        return _sgd_update(momentum_on, maximize, decay, nesterov, first, *lists, *hyper, grad_scale, found_inf)

    step.__qualname__ = "fused_sgd"
    return _executor.jitted(step, key=("fused_sgd", momentum_on, maximize, decay, nesterov, first, scaled, checked))


def _one_element_tpu(name: str, what: str, t: Any, index: int) -> None:
    if t is not None and (t.device.type != "tpu" or t.device.index != index or t.numel() != 1):
        raise RuntimeError(f"aten::{name}: {what} must be a one-element tensor on tpu:{index} (the tensors' "
                           f"device), got shape {list(t.shape)} on {t.device}")


def _fused_sgd_(self, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening, nesterov, maximize,
                is_first_step, grad_scale=None, found_inf=None):
    name = "_fused_sgd_"
    momentum_on = momentum != 0
    lists = {"self": list(self), "grads": list(grads)}
    if momentum_on:
        lists["momentum_buffer_list"] = list(momentum_buffer_list)
    if not lists["self"]:
        return None
    index = _check(name, lists, False)
    if isinstance(lr, torch.Tensor) and lr.device.type == "cpu" and lr.numel() == 1:
        lr = lr.item()  # a host learning rate is a number of the program (CPU's kernel reads it the same way)
    for what, t in (("grad_scale", grad_scale), ("found_inf", found_inf),
                    ("lr", lr if isinstance(lr, torch.Tensor) else None)):
        _one_element_tpu(name, what, t, index)
    read = _storage.read
    arrays = (tuple(read(t) for t in lists["self"]), tuple(read(t) for t in lists["grads"]),
              tuple(read(t) for t in lists.get("momentum_buffer_list", ())))
    arrays = tuple(list(a) for a in arrays)
    lr_v = read(lr) if isinstance(lr, torch.Tensor) else float(lr)
    hyper = (lr_v, float(weight_decay), float(momentum), float(dampening))
    prog = _sgd_program(momentum_on, bool(maximize), weight_decay != 0, bool(nesterov), bool(is_first_step),
                        grad_scale is not None, found_inf is not None)
    p, g, b = prog(arrays, hyper, None if grad_scale is None else read(grad_scale),
                   None if found_inf is None else read(found_inf))
    outs = [(lists["self"], p)]
    if grad_scale is not None:
        outs.append((lists["grads"], g))
    if momentum_on:
        outs.append((lists["momentum_buffer_list"], b))
    _write_lists(outs)
    return None


direct("_fused_sgd_", "_fused_sgd_.tensor_lr", defer=True)(_fused_sgd_)


# ---- GradScaler (torch.amp.GradScaler("tpu")) ----

def _unscale(grads: list, found_inf: Any, inv_scale: Any) -> tuple:
    """(grads * inv_scale, found_inf set to 1.0 where any gradient has an inf or nan), as CPU's kernel: each
    value is multiplied in its opmath type (float32 for half/bfloat16) and cast back."""
    inv = inv_scale.reshape(())
    bad = jnp.zeros((), bool)
    out = []
    for g in grads:
        op = jnp.float32 if g.dtype in (jnp.bfloat16, jnp.float16) else g.dtype
        bad = bad | ~jnp.all(jnp.isfinite(g))
        out.append((g.astype(op) * inv.astype(op)).astype(g.dtype))
    return out, jnp.where(bad, jnp.ones_like(found_inf), found_inf)


_UNSCALE = _executor.jitted(_unscale, key="amp_unscale")


def _float_scalar(name: str, what: str, t: Any) -> None:
    if t.numel() != 1:
        raise RuntimeError(f"aten::{name}: {what} must be a 1-element tensor, got shape {list(t.shape)}")
    if t.dtype != torch.float32:
        raise RuntimeError(f"aten::{name}: {what} must be a float tensor (torch.float32), got {t.dtype}")


def _amp_foreach_non_finite_check_and_unscale_(self, found_inf, inv_scale):
    name = "_amp_foreach_non_finite_check_and_unscale_"
    grads = list(self)
    _float_scalar(name, "found_inf", found_inf)
    _float_scalar(name, "inv_scale", inv_scale)
    if not grads:
        return None
    index = found_inf.device.index
    for what, t in [("inv_scale", inv_scale)] + [(f"scaled_grads[{i}]", g) for i, g in enumerate(grads)]:
        if t.device.type != "tpu" or t.device.index != index:
            raise RuntimeError(f"aten::{name}: {what} is on {t.device} but found_inf is on {found_inf.device}; "
                               "every tensor must be on one tpu device")
    for i, g in enumerate(grads):
        if not g.dtype.is_floating_point:
            raise RuntimeError(f"aten::{name}: scaled_grads[{i}] has dtype {g.dtype}; gradients must be floating "
                               "point")
    read = _storage.read
    new_grads, new_found = _UNSCALE([read(g) for g in grads], read(found_inf), read(inv_scale))
    for g, v in zip(grads, new_grads):
        _storage.write(g, v)
    _storage.write(found_inf, new_found)
    return None


def _update_scale(scale: Any, tracker: Any, found_inf: Any, growth: Any, backoff: Any, interval: Any) -> tuple:
    """CPU's _amp_update_scale_: back off (and reset the tracker) after a step with an inf/nan, else count the
    step and grow the scale every `interval` successful steps (only if the grown scale is finite). The products
    are taken in float64 and rounded to float32, as CPU's float * double."""
    s = scale.reshape(())
    t = tracker.reshape(())
    found = found_inf.reshape(()) != 0
    backed = (s.astype(jnp.float64) * backoff).astype(s.dtype)
    grown = (s.astype(jnp.float64) * growth).astype(s.dtype)
    successful = t + 1
    at_interval = successful == jnp.asarray(interval, t.dtype)
    new_s = jnp.where(found, backed, jnp.where(at_interval & jnp.isfinite(grown), grown, s))
    new_t = jnp.where(found | at_interval, jnp.zeros_like(t), successful)
    return new_s.reshape(scale.shape), new_t.reshape(tracker.shape)


_UPDATE_SCALE = _executor.jitted(_update_scale, key="amp_update_scale")


def _amp_update_scale_(self, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor,
                       growth_interval):
    name = "_amp_update_scale_"
    _float_scalar(name, "current_scale", self)
    _float_scalar(name, "found_inf", found_inf)
    if growth_tracker.numel() != 1:
        raise RuntimeError(f"aten::{name}: growth_tracker must be a 1-element tensor, got shape "
                           f"{list(growth_tracker.shape)}")
    if growth_tracker.dtype != torch.int32:
        raise RuntimeError(f"aten::{name}: growth_tracker must be an int tensor (torch.int32), got "
                           f"{growth_tracker.dtype}")
    for what, t in (("growth_tracker", growth_tracker), ("found_inf", found_inf)):
        if t.device != self.device:
            raise RuntimeError(f"aten::{name}: {what} is on {t.device} but current_scale is on {self.device}; "
                               "every tensor must be on one tpu device")
    read = _storage.read
    s, t = _UPDATE_SCALE(read(self), read(growth_tracker), read(found_inf), float(scale_growth_factor),
                         float(scale_backoff_factor), int(growth_interval))
    _storage.write(self, s)
    _storage.write(growth_tracker, t)
    return self


direct("_amp_foreach_non_finite_check_and_unscale_", defer=True)(_amp_foreach_non_finite_check_and_unscale_)
direct("_amp_update_scale_", defer=True)(_amp_update_scale_)


# torch.compile graphs carry the functional forms (AOTAutograd functionalizes the in-place kernels above)

@lower("_amp_foreach_non_finite_check_and_unscale", trace_only=True, variants=False)
def amp_unscale_traced(self: list, found_inf: Any, inv_scale: Any) -> tuple:
    return _unscale(list(self), found_inf, inv_scale)


@lower("_amp_update_scale", trace_only=True, variants=False)
def amp_update_scale_traced(self: Any, growth_tracker: Any, found_inf: Any, scale_growth_factor: float,
                            scale_backoff_factor: float, growth_interval: int) -> tuple:
    return _update_scale(self, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor,
                         growth_interval)
