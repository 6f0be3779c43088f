"""A small ResNet-style CNN (conv, batch norm, residual blocks, pooling) on synthetic images:
python examples/resnet.py --device tpu|cpu"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from _train import parse_args, synthetic, train


class Residual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


def build(seed: int = 0) -> tuple[nn.Module, object, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        Residual(16, 16, 1), Residual(16, 32, 2), Residual(32, 64, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )
    batches = synthetic(lambda g: (torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)),
                        seed)
    return model, batches, F.cross_entropy


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)


if __name__ == "__main__":
    args = parse_args(__doc__)
    model, batches, loss_fn = build(args.seed)
    model = model.to(args.device)
    train(model, optimizer(model), batches, loss_fn, args.device, args.steps)
