"""Host memory of a run with weights on disk as a memory cgroup counts it: resident memory plus the page cache the
run's reads leave behind stay within the CPU budget + 5% when the page cache has no room beside the budget.

The run goes in a child process placed in a memory cgroup of its own (root and a cgroup v1 or v2 memory
controller needed; skipped otherwise). Its limit, 1 GiB, is far enough above what the run should use (~450 MiB)
that the kernel reclaims nothing for it (a page cache left to grow would show in the peak), and low enough that
the planner finds no room for the page cache to keep disk units beside the budget (it keeps 1/16 of RAM aside).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_hf_model, save_hf_model

from offload.system import memory_cgroup

LIMIT_BYTES = 2**30
CHILD = r"""
import json, sys
from offload import LLM, SamplingParams
from offload.runtime.host_memory import process_baseline_bytes
model = sys.argv[1]
budget = process_baseline_bytes(model) + 192 * 2**20
llm = LLM(model, dtype="bf16", cpu_memory=budget, disk_memory="1GiB", max_model_len=48, max_tokens=8,
          max_batch_size=1, backend="cpu")
out = llm.generate([list(range(1, 17))], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
print(json.dumps({"budget": budget, "disk": llm.plan.tier("disk").weights_bytes,
                  "kept": sorted(llm.model.placement.page_cache or []), "tokens": out[0].token_ids}))
"""


def _memory_cgroup(tmp_name: str) -> tuple[Path, str, str] | None:
    """A new memory cgroup under this process's own: (folder, limit file, peak file), or None where none can be
    made."""
    found = memory_cgroup() if os.geteuid() == 0 else None
    if found is None:
        return None
    parent, v2 = found
    limit, peak = ("memory.max", "memory.peak") if v2 else ("memory.limit_in_bytes", "memory.max_usage_in_bytes")
    folder = parent / tmp_name
    try:
        folder.mkdir()
    except OSError:
        return None
    if not (folder / limit).exists() or not (folder / peak).exists():
        folder.rmdir()
        return None
    return folder, limit, peak


def test_resident_memory_and_page_cache_stay_within_the_budget(tmp_path):
    config = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=8000, max_position_embeddings=64)
    path = save_hf_model(make_hf_model("llama", **config).to(torch.bfloat16), tmp_path / "model")
    cgroup = _memory_cgroup(f"offload-test-{os.getpid()}")
    if cgroup is None:
        pytest.skip("needs root and a memory cgroup controller to account the run's memory")
    folder, limit_file, peak_file = cgroup
    size = (path / "model.safetensors").stat().st_size
    try:
        (folder / limit_file).write_text(str(LIMIT_BYTES))
        os.posix_fadvise(os.open(path / "model.safetensors", os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
        proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True,
                              timeout=600, preexec_fn=lambda: (folder / "cgroup.procs").write_text(str(os.getpid())))
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        peak = int((folder / peak_file).read_text())
    finally:
        folder.rmdir()
    budget = result["budget"]
    assert result["disk"] > 0.3 * size and result["kept"] == []  # weights on disk; the page cache keeps none
    assert peak <= 1.05 * budget, f"peak {peak / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB"
