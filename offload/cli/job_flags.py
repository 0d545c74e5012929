"""The flags shared by `offload run`, `offload validate` and `offload plan`: each overrides one job config key."""

from __future__ import annotations

from pathlib import Path

# Flag (argparse dest) -> the config key it overrides; flags beat the file, which beats the defaults.
OVERRIDES = {
    "model": "model.path", "quantization": "model.quantization", "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "hardware": "hardware", "gpu_memory": "memory.gpu", "cpu_memory": "memory.cpu", "disk_memory": "memory.disk",
    "input": "input.path", "input_format": "input.format", "output": "output.path",
    "max_tokens": "sampling.max_tokens", "temperature": "sampling.temperature", "seed": "sampling.seed",
    "batch_size": "schedule.batch_size", "prefetch_depth": "schedule.prefetch_depth",
    "prefill_chunk_tokens": "schedule.prefill_chunk_tokens",
    "report": "report.path", "trace": "report.trace", "plot": "report.plot",
}


RAY_CONFIG_ADDRESS = "from-config"  # --ray given without an address


def add_plan_flags(p) -> None:
    """What decides the plan: model, hardware, budgets, workload."""
    p.add_argument("config", nargs="?", help="a job YAML file such as configs/demo.yaml (flags override it)")
    p.add_argument("--model", help="model folder, .gguf file, a Hub id (org/name) in the local Hugging Face cache, a "
                                    "name in configs/models, or 'default' (model.path)")
    p.add_argument("--quantization", help="none, q8_0 or q4_0 (model.quantization)")
    p.add_argument("--dtype", help="compute format: auto, fp32, bf16 or fp16 (model.dtype)")
    p.add_argument("--max-model-len", type=int, help="tokens per sequence the KV cache holds (model.max_model_len)")
    p.add_argument("--hardware", help="hardware preset name or profile YAML (default: the calibrated profile)")
    p.add_argument("--gpu-memory", help="GPU budget such as 22GiB (memory.gpu; default 90%% of VRAM)")
    p.add_argument("--cpu-memory", help="CPU RAM budget such as 48GiB (memory.cpu; default 80%% of RAM)")
    p.add_argument("--disk-memory", help="disk budget for spilled weights such as 200GB (memory.disk; default 0)")
    p.add_argument("--max-tokens", type=int, help="tokens generated per request (sampling.max_tokens)")
    p.add_argument("--batch-size", type=int, help="sequences in flight (schedule.batch_size; default: planned)")
    p.add_argument("--prefetch-depth", type=int, help="staging slots and read-ahead buffers (schedule.prefetch_depth; "
                   "default: searched by the planner, 1-4)")
    p.add_argument("--prefill-chunk-tokens", type=int, help="tokens per prefill pass (schedule.prefill_chunk_tokens)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set sampling.top_p=0.9 (repeatable)")


def add_job_flags(p) -> None:
    """add_plan_flags plus what a job reads and writes."""
    add_plan_flags(p)
    p.add_argument("--input", help="batch JSONL or prompts file (input.path)")
    p.add_argument("--input-format", choices=["openai", "text"], help="input.format")
    p.add_argument("--output", help="output JSONL (output.path)")
    p.add_argument("--temperature", type=float, help="sampling.temperature")
    p.add_argument("--seed", type=int, help="sampling.seed")
    p.add_argument("--report", help="report JSON path (report.path)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace JSON here (report.trace)")
    p.add_argument("--plot", help="write a timeline PNG here (report.plot)")
    p.add_argument("--ray", nargs="?", const=RAY_CONFIG_ADDRESS, metavar="ADDRESS",
                   help="run on a Ray cluster (engine: ray): at ADDRESS (auto, local or HOST:PORT), or at "
                        "distributed.address when none is given; put it after the config file")


def effective_config(args, need_input: bool = True):
    """The config from args.config plus every flag that was given."""
    from offload.jobs.config import load_config, parse_set_option

    overrides = {key: getattr(args, dest) for dest, key in OVERRIDES.items() if getattr(args, dest, None) is not None}
    if getattr(args, "no_progress", False):
        overrides["report.progress"] = False
    if getattr(args, "echo", False):
        overrides["report.echo"] = True
    if getattr(args, "ray", None) is not None:
        overrides |= ray_overrides(args)
    overrides.update(dict(parse_set_option(s) for s in args.set))
    if args.config is None and "model.path" not in overrides:
        overrides["model.path"] = "default"
    return load_config(args.config, overrides, need_input)


def ray_overrides(args) -> dict:
    """--ray [ADDRESS]: engine ray, and the address when one is given (a config file there is a misplaced flag)."""
    from offload.errors import ConfigError

    if args.ray == RAY_CONFIG_ADDRESS:
        return {"engine": "ray"}
    if args.config is None and Path(args.ray).is_file():
        raise ConfigError(f"--ray took {args.ray!r}, a file, as the Ray address; put the config file first "
                          f"(`offload run {args.ray} --ray`) or give an address (`--ray auto`)")
    return {"engine": "ray", "distributed.address": args.ray}
