"""Losses and their backward ops."""

from __future__ import annotations

from typing import Any

from torch_tpu._checks import report_bad_index
from torch_tpu._jax import jnp
from torch_tpu.kernels.nn._common import _grad_scale, _opmath, _reduce
from torch_tpu.kernels.registry import DEFAULT, lower


# ---- losses ----


def _nll(self: Any, target: Any, weight: Any, ignore_index: int) -> tuple[Any, Any]:
    """Per-element (loss, weight) of the negative log likelihood; class dim 1 (0 for 1-D input)."""
    x = _opmath(self)
    if x.ndim == 1:
        x, target = x[None], target[None]
    valid = target != ignore_index
    t = jnp.where(valid, target, 0)
    picked = jnp.take_along_axis(x, t[:, None], axis=1)[:, 0]
    w = _opmath(weight)[t] if weight is not None else jnp.ones(t.shape, x.dtype)
    w = jnp.where(valid, w, 0).astype(x.dtype)
    return -picked * w, w


def _check_nll(self: Any, target: Any, weight: Any, spatial: bool) -> None:
    if spatial:
        if self.ndim != 4 or target.ndim != 3:
            raise RuntimeError(f"only batches of spatial targets supported (3D tensors) but got targets of "
                               f"dimension: {target.ndim}")
        return
    if self.ndim not in (1, 2):
        raise RuntimeError("input tensor should be 1D or 2D")
    if target.ndim > 1:
        raise RuntimeError("0D or 1D target tensor expected, multi-target not supported")
    if self.ndim == 2 and self.shape[0] != target.shape[0]:
        raise RuntimeError(f"Expected input batch_size ({self.shape[0]}) to match target batch_size "
                           f"({target.shape[0]}).")
    n_classes = self.shape[-1]
    if weight is not None and weight.size != n_classes:
        raise RuntimeError(f"weight tensor should be defined either for all {n_classes} classes or no classes "
                           f"but got weight tensor of shape: {list(weight.shape)}")


def _nll_forward(self: Any, target: Any, weight: Any, reduction: int, ignore_index: int) -> tuple[Any, Any]:
    report_bad_index("nll_loss", jnp.where(target != ignore_index, target, 0), self.shape[1 if self.ndim > 1 else 0],
                     message="{op}(): Target {value} is out of bounds.")
    loss, w = _nll(self, target, weight, ignore_index)
    if reduction == 0:
        return loss.reshape(target.shape).astype(self.dtype), jnp.zeros((), self.dtype)
    total = jnp.sum(w)
    out = jnp.sum(loss) if reduction == 2 else jnp.sum(loss) / total
    return out.astype(self.dtype), total.astype(self.dtype)


@lower("nll_loss_forward", checks=True)
def nll_loss_forward(self: Any, target: Any, weight: Any, reduction: int, ignore_index: int) -> tuple[Any, Any]:
    _check_nll(self, target, weight, spatial=False)
    return _nll_forward(self, target, weight, reduction, ignore_index)


@lower("nll_loss2d_forward", checks=True)
def nll_loss2d_forward(self: Any, target: Any, weight: Any, reduction: int, ignore_index: int) -> tuple[Any, Any]:
    _check_nll(self, target, weight, spatial=True)
    return _nll_forward(self, target, weight, reduction, ignore_index)


def _nll_backward(
    grad_output: Any, self: Any, target: Any, weight: Any, reduction: int, ignore_index: int, total_weight: Any,
) -> Any:
    x = self if self.ndim > 1 else self[None]
    tgt = target if self.ndim > 1 else target[None]
    _, w = _nll(x, tgt, weight, ignore_index)
    g = _opmath(grad_output)
    if reduction == 0:
        g = g.reshape(w.shape)
    elif reduction == 1:
        g = g / _opmath(total_weight)
    per = -w * g  # (N, *spatial)
    t = jnp.where(tgt != ignore_index, tgt, 0)
    classes = jnp.arange(x.shape[1]).reshape((1, -1) + (1,) * (x.ndim - 2))
    grad = jnp.where(t[:, None] == classes, per[:, None], 0)
    return grad.reshape(self.shape).astype(self.dtype)


@lower("nll_loss_backward", "nll_loss2d_backward")
def nll_loss_backward(
    grad_output: Any, self: Any, target: Any, weight: Any, reduction: int, ignore_index: int, total_weight: Any,
) -> Any:
    return _nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight)


@lower("mse_loss", promote=DEFAULT, promote_args=("self", "target"))
def mse_loss(self: Any, target: Any, reduction: int = 1) -> Any:
    return _reduce(jnp.square(_opmath(self) - _opmath(target)), reduction).astype(self.dtype)


@lower("mse_loss_backward")
def mse_loss_backward(grad_output: Any, self: Any, target: Any, reduction: int) -> Any:
    g = _grad_scale(_opmath(grad_output), reduction, self.size)
    return (2 * (_opmath(self) - _opmath(target)) * g).astype(self.dtype)


@lower("smooth_l1_loss", promote=DEFAULT, promote_args=("self", "target"))
def smooth_l1_loss(self: Any, target: Any, reduction: int = 1, beta: float = 1.0) -> Any:
    if beta < 0:
        raise RuntimeError("smooth_l1_loss does not support negative values for beta.")
    d = jnp.abs(_opmath(self) - _opmath(target))
    loss = d if beta == 0 else jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)
    return _reduce(loss, reduction).astype(self.dtype)


@lower("smooth_l1_loss_backward")
def smooth_l1_loss_backward(grad_output: Any, self: Any, target: Any, reduction: int, beta: float) -> Any:
    x = _opmath(self) - _opmath(target)
    g = _grad_scale(_opmath(grad_output), reduction, self.size)
    d = jnp.sign(x) if beta == 0 else jnp.where(x < -beta, -1.0, jnp.where(x > beta, 1.0, x / beta))
    return (d * g).astype(self.dtype)


@lower("huber_loss", promote=DEFAULT, promote_args=("self", "target"))
def huber_loss(self: Any, target: Any, reduction: int = 1, delta: float = 1.0) -> Any:
    if delta <= 0:
        raise RuntimeError("huber_loss does not support non-positive values for delta.")
    d = jnp.abs(_opmath(self) - _opmath(target))
    loss = jnp.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta))
    return _reduce(loss, reduction).astype(self.dtype)


@lower("huber_loss_backward")
def huber_loss_backward(grad_output: Any, self: Any, target: Any, reduction: int, delta: float) -> Any:
    x = _opmath(self) - _opmath(target)
    g = _grad_scale(_opmath(grad_output), reduction, self.size)
    return (jnp.clip(x, -delta, delta) * g).astype(self.dtype)


@lower("binary_cross_entropy")
def binary_cross_entropy(self: Any, target: Any, weight: Any = None, reduction: int = 1) -> Any:
    x, y = _opmath(self), _opmath(target)
    loss = (y - 1) * jnp.maximum(jnp.log1p(-x), -100) - y * jnp.maximum(jnp.log(x), -100)
    if weight is not None:
        loss = loss * _opmath(weight)
    return _reduce(loss, reduction).astype(self.dtype)


@lower("binary_cross_entropy_backward")
def binary_cross_entropy_backward(
    grad_output: Any, self: Any, target: Any, weight: Any = None, reduction: int = 1,
) -> Any:
    x, y = _opmath(self), _opmath(target)
    g = _grad_scale(_opmath(grad_output), reduction, self.size)
    grad = g * (x - y) / jnp.maximum((1 - x) * x, 1e-12)
    if weight is not None:
        grad = grad * _opmath(weight)
    return grad.astype(self.dtype)


@lower("binary_cross_entropy_with_logits")
def binary_cross_entropy_with_logits(
    self: Any, target: Any, weight: Any = None, pos_weight: Any = None, reduction: int = 1,
) -> Any:
    x, y = _opmath(self), _opmath(target)
    log_sigmoid = jnp.minimum(x, 0) - jnp.log1p(jnp.exp(-jnp.abs(x)))
    if pos_weight is not None:
        loss = (1 - y) * x - ((_opmath(pos_weight) - 1) * y + 1) * log_sigmoid
    else:
        loss = (1 - y) * x - log_sigmoid
    if weight is not None:
        loss = loss * _opmath(weight)
    return _reduce(loss, reduction).astype(self.dtype)


def _multi_margin_terms(self: Any, target: Any, p: Any, margin: Any, weight: Any) -> tuple[Any, Any, Any, Any]:
    """(x, hinge margins z = margin - x[y] + x[j] masked to j != y and z > 0, sample weights, one-hot of y)."""
    x = _opmath(self)
    if x.ndim <= 1:
        x, target = x.reshape(1, -1), target.reshape(1)
    onehot = target[:, None] == jnp.arange(x.shape[1])[None, :]
    picked = jnp.take_along_axis(x, target[:, None], axis=1)
    z = margin - picked + x
    z = jnp.where(onehot | (z <= 0), 0, z)
    w = _opmath(weight)[target][:, None] if weight is not None else jnp.ones((x.shape[0], 1), x.dtype)
    return x, z, w, onehot


@lower("multi_margin_loss", checks=True)
def multi_margin_loss(self: Any, target: Any, p: Any = 1, margin: Any = 1, weight: Any = None,
                      reduction: int = 1) -> Any:
    report_bad_index("multi_margin_loss", target, self.shape[-1] if self.ndim else 1, error=RuntimeError,
                     message="{op}(): target out of range: target {value} with {size} classes")
    x, z, w, _ = _multi_margin_terms(self, target, p, margin, weight)
    per = jnp.sum(jnp.where(p == 1, z, z * z) * w, axis=1) / x.shape[1]
    if reduction == 0 and self.ndim <= 1:
        per = per.reshape(())
    return _reduce(per, reduction).astype(self.dtype)


@lower("multi_margin_loss_backward")
def multi_margin_loss_backward(grad_output: Any, self: Any, target: Any, p: Any, margin: Any, weight: Any = None,
                               reduction: int = 1) -> Any:
    x, z, w, onehot = _multi_margin_terms(self, target, p, margin, weight)
    g = _opmath(grad_output)
    g = g.reshape(-1, 1) if reduction == 0 else (g / x.shape[0] if reduction == 1 else g)
    d = jnp.where(z > 0, jnp.where(p == 1, 1.0, 2 * z), 0) * w / x.shape[1]
    grad = d - onehot * jnp.sum(d, axis=1, keepdims=True)
    return (grad * g).reshape(self.shape).astype(self.dtype)
