"""A run's optimiser and its learning-rate schedule: torch's Adam, on CPU over all of a model's
parameters as one flat buffer (`FlatAdam`, the same numbers to the bit), on CUDA fused."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from .devices import fused_adam


class FlatAdam(torch.optim.Adam):
    """torch's Adam (its CPU implementation, one parameter tensor at a time) on one contiguous buffer
    that holds all of a model's parameters, each parameter a view of it and its gradient a view of a
    second buffer: a step runs Adam's dozen ops once, not once per parameter tensor (the
    Transformer has 68; docs/bench.md has the gain). Adam is elementwise, so the numbers
    are those of Adam on the separate tensors, to the bit (tests/test_train.py). Gradients are
    zeroed in place, never set to None, so that the views stay the parameters' gradients; a
    clip (`clip_grad_norm_`) scales them in one product on the buffer."""

    def __init__(self, model: nn.Module, **options):
        parameters = list(model.parameters())
        self.tensors = len(parameters)  # what a state saved per tensor has (`load_state_dict`)
        values = torch.cat([p.detach().reshape(-1) for p in parameters])
        grads = torch.zeros_like(values)
        offset = 0
        for p in parameters:
            p.data, p.grad = (buffer[offset : offset + p.numel()].view_as(p) for buffer in (values, grads))
            offset += p.numel()
        flat = nn.Parameter(values)
        flat.grad = grads
        self.grads = [p.grad for p in parameters]
        super().__init__([flat], **options)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.param_groups[0]["params"][0].grad.zero_()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ of the model's parameters, to the bit: the total norm from
        the norms of the separate gradients, as torch computes them (`get_total_norm`'s ops, without
        its grouping by device and a copy call per tensor, an overhead per tensor), then
        one product scales the whole buffer (torch's is a product per tensor). -> the total norm."""
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(self.grads, 2.0)), 2.0)
        torch.nn.utils.clip_grads_with_norm_(self.param_groups[0]["params"], max_norm, total)
        return total

    def load_state_dict(self, state_dict: dict) -> None:
        """Adam's state, also as torch's Adam on the model's separate tensors saves it (a checkpoint
        written before FlatAdam): its moments are joined in the buffer's order, so such a run goes on
        as it would have."""
        (group,) = state_dict["param_groups"]
        states = [state_dict["state"].get(index) for index in group["params"]]
        if len(states) == self.tensors > 1 and all(states):
            joined = {key: torch.cat([state[key].reshape(-1) for state in states]) for key in ("exp_avg", "exp_avg_sq")}
            step = torch.as_tensor(states[0]["step"]).clone()
            state_dict = {"state": {0: {"step": step, **joined}}, "param_groups": [{**group, "params": [0]}]}
        super().load_state_dict(state_dict)


def adam(model: nn.Module, lr: float, device: torch.device) -> torch.optim.Adam:
    """A run's optimiser: FlatAdam on the CPU (torch's default Adam's numbers), torch's Adam
    elsewhere, fused on CUDA (devices.fused_adam)."""
    if device.type == "cpu":
        return FlatAdam(model, lr=lr)
    return torch.optim.Adam(model.parameters(), lr=lr, fused=fused_adam(device))


def lr_schedule(optimizer: torch.optim.Optimizer, train: DictConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning rate schedule `train.schedule` names: `onecycle` (warm up for the fraction
    `train.warmup` of `train.steps` to `train.lr`, then anneal), else constant at `train.lr`."""
    if train.schedule == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, train.lr, total_steps=train.steps, pct_start=train.warmup)
    return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0)
