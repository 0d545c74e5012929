"""Decode tokens/s of a Gemma-2-like model on the CPU (or, with --family, a Phi-4-mini-, OLMo-2- or gpt-oss-like one):
the fused C++ layer against the reference block math, on the same quantized weights and threads, in the same run
(the two models alternate; medians of --repeats).

The model is random (about 220M parameters: 12 layers of hidden 1024, MLP 4096, 8 query and 4 KV heads of 128,
vocabulary 32,000), written once to a temporary folder in bf16. gemma2: transformers' Gemma2, sliding window 256 on
every other layer; phi3: Phi-4-mini's rope (the first 3/4 of each head turns, LongRoPE scaling cos and sin by its
attention factor); olmo2: OLMo 2's norms after attention and the MLP, q/k norms over all heads; gpt_oss: sinks,
sliding window 256 on every other layer, 8 biased experts of width 512 with the clamped SwiGLU, 2 per token (about
150M parameters). Prompt and decode (200 + 128 tokens by default) run past the window; within its ring's 384 slots
the caches keep every position, past them (--prompt-len 1000) the sliding layers keep rings, which the fused layer
reads through tables that wrap (decode steps; a prompt chunk longer than a ring takes at once runs the reference
math on both sides).

  python scripts/bench_fused_gemma.py --threads 2 [--family phi3|olmo2|gpt_oss]
  python scripts/bench_fused_gemma.py --smoke    # tiny models of each family, a 16-token prompt, 4 tokens: seconds
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from offload import LLM, SamplingParams

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=8,
             num_key_value_heads=4)
SMOKE_SHAPE = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2)


def _longrope(pairs: int) -> dict:
    """Phi-4-mini's kind of rope_scaling over pairs rotary pairs (original context a quarter of the model's)."""
    return {"type": "longrope", "short_factor": [1.0 + i / pairs for i in range(pairs)],
            "long_factor": [2.0 + i / pairs for i in range(pairs)]}


# family -> (transformers class prefix, its config beyond SHAPE, the same for SMOKE_SHAPE)
FAMILIES = {
    "gemma2": ("Gemma2", dict(head_dim=128, query_pre_attn_scalar=128, sliding_window=256),
               dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=6)),
    "phi3": ("Phi3", dict(partial_rotary_factor=0.75, original_max_position_embeddings=1024, rope_scaling=_longrope(48),
                          pad_token_id=0, eos_token_id=2),
             dict(partial_rotary_factor=0.75, original_max_position_embeddings=1024, rope_scaling=_longrope(6),
                  pad_token_id=0, eos_token_id=2)),
    "olmo2": ("Olmo2", dict(eos_token_id=2), dict(eos_token_id=2)),
    "gpt_oss": ("GptOss", dict(head_dim=128, sliding_window=256, num_local_experts=8, num_experts_per_tok=2,
                               intermediate_size=512, eos_token_id=2),
                dict(head_dim=16, sliding_window=6, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                     eos_token_id=2)),
}  # eos_token_id: Phi-3's and OLMo 2's defaults lie past these vocabularies (gpt-oss's is None)


def make_model(folder: Path, family: str, smoke: bool) -> Path:
    """A random model of the family (SHAPE, or SMOKE_SHAPE) saved as safetensors (bf16)."""
    import transformers

    torch.manual_seed(0)
    prefix, extra, smoke_extra = FAMILIES[family]
    shape = {**(SMOKE_SHAPE if smoke else SHAPE), **(smoke_extra if smoke else extra)}
    config = getattr(transformers, f"{prefix}Config")(max_position_embeddings=4096, **shape)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def decode_tps(llm: LLM, ids: list[int], params: SamplingParams) -> float:
    """Decode tokens/s of one greedy generate over the prompt (the engine's timeline)."""
    llm.timeline.clear()
    llm.generate({"prompt_token_ids": ids}, params)
    return llm.timeline.phase_tokens["decode"] / llm.timeline.phase_time_s["decode"]


def compare(folder: Path, quantization: str, ids: list[int], n_decode: int, repeats: int) -> tuple[float, float]:
    """(fused, reference) median decode tokens/s on the same weights, the two runs alternating."""
    params = SamplingParams(max_tokens=n_decode, temperature=0, ignore_eos=True)
    models = {}
    for fuse in (True, False):
        llm = LLM(str(folder), quantization=quantization, backend="cpu", batch_size=1,
                  max_model_len=len(ids) + n_decode + 8)
        llm.model.fuse = fuse
        llm.generate({"prompt_token_ids": ids}, params)  # warm-up
        models[fuse] = llm
    if not models[True].model.fuse:
        raise SystemExit("the fused layer does not run this model's math (runs_math_of)")
    runs = {True: [], False: []}
    for _ in range(repeats):
        for fuse, llm in models.items():
            runs[fuse].append(decode_tps(llm, ids, params))
    return statistics.median(runs[True]), statistics.median(runs[False])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantizations", default="q4_0,q8_0")
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--family", choices=list(FAMILIES), default="gemma2")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.quantizations, args.prompt_len, args.decode_tokens, args.repeats = "q4_0", 16, 4, 1
    torch.set_num_threads(args.threads)
    vocab = (SMOKE_SHAPE if args.smoke else SHAPE)["vocab_size"]
    ids = [100 + (i * 7919) % (vocab - 200) for i in range(args.prompt_len)]
    for family in FAMILIES if args.smoke else [args.family]:
        with tempfile.TemporaryDirectory() as tmp:
            folder = make_model(Path(tmp), family, args.smoke)
            for quantization in args.quantizations.split(","):
                ours, ref = compare(folder, quantization, ids, args.decode_tokens, args.repeats)
                print(f"{family} {quantization} decode, {args.threads} threads, {args.prompt_len}-token prompt: fused "
                      f"{ours:.1f} tok/s, reference math {ref:.1f} tok/s, fused / reference {ours / ref:.2f}x")


if __name__ == "__main__":
    main()
