"""PyTorch's OpInfo database against tpu (see opinfo_harness.py for what each case checks).

Every OpInfo that runs on CPU in float32 is a case; int64, bool and bfloat16 run too (fewer samples, no
variants). Expected failures are listed in one place, tests/opinfo_expected.py, each with its reason; a listed
op that starts passing fails the run until the list is updated (tools/gen_op_coverage.py rewrites it).

The same cases run again under DEFER_AND_FUSE (ops recorded and run as fused graphs), with the same expected
failures: deferred execution must not change any result, error, alias or out= behaviour.

Errors: every OpInfo's error inputs (PyTorch's own list of bad calls and the error each raises) made on tpu must
raise that error type with a matching message, in both modes (opinfo_harness.check_errors); the few where tpu's
error differs on purpose are listed in ERROR_DIFFERENCES below with the reason.

Gradients run in float32 under DEFER_NEVER: reverse mode for every OpInfo that supports autograd
("name:float32:grad") and forward mode for those that support forward AD ("name:float32:fwad"), in the same
expected-failure list (opinfo_harness.check_grad_op says what is compared).

Tiers: the default run (README's test command, CI) checks every op in float32 op by op, with its error inputs,
and a spread of the rest (_one_in, in op_db's order): every bfloat16 case and one in three int64 and bool cases,
one in four reverse-mode gradients, one in eight ops fused, in forward mode and with fused error inputs, one in
sixteen other-dtype cases fused. The others are marked `extended` and run with `bash tools/test_extended`, before
an issue is resolved: all of them take about an hour on a 2-core machine, past CI's limit beside the rest.
"""

from __future__ import annotations

import pytest
import torch
import torch_tpu

from opinfo_expected import EXPECTED_FAILURES
from opinfo_harness import check_errors, check_grad_op, check_op, error_ops, fwad_ops, grad_ops, op_id, opinfo_ops


def _cases(dtype: torch.dtype) -> list:
    params = []
    for op in opinfo_ops(dtype):
        key = f"{op_id(op)}:{str(dtype).removeprefix('torch.')}"
        params.append(pytest.param(op, key, id=key))
    return params


def _grad_cases(ops: list, kind: str) -> list:
    return [pytest.param(op, f"{op_id(op)}:float32:{kind}", id=f"{op_id(op)}:float32:{kind}") for op in ops]


def _one_in(every: int, params: list) -> list:
    """Every `every`-th case (in op_db's order, so a spread of op families) runs by default; the others are marked
    extended (tools/test_extended runs them all)."""
    return [p if i % every == 0 else pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.extended])
            for i, p in enumerate(params)]


def _run(op, key: str, dtype: torch.dtype, cap: int, variants: bool, mode: str = "DEFER_NEVER",
         check=None) -> None:
    assert torch_tpu._C._fallback_mode() == 0, "the OpInfo suite must run with the strict missing-op policy"
    reason = EXPECTED_FAILURES.get(key)
    try:
        with torch.tpu.set_eager_mode(mode):
            if check is None:
                check_op(op, dtype, cap=cap, variants=variants)
            else:
                check()
    except Exception:  # noqa: BLE001 - a listed failure may fail in any way
        if reason is None:
            raise
        return
    if reason is not None:
        pytest.fail(f"{key} is listed as an expected failure ({reason}) but passed: update tests/opinfo_expected.py "
                    "with tools/gen_op_coverage.py")


@pytest.mark.parametrize("op,key", _cases(torch.float32))
def test_opinfo_float32(op, key) -> None:
    _run(op, key, torch.float32, cap=4, variants=True)


@pytest.mark.parametrize("op,key", _one_in(3, _cases(torch.int64)) + _one_in(3, _cases(torch.bool)) +
                         _cases(torch.bfloat16))
def test_opinfo_other_dtypes(op, key) -> None:
    dtype = {"int64": torch.int64, "bool": torch.bool, "bfloat16": torch.bfloat16}[key.rsplit(":", 1)[1]]
    _run(op, key, dtype, cap=2, variants=False)


@pytest.mark.parametrize("op,key", _one_in(8, _cases(torch.float32)))
def test_opinfo_float32_fused(op, key) -> None:
    _run(op, key, torch.float32, cap=4, variants=True, mode="DEFER_AND_FUSE")


@pytest.mark.parametrize("op,key", _one_in(16, _cases(torch.int64) + _cases(torch.bool) + _cases(torch.bfloat16)))
def test_opinfo_other_dtypes_fused(op, key) -> None:
    dtype = {"int64": torch.int64, "bool": torch.bool, "bfloat16": torch.bfloat16}[key.rsplit(":", 1)[1]]
    _run(op, key, dtype, cap=2, variants=False, mode="DEFER_AND_FUSE")


# Gradients (float32, DEFER_NEVER): reverse mode for every OpInfo that supports autograd, forward mode for those
# that support forward AD; keys "name:float32:grad" / "name:float32:fwad" in the same expected-failure list.
@pytest.mark.parametrize("op,key", _one_in(4, _grad_cases(grad_ops(torch.float32), "grad")))
def test_opinfo_float32_grad(op, key) -> None:
    _run(op, key, torch.float32, cap=0, variants=False, check=lambda: check_grad_op(op, torch.float32, mode="grad"))


@pytest.mark.parametrize("op,key", _one_in(8, _grad_cases(fwad_ops(torch.float32), "fwad")))
def test_opinfo_float32_fwad(op, key) -> None:
    _run(op, key, torch.float32, cap=0, variants=False, check=lambda: check_grad_op(op, torch.float32, mode="fwad"))


# Error inputs (by OpInfo and index in op.error_inputs("tpu")) where tpu does not raise PyTorch's error, and why.
# All are out= checks ATen makes per op that the out= path does not make yet. They are stricter than the values
# require: tpu computes the result into a new buffer from the inputs as they were, then writes it to `out`, so an
# `out` that overlaps an input still gets the call's meaning, and one of another dtype the result casts to gets the
# result cast, as elementwise ops' out= does on every device (PyTorch refuses both for these ops).
_OVERLAP = "an out= tensor that overlaps an input (ATen's assert_no_overlap) is accepted: tpu writes it after computing"
_OUT_DTYPE = "an out= dtype other than the result's is accepted when the result casts to it (ATen wants it exact here)"
ERROR_DIFFERENCES: dict[str, dict[int, str]] = {
    "cat": {0: _OVERLAP, 6: _OVERLAP, 7: _OVERLAP, 8: _OVERLAP},
    "gather": {1: _OUT_DTYPE, 4: _OVERLAP, 5: _OVERLAP, 6: _OVERLAP},
    "index_select": {0: _OVERLAP},
    "take": {0: _OVERLAP, 1: _OVERLAP, 2: _OVERLAP},
    "masked_select": {0: _OVERLAP, 1: _OVERLAP, 2: _OVERLAP},
    "kthvalue": {0: _OVERLAP},
    "aminmax": {3: _OUT_DTYPE},
    "amax": {5: _OUT_DTYPE + "; a narrower one raises the cast error instead of ATen's dtype error"},
    "amin": {5: _OUT_DTYPE + "; a narrower one raises the cast error instead of ATen's dtype error"},
    "nn.functional.softshrink": {0: "lambd is a Scalar, traced like every number argument: its range is checked on the "
                                    "device and raised at the next synchronization, naming the range but not the value"},
    "complex": {2: _OUT_DTYPE + " (complex64 for float64 inputs: the result is rounded into it)"},
}


def _errors(op, mode: str) -> None:
    assert torch_tpu._C._fallback_mode() == 0, "the OpInfo suite must run with the strict missing-op policy"
    with torch.tpu.set_eager_mode(mode):
        check_errors(op, ERROR_DIFFERENCES.get(op_id(op)))


@pytest.mark.parametrize("op", [pytest.param(op, id=op_id(op)) for op in error_ops()])
def test_opinfo_errors(op) -> None:
    _errors(op, "DEFER_NEVER")


@pytest.mark.parametrize("op", _one_in(8, [pytest.param(op, id=op_id(op)) for op in error_ops()]))
def test_opinfo_errors_fused(op) -> None:
    _errors(op, "DEFER_AND_FUSE")


def test_error_checks_catch_a_bad_call_that_succeeds() -> None:
    """check_errors fails an op whose bad call returns a value, and one that raises another error type."""
    import copy

    from torch.testing._internal.common_methods_invocations import op_db

    cat = next(op for op in op_db if op.name == "cat")
    lenient = copy.copy(cat)
    lenient.op = lambda tensors, *a, **k: tensors[0]  # accepts every bad list
    with pytest.raises(AssertionError, match="got no error"):
        check_errors(lenient)
    other = copy.copy(cat)
    other.op = lambda *a, **k: (_ for _ in ()).throw(TypeError("Cannot concatenate arrays"))
    with pytest.raises(AssertionError, match="got TypeError"):
        check_errors(other)


class _SinWithDeviceBackward(torch.autograd.Function):
    """sin whose derivative is off by `BIAS` on tpu only (or missing there, with BIAS None): what the gradient
    checks must catch."""

    BIAS: float | None = 1.0

    @staticmethod
    def forward(x):
        return x.sin()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if x.device.type == "tpu":
            return None if _SinWithDeviceBackward.BIAS is None else g * x.cos() + _SinWithDeviceBackward.BIAS
        return g * x.cos()

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        bias = _SinWithDeviceBackward.BIAS if x.device.type == "tpu" else 0.0
        return t * x.cos() + bias


@pytest.mark.parametrize("mode,bias", [("grad", 1.0), ("grad", None), ("fwad", 1.0)])
def test_gradient_checks_catch_wrong_derivatives(mode, bias) -> None:
    """The gradient harness fails on a derivative that is wrong (or missing) on tpu alone, and passes the same
    op with the right one: the grad/fwad cases cannot pass whatever tpu computes."""
    import copy

    from torch.testing._internal.common_methods_invocations import op_db

    sin = next(op for op in op_db if op.name == "sin" and not op.variant_test_name)
    wrong = copy.copy(sin)
    wrong.op = lambda x, *a, **k: _SinWithDeviceBackward.apply(x)
    _SinWithDeviceBackward.BIAS = bias
    try:
        with pytest.raises(AssertionError, match="tpu gives no gradient" if bias is None else "is wrong"):
            check_grad_op(wrong, torch.float32, mode=mode)
        _SinWithDeviceBackward.BIAS = 0.0
        assert check_grad_op(wrong, torch.float32, mode=mode) > 0
    finally:
        _SinWithDeviceBackward.BIAS = 1.0
