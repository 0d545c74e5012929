"""HardwareProfile: a machine as numbers (memory sizes, bandwidths, matmul rates), declared in YAML or calibrated."""

from __future__ import annotations

import difflib
import math
import os
import shutil
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from offload.errors import ConfigError
from offload.paths import cache_dir, configs_dir
from offload.units import format_bytes, parse_rate, parse_size  # noqa: F401 (offload.hardware's names too)
from offload.formats import FLOAT_FORMATS, GGUF_TYPES, WEIGHT_FORMATS
from offload.rate_curves import GPU_KERNELS, crossover_rows, gpu_kernel, scale_curve
from offload.system import system_cores, system_memory_bytes

PRESET_DIR = configs_dir() / "hardware"

# A profile without figures for a GGUF type prices it by its kin (formats.GGUF_TYPES: the format its kernels
# resemble); types without a fused CPU kernel are dequantized and multiplied in fp32, so priced by fp32's rates.
KIN_FORMATS = {t.name: t.kin for t in GGUF_TYPES if t.kin}


def _measured(fmt: str, table: dict) -> str:
    """fmt if table has a figure for it, else its first kin format that has one (else its last kin)."""
    if table.get(fmt) or fmt not in KIN_FORMATS:
        return fmt
    return next((kin for kin in KIN_FORMATS[fmt] if table.get(kin)), KIN_FORMATS[fmt][-1])


@dataclass(frozen=True)
class HardwareProfile:
    """What the planner needs to know about a machine; bandwidths in bytes/s, rates in FLOP/s."""

    name: str
    vram_bytes: int  # GPU memory; 0 on a CPU-only machine
    ram_bytes: int
    disk_bytes: int
    n_cores: int
    h2d_pinned_bps: float  # host-to-device copy from page-locked memory
    h2d_pageable_bps: float
    gpu_flops: float  # dense bf16 matmul rate reached on large shapes
    gpu_mem_bps: float
    cpu_mem_bps: float  # read bandwidth reached by all cores together
    # CPU matmul rate per weight format at a batch of 16+ tokens (compute-bound regime).
    cpu_flops: dict[str, float] = field(hash=False)
    disk_read_bps: float  # a cold sequential read from the device
    gpu_name: str = ""
    cpu_name: str = ""
    gpu_reserved_bytes: int = 0  # device memory the process holds outside offload's buffers: CUDA context, cuBLAS
    # Measured by `offload calibrate` (empty in presets: the flat cpu_flops figures and no overhead terms):
    # offload's CPU matmul rate per weight format by rows of activations, weights read from DRAM, as
    # ((rows, FLOP/s), ...): decode-sized products are bound by memory, prefill-sized ones by compute
    cpu_flops_by_rows: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict, hash=False)
    # ... and on one thread (what a step gets when the thread governor has halved the count on a busy machine)
    cpu_flops_one_thread: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict, hash=False)
    # ... times a factor by the weights' inner dimension K, ((K, factor), ...) per format (1 at the K the curves
    # are measured at): a kernel's blocking fits some K better than others
    cpu_k_factor: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict, hash=False)
    # ... and by its outputs N, ((N, factor), ...) per format (1 for the calibration model's own linears)
    cpu_n_factor: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict, hash=False)
    # CPU attention: FLOP/s of the fused C++ layer's and of torch's, and the rate KV caches are read at (bytes/s)
    cpu_attention: dict[str, float] = field(default_factory=dict, hash=False)
    overhead_s: dict[str, float] = field(default_factory=dict, hash=False)  # OVERHEAD_TERMS: seconds each
    # runtime.speedprobe's rates (memory-bound, compute-bound matmul FLOP/s, attention FLOP/s: 0 where not
    # measured) per weight format, taken by `offload calibrate` as it starts: a job probes again and its report
    # scales the CPU figures by the ratio (at_speed)
    cpu_probe: dict[str, tuple[float, float, float]] = field(default_factory=dict, hash=False)
    page_cache_bps: float = 0.0  # a read served by the OS page cache (0: not measured)
    # DRAM read by the CPU kernels and by a pinned host-to-device copy together (0: not stated: the CPU's own
    # cpu_mem_bps); above cpu_mem_bps where the DMA engine adds bandwidth the cores alone do not reach
    host_read_bps: float = 0.0
    # Measured by `offload calibrate` on a CUDA GPU (empty or 0 in presets: GPU blocks are then rooflines): the
    # matmul rate of a layer-sized weight by rows of activations, per weight format and GPU_KERNELS kernel,
    # {fmt: {kernel: ((rows, FLOP/s), ...)}}; one kernel launch (seconds, host side); a small tensor's round trip
    # device -> host -> device, idle and while a large copy runs on another stream (seconds)
    gpu_flops_by_rows: dict[str, dict[str, tuple[tuple[int, float], ...]]] = field(default_factory=dict, hash=False)
    gpu_launch_s: float = 0.0
    handover_s: float = 0.0
    handover_busy_s: float = 0.0
    # host seconds of one decode step of a GPU layer and of a GPU experts unit (runtime/host_cost.py; 0: priced by
    # launches)
    gpu_layer_host_s: float = 0.0
    gpu_experts_host_s: float = 0.0
    source: str = field(default="", compare=False)

    @property
    def page_cache_rate(self) -> float:
        """Bytes/s of a read the page cache serves: measured, else a quarter of the memory bandwidth (one copy
        by one thread)."""
        return self.page_cache_bps or self.cpu_mem_bps / 4

    @property
    def host_read_rate(self) -> float:
        """Bytes/s host RAM serves to the CPU kernels and the copies to the GPU together."""
        return max(self.host_read_bps, self.cpu_mem_bps)

    @property
    def has_gpu(self) -> bool:
        return self.vram_bytes > 0 and self.gpu_flops > 0 and self.h2d_pinned_bps > 0

    def rated_format(self, fmt: str) -> str:
        """The format whose calibrated CPU figures price fmt: fmt itself, or its kin where it has none."""
        return _measured(fmt, self.cpu_flops_by_rows)

    def cpu_flops_for(self, fmt: str) -> float:
        """CPU matmul FLOP/s for weights in fmt (falls back to a kin format's figure, then to fp32's)."""
        rate = self.cpu_flops.get(_measured(fmt, self.cpu_flops)) or self.cpu_flops.get("fp32")
        if not rate:
            raise ConfigError(f"hardware profile {self.name!r} has no CPU matmul rate for {fmt!r} or fp32; "
                              "add cpu.flops to its YAML or run `offload calibrate`")
        return rate

    def cpu_matmul_rate(self, fmt: str, rows: int, threads: int = 0) -> float:
        """CPU matmul FLOP/s for weights in fmt at `rows` activation rows on `threads` threads (0: all cores):
        the calibrated curve, interpolated in log(rows) and held flat past its ends, and between the one-thread
        and all-core curves by thread count; else the flat cpu_flops figure."""
        rated = _measured(fmt, self.cpu_flops_by_rows)
        full = self._curve_rate(self.cpu_flops_by_rows.get(rated), rows)
        if full is None:
            return self.cpu_flops_for(fmt)
        one = self._curve_rate(self.cpu_flops_one_thread.get(rated), rows)
        if one is None or threads <= 0 or threads >= self.n_cores:
            return full
        return one + (full - one) * (threads - 1) / max(self.n_cores - 1, 1)

    def shape_efficiency(self, fmt: str, shapes) -> float:
        """The calibrated K and N factors of a unit's linears of shapes [(N, K), ...] in fmt, weighted by their
        work (1 where not calibrated)."""
        return shape_efficiency(self.cpu_k_factor.get(_measured(fmt, self.cpu_k_factor)),
                                self.cpu_n_factor.get(_measured(fmt, self.cpu_n_factor)), shapes)

    @staticmethod
    def _curve_rate(curve, rows: int, log_scale: bool = True) -> float | None:
        if not curve:
            return None
        rows = max(rows, 1)
        if rows <= curve[0][0]:
            return curve[0][1]
        for (r0, f0), (r1, f1) in zip(curve, curve[1:]):
            if rows <= r1:
                t = math.log(rows / r0) / math.log(r1 / r0) if log_scale else (rows - r0) / (r1 - r0)
                return f0 + t * (f1 - f0)
        return curve[-1][1]

    def gpu_crossover(self) -> dict[str, int]:
        """{fmt: the fewest measured rows at which dequantize + cuBLAS beat the fused kernel}, for the formats
        where it did (linear()'s table: gpu_kernel)."""
        table = {fmt: crossover_rows(curves) for fmt, curves in self.gpu_flops_by_rows.items()}
        return {fmt: rows for fmt, rows in table.items() if rows is not None}

    def gpu_matmul_rate(self, fmt: str, rows: int) -> float | None:
        """GPU matmul FLOP/s for weights in fmt at `rows` activation rows with the kernel linear() picks (the
        measured curve, interpolated in log(rows) and held flat past its ends); None where not measured."""
        curves = self.gpu_flops_by_rows.get(fmt) or self._float_kin_curves(fmt)
        if not curves:
            return None
        kernel = "cublas" if "cublas" in curves else gpu_kernel(self.gpu_crossover(), fmt, rows)
        return self._curve_rate(curves.get(kernel) or next(iter(curves.values())), rows)

    def _float_kin_curves(self, fmt: str) -> dict:
        """A float format's measured curves where its own are not: those of a float format as wide (cuBLAS reads
        the same bytes and runs the same tensor-core rate for bf16 and fp16)."""
        width = FLOAT_FORMATS.get(fmt)
        return next((c for f, c in self.gpu_flops_by_rows.items() if width and FLOAT_FORMATS.get(f) == width), {})

    def attention_rate(self, path: str) -> float:
        """FLOP/s of CPU attention on a path (fused: offload's C++ layer; torch: scaled_dot_product_attention)."""
        return self.cpu_attention.get(path) or self.cpu_flops_for("fp32")

    @property
    def kv_read_bps(self) -> float:
        """Bytes/s CPU attention reads cached K and V at (the memory bandwidth where not calibrated)."""
        return self.cpu_attention.get("kv_read") or self.cpu_mem_bps

    def overhead(self, term: str) -> float:
        """Seconds of one overhead term (see OVERHEAD_TERMS); 0 where not calibrated."""
        return self.overhead_s.get(term, 0.0)

    def at_speed(self, memory: float, compute: float, attention: float | None = None) -> HardwareProfile:
        """A copy for the CPU running at `memory` x, `compute` x and `attention` x (None: compute x) the speed it was
        calibrated at (speedprobe's ratios): matmul curves by speed_factor of their rows, memory and KV-read
        bandwidth by memory, attention by attention, flat matmul rates by compute, overhead seconds by 1 / compute;
        GPU, PCIe and disk figures unchanged."""
        def curves(table):
            return {fmt: scale_curve(curve, memory, compute) for fmt, curve in table.items()}

        attention = compute if attention is None else attention
        return replace(self, cpu_mem_bps=self.cpu_mem_bps * memory, host_read_bps=self.host_read_bps * memory,
                       cpu_flops={fmt: rate * compute for fmt, rate in self.cpu_flops.items()},
                       cpu_flops_by_rows=curves(self.cpu_flops_by_rows),
                       cpu_flops_one_thread=curves(self.cpu_flops_one_thread),
                       cpu_attention={k: rate * (memory if k == "kv_read" else attention)
                                      for k, rate in self.cpu_attention.items()},
                       overhead_s={k: s / compute for k, s in self.overhead_s.items()})

    def with_changes(self, **changes) -> HardwareProfile:
        """A copy with some figures replaced (for what-if planning)."""
        return replace(self, **changes)


def shape_efficiency(k_factor, n_factor, shapes) -> float:
    """The factor of linears of shapes [(N, K), ...] on a matmul curve, from a K factor and an N factor
    (((K, factor), ...), ((N, factor), ...); either may be empty), each interpolated linearly and held flat past
    its ends, weighted by the linears' work."""
    if not shapes or not (k_factor or n_factor):
        return 1.0
    rate = HardwareProfile._curve_rate
    work = [(n * k, (rate(k_factor, k, log_scale=False) or 1.0) * (rate(n_factor, n, log_scale=False) or 1.0))
            for n, k in shapes]
    return sum(w for w, _ in work) / sum(w / f for w, f in work)


# Time a step takes besides its matmuls and attention, fitted by `offload calibrate`: per step (embedding,
# Python), per CPU layer through the fused C++ layer, per CPU layer through torch ops, per sequence in the step
# (bookkeeping), per logit sampled (rows x vocabulary: softmax or argmax, the copy to Python), and per token and
# CPU layer (the norms, rope, silu and residual adds around the matmuls: a prefill of thousands of tokens spends
# about a tenth of its time there).
OVERHEAD_TERMS = ("step", "layer", "layer_unfused", "sequence", "logit", "token")
ATTENTION_KEYS = ("fused", "torch", "kv_read")  # FLOP/s on each path; bytes/s of KV reads

# YAML layout: (section, key) -> (field, parser). Sections keep the file readable.
_YAML_KEYS = {
    ("gpu", "name"): ("gpu_name", str),
    ("gpu", "memory"): ("vram_bytes", parse_size),
    ("gpu", "flops"): ("gpu_flops", parse_rate),
    ("gpu", "memory_bandwidth"): ("gpu_mem_bps", parse_rate),
    ("gpu", "reserved"): ("gpu_reserved_bytes", parse_size),
    ("gpu", "flops_by_rows"): ("gpu_flops_by_rows", "gpu_curves"),
    ("gpu", "launch"): ("gpu_launch_s", "seconds"),
    ("gpu", "handover"): ("handover_s", "seconds"),
    ("gpu", "handover_under_copy"): ("handover_busy_s", "seconds"),
    ("gpu", "layer_host"): ("gpu_layer_host_s", "seconds"),
    ("gpu", "experts_host"): ("gpu_experts_host_s", "seconds"),
    ("pcie", "pinned"): ("h2d_pinned_bps", parse_rate),
    ("pcie", "pageable"): ("h2d_pageable_bps", parse_rate),
    ("cpu", "name"): ("cpu_name", str),
    ("cpu", "cores"): ("n_cores", int),
    ("cpu", "memory"): ("ram_bytes", parse_size),
    ("cpu", "memory_bandwidth"): ("cpu_mem_bps", parse_rate),
    ("cpu", "combined_read_bandwidth"): ("host_read_bps", parse_rate),
    ("cpu", "flops"): ("cpu_flops", None),
    ("cpu", "flops_by_rows"): ("cpu_flops_by_rows", "curve"),
    ("cpu", "flops_by_rows_one_thread"): ("cpu_flops_one_thread", "curve"),
    ("cpu", "k_factor"): ("cpu_k_factor", "curve"),
    ("cpu", "n_factor"): ("cpu_n_factor", "curve"),
    ("cpu", "attention"): ("cpu_attention", "attention"),
    ("cpu", "probe"): ("cpu_probe", "probe"),
    ("disk", "size"): ("disk_bytes", parse_size),
    ("disk", "read_bandwidth"): ("disk_read_bps", parse_rate),
    ("disk", "page_cache_bandwidth"): ("page_cache_bps", parse_rate),
}
_OPTIONAL = {"gpu_name": "", "cpu_name": "", "vram_bytes": 0, "gpu_flops": 0.0, "gpu_mem_bps": 0.0, "gpu_reserved_bytes": 0,
             "h2d_pinned_bps": 0.0, "h2d_pageable_bps": 0.0, "disk_bytes": 0, "disk_read_bps": 0.0,
             "cpu_flops_by_rows": {}, "cpu_flops_one_thread": {}, "cpu_k_factor": {}, "cpu_n_factor": {},
             "cpu_attention": {},
             "overhead_s": {}, "page_cache_bps": 0.0, "cpu_probe": {}, "host_read_bps": 0.0,
             "gpu_flops_by_rows": {}, "gpu_launch_s": 0.0, "handover_s": 0.0, "handover_busy_s": 0.0,
             "gpu_layer_host_s": 0.0, "gpu_experts_host_s": 0.0}
_ZERO_UNMEASURED = ("page_cache_bps", "host_read_bps", "gpu_launch_s", "handover_s", "handover_busy_s",
                    "gpu_layer_host_s", "gpu_experts_host_s")  # 0: left out of the YAML
PROBE_KEYS = ("memory", "compute", "attention")  # cpu.probe's rates per format, in that order in cpu_probe


def _did_you_mean(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _parse_cpu_flops(value, where: str) -> dict[str, float]:
    return _parse_named_rates(value, where, WEIGHT_FORMATS, "FLOP/s", parse_rate, "weight format")


def _parse_curves(value, where: str) -> dict[str, tuple[tuple[int, float], ...]]:
    return _parse_named_rates(value, where, WEIGHT_FORMATS, "{rows: FLOP/s}", _parse_curve, "weight format")


def _parse_curve(points, where: str) -> tuple[tuple[int, float], ...]:
    if not isinstance(points, dict) or not points:
        raise ConfigError(f"{where}: expected a mapping of rows to FLOP/s, found {points!r}")
    curve = []
    for rows, rate in points.items():
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ConfigError(f"{where}: rows must be whole numbers of 1 or more, found {rows!r}")
        curve.append((rows, parse_rate(rate, f"{where}.{rows}")))
    return tuple(sorted(curve))


def _parse_gpu_curves(value, where: str) -> dict[str, dict[str, tuple[tuple[int, float], ...]]]:
    def kernels(body, at: str) -> dict:
        return _parse_named_rates(body, at, GPU_KERNELS, "{rows: FLOP/s}", _parse_curve, "GPU kernel")

    return _parse_named_rates(value, where, WEIGHT_FORMATS, "{kernel: {rows: FLOP/s}}", kernels, "weight format")


def _parse_probes(value, where: str) -> dict[str, tuple[float, float, float]]:
    return _parse_named_rates(value, where, WEIGHT_FORMATS, "{memory: FLOP/s, compute: FLOP/s, attention: FLOP/s}",
                              _parse_probe,
                              "weight format")


def _parse_probe(value, where: str) -> tuple[float, float, float]:
    rates = _parse_named_rates(value, where, PROBE_KEYS, "FLOP/s", parse_rate)
    missing = [k for k in PROBE_KEYS[:2] if k not in rates]
    if missing:
        raise ConfigError(f"{where}: expected both memory and compute rates, found no {' or '.join(missing)}; "
                          "add it or run `offload calibrate` again")
    return rates["memory"], rates["compute"], rates.get("attention", 0.0)  # a calibration before it: none


def _parse_named_rates(value, where: str, names: tuple[str, ...], what: str, parse, kind: str = "key") -> dict:
    """A mapping of names (each one of `names`) to values read by parse(value, where)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping of {kind} to {what}, found {value!r}")
    out = {}
    for name, rate in value.items():
        if name not in names:
            raise ConfigError(f"{where}: unknown {kind} {name!r}{_did_you_mean(str(name), names)}; "
                              f"use {', '.join(names)}")
        out[name] = parse(rate, f"{where}.{name}")
    return out


def _parse_seconds(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 10 or value != value:
        raise ConfigError(f"{where}: expected seconds as a number from 0 to 10, found {value!r}")
    return float(value)


def profile_from_dict(data: dict, source: str = "hardware.yaml") -> HardwareProfile:
    """Build a HardwareProfile from the sectioned YAML layout; errors name the file and key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with gpu/pcie/cpu/disk sections, found {type(data).__name__}")
    values: dict = {"name": str(data.get("name") or Path(source).stem)}
    sections = {s for s, _ in _YAML_KEYS} | {"overhead"}
    for section, body in data.items():
        if section == "name":
            continue
        if section == "overhead":
            values["overhead_s"] = _parse_named_rates(body, f"{source}: overhead", OVERHEAD_TERMS, "seconds",
                                                      _parse_seconds)
            continue
        if section not in sections:
            raise ConfigError(f"{source}: unknown section {section!r}{_did_you_mean(section, sections)}; "
                              f"expected name, {', '.join(sorted(sections))}")
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: section {section!r} must be a mapping, found {body!r}")
        for key, value in body.items():
            where = f"{source}: {section}.{key}"
            if (section, key) not in _YAML_KEYS:
                keys = [k for s, k in _YAML_KEYS if s == section]
                raise ConfigError(f"{where} is not a known key{_did_you_mean(key, keys)}; "
                                  f"{section} takes {', '.join(keys)}")
            name, parse = _YAML_KEYS[(section, key)]
            if parse is None:
                values[name] = _parse_cpu_flops(value, where)
            elif parse == "curve":
                values[name] = _parse_curves(value, where)
            elif parse == "probe":
                values[name] = _parse_probes(value, where)
            elif parse == "gpu_curves":
                values[name] = _parse_gpu_curves(value, where)
            elif parse == "seconds":
                values[name] = _parse_seconds(value, where)
            elif parse == "attention":
                values[name] = _parse_named_rates(value, where, ATTENTION_KEYS, "FLOP/s or bytes/s", parse_rate)
            else:
                values[name] = _parse_value(parse, value, where)
    for f in fields(HardwareProfile):
        if f.name not in values and f.name != "source":
            if f.name not in _OPTIONAL:
                section, key = next(k for k, v in _YAML_KEYS.items() if v[0] == f.name)
                raise ConfigError(f"{source}: required key {section}.{key} is missing; add it "
                                  "(see configs/hardware/*.yaml for examples)")
            values[f.name] = _OPTIONAL[f.name]
    return HardwareProfile(**values, source=source)


def _parse_value(parse, value, where: str):
    if parse is str:
        return str(value)
    if parse is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: expected a whole number of 1 or more, found {value!r}")
        return value
    return parse(value, where)


def profile_to_dict(profile: HardwareProfile) -> dict:
    """The sectioned YAML layout of a profile (plain numbers: bytes, bytes/s, FLOP/s)."""
    out: dict = {"name": profile.name}
    for (section, key), (name, _) in _YAML_KEYS.items():
        value = getattr(profile, name)
        if name in ("cpu_flops_by_rows", "cpu_flops_one_thread", "cpu_k_factor", "cpu_n_factor"):
            value = {fmt: dict(curve) for fmt, curve in value.items()}
        if name == "gpu_flops_by_rows":
            value = {fmt: {kernel: dict(curve) for kernel, curve in kernels.items()} for fmt, kernels in value.items()}
        if name == "cpu_probe":
            value = {fmt: {k: r for k, r in zip(PROBE_KEYS, rates) if r or k != "attention"}
                     for fmt, rates in value.items()}
        if (isinstance(value, dict) and not value and name != "cpu_flops") or (name in _ZERO_UNMEASURED and not value):
            continue  # not calibrated
        out.setdefault(section, {})[key] = dict(value) if isinstance(value, dict) else value
    if profile.overhead_s:
        out["overhead"] = dict(profile.overhead_s)
    return out


def gpu_calibration_summary(profile: HardwareProfile) -> dict:
    """The GPU figures calibration measured, for a check's summary: launch and hand-over microseconds, each
    format's crossover rows (null: the fused kernel at every measured row count) and TFLOP/s by kernel and rows."""
    crossover = profile.gpu_crossover()
    return {"launch_us": profile.gpu_launch_s * 1e6, "handover_us": profile.handover_s * 1e6,
            "handover_under_copy_us": profile.handover_busy_s * 1e6,
            "crossover_rows": {fmt: crossover.get(fmt) for fmt, curves in profile.gpu_flops_by_rows.items()
                               if "fused" in curves},
            "tflops_by_rows": {fmt: {kernel: {rows: round(rate / 1e12, 3) for rows, rate in curve}
                                     for kernel, curve in curves.items()}
                               for fmt, curves in profile.gpu_flops_by_rows.items()}}


def load_hardware(path_or_name: str | Path) -> HardwareProfile:
    """Read a profile from a YAML file, or a preset by name (see configs/hardware/)."""
    path = Path(path_or_name)
    if not path.is_file():
        preset = PRESET_DIR / f"{path_or_name}.yaml"
        if not preset.is_file():
            raise ConfigError(f"hardware profile {str(path_or_name)!r} is neither a file nor a preset; "
                              f"presets: {', '.join(preset_names())}; or run `offload calibrate`")
        path = preset
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"hardware profile {path} is not UTF-8 text (byte {e.start} is "
                          f"{e.object[e.start:e.start + 1]!r}), so not a profile YAML; give a profile that "
                          f"`offload calibrate` wrote, or a preset name") from None
    except (yaml.YAMLError, RecursionError) as e:  # PyYAML's parser recurses once per level of nesting
        why = "it nests too deep to parse" if isinstance(e, RecursionError) else " ".join(str(e).split())
        raise ConfigError(f"{path} is not valid YAML ({why}); fix the file") from None
    return profile_from_dict(data, source=str(path))


def save_hardware(profile: HardwareProfile, path: str | Path) -> Path:
    """Write a profile as YAML (creating the folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = f"# offload hardware profile ({profile.source or 'declared'})\n"
    path.write_text(header + yaml.safe_dump(profile_to_dict(profile), sort_keys=False))
    return path


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def cache_path() -> Path:
    """Where `offload calibrate` stores its result: hardware.yaml in offload's cache folder."""
    return cache_dir() / "hardware.yaml"


def estimate_hardware() -> HardwareProfile:
    """This machine's RAM, cores and disk with rough CPU figures (no GPU assumed); calibrate replaces it."""
    n_cores = system_cores()
    # Rough per-core figures of a recent AVX2 desktop core; `offload calibrate` measures the real ones.
    per_core = {"fp32": 50e9, "bf16": 25e9, "fp16": 20e9, "q8_0": 40e9, "q4_0": 35e9}
    disk_free = shutil.disk_usage(Path.home()).free
    return HardwareProfile(
        name="estimated", vram_bytes=0, ram_bytes=system_memory_bytes(), disk_bytes=disk_free,
        n_cores=n_cores, h2d_pinned_bps=0.0, h2d_pageable_bps=0.0, gpu_flops=0.0, gpu_mem_bps=0.0,
        cpu_mem_bps=min(10e9 * n_cores, 40e9), cpu_flops={k: v * n_cores for k, v in per_core.items()},
        disk_read_bps=1e9, source="estimated from the OS; run `offload calibrate` to measure")


PAGEABLE_ENV = "OFFLOAD_PAGEABLE"  # 1: host memory is not page-locked (cudaHostRegister refused), copies pageable


def pageable_copies() -> bool:
    """Whether OFFLOAD_PAGEABLE=1 asks for host-to-device copies from pageable memory (nothing pinned)."""
    return os.environ.get(PAGEABLE_ENV) == "1"


def as_pageable(profile: HardwareProfile) -> HardwareProfile:
    """profile with its host-to-device copies at the pageable rate, as they run where nothing is pinned."""
    if not profile.h2d_pageable_bps:
        return profile
    return profile.with_changes(h2d_pinned_bps=profile.h2d_pageable_bps)


def default_hardware() -> HardwareProfile:
    """The calibrated profile cached by `offload calibrate`, else a rough estimate of this machine."""
    path = cache_path()
    return load_hardware(path) if path.is_file() else estimate_hardware()
