"""Random numbers on tpu (torch_tpu/_rng.py): a generator step (seed, offset) becomes one JAX key by one rule,
for eager draws, DEFER_AND_FUSE and compiled programs. The streams are pinned against that rule computed with
JAX directly, so a refactor cannot silently change what a seed produces."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

FUSE = "DEFER_AND_FUSE"


def _key(seed: int, offset: int) -> jax.Array:
    """The documented rule, written out: key(seed) folded with the offset's low, then high 32 bits."""
    k = jax.random.key(np.uint64(seed))
    k = jax.random.fold_in(k, np.uint32(offset & 0xFFFFFFFF))
    return jax.random.fold_in(k, np.uint32(offset >> 32))


@pytest.mark.parametrize("offset", [0, 5, 2**32 + 3])
def test_eager_draw_is_the_documented_key(offset: int) -> None:
    g = torch.Generator("tpu")
    g.manual_seed(1234)
    g.set_offset(offset)
    got = torch.randn(16, device="tpu", generator=g).cpu().numpy()
    want = np.asarray(jax.random.normal(_key(1234, offset), (16,), np.float32))
    np.testing.assert_array_equal(got, want)
    assert g.get_offset() == offset + 1  # one step per random op


def test_default_generator_steps_once_per_op() -> None:
    torch.manual_seed(77)
    a = torch.rand(8, device="tpu").cpu().numpy()
    b = torch.rand(8, device="tpu").cpu().numpy()
    np.testing.assert_array_equal(a, np.asarray(jax.random.uniform(_key(77, 0), (8,), np.float32)))
    np.testing.assert_array_equal(b, np.asarray(jax.random.uniform(_key(77, 1), (8,), np.float32)))


def _draws() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    x = torch.ones(64, 32, device="tpu")
    out = {
        "randn": torch.randn(64, 32, device="tpu"),
        "rand64": torch.rand(10, device="tpu", dtype=torch.float64),
        "randint": torch.randint(0, 100, (50,), device="tpu"),
        "bernoulli": torch.bernoulli(torch.full((40,), 0.3, device="tpu")),
        "normal_": torch.empty(20, device="tpu").normal_(2.0, 3.0),
        "exponential_": torch.empty(20, device="tpu").exponential_(1.5),
        "dropout": F.dropout(x, 0.4),
        "randperm": torch.randperm(30, device="tpu"),
        "multinomial": torch.multinomial(torch.tensor([0.1, 0.5, 0.4], device="tpu"), 6, replacement=True),
    }
    return {k: v.cpu() for k, v in out.items()}


def test_same_seed_same_values_eager_and_fused() -> None:
    eager = _draws()
    with torch.tpu.set_eager_mode(FUSE):
        fused = _draws()
    again = _draws()
    for k in eager:
        assert torch.equal(eager[k], fused[k]), k
        assert torch.equal(eager[k], again[k]), k
    assert not torch.equal(eager["randn"][0], eager["randn"][1])


def test_compiled_program_draws_one_step_and_folds_per_random_op() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + torch.rand(6, device=x.device), torch.randn(6, device=x.device)

    fn = torch.compile(f, backend="tpu")
    x = torch.zeros(6, device="tpu")
    torch.manual_seed(11)
    a, b = fn(x)
    gen = torch.tpu.default_generators[0]
    assert gen.get_offset() == 1  # one generator step per program call, whatever its number of random ops
    first = _key(11, 0)
    # The i-th random op of the program (1-based, in graph order) draws from fold_in(program key, i).
    want_a = jax.random.uniform(jax.random.fold_in(first, 1), (6,), np.float32)
    want_b = jax.random.normal(jax.random.fold_in(first, 2), (6,), np.float32)
    np.testing.assert_array_equal(a.cpu().numpy(), np.asarray(want_a))
    np.testing.assert_array_equal(b.cpu().numpy(), np.asarray(want_b))
    torch.manual_seed(11)
    a2, b2 = fn(x)
    assert torch.equal(a.cpu(), a2.cpu()) and torch.equal(b.cpu(), b2.cpu())
    a3, _ = fn(x)
    assert not torch.equal(a.cpu(), a3.cpu())
