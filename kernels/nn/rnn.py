"""The fused recurrent cells that nn.LSTM / nn.GRU call on an accelerator, and their backward ops."""

from __future__ import annotations

from typing import Any

from torch_tpu._jax import jax, jnp
from torch_tpu.kernels.registry import lower


# ---- fused recurrent cells (what nn.LSTM / nn.GRU call on an accelerator) ----


def _gate_sum(input_gates: Any, hidden_gates: Any, input_bias: Any, hidden_bias: Any) -> Any:
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
    if hidden_bias is not None:
        gates = gates + hidden_bias
    return gates


@lower("_thnn_fused_lstm_cell")
def thnn_fused_lstm_cell(input_gates: Any, hidden_gates: Any, cx: Any, input_bias: Any = None,
                         hidden_bias: Any = None) -> tuple[Any, Any, Any]:
    """One LSTM step: gates (input, forget, cell, output) -> (hy, cy, workspace of activated gates)."""
    gates = _gate_sum(input_gates, hidden_gates, input_bias, hidden_bias)
    i, f, g, o = jnp.split(gates, 4, axis=1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * cx + i * g
    hy = o * jnp.tanh(cy)
    return hy, cy, jnp.concatenate([i, f, g, o], axis=1)


@lower("_thnn_fused_lstm_cell_backward_impl")
def thnn_fused_lstm_cell_backward_impl(grad_hy: Any, grad_cy: Any, cx: Any, cy: Any, workspace: Any,
                                       has_bias: bool) -> tuple[Any, Any, Any]:
    """Gradients of one fused LSTM step w.r.t. the summed gates, cx and the bias."""
    i, f, g, o = jnp.split(workspace, 4, axis=1)
    tanh_cy = jnp.tanh(cy)
    ghy = jnp.zeros_like(cy) if grad_hy is None else grad_hy
    gcy = jnp.zeros_like(cy) if grad_cy is None else grad_cy
    gcx = ghy * o * (1 - tanh_cy * tanh_cy) + gcy
    grad_gates = jnp.concatenate([
        gcx * g * i * (1 - i),          # input gate
        gcx * cx * f * (1 - f),         # forget gate
        gcx * i * (1 - g * g),          # cell gate
        ghy * tanh_cy * o * (1 - o),    # output gate
    ], axis=1)
    grad_bias = grad_gates.sum(axis=0) if has_bias else jnp.zeros((grad_gates.shape[1],), grad_gates.dtype)
    return grad_gates, gcx * f, grad_bias


@lower("_thnn_fused_gru_cell")
def thnn_fused_gru_cell(input_gates: Any, hidden_gates: Any, hx: Any, input_bias: Any = None,
                        hidden_bias: Any = None) -> tuple[Any, Any]:
    """One GRU step (reset, update, new gates) -> (hy, workspace)."""
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    ir, ii, inn = jnp.split(input_gates, 3, axis=1)
    hr, hi, hn = jnp.split(hidden_gates, 3, axis=1)
    r = jax.nn.sigmoid(ir + hr)
    z = jax.nn.sigmoid(ii + hi)
    n = jnp.tanh(inn + r * hn)
    hy = n + z * (hx - n)
    return hy, jnp.concatenate([r, z, n, hx, hn], axis=1)


@lower("_thnn_fused_gru_cell_backward")
def thnn_fused_gru_cell_backward(grad_hy: Any, workspace: Any, has_bias: bool) -> tuple[Any, Any, Any, Any, Any]:
    """Gradients of one fused GRU step: (input gates, hidden gates, hx, input bias, hidden bias)."""
    r, z, n, hx, hn = jnp.split(workspace, 5, axis=1)
    gn = grad_hy * (1 - z) * (1 - n * n)
    gz = grad_hy * (hx - n) * z * (1 - z)
    gr = gn * hn * r * (1 - r)
    grad_input = jnp.concatenate([gr, gz, gn], axis=1)
    grad_hidden = jnp.concatenate([gr, gz, gn * r], axis=1)
    grad_hx = grad_hy * z
    if has_bias:
        return grad_input, grad_hidden, grad_hx, grad_input.sum(axis=0), grad_hidden.sum(axis=0)
    zeros = jnp.zeros((grad_input.shape[1],), grad_input.dtype)
    return grad_input, grad_hidden, grad_hx, zeros, zeros
