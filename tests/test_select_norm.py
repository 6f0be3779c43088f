"""topk through XLA's TopK (float32, bfloat16, float16), sort through one packed key per element on XLA:CPU, and vector
norms whose order is chosen on the device, against CPU PyTorch. tpu's topk orders equal elements by index (a stable
order), so its oracle is CPU's stable sort cut to k: values and indices bit for bit, NaN (either sign) largest, -0.0
equal to 0.0 and returned as itself."""

from __future__ import annotations

import pytest
import torch

MODES = ("DEFER_NEVER", "DEFER_AND_FUSE")


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    same = ((a == b) & (a.signbit() == b.signbit())) | (a.isnan() & b.isnan())
    return bool(same.all())


def _edge_rows(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 48, generator=g).to(dtype)
    x[0, 3], x[0, 7], x[0, 11] = float("nan"), -float("nan"), float("nan")
    x[1, :12] = 1.0  # ties
    x[2, :6] = -0.0
    x[2, 6:12] = 0.0
    x[3, 2], x[3, 9], x[3, 20] = float("inf"), -float("inf"), float("inf")
    x[4] = (x[4] * 2).round()  # many ties
    x[5] = float("nan")
    return x


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32], ids=str)
def test_topk_is_the_stable_sort_cut_to_k(dtype: torch.dtype, mode: str) -> None:
    x = _edge_rows(torch.float32)
    x = x.nan_to_num(0.0).round().to(dtype) if not dtype.is_floating_point else x.to(dtype)
    t = x.to("tpu")
    for dim in (1, 0):
        for largest in (True, False):
            for k in (1, 5, x.shape[dim]):
                want_v, want_i = torch.sort(x, stable=True, dim=dim, descending=largest)
                want_v, want_i = want_v.narrow(dim, 0, k), want_i.narrow(dim, 0, k)
                with torch.tpu.set_eager_mode(mode):
                    v, i = t.topk(k, dim, largest)
                    v, i = v.cpu(), i.cpu()
                case = (dim, largest, k)
                assert torch.equal(i, want_i), case
                if dtype.is_floating_point:
                    assert _bits_equal(v.double(), want_v.double()), case
                else:
                    assert torch.equal(v, want_v), case


SORT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int16, torch.int8,
               torch.uint8, torch.bool, torch.int64]


def _sort_input(dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return _edge_rows(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (7, 48), generator=torch.Generator().manual_seed(2)).bool()
    info = torch.iinfo(dtype)
    x = torch.randint(max(info.min, -20), min(info.max, 20), (7, 48), generator=torch.Generator().manual_seed(2))
    x = x.to(dtype)
    x[0, 0], x[0, 1], x[1, 5] = info.min, info.max, info.min  # the ends of the range (the key's offset)
    return x


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", SORT_DTYPES, ids=str)
def test_sort_and_argsort_are_cpus_stable_sort(dtype: torch.dtype, mode: str) -> None:
    # XLA:CPU sorts dtypes of up to 32 bits as one uint64 per element (order key, index): values and indices must
    # be CPU's stable sort bit for bit, NaNs of both signs last (first descending), -0.0 tied with 0.0 by index
    x = _sort_input(dtype)
    for dim in (1, 0):
        for descending in (False, True):
            with torch.tpu.set_eager_mode(mode):
                t = x.to("tpu")
                v, i = torch.sort(t, dim=dim, descending=descending, stable=True)
                a = torch.argsort(t, dim=dim, descending=descending, stable=True)
                v, i, a = v.cpu(), i.cpu(), a.cpu()
            want_v, want_i = torch.sort(x, dim=dim, descending=descending, stable=True)
            assert torch.equal(i, want_i), (dim, descending)
            assert torch.equal(a, want_i), (dim, descending)
            assert _bits_equal(v, want_v) if dtype.is_floating_point else torch.equal(v, want_v), (dim, descending)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32], ids=str)
def test_sort_of_a_vocabulary_row_and_its_uses(dtype: torch.dtype) -> None:
    # top-p sampling's sort of a vocabulary-sized row; median, kthvalue and unique take the same sort
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 32000, generator=g) * 100).to(dtype)
    t = x.to("tpu")
    v, i = torch.sort(t, descending=True)
    want_v, want_i = torch.sort(x, descending=True, stable=True)
    assert torch.equal(v.cpu(), want_v) and torch.equal(i.cpu(), want_i)
    assert torch.equal(t.median(dim=-1).values.cpu(), x.median(dim=-1).values)
    assert torch.equal(t.kthvalue(100, dim=-1).values.cpu(), x.kthvalue(100, dim=-1).values)
    assert torch.equal(torch.unique(t).cpu(), torch.unique(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_topk_of_distinct_values_matches_cpu(dtype: torch.dtype) -> None:
    # distinct values leave no freedom: CPU's own topk is the oracle, a vocabulary-sized row included
    g = torch.Generator().manual_seed(0)
    n = 8000 if dtype == torch.float32 else 200  # (bfloat16 holds the integers up to 256 exactly)
    x = (torch.stack([torch.randperm(n, generator=g) for _ in range(4)]).float() - n // 2).to(dtype)
    for k, largest in ((50, True), (1, True), (7, False)):
        v, i = x.to("tpu").topk(k, -1, largest)
        want_v, want_i = x.topk(k, -1, largest)
        assert torch.equal(v.cpu(), want_v) and torch.equal(i.cpu(), want_i), (k, largest)


@pytest.mark.parametrize("mode", MODES)
def test_vector_norm_orders(mode: str) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 33, generator=g)
    x[0, :5] = 0.0
    t = x.to("tpu")
    for ord_ in (2, 1, 0, float("inf"), -float("inf"), 3, 0.5, -1, 1.5):
        for dim in (-1, None, (0, 1)):
            with torch.tpu.set_eager_mode(mode):
                got = torch.linalg.vector_norm(t, ord=ord_, dim=dim).cpu()
            torch.testing.assert_close(got, torch.linalg.vector_norm(x, ord=ord_, dim=dim),
                                       msg=lambda m, o=ord_, d=dim: f"ord {o}, dim {d}: {m}")


def test_vector_norm_new_order_does_not_compile() -> None:
    t = torch.randn(5, 9, device="tpu")
    torch.linalg.vector_norm(t, 2.0, -1).cpu()  # (an int order is another key: a Python scalar's type is static)
    before = torch.tpu.metrics().compiles
    for ord_ in (1.0, 3.0, float("inf"), 0.5, -float("inf")):
        torch.linalg.vector_norm(t, ord_, -1).cpu()
    assert torch.tpu.metrics().compiles == before


def test_clip_grad_norm_matches_cpu() -> None:
    # the norm every clipped training step takes (Hugging Face's Trainer clips at 1.0 by default)
    torch.manual_seed(3)
    cpu = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    tpu = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    tpu.load_state_dict(cpu.state_dict())
    tpu.to("tpu")
    x = torch.randn(8, 16)
    cpu(x).square().sum().backward()
    tpu(x.to("tpu")).square().sum().backward()
    for norm_type in (2.0, float("inf"), 1.0):
        want = torch.nn.utils.clip_grad_norm_(cpu.parameters(), 0.5, norm_type)
        got = torch.nn.utils.clip_grad_norm_(tpu.parameters(), 0.5, norm_type)
        torch.testing.assert_close(got.cpu(), want)
        for a, b in zip(tpu.parameters(), cpu.parameters()):
            torch.testing.assert_close(a.grad.cpu(), b.grad)
