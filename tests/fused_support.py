"""What the fused layer's family tests share (test_fused_gemma.py, test_fused_families.py, test_fused_gpt_oss.py): the
extension with its fused calls counted, a seeded prompt, offload's and transformers' greedy tokens, the kernel
paths this machine runs."""

from __future__ import annotations

from collections import Counter

import torch

from conftest import assert_logits_close, hf_logits, offload_logits
from offload import LLM, SamplingParams
from offload.kernels import ACTIVE_PATH

PROMPT_LEN, NEW = 20, 6
PATHS = ["scalar"] + [p for p in ("avx2", "avx512") if ACTIVE_PATH in ("avx2", "avx512") and
                      (p == "avx2" or ACTIVE_PATH == "avx512")]


class Counting:
    """The extension, with its calls of the named functions counted (the fused layer and its attention alone); a run
    of fused units counts as each of its units' calls (layer_forward, experts_forward) each time it runs."""

    def __init__(self, ext, names: tuple[str, ...] = ("layer_forward", "cached_attention")):
        self.ext, self.names, self.calls, self.runs = ext, names, Counter(), {}

    def __getattr__(self, name):
        real = getattr(self.ext, name)
        if name == "unit_run":
            return lambda units: self._made(real(units), units)
        if name == "run_units":
            return lambda run, *args: self.calls.update(self.runs[id(run)][1]) or real(run, *args)
        if name not in self.names:
            return real
        return lambda *args: self.calls.update([name]) or real(*args)

    def _made(self, run, units):
        kinds = Counter({1: "experts_forward", 3: "final_norm", 7: "layer_forward"}[len(u)] for u in units)
        self.runs[id(run)] = (run, Counter({k: n for k, n in kinds.items() if k in self.names}))
        return run


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(llm, ids: list[int]) -> list[int]:
    """NEW greedy tokens of an offload LLM after ids."""
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids)


def hf_greedy(hf, ids: list[int]) -> list[int]:
    """NEW greedy tokens of a transformers model after ids, each from a full forward over the sequence so far."""
    out = list(ids)
    for _ in range(NEW):
        out.append(int(hf_logits(hf, out)[-1].argmax()))
    return out[len(ids):]


def check_fp32_fused(hf, folder, monkeypatch) -> None:
    """fp32 weights: transformers' logits and greedy tokens, with every decode step's layers one fused C++ call
    (offload's fp32 kernels read the weights in place); and with steps of more than F32_KERNEL_ROWS tokens (here:
    all, the rows set to 0), torch's linears with the fused layer's attention for every layer of every step."""
    import offload.kernels.layer as fused
    import offload.runtime.unit_runner as unit_runner

    llm = LLM(str(folder), backend="cpu")
    counting = Counting(fused._C)
    monkeypatch.setattr(fused, "_C", counting)
    ids = prompt(PROMPT_LEN)
    assert_logits_close(offload_logits(llm.model, ids), hf_logits(hf, ids))
    assert greedy(llm, ids) == hf_greedy(hf, ids)
    assert counting.calls["layer_forward"] >= NEW  # the decode steps' (a run of layers may be one call)
    monkeypatch.setattr(unit_runner, "F32_KERNEL_ROWS", 0)
    counting.calls.clear()
    assert_logits_close(offload_logits(llm.model, ids), hf_logits(hf, ids))
    assert greedy(llm, ids) == hf_greedy(hf, ids)
    assert counting.calls["cached_attention"] >= llm.model.spec.n_layers * (NEW + 1) and \
        not counting.calls["layer_forward"]


def check_q8_0_fused(folder, monkeypatch) -> None:
    """q8_0 weights: every layer of every step one fused C++ call; tokens and logits those of the reference block
    math on the same weights."""
    import offload.kernels.layer as fused

    llm, reference = (LLM(str(folder), quantization="q8_0", backend="cpu") for _ in range(2))
    reference.model.fuse = False
    counting = Counting(fused._C)
    monkeypatch.setattr(fused, "_C", counting)
    ids = prompt(PROMPT_LEN)
    ours = greedy(llm, ids)
    assert counting.calls["layer_forward"] >= llm.model.spec.n_layers * NEW
    counting.calls.clear()
    assert ours == greedy(reference, ids) and not counting.calls
    assert_logits_close(offload_logits(llm.model, ids), offload_logits(reference.model, ids))
