"""The model of the DDP benchmark jobs: ``rankscope.demo.train --ddp``'s MLP, its optimiser and input."""

from __future__ import annotations

from typing import Any

import torch


def ddp_mlp(size: int, rank: int) -> tuple[Any, torch.optim.Optimizer, torch.Tensor]:
    """Six ``size``-wide Linear+ReLU layers under DDP (the process group is initialised), SGD, an input."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(rank)
    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(size, size), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*layers))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), torch.randn(size, size)
