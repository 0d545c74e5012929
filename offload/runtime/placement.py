"""Placement: for each unit, where its weights live and where it computes in each phase (from a Plan, or by hand)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from offload.errors import ConfigError
from offload.spec import ModelSpec

WEIGHT_TIERS = ("gpu", "cpu", "disk")
COMPUTE_MODES = ("gpu", "stream", "cpu")


@dataclass(frozen=True)
class UnitPlacement:
    """weights: gpu | cpu | disk; prefill / decode: gpu (resident) | stream | cpu; kv: gpu | cpu for layers."""

    weights: str
    prefill: str
    decode: str
    kv: str | None = None

    def mode(self, phase: str) -> str:
        return self.prefill if phase == "prefill" else self.decode

    def check(self, name: str) -> None:
        if self.weights not in WEIGHT_TIERS or {self.prefill, self.decode} - set(COMPUTE_MODES):
            raise ConfigError(f"placement of {name} is invalid ({self}); weights go to gpu, cpu or disk and "
                              f"compute is gpu, stream or cpu")
        resident = self.weights == "gpu"
        if resident != (self.prefill == "gpu") or resident != (self.decode == "gpu"):
            raise ConfigError(f"placement of {name}: weights on the gpu compute there (mode 'gpu'), and only they "
                              f"do; found weights={self.weights}, prefill={self.prefill}, decode={self.decode}")


@dataclass(frozen=True)
class Placement:
    """Every unit's placement, the prefetch depth (staging slots) and the disk read-ahead depth."""

    units: dict[str, UnitPlacement]
    prefetch_depth: int = 2
    read_ahead: int = 2

    def __post_init__(self):
        for name, p in self.units.items():
            p.check(name)
        if self.prefetch_depth < 1 or self.read_ahead < 1:
            raise ConfigError("prefetch_depth and read_ahead must be at least 1")

    def __getitem__(self, unit: str) -> UnitPlacement:
        return self.units[unit]

    @classmethod
    def from_plan(cls, plan) -> "Placement":
        """The placement a planner Plan decided."""
        units = {u.name: UnitPlacement(u.weight_tier, u.prefill, u.decode, _kv_tier(u.kv_tier, u.decode))
                 for u in plan.units}
        return cls(units, prefetch_depth=max(1, plan.prefetch_depth))

    @classmethod
    def uniform(cls, spec: ModelSpec, weights: str, compute: str, **kwargs) -> "Placement":
        """Every unit alike: e.g. ("cpu", "cpu"), ("gpu", "gpu"), ("cpu", "stream"), ("disk", "stream")."""
        return cls({u.name: _unit(weights, compute, compute) for u in spec.units()}, **kwargs)

    @classmethod
    def random(cls, spec: ModelSpec, seed: int, **kwargs) -> "Placement":
        """A random valid mix, for tests."""
        rng = random.Random(seed)
        units = {}
        for u in spec.units():
            weights = rng.choice(WEIGHT_TIERS)
            modes = ["gpu"] if weights == "gpu" else ["stream", "cpu"]
            units[u.name] = _unit(weights, rng.choice(modes), rng.choice(modes))
        return cls(units, **kwargs)


def _kv_tier(kv: str | None, decode: str) -> str:
    """The KV cache lives where the block decodes."""
    if kv in ("gpu", "cpu"):
        return kv
    return "cpu" if decode == "cpu" else "gpu"


def _unit(weights: str, prefill: str, decode: str) -> UnitPlacement:
    return UnitPlacement(weights, prefill, decode, _kv_tier(None, decode))
