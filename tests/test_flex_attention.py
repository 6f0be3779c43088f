"""FlexAttention on tpu, as TorchTitan's llama3 calls it (examples/torchtitan/): a causal document mask built
by `create_block_mask` on the device, eager `flex_attention` forward and backward, against plain softmax
attention on CPU. PyTorch's Python allow-list gate (`_validate_device`) leaves `tpu` out; torch_tpu lifts it for
tpu tensors only (torch_tpu/_torch_gates.py), with no change for other devices. The full TorchTitan run is
`tools/torchtitan_check` (minutes on XLA:CPU, its own venv), not part of the suite."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as fa


def _reference(q, k, v, docs, scale):
    s = (q @ k.transpose(-1, -2)) * scale
    n = q.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    same_doc = docs[:, None, :, None] == docs[:, None, None, :]
    s = s.masked_fill(~(causal & same_doc), float("-inf"))
    return torch.softmax(s, -1) @ v


def test_flex_attention_document_causal_mask_matches_cpu():
    torch.manual_seed(0)
    b, h, n, d = 2, 4, 256, 16  # two mask blocks of 128 along the sequence
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    docs = torch.cat([torch.zeros(b, 100, dtype=torch.long), torch.ones(b, n - 100, dtype=torch.long)], 1)
    docs[1, 180:] = 2
    docs_t = docs.to("tpu")

    def mask_mod(bi, hi, qi, ki):
        return (qi >= ki) & (docs_t[bi, qi] == docs_t[bi, ki])

    block_mask = fa.create_block_mask(mask_mod, b, None, n, n, device="tpu")
    qt, kt, vt = (t.to("tpu").requires_grad_() for t in (q, k, v))
    out = fa.flex_attention(qt, kt, vt, block_mask=block_mask)
    assert out.device.type == "tpu"
    grad = torch.randn(b, h, n, d)
    out.backward(grad.to("tpu"))

    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _reference(qc, kc, vc, docs, d**-0.5)
    ref.backward(grad)
    torch.testing.assert_close(out.cpu(), ref.detach(), atol=2e-5, rtol=1e-4)
    for t, c in ((qt, qc), (kt, kc), (vt, vc)):
        torch.testing.assert_close(t.grad.cpu(), c.grad, atol=2e-5, rtol=1e-4)


def test_device_gate_is_lifted_for_tpu_only() -> None:
    q = torch.randn(1, 1, 4, 8)
    fa._validate_device(q.to("tpu"), q.to("tpu"), q.to("tpu"))  # accepted
    g = q.requires_grad_()
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        fa._validate_device(g, g, g)  # PyTorch's own check for every other device
    assert fa._validate_device.__wrapped__.__module__ == fa.__name__
