"""Runs PyTorch's OpInfo samples on CPU and on tpu and compares them. Shared by tests/test_opinfo.py and
tools/gen_op_coverage.py (which writes docs/op_coverage.md and the expected-failure list).

For each OpInfo and dtype: every sample (up to a cap) is run on CPU and on tpu; results must agree in dtype,
shape and values (within tolerance), live on tpu, alias their inputs where CPU's do, and mutate inputs the
same way. The same runs again with SampleInput.noncontiguous(), and with out= when the op supports it (the
result must be the out tensor itself). The missing-op policy stays strict: nothing passes by falling back.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_flatten, tree_map

CAP = int(os.environ.get("TORCH_TPU_OPINFO_SAMPLES", "4"))
DTYPES = (torch.float32, torch.int64, torch.bool, torch.bfloat16)

# Ops whose values are random or uninitialised: checked for dtype, shape and device only.
UNCHECKED_VALUES = {
    "bernoulli", "multinomial", "normal", "normal.number_mean", "rand_like", "randint_like", "randn_like",
    "randint", "randn", "rand", "randperm", "uniform", "exponential", "geometric", "cauchy", "log_normal",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout", "nn.functional.rrelu", "empty", "empty_like", "new_empty",
    "new_empty_strided", "empty_strided", "empty_permuted", "torch.empty", "nn.functional.feature_alpha_dropout.with_train",
    "nn.functional.feature_alpha_dropout.without_train",
    # F.fractional_max_pool*d draw their window offsets with the device's generator (tests/test_op_families.py
    # checks the values with the same offsets given as _random_samples).
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
}

TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3),
              torch.float64: (1e-7, 1e-7), torch.complex64: (1e-4, 1e-5)}


# OpInfos whose tensor arguments (not the input) must stay on the CPU, as their sample functions make them
# for any device.
CPU_ARGS = {"tensor_split"}


def opinfo_ops(dtype: torch.dtype = torch.float32) -> list:
    """The OpInfos that run on CPU in `dtype` (jiterator OpInfos exist for CUDA/ROCm only)."""
    return [op for op in op_db if dtype in op.supported_dtypes("cpu") and not op.name.startswith("jiterator")]


def op_id(op: Any) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _to_tpu(x: Any) -> Any:
    """The same tensor on tpu with the same geometry: its whole storage is copied and viewed with the same
    sizes, strides and offset, so non-contiguous samples stay non-contiguous views on tpu."""
    if isinstance(x, torch.Tensor):
        return _same_geometry(x, "tpu")
    return x


def _device_to_tpu(x: Any) -> Any:
    if isinstance(x, torch.device) and x.type == "cpu":
        return torch.device("tpu")
    return "tpu" if isinstance(x, str) and x == "cpu" else x  # device strings ('cpu' means nothing else)


def _tpu_sample(op: Any, sample: Any) -> Any:
    moved = sample.transform(_to_tpu)
    if op.name in CPU_ARGS:
        moved = type(sample)(moved.input, args=sample.args, kwargs=sample.kwargs,
                             broadcasts_input=sample.broadcasts_input, name=sample.name)
    # Device arguments (factory functions, Tensor.to) follow the sample to tpu.
    moved = type(sample)(moved.input, args=tree_map(_device_to_tpu, moved.args),
                         kwargs=tree_map(_device_to_tpu, moved.kwargs), broadcasts_input=sample.broadcasts_input,
                         name=sample.name)
    return moved


def _same_geometry(x: torch.Tensor, device: str) -> torch.Tensor:
    """A copy of x's whole storage on `device`, viewed with x's sizes, strides and offset."""
    d = x.detach()
    if d.layout != torch.strided or d.untyped_storage().nbytes() % d.element_size():
        return d.to(device, copy=True).requires_grad_(x.requires_grad)
    whole = torch.empty(0, dtype=d.dtype).set_(d.untyped_storage())
    copy = whole.to(device, copy=True)
    return copy.as_strided(d.size(), d.stride(), d.storage_offset()).requires_grad_(x.requires_grad)


def _clone(x: Any) -> Any:
    return _same_geometry(x, "cpu") if isinstance(x, torch.Tensor) else x


def _sample_tensors(sample: Any) -> list:
    return [t for t in tree_flatten((sample.input, sample.args, sample.kwargs))[0] if isinstance(t, torch.Tensor)]


def _compare(actual: Any, expected: Any, dtype: torch.dtype, check_values: bool, what: str) -> None:
    a_flat, a_spec = tree_flatten(actual)
    e_flat, e_spec = tree_flatten(expected)
    if len(a_flat) != len(e_flat):
        raise AssertionError(f"{what}: {len(a_flat)} outputs on tpu, {len(e_flat)} on CPU")
    rtol, atol = TOLERANCES.get(dtype, (1e-4, 1e-5))
    for a, e in zip(a_flat, e_flat):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise AssertionError(f"{what}: tpu returned {type(a).__name__}, CPU a tensor")
            if e.device.type == "cpu" and a.device.type != "tpu":
                raise AssertionError(f"{what}: output on {a.device}, expected tpu")
            if a.dtype != e.dtype or a.shape != e.shape:
                raise AssertionError(f"{what}: tpu gave {a.dtype}{list(a.shape)}, CPU {e.dtype}{list(e.shape)}")
            if check_values:
                torch.testing.assert_close(a.detach().cpu(), e.detach(), rtol=rtol, atol=atol, equal_nan=True,
                                           msg=lambda m: f"{what}: {m}")
        elif check_values and isinstance(e, float):
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)
        elif check_values and a != e:
            raise AssertionError(f"{what}: tpu gave {a!r}, CPU {e!r}")


def _aliases(out: Any, inputs: list) -> list[bool]:
    ptrs = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    return [isinstance(o, torch.Tensor) and o.numel() > 0 and o.untyped_storage().data_ptr() in ptrs
            for o in tree_flatten(out)[0]]


def _random_sample(sample: Any) -> bool:
    """Samples that draw random numbers (attention with dropout): values cannot match CPU's stream."""
    p = sample.kwargs.get("dropout_p", 0.0)
    return isinstance(p, (int, float)) and p > 0 and sample.kwargs.get("training", True)


def check_sample(op: Any, sample: Any, dtype: torch.dtype, what: str) -> None:
    check_values = (op.name not in UNCHECKED_VALUES and op_id(op) not in UNCHECKED_VALUES
                    and not _random_sample(sample))
    cpu_sample = sample.transform(_clone)
    tpu_sample = _tpu_sample(op, sample)
    try:
        expected = op(cpu_sample.input, *cpu_sample.args, **cpu_sample.kwargs)
    except RuntimeError as e:
        # A contiguity requirement of the CPU kernel itself: no reference for this sample.
        if "is_contiguous" in str(e):
            return
        # Otherwise CPU's error is the expected behaviour: tpu must raise the same kind of error.
        try:
            op(tpu_sample.input, *tpu_sample.args, **tpu_sample.kwargs)
        except RuntimeError:
            return
        raise AssertionError(f"{what}: CPU raises RuntimeError ({str(e).splitlines()[0]}), tpu does not") from None
    actual = op(tpu_sample.input, *tpu_sample.args, **tpu_sample.kwargs)
    _compare(actual, expected, dtype, check_values, what)
    if _aliases(expected, _sample_tensors(cpu_sample)) != _aliases(actual, _sample_tensors(tpu_sample)):
        raise AssertionError(f"{what}: output/input aliasing differs from CPU")
    for t_in, c_in in zip(_sample_tensors(tpu_sample), _sample_tensors(cpu_sample)):
        if check_values:
            torch.testing.assert_close(t_in.detach().cpu(), c_in.detach(), equal_nan=True,
                                       msg=lambda m: f"{what}: input mutated differently: {m}")


def check_out(op: Any, sample: Any, dtype: torch.dtype, what: str) -> None:
    cpu_sample = sample.transform(_clone)
    expected = op(cpu_sample.input, *cpu_sample.args, **cpu_sample.kwargs)
    flat, spec = tree_flatten(expected)
    if not flat or not all(isinstance(t, torch.Tensor) for t in flat):
        return
    # What CPU returns from out= (the out tensors themselves, or None for list outs) is what tpu must return.
    cpu_out = tree_map(torch.empty_like, expected)
    cpu_sample = sample.transform(_clone)
    out = tree_map(lambda t: torch.empty_like(t, device="tpu"), expected)
    tpu_sample = _tpu_sample(op, sample)
    try:
        cpu_result = op(cpu_sample.input, *cpu_sample.args, out=cpu_out, **cpu_sample.kwargs)
    except (TypeError, RuntimeError) as e:  # CPU rejects this out= (e.g. a tuple out): tpu must reject it too
        try:
            op(tpu_sample.input, *tpu_sample.args, out=out, **tpu_sample.kwargs)
        except type(e):
            return
        raise AssertionError(f"{what}: CPU raises {type(e).__name__} for this out=, tpu does not") from None
    result = op(tpu_sample.input, *tpu_sample.args, out=out, **tpu_sample.kwargs)
    if cpu_result is None:
        if result is not None:
            raise AssertionError(f"{what}: out= returned {type(result).__name__}, CPU returns None")
    else:
        for c, co, r, o in zip(tree_flatten(cpu_result)[0], tree_flatten(cpu_out)[0], tree_flatten(result)[0],
                               tree_flatten(out)[0]):
            if (c is co) != (r is o):
                raise AssertionError(f"{what}: out= returned a new tensor instead of the out tensor")
    check_values = op.name not in UNCHECKED_VALUES
    _compare(out, expected, dtype, check_values, what)


def check_op(op: Any, dtype: torch.dtype, cap: int = CAP, variants: bool = True) -> int:
    """Runs the checks; returns the number of samples compared. Raises on the first failure."""
    # The same samples whatever ran before (pytest and tools/gen_op_coverage.py must agree on the outcome).
    torch.manual_seed(zlib.crc32(f"{op_id(op)}:{dtype}".encode()))
    samples = list(op.sample_inputs("cpu", dtype))[:cap]
    if not samples:
        return 0
    for i, sample in enumerate(samples):
        check_sample(op, sample, dtype, f"{op_id(op)} {dtype} sample {i}")
        if variants:
            check_sample(op, sample.noncontiguous(), dtype, f"{op_id(op)} {dtype} sample {i} noncontiguous")
    if variants and op.supports_out:
        for i, sample in enumerate(samples[:2]):
            check_out(op, sample, dtype, f"{op_id(op)} {dtype} sample {i} out=")
    return len(samples)
