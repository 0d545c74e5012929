"""`offload run` and `offload validate`: batch jobs from a YAML config, flags overriding the file."""

from __future__ import annotations

from pathlib import Path

from offload.errors import ConfigError

# Flag (argparse dest) -> the config key it overrides; flags beat the file, which beats the defaults.
OVERRIDES = {
    "model": "model.path", "quantization": "model.quantization", "dtype": "model.dtype",
    "hardware": "hardware", "gpu_memory": "memory.gpu", "cpu_memory": "memory.cpu", "disk_memory": "memory.disk",
    "input": "input.path", "input_format": "input.format", "output": "output.path",
    "max_tokens": "sampling.max_tokens", "temperature": "sampling.temperature", "seed": "sampling.seed",
    "batch_size": "schedule.batch_size", "report": "report.path", "trace": "report.trace", "plot": "report.plot",
}


def _add_config_flags(p) -> None:
    p.add_argument("config", nargs="?", help="a job YAML file such as configs/demo.yaml")
    p.add_argument("--model", help="model folder or 'default' (model.path)")
    p.add_argument("--quantization", help="none, q8_0 or q4_0 (model.quantization)")
    p.add_argument("--dtype", help="auto, fp32, bf16 or fp16 (model.dtype)")
    p.add_argument("--hardware", help="hardware preset name or profile YAML")
    p.add_argument("--gpu-memory", help="GPU budget such as 22GiB (memory.gpu)")
    p.add_argument("--cpu-memory", help="CPU RAM budget such as 48GiB (memory.cpu)")
    p.add_argument("--disk-memory", help="disk budget such as 200GB (memory.disk)")
    p.add_argument("--input", help="batch JSONL or prompts file (input.path)")
    p.add_argument("--input-format", choices=["openai", "text"], help="input.format")
    p.add_argument("--output", help="output JSONL (output.path)")
    p.add_argument("--max-tokens", type=int, help="sampling.max_tokens")
    p.add_argument("--temperature", type=float, help="sampling.temperature")
    p.add_argument("--seed", type=int, help="sampling.seed")
    p.add_argument("--batch-size", type=int, help="sequences in flight (schedule.batch_size)")
    p.add_argument("--report", help="report JSON path (report.path)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace JSON here (report.trace)")
    p.add_argument("--plot", help="write a timeline PNG here (report.plot)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set sampling.top_p=0.9 (repeatable)")


def add_run_parser(sub) -> None:
    p = sub.add_parser("run", help="run a batch job from a YAML config (resumable)")
    _add_config_flags(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (also off when not a terminal)")
    p.add_argument("--restart", action="store_true", help="discard existing outputs and start over")
    p.add_argument("--echo", action="store_true", help="print each answer as it finishes (report.echo)")
    p.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    p.set_defaults(func=run_run)


def add_validate_parser(sub) -> None:
    p = sub.add_parser("validate", help="check a job config and its input file without running it")
    _add_config_flags(p)
    p.set_defaults(func=run_validate)


def effective_config(args):
    """The config from args.config plus every flag that was given."""
    from offload.config import load_config, parse_set_option

    overrides = {key: getattr(args, dest) for dest, key in OVERRIDES.items() if getattr(args, dest) is not None}
    if getattr(args, "no_progress", False):
        overrides["report.progress"] = False
    if getattr(args, "echo", False):
        overrides["report.echo"] = True
    overrides.update(dict(parse_set_option(s) for s in args.set))
    return load_config(args.config, overrides)


def run_run(args) -> int:
    from offload.jobs import run_batch

    config = effective_config(args)
    if args.print_config:
        print(config.to_yaml(), end="")
        return 0
    run_batch(config, restart=args.restart)
    return 0


def run_validate(args) -> int:
    from offload.batch import read_requests
    from offload.jobs import sampling_defaults

    config = effective_config(args)
    requests, bad = read_requests(Path(config.input.path), config.input.format, sampling_defaults(config),
                                  config.input.chat)
    name = args.config or "the command line"
    if bad:
        lines = "\n".join(f"  - {b.message}" for b in bad)
        raise ConfigError(f"{config.input.path} has {len(bad)} bad line(s) that would become error lines in "
                          f"the output; fix them:\n{lines}")
    print(f"{name}: ok; {len(requests)} requests from {config.input.path}; outputs to {config.output_path}")
    return 0
