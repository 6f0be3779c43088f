"""Casts and reads to the host. aten::_to_copy on tpu (runtime/TpuCast.cpp): a cast that stays on its device, of a
contiguous tensor, is one call of kernels/copy.py's `_cast`, a copy of one to the host one call of `_to_host` (or,
for the whole of a computed array, one host read the kernel copies from itself);
every other form runs ATen's composite (empty_like, then copy_). And `.item()`. Each must give what CPU PyTorch
gives, bit for bit, in each eager mode."""

from __future__ import annotations

import warnings

import pytest
import torch

EagerMode = torch.tpu.EagerMode
MODES = ("DEFER_NEVER", "DEFER_AND_FUSE", "DEFER_NEVER_AND_LAUNCH_BLOCKING")


@pytest.fixture(autouse=True)
def _restore_mode():
    yield
    torch.tpu.eager_mode = EagerMode.DEFER_NEVER


@pytest.fixture
def calls(monkeypatch):
    """What the C++ kernel handed to kernels/copy.py's functions: ("cast", shape, source dtype, dtype) for a
    same-device cast, ("host", shape, dtype) for a copy to the host through `_to_host`, ("read", shape, dtype)
    for one the kernel made itself from the host read of a computed whole array (`host_array`)."""
    from torch_tpu import _C
    from torch_tpu.kernels import copy as copy_kernels

    seen: list[tuple] = []

    def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        seen.append(("cast", tuple(t.shape), t.dtype, dtype))
        return copy_kernels.CASTS[0](t, dtype)

    def to_host(t: torch.Tensor) -> torch.Tensor:
        seen.append(("host", tuple(t.shape), t.dtype))
        return copy_kernels.CASTS[1](t)

    def host_read(a) -> object:
        out = copy_kernels.CASTS[2](a)
        seen.append(("read", tuple(out.shape), out.dtype))
        return out

    _C._set_casts(cast, to_host, host_read)
    yield seen
    _C._set_casts(*copy_kernels.CASTS)


def _kinds(calls: list[tuple], kind: str) -> list[tuple]:
    return [c for c in calls if c[0] == kind]


def _source(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    """Values every dtype holds and every conversion keeps defined (no NaN, nothing out of an integer's range)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(-20, 100, shape, generator=g).to(torch.float32) / 4
    if dtype == torch.bool:
        return base > 5
    if dtype in (torch.uint8,):
        return base.abs().to(dtype)
    if dtype.is_complex:
        return torch.complex(base, base.flip(-1) if base.dim() else base).to(dtype)
    return base.to(dtype)


DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool,
          torch.complex64)


@pytest.mark.parametrize("mode", MODES)
def test_same_device_casts_match_cpu_bit_for_bit(mode, calls) -> None:
    torch.tpu.eager_mode = getattr(EagerMode, mode)
    n = 0
    for src in DTYPES:
        c = _source(src)
        t = c.to("tpu")
        for dst in DTYPES:
            if dst == src:
                continue
            s, ts = c, t
            if dst == torch.uint8 and src != torch.bool:
                # (a negative number's uint8 is undefined in C++: CPU wraps, XLA clamps)
                s = torch.complex(c.real.abs(), c.imag) if src.is_complex else c.abs()
                ts = s.to("tpu")
            want = s.to(dst)
            for got in (ts.to(dst), ts.to("tpu", dst), ts.to(device="tpu:0", dtype=dst), ts.type(dst)):
                assert got.device == torch.device("tpu", 0) and got.dtype == dst and got.shape == want.shape
                assert got.is_contiguous()
                assert torch.equal(got.cpu(), want), (src, dst)
            n += 4
    assert len(_kinds(calls, "cast")) == n  # every one took the one-call form


@pytest.mark.parametrize("mode", MODES[:2])
def test_views_zero_dim_empty_and_lazy_bits(mode, calls) -> None:
    torch.tpu.eager_mode = getattr(EagerMode, mode)
    c = _source(torch.float32, (4, 6))
    t = c.to("tpu")
    cases = {
        "row slice (contiguous, offset)": (t[1:3], c[1:3]),
        "one row": (t[2], c[2]),
        "element (0-d)": (t[1, 2], c[1, 2]),
        "empty": (t[:0], c[:0]),
        "reshaped": (t.reshape(3, 8), c.reshape(3, 8)),
        "negative view": (torch._neg_view(t), torch._neg_view(c)),
    }
    z, zc = _source(torch.complex64).to("tpu"), _source(torch.complex64)
    cases["conjugate view"] = (z.conj(), zc.conj())
    for name, (tv, cv) in cases.items():
        for dst in ((torch.complex128,) if tv.is_complex() else (torch.bfloat16, torch.int32, torch.float16)):
            got, want = tv.to(dst), cv.to(dst)
            assert got.dtype == dst and got.shape == want.shape, name
            assert not got.is_conj() and not got.is_neg()
            assert torch.equal(got.cpu(), want), name
    assert len(_kinds(calls, "cast")) == 3 * (len(cases) - 1) + 1
    # A complex source to a real dtype drops the imaginary part, as CPU does (CPU also warns, once per process).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = zc.conj().to(torch.float32)
    assert torch.equal(z.conj().to(torch.float32).cpu(), want)


def test_other_forms_run_the_composite(calls) -> None:
    c = _source(torch.float32, (2, 3, 4, 5))
    t = c.to("tpu")
    # non-contiguous: the composite keeps the source's strides (dense) as CPU does
    got = t.transpose(1, 3).to(torch.bfloat16)
    want = c.transpose(1, 3).to(torch.bfloat16)
    assert got.stride() == want.stride() and torch.equal(got.cpu(), want)
    got = t.to(torch.float16, memory_format=torch.channels_last)
    want = c.to(torch.float16, memory_format=torch.channels_last)
    assert got.stride() == want.stride() and torch.equal(got.cpu(), want)
    # no dtype change, another device, a copy to the host, from the host
    same = t.to(torch.float32, copy=True)
    assert same.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() and torch.equal(same.cpu(), c)
    assert torch.equal(t.to("cpu", torch.bfloat16), c.to(torch.bfloat16))
    assert torch.equal(c.to("tpu", torch.int32).cpu(), c.to(torch.int32))
    assert _kinds(calls, "cast") == []


def test_result_is_a_new_tensor_and_autograd_flows(calls) -> None:
    c = _source(torch.float32)
    t = c.to("tpu")
    r = t.to(torch.bfloat16)
    assert r.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    t.add_(1)
    assert torch.equal(r.cpu(), c.to(torch.bfloat16))  # the source's later write does not show through
    for mode in MODES[:2]:
        torch.tpu.eager_mode = getattr(EagerMode, mode)
        xc = c.clone().requires_grad_()
        x = c.to("tpu").requires_grad_()
        (x.to(torch.bfloat16) * 3).to(torch.float32).pow(2).sum().backward()
        (xc.to(torch.bfloat16) * 3).to(torch.float32).pow(2).sum().backward()
        assert x.grad.dtype == torch.float32
        torch.testing.assert_close(x.grad.cpu(), xc.grad)
    assert _kinds(calls, "cast")  # the forward casts and ToCopyBackward's took the one-call form


@pytest.fixture
def programs():
    """As `calls`, with the C++ kernel's own path under DEFER_NEVER on: ("program", source dtype, dtype, shape)
    for each cast it ran through `_cast_program`'s jitted conversion (no Python frame of kernels/copy.py), ("cast",
    ...) for each one it handed to `_cast`."""
    from torch_tpu import _C
    from torch_tpu.kernels import copy as copy_kernels

    seen: list[tuple] = []

    def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        seen.append(("cast", t.dtype, dtype))
        return copy_kernels.CASTS[0](t, dtype)

    def cast_program(dtype: torch.dtype):
        fn = copy_kernels.CASTS[3](dtype)

        def run(a):
            seen.append(("program", str(a.dtype), dtype, tuple(a.shape)))
            return fn(a)

        return run

    _C._set_casts(cast, copy_kernels.CASTS[1], copy_kernels.CASTS[2], cast_program)
    yield seen
    _C._set_casts(*copy_kernels.CASTS)


@pytest.mark.parametrize("mode", MODES)
def test_defer_never_casts_a_whole_array_in_cpp(mode, programs) -> None:
    """Under DEFER_NEVER a cast of a tensor viewing its whole computed array is the jitted conversion called from
    C++, bit for bit CPU's value in every pair of dtypes; views, lazy bits and the other modes take `_cast`."""
    torch.tpu.eager_mode = getattr(EagerMode, mode)
    n = 0
    for src in DTYPES:
        c = _source(src)
        if src != torch.bool:
            c = torch.complex(c.real.abs(), c.imag) if src.is_complex else c.abs()  # (see uint8 above)
        t = c.to("tpu")
        for dst in DTYPES:
            if dst != src:
                got = t.to(dst)
                assert got.device == torch.device("tpu", 0) and got.dtype == dst and got.shape == c.shape
                assert got.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
                assert torch.equal(got.cpu(), c.to(dst)), (src, dst)
                n += 1
    on = mode == "DEFER_NEVER"
    assert len(_kinds(programs, "program")) == (n if on else 0)
    assert len(_kinds(programs, "cast")) == (0 if on else n)
    programs.clear()
    v = _source(torch.float32, (4, 6))
    tv = v.to("tpu")
    assert torch.equal(tv[1:3].to(torch.bfloat16).cpu(), v[1:3].to(torch.bfloat16))  # a view: `_cast` reads it
    assert programs == [("cast", torch.float32, torch.bfloat16)]
    # (a negative view reaches the kernel resolved by ATen's fallback: a whole array, either path)
    assert torch.equal(torch._neg_view(tv).to(torch.float16).cpu(), torch._neg_view(v).to(torch.float16))
    # an error of the program is raised as itself, nothing is swallowed
    if on:
        from torch_tpu import _C
        from torch_tpu.kernels import copy as copy_kernels

        def broken(dtype):
            def run(a):
                raise ValueError(f"cast to {dtype} failed")
            return run

        _C._set_casts(copy_kernels.CASTS[0], copy_kernels.CASTS[1], copy_kernels.CASTS[2], broken)
        with pytest.raises(ValueError, match="cast to torch.float16 failed"):
            tv.to(torch.float16)


def test_defer_and_fuse_records_the_cast() -> None:
    c = _source(torch.float32)
    t = c.to("tpu")
    torch.tpu.eager_mode = EagerMode.DEFER_AND_FUSE
    (t * 2).to(torch.bfloat16).cpu()  # the entries exist
    m0 = torch.tpu.metrics()
    y = (t * 2).to(torch.bfloat16).to(torch.float32) + 1
    assert torch.tpu.metrics().fused_graph_runs == m0.fused_graph_runs  # nothing ran yet
    torch.testing.assert_close(y.cpu(), (c * 2).to(torch.bfloat16).to(torch.float32) + 1, rtol=0, atol=0)
    m1 = torch.tpu.metrics()
    assert m1.fused_ops >= m0.fused_ops + 4 and m1.fused_graph_runs == m0.fused_graph_runs + 1



@pytest.mark.parametrize("mode", MODES)
def test_copies_to_the_host_match_cpu_and_are_private(mode, calls) -> None:
    torch.tpu.eager_mode = getattr(EagerMode, mode)
    n = 0
    dtypes = DTYPES + (torch.float64, torch.int16, torch.int8)
    for dtype in dtypes:
        c = _source(dtype, (4, 6)) if dtype != torch.int8 else _source(torch.int64, (4, 6)).to(dtype)
        t = c.to("tpu")
        views = {"whole": (t, c), "rows": (t[1:3], c[1:3]), "row": (t[2], c[2]), "0-d": (t[1, 2], c[1, 2]),
                 "empty": (t[:0], c[:0]), "reshaped": (t.reshape(3, 8), c.reshape(3, 8))}
        if dtype.is_floating_point:
            views["negative view"] = (torch._neg_view(t), torch._neg_view(c))
        if dtype.is_complex:
            views["conjugate view"] = (t.conj(), c.conj())
        for name, (tv, cv) in views.items():
            for got in (tv.cpu(), tv.to("cpu"), tv.to(device="cpu", dtype=dtype)):
                assert got.device.type == "cpu" and got.dtype == dtype and got.shape == cv.shape, name
                assert got.is_contiguous() and not got.is_conj() and not got.is_neg()
                assert torch.equal(got, cv), (dtype, name)
                n += 1
        host = t.cpu()
        host.zero_()  # the copy is the caller's own: the tpu tensor keeps its values
        assert torch.equal(t.cpu(), c)
        t.zero_()  # and a later write on tpu does not show through
        assert torch.equal(host, torch.zeros_like(c))
        n += 2
    # The whole tensor (three spellings, then the two reads of t) is read by the kernel itself, and so is a view
    # with a lazy bit (PyTorch's Negative/Conjugate fallback hands the kernel the bit applied, a new computed
    # array; under DEFER_AND_FUSE a recorded op still to run, which `_to_host` flushes); the other views by
    # `_to_host`: the storage's array is another shape, or starts elsewhere.
    reads = _kinds(calls, "read")
    lazy = 0 if mode == "DEFER_AND_FUSE" else sum(d.is_floating_point or d.is_complex for d in dtypes)
    assert len(reads) == 5 * len(dtypes) + 3 * lazy and all(r[1] == (4, 6) for r in reads), reads
    assert len(_kinds(calls, "host")) == n - len(reads)
    # Not this form: a cast on the way (CPU casts after the copy), a non-contiguous source (strides kept).
    c = _source(torch.float32, (2, 3, 4))
    t = c.to("tpu")
    before = len(calls)
    assert torch.equal(t.to("cpu", torch.float64), c.to(torch.float64))
    got = t.transpose(0, 2).cpu()
    assert got.stride() == c.transpose(0, 2).stride()
    assert torch.equal(got, c.transpose(0, 2))
    assert len(calls) == before


def test_the_host_copy_reads_pending_work_and_index_errors() -> None:
    torch.tpu.eager_mode = EagerMode.DEFER_AND_FUSE
    c = _source(torch.float32, (8,))
    t = c.to("tpu")
    y = (t * 2).exp()
    torch.testing.assert_close(y.cpu(), (c * 2).exp())  # the pending graph runs first
    torch.tpu.eager_mode = EagerMode.DEFER_NEVER
    bad = torch.tensor([0, 9], device="tpu")
    r = t[bad]
    with pytest.raises((IndexError, RuntimeError), match="(?i)index"):
        r.cpu()


@pytest.mark.parametrize("mode", MODES[:2])
def test_item_and_tolist_give_cpu_s_python_numbers(mode, calls) -> None:
    torch.tpu.eager_mode = getattr(EagerMode, mode)
    extra = (torch.float64, torch.int8, torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
             torch.float8_e5m2)
    for dtype in DTYPES + extra:
        c = _source(torch.float32, (2, 3)).abs().to(dtype) if dtype in extra else _source(dtype, (2, 3))
        t = c.to("tpu")
        before = len(_kinds(calls, "read"))
        # A whole one-element array (an upload, computed: the kernel reads it itself), views (`_item_host`).
        for tv, cv in ((c[1, 2].reshape(1).to("tpu"), c[1, 2]), (t[1, 2], c[1, 2]), (t[0, :1], c[0, :1]),
                       ((t * 1)[1, 1], (c * 1)[1, 1]) if dtype in (torch.float32, torch.int64, torch.complex64)
                       else (t[0, 0], c[0, 0])):
            got, want = tv.item(), cv.item()
            assert type(got) is type(want) and got == want, (dtype, got, want)
        assert len(_kinds(calls, "read")) == before + 1, dtype
        if dtype not in (torch.uint16, torch.uint32, torch.float8_e4m3fn, torch.float8_e5m2):  # (CPU has no tolist)
            assert t.tolist() == c.tolist(), dtype
