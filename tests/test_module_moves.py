"""Module moves to and from tpu keep Parameter identity and weight ties, as on CUDA.

nn.Module._apply (`.to()`, `.tpu()`, `.cpu()`, `.double()`) and `param.data = t` keep the Parameter object
only when aten::_has_compatible_shallow_copy_type says the old and new tensors are compatible; torch_tpu's
kernel (runtime/TpuShallowCopy.cpp) counts tpu as a dense backend. CPU PyTorch is the oracle: a tpu move must
do what a cpu dtype move does to the same module."""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM = 32, 8


class TinyLM(nn.Module):
    """Embedding, one block, norm with buffers, and a head tied to the embedding (as GPT-2's lm_head/wte)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.block = nn.Linear(DIM, DIM)
        self.norm = nn.BatchNorm1d(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.block(self.emb(ids)))
        return self.head(self.norm(h))


def _slots(m: nn.Module) -> dict[str, nn.Parameter]:
    return dict(m.named_parameters(remove_duplicate=False))


def _unique(m: nn.Module) -> int:
    return len({id(p) for p in _slots(m).values()})


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (6,), generator=g), torch.randint(0, VOCAB, (6,), generator=g))
            for _ in range(n)]


def _train_with_optimizer_built_before_move(device: str, steps: int = 5):
    torch.manual_seed(0)
    m = TinyLM()
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    m.to(device)
    losses = []
    for x, y in _batches(steps):
        loss = F.cross_entropy(m(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return m, opt, losses


def test_shallow_copy_rule_is_c10s_plus_tpu(tpu):
    cpu, dev = torch.randn(3), torch.randn(3, device=tpu)
    f = torch._has_compatible_shallow_copy_type
    assert f(cpu, dev) and f(dev, cpu) and f(dev, dev)
    assert f(cpu.double(), dev) and f(dev, cpu.to(torch.int64))  # dtype is not part of the rule
    with torch.inference_mode():  # no autograd keys: the PrivateUse1 registration answers
        assert f(torch.randn(3), torch.randn(3, device=tpu))
    # Everything that is not dense gets c10's answer, exactly as against a cpu tensor (CUDA: the same).
    sparse, meta = torch.randn(2, 2).to_sparse(), torch.empty(3, device="meta")
    for other in (sparse, meta):
        assert f(other, dev) == f(other, cpu) is False
        assert f(dev, other) == f(cpu, other) is False
    assert f(sparse, sparse.clone()) and f(meta, torch.empty(2, device="meta"))


def test_cpu_only_moves_unchanged():
    torch.manual_seed(0)
    m = TinyLM()
    before = _slots(m)
    m.to("cpu")
    assert all(_slots(m)[k] is p for k, p in before.items())
    m.to(torch.float64)
    assert all(_slots(m)[k] is p and p.dtype == torch.float64 for k, p in before.items())
    assert len(_slots(m)) == 6 and _unique(m) == 5  # emb/head tied, block and norm weight+bias
    assert torch._has_compatible_shallow_copy_type(torch.randn(2), torch.randn(2).to_sparse()) is False


@pytest.mark.parametrize("move", ["to_tpu", "tpu_method", "to_device_obj"])
def test_move_keeps_identity_and_ties(tpu, move):
    torch.manual_seed(0)
    m = TinyLM()
    before = _slots(m)
    n_cpu = _unique(m)
    {"to_tpu": lambda: m.to("tpu"), "tpu_method": lambda: m.tpu(), "to_device_obj": lambda: m.to(tpu)}[move]()
    after = _slots(m)
    assert after.keys() == before.keys()
    for k, p in before.items():
        assert after[k] is p, k
        assert type(p) is nn.Parameter and p.device == tpu and p.is_leaf and p.requires_grad and p.grad_fn is None
    assert m.head.weight is m.emb.weight
    assert _unique(m) == n_cpu
    # buffers moved (nn.Module._apply replaces buffer objects on every device, CUDA included)
    assert {b.device for b in m.buffers()} == {tpu}
    assert m.norm.num_batches_tracked.dtype == torch.int64


def test_optimizer_built_before_move_trains_like_cpu(tpu):
    m_cpu, opt_cpu, l_cpu = _train_with_optimizer_built_before_move("cpu")
    m_tpu, opt_tpu, l_tpu = _train_with_optimizer_built_before_move("tpu")
    torch.testing.assert_close(torch.tensor(l_tpu), torch.tensor(l_cpu), rtol=1e-5, atol=1e-5)
    # the optimizer holds the model's parameters, its state was created on tpu
    assert {id(p) for g in opt_tpu.param_groups for p in g["params"]} == {id(p) for p in m_tpu.parameters()}
    for p in m_tpu.parameters():
        st = opt_tpu.state[p]
        assert st["exp_avg"].device == tpu and st["exp_avg_sq"].device == tpu
    for (k, a), (_, b) in zip(m_cpu.state_dict().items(), m_tpu.state_dict().items()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-5, msg=k)


def test_grads_move_with_params_and_back_to_cpu(tpu):
    torch.manual_seed(0)
    m = TinyLM()
    x, y = _batches(1)[0]
    F.cross_entropy(m(x), y).backward()
    params = _slots(m)
    grads = {k: p.grad for k, p in params.items()}
    ref = {k: g.clone() for k, g in grads.items()}
    m.to("tpu")
    for k, p in params.items():
        assert p.grad is grads[k] and p.grad.device == tpu, k
        torch.testing.assert_close(p.grad.cpu(), ref[k])
    # backward on tpu accumulates into the moved grads (the grad accumulator was rebuilt for tpu)
    F.cross_entropy(m(x.to(tpu)), y.to(tpu)).backward()
    m.to("cpu")
    for k, p in params.items():
        assert _slots(m)[k] is p and p.device.type == "cpu" and p.grad is grads[k] and p.grad.device.type == "cpu"
        torch.testing.assert_close(p.grad, 2 * ref[k], rtol=1e-5, atol=1e-6)
    assert m.head.weight is m.emb.weight


def test_dtype_move_on_tpu_matches_cpu(tpu):
    torch.manual_seed(0)
    ref = TinyLM()
    m = copy.deepcopy(ref).to(tpu)
    params = _slots(m)
    m.to(torch.float64)
    ref.to(torch.float64)
    assert all(_slots(m)[k] is p and p.dtype == torch.float64 and p.device == tpu for k, p in params.items())
    for k, v in ref.state_dict().items():
        assert m.state_dict()[k].dtype == v.dtype
        torch.testing.assert_close(m.state_dict()[k].cpu(), v, rtol=0, atol=0)
    m.to(torch.float32)
    assert all(_slots(m)[k] is p and p.dtype == torch.float32 for k, p in params.items())


def test_version_counter_kept(tpu):
    p = nn.Parameter(torch.randn(3))
    with torch.no_grad():
        p.add_(1)
    v = p._version
    m = nn.Module()
    m.p = p
    m.to(tpu)
    assert m.p is p and p._version == v
    with torch.no_grad():
        p.add_(1)
    assert p._version == v + 1


@pytest.mark.parametrize("direction", ["cpu_to_tpu", "tpu_to_cpu"])
def test_param_data_assignment(tpu, direction):
    src, dst = ("cpu", tpu) if direction == "cpu_to_tpu" else (tpu, "cpu")
    w = nn.Parameter(torch.randn(4, 3, device=src))
    x = torch.randn(2, 4)
    (x.to(src) @ w).sum().backward()  # builds a grad accumulator on the old device
    w.grad = None
    new = torch.randn(4, 3)
    w.data = new.to(dst)
    assert type(w) is nn.Parameter and w.device == torch.device(dst) and w.is_leaf and w.requires_grad
    torch.testing.assert_close(w.detach().cpu(), new)
    (x.to(dst) @ w).sum().backward()
    assert w.grad is not None and w.grad.device == torch.device(dst)
    torch.testing.assert_close(w.grad.cpu(), x.sum(0)[:, None].expand(4, 3))
    # .grad itself can move the same way
    g = w.grad
    g.data = g.to(src)
    assert w.grad is g and g.device == torch.device(src)


def test_load_state_dict_assign_from_tpu_behaves_as_cpu(tpu):
    torch.manual_seed(0)
    src = TinyLM()
    sd_cpu = src.state_dict()
    sd_tpu = {k: v.to(tpu) for k, v in sd_cpu.items()}
    results = {}
    for name, sd in (("cpu", sd_cpu), ("tpu", sd_tpu)):
        with torch.device("meta"):
            m = TinyLM()
        m.load_state_dict(sd, assign=True)
        results[name] = m
        for k, p in m.named_parameters(remove_duplicate=False):
            assert type(p) is nn.Parameter and p.requires_grad and p.device == sd[k].device
            assert p.untyped_storage().data_ptr() == sd[k].untyped_storage().data_ptr()  # assigned, not copied
    assert _unique(results["tpu"]) == _unique(results["cpu"])
    assert (results["tpu"].head.weight is results["tpu"].emb.weight) == (
        results["cpu"].head.weight is results["cpu"].emb.weight)
    # loading a tpu state dict into a cpu module without assign copies into the same Parameters
    m = TinyLM()
    slots = _slots(m)
    m.load_state_dict(sd_tpu)
    assert all(_slots(m)[k] is p and p.device.type == "cpu" for k, p in slots.items())
    for k, v in sd_cpu.items():
        torch.testing.assert_close(m.state_dict()[k], v, rtol=0, atol=0)


def test_deepcopy_and_save_load_of_moved_module(tpu):
    torch.manual_seed(0)
    m = TinyLM().to(tpu)
    c = copy.deepcopy(m)
    assert c.head.weight is c.emb.weight and c.emb.weight is not m.emb.weight
    assert c.emb.weight.device == tpu and type(c.emb.weight) is nn.Parameter
    torch.testing.assert_close(c.emb.weight.cpu(), m.emb.weight.cpu(), rtol=0, atol=0)
    # whole-module pickle keeps the tie; the state dict keeps the storage sharing
    buf = io.BytesIO()
    torch.save({"model": m, "sd": m.state_dict()}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    lm, sd = loaded["model"], loaded["sd"]
    assert lm.head.weight is lm.emb.weight and lm.emb.weight.device == tpu and _unique(lm) == _unique(m)
    assert sd["head.weight"].untyped_storage().data_ptr() == sd["emb.weight"].untyped_storage().data_ptr()
    fresh = TinyLM()
    fresh.load_state_dict(sd)
    fresh.to(tpu)
    assert fresh.head.weight is fresh.emb.weight
    x = torch.randint(0, VOCAB, (5,))
    m.eval(), lm.eval(), fresh.eval()
    for other in (lm, fresh):
        for a, b in zip(other.parameters(), m.parameters()):  # the same weights, bit for bit
            torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0)
        # The same outputs to float32 rounding, not bit for bit: the loaded module's storages hold the checkpoint's
        # bytes until first written, so its ops read their weight views in a separate program, while the original's
        # read them inside the op's own (the eager fast path); XLA may sum a dot in another order between the two.
        torch.testing.assert_close(other(x.to(tpu)).cpu(), m(x.to(tpu)).cpu(), rtol=1e-6, atol=1e-6)


def test_move_with_pending_fused_values(tpu):
    """Params updated under DEFER_AND_FUSE (values still pending) move to cpu and back with identity kept."""
    torch.manual_seed(0)
    m_ref, _, _ = _train_with_optimizer_built_before_move("cpu", steps=2)
    torch.manual_seed(0)
    m = TinyLM()
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    params = _slots(m)
    with torch.tpu.set_eager_mode("DEFER_AND_FUSE"):
        m.to(tpu)
        for x, y in _batches(2):
            F.cross_entropy(m(x.to(tpu)), y.to(tpu)).backward()
            opt.step()
            opt.zero_grad()
        m.to("cpu")
    assert all(_slots(m)[k] is p and p.device.type == "cpu" for k, p in params.items())
    for k, v in m_ref.state_dict().items():
        torch.testing.assert_close(m.state_dict()[k], v, rtol=1e-5, atol=1e-5, msg=k)


def test_hooks_survive_and_old_storage_is_released(tpu):
    """The moved TensorImpl keeps its autograd hooks; the tpu storage it drops on the way back is freed."""
    # Earlier tests can leave tpu tensors in reference cycles; collect them first, or the cyclic collector
    # running mid-test frees them and the count drops below the baseline (seen in CI: 15 == 18).
    gc.collect()
    base = torch.tpu.live_storages()
    m = nn.Linear(4, 4)
    w = m.weight
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.device))
    w.register_hook(lambda g: g * 2)
    m.to(tpu)
    assert w.untyped_storage().device == tpu and torch.tpu.live_storages() == base + 2
    x = torch.randn(3, 4)
    m(x.to(tpu)).sum().backward()
    assert seen == [tpu]
    torch.testing.assert_close(w.grad.cpu(), 2 * x.sum(0)[None].expand(4, 4))
    m.to("cpu")
    assert w.device.type == "cpu" and w.grad.device.type == "cpu"
    gc.collect()
    assert torch.tpu.live_storages() == base
