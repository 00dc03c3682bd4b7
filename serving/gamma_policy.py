"""How many draft tokens a decode step proposes: a fixed number, or the controller's choice per step."""

from __future__ import annotations

from typing import Protocol

import torch

from tide.serving.controller import Controller


class GammaPolicy(Protocol):
    @property
    def gamma(self) -> int:
        """The last choice (the fixed setting for a fixed policy)."""
        ...

    @property
    def stop_below(self) -> float:
        """A chain ends early where the draft's confidence in it falls below this (0: never)."""
        ...

    def choose(self, workloads: list[str]) -> int: ...

    def observe(self, workloads: list[str], accepted: torch.Tensor, gamma: int, seconds: float) -> None: ...


class FixedGamma:
    def __init__(self, gamma: int):
        self.gamma = gamma
        self.stop_below = 0.0

    def choose(self, workloads: list[str]) -> int:
        return self.gamma

    def observe(self, workloads: list[str], accepted: torch.Tensor, gamma: int, seconds: float) -> None:
        pass


class AdaptiveGamma:
    """The controller's gamma for the batch's workloads; it learns from every step it chose."""

    def __init__(self, controller: Controller):
        self.controller = controller

    @property
    def gamma(self) -> int:
        return self.controller.last.gamma

    @property
    def stop_below(self) -> float:
        return self.controller.cfg.stop_below

    def choose(self, workloads: list[str]) -> int:
        return self.controller.choose(workloads).gamma

    def observe(self, workloads: list[str], accepted: torch.Tensor, gamma: int, seconds: float) -> None:
        self.controller.observe(workloads, accepted, gamma, seconds)
