"""Speculative decoding's speed in RAM: prompt lookup on a rewrite task, against no speculation and against
llama.cpp's own prompt lookup.

The task: 10 chat prompts, each quoting a paragraph with a few misspellings and asking for it back corrected
(the answer repeats most of the prompt, which prompt lookup proposes). Greedy, --max-tokens new tokens, one
request at a time (batch 1, where speculation pays), on --model as stored (default: the default model's GGUF).

- offload: LLM(model) and LLM(model, speculative_config={"method": "ngram"}) (k chosen as the run goes), in
  alternating rounds; the median tokens/s of each over --rounds, the ratio, the acceptance rate and tokens per
  pass; the answers compared: identical, or where one parts, the top-2 logit gap there under the plain run (a
  (k+1)-token pass runs other kernel paths than a 1-token step on quantized weights, and sums in another order:
  a near-tie, gap < 0.05, may part; a larger gap would be a bug and is printed).
- --against-llamacpp: the same token ids through llama-cpp-python's Llama (in a subprocess: 2 threads, its AMX
  and repacking buffers off on an AMX CPU, where they crash; OMP_WAIT_POLICY=PASSIVE) with and without its
  LlamaPromptLookupDecoding (its defaults: max_ngram_size 2, num_pred_tokens 10), alternating with offload's two
  runs; prints each one's tokens/s and offload-with-lookup / llama.cpp-with-lookup.

- --disk: where the weights are far. The target is the default model's fp32 copy (the float reference the tests
  write: its GGUF dequantized by transformers), on the disk tier: cpu_memory --budget (the whole process, the
  draft included: it is planned first and the model gets the rest) leaves most of it on disk; the draft is
  `method: self` at q4_0 (the same weights, quantized, in RAM), or with --method substitute the q4_0 copies drafting over
  the model's own KV cache. Each run is a child process in a memory cgroup
  (scripts/bench_disk.py's; one limit for both runs: the larger budget + --cgroup-slack for the page cache and
  activations), the model's
  files dropped from the page cache before it, so every pass reads what is on disk; --disk-prompts chat prompts,
  --disk-tokens greedy tokens each, one at a time; without and with speculation alternating over --rounds.

- --drafts: the two drafts of the model's own weights (in the format the planner chooses, q4_0 or q8_0, unless
  --draft-quantization sets one; the table names it), on the default model's fp32 copy in RAM (--dtype
  bf16: made bf16, weights and compute; CPU backend, batch 1): `method: self` (a draft with its own KV cache: it
  prefills each prompt itself) and `method: substitute` (drafting over the model's own KV cache: no draft cache, no
  draft prefill), against no speculation, in alternating rounds on --prompts open-ended chat prompts (default 6) x
  --max-tokens greedy tokens (default 64);
  each one's median tokens/s, the ratio, acceptance, tokens per pass, the share of decode steps that carried
  proposals (with k chosen as the run goes, offload may stop drafting), drafting's share of the time, the answers
  against the plain run's (greedy on float weights: identical, or printed where they part), and the seconds of a
  prompt's first drafting (self's draft prefills the prompt there) against its later ones.

  python scripts/bench_spec.py [--rounds 3] [--max-tokens 128] [--against-llamacpp]
  python scripts/bench_spec.py --disk [--method substitute] [--budget 256MiB] [--disk-prompts 10] [--disk-tokens 64]
  python scripts/bench_spec.py --drafts [--rounds 3] [--prompts 6] [--max-tokens 64] [--k 4] [--dtype bf16]
  python scripts/bench_spec.py --smoke [--drafts]    # a tiny random model, 2 prompts, 8 tokens, one round
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIE = 0.05  # top-2 logit gap below which a parting is a near-tie (issue 35)
ASK = "Correct the spelling mistakes in this paragraph and write it back in full:\n\n{}"
PARAGRAPHS = [
    "The old lighthouse stood at the edge of the cliff for more then a hundred years. Every night its keeper climbed "
    "the narow stairs to light the lamp, and every morning he wrote the weather in a small leather book.",
    "Bread is made from flour, water, salt and yeast. The dough is kneeded until it is smooth, left to rise in a "
    "warm place, shaped into loafs and baked in a hot oven until the crust is golden and crisp.",
    "Honey bees live in colonys of many thousands. The worker bees gather nectar from flowers and bring it back to "
    "the hive, where it is turned into honey and stored in wax cells for the long winter.",
    "The train left the station at seven o'clock and traveled north through feilds and small villages. By noon it "
    "had reached the mountains, where the track climbed slowly through tunnels and over high bridges.",
    "Chess is played on a board of sixty-four squares. Each player begins with sixteen peices, and the aim of the "
    "game is to trap the other player's king so that it can not escape capture.",
    "Rain falls when water droplets in a cloud grow to heavy to stay in the air. In warm regions it can fall for "
    "hours at a time, filling rivers and lakes and giving life to forests and farms alike.",
    "The desert is hot during the day and surprisingly cold at night. Few plants grow there, but those that do "
    "have long roots to reach water deep under the sand, and thick leafs that store it for weeks.",
    "Coffee beans are the seeds of a small red fruit. After they are picked, the beans are dried, roasted and "
    "ground, and hot water is poured over them to make the drink that so many people enjoy each morning.",
    "Volcanoes form where melted rock rises from deep inside the earth. When the preasure becomes too great, the "
    "rock bursts out as lava, ash and gas, and over many years it builds mountains that can reach the clouds.",
    "A small robot rolled accross the kitchen floor, looking for crumbs. It bumped gently into the table legs, "
    "turned around, and went back the way it came, humming a quiet tune to itself as it worked.",
]

QUESTIONS = ["Why is the sky blue?", "Write a short story about a fox who learns to sail.",
             "What should I pack for a week of hiking in the mountains?", "Explain how a refrigerator keeps food cold.",
             "Give me some ideas for a rainy Sunday afternoon.", "How do plants make their own food?",
             "What makes a good friend?", "Describe your ideal breakfast.",
             "How does a bicycle stay upright when it moves?", "Tell me about the history of the printing press."]


def chats(n: int, open_ended: bool = False) -> list[list[dict]]:
    return [[{"role": "user", "content": q if open_ended else ASK.format(q)}]
            for q in (QUESTIONS if open_ended else PARAGRAPHS)[:n]]


class OffloadPair:
    """offload's plain and speculative LLMs on one model, and the prompts as token ids."""

    def __init__(self, model: str, args):
        from offload import LLM, SamplingParams

        self.plain = LLM(model, max_model_len=2048)
        self.spec = LLM(model, max_model_len=2048, speculative_config={"method": "ngram"})
        self.prompts = [self.plain.apply_chat_template(c) for c in chats(args.prompts)]
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        for llm in (self.plain, self.spec):  # warm-up: kernels, caches
            llm.generate({"prompt_token_ids": self.prompts[0]}, SamplingParams(max_tokens=4, temperature=0.0))
        self.answers: dict[str, list[list[int]]] = {}

    def rate(self, name: str) -> float:
        """Tokens/s of one pass over the prompts, one request at a time."""
        llm = self.plain if name == "plain" else self.spec
        start, outs = time.perf_counter(), []
        for ids in self.prompts:
            outs += llm.generate({"prompt_token_ids": ids}, self.params)
        seconds = time.perf_counter() - start
        self.answers[name] = [o.token_ids for o in outs]
        return sum(len(o.token_ids) for o in outs) / seconds


def compare(llm, prompts: list[list[int]], want: list[list[int]], got: list[list[int]]) -> dict:
    """Identical answers, and for each that parts the top-2 logit gap at its first differing token (plain run)."""
    from offload import SamplingParams

    out = {"identical": 0, "near_tie": 0, "other": []}
    for prompt, a, b in zip(prompts, want, got):
        if a == b:
            out["identical"] += 1
            continue
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        row = llm.generate({"prompt_token_ids": prompt + a[:at]},
                           SamplingParams(max_tokens=1, temperature=0.0, logprobs=2))[0].outputs[0].logprobs[0]
        gap = row.top[0][1] - row.top[1][1]  # logprobs differ from logits by one constant per row
        if gap < TIE:
            out["near_tie"] += 1
        else:
            out["other"].append({"at": at, "gap": gap})
    return out


LLAMACPP_WORKER = r"""
import json, sys, time
import llama_cpp.llama_cpp as c
default = c.llama_model_default_params
def params():
    p = default(); p.use_extra_bufts = False; return p
if "amx_int8" in open("/proc/cpuinfo").read():
    c.llama_model_default_params = params  # its AMX and repacking buffers off (they crash on an AMX CPU)
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
job = json.loads(sys.argv[1])
llm = Llama(model_path=job["model"], n_ctx=2048, n_threads=job["threads"], n_threads_batch=job["threads"],
            verbose=False, draft_model=LlamaPromptLookupDecoding() if job["lookup"] else None)
llm.create_completion(prompt=job["prompts"][0], max_tokens=4, temperature=0.0)  # warm-up
start, n = time.perf_counter(), 0
for ids in job["prompts"]:
    out = llm.create_completion(prompt=ids, max_tokens=job["max_tokens"], temperature=0.0, top_k=1)
    n += out["usage"]["completion_tokens"]
print(json.dumps({"tokens": n, "seconds": time.perf_counter() - start}))
"""


def llamacpp_rate(gguf: str, prompts: list[list[int]], args, lookup: bool) -> float:
    job = {"model": gguf, "prompts": prompts, "max_tokens": args.max_tokens, "threads": os.cpu_count() or 1,
           "lookup": lookup}
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run([sys.executable, "-c", LLAMACPP_WORKER, json.dumps(job)], capture_output=True, text=True,
                          env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"llama-cpp-python failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["tokens"] / result["seconds"]


def disk_child(job: dict) -> dict:
    """One run on the disk tier (in its cgroup): tokens/s over the prompts, the stats, the answers."""
    from offload import LLM, SamplingParams

    spec = {"method": job["method"], "quantization": job["draft"], "num_speculative_tokens": job.get("k")} \
        if job["speculate"] else None
    llm = LLM(job["model"], quantization="none", dtype="fp32", cpu_memory=job["budget"], gpu_memory=0, disk_memory="4GiB",
              backend="cpu", batch_size=1, max_model_len=1024, speculative_config=spec)
    if job["speculate"] and llm.speculative_stats is None:  # priced at load as not paying (offload/api.py)
        raise SystemExit(f"no speculative run to measure: {llm.draft_price.verdict(kept=False)}")
    on_disk = sum(u.weight_tier == "disk" for u in llm.plan.units) if llm.plan is not None else None
    llm.generate({"prompt_token_ids": job["prompts"][0]}, SamplingParams(max_tokens=2, temperature=0.0))
    params = SamplingParams(max_tokens=job["tokens"], temperature=0.0)
    start, outs = time.perf_counter(), []
    for ids in job["prompts"]:
        outs += llm.generate({"prompt_token_ids": ids}, params)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds, "answers": [o.token_ids for o in outs],
            "stats": llm.speculative_stats, "units_on_disk": on_disk, "units": len(llm.plan.units),
            "draft_cpu_bytes": llm.draft_bytes["cpu"], "model_cpu_bytes": llm.plan.budget.process_cpu_bytes}


def disk_rows(args) -> None:
    sys.path.insert(0, str(HERE))
    from bench_disk import MemCgroup, drop_cache
    from lm_eval_compare import write_fp32

    from offload.paths import cache_dir
    from offload.units import format_bytes, parse_size

    folder = write_fp32(cache_dir() / "lm-eval-fp32")
    from offload.weights.model_files import load_tokenizer
    from offload.weights.prompts import encode_chat

    tokenizer = load_tokenizer(folder)
    prompts = [encode_chat(tokenizer, folder, c, True) for c in chats(args.disk_prompts)]
    budget, room = parse_size(args.budget), parse_size(args.cgroup_slack)
    draft = args.draft_quantization or "q4_0"  # the disk rows' draft format unless set
    files = sorted(folder.glob("*.safetensors"))
    rates, runs = {False: [], True: []}, {}
    limit = max(budget, parse_size(args.spec_budget) if args.spec_budget else 0) + room
    for _ in range(args.rounds):
        for speculate in (False, True):
            drop_cache(files)
            mine = parse_size(args.spec_budget) if speculate and args.spec_budget else budget
            job = {"model": str(folder), "budget": mine, "tokens": args.disk_tokens, "prompts": prompts,
                   "speculate": speculate, "method": args.method, "draft": draft, "k": args.k}
            cgroup = MemCgroup(limit)  # one limit for both runs: the same room for the page cache
            try:
                done = subprocess.run([sys.executable, __file__, "--disk-child", json.dumps(job)], capture_output=True,
                                      text=True, timeout=3600, preexec_fn=cgroup.join)
            finally:
                peak = cgroup.stats()["peak_bytes"]
                cgroup.remove()
            if done.returncode != 0:
                raise SystemExit(f"a disk run failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
            runs[speculate] = json.loads(done.stdout.strip().splitlines()[-1]) | {"peak": peak}
            rates[speculate].append(runs[speculate]["tokens_per_s"])
    plain, spec = (statistics.median(rates[s]) for s in (False, True))
    same = sum(a == b for a, b in zip(runs[False]["answers"], runs[True]["answers"]))
    stats = runs[True]["stats"]
    print(f"{folder.name} (fp32; units on disk: {runs[False]['units_on_disk']} of {runs[False]['units']} without a "
          f"draft, {runs[True]['units_on_disk']} with one); cpu_memory {format_bytes(budget)} without, "
          f"{format_bytes(runs[True]['model_cpu_bytes'] + runs[True]['draft_cpu_bytes'])} with the draft (the model "
          f"{format_bytes(runs[True]['model_cpu_bytes'])}, the draft {format_bytes(runs[True]['draft_cpu_bytes'])}); "
          f"cgroup limit {format_bytes(limit)} for both (peaks {format_bytes(runs[False]['peak'])} / "
          f"{format_bytes(runs[True]['peak'])}); {args.disk_prompts} chat prompts x {args.disk_tokens} greedy tokens, "
          f"one at a time; median of {args.rounds} runs each, alternating")
    print(f"without speculation: {plain:.2f} tok/s; with method {args.method} ({draft} "
          f"draft in RAM): {spec:.2f} tok/s "
          f"({spec / plain:.2f}x); acceptance {stats['acceptance_rate']:.2f}, {stats['tokens_per_pass']:.2f} tokens "
          f"per pass that carried proposals, drafting {stats['draft_s']:.1f} s; a tree's second candidates "
          f"{stats.get('branch_tokens', 0)} carried, "
          f"{stats.get('branches_kept', 0)} kept of {stats.get('branches', 0)} checked; answers identical {same} of "
          f"{len(prompts)}")


def draft_rows(model: str, args) -> None:
    """--drafts: no speculation, method self and method substitute on model (fp32, in RAM), alternating; --trees:
    method substitute's chains (max_branches 0) against its trees."""
    from offload import LLM, SamplingParams

    load = os.getloadavg()[0]
    configs = {"plain": None}
    for name in (("chains", "trees") if args.trees else ("self", "substitute")):
        method = "substitute" if args.trees else name
        configs[name] = {"method": method, "num_speculative_tokens": args.k, "quantization": args.draft_quantization,
                         **({"max_branches": 0} if name == "chains" else {})}
    names = tuple(configs)
    llms = {n: LLM(model, quantization="none", dtype=args.dtype, backend="cpu", gpu_memory=0, batch_size=1,
                   max_model_len=1024, speculative_config=c) for n, c in configs.items()}
    prompts = [llms["plain"].apply_chat_template(c) for c in chats(args.prompts, open_ended=True)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for llm in llms.values():  # warm-up: kernels, caches
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=4, temperature=0.0))
    rates, drafts = {n: [] for n in names}, {n: ([], []) for n in names}  # (first, later) draftings' seconds
    for name in names[1:]:  # each prompt's draftings timed: its first (self's draft prefills there) and the rest
        spec, seen = llms[name].generator.speculator, {}  # by id: the sequences, kept (their ids not reused)

        def timed(asks, *more, seen=seen, propose=spec.propose_many, out=drafts[name]):
            start, proposals = time.perf_counter(), propose(asks, *more)
            if not asks:  # no room left for proposals
                return proposals
            out[id(asks[0][2]) in seen].append(time.perf_counter() - start)
            seen[id(asks[0][2])] = asks[0][2]
            return proposals
        spec.propose_many = timed
    draft_s, timed_s, answers = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0), {}
    for _ in range(args.rounds):  # alternating: this machine's speed drifts over minutes
        for name, llm in llms.items():
            before = (llm.speculative_stats or {}).get("draft_s", 0.0)
            start, outs = time.perf_counter(), []
            for ids in prompts:
                outs += llm.generate({"prompt_token_ids": ids}, params)
            took = time.perf_counter() - start
            rates[name].append(sum(len(o.token_ids) for o in outs) / took)
            draft_s[name] += (llm.speculative_stats or {}).get("draft_s", 0.0) - before
            timed_s[name], answers[name] = timed_s[name] + took, [o.token_ids for o in outs]
    med = {n: statistics.median(r) for n, r in rates.items()}
    print(f"{model} ({args.dtype} in RAM, CPU backend, batch 1): {args.prompts} open-ended chat prompts, greedy, "
          f"{args.max_tokens} new tokens, one at a time, k {args.k or 'chosen as the run goes'}; median of "
          f"{args.rounds} rounds, alternating (load average {load:.1f} before, {os.getloadavg()[0]:.1f} after; "
          f"{os.cpu_count()} CPUs)")
    print(f"{'method, draft':<16} {'tok/s':>7} {'vs plain':>8} {'accept':>7} {'tok/pass':>8} {'drafted':>7} "
          f"{'draft %':>7} {'1st / later drafting':>20}  answers vs plain")
    for name in names:
        stats = llms[name].speculative_stats
        same = "-"
        if name != "plain":
            p = compare(llms["plain"], prompts, answers["plain"], answers[name])
            same = (f"identical {p['identical']}/{len(prompts)}, near-tie {p['near_tie']}, larger gap "
                    f"{len(p['other'])}" + "".join(f"; parts at token {o['at']} (gap {o['gap']:.3f})"
                                                   for o in p["other"]))
        if stats and stats["branches"]:
            print(f"  {name}: second candidates checked {stats['branches']}, kept {stats['branches_kept']}")
        spec = (f"{stats['acceptance_rate']:>7.2f} {stats['tokens_per_pass']:>8.2f} "  # drafted: decode steps with
                f"{100 * stats['verified_passes'] / max(stats['decode_steps'], 1):>6.0f}% "  # proposals (k > 0)
                f"{100 * draft_s[name] / timed_s[name]:>6.1f}%" if stats else f"{'-':>7} {'-':>8} {'-':>7} {'-':>7}")
        first, later = (f"{statistics.median(d):.3f}" if d else "-" for d in drafts[name])
        label = name if name == "plain" else f"{name} {llms[name].speculative.draft_quantization}"
        print(f"{label:<16} {med[name]:>7.2f} {med[name] / med['plain']:>7.2f}x {spec} {first:>9} / {later:<6} s  "
              f"{same}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="a model offload loads (default: the default model's GGUF)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, help="default 128 (--drafts: 64)")
    ap.add_argument("--prompts", type=int, help=f"how many (at most {len(PARAGRAPHS)}; default all, --drafts: 6)")
    ap.add_argument("--against-llamacpp", action="store_true",
                    help="also llama-cpp-python with and without its prompt lookup, on the same GGUF file")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, 2 prompts, 8 tokens, one round")
    ap.add_argument("--disk", action="store_true", help="the fp32 copy on the disk tier, a self-draft at q4_0")
    ap.add_argument("--drafts", action="store_true", help="the fp32 copy in RAM: methods self and substitute")
    ap.add_argument("--trees", action="store_true", help="--drafts: method substitute's chains against its trees")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="--drafts: the model's weights and compute (the fp32 copy read as it is, or made bf16)")
    ap.add_argument("--k", type=int, help="--drafts and --disk: num_speculative_tokens (default: chosen as the run "
                    "goes)")
    ap.add_argument("--draft-quantization", choices=("q4_0", "q8_0"),
                    help="the drafts' format (default: --drafts the planner's choice, --disk q4_0)")
    ap.add_argument("--method", choices=("self", "substitute"), default="self",
                    help="--disk: the draft (self: a copy with its own KV cache; substitute: copies over the "
                    "model's own KV cache; q4_0 unless --draft-quantization)")
    ap.add_argument("--budget", default="640MiB", help="--disk: cpu_memory (the whole process, the draft included)")
    ap.add_argument("--cgroup-slack", default="512MiB", help="--disk: the cgroup's room beyond --budget")
    ap.add_argument("--spec-budget", help="--disk: cpu_memory of the speculative run (default --budget); more gives "
                                          "the draft room of its own, so that the model keeps as much in RAM as "
                                          "without it")
    ap.add_argument("--disk-prompts", type=int, default=10)
    ap.add_argument("--disk-tokens", type=int, default=64)
    ap.add_argument("--disk-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.max_tokens = args.max_tokens or (64 if args.drafts else 128)
    args.prompts = args.prompts or (6 if args.drafts else len(PARAGRAPHS))
    return args


def lookup_rows(model: str, args) -> None:
    """The default mode: prompt lookup against no speculation (and llama.cpp's, with --against-llamacpp)."""
    load = os.getloadavg()[0]
    pair = OffloadPair(model, args)
    gguf = None
    if args.against_llamacpp:
        from offload.weights.default_model import resolve_model

        gguf = str(resolve_model(model))
        if not gguf.endswith(".gguf"):
            raise SystemExit(f"--against-llamacpp needs a GGUF file; {gguf} is not one")
    rates = {"plain": [], "lookup": [], "llama.cpp": [], "llama.cpp lookup": []}
    for _ in range(args.rounds):  # alternating: this machine's speed drifts over minutes
        rates["plain"].append(pair.rate("plain"))
        rates["lookup"].append(pair.rate("lookup"))
        if gguf is not None:
            rates["llama.cpp"].append(llamacpp_rate(gguf, pair.prompts, args, False))
            rates["llama.cpp lookup"].append(llamacpp_rate(gguf, pair.prompts, args, True))
    med = {name: statistics.median(r) for name, r in rates.items() if r}
    stats = pair.spec.speculative_stats
    partings = compare(pair.plain, pair.prompts, pair.answers["plain"], pair.answers["lookup"])
    print(f"{model}: {args.prompts} rewrite prompts, greedy, {args.max_tokens} new tokens, one at a time; median "
          f"of {args.rounds} rounds, alternating (load average {load:.1f} before, {os.getloadavg()[0]:.1f} after)")
    print(f"offload without speculation: {med['plain']:.1f} tok/s; with prompt lookup: {med['lookup']:.1f} tok/s "
          f"({med['lookup'] / med['plain']:.2f}x); acceptance {stats['acceptance_rate']:.2f}, "
          f"{stats['tokens_per_pass']:.2f} tokens per pass that carried proposals")
    print(f"answers: identical {partings['identical']}, parting at a near-tie (top-2 gap < {TIE}) "
          f"{partings['near_tie']}, parting at a larger gap {len(partings['other'])}"
          + "".join(f"\n  parts at token {p['at']} (gap {p['gap']:.3f})" for p in partings["other"]))
    if gguf is not None:
        sys.path.insert(0, str(HERE))
        from bench_cpu_decode import amx_cpu

        buffers = "AMX and repacking buffers off" if amx_cpu() else "its weight repacking on"
        print(f"llama.cpp (llama-cpp-python, {os.cpu_count()} threads, {buffers}): without "
              f"{med['llama.cpp']:.1f} tok/s, with LlamaPromptLookupDecoding {med['llama.cpp lookup']:.1f} tok/s "
              f"({med['llama.cpp lookup'] / med['llama.cpp']:.2f}x)")
        print(f"offload with prompt lookup / llama.cpp with prompt lookup: "
              f"{med['lookup'] / med['llama.cpp lookup']:.2f}x")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.disk_child:
        print(json.dumps(disk_child(json.loads(args.disk_child))))
        return 0
    if args.disk:
        disk_rows(args)
        return 0
    model = args.model
    if args.smoke:
        sys.path.insert(0, str(HERE))
        from make_llama import tiny

        args.rounds, args.max_tokens, args.prompts, args.against_llamacpp = 1, 8, 2, False
        model = str(tiny(Path(tempfile.mkdtemp(prefix="bench-spec-")) / "tiny", vocab=259, tokenizer=True))
    if args.drafts:
        if not args.smoke:
            sys.path.insert(0, str(HERE))
            from lm_eval_compare import write_fp32

            from offload.paths import cache_dir

            model = str(write_fp32(cache_dir() / "lm-eval-fp32"))
        draft_rows(model, args)
        return 0
    lookup_rows(model, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
