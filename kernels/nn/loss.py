"""Losses and their backward ops."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import numpy as np

from torch_tpu import _runtime
from torch_tpu._checks import report_bad_index
from torch_tpu._jax import jax, jnp, lax
from torch_tpu.kernels._promote import dtype_name
from torch_tpu.kernels.nn._common import _grad_scale, _is_float, _opmath, _reduce
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


def _check_margin_loss(kernel: str, self: Any, target: Any, weight: Any = None, multilabel: bool = False) -> None:
    """ATen's multi_margin_loss_shape_check / multilabel_margin_loss_shape_check (LossMulti.h), then the dtype checks
    of its CPU kernel `kernel` (skipped, as there, for an empty input)."""
    shape, tshape = list(self.shape), list(target.shape)
    if not ((self.ndim == 2 and shape[1] != 0) or (self.ndim == 1 and shape[0] != 0) or self.ndim == 0):
        raise RuntimeError(f"Expected non-empty vector or matrix with optional 0-dim batch size, but got: {shape}")
    nframe, dim = (shape[0], shape[1]) if self.ndim == 2 else (1, shape[0] if self.ndim else 1)
    if multilabel:
        if not (target.ndim <= 1 and target.size == dim if self.ndim <= 1 else tshape == shape):
            raise RuntimeError(f"inconsistent target size: {tshape} for input of size: {shape}")
    else:
        if target.ndim > 1 or target.size != nframe:
            raise RuntimeError("multi_margin_loss: target tensor should be 1-D with size equal to the number of input "
                               f"samples (batch size). Expected target size [{nframe}], but got {tshape}. Input has "
                               f"shape {shape}.")
        if weight is not None and (weight.ndim > 1 or weight.size != dim):
            raise RuntimeError(f"inconsistent weight size, expected {dim} but got {list(weight.shape)}")
    if self.size == 0:
        return

    def name(x: Any) -> str:
        return dtype_name(_runtime.torch_dtype(x.dtype))

    if not _is_float(self) or jnp.issubdtype(self.dtype, jnp.complexfloating):
        raise NotImplementedError(f"\"{kernel}\" not implemented for '{name(self)}'")
    if target.dtype != jnp.int64:
        raise RuntimeError(f"expected scalar type Long but found {name(target)}")
    if weight is not None and weight.dtype != self.dtype:
        raise RuntimeError(f"expected scalar type {name(self)} but found {name(weight)}")


def _multi_margin_terms(self: Any, target: Any, p: Any, margin: Any, weight: Any) -> tuple[Any, Any, Any, Any]:
    """(x, hinge margins z = margin - x[y] + x[j] masked to j != y and z > 0, sample weights, one-hot of y)."""
    x = _opmath(self)
    x, target = x.reshape(-1, x.shape[-1] if x.ndim else 1), target.reshape(-1).astype(jnp.int64)
    onehot = target[:, None] == jnp.arange(x.shape[1])[None, :]
    picked = jnp.take_along_axis(x, target[:, None], axis=1)
    z = margin - picked + x
    z = jnp.where(onehot | (z <= 0), 0, z)
    w = _opmath(weight)[target][:, None] if weight is not None else jnp.ones((x.shape[0], 1), x.dtype)
    return x, z, w, onehot


@lower("multi_margin_loss", checks=True)
def multi_margin_loss(self: Any, target: Any, p: Any = 1, margin: Any = 1, weight: Any = None,
                      reduction: int = 1) -> Any:
    _check_margin_loss("multi_margin_loss_cpu_kernel", self, target, weight)
    report_bad_index("multi_margin_loss", target, self.shape[-1] if self.ndim else 1, error=RuntimeError,
                     message="{op}(): target out of range: target {value} with {size} classes")
    x, z, w, _ = _multi_margin_terms(self, target, p, margin, weight)
    per = jnp.sum(jnp.where(p == 1, z, z * z) * w, axis=1) / x.shape[1]
    if reduction == 0 and target.ndim == 0:  # ATen: a 0-dim target gives a 0-dim result
        per = per.reshape(())
    return _reduce(per, reduction).astype(self.dtype)


@lower("multi_margin_loss_backward")
def multi_margin_loss_backward(grad_output: Any, self: Any, target: Any, p: Any, margin: Any, weight: Any = None,
                               reduction: int = 1) -> Any:
    _check_margin_loss("multi_margin_loss_backward_cpu_kernel", self, target, weight)
    x, z, w, onehot = _multi_margin_terms(self, target, p, margin, weight)
    g = _opmath(grad_output)
    g = g.reshape(-1, 1) if reduction == 0 else (g / x.shape[0] if reduction == 1 else g)
    d = jnp.where(z > 0, jnp.where(p == 1, 1.0, 2 * z), 0) * w / x.shape[1]
    grad = d - onehot * jnp.sum(d, axis=1, keepdims=True)
    return (grad * g).reshape(self.shape).astype(self.dtype)


# ---- CTC loss ----
# The forward (alpha) and backward (beta) recursions of Graves et al. in log space, one lax.scan over time each,
# batched over the samples. Lengths are static (int[]); the .Tensor overloads read them on the host first, as
# ATen's CPU kernel does, since they decide log_alpha's shape.


def _lse(*xs: Any) -> Any:
    """log(sum(exp(x))) of same-shaped arrays, -inf (not nan) when every term is -inf."""
    m = functools.reduce(jnp.maximum, xs)
    safe = jnp.where(jnp.isneginf(m), 0, m)
    return safe + jnp.log(sum(jnp.exp(x - safe) for x in xs))


def _ctc_setup(log_probs: Any, targets: Any, input_lengths: Sequence[int], target_lengths: Sequence[int],
               blank: int) -> tuple[Any, ...]:
    """(log-probs of the extended labels (T, N, L), extended labels (N, L), skip-allowed mask (N, L),
    s valid (N, L)), L = 2 * max target length + 1."""
    if log_probs.ndim != 3:
        raise RuntimeError(f"ctc_loss: expected log_probs to be a 3-D (T, N, C) tensor, got {log_probs.ndim}-D")
    t_max, n, c = log_probs.shape
    if len(input_lengths) != n:
        raise RuntimeError(f"input_lengths must be of size batch_size, but got {len(input_lengths)} for batch "
                           f"size {n}")
    if len(target_lengths) != n:
        raise RuntimeError(f"target_lengths must be of size batch_size, but got {len(target_lengths)} for batch "
                           f"size {n}")
    if not 0 <= blank < c:
        raise RuntimeError("blank must be in label range")
    for i, il in enumerate(input_lengths):
        if not 0 <= il <= t_max:
            raise RuntimeError(f"Expected input_lengths to have value at most {t_max}, but got value {il} (while "
                               f"checking arguments for ctc_loss_cpu)")
    max_s = max(target_lengths, default=0)
    tl = np.asarray(target_lengths, np.int64)
    if targets.ndim == 1:
        starts = np.concatenate([[0], np.cumsum(tl)[:-1]]).astype(np.int64)
        if tl.sum() > targets.shape[0]:
            raise RuntimeError(f"Expected tensor to have size at least {tl.sum()} at dimension 0, but got size "
                               f"{targets.shape[0]} for argument #2 'targets' (while checking arguments for "
                               "ctc_loss_cpu)")
        pos = starts[:, None] + np.minimum(np.arange(max_s)[None, :], np.maximum(tl[:, None] - 1, 0))
        tgt = targets[np.clip(pos, 0, max(targets.shape[0] - 1, 0))] if targets.shape[0] else \
            jnp.zeros((n, max_s), targets.dtype)
    else:
        if max_s > targets.shape[1]:
            raise RuntimeError(f"Expected tensor to have size at least {max_s} at dimension 1, but got size "
                               f"{targets.shape[1]} for argument #2 'targets' (while checking arguments for "
                               "ctc_loss_cpu)")
        tgt = targets[:, :max_s]
    tgt = tgt.astype(jnp.int32).reshape(n, max_s)
    length = 2 * max_s + 1
    s = np.arange(length)
    labels = jnp.full((n, length), blank, jnp.int32)
    if max_s:
        labels = labels.at[:, 1::2].set(tgt)
    prev2 = jnp.concatenate([jnp.full((n, 2), -1, jnp.int32), labels[:, :-2]], axis=1)
    skip = jnp.asarray(s % 2 == 1)[None, :] & jnp.asarray(s >= 2)[None, :] & (labels != prev2)
    valid = jnp.asarray(s[None, :] < 2 * tl[:, None] + 1)
    lp = _opmath(log_probs)
    lp_ext = jnp.take_along_axis(lp, jnp.broadcast_to(labels[None], (t_max, n, length)), axis=2)
    return lp, lp_ext, labels, skip, valid


def _ctc_alpha(lp_ext: Any, skip: Any, valid: Any, input_lengths: Sequence[int]) -> Any:
    """log_alpha (T, N, L); rows at t >= input length repeat the last one."""
    neg = jnp.full(lp_ext.shape[1:], -jnp.inf, lp_ext.dtype)
    s = jnp.arange(lp_ext.shape[2])
    alpha0 = jnp.where((s < 2)[None, :] & valid, lp_ext[0], -jnp.inf) if lp_ext.shape[0] else neg
    il = jnp.asarray(np.asarray(input_lengths, np.int64))

    def step(alpha: Any, inp: tuple[Any, Any]) -> tuple[Any, Any]:
        t, lpt = inp
        a1 = jnp.concatenate([neg[:, :1], alpha[:, :-1]], axis=1)
        a2 = jnp.where(skip, jnp.concatenate([neg[:, :2], alpha[:, :-2]], axis=1), -jnp.inf)
        new = jnp.where(valid, lpt + _lse(alpha, a1, a2), -jnp.inf)
        new = jnp.where((t < il)[:, None], new, alpha)
        return new, new

    if lp_ext.shape[0] <= 1:
        return alpha0[None][: lp_ext.shape[0]]
    ts = jnp.arange(1, lp_ext.shape[0])
    _, rest = lax.scan(step, alpha0, (ts, lp_ext[1:]))
    return jnp.concatenate([alpha0[None], rest], axis=0)


def _ctc_nll(alpha_last: Any, target_lengths: Sequence[int]) -> Any:
    tl = jnp.asarray(np.asarray(target_lengths, np.int64))
    end = jnp.take_along_axis(alpha_last, (2 * tl)[:, None], axis=1)[:, 0]
    before = jnp.take_along_axis(alpha_last, jnp.maximum(2 * tl - 1, 0)[:, None], axis=1)[:, 0]
    return -_lse(end, jnp.where(tl > 0, before, -jnp.inf))


def _ctc_forward(log_probs: Any, targets: Any, input_lengths: Sequence[int], target_lengths: Sequence[int],
                 blank: int) -> tuple[Any, Any]:
    _, lp_ext, _, skip, valid = _ctc_setup(log_probs, targets, input_lengths, target_lengths, blank)
    alpha = _ctc_alpha(lp_ext, skip, valid, input_lengths)
    nll = _ctc_nll(alpha[-1], target_lengths) if alpha.shape[0] else jnp.full((lp_ext.shape[1],), jnp.inf)
    return nll.astype(log_probs.dtype), jnp.transpose(alpha, (1, 0, 2)).astype(log_probs.dtype)


def _ctc_backward(grad: Any, log_probs: Any, targets: Any, input_lengths: Sequence[int],
                  target_lengths: Sequence[int], neg_log_likelihood: Any, log_alpha: Any, blank: int,
                  zero_infinity: bool) -> Any:
    """ATen's gradient: exp(lp) - exp(log(sum over s labelled c of alpha beta) + nll - lp) per (t, n, c), times
    grad; 0 for t >= input length (it is the gradient of the logits under log_softmax, as on CPU and CUDA)."""
    lp, lp_ext, labels, skip, valid = _ctc_setup(log_probs, targets, input_lengths, target_lengths, blank)
    t_max, n, length = lp_ext.shape
    il = jnp.asarray(np.asarray(input_lengths, np.int64))
    tl = jnp.asarray(np.asarray(target_lengths, np.int64))
    s = jnp.arange(length)
    init = jnp.where(((s[None, :] == 2 * tl[:, None]) | ((s[None, :] == 2 * tl[:, None] - 1) & (tl[:, None] > 0)))
                     & valid, 0.0, -jnp.inf)
    neg = jnp.full((n, length), -jnp.inf, lp_ext.dtype)
    skip_next = jnp.concatenate([skip[:, 2:], jnp.zeros((n, 2), bool)], axis=1)  # s -> s + 2 allowed

    def step(beta: Any, inp: tuple[Any, Any]) -> tuple[Any, Any]:
        t, lpt = inp
        b1 = jnp.concatenate([beta[:, 1:], neg[:, :1]], axis=1)
        b2 = jnp.where(skip_next, jnp.concatenate([beta[:, 2:], neg[:, :2]], axis=1), -jnp.inf)
        rec = jnp.where(valid, lpt + _lse(beta, b1, b2), -jnp.inf)
        new = jnp.where((t == il - 1)[:, None], lpt + init, jnp.where((t < il - 1)[:, None], rec, -jnp.inf))
        return new, new

    _, beta = lax.scan(step, neg, (jnp.arange(t_max), lp_ext), reverse=True)
    alpha = jnp.transpose(_opmath(log_alpha), (1, 0, 2))
    nll = _opmath(neg_log_likelihood)
    occupancy = jnp.exp(alpha + beta + nll[None, :, None] - lp_ext)  # (T, N, L)
    occupancy = jnp.where(valid[None], occupancy, 0)
    tt, nn = np.meshgrid(np.arange(t_max), np.arange(n), indexing="ij")
    per_class = jnp.zeros(lp.shape, lp.dtype).at[tt[..., None], nn[..., None], labels[None]].add(occupancy)
    g = (jnp.exp(lp) - per_class) * _opmath(grad)[None, :, None]
    live = jnp.arange(t_max)[:, None] < il[None, :]
    if zero_infinity:
        live = live & ~jnp.isinf(nll)[None, :]
    return jnp.where(live[..., None], g, 0).astype(log_probs.dtype)


@lower("_ctc_loss")
def ctc_loss(log_probs: Any, targets: Any, input_lengths: Sequence[int], target_lengths: Sequence[int],
             blank: int = 0, zero_infinity: bool = False) -> tuple[Any, Any]:
    """(negative log likelihood (N,), log_alpha (N, T, 2 max(target_lengths) + 1)); zero_infinity is applied
    by ATen's composite ctc_loss around this op."""
    return _ctc_forward(log_probs, targets, tuple(input_lengths), tuple(target_lengths), blank)


@lower("_ctc_loss_backward")
def ctc_loss_backward(grad: Any, log_probs: Any, targets: Any, input_lengths: Sequence[int],
                      target_lengths: Sequence[int], neg_log_likelihood: Any, log_alpha: Any, blank: int,
                      zero_infinity: bool = False) -> Any:
    return _ctc_backward(grad, log_probs, targets, tuple(input_lengths), tuple(target_lengths), neg_log_likelihood,
                         log_alpha, blank, zero_infinity)


def _host_lengths(name: str, lengths: Any) -> tuple[int, ...]:
    """Length tensors read on the host (a sync: they decide log_alpha's shape, as in ATen's CPU kernel)."""
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise RuntimeError(f"{name} must be integral")
    return tuple(int(v) for v in np.asarray(lengths).reshape(-1))


@functools.lru_cache(maxsize=64)
def _ctc_jit(kind: str, input_lengths: tuple[int, ...], target_lengths: tuple[int, ...], blank: int,
             zero_infinity: bool) -> Callable[..., Any]:
    if kind == "forward":
        return jax.jit(lambda lp, tg: _ctc_forward(lp, tg, input_lengths, target_lengths, blank))
    return jax.jit(lambda g, lp, tg, nll, la: _ctc_backward(g, lp, tg, input_lengths, target_lengths, nll, la, blank,
                                                            zero_infinity))


@lower("_ctc_loss.Tensor", jit=False)
def ctc_loss_tensor(log_probs: Any, targets: Any, input_lengths: Any, target_lengths: Any, blank: int = 0,
                    zero_infinity: bool = False) -> tuple[Any, Any]:
    il = _host_lengths("input_lengths", input_lengths)
    tl = _host_lengths("target_lengths", target_lengths)
    return _ctc_jit("forward", il, tl, blank, False)(log_probs, targets)


@lower("_ctc_loss_backward.Tensor", jit=False)
def ctc_loss_backward_tensor(grad: Any, log_probs: Any, targets: Any, input_lengths: Any, target_lengths: Any,
                             neg_log_likelihood: Any, log_alpha: Any, blank: int,
                             zero_infinity: bool = False) -> Any:
    il = _host_lengths("input_lengths", input_lengths)
    tl = _host_lengths("target_lengths", target_lengths)
    return _ctc_jit("backward", il, tl, blank, zero_infinity)(grad, log_probs, targets, neg_log_likelihood,
                                                              log_alpha)


# ---- multilabel margin loss ----


def _multilabel_terms(self: Any, target: Any) -> tuple[Any, Any, Any, Any]:
    """(x (N, C), hinge terms (N, K, C) masked to valid targets k and non-target classes, is_target (N, C), N)."""
    x = _opmath(self).reshape(-1, self.shape[-1] if self.ndim else 1)
    t = target.reshape(x.shape).astype(jnp.int32)
    valid = jnp.cumprod((t != -1).astype(jnp.int32), axis=1).astype(bool)  # targets end at the first -1
    ts = jnp.where(valid, t, 0)
    classes = jnp.arange(x.shape[1])
    is_target = jnp.any(valid[:, :, None] & (ts[:, :, None] == classes[None, None, :]), axis=1)
    picked = jnp.take_along_axis(x, ts, axis=1)  # (N, K)
    z = 1 - picked[:, :, None] + x[:, None, :]
    z = jnp.where(valid[:, :, None] & ~is_target[:, None, :] & (z > 0), z, 0)
    return x, z, is_target, ts


@lower("multilabel_margin_loss_forward", checks=True)
def multilabel_margin_loss_forward(self: Any, target: Any, reduction: int) -> tuple[Any, Any]:
    """(loss, is_target): per sample, the hinge 1 - (x[y] - x[i]) over its targets y (up to the first -1) and
    the classes i that are not targets, divided by the number of classes."""
    _check_margin_loss("multilabel_margin_loss_forward_out_frame", self, target, multilabel=True)
    n_classes = self.shape[-1] if self.ndim else 1
    live = jnp.cumprod((target.reshape(-1, n_classes) != -1).astype(jnp.int32), axis=1).astype(bool)
    report_bad_index("multilabel_margin_loss", jnp.where(live, target.reshape(live.shape), 0), n_classes,
                     error=RuntimeError, message="{op}: target index out of bounds: {value} with {size} classes")
    x, z, is_target, _ = _multilabel_terms(self, target)
    per = jnp.sum(z, axis=(1, 2)) / x.shape[1]
    if reduction == 0 and self.ndim <= 1:
        per = per.reshape(())
    return _reduce(per, reduction).astype(self.dtype), is_target.reshape(target.shape).astype(self.dtype)


@lower("multilabel_margin_loss_backward")
def multilabel_margin_loss_backward(grad_output: Any, self: Any, target: Any, reduction: int,
                                    is_target: Any) -> Any:
    _check_margin_loss("multilabel_margin_loss_backward_out_frame", self, target, multilabel=True)
    x, z, _, ts = _multilabel_terms(self, target)
    active = (z > 0).astype(x.dtype) / x.shape[1]  # (N, K, C)
    grad = jnp.sum(active, axis=1)  # + for the non-target class i
    down = jnp.sum(active, axis=2)  # - for the target y_k
    grad = grad - jnp.zeros_like(x).at[jnp.arange(x.shape[0])[:, None], ts].add(down)
    g = _opmath(grad_output)
    g = g.reshape(-1, 1) if reduction == 0 else (g / x.shape[0] if reduction == 1 else g)
    return (grad * g).reshape(self.shape).astype(self.dtype)
