"""HardwareProfile: size parsing, YAML presets and errors, the calibrate cache, and no torch in pure modules."""

import re
import subprocess
import sys

import pytest

from offload.errors import ConfigError
from offload.hardware import (PRESET_DIR, cache_path, default_hardware, load_hardware, parse_rate, parse_size,
                              preset_names, profile_from_dict, save_hardware)

PRESETS = ("rtx3090-ddr4", "rtx4090-ddr5", "t4-server", "h200-server", "cpu-desktop")


@pytest.mark.parametrize("text, expected", [
    ("22GiB", 22 * 2**30), ("64GB", 64 * 10**9), ("512MiB", 512 * 2**20), ("1.5TB", 15 * 10**11),
    ("0", 0), (1024, 1024), ("3 gib", 3 * 2**30),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["22 GiBs", "-1GB", "lots", True, -5, ""])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError, match="expected a size"):
        parse_size(bad, "gpu-memory")


@pytest.mark.parametrize("text, expected", [("25GB/s", 25e9), ("165TFLOPS", 165e12), ("1.2e12", 1.2e12),
                                            (40e9, 40e9), ("4.8TB/s", 4.8e12)])
def test_parse_rate(text, expected):
    assert parse_rate(text) == pytest.approx(expected)


def test_presets_exist_and_load():
    assert set(PRESETS) <= set(preset_names())
    for name in PRESETS:
        hw = load_hardware(name)
        assert hw.ram_bytes > 0 and hw.cpu_mem_bps > 0 and hw.n_cores > 0
        assert all(hw.cpu_flops_for(f) > 0 for f in ("fp32", "bf16", "fp16", "q8_0", "q4_0"))
    assert not load_hardware("cpu-desktop").has_gpu
    assert load_hardware("h200-server").h2d_pinned_bps > load_hardware("t4-server").h2d_pinned_bps


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_figure_says_where_it_comes_from(name):
    for line in (PRESET_DIR / f"{name}.yaml").read_text().splitlines():
        if re.match(r"\s+\w+:\s*[0-9]", line):  # a numeric figure
            assert "#" in line, f"{name}: figure without a source comment: {line.strip()}"


def test_yaml_errors_name_file_and_key(tmp_path):
    with pytest.raises(ConfigError, match=r"hw.yaml: cpu.memroy is not a known key \(did you mean 'memory'\?\)"):
        profile_from_dict({"cpu": {"memroy": "1GiB"}}, "hw.yaml")
    with pytest.raises(ConfigError, match=r"hw.yaml: required key cpu.memory_bandwidth is missing"):
        profile_from_dict({"cpu": {"memory": "8GiB", "cores": 4, "flops": {"fp32": 1e11}},
                           "disk": {"read_bandwidth": "1GB/s"}}, "hw.yaml")
    with pytest.raises(ConfigError, match=r"unknown section 'gpus' \(did you mean 'gpu'\?\)"):
        profile_from_dict({"gpus": {}}, "hw.yaml")
    with pytest.raises(ConfigError, match=r"hw.yaml: gpu.memory: expected a size"):
        profile_from_dict({"gpu": {"memory": "lots"}}, "hw.yaml")
    with pytest.raises(ConfigError, match="neither a file nor a preset"):
        load_hardware(tmp_path / "missing.yaml")


def test_save_load_round_trip(tmp_path):
    hw = load_hardware("rtx4090-ddr5")
    again = load_hardware(save_hardware(hw, tmp_path / "hw.yaml"))
    assert again == hw


def test_default_hardware_prefers_the_calibrated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path))
    assert cache_path() == tmp_path / "hardware.yaml"
    estimated = default_hardware()
    assert estimated.name == "estimated" and not estimated.has_gpu and estimated.ram_bytes > 0
    save_hardware(load_hardware("t4-server"), cache_path())
    assert default_hardware().name == "t4-server"


@pytest.mark.parametrize("module", ["offload.spec", "offload.hardware", "offload.planner", "offload.planner.search",
                                    "offload.cli.plan"])
def test_pure_modules_import_no_torch(module):
    code = f"import {module}, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
