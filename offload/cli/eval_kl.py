"""`offload eval-kl`: a model's KL divergence from a reference model, its top-1 agreement and its perplexity over a
text, as `llama-perplexity --kl-divergence` measures them (offload/quality.py), so that llama.cpp's figures on the
same files and text can be put beside them (scripts/bench_kl.py)."""

from __future__ import annotations

import logging
from pathlib import Path

from offload.cli.job_flags import add_option_flags
from offload.errors import ConfigError

log = logging.getLogger("offload")
DEFAULT_CTX = 512  # llama-perplexity's default context


def add_parser(sub) -> None:
    p = sub.add_parser("eval-kl", help="KL divergence, top-1 agreement and perplexity of a model against a "
                                       "reference over a text (llama-perplexity --kl-divergence)")
    p.add_argument("--model", required=True, help="the model measured: a .gguf file or model folder")
    p.add_argument("--reference", required=True,
                   help="the reference: the same model's F32/F16/BF16 .gguf file or folder")
    p.add_argument("--text", required=True, help="a UTF-8 text file of at least 2 x --ctx tokens")
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX,
                   help=f"tokens per chunk, and the context the models are planned for (their max_model_len); the "
                        f"second half of each chunk is scored (default {DEFAULT_CTX}, llama-perplexity's -c)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks (default: all)")
    # tokens per forward pass: --batch is llama-perplexity's name (-b)
    add_option_flags(p, {"model.dtype": (), "hardware.backend": (), "schedule.prefill_chunk_tokens": ("--batch",)})
    p.set_defaults(func=run)


def run(args) -> int:
    from offload.quality import adds_bos, chunk_tokens, evaluate, format_result, llm_logits

    text = read_text(Path(args.text))
    if args.chunks is not None and args.chunks < 1:
        raise ConfigError(f"--chunks {args.chunks}: give 1 or more, or leave it out for every chunk")
    if args.prefill_chunk_tokens is not None and args.prefill_chunk_tokens < 1:
        raise ConfigError(f"--prefill-chunk-tokens (--batch) {args.prefill_chunk_tokens}: give 1 or more tokens per "
                          f"forward pass")
    for flag, path in (("--model", args.model), ("--reference", args.reference)):
        if not Path(path).exists():
            raise ConfigError(f"{flag} {path} does not exist; give a .gguf file or a model folder")
    model = load(args.model, args)
    ids = model.tokenizer.encode(text, add_special_tokens=True)
    chunks = chunk_tokens(ids, args.ctx, args.chunks, adds_bos(model.tokenizer))  # a short text: before the reference
    reference = load(args.reference, args)
    check_same_vocab(model, reference, args)
    log.info(f"{len(ids)} tokens, {len(chunks)} chunks of {args.ctx}")

    def progress(i: int, sums) -> None:
        log.info(f"chunk {i + 1}/{len(chunks)}: mean KLD so far {sums.kld / sums.count:.6f}")

    result = evaluate(llm_logits(model), llm_logits(reference), chunks, progress)
    print(format_result(result, args.model, args.reference))
    return 0


def read_text(path: Path) -> str:
    if not path.is_file():
        raise ConfigError(f"--text {path} is not a file; give a UTF-8 text file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--text {path} is not UTF-8 text ({e.reason} at byte {e.start}); give a UTF-8 file") \
            from None


def load(path: str, args):
    """An LLM for one chunk at a time: a batch of 1 and a context of --ctx."""
    from offload.api import LLM

    llm = LLM(path, dtype=args.dtype, backend=args.backend, prefill_chunk_tokens=args.prefill_chunk_tokens,
              batch_size=1, max_model_len=args.ctx)
    if llm.tokenizer is None:
        raise ConfigError(f"{path} has no tokenizer; eval-kl tokenizes the text with the model's own")
    return llm


def check_same_vocab(model, reference, args) -> None:
    if model.spec.vocab_size != reference.spec.vocab_size:
        raise ConfigError(f"--model {args.model} has {model.spec.vocab_size} tokens and --reference "
                          f"{args.reference} {reference.spec.vocab_size}; give the same model's reference file")

