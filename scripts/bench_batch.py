"""Throughput of the scheduler on 64 prompts of mixed lengths: the schedule offload had before against mixed steps.

Both run in the same process on the same model, prompts and batch size (sequences in flight), greedy:
- before: a step is all prompt chunks or all decode tokens, prompts first (running sequences wait while a new
  one is prefilled), at most --batch sequences in flight (the KV cache offload had before: --batch slots of
  the longest request);
- mixed: each step carries the running sequences' decode tokens plus prompt chunks up to the step's token
  budget (one pass over the weights serves both), KV slots handed out by need from a pool of at most that
  many slots, so more short sequences are in flight at once (up to --n-prompts).
Both use the pool (sized by need), so the KV figures are what each run allocated.
Prints tokens/s (generated, and prompt + generated), the KV cache each allocated, how many sequences were in
flight at most, the number of passes over the weights, the ratio mixed / before, and how many greedy outputs are
identical (where one parts, the token it parts at and the two top logits' gap there: the q4_0 kernels sum in
another order at another token count, ~5e-7 apart, which a near-tie can turn). Medians of --repeats runs, the two schedules alternating.

Usage: python scripts/bench_batch.py [--model default] [--quantization q8_0] [--n-prompts 64] [--batch 16]
                                     [--weights-on-disk]
--weights-on-disk runs both with every unit's weights on disk, read ahead at each pass and dropped from the page
cache after (as for a model bigger than RAM), where the passes over the weights the mixed steps save count most.

Two more measurements, each instead of the above:
- --scaling: decode tokens/s with 32 sequences in flight against 1 (same prompts of 16 tokens, 64 new tokens
  each, every block on the CPU): how much one read of the weights per step serves many sequences.
- --against-transformers: the same offline job (--n-prompts chat-length prompts x 32 new tokens, greedy, no
  stop at end-of-sequence) through transformers' batched `generate` in fp32 and bf16 and through offload with
  quantization none, dtype bf16, q8_0 and q4_0, one after another in this process on the same threads, in
  rounds (--repeats, default 3 for the other modes: pass --repeats 1 for a quick look); median tokens/s and each
  one's ratio against transformers bf16. --model may be a Hugging Face folder or a GGUF
  file (transformers dequantizes it). On a CPU with AVX-512 BF16 it also prints offload bf16's rate over the
  token-passes the job really computes (every prompt token and every decode step's token through the layers, each
  sequence's sampled rows through the lm_head: no padding) as a fraction of vdpbf16ps's peak, measured in the run.
--smoke runs all three on a tiny random model with a byte-level tokenizer, a few prompts and tokens each: seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

TOPICS = ["the sea", "a city", "the moon", "music", "a forest", "winter", "a robot", "bread"]


def prompt_ids(tokenizer, n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """n prompts of 10 to ~600 tokens (most short, a few long, as in a real batch) and each one's max_tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts, max_tokens = [], []
    for i in range(n):
        repeats = 1 if i % 4 else int(torch.randint(2, 40, (1,), generator=g))
        text = " ".join(f"Tell me something about {TOPICS[(i + j) % len(TOPICS)]} ({i}.{j})." for j in range(repeats))
        prompts.append(tokenizer.encode(text))
        max_tokens.append(int(torch.randint(8, 65, (1,), generator=g)))
    return prompts, max_tokens


def run(llm, prompts, max_tokens, batch: int, mixed: bool) -> dict:
    from offload import SamplingParams
    from offload.engine import run_to_end
    from offload.generate import Generator
    from offload.sequence import Sequence

    seqs = [Sequence(i, p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
            for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    # the KV budget of before's cache: `batch` slots as long as the run's longest request
    kv_tokens = batch * min(max(len(p) + m for p, m in zip(prompts, max_tokens)), llm.max_model_len) + 1
    gen = Generator(llm.model, max_batch_size=len(prompts) if mixed else batch, max_model_len=llm.max_model_len,
                    step_tokens=llm.model.placement.prefill_pass_tokens, kv_tokens=kv_tokens, logits_rows=batch,
                    mixed=mixed)
    kv_bytes, real_cache = [], llm.model.new_cache

    def new_cache(b, n, n_rings=None):
        cache = real_cache(b, n, n_rings)
        kv_bytes.append(sum(kv.nbytes for kv in cache))
        return cache

    llm.model.new_cache = new_cache
    llm.timeline.clear()
    try:
        start = time.perf_counter()
        run_to_end(gen, seqs)
        seconds = time.perf_counter() - start
    finally:
        del llm.model.new_cache
    steps = llm.timeline.steps
    generated = sum(len(s.output_ids) for s in seqs)
    return {"seconds": seconds, "generated": generated, "total": generated + sum(len(p) for p in prompts),
            "kv_bytes": kv_bytes[0], "in_flight": max(s.n_seqs for s in steps), "passes": len(steps),
            "outputs": [s.output_ids for s in seqs]}


def scaling(args, many: int = 32, new_tokens: int = 64) -> None:
    """Decode tokens/s at `many` (32) sequences in flight over the same at 1."""
    from offload import LLM, SamplingParams
    from offload.planner.placement import Placement
    from offload.weights.default_model import resolve_model
    from offload.weights.model_files import model_spec

    placement = Placement.uniform(model_spec(resolve_model(args.model)), "cpu", "cpu")
    llm = LLM(args.model, quantization=args.quantization, backend="cpu", batch_size=many, placement=placement)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    spread = min(900, llm.spec.vocab_size - 100)  # ids 100-999 (fewer in a tiny vocabulary)
    prompts = [{"prompt_token_ids": [100 + (7 * i + j) % spread for j in range(16)]} for i in range(many)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    rates: dict[int, list[float]] = {1: [], many: []}
    for _ in range(args.repeats):
        for n in rates:
            llm.timeline.clear()
            llm.generate(prompts[:n], params)
            t = llm.timeline
            rates[n].append(t.phase_tokens["decode"] / t.phase_time_s["decode"])
    one, all_ = statistics.median(rates[1]), statistics.median(rates[many])
    print(f"model: {llm.path.name}, {args.quantization}, every block on the CPU; {torch.get_num_threads()} threads; "
          f"16-token prompts, {new_tokens} new tokens; median of {args.repeats}")
    print(f"decode, 1 sequence:   {one:8.1f} tok/s")
    print(f"decode, {many} sequences: {all_:8.1f} tok/s")
    print(f"ratio {many} / 1: {all_ / one:.1f}x")


def chat_prompts(n: int, vocab: int) -> list[list[int]]:
    """n prompts of one to four short sentences, as token ids of the default tokenizer's kind (no tokenizer needed:
    ids drawn from the vocabulary's first thousands, fixed by the seed; below vocab)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(12, 50, (n,), generator=g).tolist()
    return [torch.randint(min(200, vocab // 2), min(3000, vocab), (k,), generator=g).tolist() for k in lengths]


def bench_transformers(path, prompts: list[list[int]], new_tokens: int, dtype) -> tuple[float, list[list[int]]]:
    """Seconds of transformers' batched greedy generate over all prompts (left padding), and its outputs."""
    from transformers import AutoModelForCausalLM

    if path.is_file():  # a GGUF file: dequantized in fp32 (asked for bf16, transformers keeps its blocks packed
        # and computes through them), then plain nn.Linear weights cast to dtype
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        model = model.to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(input_ids=ids[:2, -8:], attention_mask=mask[:2, -8:], **{**kwargs, "max_new_tokens": 2,
                                                                                 "min_new_tokens": 2})  # warm-up
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        seconds = time.perf_counter() - start
    del model
    return seconds, out[:, width:].tolist()


def bench_offload(model: str, prompts: list[list[int]], new_tokens: int, quantization: str,
                  dtype: str) -> tuple[float, list[list[int]]]:
    """Seconds of offload's generate over all prompts (the planner chooses the batch), and its outputs."""
    import gc

    from offload import LLM, SamplingParams

    llm = LLM(model, quantization=quantization, dtype=dtype, backend="cpu")
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                 SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - start
    llm.model.close()
    del llm
    gc.collect()
    return seconds, [o.token_ids for o in outs]


AGAINST = (("transformers fp32", None, torch.float32), ("transformers bf16", None, torch.bfloat16),
           ("offload none (fp32)", ("none", "auto"), None), ("offload bf16", ("none", "bf16"), None),
           ("offload q8_0", ("q8_0", "auto"), None), ("offload q4_0", ("q4_0", "auto"), None))


def against_transformers(args, new_tokens: int = 32) -> None:
    """Each configuration once per round, rounds repeated --repeats times; medians."""
    from offload.weights.default_model import resolve_model

    from offload.weights.model_files import model_spec

    path = resolve_model(args.model)
    prompts = chat_prompts(args.n_prompts, model_spec(path).vocab_size)
    generated = len(prompts) * new_tokens
    seconds: dict[str, list[float]] = {name: [] for name, _, _ in AGAINST}
    outputs = {}
    threads = torch.get_num_threads()  # each run starts on these (offload's governor may lower its own count)
    for _ in range(args.repeats):
        for name, offload_args, dtype in AGAINST:
            torch.set_num_threads(threads)
            if offload_args is None:
                t, outputs[name] = bench_transformers(path, prompts, new_tokens, dtype)
            else:
                t, outputs[name] = bench_offload(args.model, prompts, new_tokens, *offload_args)
            seconds[name].append(t)
    lengths = sorted(len(p) for p in prompts)
    print(f"model: {path.name}; {len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens, {new_tokens} new tokens "
          f"each, greedy; {threads} threads; median of {args.repeats} rounds, each running every configuration once")
    median = {name: statistics.median(ts) for name, ts in seconds.items()}
    base = median["transformers bf16"]
    for name, _, _ in AGAINST:
        spread = max(seconds[name]) / min(seconds[name])
        print(f"{name:>20}: {generated / median[name]:8.1f} generated tok/s   {base / median[name]:5.2f}x transformers "
              f"bf16   (runs {spread:.2f}x apart)")
    best = min((n for n, o, _ in AGAINST if o), key=median.get)
    print(f"offload's best ({best}) / transformers bf16: {base / median[best]:.2f}x")
    print_bf16_peak_share(path, prompts, new_tokens, median["offload bf16"], threads)
    ref = outputs["transformers fp32"]
    same = sum(a[:8] == b[:8] for a, b in zip(outputs["offload none (fp32)"], ref))
    print(f"offload none (fp32): first 8 greedy tokens equal to transformers fp32 in {same}/{len(ref)} prompts")


def job_flops(path, prompts: list[list[int]], new_tokens: int) -> float:
    """Multiply-add FLOPs of the job's real token-passes through the linears: every prompt token and every decode
    step's token through each layer (a sequence's first new token comes from its prompt's pass), new_tokens
    sampled rows per sequence through the lm_head."""
    from offload.weights.model_files import model_spec

    spec = model_spec(path)
    layer_passes = sum(len(p) for p in prompts) + len(prompts) * (new_tokens - 1)
    return sum(u.matmul_flops(new_tokens * len(prompts) if u.kind == "lm_head" else layer_passes)
               for u in spec.units() if u.kind in ("layer", "lm_head"))


def print_bf16_peak_share(path, prompts, new_tokens: int, seconds: float, threads: int) -> None:
    """offload bf16's FLOP/s over the job's token-passes as a fraction of vdpbf16ps's peak (AVX-512 BF16 only)."""
    import offload.kernels as K

    if not K.BF16_TILES:
        return
    peak = max(K._C.peak_flops("bf16", 2_000_000, threads) for _ in range(5))
    rate = job_flops(path, prompts, new_tokens) / seconds
    print(f"offload bf16: {rate / 1e9:.0f} GFLOP/s over the job's real token-passes = {rate / peak:.2f} of the "
          f"vdpbf16ps peak ({peak / 1e9:.0f} GFLOP/s on {threads} threads, measured now)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantization", default="q8_0")
    parser.add_argument("--n-prompts", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="KV slots of the longest request (both schedules)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weights-on-disk", action="store_true",
                        help="every unit's weights read from disk at each pass, dropped from the page cache after")
    parser.add_argument("--scaling", action="store_true", help="decode tok/s at 32 sequences over 1 (see above)")
    parser.add_argument("--against-transformers", action="store_true",
                        help="the same job through transformers generate and offload (see above)")
    parser.add_argument("--smoke", action="store_true", help="all three on a tiny model, a few tokens: seconds")
    args = parser.parse_args()
    if args.smoke:
        return smoke(args)
    if args.scaling:
        return scaling(args)
    if args.against_transformers:
        return against_transformers(args)
    mixed_against_before(args)


def smoke(args) -> None:
    """The three measurements on a tiny random model with a byte-level tokenizer, a few prompts and tokens."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_llama import tiny

    threads = torch.get_num_threads()  # each starts on these (offload's governor may lower its own count)
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        args.model, args.repeats = str(tiny(Path(tmp) / "tiny", tokenizer=True)), 1
        args.n_prompts, args.batch = 6, 2
        mixed_against_before(args)
        torch.set_num_threads(threads)
        scaling(args, many=4, new_tokens=4)
        torch.set_num_threads(threads)
        args.n_prompts = 3
        against_transformers(args, new_tokens=4)


def mixed_against_before(args) -> None:
    """The two schedules on --n-prompts prompts of mixed lengths (see above)."""
    from offload import LLM

    placement = None
    if args.weights_on_disk:  # a model bigger than RAM: every pass over the weights reads them from disk
        from offload.planner.placement import Placement
        from offload.weights.default_model import resolve_model
        from offload.weights.model_files import model_spec

        placement = Placement.uniform(model_spec(resolve_model(args.model)), "disk", "cpu", page_cache=frozenset())
    llm = LLM(args.model, quantization=args.quantization, batch_size=args.batch, placement=placement,
              backend="cpu" if placement else "auto")
    prompts, max_tokens = prompt_ids(llm.tokenizer, args.n_prompts)
    threads = torch.get_num_threads()  # each run starts on these (offload's governor may lower its own count)
    run(llm, prompts[:2], [4, 4], 2, True)  # warm-up
    results: dict[str, list[dict]] = {"before": [], "mixed": []}
    for _ in range(args.repeats):
        for name in results:
            results[name].append(run(llm, prompts, max_tokens, args.batch, name == "mixed"))
    lengths = sorted(len(p) for p in prompts)
    print(f"model: {llm.path.name}, {args.quantization}; {args.n_prompts} prompts of {lengths[0]}-{lengths[-1]} "
          f"tokens (median {lengths[len(lengths) // 2]}), 8-64 new tokens each; KV cache for {args.batch} of the "
          f"longest; {threads} threads; median of {args.repeats}"
          + ("; weights read from disk at every pass (not kept by the page cache)" if placement else ""))
    rates = {}
    for name, runs in results.items():
        s = statistics.median(r["seconds"] for r in runs)
        r = runs[0]
        rates[name] = r["generated"] / s
        print(f"{name:>7}: {r['generated'] / s:7.1f} generated tok/s, {r['total'] / s:7.1f} total tok/s; "
              f"KV cache {r['kv_bytes'] / 2**20:6.1f} MiB; {r['in_flight']} in flight at most; {r['passes']} passes "
              f"over the weights")
    print(f"ratio mixed / before: {rates['mixed'] / rates['before']:.2f}x generated tok/s; KV cache "
          f"{results['mixed'][0]['kv_bytes'] / results['before'][0]['kv_bytes']:.2f}x")
    print(compare_outputs(llm, prompts, results["before"][0]["outputs"], results["mixed"][0]["outputs"]))


def top2_gap(llm, ids: list[int]) -> float:
    """The gap between the two highest logits of the next token after ids, run alone."""
    from offload import SamplingParams
    from offload.engine import run_to_end
    from offload.generate import Generator
    from offload.sequence import Sequence

    class Recording(Generator):
        def _sample_next(self, seqs, logits):
            top = torch.topk(logits[0].float(), 2).values
            self.gap = float(top[0] - top[1])
            return super()._sample_next(seqs, logits)

    gen = Recording(llm.model, max_batch_size=1, max_model_len=llm.max_model_len)
    run_to_end(gen, [Sequence(0, ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))])
    return gen.gap


def compare_outputs(llm, prompts, before: list[list[int]], mixed: list[list[int]]) -> str:
    """How many greedy outputs the two schedules share, and where the others part, with the top-2 logit gap there:
    the q4_0 kernels sum a block's products in another order at another token count (results ~5e-7 apart,
    relative), which a near-tie can turn into another token; q8_0's and bf16's sum in one order."""
    parted = [(i, next(k for k in range(len(a)) if a[k] != b[k]), len(a))
              for i, (a, b) in enumerate(zip(before, mixed)) if a != b]
    line = f"greedy outputs identical: {len(before) - len(parted)} of {len(before)}"
    for i, k, n in parted[:3]:
        gap = top2_gap(llm, prompts[i] + before[i][:k])
        line += f"; request {i} parts at token {k} of {n} (top-2 logit gap there {gap:.3f})"
    return line + ("; ..." if len(parted) > 3 else "")


if __name__ == "__main__":
    main()
