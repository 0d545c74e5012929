"""Item 2: a 600-token prompt (longer than a 512-token prefill chunk) through GPU layers against the CPU backend.

A small random Llama checkpoint is written by scripts/make_llama.py (fp32, grouped-query heads). For each way GPU
layers run (resident, streamed from host RAM, streamed with their KV cache in host RAM), the same placement on the
CPU backend is the reference, as tests/test_sim.py holds the simulated device to it: the prompt's logits in one
pass (its layers chunk it at 512 tokens) within 1e-4 of the logit range, and the greedy tokens of a long prompt
alone, and joining a batch where another sequence decodes (a step of its whole prompt plus that decode token, chunked
in the layers), identical."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

PROMPT_LEN = 600
NEW_TOKENS = 8
# the mixed run, two sequences at a time: (prompt length, new tokens) of a sequence that decodes on, one that ends
# early, and the long prompt, which takes the second one's place in the KV pool (the first one's extent lies before
# it) in a step beside the first one's decode token
MIXED = ((20, 12), (30, 3), (PROMPT_LEN, NEW_TOKENS))
REL = 1e-4  # of the reference's logit range (fp32 on both)
# --std 0.1 spreads the logits (0.02's are near-flat: greedy near-ties that fp32 rounding could turn)
MODEL = ("--hidden", "256", "--layers", "3", "--intermediate", "512", "--heads", "8", "--kv-heads", "2",
         "--vocab", "1024", "--dtype", "fp32", "--std", "0.1")
SMOKE_MODEL = ("--hidden", "64", "--layers", "2", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
               "--vocab", "512", "--dtype", "fp32", "--std", "0.1")


def make_model(folder: Path, args: tuple[str, ...]) -> Path:
    """A random checkpoint written by scripts/make_llama.py."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from make_llama import main

    if main(["--out", str(folder), *args]) != 0:
        raise RuntimeError(f"scripts/make_llama.py could not write a model into {folder}")
    return folder


def placements(spec) -> dict:
    """How GPU layers run: resident, streamed, and streamed with the KV cache in host RAM."""
    from offload.planner import Placement

    streamed = Placement.uniform(spec, "cpu", "stream")
    host_kv = Placement({n: dataclasses.replace(p, kv="cpu") if n.startswith("layer.") else p
                         for n, p in streamed.units.items()})
    return {"resident": Placement.uniform(spec, "gpu", "gpu"), "streamed": streamed, "host_kv": host_kv}


def prompt_logits(model, ids: list[int]):
    """fp32 logits [S, V] of one prefill pass over ids."""
    import torch

    positions = torch.arange(len(ids))[None]
    cache = model.new_cache(1, len(ids))
    step = model.make_step(positions, torch.ones_like(positions, dtype=torch.bool), trash_slot=len(ids))
    with torch.inference_mode():
        return model.logits(model.forward(torch.tensor([ids]), step, cache))[0]


def greedy(model, prompts: list[list[int]], new_tokens: list[int], batch: int) -> list[list[int]]:
    """Greedy tokens of each prompt, at most batch sequences at a time."""
    from offload.engine import run_to_end
    from offload.generate import Generator
    from offload.sampling import SamplingParams
    from offload.sequence import Sequence

    seqs = [Sequence(i, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, new_tokens))]
    run_to_end(Generator(model, max_batch_size=batch), seqs)
    return [s.output_ids for s in seqs]


def compare(ctx, folder: Path, spec, placement, prompts: list[list[int]]) -> dict:
    """One placement on the device and on the CPU backend: logits and greedy tokens."""
    import torch

    from offload.runtime.backends.cpu import CPUBackend
    from offload.runtime.executor import PlacedModel
    from offload.weights.loader import Checkpoint
    from offload.weights.sources import CheckpointSource

    out = {}
    for side, backend in (("device", ctx.device.backend()), ("cpu", CPUBackend())):
        model = PlacedModel(spec, CheckpointSource(Checkpoint(folder), spec, torch.float32, "none"), placement,
                            backend, torch.float32)
        out[side] = {"logits": prompt_logits(model, prompts[-1]), "long": greedy(model, prompts[-1:], [NEW_TOKENS], 1)}
        model.timeline.clear()
        out[side]["mixed"] = greedy(model, prompts, [n for _, n in MIXED], 2)
        out["mixed_steps"] = [[s.n_prompt_tokens, s.n_decode_tokens] for s in model.timeline.steps
                              if s.n_prompt_tokens and s.n_decode_tokens]  # (prompt, decode) tokens of each
        if side == "device" and ctx.smoke:
            out["host_syncs"] = {f"{unit} {what}": n for (unit, what), n in backend.strict.syncs.items()}
        model.close()
    ours, ref = out["device"]["logits"], out["cpu"]["logits"]
    span = float(ref.max() - ref.min())
    return {"max_diff_over_range": float((ours - ref).abs().max()) / span, "logit_range": span,
            "long_tokens_equal": out["device"]["long"] == out["cpu"]["long"],
            "mixed_tokens_equal": out["device"]["mixed"] == out["cpu"]["mixed"],
            "tokens": out["device"]["long"][0], "mixed_steps": out["mixed_steps"],
            **({"host_syncs": out["host_syncs"]} if "host_syncs" in out else {})}


def prompt_vs_cpu(ctx) -> None:
    import torch

    from offload.spec import load_spec

    with tempfile.TemporaryDirectory(prefix="gpu-check-prompt-") as tmp:
        folder = make_model(Path(tmp) / "llama", SMOKE_MODEL if ctx.smoke else MODEL)
        spec = load_spec(folder)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n, _ in MIXED]
        ctx.put("model", {"layers": spec.n_layers, "hidden": spec.hidden_size, "prompt_len": PROMPT_LEN})
        for name, placement in placements(spec).items():
            ctx.put(name, compare(ctx, folder, spec, placement, prompts))
    results = {n: ctx.figures[n] for n in ("resident", "streamed", "host_kv")}
    ctx.summary(**{n: [round(r["max_diff_over_range"], 8), r["long_tokens_equal"] and r["mixed_tokens_equal"]]
                   for n, r in results.items()})
    bad = [n for n, r in results.items()
           if r["max_diff_over_range"] > REL or not (r["long_tokens_equal"] and r["mixed_tokens_equal"])]
    if not all(r["mixed_steps"] for r in results.values()):
        raise AssertionError("the mixed run had no step carrying a prompt beside a decode token (the scheduler "
                             "admits sequences otherwise now): change MIXED so that one does")
    if bad:
        raise AssertionError(f"GPU layers differ from the CPU backend ({', '.join(bad)}): logits beyond {REL} of "
                             f"the range, or other greedy tokens")
