"""A substitute draft on a plan with GPU layers (SubSpec's layout): the model's resident units are the draft's as
they are, every far unit gets a copy in the draft's format, in VRAM where the room set aside holds it (a streamed
unit's must be there: its KV is on the GPU), else in RAM; the planner prices the room, and the simulated device runs
it with greedy answers the model's own."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from offload import LLM, SamplingParams
from offload.options import SpeculativeOptions
from offload.planner import PlanRequest, plan_for
from offload.planner.speculation import plan_speculation
from offload.planner.substitutes import draft_step_s, gpu_fused, layout_on
from offload.weights.model_files import model_spec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from make_llama import main as make_llama, write_byte_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """6 layers of hidden 512 (about 4 MiB each in fp32): a few MiB of VRAM past the simulated card's reserve
    splits them between the GPU and the CPU."""
    out = tmp_path_factory.mktemp("sub") / "wide"
    make_llama(["--out", str(out), "--hidden", "512", "--layers", "6", "--intermediate", "1024", "--heads", "8",
                "--kv-heads", "2", "--vocab", "259", "--std", "0.05"])
    write_byte_tokenizer(out, 259)
    return out


def test_the_layout_keeps_streamed_copies_on_the_gpu_and_prices_the_room():
    """Llama-3.1-8B in bf16 on a 4 GiB card: the plan the substitute's price rests on shares the resident units,
    copies every far unit (the streamed ones in VRAM), sets their bytes aside from the model's budgets, and a draft
    step of q4_0 copies costs less than the verifying pass; a copy of a streamed unit that does not fit is no
    layout."""
    request = PlanRequest.of(model=str(ROOT / "configs/models/llama-3.1-8b"), hardware="rtx4090-ddr5",
                             gpu_memory="4GiB", batch_size=1, dtype="bf16")
    spec, hw = model_spec(ROOT / "configs/models/llama-3.1-8b"), request.profile()
    plans = plan_speculation(spec, hw, request, SpeculativeOptions(method="substitute", quantization="q4_0"))
    layout, target = plans.layout, plans.target
    far = {u.name for u in target.units if u.kind in ("layer", "mlp", "lm_head") and u.weight_tier != "gpu"}
    assert set(layout.shared) == {u.name for u in target.units if u.weight_tier == "gpu"}
    assert set(layout.on_gpu) | set(layout.on_cpu) == far and not set(layout.on_gpu) & set(layout.on_cpu)
    assert layout.gpu_bytes <= plans.draft_gpu_bytes == layout.plan_held[0]
    assert layout.cpu_bytes <= plans.draft_cpu_bytes == layout.plan_held[1]
    assert 0 < plans.draft_step_s < plans.pass_s(3)
    assert target.tier("gpu").total_bytes <= request.budget(hw).gpu_bytes - plans.draft_gpu_bytes
    plain = plan_for(spec, hw, request)  # resident, streamed and CPU layers
    streamed = [u.name for u in plain.units if u.weight_tier != "gpu" and u.decode == "stream"]
    on_cpu = [u.name for u in plain.units if u.kind == "layer" and u.decode == "cpu"]
    assert streamed and on_cpu and plain.n_gpu_units
    sizes = {u.name: 1000 for u in plain.units}
    assert layout_on(plain, sizes, "q4_0", 1000 * len(streamed) - 1) is None  # a streamed unit's copy left out
    kv = {u.name: u.kv_bytes for u in plain.units}  # a CPU layer's copy in VRAM takes a mirror of its KV too
    room = 1000 * (len(streamed) + 2) + kv[on_cpu[0]] + kv[on_cpu[1]]
    some = layout_on(plain, sizes, "q4_0", room)  # the streamed first, then two CPU layers and their KV mirrors
    assert set(some.on_gpu) == set(streamed) | set(on_cpu[:2]) and set(some.on_cpu) >= set(on_cpu[2:])
    assert some.mirrored == tuple(on_cpu[:2]) and some.mirror_bytes == kv[on_cpu[0]] + kv[on_cpu[1]] > 0
    assert on_cpu[1] not in layout_on(plain, sizes, "q4_0", room - 1).on_gpu  # its mirror no longer fits
    assert set(some.shared) == {u.name for u in plain.units if u.weight_tier == "gpu"}
    assert layout_on(plain, sizes, "q4_0", 10**12, fused=frozenset()) is None  # no kernel for the streamed copies
    unfused = layout_on(plain, sizes, "q4_0", 10**12, fused=frozenset(streamed) | frozenset(on_cpu[1:]))
    assert on_cpu[0] in unfused.on_cpu and set(unfused.on_gpu) >= set(on_cpu[1:])  # only fused copies in VRAM
    split = replace(spec, split_mlp=target.split_mlp)  # the units target places
    copies = split.with_stored_formats({t.name: "iq2_xxs" if t.role == "linear" else "f32" for t in spec.tensors()})
    assert not gpu_fused(copies, "gguf", "bf16") & set(far)  # no Triton kernel for IQ2_XXS
    assert gpu_fused(copies.with_stored_formats({t.name: "q2_k" for t in spec.tensors() if t.role == "linear"}),
                     "gguf", "bf16") >= set(far)
    real = {u.name: u.weight_bytes // 3 for u in plain.units}
    in_ram = layout_on(plain, real, "q4_0", sum(real[n] for n in streamed))
    in_vram = layout_on(plain, real, "q4_0", sum(real.values()))
    assert in_ram.on_cpu and not in_vram.on_cpu  # copies the CPU reads cost more than copies in VRAM
    assert draft_step_s(spec, hw, plain, in_ram, 1000) > draft_step_s(spec, hw, plain, in_vram, 1000)


def test_a_substitute_on_a_gpu_plan_shares_the_resident_units_and_keeps_greedy_answers(wide):
    """On the simulated card with a few MiB for layers, fp32: the draft's resident units are the model's own
    tensors (not loaded again), its copies sit where the layout says (a VRAM copy of a layer the CPU computes
    attends to a mirror of that layer's KV in VRAM, copied from the model's host cache each drafting round), and
    greedy answers are plain decoding's."""
    from offload.runtime.backends.sim_device import is_device

    kw = dict(backend="sim", hardware="rtx4090-ddr5", gpu_memory="658MiB", max_model_len=256, dtype="fp32",
              batch_size=1)
    greedy = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 9)]
    prompts = ["The quick brown fox", "Hello there"]
    want = [o.token_ids for o in LLM(str(wide), **kw).generate(prompts, greedy)]
    llm = LLM(str(wide), **kw, speculative_config={"method": "substitute", "num_speculative_tokens": 3,
                                                   "quantization": "q8_0"})
    drafter = llm.generator.speculator.drafter
    draft = drafter.draft.model
    resident = [n for n, p in llm.model.placement.units.items() if p.weights == "gpu"]
    copies = [n for n, p in draft.placement.units.items() if n.startswith("layer.") and n not in resident]
    assert resident and {draft.placement[n].weights for n in copies} == {"gpu", "cpu"}  # the budget splits it
    assert all(draft.resident[n] is llm.model.resident[n] for n in resident)
    mirrored = [f"layer.{i}" for i in drafter.mirrored]
    assert mirrored and set(mirrored) <= set(copies)
    for name in copies:
        p, q = draft.placement[name], llm.model.placement[name]
        assert draft.layouts[name].n_bytes < llm.model.layouts[name].n_bytes  # q8_0 of fp32
        assert (p.kv, q.kv) == (("gpu", "cpu") if name in mirrored else (q.kv, q.kv))
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want
    stats = llm.speculative_stats  # q8_0 copies of fp32 weights keep every proposal here; a mirror left stale
    assert stats["acceptance_rate"] > 0.8 and stats["verified_passes"] > 0  # keeps 0.02 of them
    for i in drafter.mirrored:  # the mirror is a device copy of the model's host cache as of the last round
        twin, host = drafter._mirror[i], drafter.cache[i]
        assert is_device(twin.k) and not is_device(host.k) and twin.k.shape == host.k.shape


@pytest.fixture(scope="module")
def copy_of_wide(wide, tmp_path_factory) -> Path:
    """wide's weights as a GGUF file in Q5_0, a format offload does not quantize to itself (gguf-py writes it)."""
    from transformers import AutoModelForCausalLM

    from gguf_support import write_gguf

    model = AutoModelForCausalLM.from_pretrained(str(wide), torch_dtype="float32")
    return write_gguf(model, tmp_path_factory.mktemp("copy") / "wide-Q5_0.gguf", "Q5_0", tokenizer=False)


@pytest.mark.parametrize("where", ["cpu", "sim"])
def test_copies_read_from_a_gguf_file_of_the_same_model(wide, copy_of_wide, where):
    """speculative.model with method substitute: the copies are that file's weights as stored (Q5_0 here), on a CPU
    plan and a GPU plan alike; they draft over the model's cache, so their keys must be laid out as the model's
    (kept proposals show it) and greedy answers stay the model's. A file of another shape is refused in one line."""
    from offload.errors import ConfigError

    kw = dict(backend=where, max_model_len=256, dtype="fp32", batch_size=1)
    if where == "sim":
        kw.update(hardware="rtx4090-ddr5", gpu_memory="658MiB")
    greedy = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 12)]
    prompts = ["The quick brown fox", "Hello there"]
    want = [o.token_ids for o in LLM(str(wide), **kw).generate(prompts, greedy)]
    llm = LLM(str(wide), **kw, speculative_config={"method": "substitute", "model": str(copy_of_wide),
                                                   "num_speculative_tokens": 3})
    draft = llm.generator.speculator.drafter.draft
    assert draft.path == copy_of_wide and draft.spec.stored_format == "q5_0"
    assert "(substitute, q5_0 copy" in llm.draft_price.line()
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want
    # 0.35 on the CPU, as the model's own q4_0 copies of these random weights keep (F32 and Q8_0 files keep every
    # proposal); keys laid out otherwise than the model's would keep about none
    assert llm.speculative_stats["acceptance_rate"] > 0.2
    from offload.jobs.worker import job_draft_spec
    from offload.planner.speculation import against_measured, prior_acceptance

    report = against_measured(llm.spec, llm.request.profile(), llm.whole_request, llm.speculative,
                              llm.speculative_stats, prior_acceptance(llm.speculative), job_draft_spec(llm))
    assert report["predicted_tokens_per_s"] > 0 and report["tokens_per_pass_over_measured"] > 0  # the job report's
    with pytest.raises(ConfigError, match="is not a copy of the model"):
        other = copy_of_wide.parent / "narrow"
        make_llama(["--out", str(other), "--hidden", "256", "--layers", "6", "--intermediate", "1024", "--heads",
                    "8", "--kv-heads", "2", "--vocab", "259"])
        LLM(str(wide), **kw, speculative_config={"method": "substitute", "model": str(other)})


def test_a_price_that_does_not_pay_says_a_run_drops_it():
    """The line `offload plan` prints for speculation predicted slower than without it says the run drops it."""
    from offload.planner.speculation import DROPPED, SpeculationPrice

    def price(tokens_per_s):
        return SpeculationPrice("substitute", 0.7, 0, 1.0, 0.3, 0.0, tokens_per_s, 3.0)

    assert price(2.5).line().endswith(DROPPED) and DROPPED not in price(3.5).line()
