"""Bigger than RAM, side by side: offload's disk tier against Hugging Face accelerate's disk offload, on the CPU.

Both tools run the same model (a Hugging Face folder: config.json + safetensors; scripts/make_llama.py writes a
random one) with the same CPU memory budget for weights, batch 1, greedy decoding of --tokens tokens after the
same fixed random prompt of --prompt-len token ids (no tokenizer is needed), each measurement in a fresh child
process (`bench_disk.py --child SPEC`), so page cache, RSS and memory accounting belong to one run:

  accelerate  AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, device_map="auto",
              max_memory={"cpu": budget}, offload_folder=<fresh temp dir>), then model.generate(ids,
              max_new_tokens=n, min_new_tokens=n, do_sample=False) (min_new_tokens: EOS does not end it early).
  offload     LLM(model, dtype="bf16", cpu_memory=budget, disk_memory=--disk-memory, gpu_memory=0,
              backend="cpu", batch_size=1, max_model_len=prompt+tokens, max_tokens=tokens), then
              llm.generate([ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)). offload counts
              its own process (Python, torch: host_baseline "auto", its default) against cpu_memory, so its plan
              holds fewer weights in RAM than accelerate's max_memory, which counts weights only;
              --offload-host-baseline 0 gives the plan the whole budget instead. Its plan's prediction is reported beside the measurement: the decode phase's
              tokens/s (plan.decode, the figure `offload plan` prints) and predicted / measured step time,
              and the bytes the plan put on disk.
  llama.cpp   only when --model is a .gguf file and llama-cpp-python is importable: Llama(path, n_ctx, n_threads=
              os.cpu_count(), verbose=False) with its default mmap, warm row only (accelerate then loads the same
              file through transformers' gguf_file=, which dequantizes it).

Timing (the same for every tool): after a warm-up generate of 2 tokens, one generate of 1 token (prefill and the
first token) and one of N tokens are timed; the decode rate is (N - 1) / (t_N - t_1), prefill cancelled out.
Each child also reports, over the measured N-token generate: bytes read from the block device (/proc/self/io
read_bytes, which sums every thread of the process, mmap page faults included) and bytes read by read()-family
calls (rchar), both divided by N (each token is one pass over the weights); its peak RSS (VmHWM; ru_maxrss too,
which Linux carries over exec from the parent), the load time, and the generated ids (so the tools' greedy
outputs can be compared).

Rows (--rows, in the order given; --repeats fresh children per tool, accelerate and offload interleaved, medians
reported):
  warm     no memory limit; the model files are read once (as `cat FILE > /dev/null`) before each run, so the
           page cache holds them. Where cgroups work the child still runs in a cgroup without a limit, to
           report its peak memory.
  bounded  the child runs in a memory cgroup (v1 memory.limit_in_bytes, swap limited alike where memsw exists;
           or v2 memory.max, memory.swap.max 0) created under this process's own cgroup, limit = budget +
           the tool's import baseline + --cgroup-slack. The baseline is measured once per tool by a child
           that imports torch and transformers+accelerate (or offload) and nothing else, in an unlimited
           cgroup: the cgroup's peak, which is what the limit counts (--baseline rss takes the child's RSS
           instead, which also counts the shared libraries' page-cache pages, charged to whoever read them
           first: ~150 MiB more for torch + transformers). Before each run the model files are dropped
           from the page cache (posix_fadvise DONTNEED), so it starts cold. After the run the cgroup's peak
           (memory.max_usage_in_bytes / memory.peak), failcnt and OOM kills are read, then it is removed.
           A run killed by the OOM killer is reported as OOM, not as a crash. Without root or a memory
           controller the row is skipped, saying why.
  roomy    as bounded, but the limit is ROOMY_FACTOR (2) x the budget, for both tools: a container with room for
           the page cache beside the budget, where offload's planner leaves disk units to the page cache (it
           keeps 1/16 of the cgroup's limit aside) and accelerate's reads of its offload folder stay cached too.

--smoke writes a tiny random model to a temporary folder and runs one row once with a few tokens: roomy where
memory cgroups can be made (both tools, a cgroup each), else warm; --rows picks others. About 10 s a child: it
checks that the script runs, not speed.

Usage:
  python scripts/make_llama.py --out /tmp/llama-1.6b                      # ~1.65 GB bf16
  python scripts/bench_disk.py --model /tmp/llama-1.6b --budget 1200MiB --tokens 16 --repeats 3 --json out.json
  python scripts/bench_disk.py --smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MARK = "BENCH_DISK_RESULT "  # the child's one JSON line on stdout starts with this
PHASE_MARK = "BENCH_DISK_PHASE "  # the child says on stderr what it starts (an OOM-killed run says where it died)
ROWS = ("warm", "bounded", "roomy")
ROOMY_FACTOR = 2  # the roomy row's cgroup limit, in budgets: room for the page cache beside the budget
TOOLS = ("accelerate", "offload")
READ_CHUNK = 8 << 20


# ----------------------------------------------------------------------------------------------- small helpers

def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_num(x, digits=2, suffix="") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def proc_io() -> dict:
    """This process's /proc/self/io counters (summed over all its threads); {} where there is none."""
    try:
        return {k: int(v) for k, v in (line.split(":") for line in Path("/proc/self/io").read_text().splitlines())}
    except (OSError, ValueError):
        return {}


def proc_status(key: str) -> int | None:
    """A kB figure of /proc/self/status (VmRSS, VmHWM, RssAnon...) in bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def model_files(model: Path) -> list[Path]:
    """The files whose bytes are the weights: a GGUF file (its split set), or a folder's safetensors."""
    if model.is_file():
        if "-00001-of-" in model.name:
            return sorted(model.parent.glob(model.name.split("-00001-of-")[0] + "-0*-of-*.gguf"))
        return [model]
    return sorted(model.glob("*.safetensors"))


def warm_cache(files: list[Path]) -> int:
    """Read every file once (cat FILE > /dev/null), so the page cache holds it; bytes read."""
    total = 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(READ_CHUNK):
                total += len(chunk)
    return total


def drop_cache(files: list[Path]) -> None:
    """Drop the files' clean pages from the page cache (POSIX_FADV_DONTNEED)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------------------- the child

def child_main(spec: dict) -> int:
    """Run one measurement (spec['tool']) and print MARK + one JSON line."""
    tool = spec["tool"]
    result = {"tool": tool}
    phase("import")
    if spec.get("threads") and tool in ("accelerate", "offload"):
        import torch

        torch.set_num_threads(spec["threads"])
    try:
        if tool.startswith("baseline:"):
            result.update(child_baseline(tool.split(":", 1)[1]))
        else:
            result.update({"accelerate": child_accelerate, "offload": child_offload,
                           "llamacpp": child_llamacpp}[tool](spec))
    except Exception as exc:  # reported, so the parent prints it in one line
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    import resource

    result["peak_rss_bytes"] = proc_status("VmHWM")
    result["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sys.stdout.flush()
    print(MARK + json.dumps(result), flush=True)
    return 0


def child_baseline(which: str) -> dict:
    import torch  # noqa: F401

    if which == "accelerate":
        import accelerate  # noqa: F401
        from transformers import AutoModelForCausalLM  # noqa: F401
        import transformers.models.llama.modeling_llama  # noqa: F401  (what from_pretrained imports for llama)
    else:
        from offload import LLM, SamplingParams  # noqa: F401
    return {"rss_bytes": proc_status("VmRSS"), "rss_anon_bytes": proc_status("RssAnon")}


def phase(name: str) -> None:
    print(PHASE_MARK + name, file=sys.stderr, flush=True)


def measure(generate, tokens: int) -> dict:
    """Warm-up generate of 2 tokens, then t_1 and t_N; the decode rate is (N-1)/(t_N-t_1). generate(n) returns
    the generated ids."""
    phase("warm-up generate")
    t0 = time.perf_counter()
    generate(2)
    warmup_s = time.perf_counter() - t0
    phase("1-token generate")
    t0 = time.perf_counter()
    generate(1)
    t1_s = time.perf_counter() - t0
    phase(f"{tokens}-token generate")
    io0 = proc_io()
    t0 = time.perf_counter()
    ids = generate(tokens)
    tn_s = time.perf_counter() - t0
    io1 = proc_io()
    phase("report")
    decode_s = tn_s - t1_s
    out = {
        "warmup_s": warmup_s, "t1_s": t1_s, "tn_s": tn_s, "generated": len(ids), "output_ids": list(ids),
        "decode_step_s": decode_s / (tokens - 1) if decode_s > 0 else None,
        "decode_tokens_per_s": (tokens - 1) / decode_s if decode_s > 0 else None,
        "e2e_tokens_per_s": tokens / tn_s if tn_s > 0 else None,
    }
    for key in ("read_bytes", "rchar"):
        if key in io0 and key in io1:
            out[key] = io1[key] - io0[key]
            out[key + "_per_token"] = out[key] / tokens
    if len(ids) != tokens:
        out["warning"] = f"generated {len(ids)} tokens, not {tokens}"
    return out


def child_accelerate(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model_path = Path(spec["model"])
    offload_folder = tempfile.mkdtemp(prefix="accelerate-offload-")  # TMPDIR is this run's own folder
    kwargs = dict(dtype=torch.bfloat16, device_map="auto", max_memory={"cpu": spec["budget_bytes"]},
                  offload_folder=offload_folder)
    phase("load")
    t0 = time.perf_counter()
    try:
        if model_path.is_file():  # a GGUF file: transformers dequantizes it
            model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(model_path), **kwargs)
        model.eval()
        load_s = time.perf_counter() - t0
        placed = device_map_bytes(model)
        ids = torch.tensor([spec["prompt_ids"]], dtype=torch.long)
        mask = torch.ones_like(ids)
        eos = model.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0

        def generate(n: int) -> list[int]:
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     pad_token_id=pad)
            return out[0, ids.shape[1]:].tolist()

        res = measure(generate, spec["tokens"])
        res.update(load_s=load_s, placed_bytes=placed, torch_threads=torch.get_num_threads())
        return res
    finally:
        shutil.rmtree(offload_folder, ignore_errors=True)


def device_map_bytes(model) -> dict:
    """Parameter bytes per device of accelerate's device map (cpu, disk)."""
    dmap = getattr(model, "hf_device_map", None) or {}
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        device = next((dmap[".".join(parts[:i])] for i in range(len(parts), -1, -1) if ".".join(parts[:i]) in dmap),
                      str(p.device))
        out[str(device)] = out.get(str(device), 0) + p.numel() * p.element_size()
    return out


def child_offload(spec: dict) -> dict:
    import torch
    from offload import LLM, SamplingParams

    host_baseline = spec["offload_host_baseline"]
    phase("load")
    t0 = time.perf_counter()
    llm = LLM(spec["model"], dtype="bf16", batch_size=1, cpu_memory=spec["budget_bytes"],
              disk_memory=spec["disk_memory"], gpu_memory=0, backend="cpu",
              max_model_len=len(spec["prompt_ids"]) + spec["tokens"], max_tokens=spec["tokens"],
              host_baseline=host_baseline if host_baseline == "auto" else int(host_baseline))
    load_s = time.perf_counter() - t0
    prompt = list(spec["prompt_ids"])

    def generate(n: int) -> list[int]:
        out = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return list(out[0].token_ids)

    res = measure(generate, spec["tokens"])
    res.update(load_s=load_s, torch_threads=torch.get_num_threads())
    plan = llm.plan
    if plan is not None:
        dec = plan.decode
        tiers = {t.tier: t for t in plan.tiers}
        res["predicted"] = {
            "decode_tokens_per_s": dec.tokens_per_s if math.isfinite(dec.tokens_per_s) else None,
            "decode_step_s": dec.step_s, "bound": dec.bound, "disk_s": dec.disk_s, "cpu_s": dec.cpu_s,
            "host_mem_s": dec.host_mem_s, "prefill_step_s": plan.prefill.step_s,
            "disk_weights_bytes": tiers["disk"].weights_bytes if "disk" in tiers else 0,
            "cpu_weights_bytes": tiers["cpu"].weights_bytes if "cpu" in tiers else 0,
            "cpu_total_bytes": tiers["cpu"].total_bytes if "cpu" in tiers else None,
            "cpu_budget_bytes": tiers["cpu"].budget_bytes if "cpu" in tiers else None,
            "units_on_disk": sum(u.weight_tier == "disk" for u in plan.units), "n_units": len(plan.units),
            "hardware": plan.hardware, "weight_format": plan.weight_format,
            "workload": {"batch_size": plan.workload.batch_size, "prompt_len": plan.workload.prompt_len,
                         "gen_len": plan.workload.gen_len},
        }
        if res.get("decode_step_s") and dec.step_s:
            res["predicted"]["pred_over_measured_step"] = dec.step_s / res["decode_step_s"]
    return res


def child_llamacpp(spec: dict) -> dict:
    from llama_cpp import Llama

    phase("load")
    t0 = time.perf_counter()
    llm = Llama(model_path=spec["model"], n_ctx=len(spec["prompt_ids"]) + spec["tokens"] + 8,
                n_threads=spec.get("threads") or os.cpu_count(), verbose=False)
    load_s = time.perf_counter() - t0
    prompt = list(spec["prompt_ids"])

    def generate(n: int) -> list[int]:
        llm.reset()  # no reuse of the previous call's prompt in the KV cache
        out = []
        for tok in llm.generate(prompt, temp=0.0, reset=True):  # never stops by itself: EOS is ignored
            out.append(int(tok))
            if len(out) >= n:
                break
        return out

    res = measure(generate, spec["tokens"])
    res.update(load_s=load_s, n_threads=spec.get("threads") or os.cpu_count())
    return res


# ---------------------------------------------------------------------------------------------- memory cgroups

class CgroupUnavailable(Exception):
    pass


def _mounts() -> list[tuple[str, str, str]]:
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 4:
            out.append((parts[1], parts[2], parts[3]))
    return out


def _own_path(match) -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if match(controllers):
            return path
    raise CgroupUnavailable("this process is in no cgroup of that hierarchy (/proc/self/cgroup)")


class MemCgroup:
    """One memory cgroup below this process's own: created, limited, joined by a child (preexec_fn), read and
    removed. Cgroup v1 (memory controller) where mounted, else v2 with the memory controller."""

    counter = 0

    @staticmethod
    def locate() -> tuple[int, Path]:
        """(version, parent folder) for new memory cgroups, or raise CgroupUnavailable saying why."""
        try:
            mounts = _mounts()
            v1 = [m for m, fs, opts in mounts if fs == "cgroup" and "memory" in opts.split(",")]
            if v1:
                own = _own_path(lambda c: "memory" in c.split(","))
                return 1, Path(v1[0] + own)
            v2 = [m for m, fs, _ in mounts if fs == "cgroup2"]
            for mount in v2:
                controllers = (Path(mount) / "cgroup.controllers").read_text().split()
                if "memory" in controllers:
                    return 2, Path(mount + _own_path(lambda c: c == ""))
        except OSError as exc:
            raise CgroupUnavailable(f"cannot read the cgroup mounts: {exc}") from exc
        raise CgroupUnavailable("no cgroup v1 memory controller is mounted and no cgroup v2 hierarchy offers "
                                "the memory controller")

    @classmethod
    def probe(cls) -> str:
        """A short description of where cgroups go; raises CgroupUnavailable (not root, read-only, ...)."""
        cg = cls(None)
        cg.remove()
        return f"cgroup v{cg.version} under {cg.parent}"

    def __init__(self, limit_bytes: int | None):
        self.version, self.parent = self.locate()
        MemCgroup.counter += 1
        self.path = self.parent / f"offload-bench-{os.getpid()}-{MemCgroup.counter}"
        self.limit_bytes = limit_bytes
        try:
            self.path.mkdir()
        except OSError as exc:
            why = "" if os.geteuid() == 0 else " (not root)"
            raise CgroupUnavailable(f"cannot create {self.path}{why}: {exc.strerror or exc}") from exc
        try:
            if self.version == 2 and not (self.path / "memory.max").exists():
                try:
                    (self.parent / "cgroup.subtree_control").write_text("+memory")
                except OSError as exc:
                    raise CgroupUnavailable(f"cannot enable the memory controller below {self.parent} "
                                            f"(cgroup v2 forbids it where processes live): {exc}") from exc
            if limit_bytes is not None:
                self._limit(limit_bytes)
        except Exception:
            self.remove()
            raise

    def _limit(self, n: int) -> None:
        try:
            if self.version == 1:
                (self.path / "memory.limit_in_bytes").write_text(str(n))
                memsw = self.path / "memory.memsw.limit_in_bytes"
                if memsw.exists():  # no swapping around the limit
                    try:
                        memsw.write_text(str(n))
                    except OSError:
                        pass
            else:
                (self.path / "memory.max").write_text(str(n))
                swap = self.path / "memory.swap.max"
                if swap.exists():
                    try:
                        swap.write_text("0")
                    except OSError:
                        pass
        except OSError as exc:
            raise CgroupUnavailable(f"cannot set the memory limit of {self.path}: {exc}") from exc

    def join(self) -> None:
        """preexec_fn: move the child, between fork and exec, into this cgroup."""
        with open(self.path / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def _read(self, name: str) -> str | None:
        try:
            return (self.path / name).read_text()
        except OSError:
            return None

    def _keyed(self, name: str) -> dict:
        text = self._read(name) or ""
        return {k: int(v) for k, v in (line.split() for line in text.splitlines() if len(line.split()) == 2)}

    def stats(self) -> dict:
        if self.version == 1:
            peak, failcnt = self._read("memory.max_usage_in_bytes"), self._read("memory.failcnt")
            oom = self._keyed("memory.oom_control")
            return {"peak_bytes": int(peak) if peak else None, "failcnt": int(failcnt) if failcnt else None,
                    "oom_kill": oom.get("oom_kill"), "under_oom": oom.get("under_oom")}
        peak = self._read("memory.peak")
        events = self._keyed("memory.events")
        return {"peak_bytes": int(peak) if peak and peak.strip().isdigit() else None,
                "failcnt": events.get("max"), "oom_kill": events.get("oom_kill"), "under_oom": None}

    def remove(self) -> None:
        for _ in range(50):  # a child just reaped may linger in cgroup.procs for a moment
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        print(f"warning: could not remove {self.path}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------- the parent

def run_child(spec: dict, args, cgroup_limit: int | None = None, use_cgroup: bool = False) -> dict:
    """Run one child; its result dict with rc, wall time, the cgroup's figures and the OOM verdict added."""
    rundir = Path(tempfile.mkdtemp(prefix="bench-disk-", dir=args.tmp_dir))
    env = dict(os.environ, TMPDIR=str(rundir), PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    cg = MemCgroup(cgroup_limit) if use_cgroup else None
    proc = None
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=cg.join if cg else None, cwd=str(REPO))
        try:
            stdout, stderr = proc.communicate(timeout=args.timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            timed_out = True
        rc = proc.returncode
        stats = cg.stats() if cg else {}
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if cg:
            cg.remove()
        shutil.rmtree(rundir, ignore_errors=True)
    result = {}
    for line in stdout.splitlines():
        if line.startswith(MARK):
            result = json.loads(line[len(MARK):])
    result.update(tool=spec["tool"], rc=rc, wall_s=time.perf_counter() - t0, timed_out=timed_out)
    phases = [ln[len(PHASE_MARK):] for ln in stderr.splitlines() if ln.startswith(PHASE_MARK)]
    result["last_phase"] = phases[-1] if phases else None
    if cg:
        result["cgroup"] = {"version": cg.version, "limit_bytes": cgroup_limit, **stats}
    killed = rc == -signal.SIGKILL
    result["oom_killed"] = bool(cg and not timed_out and (stats.get("oom_kill") or (killed and stats.get(
        "oom_kill") is None)))
    if result["oom_killed"]:
        result["status"] = "OOM"
    elif timed_out:
        result["status"] = "timeout"
    elif rc != 0 or "error" in result or "decode_tokens_per_s" not in result and not spec["tool"].startswith(
            "baseline"):
        result["status"] = "failed"
        tail = [ln for ln in stderr.strip().splitlines() if ln.strip() and not ln.startswith(PHASE_MARK)]
        result.setdefault("error", (tail[-1] if tail else f"exit status {rc}")[:300])
        result["stderr_tail"] = "\n".join(tail[-15:])
    else:
        result["status"] = "ok"
    return result


def run_line(row: str, rep: int, r: dict) -> str:
    head = f"  [{row} #{rep + 1}] {r['tool']:<10}"
    cg = r.get("cgroup") or {}
    mem = f", cgroup peak {fmt_bytes(cg.get('peak_bytes'))}" if cg else ""
    if r["status"] != "ok":
        extra = f": {r.get('error', '')}" if r["status"] == "failed" else f" during {r.get('last_phase')}"
        return f"{head} {r['status']}{extra} (exit {r['rc']}{mem}, failcnt {cg.get('failcnt')})"
    line = (f"{head} {fmt_num(r.get('decode_tokens_per_s'))} tok/s decode (t1 {r['t1_s']:.2f} s, t{r['generated']} "
            f"{r['tn_s']:.2f} s), read {fmt_bytes(r.get('read_bytes_per_token'))}/token, "
            f"rchar {fmt_bytes(r.get('rchar_per_token'))}/token, peak RSS {fmt_bytes(r.get('peak_rss_bytes'))}{mem}")
    pred = r.get("predicted")
    if pred:
        line += (f"; plan {fmt_num(pred.get('decode_tokens_per_s'))} tok/s ({pred.get('bound')}-bound), "
                 f"{fmt_bytes(pred.get('disk_weights_bytes'))} on disk")
    if r.get("placed_bytes"):
        line += "; placed " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(r["placed_bytes"].items()))
    if r.get("warning"):
        line += f"; {r['warning']}"
    return line


def median_of(runs: list[dict], *keys):
    vals = []
    for r in runs:
        v = r
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            vals.append(v)
    return statistics.median(vals) if vals else None


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["status"] == "ok"]
    counts = {s: sum(r["status"] == s for r in runs) for s in ("ok", "OOM", "failed", "timeout")}
    return {
        "runs": len(runs), **{f"n_{k}": v for k, v in counts.items()},
        "decode_tokens_per_s": median_of(ok, "decode_tokens_per_s"),
        "decode_step_s": median_of(ok, "decode_step_s"),
        "e2e_tokens_per_s": median_of(ok, "e2e_tokens_per_s"),
        "read_bytes_per_token": median_of(ok, "read_bytes_per_token"),
        "rchar_per_token": median_of(ok, "rchar_per_token"),
        "peak_rss_bytes": median_of(ok, "peak_rss_bytes"),
        "cgroup_peak_bytes": median_of(runs, "cgroup", "peak_bytes"),
        "predicted_tokens_per_s": median_of(ok, "predicted", "decode_tokens_per_s"),
        "pred_over_measured_step": median_of(ok, "predicted", "pred_over_measured_step"),
        "predicted_disk_weights_bytes": median_of(ok, "predicted", "disk_weights_bytes"),
    }


def cell_tps(s: dict | None) -> str:
    if not s:
        return "-"
    tps = fmt_num(s["decode_tokens_per_s"]) if s["decode_tokens_per_s"] is not None else ""
    bad = [f"{s['n_' + k]}/{s['runs']} {k}" for k in ("OOM", "failed", "timeout") if s["n_" + k]]
    return " ".join(x for x in (tps, f"({', '.join(bad)})" if bad else "") if x) or "-"


def print_table(summary: dict, conditions: dict, with_llamacpp: bool) -> str:
    head = ["row", "conditions", "accelerate tok/s", "offload tok/s", "offload/accel", "offload pred tok/s",
            "pred/meas step", "offload plan on disk", "read/token accel", "read/token offload",
            "cgroup peak accel", "cgroup peak offload"]
    if with_llamacpp:
        head[4:4] = ["llama.cpp tok/s"]
    rows = []
    for row, tools in summary.items():
        a, o = tools.get("accelerate"), tools.get("offload")
        ratio = (o["decode_tokens_per_s"] / a["decode_tokens_per_s"]
                 if a and o and a["decode_tokens_per_s"] and o["decode_tokens_per_s"] else None)
        cells = [row, conditions[row], cell_tps(a), cell_tps(o), fmt_num(ratio, 2, "x"),
                 fmt_num(o and o["predicted_tokens_per_s"]), fmt_num(o and o["pred_over_measured_step"]),
                 fmt_bytes(o and o["predicted_disk_weights_bytes"]),
                 fmt_bytes(a and a["read_bytes_per_token"]), fmt_bytes(o and o["read_bytes_per_token"]),
                 fmt_bytes(a and a["cgroup_peak_bytes"]), fmt_bytes(o and o["cgroup_peak_bytes"])]
        if with_llamacpp:
            cells[4:4] = [cell_tps(tools.get("llamacpp"))]
        rows.append(cells)
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split(
                                     "Usage:")[-1])
    ap.add_argument("--model", help="Hugging Face model folder (config.json + safetensors) or a .gguf file")
    ap.add_argument("--budget", default="1200MiB", help="CPU memory for weights, both tools (default 1200MiB)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated by the measured generate (>= 2)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="fresh children per tool and row; medians reported")
    ap.add_argument("--rows", help="comma-separated, from: warm, bounded, roomy (default: all; with --smoke, roomy "
                    "where cgroups can be made, else warm)")
    ap.add_argument("--cgroup-slack", default="0", help="bytes added to the bounded row's cgroup limit")
    ap.add_argument("--baseline", choices=("cgroup", "rss"), default="cgroup", help="the bounded row's baseline: "
                    "the import-only child's cgroup peak (what the limit counts; default) or its RSS (which also "
                    "counts shared library pages the cgroup is not charged for)")
    ap.add_argument("--disk-memory", default="20GiB", help="offload's disk budget (disk_memory)")
    ap.add_argument("--offload-host-baseline", default="auto", help="offload's host_baseline: auto (default: "
                    "offload counts its own process against the budget, as a user's run does) or bytes, e.g. 0")
    ap.add_argument("--tmp-dir", default=tempfile.gettempdir(), help="where each child's temp folder goes "
                    "(accelerate's offload_folder, offload's spill files); must be on disk, not tmpfs")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    ap.add_argument("--threads", type=int, default=0, help="compute threads for every tool (torch.set_num_threads, "
                    "llama.cpp n_threads); default 0: torch's default and os.cpu_count() for llama.cpp. offload's "
                    "thread governor may still step down to half of them")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds a child may run before it is killed")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model made here, one row once, a few "
                    "tokens: checks the script runs (about 10 s a child)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def prompt_ids(model: Path, n: int, seed: int) -> tuple[list[int], int | None]:
    import random

    vocab = None
    if model.is_dir():
        try:
            cfg = json.loads((model / "config.json").read_text())
            vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
        except (OSError, ValueError):
            pass
    hi = min(vocab or 1000, 32000)  # a GGUF file: ids below 1000 exist in every vocabulary
    rng = random.Random(seed)
    return [rng.randrange(min(10, hi - 1), hi) for _ in range(n)], vocab


def bounded_limits(args, tools: list[str], budget: int, slack: int, results: dict) -> dict | None:
    """The bounded row's cgroup limit per tool: budget + the tool's import baseline (measured by a child) + slack;
    None (the row skipped, saying why) where a baseline child fails."""
    print("bounded: measuring each tool's import baseline")
    baselines, limits = {}, {}
    for tool in tools:
        r = run_child({"tool": f"baseline:{tool}"}, args, cgroup_limit=None, use_cgroup=True)
        if r["status"] != "ok":
            print(f"bounded row skipped: the {tool} baseline child failed: {r.get('error')}")
            results["skipped"]["bounded"] = f"{tool} baseline child failed: {r.get('error')}"
            return None
        cg_peak = (r.get("cgroup") or {}).get("peak_bytes")
        base = cg_peak if args.baseline == "cgroup" and cg_peak else r.get("rss_bytes") or 0
        baselines[tool] = {"rss_bytes": r.get("rss_bytes"), "cgroup_peak_bytes": cg_peak, "baseline_bytes": base}
        limits[tool] = budget + base + slack
        print(f"  {tool}: after imports RSS {fmt_bytes(r.get('rss_bytes'))}, cgroup peak {fmt_bytes(cg_peak)} -> "
              f"limit {fmt_bytes(limits[tool])} (budget + {args.baseline} baseline{' + slack' if slack else ''})")
    results.setdefault("baselines", baselines)
    return limits


def smoke_row() -> str:
    try:
        MemCgroup.probe()
        return "roomy"
    except CgroupUnavailable as exc:
        print(f"smoke: the warm row, as cgroups are unavailable: {exc}")
        return "warm"


def smoke(args) -> int:
    """--smoke: a tiny random model in a temporary folder, one row (args.rows, or roomy where cgroups can be
    made, else warm) once, 3 tokens after a 4-id prompt."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_llama

    with tempfile.TemporaryDirectory(prefix="bench-disk-smoke-") as tmp:
        model = make_llama.tiny(Path(tmp) / "tiny")  # ~0.3 MB: every tool holds it in RAM (the rows' code runs)
        argv = ["--model", str(model), "--budget", "768MiB", "--tokens", "3", "--prompt-len", "4", "--repeats", "1",
                "--rows", args.rows or smoke_row(), "--timeout", "300", "--tmp-dir", tmp]
        return main(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))
    if args.smoke:
        return smoke(args)
    from offload.errors import ConfigError
    from offload.hardware import parse_size

    if not args.model:
        return fail("--model is required (a Hugging Face model folder or a .gguf file), or --smoke")
    model = Path(args.model).expanduser().resolve()
    if not model.exists():
        return fail(f"--model {args.model}: no such folder or file")
    if model.is_dir():
        if not (model / "config.json").is_file():
            return fail(f"--model {args.model}: the folder has no config.json (a Hugging Face model folder is needed)")
        if not model_files(model):
            return fail(f"--model {args.model}: the folder has no .safetensors files")
    elif model.suffix != ".gguf":
        return fail(f"--model {args.model}: expected a model folder or a .gguf file")
    try:
        budget = parse_size(args.budget, "--budget")
        slack = parse_size(args.cgroup_slack, "--cgroup-slack")
        parse_size(args.disk_memory, "--disk-memory")
    except ConfigError as exc:
        return fail(str(exc))
    if budget <= 0:
        return fail(f"--budget must be more than 0, got {args.budget!r}")
    if args.tokens < 2:
        return fail(f"--tokens must be 2 or more (the decode rate is (N-1)/(t_N - t_1)), got {args.tokens}")
    if args.prompt_len < 1 or args.repeats < 1 or args.threads < 0:
        return fail("--prompt-len and --repeats must be 1 or more, --threads 0 or more")
    rows = [r.strip() for r in (args.rows or ",".join(ROWS)).split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        return fail(f"--rows: unknown row(s) {', '.join(bad) or '(none)'}; use a comma-separated list of "
                    f"{', '.join(ROWS)}")
    if args.offload_host_baseline != "auto":
        try:
            args.offload_host_baseline = str(parse_size(args.offload_host_baseline, "--offload-host-baseline"))
        except ConfigError as exc:
            return fail(str(exc))
    if not Path(args.tmp_dir).is_dir():
        return fail(f"--tmp-dir {args.tmp_dir}: no such folder")

    files = model_files(model)
    model_bytes = sum(f.stat().st_size for f in files)
    ids, vocab = prompt_ids(model, args.prompt_len, args.seed)
    base_spec = {"model": str(model), "budget_bytes": budget, "tokens": args.tokens, "prompt_ids": ids,
                 "disk_memory": args.disk_memory, "offload_host_baseline": args.offload_host_baseline,
                 "threads": args.threads}
    tools = list(TOOLS)
    llamacpp_reason = None
    if model.suffix != ".gguf":
        llamacpp_reason = "skipped: the model is not a .gguf file"
    else:
        try:
            import importlib.util

            if importlib.util.find_spec("llama_cpp") is None:
                llamacpp_reason = "skipped: llama-cpp-python is not importable"
        except (ImportError, ValueError) as exc:
            llamacpp_reason = f"skipped: llama-cpp-python is not importable ({exc})"
    try:
        cgroup_where = MemCgroup.probe()
        cgroup_reason = None
    except CgroupUnavailable as exc:
        cgroup_where, cgroup_reason = None, str(exc)

    print(f"model {model} ({fmt_bytes(model_bytes)} in {len(files)} file(s), vocab {vocab or '?'}); budget "
          f"{fmt_bytes(budget)} = {budget / model_bytes:.0%} of the weights; batch 1, prompt {args.prompt_len} "
          f"ids, {args.tokens} tokens, greedy; {os.cpu_count()} CPUs; {args.repeats} repeat(s)")
    print(f"llama.cpp: {llamacpp_reason or 'runs in the warm row (default mmap)'}")
    print(f"cgroups: {cgroup_where or 'unavailable: ' + cgroup_reason}")

    results: dict = {"args": vars(args) | {"model": str(model)}, "model_bytes": model_bytes, "budget_bytes": budget,
                     "prompt_ids": ids, "rows": {}, "skipped": {}}
    if llamacpp_reason:
        results["skipped"]["llamacpp"] = llamacpp_reason
    summary, conditions = {}, {}
    for row in rows:
        row_tools = tools + (["llamacpp"] if row == "warm" and not llamacpp_reason else [])
        if row != "warm" and cgroup_reason:
            print(f"{row} row skipped: {cgroup_reason}")
            results["skipped"][row] = cgroup_reason
            continue
        if row == "bounded":
            limits = bounded_limits(args, tools, budget, slack, results)
            if limits is None:
                continue
            conditions[row] = (f"cgroup v{MemCgroup.locate()[0]}, limit budget+baseline"
                               f"{'+slack' if slack else ''} (" + ", ".join(
                                   f"{t[:3]} {fmt_bytes(v)}" for t, v in limits.items()) + "), cold cache")
        elif row == "roomy":
            limits = {tool: ROOMY_FACTOR * budget for tool in tools}
            conditions[row] = (f"cgroup v{MemCgroup.locate()[0]}, limit {ROOMY_FACTOR} x budget "
                               f"({fmt_bytes(ROOMY_FACTOR * budget)}), cold cache")
        else:
            limits = {}
            conditions[row] = "no limit, page cache warm"
        print(f"{row}: {conditions[row]}")
        runs = {t: [] for t in row_tools}
        for rep in range(args.repeats):
            for tool in row_tools:
                if row == "warm":
                    warm_cache(files)
                else:
                    drop_cache(files)
                r = run_child(base_spec | {"tool": tool}, args, cgroup_limit=limits.get(tool),
                              use_cgroup=cgroup_reason is None)
                r["repeat"] = rep
                runs[tool].append(r)
                print(run_line(row, rep, r), flush=True)
                if r["status"] == "failed" and r.get("stderr_tail"):
                    print("    " + r["stderr_tail"].replace("\n", "\n    "), file=sys.stderr)
        summary[row] = {t: summarize(rs) for t, rs in runs.items()}
        results["rows"][row] = {"conditions": conditions[row], "limits_bytes": limits, "runs": runs,
                                "median": summary[row]}
        same = [r["output_ids"] for rs in runs.values() for r in rs if r.get("output_ids")]
        if len(same) > 1:
            agree = all(s == same[0] for s in same)
            results["rows"][row]["outputs_agree"] = agree
            if not agree:
                print(f"  note: the tools' greedy outputs differ in the {row} row (bf16 rounding differs "
                      f"between implementations)")
    print()
    table = print_table(summary, conditions, "llamacpp" in {t for s in summary.values() for t in s})
    print(table)
    print("tok/s: decode rate (N-1)/(t_N - t_1), median over repeats; read/token: block-device bytes "
          "(/proc/self/io read_bytes) during the N-token generate / N; pred/meas step: offload's planned decode "
          "step time / measured")
    results["table"] = table
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
