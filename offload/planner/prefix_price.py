"""What the prefix cache saves a request, in the plan's own prices (`offload simulate --prefix-hit-rate`), and the
room its host tier takes of the CPU budget the plan leaves free.

A hit of rate r of a prompt's tokens leaves (1 - r) of them to compute, at the plan's prefill rate for its prompt
length, and copies the rest's K and V into the request's extent at the bandwidth of the memory its KV lives in (the
GPU's where the plan keeps any layer's KV there, else the host's). The computed tokens still attend to the cached
ones: the plan's rate per prompt token, taken at the whole prompt's length, prices that.
"""

from __future__ import annotations

from dataclasses import dataclass

from offload.errors import ConfigError


@dataclass(frozen=True)
class PrefixHitPrice:
    """One request's prompt without and with the hit: seconds to compute it, and the hit's copy."""

    hit_rate: float
    prompt_tokens: int
    prefill_s: float  # the whole prompt computed
    computed_s: float  # the tokens the cache did not give
    copy_s: float  # the cached tokens' K and V copied into the request's extent

    @property
    def hit_prefill_s(self) -> float:
        return self.computed_s + self.copy_s

    @property
    def speedup(self) -> float:
        return self.prefill_s / self.hit_prefill_s if self.hit_prefill_s > 0 else float("inf")

    def line(self) -> str:
        cached = round(self.hit_rate * self.prompt_tokens)
        return (f"prefix cache at {self.hit_rate:.0%} of a {self.prompt_tokens}-token prompt ({cached} tokens "
                f"cached): its prefill {self.prefill_s:.3g} s -> {self.hit_prefill_s:.3g} s (copy "
                f"{self.copy_s:.2g} s), {self.speedup:.1f}x sooner to its first token")


def price_prefix_hit(plan, spec, hw, hit_rate: float) -> PrefixHitPrice:
    """The plan's prefill of one prompt of its workload's length, with hit_rate of its tokens from the cache."""
    if not 0.0 <= hit_rate <= 1.0:
        raise ConfigError(f"--prefix-hit-rate must be a share of the prompt from 0 to 1, found {hit_rate}")
    prompt = plan.workload.prompt_len
    per_token_s = plan.prefill.step_s / max(plan.prefill.tokens_per_step, 1)
    cached = min(round(hit_rate * prompt), prompt - 1)  # the last prompt token is always computed
    on_gpu = any(u.kv_tier == "gpu" for u in plan.units)
    bandwidth = hw.gpu_mem_bps if on_gpu and hw.has_gpu else hw.cpu_mem_bps
    copy_s = 2 * cached * spec.kv_bytes_per_token(plan.workload.kv_elem_bytes) / bandwidth  # read and write
    return PrefixHitPrice(hit_rate, prompt, prompt * per_token_s, (prompt - cached) * per_token_s, copy_s)


def host_tier_bytes(plan, asked: int | None) -> int:
    """The host tier's bytes: asked where given (ConfigError where it passes the CPU budget the plan leaves free),
    else half of that room (0 without a plan: a placement given by hand leaves the budget unknown)."""
    from offload.hardware import format_bytes

    room = 0 if plan is None else max(0, plan.tier("cpu").budget_bytes - plan.tier("cpu").total_bytes)
    if asked is None:
        return room // 2
    if plan is not None and asked > room:
        raise ConfigError(f"prefix_cache.host_memory is {format_bytes(asked)} and the plan leaves "
                          f"{format_bytes(room)} of memory.cpu free; lower it, or raise memory.cpu")
    return asked
