"""Lazy conjugate and negative bits (`z.conj()`, `torch._neg_view`, `m.mH`) on tpu, against CPU.

PyTorch's Conjugate/Negative fallbacks resolve the bits for most ops, but let some reach the backend with the
bit set (dot, vdot, mm, addmm, bmm, baddbmm, copy_, linalg_vector_norm...): the storage layer resolves them where
a tensor's value is read (and applies them where one is written), so every kernel sees plain values. The cases
below cover the fallthrough ops, views of conjugates and conjugates of views, in-place writes into a conjugate
view, out=, copy_, and the fused and compiled executors.
"""

from __future__ import annotations

import pytest
import torch

EagerMode = torch.tpu.EagerMode


def _z(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.complex(torch.randn(*shape, generator=g), torch.randn(*shape, generator=g))


def _r(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def _neg(t: torch.Tensor) -> torch.Tensor:
    return torch._neg_view(t)


# Each case: f(*tensors) on CPU inputs and on the same tpu inputs; the lazy bits are made inside f, on the device.
CASES = {
    "dot_conj": (lambda z, w: torch.dot(z, z.conj()), (_z(7), _z(7, seed=1))),
    "dot_conj_other": (lambda z, w: torch.dot(z.conj(), w), (_z(7), _z(7, seed=1))),
    "vdot_conj": (lambda z, w: torch.vdot(z.conj(), w.conj()), (_z(7), _z(7, seed=1))),
    "matmul_1d": (lambda z, w: z @ w.conj(), (_z(7), _z(7, seed=1))),
    "mm_conj": (lambda m, n: m @ m.conj(), (_z(4, 4), _z(4, 4, seed=1))),
    "mm_mH": (lambda m, n: m @ m.mH, (_z(4, 3), _z(4, 3, seed=1))),
    "mm_mH_left": (lambda m, n: m.mH @ n, (_z(4, 3), _z(4, 3, seed=1))),
    "mv_conj": (lambda m, v: m.conj() @ v[:4].conj(), (_z(3, 4), _z(6, seed=1))),
    "bmm_conj": (lambda a, b: torch.bmm(a.conj(), b.mH), (_z(2, 3, 4), _z(2, 5, 4, seed=1))),
    "addmm_conj": (lambda c, m: torch.addmm(c.conj(), m, m.mH), (_z(3, 3), _z(3, 5, seed=1))),
    "baddbmm_conj": (lambda c, a: torch.baddbmm(c.conj(), a, a.mH.conj()), (_z(2, 3, 3), _z(2, 3, 4, seed=1))),
    "einsum_conj": (lambda a, b: torch.einsum("ij,jk->ik", a.conj(), b), (_z(3, 4), _z(4, 2, seed=1))),
    "vector_norm_conj": (lambda z, w: torch.linalg.vector_norm(z.conj() + 0 * w.conj(), 3), (_z(5), _z(5, seed=1))),
    "mul_add_sum": (lambda z, w: (z.conj() * w + w.conj()).sum(), (_z(5), _z(5, seed=1))),
    "conj_of_view": (lambda m, n: m[1:, ::2].conj() @ n[::2, :2], (_z(4, 6), _z(6, 4, seed=1))),
    "view_of_conj": (lambda m, n: m.conj()[1:, ::2].t() @ n[:3, :3], (_z(4, 6), _z(6, 4, seed=1))),
    "transpose_conj_matmul": (lambda m, n: m.conj().transpose(0, 1) @ n, (_z(4, 3), _z(4, 2, seed=1))),
    "clone_contiguous": (lambda m, n: m.conj().t().contiguous() + m.conj().clone().t(), (_z(3, 3), _z(3, 3))),
    "resolve_conj": (lambda m, n: m.conj().resolve_conj(), (_z(3, 3), _z(3, 3))),
    "real_imag": (lambda m, n: torch.stack([m.conj().imag, m.conj().real, n.conj().imag]), (_z(3, 3), _z(3, 3, seed=1))),
    "cat_conj": (lambda m, n: torch.cat([m.conj(), n]), (_z(2, 3), _z(2, 3, seed=1))),
    "neg_mm": (lambda a, b: _neg(a) @ b, (_r(3, 4), _r(4, 2, seed=1))),
    "neg_dot": (lambda a, b: torch.dot(_neg(a), b), (_r(5), _r(5, seed=1))),
    "neg_view_slice": (lambda a, b: _neg(a)[::2] @ _neg(b)[:, 1:], (_r(4, 4), _r(4, 3, seed=1))),
    "neg_addmm": (lambda c, a: torch.addmm(_neg(c), _neg(a), a.t()), (_r(3, 3), _r(3, 2, seed=1))),
    "neg_conj_imag": (lambda m, n: m.conj().imag @ n.real, (_z(3, 3), _z(3, 3, seed=1))),  # imag of conj: a neg view
    "neg_view_copy": (lambda m, n: m.conj().imag.clone(), (_z(3, 3), _z(3, 3))),
}


@pytest.mark.parametrize("mode", [EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE])
@pytest.mark.parametrize("name", list(CASES))
def test_lazy_bits_match_cpu(name: str, mode: EagerMode) -> None:
    f, args = CASES[name]
    want = f(*args)
    dev = [a.to("tpu") for a in args]
    saved = torch.tpu.eager_mode
    torch.tpu.eager_mode = mode
    try:
        got = f(*dev)
        got = got.cpu().to("tpu")  # materialize under DEFER_AND_FUSE before leaving the mode
    finally:
        torch.tpu.eager_mode = saved
    _same(got, want)


def test_fast_path_cache_hit_sees_the_bit() -> None:
    """The eager executor caches a program per argument layout; a call with a conjugate (same shapes and dtypes)
    must not reuse the plain call's fast path on the raw storage."""
    a, b = _z(4, 4), _z(4, 4, seed=1)
    da, db = a.to("tpu"), b.to("tpu")
    for _ in range(3):
        _same(da @ db, a @ b)
        _same(da @ db.conj(), a @ b.conj())
        _same(torch.dot(da[0], db[0].conj()), torch.dot(a[0], b[0].conj()))
        _same(da.conj() + db, a.conj() + b)


def test_inplace_into_conj_and_neg_views() -> None:
    """Writing through a conjugate (negative) view stores the conjugate (negation): the base reads as CPU's."""
    for op in (lambda v: v.mul_(2 + 1j), lambda v: v.add_(1j), lambda v: v.copy_(torch.full_like(v, 3 - 2j)),
               lambda v: v.zero_(), lambda v: v.addmm_(v, v)):
        z = _z(3, 3)
        dz = z.to("tpu")
        op(z.conj())
        op(dz.conj())
        _same(dz, z)
    r = _r(3, 3)
    dr = r.to("tpu")
    for t in (r, dr):
        _neg(t).add_(1.5)
        _neg(t)[0].copy_(torch.arange(3.0, device=t.device))
    _same(dr, r)


def test_out_and_copy_between_bits() -> None:
    z, w = _z(3, 3), _z(3, 3, seed=1)
    dz, dw = z.to("tpu"), w.to("tpu")
    out, dout = torch.empty(3, 3, dtype=torch.cfloat), torch.empty(3, 3, dtype=torch.cfloat, device="tpu")
    torch.mm(z.conj(), w, out=out)
    torch.mm(dz.conj(), dw, out=dout)
    _same(dout, out)
    # out= tensor that is itself a conjugate view
    base, dbase = torch.zeros(3, 3, dtype=torch.cfloat), torch.zeros(3, 3, dtype=torch.cfloat, device="tpu")
    torch.mm(z, w.conj(), out=base.conj())
    torch.mm(dz, dw.conj(), out=dbase.conj())
    _same(dbase, base)
    # copy_ across every bit combination, both directions, and to the host
    for src_bit in (False, True):
        for dst_bit in (False, True):
            dst, ddst = torch.zeros(3, 3, dtype=torch.cfloat), torch.zeros(3, 3, dtype=torch.cfloat, device="tpu")
            (dst.conj() if dst_bit else dst).copy_(z.conj() if src_bit else z)
            (ddst.conj() if dst_bit else ddst).copy_(dz.conj() if src_bit else dz)
            _same(ddst, dst)
            host = torch.zeros(3, 3, dtype=torch.cfloat)
            (host.conj() if dst_bit else host).copy_(dz.conj() if src_bit else dz)
            torch.testing.assert_close(host, dst)
    torch.testing.assert_close(dz.conj().cpu(), z.conj())
    torch.testing.assert_close(_neg(dz.real).cpu(), -z.real)
    assert dz.conj()[0, 1].item() == z.conj()[0, 1].item()


def test_compiled_graph_with_conj_inputs() -> None:
    z, w = _z(4, 4), _z(4, 4, seed=1)
    f = torch.compile(lambda a, b: a @ b + a.sum(), backend="tpu", fullgraph=False)
    dz, dw = z.to("tpu"), w.to("tpu")
    _same(f(dz.conj(), dw), z.conj() @ w + z.conj().sum())
    _same(f(dz, dw.conj()), z @ w.conj() + z.sum())


def test_autograd_through_conj_matmul() -> None:
    """Complex backward of mm produces conjugated operands (grad @ b.mH): it must match CPU."""
    z, w = _z(3, 4), _z(4, 2, seed=1)
    grads = []
    for dev in ("cpu", "tpu"):
        a = z.detach().to(dev).requires_grad_()
        b = w.detach().to(dev).requires_grad_()
        (a @ b.conj()).abs().sum().backward()
        grads.append((a.grad.cpu(), b.grad.cpu()))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-5, atol=1e-5)


# ---- every OpInfo: a conjugate (complex64) or negative (float32) view gives CPU's result ----

_RANDOM = ("normal", "bernoulli", "multinomial", "uniform", "cauchy", "exponential", "geometric", "log_normal")


def _bit_sweep(kind: str) -> tuple[int, list[str]]:
    """For each OpInfo's first sample: every floating (complex) tensor argument turned into a negative
    (conjugate) view, on both devices. Compared where the op already agrees with CPU on plain tensors holding the
    same values (the bit resolved first): (samples compared, the ones that differ)."""
    import opinfo_harness as H
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.utils._pytree import tree_flatten, tree_map

    dtype = torch.complex64 if kind == "conj" else torch.float32

    def bit(x):
        if not isinstance(x, torch.Tensor):
            return x
        if kind == "conj":
            return x.conj() if x.is_complex() else x
        return torch._neg_view(x) if x.is_floating_point() else x

    def resolved(x):
        return x.resolve_conj().resolve_neg() if isinstance(x, torch.Tensor) else x

    def run(op, s, dev, lazy):
        args = (s.input, s.args, s.kwargs)
        if dev == "tpu":
            args = tree_map(H._to_tpu, args)
        args = tree_map(bit, args)
        if not lazy:
            args = tree_map(resolved, args)
        torch.manual_seed(0)
        out = op(args[0], *args[1], **args[2])
        return [o.detach().cpu() if isinstance(o, torch.Tensor) else o for o in tree_flatten(out)[0]]

    def same(a, b):
        if len(a) != len(b):
            return False
        for x, y in zip(a, b):
            if isinstance(x, torch.Tensor):
                try:
                    torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4, equal_nan=True)
                except (AssertionError, TypeError):
                    return False
        return True

    compared, differ = 0, []
    for op in op_db:
        if (dtype not in op.supported_dtypes("cpu") or "dropout" in op.name or "empty" in op.name
                or any(r in op.name for r in _RANDOM) or op.name.endswith("_like")):
            continue
        try:
            torch.manual_seed(0)
            sample = next(iter(op.sample_inputs("cpu", dtype)))
            if not same(run(op, sample, "cpu", False), run(op, sample, "tpu", False)):
                continue  # not this test's concern: plain inputs already differ (the OpInfo suite's job)
            want = run(op, sample, "cpu", True)
        except Exception:
            continue
        compared += 1
        try:
            ok = same(want, run(op, sample, "tpu", True))
            why = "values differ"
        except Exception as e:  # noqa: BLE001 - an error where CPU computes is a difference too
            ok, why = False, f"{type(e).__name__}: {str(e)[:120]}"
        if not ok:
            differ.append(f"{op.name}.{op.variant_test_name}: {why}")
    return compared, differ


@pytest.mark.extended  # every OpInfo four times (3-4 minutes): the cases above cover the ops the bits reach
@pytest.mark.parametrize("kind", ["conj", "neg"])
def test_every_opinfo_with_lazy_bit_inputs(kind: str) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compared, differ = _bit_sweep(kind)
    assert compared > 250, compared  # the sweep reaches most of the suite's ops
    assert differ == [], differ
