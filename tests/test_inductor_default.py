"""Default torch.compile (Inductor) on tpu tensors, and Inductor's tpu contract
(torch_tpu._internal.pallas.tpu_torch_pallas).

- tpu_torch_pallas: register/lookup/call with small jax.export'ed modules (exported for this platform, which goes
  through the same code path as a TPU module on a TPU), donation only where the storage holds the only reference,
  errors naming the kernel and shapes, and a Mosaic (Pallas TPU) module refused on XLA:CPU with a clear error.
- Routing: on XLA:CPU, `torch.compile(model)` sends graphs with tpu tensors to the `tpu` backend; the MLP and GPT
  examples train like eager within 1e-5 and exactly like backend="tpu"; TORCH_TPU_INDUCTOR=pallas sends them to
  Inductor's Pallas code generator, whose generated code reaches tpu_torch_pallas and is refused there.
- A Hugging Face Llama (random init, tiny config) runs `generate` compiled like eager (skips without transformers).
"""

from __future__ import annotations

import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from conftest import REPO, load_example

from torch_tpu._internal.pallas import tpu_torch_pallas as ttp

sys.path.insert(0, str(REPO / "examples"))


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _export(fn, *shapes, platform="cpu", dtype=jnp.float32) -> bytes:
    specs = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    return jax.export.export(jax.jit(fn), platforms=[platform])(*specs).mlir_module_serialized


# ---- tpu_torch_pallas ----

def test_register_lookup_call_match_cpu() -> None:
    name, key = "k_sin_add", "k_sin_add_out_4_8_in_4_8x4_8"
    assert not ttp.lookup_custom_kernel(name, key)
    ttp.register_custom_kernel(name, key, serialized_mlir_module=_export(lambda x, y: (jnp.sin(x) + y, x * y),
                                                                         (4, 8), (4, 8)))
    assert ttp.lookup_custom_kernel(name, key)
    assert not ttp.lookup_custom_kernel(name, "other shapes")
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(2):  # the second call reuses the compiled executable
        outs = ttp.call_custom_kernel(name, key, inputs=[x.to("tpu"), y.to("tpu")],
                                      output_shapes=[torch.empty(4, 8, device="tpu")] * 2, donate_argnums=[])
        assert [o.device.type for o in outs] == ["tpu", "tpu"]
        torch.testing.assert_close(outs[0].cpu(), torch.sin(x) + y)
        torch.testing.assert_close(outs[1].cpu(), x * y)
    assert len(ttp._KERNELS[(name, key)].compiled) == 1
    # positional module (the generated code's fallback form) is accepted; a second register keeps the first
    ttp.register_custom_kernel(name, key, _export(lambda x, y: (x, y), (4, 8), (4, 8)))
    again = ttp.call_custom_kernel(name, key, inputs=[x.to("tpu"), y.to("tpu")],
                                   output_shapes=[torch.empty(4, 8, device="tpu")] * 2)
    torch.testing.assert_close(again[1].cpu(), x * y)


def test_int64_output_of_a_32_bit_module() -> None:
    """Inductor's tpu code exports with x64 off (int64 -> int32) and asks for the tensor dtype it wants."""
    name = "k_iota"
    with jax.enable_x64(False):
        mod = _export(lambda x: x + 1, (5,), dtype=jnp.int32)
    x = torch.arange(5, dtype=torch.int32, device="tpu")
    jax.config.update("jax_enable_x64", False)  # as the generated code leaves it after exporting
    assert not ttp.lookup_custom_kernel(name, "5")
    assert jax.config.jax_enable_x64  # turned back on at once: tpu tensors need it
    ttp.register_custom_kernel(name, "5", serialized_mlir_module=mod)
    out, = ttp.call_custom_kernel(name, "5", inputs=[x],
                                  output_shapes=[torch.empty(5, dtype=torch.int64, device="tpu")])
    assert out.dtype == torch.int64
    torch.testing.assert_close(out.cpu(), torch.arange(1, 6))


def test_donation_only_of_a_sole_reference() -> None:
    name, key = "k_scale", "16"
    ttp.register_custom_kernel(name, key, serialized_mlir_module=_export(lambda o, x: o + 2 * x, (16,), (16,)))
    x = torch.arange(16.0, device="tpu")
    buf = torch.ones(16, device="tpu")
    view = buf.view(4, 4)  # views share the storage: they see the donated buffer's new value
    out, = ttp.call_custom_kernel(name, key, inputs=[buf, x], output_shapes=[torch.empty(16, device="tpu")],
                                  donate_argnums=[0])
    expect = 1 + 2 * torch.arange(16.0)
    torch.testing.assert_close(out.cpu(), expect)
    torch.testing.assert_close(buf.cpu(), expect)  # the donated input holds its result, not a deleted array
    torch.testing.assert_close(view.cpu(), expect.view(4, 4))
    assert (name, key, (0,)) == (name, key, next(iter(ttp._KERNELS[(name, key)].compiled))[1])
    # An array something else still references is never donated: it stays readable.
    from torch_tpu import _storage

    held = _storage.read(buf)
    out2, = ttp.call_custom_kernel(name, key, inputs=[buf, x], output_shapes=[torch.empty(16, device="tpu")],
                                   donate_argnums=[0])
    torch.testing.assert_close(torch.from_numpy(np.array(held)), expect)
    torch.testing.assert_close(out2.cpu(), expect + 2 * torch.arange(16.0))
    assert any(d == () for _, d, _ in ttp._KERNELS[(name, key)].compiled)


def test_errors_name_the_kernel_and_shapes() -> None:
    with pytest.raises(RuntimeError, match="'k_missing' is not registered"):
        ttp.call_custom_kernel("k_missing", "k", inputs=[], output_shapes=[])
    ttp.register_custom_kernel("k_neg", "3", serialized_mlir_module=_export(lambda x: -x, (3,)))
    with pytest.raises(ValueError, match=r"k_neg.*float32\[3\].*float32 \[4\]"):
        ttp.call_custom_kernel("k_neg", "3", inputs=[torch.zeros(4, device="tpu")],
                               output_shapes=[torch.empty(3, device="tpu")])
    with pytest.raises(ValueError, match=r"k_neg.*on cpu"):
        ttp.call_custom_kernel("k_neg", "3", inputs=[torch.zeros(3)], output_shapes=[torch.empty(3, device="tpu")])
    with pytest.raises(ValueError, match="k_bad.*not a serialized StableHLO module"):
        ttp.register_custom_kernel("k_bad", "x", serialized_mlir_module=b"not a module")
    with pytest.raises(TypeError, match="k_bad.*must be bytes"):
        ttp.register_custom_kernel("k_bad", "x", serialized_mlir_module="text")


def test_mosaic_module_is_refused_on_xla_cpu() -> None:
    from jax.experimental import pallas as pl

    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def kernel(x):
        return pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    mod = _export(kernel, (8, 128), platform="tpu")
    with pytest.raises(RuntimeError, match=r"'k_mosaic'.*float32\[8, 128\].*Mosaic.*XLA:CPU"):
        ttp.register_custom_kernel("k_mosaic", "8_128", serialized_mlir_module=mod)
    assert not ttp.lookup_custom_kernel("k_mosaic", "8_128")


# ---- default torch.compile on tpu tensors ----



def _train(mod, steps: int, backend: str | None) -> list[float]:
    from _train import train

    model, batches, loss_fn = mod.build(0)
    model = model.to("tpu")
    opt = mod.optimizer(model)
    if backend == "default":
        model = torch.compile(model)
    elif backend is not None:
        model = torch.compile(model, backend=backend)
    return train(model, opt, batches, loss_fn, "tpu", steps, log=False)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_default_compile_trains_examples_like_eager(name: str) -> None:
    mod = load_example(name)
    default = _train(mod, 3, "default")
    assert counters["tpu"]["inductor_to_tpu_backend"] == 1  # one Dynamo graph, compiled by the tpu backend
    assert counters["tpu"]["xla_programs"] == 2  # its forward and backward aten graphs
    torch._dynamo.reset()
    explicit = _train(mod, 3, "tpu")
    eager = _train(mod, 3, None)
    torch.testing.assert_close(default, eager, rtol=1e-5, atol=1e-5)
    assert default == explicit  # the same programs


def test_routing_leaves_cpu_graphs_to_inductor_and_honours_the_variable(monkeypatch) -> None:
    from torch_tpu import _inductor_route

    cpu, tpu = torch.ones(2), torch.ones(2, device="tpu")
    assert _inductor_route.route(None, [cpu]) == "inductor"
    assert _inductor_route.route(None, [tpu]) == "tpu"  # XLA:CPU here
    monkeypatch.setenv("TORCH_TPU_INDUCTOR", "pallas")
    assert _inductor_route.route(None, [tpu]) == "inductor"
    monkeypatch.setenv("TORCH_TPU_INDUCTOR", "tpu")
    assert _inductor_route.route(None, [tpu]) == "tpu"
    assert _inductor_route.route(None, [cpu]) == "inductor"


def test_cpu_graphs_reach_inductor_and_tpu_graphs_do_not(monkeypatch) -> None:
    """Through torch.compile itself: Inductor's graph compiler (stubbed here: a real CPU compile takes tens of
    seconds) sees the CPU graph and not the tpu one."""
    import torch._inductor.compile_fx as cfx

    seen = []

    def compile_fx(gm, inputs, **kwargs):
        seen.append([t.device.type for t in inputs if isinstance(t, torch.Tensor)])
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", compile_fx)
    f = torch.compile(lambda x: torch.cos(x) + 1)
    for device in ("cpu", "tpu"):
        x = torch.randn(5, device=device)
        torch.testing.assert_close(f(x).cpu(), torch.cos(x.cpu()) + 1)
    assert seen == [["cpu"]]
    assert counters["tpu"]["inductor_to_tpu_backend"] == 1


def test_inductor_pallas_code_reaches_the_contract_and_is_refused_on_xla_cpu(monkeypatch) -> None:
    """TORCH_TPU_INDUCTOR=pallas: Inductor generates its Pallas code for device tpu; that code imports and calls
    tpu_torch_pallas, which refuses the Mosaic kernel on XLA:CPU instead of crashing or computing garbage."""
    monkeypatch.setenv("TORCH_TPU_INDUCTOR", "pallas")
    f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
    with pytest.raises(Exception, match=r"Mosaic \(Pallas TPU\) kernel.*XLA:CPU"):
        f(torch.randn(8, 128, device="tpu"))
    assert counters["tpu"]["inductor_to_tpu_backend"] == 0
    assert jax.config.jax_enable_x64  # the generated code turned it off; the refusal turned it back on
    torch.testing.assert_close(torch.arange(3, device="tpu").cpu(), torch.arange(3))  # int64 still int64


def test_inductor_generated_code_runs_through_the_contract(monkeypatch) -> None:
    """Inductor's generated code for device tpu, end to end through tpu_torch_pallas on XLA:CPU: the one step only
    a TPU can do (Mosaic) is replaced, for this test, by Pallas interpret mode exported for this platform; the
    rest (x64 toggling, jax.export, lookup/register/call, donation of the aliased outputs, copy-back) is the
    generated code as Inductor writes it. Compared with CPU eager, in-place update of the input included."""
    from jax.experimental import pallas as pl

    pallas_call, export = pl.pallas_call, jax.export.export
    monkeypatch.setattr(pl, "pallas_call", lambda *a, **k: pallas_call(*a, **{**k, "interpret": True}))
    monkeypatch.setattr(jax.export, "export", lambda fn, *a, platforms=None, **k: export(
        fn, *a, platforms=["cpu"] if platforms == ["tpu"] else platforms, **k))
    monkeypatch.setenv("TORCH_TPU_INDUCTOR", "pallas")
    calls = []
    call = ttp.call_custom_kernel
    monkeypatch.setattr(ttp, "call_custom_kernel", lambda name, key, **kw: calls.append(
        (name, list(kw["donate_argnums"]))) or call(name, key, **kw))

    def g(x, y):
        x.mul_(2)
        return torch.sin(x) * y + 1, (x * y).sum()

    x, y = torch.randn(8, 128), torch.randn(8, 128)
    xt = x.to("tpu")
    got = torch.compile(g)(xt, y.to("tpu"))
    want = g(x, y)
    for a, b in zip(got, want):
        assert a.device.type == "tpu"
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(xt.cpu(), x)  # the graph input's in-place update
    assert calls and all(d for _, d in calls), calls  # Inductor donated its aliased output buffers
    assert counters["tpu"]["inductor_to_tpu_backend"] == 0
    assert jax.config.jax_enable_x64 and torch.arange(3, device="tpu").cpu().dtype == torch.int64


def test_inductor_options_warn_that_they_do_not_apply() -> None:
    from torch_tpu import _inductor_route

    monkey = _inductor_route._warned_options
    _inductor_route._warned_options = False
    try:
        f = torch.compile(lambda x: x * 3, mode="max-autotune-no-cudagraphs")
        with pytest.warns(UserWarning, match="do not apply to graphs with tpu tensors"):
            out = f(torch.arange(4.0, device="tpu"))
    finally:
        _inductor_route._warned_options = monkey or _inductor_route._warned_options
    torch.testing.assert_close(out.cpu(), torch.arange(4.0) * 3)


# ---- Hugging Face Llama generate, compiled ----

def test_hf_llama_generate_compiled_matches_eager() -> None:
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("check_hf_generate", REPO / "tools" / "check_hf_generate.py")
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool
    spec.loader.exec_module(tool)
    r = tool.compare(new_tokens=3, warm=False)
    assert r["compiled"] == r["eager"], r
    assert r["eager"] == r["cpu"], r
    assert r["routed_graphs"] >= 1, r
