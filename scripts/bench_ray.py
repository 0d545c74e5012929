"""A batch job on Ray against the same job on this machine alone: throughput of 1 and 2 replicas, and what Ray adds.

One run, one process, the same job (--requests completions of --max-tokens tokens each, greedy, no stop at
end-of-sequence, the default model) three times:
- local: engine local, torch on 1 thread (what one replica of 1 CPU gets: Ray sets OMP_NUM_THREADS=1);
- ray x1: engine ray, 1 replica of 1 CPU on a Ray cluster started here (2 CPUs);
- ray x2: engine ray, 2 replicas of 1 CPU each.
A warm-up job runs first; then --repeats rounds of the three. Prints, for each (the run of median time): seconds
to start (model load; for Ray also the replicas' start-up), seconds generating (the
driver's clock, from the first request handed out to the last answer written), generated tokens/s; then the
ratio ray x2 / ray x1, and Ray's overhead per request two ways: (ray x1 - local) generating seconds / requests
(the single replica runs the same single batch as the local job), and, within the same run, the driver's
generating time less the replica's own time in LLM.generate (handing out, streaming each answer back). Checks
that every run gives the same answers.
On a 2-core machine the point is correctness and overhead, not speed-up: two replicas share two cores with the
driver (and whatever else runs).

Usage: python scripts/bench_ray.py [--requests 64] [--max-tokens 16] [--repeats 3]
       python scripts/bench_ray.py --smoke    # a tiny model with a byte-level tokenizer, 4 requests of 2 tokens,
                                              # once, local and ray x1 only
Without ray installed (pip install 'offload[ray]') only the local job runs, said so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch


def write_job(folder: Path, name: str, n_requests: int, max_tokens: int, engine: str, replicas: int,
              model: str = "default") -> Path:
    import yaml

    lines = [{"custom_id": f"r{i:03d}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Request {i}: tell me about {'the long history of ' * (i % 5)}the sea"}}
             for i in range(n_requests)]
    (folder / f"{name}.in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = {"model": {"path": model}, "input": {"path": f"{name}.in.jsonl"}, "output": {"path": f"{name}.out.jsonl"},
           "sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
           "report": {"print": False, "progress": False}, "engine": engine,
           "distributed": {"replicas": replicas, "cpus_per_replica": 1}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def timed_job(path: Path) -> dict:
    """Start the engine, run the job on it; seconds to start, seconds generating, tokens, answers."""
    from offload.jobs.config import load_config
    from offload.jobs.run import load_engine, run_batch

    config = load_config(path)
    start = time.perf_counter()
    engine = load_engine(config)
    start_s = time.perf_counter() - start
    try:
        report = run_batch(config, llm=engine, restart=True)
    finally:
        if hasattr(engine, "close"):
            engine.close()
    records = [json.loads(line) for line in config.output_path.read_text().splitlines()]
    in_llm_s = [r["report"]["generate_s"] for r in report.get("replicas", [])]  # each replica's own clock
    return {"start_s": start_s, "generate_s": report["generate_s"], "tokens": report["tokens"]["generated"],
            "tokens_per_s": report["generated_tokens_per_s"], "requests": report["requests"]["done"],
            "replica_s": max(in_llm_s) if in_llm_s else None,
            "answers": {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in records}}


def median_run(runs: list[dict]) -> dict:
    """The run of median generating time (its own figures, so that they stay consistent with each other)."""
    return sorted(runs, key=lambda r: r["generate_s"])[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the three; medians are printed")
    parser.add_argument("--model", default="default", help="'default', or a model with a tokenizer")
    parser.add_argument("--smoke", action="store_true", help="a tiny model with a byte-level tokenizer, 4 requests of "
                        "2 tokens, one round, without ray x2")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        run(args, Path(tmp))


def run(args, folder: Path) -> None:
    """Write the jobs into folder, run each --repeats times after a warm-up job, and report."""
    if args.smoke:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from make_llama import tiny

        args.model, args.requests, args.max_tokens, args.repeats = str(tiny(folder / "tiny", tokenizer=True)), 4, 2, 1
    setups = {"local": ("local", 1), "ray x1": ("ray", 1), "ray x2": ("ray", 2)}
    if args.smoke:  # a second replica's start-up is ~10 s more of the same code
        del setups["ray x2"]
    if importlib.util.find_spec("ray") is None:
        print("ray is not installed (pip install 'offload[ray]'): only the local job runs")
        setups = {"local": setups["local"]}
    else:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    torch.set_num_threads(1)  # the local job on the one CPU a replica gets
    paths = {name: write_job(folder, name.replace(" ", ""), args.requests, args.max_tokens, *setup, args.model)
             for name, setup in setups.items()}
    # warm-up: the first job in a process pays one-time costs
    timed_job(write_job(folder, "warm-up", 4, 2, "local", 1, args.model))
    rounds = [{name: timed_job(path) for name, path in paths.items()} for _ in range(args.repeats)]
    if "ray x1" in setups:
        ray.shutdown()
    report(args, {name: median_run([r[name] for r in rounds]) for name in setups}, rounds)


def report(args, runs: dict, rounds: list[dict]) -> None:
    """Each setup's figures, and the ratios and Ray's overhead where Ray ran."""
    print(f"{args.requests} requests x {args.max_tokens} tokens, {Path(args.model).name} model, 1 CPU per replica "
          f"(local: 1 thread); medians of {args.repeats} rounds")
    for name, r in runs.items():
        print(f"  {name:>7}: start {r['start_s']:5.1f} s, generate {r['generate_s']:6.2f} s, "
              f"{r['tokens_per_s']:6.1f} generated tok/s ({r['requests']} requests, {r['tokens']} tokens)")
    local = runs["local"]
    if "ray x2" in runs:
        print(f"  ray x2 / ray x1 throughput: {runs['ray x2']['tokens_per_s'] / runs['ray x1']['tokens_per_s']:.2f}x")
    if "ray x1" in runs:
        one = runs["ray x1"]
        print(f"  ray x1 / local throughput: {one['tokens_per_s'] / local['tokens_per_s']:.2f}x")
        over_local_s, over_replica_s = one["generate_s"] - local["generate_s"], one["generate_s"] - one["replica_s"]
        print(f"  Ray's overhead per request: {1e3 * over_local_s / args.requests:+.1f} ms (ray x1 - local); "
              f"{1e3 * over_replica_s / args.requests:+.2f} ms (the driver's generating time - the replica's time in "
              f"LLM.generate, same run)")
    same = all(r[name]["answers"] == local["answers"] for r in rounds for name in runs)
    print(f"  same answers in every run: {same}")


if __name__ == "__main__":
    main()
