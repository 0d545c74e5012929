"""vLLM's series on /metrics, beside offload's own: the names, types, labels and buckets of vLLM's Prometheus logger
(vllm/v1/metrics/loggers.py), so the dashboards and alerts written for `vllm serve` read `offload serve` as they
are. The prefix cache's queries count prompt tokens and its hits the tokens it gave, as vLLM's do."""

from __future__ import annotations

VLLM_LABELS = ("model_name", "engine")  # vLLM's labels on every series; this server runs one engine, "0"
VLLM_ENGINE = "0"
# vLLM's FinishReason strings: each has its request_success series from the start, as vLLM's logger makes them
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
VLLM_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                      40.0, 80.0)
VLLM_E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                      480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's buckets for a request's token counts: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


def kv_usage(engine) -> float:
    """The share of the engine's KV slots that running requests hold (0 to 1: vLLM's kv_cache_usage_perc)."""
    return engine.kv_slots_used / engine.capacity if engine.capacity else 0.0


class VllmMetrics:
    """vLLM's series in a registry, each labelled with the served model's name; ServeMetrics records into them."""

    def __init__(self, registry, engine, model_name: str, max_model_len: int):
        from prometheus_client import Counter, Gauge, Histogram

        labels = (model_name, VLLM_ENGINE)

        def counter(name: str, doc: str):
            return Counter(name, doc, VLLM_LABELS, registry=registry).labels(*labels)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=registry).labels(*labels)

        for name, doc, read in (
                ("vllm:num_requests_running", "requests in the running batch", lambda: engine.n_running),
                ("vllm:num_requests_waiting", "requests waiting for KV slots", lambda: engine.n_waiting),
                ("vllm:kv_cache_usage_perc", "share of the KV slots running requests hold, 0 to 1",
                 lambda: kv_usage(engine))):
            Gauge(name, doc, VLLM_LABELS, registry=registry).labels(*labels).set_function(read)
        self.prefix_queries = counter("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "prompt tokens the prefix cache gave")
        self.prompt_tokens = counter("vllm:prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = counter("vllm:generation_tokens", "tokens generated")
        self.success = Counter("vllm:request_success", "requests that left the engine, by why",
                               [*VLLM_LABELS, "finished_reason"], registry=registry)
        for reason in VLLM_FINISH_REASONS:
            self.success.labels(*labels, reason)
        self._labels = labels
        self.ttft = histogram("vllm:time_to_first_token_seconds", "from a request's arrival to its first token",
                              VLLM_TTFT_BUCKETS_S)
        self.itl = histogram("vllm:inter_token_latency_seconds", "between a request's consecutive tokens",
                             VLLM_ITL_BUCKETS_S)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "from a request's arrival to its end",
                             VLLM_E2E_BUCKETS_S)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "prompt tokens per request",
                                               token_buckets(max_model_len))
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "generated tokens per request (all its samples)",
                                                   token_buckets(max_model_len))

    def on_finish(self, finish_reason: str, n_prompt: int, n_generated: int, e2e_s: float, n_cached: int = 0) -> None:
        """A request left the engine: why, its prompt and generated tokens (all samples), seconds since it arrived,
        and the prompt tokens the prefix cache gave."""
        self.success.labels(*self._labels, finish_reason).inc()
        self.prompt_tokens.inc(n_prompt)
        self.prefix_queries.inc(n_prompt)
        self.prefix_hits.inc(n_cached)
        self.request_prompt_tokens.observe(n_prompt)
        self.request_generation_tokens.observe(n_generated)
        self.e2e.observe(e2e_s)
