"""The server's Prometheus metrics: requests running and waiting, KV slots used, tokens, time to first token and
inter-token latency, and each resource's busy share per phase (the report's, kept as running totals); and the same
measurements under vLLM's names (vllm_metrics.py)."""

from __future__ import annotations

from offload.planner.types import PHASES
from offload.profile.timeline import RESOURCES, Timeline
from offload.serve.vllm_metrics import VllmMetrics

# Offloaded models answer in milliseconds on a GPU and in seconds when weights stream from RAM or disk.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
ITL_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40)


class ServeMetrics:
    """One registry per server (tests build several in one process); the engine thread records into it."""

    def __init__(self, engine, model_name: str, max_model_len: int):
        """engine: what the gauges read; model_name: the served name vLLM's series carry; max_model_len: the
        context, the top of vLLM's token-count buckets."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        for name, help_text, read in (
                ("offload_requests_running", "requests in the running batch", lambda: engine.n_running),
                ("offload_requests_waiting", "requests waiting for KV slots", lambda: engine.n_waiting),
                ("offload_kv_slots_used", "KV cache slots held by running requests", lambda: engine.kv_slots_used),
                ("offload_kv_slots", "KV cache slots in the engine's pool", lambda: engine.capacity)):
            Gauge(name, help_text, registry=r).set_function(read)
        self.prompt_tokens = Counter("offload_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.prefill_tokens = Counter("offload_prefill_tokens", "prompt tokens run through the model (a prompt "
                                      "with n samples is run once)", registry=r)
        self.generated_tokens = Counter("offload_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("offload_requests_finished", "requests that left the engine, by why",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("offload_time_to_first_token_seconds", "from a request's arrival to its first token",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("offload_inter_token_latency_seconds", "between a request's consecutive tokens",
                             buckets=ITL_BUCKETS_S, registry=r)
        self.busy = Counter("offload_resource_busy_seconds", "seconds each resource was busy, by phase",
                            ["resource", "phase"], registry=r)
        self.phase = Counter("offload_phase_seconds", "seconds of steps, by phase", ["phase"], registry=r)
        self.share = Gauge("offload_resource_busy_share", "busy seconds over the phase's seconds since the start "
                           "(the report's busy share)", ["resource", "phase"], registry=r)
        self._busy_s = {(res, ph): 0.0 for res in RESOURCES for ph in PHASES}
        self._phase_s = dict.fromkeys(PHASES, 0.0)
        self.vllm = VllmMetrics(r, engine, model_name, max_model_len)

    def on_tokens(self, n_tokens: int, since_s: float, first: bool, per_sample: int | None = None) -> None:
        """n_tokens new tokens of one request (per_sample of them each of its samples: n_tokens if one), since_s
        after its arrival (first) or its previous tokens."""
        per_sample = per_sample or n_tokens
        for counter in (self.generated_tokens, self.vllm.generation_tokens):
            counter.inc(n_tokens)
        if first:
            histograms, observed = (self.ttft, self.vllm.ttft), [since_s]
        else:
            histograms, observed = (self.itl, self.vllm.itl), [since_s / per_sample] * per_sample
        for histogram in histograms:
            for value_s in observed:
                histogram.observe(value_s)

    def on_finish(self, finish_reason: str, n_prompt: int, n_generated: int, e2e_s: float, n_cached: int = 0) -> None:
        """A request left the engine: why, its prompt and generated tokens (all samples), seconds since it arrived,
        and the prompt tokens the prefix cache gave."""
        self.finished.labels(finish_reason).inc()
        self.prompt_tokens.inc(n_prompt)
        self.vllm.on_finish(finish_reason, n_prompt, n_generated, e2e_s, n_cached)

    def on_step(self, timeline: Timeline | None) -> None:
        """Move what the model's timeline recorded since the last step into the busy counters (and clear it)."""
        if timeline is None:
            return
        taken = timeline.drain()
        self.prefill_tokens.inc(sum(shape.n_prompt_tokens for shape in taken.steps))
        for ph in PHASES:
            self._phase_s[ph] += taken.phase_time_s.get(ph, 0.0)
            self.phase.labels(ph).inc(taken.phase_time_s.get(ph, 0.0))
            for res in RESOURCES:
                busy_s = taken.busy_s(res, ph)
                self._busy_s[res, ph] += busy_s
                self.busy.labels(res, ph).inc(busy_s)
                if self._phase_s[ph] > 0:
                    self.share.labels(res, ph).set(self._busy_s[res, ph] / self._phase_s[ph])

    def exposition(self) -> tuple[bytes, str]:
        """The text /metrics answers, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
