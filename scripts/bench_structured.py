"""Structured outputs' cost: the same batch generated with and without a JSON schema, on the same model and threads.

Each of --batch prompts (default 16, one step carries them all) generates --max-tokens greedy tokens; the
constrained run holds every sequence to a schema of an array of at least 100 small objects, so that no sequence
ends before --max-tokens and both runs generate the same number of tokens (the unconstrained one ignores the
stop token). Both run in alternating rounds after a warm-up each (the first constraint builds the vocabulary's
tables and compiles the schema); prints each one's median tokens/s over --rounds and the median of the rounds'
ratios (a round's two runs see the same load on a shared machine). The masks are
filled in a worker thread beside each step's forward pass (offload/grammar.py); masking the rows and advancing
the matchers are what remains in series.

  python scripts/bench_structured.py [--model default] [--batch 16] [--max-tokens 64] [--rounds 5]
  python scripts/bench_structured.py --smoke    # a tiny random model, batch 4, 8 tokens, one round
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "minItems": 100, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"]}}}, "required": ["people"]}
TOPICS = ["a book club", "a chess team", "a small bakery", "a sailing crew", "a choir", "a robotics lab",
          "a hiking group", "a jazz band"]


def prompts(n: int) -> list[str]:
    return [f"List the members of {TOPICS[i % len(TOPICS)]} (group {i}) as JSON." for i in range(n)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="model folder, .gguf file or 'default'")
    p.add_argument("--batch", type=int, default=16, help="prompts generated together")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each prompt generates")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of the two runs")
    p.add_argument("--smoke", action="store_true", help="a tiny random model, batch 4, 8 tokens, one round")
    return p.parse_args(argv)


def rate(llm, texts: list[str], max_tokens: int, constrained: bool) -> float:
    """Tokens generated per second of wall time for one batch."""
    from offload import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            structured_outputs={"json": SCHEMA} if constrained else None)
    start = time.perf_counter()
    outputs = llm.generate(texts, params)
    seconds = time.perf_counter() - start
    n = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    if constrained and any(c.finish_reason != "length" for out in outputs for c in out.outputs):
        raise SystemExit("a constrained sequence ended before --max-tokens; the runs would not compare")
    return n / seconds


def measure(llm, batch: int, max_tokens: int, rounds: int) -> tuple[list[float], list[float]]:
    """Tokens/s without and with the constraint in each of the alternating rounds, after a warm-up of each."""
    texts = prompts(batch)
    for constrained in (False, True):
        rate(llm, texts, min(4, max_tokens), constrained)
    plain, held = [], []
    for _ in range(rounds):
        plain.append(rate(llm, texts, max_tokens, False))
        held.append(rate(llm, texts, max_tokens, True))
    return plain, held


def main(argv=None) -> int:
    args = parse_args(argv)
    from offload import LLM

    if args.smoke:
        sys.path.insert(0, str(HERE))
        from make_llama import tiny

        folder = tiny(Path(tempfile.mkdtemp(prefix="bench-structured-")) / "tiny", vocab=259, tokenizer=True)
        args.model, args.batch, args.max_tokens, args.rounds = str(folder), 4, 8, 1
    llm = LLM(args.model, batch_size=args.batch, max_model_len=512)
    plain, held = measure(llm, args.batch, args.max_tokens, args.rounds)
    ratio = statistics.median(h / p for p, h in zip(plain, held))
    print(f"{args.model}: {args.batch} prompts x {args.max_tokens} greedy tokens, median of {args.rounds} rounds")
    print(f"  unconstrained  {statistics.median(plain):8.1f} tok/s")
    print(f"  JSON schema    {statistics.median(held):8.1f} tok/s")
    print(f"  each round's ratio: {', '.join(f'{h / p:.3f}' for p, h in zip(plain, held))}")
    print(f"batch {args.batch}: constrained / unconstrained throughput {ratio:.3f}x (cost {100 * (1 - ratio):.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
