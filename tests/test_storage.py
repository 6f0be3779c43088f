"""The storage model: views share storage, dtype-reinterpreting views, resize_/set_, serialization, copies,
and freeing."""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch

from conftest import rss_bytes, run_python


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


# Views by geometry (sizes, strides, storage offset) of a storage of n elements: strided slices of dense blocks (read
# and written as slices of the block, _storage._block_plan), and views that are not (overlapping, stride 0, strides
# that do not nest: an element gather). Each written view has no two elements at one address.
_GEOMETRIES = [
    ((4, 4, 64, 16), (8192, 32, 128, 1), 16, 32768),  # q[..., 16:] of q = x.view(4, 64, 4, 32).transpose(1, 2)
    ((4, 4, 64, 16), (8192, 2048, 32, 1), 0, 32768),  # the first half of a contiguous tensor's last dim
    ((4, 64), (65, 1), 1, 260),  # labels[:, 1:] of a (4, 65) tensor
    ((3, 5), (12, 2), 3, 36),  # [:, 1::2][:, 1:] of a (3, 12) tensor: a stride and an offset within it
    ((2, 3, 2), (1, 8, 4), 0, 24),  # a permuted dense block
    ((3, 2), (4, 1), 2, 12),  # the last row reaches the storage's end
    ((3, 2), (4, 1), 0, 10),  # the storage ends before the last row's unused tail
    ((2, 1, 3), (6, 9, 2), 1, 12),  # a size-1 dim with an unrelated stride
    ((3, 3), (3, 2), 0, 11),  # strides that do not nest: gathered
    ((3, 3), (1, 1), 0, 5),  # overlapping (read only): gathered
    ((2, 3), (0, 2), 1, 6),  # stride 0 (read only)
]


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
@pytest.mark.parametrize("sizes,strides,offset,n", _GEOMETRIES)
def test_views_of_every_geometry_read_and_write_like_cpu(sizes, strides, offset, n, mode) -> None:
    base_cpu = torch.randn(n, generator=torch.Generator().manual_seed(n))
    with torch.tpu.set_eager_mode(mode):
        base = base_cpu.to("tpu")
        view = base.as_strided(sizes, strides, offset)
        want = base_cpu.as_strided(sizes, strides, offset)
        torch.testing.assert_close(view.cpu(), want, rtol=0, atol=0)
        torch.testing.assert_close((view * 2 + 1).cpu(), want * 2 + 1)
        address = torch.arange(n).as_strided(sizes, strides, offset).reshape(-1)
        if len(set(address.tolist())) == address.numel():
            value = torch.randn(sizes, generator=torch.Generator().manual_seed(1))
            view.copy_(value.to("tpu"))
            want.copy_(value)
            torch.testing.assert_close(base.cpu(), base_cpu, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_a_reshaping_view_over_its_whole_storage_is_read_whole_after_its_first_read(mode) -> None:
    # A Linear's bias gradient is `sum(0, keepdim=True).view(n)` with the (1, n) tensor gone: an (n,) tensor alone
    # over a (1, n) array. Its first read keeps the storage's array in its shape, later reads take the whole-array
    # path; values and writes through it and through a new base agree with CPU. While another tensor views the
    # storage, reads of the view leave the array alone (the other tensor keeps its whole-array path).
    from torch_tpu import _C

    cpu_base = torch.arange(12.0).reshape(1, 12)
    with torch.tpu.set_eager_mode(mode):
        view = (cpu_base.to("tpu") * 1).view(12).detach()  # (the (1, 12) tensor gone, as in autograd's sum_to_size)
        assert _C._array(view) is None  # another shape than the array: read through a reshape
        torch.testing.assert_close(torch._foreach_mul([view], 2.0)[0].cpu(), cpu_base.view(12) * 2)
        assert _C._array(view) is not None  # the array now has the view's shape
        base = view.view(1, 12)
        assert _C._array(base) is None
        torch.testing.assert_close(base.cpu(), cpu_base)
        view.add_(1)
        base.mul_(3)
        torch.testing.assert_close(view.cpu(), (cpu_base.view(12) + 1) * 3)
        torch.testing.assert_close(base.cpu(), (cpu_base + 1) * 3)

        shared = cpu_base.to("tpu") * 1  # alive beside its view: the view's reads do not move the array
        flat = shared.view(12)
        for _ in range(2):
            torch.testing.assert_close(torch._foreach_mul([flat], 2.0)[0].cpu(), cpu_base.view(12) * 2)
            assert _C._array(shared) is not None and _C._array(flat) is None
        strided = shared.view(3, 4).t()  # not contiguous: read through the reader, the array keeps its shape
        torch.testing.assert_close(strided.cpu(), cpu_base.view(3, 4).t())
        assert tuple(_C._storage_array(shared)[0].shape) == (1, 12)


def test_strided_slices_read_and_write_without_an_element_gather() -> None:
    """Rotary embeddings slice a transposed tensor (`q[..., :d // 2]`) in every Hugging Face attention layer: the
    programs read and write such views as slices of a dense block. An element gather or scatter over the storage
    is slow on XLA:CPU and far slower on a TPU."""
    from torch_tpu import _storage
    from torch_tpu._jax import jax, jnp

    flat = jax.ShapeDtypeStruct((32768,), jnp.float32)
    for geom in (((4, 4, 64, 16), (8192, 32, 128, 1), 16), ((4, 64), (65, 1), 1), ((3, 5), (12, 2), 3)):
        read = jax.jit(lambda f, g=geom: _storage._read_flat(f, *g)).lower(flat).as_text()
        write = jax.jit(_storage._writer((32768,), jnp.float32, jnp.float32, geom)).lower(
            flat, jax.ShapeDtypeStruct(geom[0], jnp.float32)).as_text()
        assert "gather" not in read and "scatter" not in write, geom
    # the fallback stays for views that are not such slices
    read = jax.jit(lambda f: _storage._read_flat(f, (3, 3), (1, 1), 0)).lower(flat).as_text()
    assert "gather" in read


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64,
                                   torch.float8_e4m3fn])
@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_host_uploads_are_private_copies_with_every_value_and_dtype(dtype, mode) -> None:
    # _runtime.put hands host arrays to the C++ transfer under jax.device_put: the device array must be what
    # jax.device_put makes (committed to the device, the tensor's dtype and shape) and must not alias the host
    # memory (XLA:CPU can alias an aligned host buffer; torch may write its memory after the copy).
    import jax

    from torch_tpu import _C, _executor, _runtime

    cpu = (torch.arange(24, dtype=torch.float64).reshape(2, 3, 4) - 7).to(dtype)
    sources = [cpu, cpu[:, 1:, ::2], cpu.transpose(0, 2), cpu[0, 0, 0], cpu[:0], torch.empty(0, 5, dtype=dtype)]
    if dtype.is_complex:
        sources.append(cpu.conj())
    with torch.tpu.set_eager_mode(mode):
        for src in sources:
            expected = src.clone()
            dev = src.to("tpu")
            # (the storage's array; a permuted source keeps its strides on tpu, and DEFER_AND_FUSE records that copy)
            arr = _executor.concrete(_C._storage_array(dev)[0])
            assert arr.committed and arr.devices() == {_runtime.device(0)}
            assert arr.size == src.numel() and arr.dtype == jax.numpy.dtype(_runtime.jax_dtype(dtype))
            host_bytes = torch.tensor([], dtype=torch.uint8).set_(src.untyped_storage())
            host_bytes.bitwise_not_()  # every byte of the host memory changes after the copy...
            back = dev.cpu()
            host_bytes.bitwise_not_()  # (...and back, for the next source)
            assert back.dtype == dtype and back.shape == expected.shape
            if dtype == torch.float8_e4m3fn:  # (CPU torch compares no float8 values: compare their bytes)
                back, expected = back.view(torch.uint8), expected.view(torch.uint8)
            assert torch.equal(back, expected.resolve_conj()), (src.shape, src.stride())
        built = torch.tensor([], dtype=dtype, device="tpu")  # (what HF's DynamicCache makes each step)
        assert built.shape == (0,) and built.dtype == dtype and built.device.type == "tpu"


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


# ---- data pointers: unique names that fault on a stray CPU read, with or without an address-space limit ----

_BASELINE = """
import torch, jax, jax.numpy as jnp
jnp.ones(3).block_until_ready(); (torch.ones(3) + 1).sum()
with open('/proc/self/status') as f:
    print(next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmPeak')))
"""


def _limited(code: str, limit: int | None, timeout: int = 300):
    """Runs `code` in a fresh interpreter under RLIMIT_AS=`limit` (None: unlimited)."""
    if limit is None:
        return run_python(code, timeout=timeout)
    wrapper = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))\n"
    return run_python(wrapper + f"exec({code!r})", timeout=timeout)


def _baseline_peak() -> int:
    r = _limited(_BASELINE, None)
    assert r.returncode == 0, r.stderr[-3000:]
    return int(r.stdout.split()[-1])


_STRAY_READ = """
import ctypes, torch
t = torch.arange(1000, dtype=torch.float32, device='tpu')
p = t[10:].data_ptr()
maps = [l.split() for l in open('/proc/self/maps')]
inside = [m[1] for m in maps if int(m[0].split('-')[0], 16) <= p < int(m[0].split('-')[1], 16)]
print('MAPPING', inside, hex(p), flush=True)
ctypes.string_at(p, 4)
print('READ SUCCEEDED', flush=True)
"""


def test_stray_cpu_read_of_a_tpu_pointer_faults_without_a_limit() -> None:
    r = _limited(_STRAY_READ, None)
    assert "MAPPING ['---p']" in r.stdout, r.stdout + r.stderr[-2000:]  # inside the PROT_NONE reservation
    assert "READ SUCCEEDED" not in r.stdout and r.returncode == -11, (r.returncode, r.stdout, r.stderr[-2000:])


def test_stray_cpu_read_of_a_tpu_pointer_faults_under_an_address_space_limit() -> None:
    r = _limited(_STRAY_READ, _baseline_peak() + (2 << 30))
    assert "MAPPING []" in r.stdout, r.stdout + r.stderr[-2000:]  # a non-canonical address: no mapping at all
    assert "READ SUCCEEDED" not in r.stdout and r.returncode == -11, (r.returncode, r.stdout, r.stderr[-2000:])


_UNDER_LIMIT = """
import torch
cpu = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))  # 64 MiB
x = cpu.to('tpu')
torch.testing.assert_close((x * 2 + 1).sum(0).cpu(), (cpu * 2 + 1).sum(0))
torch.testing.assert_close((x @ x[:64].T).cpu(), cpu @ cpu[:64].T, rtol=1e-4, atol=1e-3)
base = x.data_ptr()
for v, c in ((x[100:200], cpu[100:200]), (x[:, 5], cpu[:, 5]), (x.T[3], cpu.T[3]),
             (x.view(-1)[12345:], cpu.view(-1)[12345:]), (x[-1, -1:], cpu[-1, -1:])):
    assert v.data_ptr() == base + v.storage_offset() * 4
    assert base <= v.data_ptr() < base + x.untyped_storage().nbytes()
    torch.testing.assert_close(v.cpu(), c)
    torch.testing.assert_close((v + 1).cpu(), c + 1)
x[7].fill_(3.0); cpu[7].fill_(3.0)
torch.testing.assert_close(x.cpu(), cpu)
# spans of live storages are disjoint: no tensor's range overlaps another's
ts = [torch.empty(n, device='tpu') for n in range(1, 2000)] + [x]
spans = sorted((t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in ts)
assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
del ts
# freed spans are reused, so create/free cycles do not exhaust anything
for i in range(20000):
    torch.empty(1 + i % 97, device='tpu')
print('OK')
"""


def test_allocates_and_computes_under_an_address_space_limit() -> None:
    # The limit leaves ~2 GiB above what torch and JAX themselves take: before, no tpu tensor could be
    # allocated (the allocator insisted on reserving at least 64 GiB of address space).
    r = _limited(_UNDER_LIMIT, _baseline_peak() + (2 << 30))
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-4000:]


def test_same_program_without_a_limit() -> None:
    r = _limited(_UNDER_LIMIT, None)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-4000:]
