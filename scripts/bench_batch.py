"""Throughput of the block schedule: 64 prompts generated as one batch against the same 64 one by one.

The one-by-one baseline runs the first --n-single of the same prompts (all of them with --n-single 64;
the default of 16 keeps the script near 2 minutes on 2 busy cores): tokens/s is a rate, and the prompts
are alike in length.

Each forward pass of the batched run goes through every layer once for all sequences in flight, so each
pass over the weights (or, with offloading, each weight transfer) serves the whole batch. Prints the total
tokens/s of both runs and their ratio, measured in the same process on the same model.

Usage: python scripts/bench_batch.py [--model default] [--n-prompts 64] [--n-single 16] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import time

TOPICS = ["the sea", "a city", "the moon", "music", "a forest", "winter", "a robot", "bread"]
STARTS = ["Write a sentence about", "Tell me a fact about", "Describe", "Say something about",
          "Give me a word for", "Explain", "Name a color for", "Start a story about"]


def prompts(n: int) -> list[str]:
    """n short, distinct prompts."""
    return [f"{STARTS[i % len(STARTS)]} {TOPICS[(i // len(STARTS)) % len(TOPICS)]} ({i})." for i in range(n)]


def timed(fn) -> tuple[list, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--n-prompts", type=int, default=64)
    parser.add_argument("--n-single", type=int, default=16, help="prompts run one by one as the baseline")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    from offload import LLM, SamplingParams

    llm = LLM(args.model, max_batch_size=args.n_prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    texts = prompts(args.n_prompts)
    llm.generate(texts[:2], params)  # warm-up: first-call allocations and kernel dispatch

    batched, batch_s = timed(lambda: llm.generate(texts, params))
    n_single = min(args.n_single, args.n_prompts)
    single, single_s = timed(lambda: [llm.generate([t], params)[0] for t in texts[:n_single]])

    def total_tokens(outs) -> int:
        return sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)

    tok_batch, tok_single = total_tokens(batched), total_tokens(single)
    same = sum(a.token_ids == b.token_ids for a, b in zip(batched, single))
    print(f"model: {llm.path.name}; {args.n_prompts} prompts, {args.max_tokens} generated tokens each")
    print(f"one by one:     {tok_single:5d} tokens in {single_s:6.2f} s = {tok_single / single_s:8.1f} tokens/s "
          f"(first {n_single} prompts, batch of 1)")
    print(f"block schedule: {tok_batch:5d} tokens in {batch_s:6.2f} s = {tok_batch / batch_s:8.1f} tokens/s "
          f"(all {args.n_prompts} prompts, batch of {args.n_prompts})")
    print(f"ratio (block schedule / one by one): {(tok_batch / batch_s) / (tok_single / single_s):.2f}x")
    print(f"greedy outputs identical in both runs: {same}/{n_single}")


if __name__ == "__main__":
    main()
