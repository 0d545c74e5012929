"""The prefix cache's gain: the same work with the cache off and on, side by side in one process on one model.

Two cases (the issue's acceptance cases), each run cache off first, then on:
- chat: a system prompt of ~1,500 tokens kept across --turns turns (8); each turn adds a short user question to
  the conversation (the model's earlier answers included), rendered with the chat template, and generates 16
  greedy tokens. One offload.engine.Engine per mode, fed turn by turn, as a server would be; both modes see the
  same prompts (the off run's answers build the history). Prints each turn's prompt and cached tokens, time to
  first token (TTFT) off and on and their ratio; then, cache on, turn 1's TTFT over the mean of the later turns',
  and whether every turn's answer tokens were the same with and without the cache.
- batch: --requests requests (64) sharing a ~1,000-token few-shot prefix, each with its own question, 32 greedy
  tokens each (ignore_eos), one LLM.generate call per mode. Prints the end-to-end seconds of each, their ratio,
  the tokens the cache gave (the RequestOutputs' num_cached_tokens) and how many answers match.

  python scripts/bench_prefix_cache.py [--model default] [--turns 8] [--requests 64]
  python scripts/bench_prefix_cache.py --quick    # 3 turns, 8 requests, shorter prefixes and answers
  python scripts/bench_prefix_cache.py --smoke    # a tiny random model, 2 turns, 4 requests, 4 tokens
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

SUBJECTS = ["tides", "volcanoes", "bread", "bridges", "bees", "glaciers", "comets", "forests", "rivers", "deserts"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="model folder, .gguf file or 'default'")
    p.add_argument("--turns", type=int, default=8, help="chat turns over the one system prompt")
    p.add_argument("--requests", type=int, default=64, help="batch requests sharing the few-shot prefix")
    p.add_argument("--quick", action="store_true", help="3 turns, 8 requests, shorter prefixes and answers")
    p.add_argument("--smoke", action="store_true", help="a tiny random model, 2 turns, 4 requests, 4 tokens")
    args = p.parse_args(argv)
    args.system_tokens, args.shots_tokens, args.chat_new, args.batch_new, args.context = 1500, 1000, 16, 32, 4096
    if args.quick:
        args.turns, args.requests, args.system_tokens, args.shots_tokens, args.chat_new, args.batch_new = \
            3, 8, 300, 200, 8, 8
    if args.smoke:
        args.turns, args.requests, args.system_tokens, args.shots_tokens, args.chat_new, args.batch_new = \
            2, 4, 60, 40, 4, 4
        args.context = 2048
    return args


def grow(tokenizer, line, target: int) -> str:
    """line(0) + line(1) + ... until the text is at least target tokens long (deterministic)."""
    text, i = "", 0
    while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < target:
        text, i = text + line(i), i + 1
    return text


def system_prompt(tokenizer, target: int) -> str:
    return "You are a careful assistant. Follow these house rules.\n" + grow(
        tokenizer, lambda i: f"Rule {i + 1}: when asked about {SUBJECTS[i % 10]}, answer briefly, politely and "
                             f"in plain words, citing rule {i + 1}.\n", target)


def few_shot(tokenizer, target: int) -> str:
    return "Answer each question with one short sentence.\n\n" + grow(
        tokenizer, lambda i: f"Q: What is {i} plus {i + 3}?\nA: {i} plus {i + 3} is {2 * i + 3}.\n\n", target)


def first_token(engine, request_id, ids: list[int], params) -> tuple[list[int], int, float]:
    """Run one request to its end: its answer tokens, the prompt tokens the cache gave, and seconds to its first
    token."""
    seq = engine.add(request_id, ids, params)
    start, ttft = time.perf_counter(), None
    while engine.has_work():
        engine.step()
        if ttft is None and seq.output_ids:
            ttft = time.perf_counter() - start
    return list(seq.output_ids), seq.n_prefix_hit, ttft


def chat_mode(llm, system: str, prompts: list[list[int]] | None, turns: int, new: int, on: bool):
    """One engine's turns (prompts None: built from this run's own answers); the prompts, answers, cached tokens
    and TTFTs of each turn."""
    from offload import SamplingParams
    from offload.engine import Engine

    llm.generator.prefix_caching = on
    engine, params = Engine(llm.generator), SamplingParams(max_tokens=new, temperature=0.0)
    history, made, rows = [{"role": "system", "content": system}], [], []
    for turn in range(turns):
        history.append({"role": "user", "content": f"Question {turn + 1}: tell me one fact about "
                                                   f"{SUBJECTS[turn % 10]}."})
        ids = prompts[turn] if prompts is not None else llm.apply_chat_template(history)
        answer, cached, ttft = first_token(engine, turn, ids, params)
        history.append({"role": "assistant", "content": llm.tokenizer.decode(answer, skip_special_tokens=True)})
        made.append(ids)
        rows.append((answer, cached, ttft))
    return made, rows


def chat(llm, args) -> None:
    system = system_prompt(llm.tokenizer, args.system_tokens)
    n_system = len(llm.tokenizer(system, add_special_tokens=False)["input_ids"])
    print(f"chat: system prompt {n_system} tokens, {args.turns} turns x {args.chat_new} greedy tokens")
    prompts, off = chat_mode(llm, system, None, args.turns, args.chat_new, on=False)
    _, on = chat_mode(llm, system, prompts, args.turns, args.chat_new, on=True)
    print(f"  {'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT off':>9} {'TTFT on':>9} {'ratio':>7}")
    for turn, (ids, a, b) in enumerate(zip(prompts, off, on)):
        print(f"  {turn + 1:>4} {len(ids):>7} {b[1]:>7} {a[2]:>8.3f}s {b[2]:>8.3f}s {a[2] / b[2]:>6.2f}x")
    if args.turns > 1:
        later = statistics.mean(r[2] for r in on[1:])
        print(f"  cache on: turn 1 TTFT / mean TTFT of turns 2-{args.turns} = {on[0][2]:.3f}s / {later:.3f}s "
              f"= {on[0][2] / later:.2f}x")
    same = [a[0] == b[0] for a, b in zip(off, on)]
    print(f"  answers identical off vs on: {all(same)} ({sum(same)}/{len(same)} turns)")


def batch_run(llm, texts: list[list[int]], new: int, on: bool):
    from offload import SamplingParams

    llm.generator.prefix_caching = on
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(texts, params)
    return time.perf_counter() - start, outputs


def batch(llm, args) -> None:
    tok = llm.tokenizer
    prefix = tok(few_shot(tok, args.shots_tokens), add_special_tokens=False)["input_ids"]
    prompts = [prefix + tok(f"Q: What is {i} times {i % 7 + 2}?\nA:", add_special_tokens=False)["input_ids"]
               for i in range(args.requests)]
    print(f"batch: {args.requests} requests, shared prefix {len(prefix)} tokens, {args.batch_new} greedy tokens each")
    t_off, off = batch_run(llm, prompts, args.batch_new, on=False)
    t_on, on = batch_run(llm, prompts, args.batch_new, on=True)
    cached = sum(o.num_cached_tokens for o in on)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(off, on))
    print(f"  cache off {t_off:8.2f}s   cache on {t_on:8.2f}s   off / on {t_off / t_on:.2f}x")
    print(f"  cached tokens {cached} of {sum(len(p) for p in prompts)} prompt tokens "
          f"(off run: {sum(o.num_cached_tokens for o in off)})")
    print(f"  answers identical off vs on: {same}/{len(prompts)}")


def main(argv=None) -> int:
    args = parse_args(argv)
    from offload import LLM, SamplingParams

    if args.smoke:
        from pathlib import Path
        import tempfile

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from make_llama import tiny

        args.model = str(tiny(Path(tempfile.mkdtemp(prefix="bench-prefix-")) / "tiny", vocab=259, tokenizer=True))
    llm = LLM(args.model, max_model_len=args.context)
    print(f"{args.model}: prefix cache off vs on{' (quick)' if args.quick else ''}")
    llm.generator.prefix_caching = False  # a warm-up prefill as long as the system prompt: first-call costs out
    llm.generate([few_shot(llm.tokenizer, args.system_tokens)], SamplingParams(max_tokens=2, temperature=0.0))
    chat(llm, args)
    batch(llm, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
