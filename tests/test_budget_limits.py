"""Issue 32 item 2: a budget is checked against the hardware profile it is planned for (its RAM and VRAM), and, where
that profile is this machine's and the command allocates (`offload run`, LLM(...)), against what this process may
really use: MemTotal, a memory cgroup's limit, the GPU's memory. Planning for a preset one does not have stays
allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_hf_model, save_hf_model
from jobs_support import chat_line, run_cli, write_batch, write_job
from offload.errors import ConfigError
from offload.hardware import cache_path, estimate_hardware, format_bytes, load_hardware, save_hardware
from offload.runtime import host_memory
from offload.runtime.backends.cpu import CPUBackend

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """A cache of this test's own: 'this machine's calibrated profile' is what the test saves there."""
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny") / "model")


class SmallGPU(CPUBackend):
    """The CPU backend with a GPU of 1 GiB: what CUDABackend.device_memory_bytes reports on a small card."""

    def device_memory_bytes(self) -> int:
        return GIB


def test_a_cpu_budget_above_the_profiles_ram_is_one_sentence():
    ram = load_hardware("cpu-desktop").ram_bytes
    code, message = run_cli("plan", "--hardware", "cpu-desktop", "--cpu-memory", "10TiB")
    line = message.strip()
    assert code == 2 and "\n" not in line and "Traceback" not in line
    assert "10.00 TiB" in line and "--cpu-memory" in line and "'cpu-desktop'" in line  # the budget, the profile
    assert f"{format_bytes(ram)} of RAM" in line and f"set it to at most {format_bytes(ram)}" in line


def test_a_gpu_budget_above_the_profiles_vram_is_one_sentence():
    vram = load_hardware("rtx4090-ddr5").vram_bytes
    code, message = run_cli("plan", "--model", "llama-3.1-8b", "--hardware", "rtx4090-ddr5", "--gpu-memory",
                            "30GiB")
    line = message.strip()
    assert code == 2 and "\n" not in line
    assert "30.00 GiB" in line and "--gpu-memory" in line and f"{format_bytes(vram)} of VRAM" in line
    assert f"set it to at most {format_bytes(vram)}" in line


def test_planning_for_a_preset_bigger_than_this_machine_stays_allowed(monkeypatch):
    """64 GiB of RAM on a profile that has it: allowed whatever this machine has (here it has 8 GiB)."""
    monkeypatch.setattr(host_memory, "memory_limit_bytes", lambda: 8 * GIB)
    code, message = run_cli("plan", "--model", "llama-3.1-70b", "--hardware", "rtx4090-ddr5", "--cpu-memory",
                            "64GiB", "--gpu-memory", "22GiB", "--quantization", "q4_0")
    assert code == 0, message
    assert "error" not in message


def test_llm_on_this_machines_profile_is_held_to_its_memtotal(tiny_model):
    """A calibrated profile that claims more RAM than this machine has (copied from another one): LLM(...)
    allocates, so its budget must fit MemTotal and the cgroup's limit as well as the profile."""
    from offload import LLM

    machine = host_memory.memory_limit_bytes()
    save_hardware(estimate_hardware().with_changes(ram_bytes=4 * machine), cache_path())
    with pytest.raises(ConfigError) as refused:
        LLM(str(tiny_model), cpu_memory=2 * machine)
    message = str(refused.value)
    assert "\n" not in message and format_bytes(2 * machine) in message and "--cpu-memory" in message
    assert f"set it to at most {format_bytes(machine)}" in message and "container's memory limit" in message


def test_llm_on_this_machines_profile_is_held_to_a_cgroup_limit(tiny_model, monkeypatch):
    from offload import LLM

    monkeypatch.setattr(host_memory, "memory_limit_bytes", lambda: 1 * GIB)  # a container of 1 GiB
    with pytest.raises(ConfigError, match="more than the 1.00 GiB this process may use on this machine"):
        LLM(str(tiny_model), cpu_memory="2GiB")
    LLM(str(tiny_model), cpu_memory="900MiB")  # within the container: loads


def test_llm_on_this_machines_profile_is_held_to_its_gpus_memory(tiny_model, monkeypatch):
    """This machine's calibrated profile says 24 GiB of VRAM; the device it runs on has 1 GiB."""
    import offload.api

    save_hardware(load_hardware("rtx4090-ddr5"), cache_path())
    monkeypatch.setattr(offload.api, "make_backend", lambda name, hardware=None: SmallGPU())
    with pytest.raises(ConfigError) as refused:
        offload.api.LLM(str(tiny_model), gpu_memory="2GiB", cpu_memory="4GiB")
    message = str(refused.value)
    assert "GPU budget of 2.00 GiB" in message and "--gpu-memory" in message and "this GPU's 1.00 GiB" in message


def test_the_machine_check_passes_what_fits():
    from offload.planner.types import Budget

    fits = Budget(gpu_bytes=GIB // 2, cpu_bytes=GIB // 2, host_baseline_bytes=GIB // 4)
    host_memory.check_budget_fits_machine(fits, SmallGPU())
    host_memory.check_budget_fits_machine(Budget(gpu_bytes=0, cpu_bytes=GIB), CPUBackend())
    with pytest.raises(ConfigError, match="this GPU's 1.00 GiB"):
        host_memory.check_budget_fits_machine(Budget(gpu_bytes=GIB + 1, cpu_bytes=GIB), SmallGPU())


def test_a_job_with_a_budget_above_this_machine_writes_nothing(tmp_path, tiny_model):
    """The issue's case: memory.cpu 10TiB on this machine was planned (a 512 GiB margin) and run."""
    write_batch(tmp_path / "in.jsonl", [chat_line("a", "hi")])
    config = write_job(tmp_path / "job.yaml", model={"path": str(tiny_model)},
                       input={"path": "in.jsonl"}, output={"path": "o.jsonl"}, memory={"cpu": "10TiB"})
    code, message = run_cli("run", config)
    assert code == 2 and "10.00 TiB" in message and "memory.cpu" in message and "Traceback" not in message
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.cuda
def test_a_gpu_budget_above_this_cuda_devices_memory_is_refused():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from offload.planner.types import Budget
    from offload.runtime.backends.cuda import CUDABackend

    backend = CUDABackend()
    total = backend.device_memory_bytes()
    with pytest.raises(ConfigError, match=f"this GPU's {format_bytes(total)}"):
        host_memory.check_budget_fits_machine(Budget(gpu_bytes=total + GIB, cpu_bytes=GIB), backend)
    host_memory.check_budget_fits_machine(Budget(gpu_bytes=total // 2, cpu_bytes=GIB), backend)
