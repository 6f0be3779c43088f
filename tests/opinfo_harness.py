"""Runs PyTorch's OpInfo samples on CPU and on tpu and compares them. Shared by tests/test_opinfo.py and
tools/gen_op_coverage.py (which writes docs/op_coverage.md and the expected-failure list).

For each OpInfo and dtype: every sample (up to a cap) is run on CPU and on tpu; results must agree in dtype,
shape and values (within tolerance), live on tpu, alias their inputs where CPU's do, and mutate inputs the
same way. The same runs again with SampleInput.noncontiguous(), and with out= when the op supports it (the
result must be the out tensor itself). The missing-op policy stays strict: nothing passes by falling back.
"""

from __future__ import annotations

import itertools
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
    try:
        _compare(actual, expected, dtype, check_values, what)
    except AssertionError:
        if not _closer_to_float64(op, sample, actual, expected, dtype):
            raise
    if _aliases(expected, _sample_tensors(cpu_sample)) != _aliases(actual, _sample_tensors(tpu_sample)):
        raise AssertionError(f"{what}: output/input aliasing differs from CPU")
    for t_in, c_in in zip(_sample_tensors(tpu_sample), _sample_tensors(cpu_sample)):
        if check_values:
            torch.testing.assert_close(t_in.detach().cpu(), c_in.detach(), equal_nan=True,
                                       msg=lambda m: f"{what}: input mutated differently: {m}")


def _closer_to_float64(op: Any, sample: Any, actual: Any, expected: Any, dtype: torch.dtype) -> bool:
    """For bfloat16/float16 results that miss CPU's: True when CPU's float64 result of the same sample decides for
    tpu, that is every element of tpu's result is within twice CPU's own error of it (plus the dtype's tolerance).
    CPU's low-precision kernels round differently by CPU (oneDNN's bfloat16 convolutions on AVX2 and on AVX-512
    machines differ), so CPU's bfloat16 result is not the truth where sums are long (conv_transpose)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    up = _float64(sample)
    try:
        reference = op(up.input, *up.args, **up.kwargs)
    except Exception:  # noqa: BLE001 - no float64 reference: CPU's result stands
        return False
    rtol, atol = TOLERANCES[dtype]
    pairs = list(zip(tree_flatten(actual)[0], tree_flatten(expected)[0], tree_flatten(reference)[0]))
    for a, e, r in pairs:
        if not isinstance(e, torch.Tensor) or not isinstance(r, torch.Tensor) or r.shape != e.shape:
            return False
        a, e, r = a.detach().cpu().double(), e.detach().double(), r.detach().double()
        bound = 2 * (e - r).abs() + atol + rtol * r.abs()
        if not bool(((a - r).abs() <= bound).all()):
            return False
    return bool(pairs)


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
    # Only the first `cap` samples are made: PyTorch's iterator seeds the RNG before each one (three stack
    # formats per torch.manual_seed on CPU torch), so the rest would cost time and change nothing.
    samples = list(itertools.islice(op.sample_inputs("cpu", dtype), cap))
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


# ---------------------------------------------------------------------------------------------------------------
# Gradients: reverse mode (torch.autograd.grad) and forward mode (torch.autograd.forward_ad) on tpu against CPU.
#
# Samples come from op.sample_inputs(..., requires_grad=True): the tensors the OpInfo makes differentiable (the
# input and tensor arguments) are the ones differentiated. The op runs through op.gradcheck_wrapper (e.g. it makes
# eigh's input Hermitian) and sample.output_process_fn_grad (it keeps the outputs whose gradient is defined), as
# PyTorch's own gradient tests do. Outputs that are not differentiable on CPU (integer/bool outputs, indices) get
# no upstream gradient. Upstream gradients and tangents are drawn once on CPU from a seeded generator and copied
# to tpu, so both devices differentiate with the same values.
#
# A missing gradient: where CPU returns None for an input (no path from the outputs to it), tpu must return None
# or an all-zero tensor (the same gradient, materialised); where CPU returns a tensor, tpu must return a tensor
# of the same dtype and shape on tpu (None there would make optimizers skip the parameter). An output that
# requires grad on CPU must require grad on tpu; where CPU's backward raises, tpu's must raise too.
#
# Values: rtol 2e-4 / atol 2e-5; beyond that, CPU's float64 gradient of the same sample decides (tpu passes
# where it is within twice CPU's float32 error of it: ill-conditioned samples such as logcumsumexp of 1e4).
# Samples that draw random numbers (an ATen op tagged nondeterministic_seeded runs: dropout) are compared for
# dtype, shape and device only. Up to GRAD_CAP samples are taken, those with more than one element first (an
# empty or 1x1 sample cannot tell a gradient from its transpose), plus the first one made non-contiguous.

GRAD_CAP = int(os.environ.get("TORCH_TPU_OPINFO_GRAD_SAMPLES", "2"))
GRAD_TOLERANCES = {torch.float32: (2e-4, 2e-5)}


def grad_ops(dtype: torch.dtype = torch.float32) -> list:
    """The OpInfos whose gradients are checked in `dtype`: those that support autograd there on CPU."""
    return [op for op in opinfo_ops(dtype) if op.supports_autograd and dtype in op.supported_backward_dtypes("cpu")]


def fwad_ops(dtype: torch.dtype = torch.float32) -> list:
    return [op for op in grad_ops(dtype) if op.supports_forward_ad]


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


class _Flat:
    """A sample as one flat list of leaves (input, args, kwargs), copied to `device` with the same geometry."""

    def __init__(self, op: Any, sample: Any, device: str) -> None:
        if device == "cpu":
            moved = sample.transform(_clone)
        else:
            moved = _tpu_sample(op, sample)
        self.leaves, self.spec = tree_flatten((moved.input, moved.args, moved.kwargs))
        self.output_process = sample.output_process_fn_grad

    def call(self, op: Any, leaves: list) -> Any:
        from torch.utils._pytree import tree_unflatten

        inp, args, kwargs = tree_unflatten(leaves, self.spec)
        return self.output_process(op.gradcheck_wrapper(op.get_op(), inp, *args, **kwargs))


def _seeded_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Deterministic values shaped like t (on CPU), drawn from gen."""
    return torch.randn(t.shape, dtype=t.dtype, generator=gen)


def _compare_grads(actual: list, expected: list, names: list[str], dtype: torch.dtype, what: str,
                   check_values: bool = True, reference=None, random=None) -> None:
    """tpu's gradients against CPU's. Where values differ beyond the tolerance, `reference()` (CPU in float64)
    decides: tpu passes where it is as close to the float64 result as CPU's float32 is (ill-conditioned samples,
    e.g. logcumsumexp of 1e4, where both devices carry the same float32 rounding error)."""
    rtol, atol = GRAD_TOLERANCES.get(dtype, (2e-4, 2e-5))
    for j, (a, e, name) in enumerate(zip(actual, expected, names)):
        if e is None:
            if a is not None and (a.device.type != "tpu" or bool((a.detach().cpu() != 0).any())):
                raise AssertionError(f"{what}: {name}: CPU gives no gradient (None), tpu a non-zero one")
            continue
        if a is None:
            raise AssertionError(f"{what}: {name}: tpu gives no gradient (None), CPU a {e.dtype}{list(e.shape)} one")
        if a.device.type != "tpu":
            raise AssertionError(f"{what}: {name}: gradient on {a.device}, expected tpu")
        if a.dtype != e.dtype or a.shape != e.shape:
            raise AssertionError(f"{what}: {name}: tpu gave {a.dtype}{list(a.shape)}, CPU {e.dtype}{list(e.shape)}")
        if not check_values:
            continue
        a_cpu, e_cpu = a.detach().cpu(), e.detach()
        try:
            torch.testing.assert_close(a_cpu, e_cpu, rtol=rtol, atol=atol, equal_nan=True,
                                       msg=lambda m: f"{what}: {name}: {m}")
        except AssertionError:
            if random is not None and random():
                check_values = False  # random values (dropout): dtype, shape and device only
                continue
            ref = reference()[j] if reference is not None else None
            if ref is None:
                raise
            ref = ref.detach()
            err_tpu, err_cpu = (a_cpu.double() - ref).abs(), (e_cpu.double() - ref).abs()
            ok = (err_tpu <= 2 * err_cpu.nan_to_num().max() + atol + rtol * ref.abs()) | (a_cpu.isnan() & e_cpu.isnan())
            if not bool(ok.all()):
                raise AssertionError(f"{what}: {name} is wrong: {float(err_tpu.max()):.3g} from CPU's float64 result "
                                     f"(CPU's float32: {float(err_cpu.max()):.3g})") from None


def _nondeterministic(op: Any, sample: Any) -> bool:
    """Whether the op draws random numbers for this sample (dropout inside attention, rrelu in training): an ATen
    op tagged nondeterministic_seeded runs in CPU's forward. Seeding does not help: tpu's generator has its own
    stream (and OpInfos such as multi_head_attention_forward reseed inside the op). Such samples are checked for
    gradient dtype, shape and device only."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seeded(TorchDispatchMode):
        seen = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch.Tag.nondeterministic_seeded in func.tags:
                Seeded.seen = True
            return func(*args, **(kwargs or {}))

    c = sample.transform(_clone)
    with torch.no_grad(), Seeded():
        op(c.input, *c.args, **c.kwargs)
    return Seeded.seen


def _float64(sample: Any) -> Any:
    def up(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.detach().double().requires_grad_(t.requires_grad)
        return t
    return sample.transform(up)


def check_grad_sample(op: Any, sample: Any, dtype: torch.dtype, what: str, seed: int) -> bool:
    """Reverse mode for one sample. Returns False where the sample has nothing to differentiate on CPU."""
    cpu, tpu = _Flat(op, sample, "cpu"), _Flat(op, sample, "tpu")
    wrt = [i for i, t in enumerate(cpu.leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not wrt:
        return False
    try:
        expected_out = cpu.call(op, cpu.leaves)
    except RuntimeError:
        return False  # CPU rejects the sample: the forward check compares the error
    e_outs = tree_flatten(expected_out)[0]
    a_outs = tree_flatten(tpu.call(op, tpu.leaves))[0]
    if len(a_outs) != len(e_outs):
        raise AssertionError(f"{what}: {len(a_outs)} outputs on tpu, {len(e_outs)} on CPU")
    diff = [k for k, o in enumerate(e_outs) if _differentiable(o) and o.requires_grad]
    if not diff:
        return False
    for k in diff:
        if not (isinstance(a_outs[k], torch.Tensor) and a_outs[k].requires_grad):
            raise AssertionError(f"{what}: output {k} requires grad on CPU but not on tpu (no autograd graph)")
    gen = torch.Generator().manual_seed(seed)
    upstream = [_seeded_like(e_outs[k], gen) for k in diff]

    def grads(flat: _Flat, outs: list, ups: list) -> tuple:
        return torch.autograd.grad([outs[k] for k in diff], [flat.leaves[i] for i in wrt], ups, allow_unused=True)

    try:
        expected = grads(cpu, e_outs, upstream)
    except RuntimeError as err:  # CPU cannot differentiate this sample: tpu must refuse too
        try:
            grads(tpu, a_outs, [g.to("tpu") for g in upstream])
        except (RuntimeError, NotImplementedError):
            return True
        raise AssertionError(f"{what}: CPU backward raises ({str(err).splitlines()[0]}), tpu does not") from None
    actual = grads(tpu, a_outs, [g.to("tpu") for g in upstream])

    def reference() -> list | None:
        try:
            ref = _Flat(op, _float64(sample), "cpu")
            outs = tree_flatten(ref.call(op, ref.leaves))[0]
            return list(grads(ref, outs, [g.double() for g in upstream]))
        except Exception:  # noqa: BLE001 - no float64 reference for this op: the float32 comparison stands
            return None

    _compare_grads(list(actual), list(expected), [f"grad of input {i}" for i in wrt], dtype, what,
                   check_values=op.name not in UNCHECKED_VALUES and op_id(op) not in UNCHECKED_VALUES,
                   reference=reference, random=lambda: _nondeterministic(op, sample))
    return True


def check_fwad_sample(op: Any, sample: Any, dtype: torch.dtype, what: str, seed: int) -> bool:
    """Forward mode for one sample: tangents on the differentiable inputs, output tangents compared."""
    import torch.autograd.forward_ad as fwAD

    cpu, tpu = _Flat(op, sample, "cpu"), _Flat(op, sample, "tpu")
    wrt = [i for i, t in enumerate(cpu.leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not wrt:
        return False
    gen = torch.Generator().manual_seed(seed)
    tangents = {i: _seeded_like(cpu.leaves[i], gen) for i in wrt}

    def run(flat: _Flat, device: str, cast: torch.dtype | None = None) -> list:
        with fwAD.dual_level():
            leaves = list(flat.leaves)
            for i, t in tangents.items():
                primal = leaves[i].detach()
                tangent = _same_geometry(t, device) if device == "tpu" else t.to(cast or t.dtype)
                leaves[i] = fwAD.make_dual(primal, tangent)
            outs = tree_flatten(flat.call(op, leaves))[0]
            return [fwAD.unpack_dual(o).tangent if _differentiable(o) else None for o in outs]

    try:
        expected = run(cpu, "cpu")
    except (RuntimeError, NotImplementedError):
        return False  # CPU has no forward-AD formula for this sample (or rejects it)
    actual = run(tpu, "tpu")
    if len(actual) != len(expected):
        raise AssertionError(f"{what}: {len(actual)} outputs on tpu, {len(expected)} on CPU")

    def reference() -> list | None:
        try:
            return run(_Flat(op, _float64(sample), "cpu"), "cpu", torch.float64)
        except Exception:  # noqa: BLE001
            return None

    _compare_grads(actual, expected, [f"tangent of output {k}" for k in range(len(expected))], dtype, what,
                   check_values=op.name not in UNCHECKED_VALUES and op_id(op) not in UNCHECKED_VALUES,
                   reference=reference, random=lambda: _nondeterministic(op, sample))
    return True


def _informative_first(samples: list) -> list:
    """Samples whose largest tensor has more than one element first (in their order), then the others: an empty or
    1x1 sample cannot tell a gradient from its transpose (det's sample list starts with 0x0 and 1x1)."""
    def size(s: Any) -> int:
        return max((t.numel() for t in _sample_tensors(s)), default=0)
    return [s for s in samples if size(s) > 1] + [s for s in samples if size(s) <= 1]


def check_grad_op(op: Any, dtype: torch.dtype = torch.float32, cap: int = GRAD_CAP, mode: str = "grad",
                  noncontiguous: bool = True) -> int:
    """Reverse-mode (mode="grad") or forward-mode (mode="fwad") gradients of up to `cap` samples, plus the first
    one made non-contiguous. Returns the number of samples differentiated; raises on the first failure."""
    base = zlib.crc32(f"{op_id(op)}:{dtype}:{mode}".encode())
    torch.manual_seed(base)
    samples = _informative_first(list(op.sample_inputs("cpu", dtype, requires_grad=True)))[:cap]
    check = check_grad_sample if mode == "grad" else check_fwad_sample
    done = 0
    for i, sample in enumerate(samples):
        done += check(op, sample, dtype, f"{op_id(op)} {dtype} {mode} sample {i}", base + i)
        if noncontiguous and i == 0:
            check(op, sample.noncontiguous(), dtype, f"{op_id(op)} {dtype} {mode} sample {i} noncontiguous",
                  base + i)
    return done


# ---------------------------------------------------------------------------------------------------------------
# Errors: each OpInfo's error inputs (op.error_inputs, PyTorch's own list of bad calls with the exception type and
# message each must raise, as test_ops.py's test_errors runs them) made on tpu. The call must raise that type with
# a message matching the regex, at the call or when its results are read (a deferred op's error surfaces at the
# sync): a bad call that returns a value, or one that fails inside JAX with JAX's words, fails the case. OpInfos
# PyTorch marks as expected to fail test_errors on every device (their error inputs do not raise on CPU either:
# both arguments Python numbers) are left out.


def _expected_to_fail_errors(op: Any) -> bool:
    return any(getattr(d, "cls_name", None) == "TestCommon" and getattr(d, "test_name", None) == "test_errors"
               and getattr(d, "device_type", None) is None for d in op.decorators)


def error_ops() -> list:
    """The OpInfos with error inputs whose test_errors PyTorch does not expect to fail."""
    return [op for op in op_db if op.error_inputs_func is not None and not op.name.startswith("jiterator")
            and not _expected_to_fail_errors(op)]


def check_errors(op: Any, known: dict[int, str] | None = None) -> int:
    """Runs every error input of `op` on tpu; returns how many ran. Raises AssertionError listing each one that did
    not raise its exception type with a matching message, and each listed in `known` (error input index -> why
    tpu differs) that now does."""
    import re

    known = known or {}
    torch.manual_seed(zlib.crc32(f"{op_id(op)}:errors".encode()))
    wrong = []
    ran = 0
    for i, ei in enumerate(op.error_inputs("tpu")):
        s = ei.sample_input
        if not any(isinstance(t, torch.Tensor) for t in _sample_tensors(s)):
            continue  # no tensor at all (`op(2, 3)`): the call never reaches a device
        ran += 1
        try:
            out = op(s.input, *s.args, **s.kwargs)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type == "tpu":
                    t.cpu()  # a deferred op's error surfaces when its result is read
        except Exception as e:  # noqa: BLE001 - the type is what is checked
            if isinstance(e, ei.error_type) and re.search(ei.error_regex, str(e)):
                if i in known:
                    wrong.append(f"  error input {i} is listed as a known difference ({known[i]}) but now raises "
                                 "PyTorch's error: remove it from the list")
                continue
            got = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        else:
            got = "no error"
        if i not in known:
            wrong.append(f"  error input {i} ({s.name or 'unnamed'}): expected {ei.error_type.__name__} matching "
                         f"{ei.error_regex!r}, got {got}")
    if wrong:
        raise AssertionError(f"{op_id(op)}: bad calls that do not raise PyTorch's error on tpu:\n" + "\n".join(wrong))
    return ran
