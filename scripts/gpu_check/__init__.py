"""The GPU check (scripts/gpu_check.sh): measure first, write as it goes.

From a cold machine: the build, the kernel-path check and the environment, then ten items, each a function in a
process of its own that appends one JSON line to $OUT/items.jsonl as it ends (steps.py lists them with their
limits): (1) the attention path and its cost at offload's decode and prefill shapes; (2) a 600-token prompt through
GPU layers against the CPU backend; (3) context and allocator memory after each library loads; (4) host->device
rate through the real pinning path, alone and beside a CPU memory reader; (5) hand-over latency, idle and under a
weight copy; (6) the fused Triton kernels on the 70B's four weight shapes against dequantize + cuBLAS; (7) host
cost of a GPU decode layer and a MoE layer; (8) the 70B in q4_0 at 22 GiB, batch 1, on the profile items 3-7
measured; (9) the same at batch 32 with 512-token prompts; (10) the device's peak during 8 and 9; then ten
representative CUDA tests.

  PYTHONPATH=scripts python -m gpu_check run [--smoke] --out OUT --state STATE
  PYTHONPATH=scripts python -m gpu_check item NAME [--smoke] --out OUT --state STATE   (one item, this process)
"""
