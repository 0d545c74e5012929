"""The check's steps in the order they run, each with its limit: the H100 time estimated from the work it does
(bytes, launches, compiles), and a timeout of about twice that. A step is a command (the build, the kernel-path
check) or an item: a function `module:function` taking a Context (gpu_check.context), run in a process of its
own so that a step killed at its limit, or a CUDA error that poisons its context, takes no other step with it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
START_S = 3  # an item's process start on the H100 machine: Python and torch imported (2 s), a CUDA context (1 s)


@dataclass(frozen=True)
class Step:
    """One line of items.jsonl: a command or an item function, its limit and the estimate behind it."""

    name: str
    item: int | None  # the item number (None: build, kernel check, environment, tests)
    estimate_s: int  # expected seconds on an H100 machine (16 cores), from the arithmetic beside it
    timeout_s: int
    target: str = ""  # "module:function" of an item
    command: tuple[str, ...] = ()  # argv of a command step ({py}: this Python)
    modes: tuple[str, ...] = ("cuda", "smoke")
    min_s: int = 10  # not started with less of the budget left than this
    needs: str = ""  # a path under the checkout without which the step is left out (the kernel check's module)

    def argv(self, python: str) -> list[str]:
        return [python if a == "{py}" else a for a in self.command]

    def runs_in(self, mode: str) -> bool:
        return mode in self.modes and (not self.needs or (ROOT / self.needs).exists())


STEPS = (
    # 9 C++ files at -O3 (the AVX-512 tiles and the two pybind11 files the slowest, ~25 s each on one core):
    # ~30 s with the files compiled side by side (setup.py's ParallelCompile), ~90 s one after another; 150 s lets
    # a serial build end
    Step("build", None, 30, 150, command=("{py}", "setup.py", "-q", "build_ext", "--inplace"), modes=("cuda",)),
    # the first import of torch on a cold machine (~1 GB of libraries read from disk) and offload.kernels: 5 s
    Step("kernel_check", None, 5, 15, command=("{py}", "-m", "offload.kernels.check"),
         needs="offload/kernels/check.py"),
    # START_S + nvidia-smi (1 s): 4 s
    Step("environment", None, 4, 10, "gpu_check.environment:environment"),
    # START_S + Triton compiles of the split-K decode kernel (split and combine, 2 s each; batch 1 is a second
    # specialisation: 8 s) + 24 SDPA accept checks (the math path's fp32 scores at [64, 512, 4096]: 0.5 GB, ~2 ms)
    # + 9 shapes x 30 timed calls (<= 5 ms): 15 s. Its line lands within the first minute after the build: the
    # three limits so far add up to 60 s (tests/test_gpu_check.py holds them to it)
    Step("attention", 1, 15, 35, "gpu_check.attention:attention"),
    # START_S + 3 placements x (two 3-layer fp32 models of 2.6 M parameters built, a 600-token forward on the
    # GPU and on the CPU backend ~0.3 s, two generations of 8 tokens ~25 steps x 5 ms): 12 s
    Step("prompt_vs_cpu", 2, 12, 45, "gpu_check.correctness:prompt_vs_cpu"),
    # START_S + cuBLAS's module load 0.5 s + a q4_0 Triton compile 2 s + SDPA's kernels 0.5 s + the decode kernel
    # (Triton's disk cache holds it from item 1) 0.5 s: 8 s
    Step("memory", 3, 8, 30, "gpu_check.memory:library_memory"),
    # START_S + 1 GiB of host memory faulted in (0.3 s) and registered (0.2 s) + 8 pinned copies at ~50 GB/s
    # (0.2 s) + 4 pageable ones at ~10 GB/s (0.4 s) + 2 s beside a reader + 1 s of combined_read_bps: 8 s
    Step("h2d", 4, 8, 30, "gpu_check.transfers:h2d"),
    # START_S + 41 round trips of measure_handover_s (each <= 10 ms under a 256 MiB copy) + 2 x 20 through the
    # backend: 5 s
    Step("handover", 5, 5, 25, "gpu_check.transfers:handover"),
    # START_S + Triton compiles (gemv at 1 row, gemm tiles at 8/32/512 rows, q4_0 and q8_0: <= 8 x 1.5 s) + 64
    # points x 60 calls x ~0.3 ms (the largest: gate_up at 512 rows dequantized, 0.94 GB written + 0.48 TFLOP,
    # 1.2 ms) + the bf16 cuBLAS curve and rooflines (1 s): 25 s
    Step("fused_matmul", 6, 25, 60, "gpu_check.matmul:fused_matmul"),
    # START_S + a 1-layer Llama-70B (0.45 GB q4_0 layer, 0.15 GB lm_head at a 32k vocab) made and uploaded 3 s
    # (+2 s while random weights are untiled per layer) + 2 batches x 17 steps 2 s + a 1-layer Qwen3-30B-A3B
    # (128 experts, 0.34 GB) 4 s + one profiled step per model for launch counts (CUPTI's start 2 s): 20 s
    Step("host_cost", 7, 20, 60, "gpu_check.host_time:host_cost"),
    # START_S + `offload calibrate --quick`'s CPU curves (~60 s, the issue's figure) + a 70B q4_0 model planned
    # and built at 22 GiB (~18 GB of resident layers uploaded ~15 s; 60 s more while random weights are untiled
    # per layer) + warm-up (one 512-token pass streaming ~20 GB at ~50 GB/s, 2 s) + timed (prefill 1 s, 8 decode
    # steps x ~0.5 s): 90 s
    Step("offload_70b_batch1", 8, 90, 150, "gpu_check.offload_70b:batch1"),
    # START_S + build 15 s + warm-up (32 prompts of 16 tokens: one pass, 2 s) + prefill of 32 x 512 tokens (4
    # passes of 4096: 2.3 PFLOP at ~400 TFLOP/s dequantize + cuBLAS ~6 s, 4 x 0.4 s of streamed weights) + 8
    # decode steps x ~0.6 s: 35 s
    Step("offload_70b_batch32", 9, 35, 90, "gpu_check.offload_70b:batch32"),
    # reads items 8 and 9's figures, no torch: 1 s
    Step("device_peak", 10, 1, 10, "gpu_check.memory:device_peak", min_s=2),
    # START_S + a 6-layer fp32 model of 13.6 M parameters written (1 s) + two LLMs planned and loaded at 658 MiB,
    # the draft's q8_0 copies quantized (2 s) + 3 prompts x 24 tokens with and without drafts (~60 steps x ~50 ms
    # of launches, Triton's q8_0 kernels compiled by item 6): 12 s
    Step("substitute", None, 12, 40, "gpu_check.substitute:substitute"),
    # pytest's start and collection 5 s + ten tiny-model tests of ~2 s (Triton kernels in the disk cache): 30 s
    Step("cuda_tests", None, 30, 90, "gpu_check.cuda_tests:cuda_tests"),
)
BY_NAME = {s.name: s for s in STEPS}
