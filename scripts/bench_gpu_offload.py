"""Bigger than VRAM on a CUDA GPU, side by side: offload against Hugging Face accelerate's CPU offload.

Both tools run the same model (a Hugging Face folder: config.json + safetensors, bf16; scripts/make_llama.py
writes a random one) with the same GPU budget (--gpu-memory), greedy decoding of --tokens tokens after a batch of
--prompt-len random token ids per sequence (fixed seed, distinct per sequence, the same for both tools; no
tokenizer). Each tool runs in a fresh child process (`bench_gpu_offload.py --child SPEC`), one after the other,
so one never holds GPU memory while the other runs; a child loads once and measures every batch size:

  accelerate  AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, device_map="auto",
              max_memory={0: budget, "cpu": 1TiB}), then model.generate(ids, attention_mask=ones,
              max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=eos). Layers that do not fit
              stay in CPU RAM and are copied to the GPU at each forward (accelerate's hooks). max_memory counts
              weights only.
  offload     LLM(model, dtype="bf16", gpu_memory=budget, backend="cuda", hardware=--hardware,
              batch_size=max(batches), max_model_len=prompt+tokens, max_tokens=tokens), then
              llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)). gpu_memory
              counts everything offload puts on the GPU (weights, KV, staging slots, workspace, the CUDA context
              the hardware profile reserves, a margin), so its plan holds fewer weights there than accelerate's.
              Its plan's prediction (the same placement re-costed for the steps the measured generate took,
              offload.planner.recost) is reported as predicted ÷ measured time per decode token.

--device cpu is a smoke mode for machines without a GPU: accelerate loads on the CPU without a device_map,
offload runs backend="cpu" with gpu_memory=0. Its figures mean nothing; it exercises this script. --smoke makes a
tiny random model here and runs batches 1 and 2 of 3 tokens once, on the GPU if torch sees one, else with
--device cpu (said): seconds.

Timing (both tools, each batch): a warm-up generate of 2 tokens, then one generate of 1 token (prefill and the
first token: t_1, reported as prefill) and one of N tokens (t_N), torch.cuda.synchronize() before each clock
read; decode tokens/s = batch * (N - 1) / (t_N - t_1). Peak GPU memory is torch.cuda.max_memory_allocated(),
reset after the load and before each batch (the load's own peak is kept too); the CUDA context is not in it
(device_used_bytes, from cudaMemGetInfo at the end, has it). The greedy outputs are compared per sequence over
the first --agree-tokens tokens (bf16 random models can diverge between implementations: reported, not
asserted). --repeats rounds, accelerate then offload in each; medians reported; a failed child is reported
with its last stderr lines and makes the exit status 1.

Usage:
  python scripts/make_llama.py --out /tmp/llama-3b --hidden 3072 --layers 28 --intermediate 8192 --heads 24 \\
      --kv-heads 8 --vocab 32000                                          # 3.0 B parameters, 6.03 GB bf16
  python scripts/bench_gpu_offload.py --model /tmp/llama-3b --gpu-memory 1.5GiB --batches 1,16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MARK = "BENCH_GPU_OFFLOAD_RESULT "  # the child's one JSON line on stdout starts with this
TOOLS = ("accelerate", "offload")
CPU_UNLIMITED_BYTES = 1 << 40  # accelerate's CPU max_memory: no limit there


# ------------------------------------------------------------------------------------------------- the child

def child_main(spec: dict) -> int:
    """Load one tool, measure every batch, print MARK + one JSON line."""
    result = {"tool": spec["tool"]}
    try:
        result.update({"accelerate": child_accelerate, "offload": child_offload}[spec["tool"]](spec))
    except Exception as exc:  # reported by the parent in one line, the traceback in the stderr tail
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    import resource

    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sys.stdout.flush()
    print(MARK + json.dumps(result), flush=True)
    return 0


def gpu_stats(torch, on_gpu: bool) -> dict:
    if not on_gpu:
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "device_used_bytes": total - free}


def measure_batches(torch, spec: dict, make_generate, on_gpu: bool, after=None) -> dict:
    """Per batch: warm-up (2 tokens), t_1, t_N; generate(n) returns each sequence's ids; after(res) adds more."""
    n, out = spec["tokens"], {}
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    for b in spec["batches"]:
        generate = make_generate(spec["prompts"][:b])

        def timed(k: int):
            sync()
            t0 = time.perf_counter()
            ids = generate(k)
            sync()
            return time.perf_counter() - t0, ids

        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        try:
            timed(2)
            (t1_s, _), (tn_s, ids) = timed(1), timed(n)
        except Exception as exc:  # an OOM at one batch: the others still run
            out[str(b)] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
            print(f"batch {b}: {out[str(b)]['error']}", file=sys.stderr)
            if on_gpu:
                torch.cuda.empty_cache()
            continue
        res = out[str(b)] = {"t1_s": t1_s, "tn_s": tn_s, "output_ids": ids, **gpu_stats(torch, on_gpu),
                             "decode_tokens_per_s": b * (n - 1) / (tn_s - t1_s) if tn_s > t1_s else None}
        if any(len(s) != n for s in ids):
            res["warning"] = f"generated {sorted({len(s) for s in ids})} tokens, not {n}"
        if after:
            after(res)
    return out


def child_accelerate(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    on_gpu = spec["device"] == "cuda"
    kwargs = {"device_map": "auto", "max_memory": {0: spec["gpu_bytes"], "cpu": CPU_UNLIMITED_BYTES}} if on_gpu else {}
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16, **kwargs).eval()
    if on_gpu:
        torch.cuda.synchronize()
    res = {"load_s": time.perf_counter() - t0, "load": gpu_stats(torch, on_gpu), "placement": placement_hf(model)}
    eos = model.generation_config.eos_token_id
    pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    device = "cuda:0" if on_gpu else "cpu"

    def make_generate(prompts):
        ids = torch.tensor(prompts, dtype=torch.long, device=device)  # [B, S]
        mask = torch.ones_like(ids)

        def generate(n: int) -> list[list[int]]:
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=pad)
            return out[:, ids.shape[1]:].tolist()
        return generate

    res["batches"] = measure_batches(torch, spec, make_generate, on_gpu)
    return res


def placement_hf(model) -> dict:
    """Parameter bytes per device of accelerate's device map, and the summary line."""
    dmap = getattr(model, "hf_device_map", None) or {"": next(model.parameters()).device}
    placed = Counter()
    for name, device in dmap.items():
        placed[str(device)] += sum(p.numel() * p.element_size() for p in model.get_submodule(name).parameters())
    layers = [str(v) for k, v in dmap.items() if ".layers." in f".{k}."]
    on_gpu = sum(v not in ("cpu", "disk") for v in layers)
    gpu_bytes = sum(v for k, v in placed.items() if k not in ("cpu", "disk"))
    summary = (f"{on_gpu}/{len(layers)} layers on the GPU ({fmt_gib(gpu_bytes)} GiB of weights there)" if layers
               else f"device map {dict(placed)} (bytes)")
    return {"bytes_by_device": dict(placed), "summary": summary}


def child_offload(spec: dict) -> dict:
    import torch
    import offload.kernels
    from offload import LLM, SamplingParams

    on_gpu = spec["device"] == "cuda"
    t0 = time.perf_counter()
    llm = LLM(spec["model"], dtype="bf16", gpu_memory=spec["gpu_bytes"],
              backend=spec["device"], hardware=spec["hardware"], batch_size=max(spec["batches"]),
              max_model_len=spec["prompt_len"] + spec["tokens"], max_tokens=spec["tokens"])
    if on_gpu:
        torch.cuda.synchronize()
    res = {"load_s": time.perf_counter() - t0, "load": gpu_stats(torch, on_gpu)}
    plan, steps = llm.plan, []
    if plan is not None:
        tiers, decode = Counter(u.weight_tier for u in plan.units), Counter(u.decode for u in plan.units)
        gpu_weights = fmt_gib(sum(u.weight_bytes for u in plan.units if u.weight_tier == "gpu"))
        plan_tps = plan.decode.tokens_per_s if plan.decode.step_s > 0 else None
        res["placement"] = {"summary": f"{plan.summary_line} ({gpu_weights} GiB of weights there); units by tier "
                                       f"{dict(tiers)}, by where decode computes {dict(decode)}; plan: "
                                       f"{fmt(plan_tps, 1)} decode tok/s at batch {plan.workload.batch_size}; CPU "
                                       f"kernels {offload.kernels.ACTIVE_PATH}",
                            "plan_decode_tokens_per_s": plan_tps, "plan": json.loads(plan.to_json())}

    def make_generate(prompts):
        def generate(n: int) -> list[list[int]]:
            start = len(llm.timeline.steps)
            outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            steps[:] = llm.timeline.steps[start:]
            return [list(o.token_ids) for o in outs]
        return generate

    def predicted(r: dict) -> None:  # the plan re-costed for the N-token generate's decode steps
        if plan is None:
            return
        try:
            from offload.planner.recost import recost_steps

            decode_s = recost_steps(llm.spec, llm.request.profile(), plan, steps)["decode"]
            n_tokens = sum(s.n_decode_tokens for s in steps if s.phase == "decode")
            r["predicted_tokens_per_s"] = n_tokens / decode_s if decode_s > 0 else None
        except Exception as exc:  # an internal API that moved must not cost the measurement
            r["predicted_error"] = f"{type(exc).__name__}: {exc}"[:200]

    res["batches"] = measure_batches(torch, spec, make_generate, on_gpu, after=predicted)
    return res


# ------------------------------------------------------------------------------------------------ the parent

def run_child(spec: dict, timeout_s: float) -> dict:
    """One child; its result with status ok|failed, exit code, wall time and (failed) the stderr tail."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=timeout_s)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stdout, stderr = "timeout", _text(exc.stdout), _text(exc.stderr) + f"\ntimed out after {timeout_s:.0f} s"
    result = next((json.loads(ln[len(MARK):]) for ln in stdout.splitlines() if ln.startswith(MARK)), {})
    result.update(tool=spec["tool"], rc=rc, wall_s=time.perf_counter() - t0)
    bad = [f"batch {b}: {r['error']}" for b, r in result.get("batches", {}).items() if "error" in r]
    if rc != 0 or "error" in result or bad or "batches" not in result:
        result["status"] = "failed"
        result.setdefault("error", bad[0] if bad else f"timed out after {timeout_s:.0f} s" if rc == "timeout"
                          else f"exit status {rc}")
        result["stderr_tail"] = "\n".join([ln for ln in stderr.splitlines() if ln.strip()][-15:])
    else:
        result["status"] = "ok"
    return result


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def median(vals):
    vals = [v for v in vals if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


def ratio(a, b):
    return a / b if a and b else None


def fmt(x, digits=2, suffix="") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def fmt_gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def common_prefix(x: list[int], y: list[int]) -> int:
    return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


def summarize_batch(runs: dict, b: str, agree_k: int) -> dict:
    """Medians per tool over the runs that measured batch b, the ratios, and how far the greedy outputs agree."""
    done = {t: [r["batches"][b] for r in rs if "decode_tokens_per_s" in r.get("batches", {}).get(b, {})]
            for t, rs in runs.items()}
    keys = ("decode_tokens_per_s", "t1_s", "peak_allocated_bytes", "device_used_bytes", "predicted_tokens_per_s")
    out = {t: {k: median(x.get(k) for x in done[t]) for k in keys} | {"n_ok": len(done[t]), "n_runs": len(runs[t])}
           for t in TOOLS}
    a, o = out["accelerate"], out["offload"]
    out["offload_over_accelerate"] = ratio(o["decode_tokens_per_s"], a["decode_tokens_per_s"])
    # predicted ÷ measured time per token, as offload's report and scripts/predictions.py give it
    out["predicted_over_measured"] = ratio(o["decode_tokens_per_s"], o["predicted_tokens_per_s"])
    if done["accelerate"] and done["offload"]:  # the first run of each: greedy outputs do not change per run
        common = [common_prefix(x, y) for x, y in zip(done["accelerate"][0]["output_ids"],
                                                       done["offload"][0]["output_ids"])]
        out["agreement"] = {"k": agree_k, "agree": sum(c >= agree_k for c in common), "of": len(common),
                            "mean_common_prefix": statistics.mean(common)}
    return out


def table(summary: dict, runs: dict, budget: int, agree_k: int) -> str:
    head = ["batch", "accel tok/s", "offload tok/s", "offload/accel", "prefill s accel", "prefill s offload",
            f"peak GiB accel/{fmt_gib(budget)}", f"peak GiB offload/{fmt_gib(budget)}", "offload pred/meas",
            f"agree@{agree_k}"]
    rows = [head]
    for b, s in summary.items():
        a, o, agree = s["accelerate"], s["offload"], s.get("agreement")

        def failed(t, text):
            return text if s[t]["n_ok"] == s[t]["n_runs"] else f"{text} ({s[t]['n_runs'] - s[t]['n_ok']} failed)"
        rows.append([b, failed("accelerate", fmt(a["decode_tokens_per_s"])),
                     failed("offload", fmt(o["decode_tokens_per_s"])), fmt(s["offload_over_accelerate"], 2, "x"),
                     fmt(a["t1_s"], 3), fmt(o["t1_s"], 3), fmt_gib(a["peak_allocated_bytes"]),
                     fmt_gib(o["peak_allocated_bytes"]), fmt(s["predicted_over_measured"]),
                     f"{agree['agree']}/{agree['of']}" if agree else "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for t in TOOLS:
        load = median(r.get("load_s") for r in runs[t])
        load_peak = median((r.get("load") or {}).get("peak_allocated_bytes") for r in runs[t])
        place = next((r["placement"]["summary"] for r in runs[t] if r.get("placement")), "-")
        lines.append(f"{t}: load {fmt(load, 1)} s, GPU peak while loading {fmt_gib(load_peak)} GiB (medians); {place}")
    lines.append("tok/s: batch*(N-1)/(t_N - t_1), median; prefill: t_1; peak: torch.cuda.max_memory_allocated after "
                 "the load (no CUDA context); pred/meas: offload's plan re-costed ÷ measured time per decode token; "
                 "agree@K: sequences whose first K greedy tokens are equal")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Usage:" + __doc__.split("Usage:")[-1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="Hugging Face model folder (config.json + safetensors, bf16)")
    ap.add_argument("--gpu-memory", default="2GiB", help="GPU budget, both tools (default 2GiB)")
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes (default 1,16)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16, help="tokens of the measured generate (>= 2)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of fresh children, medians reported")
    ap.add_argument("--agree-tokens", type=int, default=8, help="K of agree@K (at most --tokens)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke mode, no GPU needed")
    ap.add_argument("--hardware", help="offload's hardware profile (preset or YAML); default: the calibrated "
                    "profile if `offload calibrate` ran, else h200-server on cuda, estimated on cpu")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a child may run before it is killed")
    ap.add_argument("--json", help="write every figure here (rewritten after each child)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model made here, batches 1 and 2 of 3 tokens, once; "
                    "on the CPU (--device cpu) where torch sees no GPU")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def smoke_args(args, folder: Path) -> None:
    """--smoke: a tiny random model in folder and a run of seconds, on the GPU if torch sees one."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_llama import tiny

    args.model = str(tiny(folder))
    args.batches, args.prompt_len, args.tokens, args.repeats, args.agree_tokens = "1,2", 8, 3, 1, 2
    if not torch.cuda.is_available():
        print("smoke: torch sees no CUDA GPU, so both tools run on the CPU (--device cpu); the figures mean nothing")
        args.device = "cpu"


def check_args(args) -> str | None:
    """What is wrong with the arguments, or None; fills args.gpu_bytes, args.batch_list, args.hardware."""
    from offload.errors import ConfigError
    from offload.hardware import cache_path, parse_size

    model = Path(args.model or "")
    if not args.model or not (model / "config.json").is_file() or not list(model.glob("*.safetensors")):
        return f"--model {args.model!r}: a folder with config.json and .safetensors files is needed"
    try:
        args.gpu_bytes = parse_size(args.gpu_memory, "--gpu-memory")
        args.batch_list = [int(b) for b in args.batches.split(",") if b.strip()]
    except (ConfigError, ValueError) as exc:
        return f"--gpu-memory / --batches: {exc}"
    if args.gpu_bytes <= 0 or not args.batch_list or min(args.batch_list) < 1:
        return "--gpu-memory must be more than 0 and --batches whole numbers of 1 or more"
    if args.tokens < 2 or args.prompt_len < 1 or args.repeats < 1 or args.agree_tokens < 1:
        return "--tokens must be 2 or more; --prompt-len, --repeats and --agree-tokens 1 or more"
    if args.hardware is None and args.device == "cuda" and not cache_path().is_file():
        args.hardware = "h200-server"  # the estimated profile has no GPU: offload would refuse a GPU budget
    if args.device == "cuda":
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # the parent makes no CUDA context
        import torch

        if not torch.cuda.is_available():
            return "--device cuda but torch sees no CUDA GPU; use --device cpu for the smoke mode"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="bench-gpu-offload-") as tmp:
            smoke_args(args, Path(tmp))
            return bench(args)
    return bench(args)


def bench(args) -> int:
    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    model = Path(args.model).resolve()
    cfg = json.loads((model / "config.json").read_text())
    model_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    rng = random.Random(args.seed)
    vocab = cfg.get("vocab_size") or 32000
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(max(args.batch_list))]
    spec = {"model": str(model), "device": args.device, "hardware": args.hardware,
            "gpu_bytes": args.gpu_bytes if args.device == "cuda" else 0,  # offload: a CPU profile has no GPU tier
            "batches": args.batch_list, "prompt_len": args.prompt_len, "tokens": args.tokens, "prompts": prompts}
    print(f"model {model} ({model_bytes / 2**30:.2f} GiB, {cfg.get('num_hidden_layers')} layers); GPU budget "
          f"{args.gpu_bytes / 2**30:.2f} GiB = {args.gpu_bytes / model_bytes:.0%} of the weights; device "
          f"{args.device}; offload hardware {args.hardware or 'default'}; batches {args.batch_list}, prompt "
          f"{args.prompt_len}, {args.tokens} tokens, {args.repeats} repeat(s)", flush=True)
    results = {"args": vars(args) | {"model": str(model)}, "model_bytes": model_bytes, "prompts": prompts,
               "runs": {t: [] for t in TOOLS}}
    for rep in range(args.repeats):
        for tool in TOOLS:
            r = run_child(spec | {"tool": tool}, args.timeout)
            results["runs"][tool].append(r)
            line = ", ".join(f"b{b} {fmt(x.get('decode_tokens_per_s'))} tok/s" if "error" not in x else f"b{b} failed"
                             for b, x in r.get("batches", {}).items())
            print(f"  [#{rep + 1}] {tool:<10} {r['status']} in {r['wall_s']:.0f} s: {line or r.get('error')}",
                  flush=True)
            if r["status"] == "failed":
                print(f"    {r.get('error')}\n    " + r["stderr_tail"].replace("\n", "\n    "), file=sys.stderr)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n")
    agree_k = min(args.agree_tokens, args.tokens)
    results["summary"] = {str(b): summarize_batch(results["runs"], str(b), agree_k) for b in args.batch_list}
    results["table"] = table(results["summary"], results["runs"], args.gpu_bytes, agree_k)
    print("\n" + results["table"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    return 1 if any(r["status"] != "ok" for rs in results["runs"].values() for r in rs) else 0


if __name__ == "__main__":
    sys.exit(main())
