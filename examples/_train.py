"""The training loop the examples share: plain PyTorch, device chosen on the command line."""

from __future__ import annotations

import argparse
import time
from typing import Callable, Iterator

import torch


def parse_args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--device", default="tpu", help="tpu or cpu (or cuda): the same script runs on any of them")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          batches: Iterator[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable, device: str, steps: int,
          log: bool = True) -> list[float]:
    """Runs `steps` optimizer steps; returns the loss of each step (printing loss and steps per second)."""
    model.train()
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())  # waits for the step, like any host read
        if log:
            rate = (step + 1) / (time.perf_counter() - start)
            print(f"step {step:3d}  loss {losses[-1]:.5f}  {rate:.1f} steps/s")
    return losses


def synthetic(make: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]], seed: int
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless stream of synthetic CPU batches, the same for every device."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield make(g)
