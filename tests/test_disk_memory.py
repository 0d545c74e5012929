"""Host memory of a run with weights on disk as a memory cgroup counts it (resident memory plus the page cache the
run's reads leave behind), and the page cache a run in a cgroup plans with: the planner keeps 1/16 of the cgroup's
limit aside, not 1/16 of the host's RAM.

Each run goes in a child process placed in a memory cgroup of its own (root and a cgroup v1 or v2 memory
controller needed; skipped otherwise). The child measures its baseline (~200 MiB: torch and the tokenizer), takes
a budget of that + 192 MiB for a 330 MB model, and sets its cgroup's limit from the budget before it plans:
  bounded  budget + 128 MiB: far enough above what the run should use that the kernel reclaims nothing for it
           (a page cache left to grow would show in the peak), too little for the planner to find page-cache room
           (less than PAGE_CACHE_ROUNDING once 1/16 of the limit is kept aside).
  roomy    2 x budget: the planner finds room, leaves disk units to the page cache, and the run reads them from
           the device once instead of at every pass.
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

TOKENS = 8  # a prefill pass, then TOKENS - 1 decode passes
CHILD = r"""
import json, sys
from pathlib import Path
from offload import LLM, SamplingParams
from offload.runtime.host_memory import process_baseline_bytes
model, limit_file, rule = sys.argv[1:4]
baseline = process_baseline_bytes(model)
budget = baseline + 192 * 2**20
limit = budget + 128 * 2**20 if rule == "bounded" else 2 * budget
Path(limit_file).write_text(str(limit))
llm = LLM(model, dtype="bf16", cpu_memory=budget, disk_memory="1GiB", max_model_len=48, max_tokens=TOKENS,
          batch_size=1, backend="cpu", host_baseline=baseline)
read = lambda: int(next(ln for ln in open("/proc/self/io") if ln.startswith("read_bytes")).split()[1])
before = read()
out = llm.generate([list(range(1, 17))], SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
disk = [u for u in llm.plan.units if u.weight_tier == "disk" and u.kind != "embed"]
print(json.dumps({"budget": budget, "limit": limit, "room": llm.plan.budget.page_cache_bytes, "read": read() - before,
                  "kept": sorted(llm.model.placement.page_cache or []),
                  "kept_bytes": sum(u.weight_bytes for u in disk if u.page_cached),
                  "dropped_bytes": sum(u.weight_bytes for u in disk if not u.page_cached),
                  "tokens": out[0].token_ids}))
""".replace("TOKENS", str(TOKENS))


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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    config = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=8000, max_position_embeddings=64)
    return save_hf_model(make_hf_model("llama", **config).to(torch.bfloat16), tmp_path_factory.mktemp("m") / "model")


def _run_in_cgroup(path: Path, rule: str) -> tuple[dict, int]:
    """The child's figures and the cgroup's peak, for a child that sets its limit by rule, started with the
    checkpoint out of the page cache."""
    cgroup = _memory_cgroup(f"offload-test-{os.getpid()}-{rule}")
    if cgroup is None:
        pytest.skip("needs root and a memory cgroup controller to account the run's memory")
    folder, limit_file, peak_file = cgroup
    try:
        fd = os.open(path / "model.safetensors", os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        proc = subprocess.run([sys.executable, "-c", CHILD, str(path), str(folder / limit_file), rule],
                              capture_output=True, text=True, timeout=600,
                              preexec_fn=lambda: (folder / "cgroup.procs").write_text(str(os.getpid())))
        assert proc.returncode == 0, proc.stderr[-3000:]
        peak = int((folder / peak_file).read_text())
    finally:
        folder.rmdir()
    return json.loads(proc.stdout.strip().splitlines()[-1]), peak


def test_resident_memory_and_page_cache_stay_within_the_budget(model_dir):
    result, peak = _run_in_cgroup(model_dir, "bounded")
    size = (model_dir / "model.safetensors").stat().st_size
    budget = result["budget"]
    assert result["dropped_bytes"] > 0.3 * size and result["room"] == 0 and result["kept"] == []
    assert peak <= 1.05 * budget, f"peak {peak / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB"


def test_a_cgroup_with_room_keeps_disk_units_in_the_page_cache(model_dir):
    """With the limit at twice the budget the planner counts page cache beside it (with the host's 1/16 of RAM
    kept aside, a 24 GiB host left none), the kept units are read from the device once, the others at each of the
    TOKENS passes, and resident memory plus page cache stay within the budget and the room the plan counted."""
    result, peak = _run_in_cgroup(model_dir, "roomy")
    assert result["room"] > 0 and result["kept"] and result["kept_bytes"] > 0
    expected = result["kept_bytes"] + result["dropped_bytes"] * TOKENS
    assert result["read"] <= 1.1 * expected + 16 * 2**20, (result, expected)
    within = result["budget"] + result["room"]
    assert peak <= 1.05 * within, f"peak {peak / 2**20:.0f} MiB, budget + room {within / 2**20:.0f} MiB"
