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
flight at most, the number of passes over the weights, the ratio mixed / before, and whether the greedy outputs
are identical. Medians of --repeats runs, the two schedules alternating.

Usage: python scripts/bench_batch.py [--model default] [--quantization q8_0] [--n-prompts 64] [--batch 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

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
    from offload.generate import Generator, Sequence

    seqs = [Sequence(i, p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
            for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    # the KV budget of before's cache: `batch` slots as long as the run's longest request
    kv_tokens = batch * min(max(len(p) + m for p, m in zip(prompts, max_tokens)), llm.max_model_len) + 1
    gen = Generator(llm.model, max_batch_size=len(prompts) if mixed else batch, max_model_len=llm.max_model_len,
                    step_tokens=llm.model.placement.prefill_pass_tokens, kv_tokens=kv_tokens, logits_rows=batch,
                    mixed=mixed)
    kv_bytes, real_cache = [], llm.model.new_cache

    def new_cache(b, n):
        cache = real_cache(b, n)
        kv_bytes.append(sum(kv.nbytes for kv in cache))
        return cache

    llm.model.new_cache = new_cache
    llm.timeline.clear()
    try:
        start = time.perf_counter()
        gen.run(seqs)
        seconds = time.perf_counter() - start
    finally:
        del llm.model.new_cache
    steps = llm.timeline.steps
    generated = sum(len(s.output_ids) for s in seqs)
    return {"seconds": seconds, "generated": generated, "total": generated + sum(len(p) for p in prompts),
            "kv_bytes": kv_bytes[0], "in_flight": max(s.n_seqs for s in steps), "passes": len(steps),
            "outputs": [s.output_ids for s in seqs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantization", default="q8_0")
    parser.add_argument("--n-prompts", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="KV slots of the longest request (both schedules)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from offload import LLM

    llm = LLM(args.model, quantization=args.quantization, max_batch_size=args.batch)
    prompts, max_tokens = prompt_ids(llm.tokenizer, args.n_prompts)
    run(llm, prompts[:2], [4, 4], 2, True)  # warm-up
    results: dict[str, list[dict]] = {"before": [], "mixed": []}
    for _ in range(args.repeats):
        for name in results:
            results[name].append(run(llm, prompts, max_tokens, args.batch, name == "mixed"))
    lengths = sorted(len(p) for p in prompts)
    print(f"model: {llm.path.name}, {args.quantization}; {args.n_prompts} prompts of {lengths[0]}-{lengths[-1]} "
          f"tokens (median {lengths[len(lengths) // 2]}), 8-64 new tokens each; KV cache for {args.batch} of the "
          f"longest; {torch.get_num_threads()} threads; median of {args.repeats}")
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
    same = results["mixed"][0]["outputs"] == results["before"][0]["outputs"]
    print(f"greedy outputs identical: {same}")


if __name__ == "__main__":
    main()
