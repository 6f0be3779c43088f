"""The storage model: views share storage, dtype-reinterpreting views, resize_/set_, serialization, copies,
and freeing."""

from __future__ import annotations

import copy
import gc
import io

import torch

from conftest import rss_bytes


def _pair(shape=(3, 4), dtype=torch.float32):
    cpu = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).to(dtype)
    return cpu, cpu.to("tpu")


def test_views_share_storage() -> None:
    cpu, x = _pair()
    cpu[0].add_(1)
    x[0].add_(1)
    torch.testing.assert_close(x.cpu(), cpu)
    cpu.t()[1].mul_(10)
    x.t()[1].mul_(10)
    torch.testing.assert_close(x.cpu(), cpu)
    assert x[1].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert x[1].data_ptr() == x.data_ptr() + 4 * x.element_size()


def test_writes_through_strided_and_sliced_views() -> None:
    cpu, x = _pair((4, 6))
    for view in (lambda t: t[:, ::2], lambda t: t[1:3, 2:5], lambda t: t.t()[::3], lambda t: t.view(-1)[5:17:4],
                 lambda t: t.unfold(1, 2, 2), lambda t: t.diagonal()):
        view(cpu).mul_(-2).add_(0.5)
        view(x).mul_(-2).add_(0.5)
        torch.testing.assert_close(x.cpu(), cpu)
        torch.testing.assert_close(view(x).cpu(), view(cpu))


def test_reads_of_views() -> None:
    cpu, x = _pair((2, 3, 4))
    for view in (lambda t: t.permute(2, 0, 1), lambda t: t[:, 1], lambda t: t[..., ::2], lambda t: t.transpose(0, 2)[1:],
                 lambda t: t[0:1].expand(5, 3, 4), lambda t: t.as_strided((3, 3), (5, 2), 1), lambda t: t.flatten()[3:9]):
        torch.testing.assert_close(view(x).cpu(), view(cpu))
        torch.testing.assert_close((view(x) * 2).cpu(), view(cpu) * 2)


def test_dtype_reinterpreting_views() -> None:
    cpu, x = _pair((2, 4))
    torch.testing.assert_close(x.view(torch.int32).cpu(), cpu.view(torch.int32))
    torch.testing.assert_close(x.view(torch.uint8).cpu(), cpu.view(torch.uint8))
    torch.testing.assert_close(x.view(torch.int16)[:, 1::2].cpu(), cpu.view(torch.int16)[:, 1::2])
    # writing through a reinterpreting view changes the original
    cpu.view(torch.int32)[0, 1] = 0
    x.view(torch.int32)[0, 1] = 0
    torch.testing.assert_close(x.cpu(), cpu)
    b_cpu = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    b = b_cpu.to("tpu")
    torch.testing.assert_close(b.view(torch.int16).cpu(), b_cpu.view(torch.int16))
    d = torch.tensor([1.0, 2.0], dtype=torch.float64).to("tpu")
    torch.testing.assert_close(d.view(torch.float32).cpu(), torch.tensor([1.0, 2.0], dtype=torch.float64).view(torch.float32))


def test_resize() -> None:
    x = torch.arange(4.0, device="tpu")
    x.resize_(2, 2)
    assert x.shape == (2, 2)
    torch.testing.assert_close(x.cpu(), torch.arange(4.0).reshape(2, 2))
    x.resize_(3, 3)  # grows the storage, keeps the leading values
    assert x.shape == (3, 3) and x.untyped_storage().nbytes() == 36
    torch.testing.assert_close(x.view(-1)[:4].cpu(), torch.arange(4.0))
    x.resize_(1)
    torch.testing.assert_close(x.cpu(), torch.tensor([0.0]))
    s = torch.ones(3, device="tpu").untyped_storage()
    s.resize_(20)
    assert s.nbytes() == 20
    e = torch.empty(0, device="tpu")
    e.resize_(5)
    assert e.shape == (5,)
    e.fill_(2)
    torch.testing.assert_close(e.cpu(), torch.full((5,), 2.0))


def test_set_() -> None:
    x = torch.arange(6.0, device="tpu")
    y = torch.empty(0, device="tpu")
    y.set_(x.untyped_storage(), 2, (2, 2), (2, 1))
    torch.testing.assert_close(y.cpu(), torch.arange(6.0).as_strided((2, 2), (2, 1), 2))
    y.add_(1)
    torch.testing.assert_close(x.cpu(), torch.tensor([0.0, 1, 3, 4, 5, 6]))
    z = torch.empty(0, device="tpu").set_(x)
    assert z.is_set_to(x)
    w = torch.empty(0, device="tpu").set_(x.untyped_storage())
    assert w.shape == (6,)


def test_save_load_roundtrip() -> None:
    cpu, x = _pair((3, 4))
    payload = {"x": x, "row": x[1], "half": x.to(torch.bfloat16), "ints": torch.arange(5, device="tpu"),
               "mask": x > 3}
    buf = io.BytesIO()
    torch.save(payload, buf)
    buf.seek(0)
    back = torch.load(buf)
    assert back["x"].device.type == "tpu"
    torch.testing.assert_close(back["x"].cpu(), cpu)
    torch.testing.assert_close(back["row"].cpu(), cpu[1])
    torch.testing.assert_close(back["half"].cpu(), cpu.to(torch.bfloat16))
    torch.testing.assert_close(back["ints"].cpu(), torch.arange(5))
    torch.testing.assert_close(back["mask"].cpu(), cpu > 3)
    # the view still shares storage with its base after loading
    back["row"].fill_(0)
    assert back["x"].cpu()[1].eq(0).all()
    buf.seek(0)
    on_cpu = torch.load(buf, map_location="cpu")
    assert on_cpu["x"].device.type == "cpu"
    torch.testing.assert_close(on_cpu["x"], cpu)
    torch.testing.assert_close(on_cpu["half"], cpu.to(torch.bfloat16))


def test_load_cpu_checkpoint_to_tpu() -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.randn(4, 4)}, buf)
    buf.seek(0)
    w = torch.load(buf, map_location="tpu")["w"]
    assert w.device.type == "tpu"
    buf.seek(0)
    torch.testing.assert_close(w.cpu(), torch.load(buf)["w"])


def test_module_state_dict_roundtrip() -> None:
    m = torch.nn.Linear(4, 3).tpu()
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    m2 = torch.nn.Linear(4, 3).tpu()
    m2.load_state_dict(torch.load(buf))
    torch.testing.assert_close(m2.weight.cpu(), m.weight.cpu())


def test_deepcopy_and_clone() -> None:
    cpu, x = _pair()
    y = copy.deepcopy(x)
    assert y.device == x.device
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    y.add_(1)
    torch.testing.assert_close(x.cpu(), cpu)
    torch.testing.assert_close(y.cpu(), cpu + 1)
    z = x.clone()
    z.mul_(0)
    torch.testing.assert_close(x.cpu(), cpu)
    m = copy.deepcopy(torch.nn.Linear(2, 2).tpu())
    assert m.weight.device.type == "tpu"


def test_data_pointers_are_unique_and_inaccessible() -> None:
    xs = [torch.empty(16, device="tpu") for _ in range(8)]
    ptrs = {t.data_ptr() for t in xs}
    assert len(ptrs) == 8 and 0 not in ptrs


def test_no_growth_over_10000_create_free_cycles() -> None:
    torch.tpu.synchronize()
    def cycle(i: int) -> None:
        t = torch.randn(256, device="tpu")
        u = t[::2] * 2
        u.add_(1)
        if i % 100 == 0:
            u.cpu()

    for i in range(500):  # warm up caches (jit, address spans)
        cycle(i)
    gc.collect()
    torch.tpu.synchronize()
    base_live = torch.tpu.live_storages()
    base_rss = rss_bytes()
    for i in range(10_000):
        cycle(i)
    gc.collect()
    torch.tpu.synchronize()
    assert torch.tpu.live_storages() == base_live
    growth = rss_bytes() - base_rss
    assert growth < 32 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 10,000 cycles"
