"""Predicted ÷ measured time per token, per phase, for three jobs and three quantizations on this machine.

Each job runs through `offload run`'s own code (jobs.run_batch) on the default model and the report's figures
are printed: predicted is the plan re-costed for the steps the run took (planner.recost), with the hardware
profile the planner uses (the one `offload calibrate` wrote, else the estimate: run `offload calibrate` first).
The jobs:
- demo: configs/demo.yaml's nine short prompts, 32 new tokens each;
- batch: scripts/bench_batch.py's 64 prompts of 10 to ~480 tokens, 8 to 64 new tokens each;
- long: 6 prompts of 1,000 to 4,000 tokens, 16 new tokens each.
Each job runs --repeats times, the quantizations alternating; each run's predicted ÷ measured is taken, and the
median printed with the median measured and predicted figures (this machine's speed drifts by tens of percent over
minutes, and each run is priced at the speed probed during it). Prints a table; rows outside 0.85-1.15 are
marked.

  python scripts/predictions.py [--quantizations none q8_0 q4_0] [--jobs demo batch long] [--repeats 3]
  python scripts/predictions.py --smoke    # a tiny model: the demo job and 8 batch prompts, q8_0, once
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
LOW, HIGH = 0.85, 1.15


def demo_lines() -> list[dict]:
    lines = (ROOT / "configs" / "prompts" / "demo.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def id_lines(prompts: list[list[int]], max_tokens: list[int], name: str) -> list[dict]:
    return [{"custom_id": f"{name}-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": ids, "max_tokens": m}} for i, (ids, m) in enumerate(zip(prompts, max_tokens))]


def batch_lines(tokenizer, n: int = 64) -> list[dict]:
    from bench_batch import prompt_ids

    prompts, max_tokens = prompt_ids(tokenizer, n)
    return id_lines(prompts, max_tokens, "batch")


def long_lines(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    lengths = [1000, 4000, 1600, 3200, 2200, 2800]
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]
    return id_lines(prompts, [16] * len(prompts), "long")


def run_job(model: str, lines: list[dict], quantization: str, max_model_len: int, folder: Path) -> dict:
    from offload.jobs.run import run_batch

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = {"model": {"path": model, "quantization": quantization, "max_model_len": max_model_len},
              "input": {"path": str(folder / "in.jsonl")}, "output": {"path": str(folder / "out.jsonl")},
              "sampling": {"temperature": 0, "ignore_eos": True},
              "report": {"print": False, "progress": False}}
    return run_batch(config, restart=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantizations", nargs="+", default=["none", "q8_0", "q4_0"])
    ap.add_argument("--jobs", nargs="+", default=["demo", "batch", "long"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="default", help="'default', or a model with a tokenizer")
    ap.add_argument("--smoke", action="store_true", help="a tiny model with a byte-level tokenizer; the demo job and "
                    "8 batch prompts, q8_0, once: seconds")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            from make_llama import tiny

            args.model = str(tiny(Path(tmp) / "tiny", tokenizer=True))
            args.quantizations, args.jobs, args.repeats = ["q8_0"], ["demo", "batch"], 1
        table(args, Path(tmp))


def print_rows(job: str, quant: str, runs: list[dict], worst: list[float], unscaled_ratios: list[float]) -> None:
    """One row per phase of a job's runs in one quantization; the ratios are appended to worst and unscaled_ratios."""
    for phase in runs[0]["phases"]:
        rows = [r["phases"][phase] for r in runs]
        if not rows[0]["tokens"]:
            continue
        measured = statistics.median(r["measured_s_per_token"] for r in rows)
        # each run is priced at the speed probed during it: the ratio is taken run by run
        predicted = statistics.median(r["predicted_s_per_token"] for r in rows)
        ratios = [r["predicted_s_per_token"] / r["measured_s_per_token"] for r in rows]
        ratio = statistics.median(ratios)
        mark = "" if LOW <= ratio <= HIGH else "  <- outside 0.85-1.15"
        worst.append(ratio)
        spread = max(r["measured_s_per_token"] for r in rows) / min(r["measured_s_per_token"] for r in rows)
        speeds = [r["machine_speed"] for r in runs if r.get("machine_speed")]
        speed = ""
        if speeds:  # and the prediction at the calibrated speed, unscaled
            unscaled = statistics.median(s["predicted_s_at_calibration"][phase] for s in speeds)
            attention = [s["attention"] for s in speeds if s.get("attention")]
            attention = f", {statistics.median(attention):.2f}x attention" if attention else ""
            speed = (f"; CPU speed probed {statistics.median(s['memory'] for s in speeds):.2f}x memory, "
                     f"{statistics.median(s['compute'] for s in speeds):.2f}x compute{attention}; unscaled "
                     f"{unscaled / rows[0]['tokens'] / measured:.2f}")
            unscaled_ratios.append(unscaled / rows[0]["tokens"] / measured)
        print(f"{job:6s} {quant:5s} {phase:7s} {rows[0]['tokens']:7d} {measured:15.3e} {predicted:16.3e} "
              f"{ratio:9.2f}  (runs {', '.join(f'{r:.2f}' for r in ratios)}, measured {spread:.2f}x "
              f"apart{speed}){mark}", flush=True)


def table(args, tmp: Path) -> None:
    """Run the jobs (in tmp), print a row per job, quantization and phase, and the spread of the ratios."""
    from offload.hardware import default_hardware
    from offload.weights.default_model import resolve_model
    from offload.weights.model_files import load_tokenizer

    hw = default_hardware()
    tokenizer = load_tokenizer(resolve_model(args.model))
    jobs = {"demo": (demo_lines, 2048), "batch": (lambda: batch_lines(tokenizer, 8 if args.smoke else 64), 2048),
            "long": (lambda: long_lines(tokenizer.vocab_size), 4200)}
    print(f"hardware profile: {hw.name} ({hw.source}); {torch.get_num_threads()} threads")
    print(f"{'job':6s} {'quant':5s} {'phase':7s} {'tokens':>7s} {'measured s/tok':>15s} {'predicted s/tok':>16s} "
          f"{'pred/meas':>9s}")
    worst, unscaled_ratios = [], []
    for job in args.jobs:
        make, max_model_len = jobs[job]
        lines = make()
        reports: dict[str, list[dict]] = {q: [] for q in args.quantizations}
        for _ in range(args.repeats):
            for quant in args.quantizations:
                reports[quant].append(run_job(args.model, lines, quant, max_model_len, tmp / f"{job}-{quant}"))
        for quant, runs in reports.items():
            print_rows(job, quant, runs, worst, unscaled_ratios)
    inside = sum(LOW <= r <= HIGH for r in worst)
    print(f"{inside} of {len(worst)} rows within {LOW}-{HIGH}; range {min(worst):.2f}-{max(worst):.2f}")
    if unscaled_ratios:
        inside = sum(LOW <= r <= HIGH for r in unscaled_ratios)
        print(f"unscaled by the speed probe: {inside} of {len(unscaled_ratios)} rows within; range "
              f"{min(unscaled_ratios):.2f}-{max(unscaled_ratios):.2f}")


if __name__ == "__main__":
    main()
