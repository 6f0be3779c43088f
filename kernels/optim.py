"""Fused optimizer kernels: `_fused_adam_` / `_fused_adamw_` (what `torch.optim.Adam(..., fused=True)` and
`AdamW(..., fused=True)` call), one program over all of a parameter group's lists.

The arithmetic follows ATen's CPU fused kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp): per parameter the
bias corrections come from its own step count, computed in float64 like the CPU kernel's doubles; each element
is computed in its tensor's dtype (float32 for float32 tensors, float32 for bfloat16/half as CPU's opmath); with
`grad_scale` the gradients are unscaled and written back unscaled; with `found_inf` equal to 1 nothing changes.
The step counts are not incremented here (the optimizer does it before the call).

Hyperparameters are dynamic values of the program: a learning-rate schedule does not recompile. There is no trace
lowering of the functional form (`_fused_adam`): PyTorch runs fused optimizers outside compiled graphs
(`torch.compiler.disable`), and functionalizing a direct call of `_fused_adam_` fails in PyTorch 2.13 itself
("mutating a non-functional tensor with a functional tensor").
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from torch_tpu import _executor, _storage
from torch_tpu._jax import jnp
from torch_tpu.kernels.registry import direct


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
                    raise RuntimeError(f"aten::{name}: {k}[{i}] has dtype {t.dtype}; fused Adam needs floating "
                                       "point tensors")
                if tuple(t.shape) != tuple(params[i].shape):
                    raise RuntimeError(f"aten::{name}: {k}[{i}] has shape {list(t.shape)} but params[{i}] has "
                                       f"{list(params[i].shape)}")
            elif t.numel() != 1:
                raise RuntimeError(f"aten::{name}: state_steps[{i}] must have one element, got shape "
                                   f"{list(t.shape)}")
    return index or 0


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
        write = _storage.write
        outs = [(lists["self"], p), (lists["exp_avgs"], m), (lists["exp_avg_sqs"], v)]
        if grad_scale is not None:
            outs.append((lists["grads"], g))
        if amsgrad:
            outs.append((lists["max_exp_avg_sqs"], vmax))
        for ts, vals in outs:
            for t, val in zip(ts, vals):
                write(t, val)
        return None

    fused_adam_.__name__ = name
    return fused_adam_


direct("_fused_adam_", "_fused_adam_.tensor_lr", defer=True)(_in_place(False))
direct("_fused_adamw_", "_fused_adamw_.tensor_lr", defer=True)(_in_place(True))

