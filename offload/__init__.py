"""offload: run LLMs larger than the GPU across VRAM, pinned RAM, disk and CPU SIMD units."""

__version__ = "0.1.0"

# The Python API is imported lazily so that `offload.spec` and `offload.planner`
# stay importable without torch.
_LAZY = {
    "LLM": "offload.api",
    "SamplingParams": "offload.sampling",
    "StructuredOutputsParams": "offload.structured",
    "RequestOutput": "offload.api",
    "run_batch": "offload.jobs.run",
    "simulate": "offload.simulate",
    "PlanRequest": "offload.planner",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'offload' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "run_batch", "simulate", "PlanRequest",
           "__version__"]
