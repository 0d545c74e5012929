"""Placement: for each unit, where its weights live and where it computes in each phase (from a Plan, or by hand)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from offload.errors import ConfigError
from offload.planner.types import (COMPUTE_MODES, DEFAULT_PREFETCH_DEPTH, DEFAULT_PREFILL_CHUNK_TOKENS,
                                   DEFAULT_PREFILL_PASS_TOKENS, TIERS, Plan)
from offload.spec import ModelSpec


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
        if self.weights not in TIERS or {self.prefill, self.decode} - set(COMPUTE_MODES):
            raise ConfigError(f"placement of {name} is invalid ({self}); weights go to gpu, cpu or disk and "
                              f"compute is gpu, stream or cpu")
        resident = self.weights == "gpu"
        if resident != (self.prefill == "gpu") or resident != (self.decode == "gpu"):
            raise ConfigError(f"placement of {name}: weights on the gpu compute there (mode 'gpu'), and only they "
                              f"do; found weights={self.weights}, prefill={self.prefill}, decode={self.decode}")


@dataclass(frozen=True)
class Placement:
    """What the executor runs and allocates: every unit's placement, the staging slots (prefetch_depth of
    staging_slot_bytes), the disk read-ahead (read_ahead units ahead, in an arena of read_buffer_bytes) and the
    tokens of one prefill pass. Sizes left None are taken from the units' own buffers (a placement made by hand)."""

    units: dict[str, UnitPlacement]
    prefetch_depth: int = DEFAULT_PREFETCH_DEPTH
    read_ahead: int = DEFAULT_PREFETCH_DEPTH
    staging_slot_bytes: int | None = None
    read_buffer_bytes: int | None = None
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS  # tokens one layer computes at once in prefill
    prefill_pass_tokens: int = DEFAULT_PREFILL_PASS_TOKENS  # padded prompt tokens per pass over the weights
    page_cache: frozenset[str] | None = None  # disk units the OS page cache is left to keep (None: every one)

    def __post_init__(self):
        for name, p in self.units.items():
            p.check(name)
        if min(self.prefetch_depth, self.read_ahead, self.prefill_chunk_tokens, self.prefill_pass_tokens) < 1:
            raise ConfigError(f"prefetch_depth, read_ahead, prefill_chunk_tokens and prefill_pass_tokens must be at "
                              f"least 1, found {self.prefetch_depth}, {self.read_ahead}, {self.prefill_chunk_tokens} "
                              f"and {self.prefill_pass_tokens}")

    def __getitem__(self, unit: str) -> UnitPlacement:
        return self.units[unit]

    def page_cache_keeps(self, unit: str) -> bool:
        """Whether the page cache may keep a disk unit's pages after a read (else they are dropped behind it, so
        that the cache does not grow past what the plan counted on)."""
        return self.page_cache is None or unit in self.page_cache

    @classmethod
    def from_plan(cls, plan: Plan) -> "Placement":
        """The placement a planner Plan decided, with the buffers it budgeted."""
        units = {u.name: UnitPlacement(u.weight_tier, u.prefill, u.decode, _kv_tier(u.kv_tier, u.decode))
                 for u in plan.units}
        return cls(units, prefetch_depth=max(1, plan.prefetch_depth), read_ahead=max(1, plan.read_ahead_depth),
                   staging_slot_bytes=plan.staging_slot_bytes, read_buffer_bytes=plan.read_buffer_bytes,
                   prefill_chunk_tokens=plan.workload.prefill_chunk_tokens,
                   prefill_pass_tokens=plan.workload.prefill_pass_tokens,
                   page_cache=frozenset(u.name for u in plan.units if u.page_cached))

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
            weights = rng.choice(TIERS)
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
