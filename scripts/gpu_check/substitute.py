"""A substitute draft (speculative method substitute) on a plan that splits a small random Llama between VRAM and
host RAM: its resident units the model's own tensors, copies of the far units in VRAM (with mirrors of their
layers' host KV) and in RAM; greedy answers against plain decoding's on the same device, the acceptance, and where
the copies and mirrors went. The sizes are the simulated device's test's (tests/test_gpu_substitute.py): the
rtx4090-ddr5 preset's budgets at 658 MiB of VRAM split this model's 6 layers."""

from __future__ import annotations

import tempfile
from pathlib import Path

from gpu_check.correctness import make_model

# fp32 weights spread enough (--std 0.1) that greedy near-ties do not turn on a kernel's rounding
MODEL = ("--hidden", "512", "--layers", "6", "--intermediate", "1024", "--heads", "8", "--kv-heads", "2",
         "--vocab", "259", "--dtype", "fp32", "--std", "0.1")
PROMPTS = ([17, 42, 99, 3, 250, 7], [5, 5, 80, 121, 9], [200, 13, 64, 64, 31, 2, 77, 150])  # token ids: no tokenizer
NEW_TOKENS = 24
MIN_ACCEPTANCE = 0.8  # q8_0 copies of fp32 weights kept every proposal on the simulated device; stale mirrors 0.02


def substitute(ctx) -> None:
    from offload import LLM, SamplingParams

    with tempfile.TemporaryDirectory(prefix="gpu-check-substitute-") as tmp:
        folder = make_model(Path(tmp) / "llama", MODEL)
        kw = dict(backend="sim" if ctx.smoke else "cuda", hardware="rtx4090-ddr5", gpu_memory="658MiB",
                  max_model_len=256, dtype="fp32", batch_size=1)
        greedy = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
        want = [o.token_ids for o in LLM(str(folder), **kw).generate([list(p) for p in PROMPTS], greedy)]
        llm = LLM(str(folder), **kw, speculative_config={"method": "substitute", "quantization": "q8_0",
                                                         "num_speculative_tokens": 3})
        drafter = llm.generator.speculator.drafter
        draft = drafter.draft.model
        got = [o.token_ids for o in llm.generate([list(p) for p in PROMPTS], greedy)]
        stats = llm.speculative_stats
        where = {n: (p.weights, p.kv) for n, p in draft.placement.units.items() if n != "embed"}
        shared = [n for n, p in llm.model.placement.units.items() if p.weights == "gpu"]
        ctx.put("layout", {"draft": where, "shared": shared, "mirrored": list(drafter.mirrored),
                           "price": llm.draft_price.line() if llm.draft_price else None})
        ctx.put("result", {"identical": got == want, "acceptance": stats["acceptance_rate"],
                           "tokens_per_pass": stats["tokens_per_pass"],
                           "shared_is_model": all(draft.resident[n] is llm.model.resident[n] for n in shared),
                           "mirror_on_device": all(drafter._mirror[i].k.device.type != "cpu"
                                                   for i in drafter.mirrored)})
    result = ctx.figures["result"]
    ctx.summary(identical=result["identical"], acceptance=round(result["acceptance"], 3),
                mirrored=len(ctx.figures["layout"]["mirrored"]))
    if not (result["identical"] and result["shared_is_model"] and result["mirror_on_device"]):
        raise AssertionError(f"the substitute draft on a split plan: {result}")
    if result["acceptance"] < MIN_ACCEPTANCE:
        raise AssertionError(f"the substitute draft kept {result['acceptance']:.2f} of its proposals, under "
                             f"{MIN_ACCEPTANCE}: its copies or KV mirrors are not the model's")
