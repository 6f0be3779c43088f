"""torch.compile(backend="tpu")'s runtime wrapper: inputs read and mutated inputs written back in one call each,
parameters and optimizer state donated to the program only when their storage holds the sole reference (a clone,
a view or a Python reference to the array keeps its value), a graph break between the parts of a step, and a warm
start from the persistent compile cache in a fresh process. CPU PyTorch (or tpu eager) is the oracle."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from conftest import run_python


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _mlp(device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _data(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g).to(device), torch.randint(0, 4, (8,), generator=g).to(device)


def _train_fn(model: nn.Module, opt: torch.optim.Optimizer):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().cpu() for p in model.parameters()]
    for p in model.parameters():
        st = opt.state[p]
        out += [st["exp_avg"].cpu(), st["exp_avg_sq"].cpu(), torch.as_tensor(st["step"]).cpu()]
    return out


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


def test_whole_step_compiled_matches_cpu_and_donates_the_state() -> None:
    ref_model, ref_opt = _mlp("cpu")
    ref_step = _train_fn(ref_model, ref_opt)
    model, opt = _mlp("tpu")
    step = torch.compile(_train_fn(model, opt), backend="tpu")
    x, y = _data("tpu")
    xc, yc = _data("cpu")
    for _ in range(4):
        torch.testing.assert_close(step(x, y).cpu(), ref_step(xc, yc), rtol=1e-5, atol=1e-6)
    _close(_state(model, opt), _state(ref_model, ref_opt))
    # Parameters, exp_avg and exp_avg_sq (3 x 6 tensors) were handed to the optimizer program on steady steps.
    assert counters["tpu_donation"]["inputs"] >= 18 * 2


def test_donation_never_takes_an_array_another_tensor_reads() -> None:
    """A clone (which shares the immutable array), a view of the parameter and a Python reference to its array
    all stay valid across compiled steps; the parameters still follow CPU."""
    from torch_tpu import _C

    ref_model, ref_opt = _mlp("cpu")
    ref_step = _train_fn(ref_model, ref_opt)
    model, opt = _mlp("tpu")
    step = torch.compile(_train_fn(model, opt), backend="tpu")
    x, y = _data("tpu")
    xc, yc = _data("cpu")
    for _ in range(2):  # compile, and make the optimizer state
        step(x, y), ref_step(xc, yc)
    params = list(model.parameters())
    before = [p.detach().cpu() for p in params]
    clones = [p.detach().clone() for p in params]  # same array as the parameter, another storage
    assert all(_C._array(c) is _C._array(p) for c, p in zip(clones, params))
    held = _C._array(params[0])  # a Python reference to the array itself
    views = [p.detach().view(-1) for p in params]  # same storage: must see the new values
    exp_avg = opt.state[params[1]]["exp_avg"]
    avg_clone = exp_avg.clone()
    avg_before = exp_avg.cpu()
    counters.clear()
    step(x, y), ref_step(xc, yc)
    for c, b in zip(clones, before):
        torch.testing.assert_close(c.cpu(), b, rtol=0, atol=0)
    torch.testing.assert_close(avg_clone.cpu(), avg_before, rtol=0, atol=0)
    assert not held.is_deleted()
    torch.testing.assert_close(torch.from_numpy(held.__array__().copy()), before[0], rtol=0, atol=0)
    for v, p in zip(views, ref_model.parameters()):
        torch.testing.assert_close(v.cpu(), p.detach().reshape(-1), rtol=1e-5, atol=1e-6)
    _close(_state(model, opt), _state(ref_model, ref_opt))
    # What nothing else referenced was still donated (at least the exp_avg_sq of every parameter).
    assert counters["tpu_donation"]["inputs"] >= 6
    del clones, held, avg_clone
    counters.clear()
    step(x, y), ref_step(xc, yc)
    _close(_state(model, opt), _state(ref_model, ref_opt))
    assert counters["tpu_donation"]["inputs"] == 18


def test_tied_parameter_and_a_mutated_buffer_viewed_outside() -> None:
    """A weight used twice (tied), a buffer the graph updates in place while the caller holds a view of it, and a
    view of the weight taken before the optimizer step. (A mutated input aliased by a second graph input is not
    covered: AOTAutograd makes it an as_strided_scatter, which has no tpu lowering yet.)"""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(8, 8, bias=False)
            self.register_buffer("count", torch.zeros(8))

        def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
            self.count.add_(x.sum(0))
            return F.linear(torch.tanh(self.emb(x)), self.emb.weight) + other.sum()

    def run(device: str, compiled: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        m = Tied().to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        fwd = torch.compile(m, backend="tpu") if compiled else m
        ostep = torch.compile(opt.step, backend="tpu") if compiled else opt.step
        x = torch.arange(32.0).reshape(4, 8).div(32).to(device)
        outs = []
        for _ in range(3):
            opt.zero_grad()
            alias = m.count.view(2, 4)  # reads the buffer the graph mutates
            wview = m.emb.weight.detach()[1:].t()  # a strided view of the parameter
            out = fwd(x, x * 2)
            out.sum().backward()
            ostep()
            outs += [t.cpu().clone() for t in (out.detach(), m.count, m.emb.weight.detach(), alias, wview)]
        return outs

    _close(run("tpu", True), run("cpu", False))


def test_graph_break_between_forward_and_optimizer_step() -> None:
    ref_model, ref_opt = _mlp("cpu")
    model, opt = _mlp("tpu")

    def make(model, opt):
        def step(x, y):
            opt.zero_grad()
            out = model(x)
            torch._dynamo.graph_break()
            loss = F.cross_entropy(out, y) * 1.0
            loss.backward()
            torch._dynamo.graph_break()
            opt.step()
            return loss
        return step

    step = torch.compile(make(model, opt), backend="tpu")
    ref = make(ref_model, ref_opt)
    x, y = _data("tpu")
    xc, yc = _data("cpu")
    for _ in range(3):
        torch.testing.assert_close(step(x, y).cpu(), ref(xc, yc), rtol=1e-5, atol=1e-6)
    _close(_state(model, opt), _state(ref_model, ref_opt))


def test_eager_fallback_inputs_views_are_read_and_written_through() -> None:
    """Inputs that are views (offset, transposed) take the general read/write path: values as CPU."""

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.mul_(2)
        return a @ b

    base = torch.randn(6, 4)
    b = torch.randn(4, 3)
    tb = base.to("tpu")
    out = torch.compile(f, backend="tpu")(tb[2:], b.to("tpu").t().contiguous().t())
    ref = f(base[2:], b)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tb.cpu(), base, rtol=0, atol=0)


_WARM = r"""
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4)).to("tpu")
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(8, 16, generator=g).to("tpu"), torch.randint(0, 4, (8,), generator=g).to("tpu")

@torch.compile(backend="tpu")
def step(x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss

losses = [step(x, y).item() for _ in range(4)]
s = torch.tpu.compile_cache.stats()
print("RESULT", repr(losses), repr([p.detach().cpu().sum().item() for p in model.parameters()]), s.hits, s.misses)
"""


def test_warm_start_from_the_persistent_cache_gives_the_same_values(tmp_path) -> None:
    """A fresh process with a cache another process filled loads the compiled programs (donating ones included)
    and trains to the same values, bit for bit, as the process that compiled them."""
    env = {"TORCH_TPU_CACHE_DIR": str(tmp_path / "cache")}
    runs = []
    for _ in range(2):
        out = run_python(_WARM, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")][-1]
        runs.append(line.split(" ", 1)[1].rsplit(" ", 2))
    (cold, cold_hits, cold_misses), (warm, warm_hits, warm_misses) = runs
    assert warm == cold
    assert int(cold_misses) > 0 and int(warm_hits) > 0 and int(warm_misses) == 0


def test_cpu_inputs_updated_and_returned_from_the_host_part() -> None:
    # Two CPU counters updated from CPU values alone (the host part, one generated function, written back by one
    # foreach copy), the new value returned, and read by the device part.
    def fn(x: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = c + 1
        c.copy_(n)
        d.copy_(d * 2 + n)
        return x * n.to(x.device), n

    compiled = torch.compile(fn, backend="tpu")
    x = torch.arange(4.0)
    c, d = torch.tensor(0.0), torch.tensor(1.0)
    ct, dt = torch.tensor(0.0), torch.tensor(1.0)
    for _ in range(3):
        want, want_n = fn(x, c, d)
        got, got_n = compiled(x.tpu(), ct, dt)
        torch.testing.assert_close(got.cpu(), want)
        assert got_n.device.type == "cpu" and got_n.item() == want_n.item()
        assert (ct.item(), dt.item()) == (c.item(), d.item())


def test_more_than_64_written_back_inputs_are_all_donated() -> None:
    # 13 Linear layers: 26 parameters, 78 tensors the optimizer program writes back (past one 64-bit mask).
    def build(device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(13)]).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_fn(model: nn.Module, opt: torch.optim.Optimizer):
        def step(x: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).square().sum()
            loss.backward()
            opt.step()
            return loss
        return step

    ref_model, ref_opt = build("cpu")
    ref_step = train_fn(ref_model, ref_opt)
    model, opt = build("tpu")
    step = torch.compile(train_fn(model, opt), backend="tpu")
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    for i in range(3):
        before = counters["tpu_donation"]["inputs"]
        torch.testing.assert_close(step(x.tpu()).cpu(), ref_step(x), rtol=1e-5, atol=1e-5)
        if i:  # steady steps: every parameter, exp_avg and exp_avg_sq handed to the program
            assert counters["tpu_donation"]["inputs"] - before == 78
    _close(_state(model, opt), _state(ref_model, ref_opt))


def test_compiled_optimizer_step_after_an_eager_backward_donates_its_state() -> None:
    # The eager backward leaves some gradients as views of other arrays (not whole arrays): the written-back
    # parameters and state are still donated, and the values match CPU.
    ref_model, ref_opt = _mlp("cpu")
    model, opt = _mlp("tpu")
    opt_step = torch.compile(opt.step, backend="tpu")
    x, y = _data("tpu")
    xc, yc = _data("cpu")
    for i in range(3):
        ref_opt.zero_grad()
        F.cross_entropy(ref_model(xc), yc).backward()
        ref_opt.step()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        before = counters["tpu_donation"]["inputs"]
        opt_step()
        if i:  # 6 parameters, their exp_avg and exp_avg_sq
            assert counters["tpu_donation"]["inputs"] - before == 18
    _close(_state(model, opt), _state(ref_model, ref_opt))
