"""The speed layer: what made DDP training fast on H200s, kept apart from the reference trainer.

    from ddp_helpers import speed
    record = launch(speed.run, world_size=2, backend="nccl", kwargs=speed.recipes.FAST)[0]
    record = launch(speed.run, 1, "nccl", kwargs=dict(model="resnet18", cuda_graph=True, max_steps=300))[0]

`speed.run(**settings)` takes the reference trainer's settings (`train.Config`) and the options of
`Speedups` (speed/speedups.py), in one set of keywords, and runs `train.run` with a `Speedups`
object: the trainer's plug-in (a subclass of `train.Plain`), which replaces the model, the DDP
wrapper, the data loaders, the optimizer, the step and the prediction. Notebook 07 (the performance
lab) measures what each one buys; `speed.recipes` holds the measured settings.

The package, a module per part: `speedups` (the plug-in), `device_loader` (the data kept on the
device), `lookahead` (the optimizer's slow weights), `cuda_graph` (a step replayed as one CUDA
graph), `recipes`. This file holds only `check` and `run`, and imports nothing heavy: importing
`speed.cuda_graph` does not load the trainer. `speed.Speedups`, `speed.DeviceLoader`,
`speed.Lookahead` and the other names of `speedups` are found in their modules when first used.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

from . import recipes  # noqa: F401 (speed.recipes: a dict of settings, nothing to load)

if TYPE_CHECKING:
    from ..train import Config
    from .speedups import Speedups

# Names of the package's modules, found there when first asked for (module __getattr__, PEP 562).
_HOMES = {"DeviceLoader": "device_loader", "Lookahead": "lookahead", "CapturedStep": "cuda_graph",
          **{name: "speedups" for name in ("Speedups", "SPEED_OPTIONS", "COMM_HOOKS", "speed_checks", "step",
                                           "predict", "param_groups")}}
_MODULES = ("speedups", "device_loader", "lookahead", "cuda_graph")


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES, *_MODULES])


def check(**settings: Any) -> tuple[Config, Speedups]:
    """(train.Config, Speedups) from one set of keywords; a clear error for unknown names or bad values."""
    from .. import settings as settings_
    from .. import train
    from .speedups import SPEED_OPTIONS, Speedups, speed_checks
    names = set(train.Config.__dataclass_fields__) | set(SPEED_OPTIONS)
    unknown = sorted(set(settings) - names)
    if unknown:
        raise TypeError(f"unknown setting(s) {unknown}; the trainer's: {', '.join(train.Config.__dataclass_fields__)}; "
                        f"the speed layer's: {', '.join(SPEED_OPTIONS)}")
    cfg = train.make_config(**{k: v for k, v in settings.items() if k not in SPEED_OPTIONS})
    speedups = settings_.make(Speedups, lambda s: speed_checks(s, cfg),
                             **{k: v for k, v in settings.items() if k in SPEED_OPTIONS})
    return cfg, speedups


def run(**settings: Any) -> dict:
    """train.run with the speed layer: returns the record (see train.run)."""
    from .. import train
    cfg, speedups = check(**settings)
    return train.run(recipe=speedups, **dataclasses.asdict(cfg))
