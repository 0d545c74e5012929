"""`offload generate`: completions for one or more prompts, printed one per line; planned from the same flags (or job
YAML) as `offload plan`, sampled by the sampling section's flags."""

from __future__ import annotations

from offload.cli.job_flags import add_generate_flags, effective_config


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for one or more prompts")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_generate_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from offload.errors import ConfigError
    from offload.jobs.batch import sampling_params
    from offload.jobs.config import sampling_defaults
    from offload.jobs.device import check_gpu_is_here
    from offload.jobs.worker import load_llm

    config = effective_config(args, need_input=False)
    params = sampling_params(sampling_defaults(config), {})  # no body: the section's values, within its cap
    check_gpu_is_here(config)
    llm = load_llm(config)
    if llm.tokenizer is None:  # the library's message offers token ids, which this command does not take
        raise ConfigError(f"the model in {llm.path} has no tokenizer files, and offload generate reads text prompts; "
                          f"add the model's tokenizer.json and tokenizer_config.json to {llm.path}")
    if args.raw:
        outputs = llm.generate(args.prompt, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    for out in outputs:
        thought = out.outputs[0].reasoning_content  # a thinking model's, split off by LLM.chat: shown as it was said
        print(out.text if thought is None else f"<think>{thought}</think>{out.text}")
    return 0
