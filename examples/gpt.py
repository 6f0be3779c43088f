"""A small GPT-style decoder (embeddings, causal self-attention, layer norm, MLP, cross-entropy) on synthetic
tokens: python examples/gpt.py --device tpu|cpu"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from _train import parse_args, synthetic, train

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 128, 32, 64, 4, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(LAYERS))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(seed: int = 0) -> tuple[nn.Module, object, object]:
    torch.manual_seed(seed)

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        seq = torch.randint(0, VOCAB, (8, CONTEXT + 1), generator=g)
        return seq[:, :-1], seq[:, 1:]

    return GPT(), synthetic(batch, seed), loss_fn


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


if __name__ == "__main__":
    args = parse_args(__doc__)
    model, batches, loss = build(args.seed)
    model = model.to(args.device)
    train(model, optimizer(model), batches, loss, args.device, args.steps)
