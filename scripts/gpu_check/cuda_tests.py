"""The last step: ten representative CUDA tests (`pytest -m cuda`), one per thing a GPU run relies on, chosen by node
id prefix (a parametrized id may grow a suffix). Under --smoke they are collected and skipped (no GPU): the
selection is what runs there. An id that matches no collected test is named in the figures, not an error."""

from __future__ import annotations

import pytest

FILES = ("tests/test_cuda.py", "tests/test_triton_dequant.py", "tests/test_triton_moe.py",
         "tests/test_device_dequant_gguf.py")
CHOSEN = (
    "tests/test_cuda.py::test_cuda_placements_match_cpu[q4_0-mix1",  # streamed q4_0 through the fused kernels
    "tests/test_cuda.py::test_cuda_placements_match_cpu[none-2",  # a random mix of tiers, fp32
    "tests/test_cuda.py::test_cuda_bf16_placements_match_the_cpu_backend[q4_0-mix1",  # bf16, weights from disk
    "tests/test_cuda.py::test_cuda_moe_placements_match_the_cpu_backend[q4_0-experts-streamed-rest-cpu-qwen3_moe",
    "tests/test_cuda.py::test_cuda_layers_attending_over_a_host_kv_cache_match_the_device_cache[dtype1",  # bf16
    "tests/test_cuda.py::test_cuda_timings_are_resolved_as_steps_go_not_held_to_the_end",
    "tests/test_cuda.py::test_cuda_peak_memory_within_plan",
    "tests/test_triton_dequant.py::test_cuda_kernel_equals_the_scalar_reference[gemm-q4_0-tiled-bias",
    "tests/test_triton_moe.py::test_cuda_experts_forward_takes_the_grouped_kernels[6e-top3-24tok-q4_0-tiled",
    "tests/test_device_dequant_gguf.py::test_cuda_triton_path_equals_the_torch_dequant[dtype1-64-q4_k",
)


class Selection:
    """A pytest plugin keeping, of the collected tests, the first one matching each chosen prefix, and recording
    each kept test's outcome and seconds."""

    def __init__(self, prefixes: tuple[str, ...]):
        self.prefixes = prefixes
        self.matched: dict[str, str] = {}
        self.outcomes: dict[str, dict] = {}

    @pytest.hookimpl(trylast=True)  # after `-m cuda` has deselected the rest (a test's simulated-device twin)
    def pytest_collection_modifyitems(self, session, config, items):
        keep = []
        for prefix in self.prefixes:
            item = next((i for i in items if i.nodeid.startswith(prefix) and i.get_closest_marker("cuda")
                         and i not in keep), None)
            if item is not None:
                keep.append(item)
                self.matched[prefix] = item.nodeid
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":  # a setup error or skip, or the call itself
            entry = self.outcomes.setdefault(report.nodeid, {"outcome": report.outcome, "seconds": 0.0})
            entry["seconds"] = round(entry["seconds"] + report.duration, 2)
            if report.outcome != "passed":
                entry["outcome"] = report.outcome
                entry["why"] = " ".join(str(report.longrepr).split())[-300:]


def cuda_tests(ctx) -> None:
    selection = Selection(CHOSEN)
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "-m", "cuda", *FILES], plugins=[selection])
    ctx.put("tests", selection.outcomes)
    ctx.put("not_found", [p for p in CHOSEN if p not in selection.matched])
    counts = {}
    for entry in selection.outcomes.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    ctx.summary(**counts, not_found=len(ctx.figures["not_found"]))
    if counts.get("failed"):
        raise AssertionError(f"{counts['failed']} of {len(selection.outcomes)} CUDA tests failed (pytest exit {rc})")
    if not ctx.smoke and not counts.get("passed"):
        raise AssertionError(f"no CUDA test passed (pytest exit {rc}): {selection.outcomes}")
