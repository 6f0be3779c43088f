"""An MLP classifier on synthetic data: python examples/mlp.py --device tpu|cpu"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from _train import parse_args, synthetic, train


def build(seed: int = 0) -> tuple[nn.Module, object, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.GELU(), nn.Linear(256, 10))
    batches = synthetic(lambda g: (torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)), seed)
    return model, batches, F.cross_entropy


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


if __name__ == "__main__":
    args = parse_args(__doc__)
    model, batches, loss_fn = build(args.seed)
    model = model.to(args.device)
    train(model, optimizer(model), batches, loss_fn, args.device, args.steps)
