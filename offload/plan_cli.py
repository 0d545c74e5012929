"""`offload plan`: read a model config, a hardware profile, a budget and a workload; print the Plan."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

import yaml

from offload.errors import ConfigError
from offload.hardware import default_hardware, load_hardware, parse_size
from offload.paths import configs_dir
from offload.planner import Budget, Workload, plan
from offload.spec import FORMATS, ModelSpec, load_spec

MODEL_DIR = configs_dir() / "models"
DEFAULT_MODEL = "smollm2-135m"
_CONFIG_KEYS = ("model", "quantization", "memory", "hardware", "batch_size", "max_tokens", "prompt_len")
_MEMORY_KEYS = ("gpu", "cpu", "disk")


def resolve_model(name: str, base: Path | None = None) -> Path:
    """'default', a name under configs/models, or a path (relative to base when given and present there)."""
    if name == "default":
        return MODEL_DIR / DEFAULT_MODEL
    for candidate in (Path(name), (base / name) if base else None, MODEL_DIR / name):
        if candidate is not None and candidate.exists():
            return candidate
    return Path(name)  # load_spec reports that it does not exist


def load_plan_config(path: str | Path) -> dict:
    """The minimal run config: model, quantization, memory {gpu, cpu, disk}, hardware, batch_size, max_tokens."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path} ({e}); pass a readable YAML file") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, found {type(data).__name__}")
    for key in data:
        if key not in _CONFIG_KEYS:
            close = difflib.get_close_matches(str(key), _CONFIG_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown key {key!r}{hint}; known keys: {', '.join(_CONFIG_KEYS)}")
    memory = data.get("memory") or {}
    if not isinstance(memory, dict) or set(memory) - set(_MEMORY_KEYS):
        raise ConfigError(f"{path}: memory must map some of {', '.join(_MEMORY_KEYS)} to sizes, found {memory!r}")
    out = {k: v for k, v in data.items() if k != "memory"}
    out.update({f"{tier}_memory": memory[tier] for tier in memory})
    if "model" in out:
        out["model"] = str(resolve_model(str(out["model"]), path.parent))
    if "hardware" in out and (path.parent / str(out["hardware"])).is_file():
        out["hardware"] = str(path.parent / str(out["hardware"]))
    return out


def add_plan_arguments(p) -> None:
    p.add_argument("config", nargs="?", help="YAML run config (flags override it)")
    p.add_argument("--model", help="model folder or config.json, a name in configs/models, or 'default'")
    p.add_argument("--hardware", help="hardware YAML or preset name (default: the calibrated profile)")
    p.add_argument("--gpu-memory", help="GPU budget, e.g. 22GiB (default 90%% of VRAM)")
    p.add_argument("--cpu-memory", help="CPU RAM budget, e.g. 48GiB (default 80%% of RAM)")
    p.add_argument("--disk-memory", help="disk budget for spilled weights, e.g. 200GiB (default 0)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--prompt-len", type=int, help="prompt tokens per sequence (default 512)")
    p.add_argument("--max-tokens", type=int, help="generated tokens per sequence (default 128)")
    p.add_argument("--quantization", help="none, q8_0 or q4_0 (default none: the checkpoint's dtype)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--explain", action="store_true", help="also print why the plan is what it is")


def _settings(args) -> dict:
    settings = load_plan_config(args.config) if args.config else {}
    for key in ("model", "hardware", "gpu_memory", "cpu_memory", "disk_memory", "batch_size", "prompt_len",
                "max_tokens", "quantization"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    return settings


def _weight_format(spec: ModelSpec, quantization) -> str:
    q = str(quantization or "none")
    if q == "none":
        return spec.dtype
    if q not in FORMATS:
        raise ConfigError(f"quantization {q!r} is not supported; use none, q8_0 or q4_0")
    return q


def build_plan(settings: dict):
    """The Plan for merged settings (config file, then flags)."""
    spec = load_spec(resolve_model(str(settings.get("model", "default"))))
    hw = load_hardware(settings["hardware"]) if settings.get("hardware") else default_hardware()
    size = {k: parse_size(settings[k], k.replace("_", "-")) for k in ("gpu_memory", "cpu_memory", "disk_memory")
            if settings.get(k) is not None}
    budget = Budget.for_hardware(hw, size.get("gpu_memory"), size.get("cpu_memory"), size.get("disk_memory", 0))
    workload = Workload(batch_size=_int(settings, "batch_size", 1), prompt_len=_int(settings, "prompt_len", 512),
                        gen_len=_int(settings, "max_tokens", 128))
    return plan(spec, hw, budget, workload, _weight_format(spec, settings.get("quantization")))


def _int(settings: dict, key: str, default: int) -> int:
    value = settings.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be a whole number, found {value!r}")
    return value


def run_plan(args) -> int:
    settings = _settings(args)
    if not settings.get("hardware"):
        print("offload: planning for the calibrated profile (or an estimate; run `offload calibrate`)",
              file=sys.stderr)
    result = build_plan(settings)
    if args.json:
        print(result.to_json())
        return 0
    print(result.table())
    if args.explain:
        print()
        print(result.explain())
    return 0
