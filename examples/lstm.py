"""An LSTM sequence classifier on synthetic sequences: python examples/lstm.py --device tpu|cpu"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from _train import parse_args, synthetic, train


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def build(seed: int = 0) -> tuple[nn.Module, object, object]:
    torch.manual_seed(seed)
    batches = synthetic(lambda g: (torch.randn(16, 12, 16, generator=g), torch.randint(0, 5, (16,), generator=g)), seed)
    return Classifier(), batches, F.cross_entropy


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(model.parameters(), lr=1e-3)


if __name__ == "__main__":
    args = parse_args(__doc__)
    model, batches, loss_fn = build(args.seed)
    model = model.to(args.device)
    train(model, optimizer(model), batches, loss_fn, args.device, args.steps)
