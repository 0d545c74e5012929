"""The cost model's decisions on real models and machines: CPU vs stream flips, physical bounds, speed."""

import json
from pathlib import Path

import pytest

from offload.hardware import load_hardware
from offload.planner import Budget, Workload, plan
from offload.spec import load_spec

MODELS = Path(__file__).resolve().parent.parent / "configs" / "models"
GiB = 2**30


@pytest.fixture(scope="module")
def llama70b():
    return load_spec(MODELS / "llama-3.1-70b")


def plan_70b(spec, hw, batch_size, prompt_len=512, gen_len=128):
    return plan(spec, hw, Budget.for_hardware(hw, gpu_bytes=22 * GiB),
                Workload(batch_size=batch_size, prompt_len=prompt_len, gen_len=gen_len), "q4_0")


def host_layers(p):
    return [u for u in p.units if u.kind == "layer" and u.weight_tier != "gpu"]


def test_70b_q4_on_4090_fits_22gib_and_decode_speed_is_physical(llama70b):
    hw = load_hardware("rtx4090-ddr5")  # 64 GiB DDR5 at 60 GB/s, PCIe 4.0 at 25 GB/s
    p = plan_70b(llama70b, hw, batch_size=1)
    assert p.tier("gpu").total_bytes <= 22 * GiB and p.tier("cpu").total_bytes <= p.budget.cpu_bytes
    assert 30 <= p.n_gpu_units <= 50  # ~19 GiB of 459 MiB q4_0 layers fit beside KV, workspace and staging
    # Every byte of a RAM-resident unit crosses DRAM once per token (read by a CPU kernel or by DMA), and
    # VRAM-resident bytes cross GPU memory once: those set the ceiling on batch-1 decode.
    host_bytes = sum(u.weight_bytes for u in p.units if u.weight_tier == "cpu" and u.kind != "embed")
    gpu_bytes = sum(u.weight_bytes for u in p.units if u.weight_tier == "gpu")
    ceiling = 1 / max(host_bytes / hw.cpu_mem_bps, gpu_bytes / hw.gpu_mem_bps)
    assert p.decode.tokens_per_s <= ceiling * (1 + 1e-9)
    # ...and no worse than doing it all serially: host bytes at DRAM speed, then GPU bytes at VRAM speed.
    floor = 1 / (host_bytes / min(hw.cpu_mem_bps, hw.h2d_pinned_bps) + gpu_bytes / hw.gpu_mem_bps)
    assert p.decode.tokens_per_s >= floor
    assert 1.5 < p.decode.tokens_per_s < 4.0  # i.e. about 3 tokens/s, as llama.cpp users report for this setup


def test_batch1_decode_computes_host_blocks_on_cpu_prefill_streams_them(llama70b):
    p = plan_70b(llama70b, load_hardware("rtx4090-ddr5"), batch_size=1)
    layers = host_layers(p)
    on_cpu = sum(u.decode == "cpu" for u in layers)
    # A few layers stream: PCIe is idle while the GPU runs its resident layers, so it prefetches those few.
    assert on_cpu >= 0.8 * len(layers)
    assert all(u.prefill == "stream" for u in layers)
    assert p.decode.cpu_share > 0.5 and p.prefill.gpu_share > 0.9


def test_large_batch_decode_streams_host_blocks(llama70b):
    p = plan_70b(llama70b, load_hardware("rtx4090-ddr5"), batch_size=128, prompt_len=128, gen_len=32)
    layers = host_layers(p)
    assert sum(u.decode == "stream" for u in layers) > 0.6 * len(layers)


def _flip_batch(spec, hw) -> int:
    """Smallest batch at which most RAM-resident layers stream in decode."""
    for batch_size in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256):
        layers = host_layers(plan_70b(spec, hw, batch_size, prompt_len=128, gen_len=32))
        if sum(u.decode == "stream" for u in layers) > len(layers) / 2:
            return batch_size
    return 10**9


def test_pcie5_flips_to_streaming_at_a_smaller_batch_than_pcie3(llama70b):
    desktop = load_hardware("rtx4090-ddr5")
    pcie3 = _flip_batch(llama70b, desktop.with_changes(h2d_pinned_bps=12e9))
    pcie5 = _flip_batch(llama70b, desktop.with_changes(h2d_pinned_bps=50e9))
    assert 1 < pcie5 < pcie3 < 10**9


def test_cpu_only_machine_plans_everything_on_cpu_and_disk(llama70b):
    hw = load_hardware("cpu-desktop")  # 32 GiB RAM: the 38 GiB of q4_0 weights cannot all stay in RAM
    p = plan(llama70b, hw, Budget.for_hardware(hw, disk_bytes=100 * GiB), Workload(), "q4_0")
    assert p.summary_line.startswith("blocks: 0 of 83 resident on the GPU;") and p.tier("gpu").total_bytes == 0
    assert p.summary_line.endswith(f"; {sum(u.weight_tier == 'disk' for u in p.units)} read from disk")
    assert {u.prefill for u in p.units} == {u.decode for u in p.units} == {"cpu"}
    assert p.tier("disk").weights_bytes > 0 and p.tier("cpu").total_bytes <= p.budget.cpu_bytes
    assert p.decode.bound == "disk"


def _count_work(monkeypatch) -> dict:
    """Patches the search to count what planning spends its time on: steps priced and units walked (a price or a
    candidate's build walks every unit)."""
    from offload.planner import search

    work = {"prices": 0, "units": 0}
    price, build = search.price_step, search.Search._build

    def priced(*args, **kwargs):
        work["prices"] += 1
        work["units"] += len(args[4])  # the step's unit costs
        return price(*args, **kwargs)

    def built(self, *args, **kwargs):
        work["units"] += self.n
        return build(self, *args, **kwargs)

    monkeypatch.setattr(search, "price_step", priced)
    monkeypatch.setattr(search.Search, "_build", built)
    return work


def test_planning_80_layers_prices_a_step_a_few_times_per_unit(llama70b, monkeypatch):
    """Every count of GPU residents is weighed for a real model (the plan is the best of them all): a step is
    priced (a pass over all 83 units) a few times per unit, ~0.3 ms each (scripts/bench_plan.py times a plan:
    40-70 ms on 2 cores)."""
    work = _count_work(monkeypatch)
    hw = load_hardware("rtx4090-ddr5")
    n_units = len(llama70b.units())
    for batch_size in (1, 32):
        work["prices"] = 0
        plan_70b(llama70b, hw, batch_size)
        assert 0 < work["prices"] <= 3 * n_units


def _wide_llama(folder: Path, n_layers: int):
    """Llama 3.1 8B's config with n_layers 512 wide (6 MiB a layer in bf16: 1,000 fit a 22 GiB GPU)."""
    config = json.loads((MODELS / "llama-3.1-8b" / "config.json").read_text())
    config.update(num_hidden_layers=n_layers, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=32000)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return load_spec(folder)


@pytest.mark.parametrize("machine, budget", [
    ("rtx4090-ddr5", dict(gpu_bytes=22 * GiB)),  # every layer fits the GPU: 500 or 1,000 counts of residents
    ("rtx4090-ddr5", dict(gpu_bytes=2 * GiB, cpu_bytes=3 * GiB, disk_bytes=1 << 40)),  # layers spill to disk
    ("cpu-desktop", dict(cpu_bytes=3 * GiB, disk_bytes=1 << 40)),
])
def test_planning_work_grows_linearly_with_the_layers(tmp_path, monkeypatch, machine, budget):
    """Twice the layers, at most 2.5 times the units walked: a large model's counts of GPU residents are sampled
    (planner/residents.py), each priced in one pass over the units. Weighing every count, as for a real model, is
    quadratic: on the GPU it walked 4 times the units (5 million at 1,000 layers; `offload plan` took minutes)."""
    work = _count_work(monkeypatch)
    hw = load_hardware(machine)
    walked = []
    for n_layers in (500, 1000):
        spec = _wide_llama(tmp_path / str(n_layers), n_layers)
        work["units"] = 0
        p = plan(spec, hw, Budget.for_hardware(hw, **budget), Workload(compute_format="bf16"), prefetch_depth=None)
        assert p.tier("gpu").total_bytes <= p.budget.gpu_bytes and p.tier("cpu").total_bytes <= p.budget.cpu_bytes
        walked.append(work["units"])
    assert 0 < walked[1] <= 2.5 * walked[0]
