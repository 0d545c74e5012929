"""`offload generate`: completions for one or more prompts, printed one per line."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for one or more prompts")
    p.add_argument("--model", default="default",
                   help="model folder, .gguf file, Hugging Face Hub id (org/name, from the local HF cache), or 'default'")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--quantization", default="none", help="none, q8_0 or q4_0")
    p.add_argument("--dtype", default="auto", help="compute format: auto, fp32, bf16 or fp16")
    p.set_defaults(func=run)


def run(args) -> int:
    from offload.api import LLM
    from offload.errors import ConfigError
    from offload.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop)
    llm = LLM(args.model, quantization=args.quantization, dtype=args.dtype)
    if llm.tokenizer is None:  # the library's message offers token ids, which this command does not take
        raise ConfigError(f"the model in {llm.path} has no tokenizer files, and offload generate reads text prompts; "
                          f"add the model's tokenizer.json and tokenizer_config.json to {llm.path}")
    if args.raw:
        outputs = llm.generate(args.prompt, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    for out in outputs:
        print(out.text)
    return 0
