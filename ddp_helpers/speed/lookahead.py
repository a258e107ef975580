"""The lookahead optimizer of the speed layer (`Speedups(lookahead=N)`): a slow average of the weights
that the fast ones are pulled back to. Kept apart from `Speedups` so that it can be read, tested and
attached to any optimizer on its own:

    Lookahead(model, every=5, total_steps=1000).attach(optimizer)
"""
from __future__ import annotations

from typing import Any

import torch


class Lookahead:
    """A slow copy of the weights (and BatchNorm statistics) that the fast ones are pulled back to.

    Every few steps: slow <- keep * slow + (1 - keep) * fast, then fast <- slow. `keep` grows
    from 0 (no effect) to about 0.77 as training ends, so the last steps are averaged rather
    than taken one by one; at the end the weights become the slow copy. This is airbench's
    "lookahead" (github.com/KellerJordan/cifar10-airbench), a cousin of weight averaging.
    Every rank does the same arithmetic on the same weights, so DDP's ranks stay identical.
    It runs after each optimizer step (a step hook) and is saved with the optimizer's state.
    """

    def __init__(self, model: torch.nn.Module, every: int, total_steps: int) -> None:
        self.every, self.total_steps, self.steps = every, total_steps, 0
        self.fast = [v for v in model.state_dict().values() if v.is_floating_point()]
        self.slow = [v.detach().clone() for v in self.fast]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_post_hook(self.after_step)
        optimizer.register_state_dict_post_hook(self.save)
        optimizer.register_load_state_dict_pre_hook(self.load)

    def keep(self, step: int) -> float:
        return 1.0 if step == self.total_steps else 0.95 ** self.every * (step / self.total_steps) ** 3

    @torch.no_grad()
    def pull(self, keep: float) -> None:
        torch._foreach_lerp_(self.slow, self.fast, 1 - keep)
        torch._foreach_copy_(self.fast, self.slow)

    def after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.steps += 1
        if self.steps % self.every == 0 or self.steps == self.total_steps:
            self.pull(self.keep(self.steps))

    def save(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        state_dict["lookahead"] = {"slow": self.slow, "steps": self.steps}
        return state_dict

    def load(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        state_dict = dict(state_dict)
        saved = state_dict.pop("lookahead")
        torch._foreach_copy_(self.slow, saved["slow"])
        self.steps = saved["steps"]
        return state_dict
