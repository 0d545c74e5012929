"""The streamer as the host sees it (offload/runtime/streamer.py): a disk unit's compute is launched before the host
waits for its copy (its read buffer still goes back only once the copy has landed: tests/test_sim.py removes that
wait and gets a wrong answer), a streamed unit's weights are views of its slot made once per slot and layout, and a
prefill pass that samples nothing runs (and the pricer prices) no lm_head."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import gpu_profile, make_hf_model, offload_logits, save_hf_model
from offload.engine import run_to_end
from offload.generate import Generator
from offload.planner import Placement
from offload.planner.costs import Phase, unit_cost
from offload.planner.placement import UnitPlacement
from offload.runtime import streamer
from offload.runtime.backends.cpu import CPUBackend
from offload.runtime.backends.sim import SimBackend
from offload.runtime.executor import PlacedModel
from offload.sampling import SamplingParams
from offload.sequence import Sequence
from offload.spec import load_spec
from offload.weights.loader import Checkpoint
from offload.weights.sources import CheckpointSource

PROMPT = [5, 17, 33, 2, 90, 11, 4]


class RecordingSim(SimBackend):
    """The simulated device, noting in order each block the host launches and each copy it waits for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, str]] = []

    def launch(self, work, fn, x, *args):
        self.events.append(("launch", work.unit))
        return super().launch(work, fn, x, *args)

    def host_wait(self, handle) -> None:
        self.events.append(("wait", getattr(handle, "unit", "")))
        super().host_wait(handle)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=3), tmp_path_factory.mktemp("streamer") / "tiny")
    return folder, load_spec(folder)


def _model(tiny, placement, backend) -> PlacedModel:
    folder, spec = tiny
    return PlacedModel(spec, CheckpointSource(Checkpoint(folder), spec, torch.float32, "none"), placement, backend)


def test_a_disk_unit_is_launched_before_the_host_waits_for_its_copy(tiny):
    placement = Placement.uniform(tiny[1], "disk", "stream", prefetch_depth=2, read_ahead=2, page_cache=frozenset())
    sim = RecordingSim(gpu_profile())
    logits = offload_logits(_model(tiny, placement, sim), PROMPT)
    launched = [unit for kind, unit in sim.events if kind == "launch"]
    waited = [unit for kind, unit in sim.events if kind == "wait"]
    for unit in waited:
        assert sim.events.index(("launch", unit)) < sim.events.index(("wait", unit)), unit
    assert launched == [u.name for u in tiny[1].units()] and sorted(waited) == sorted(launched[:-1])  # the last: next step
    assert torch.allclose(logits, offload_logits(_model(tiny, placement, CPUBackend()), PROMPT), rtol=1e-5, atol=1e-5)


def test_a_cpu_unit_read_after_a_streamed_disk_unit_gets_its_buffer(tiny):
    """One read buffer: the streamed layer.0 holds it until its copy lands, and layer.1, computed on the CPU from
    a read, needs it next (the host must give it back before it blocks on that read, or it waits forever)."""
    placement = Placement.uniform(tiny[1], "cpu", "cpu", prefetch_depth=1, read_ahead=1, page_cache=frozenset())
    placement.units["layer.0"] = UnitPlacement("disk", "stream", "stream", "gpu")
    placement.units["layer.1"] = UnitPlacement("disk", "cpu", "cpu", "cpu")
    placement.units["layer.2"] = UnitPlacement("disk", "stream", "stream", "gpu")
    model = _model(tiny, placement, SimBackend(gpu_profile()))
    got: list[torch.Tensor] = []
    run = threading.Thread(target=lambda: got.append(offload_logits(model, PROMPT)), daemon=True)
    run.start()
    run.join(timeout=60)
    assert got, "the host blocked on layer.1's read while layer.0 held the read buffer"
    ref = offload_logits(_model(tiny, placement, CPUBackend()), PROMPT)
    assert torch.allclose(got[0], ref, rtol=1e-5, atol=1e-5) and model.reader.max_in_use == 1


def test_a_streamed_unit_s_weights_are_made_once_per_slot_and_layout(tiny, monkeypatch):
    made = []
    materialize = streamer.materialize
    monkeypatch.setattr(streamer, "materialize", lambda layout, *a, **k: made.append(layout) or materialize(layout, *a,
                                                                                                            **k))
    placement = Placement.uniform(tiny[1], "cpu", "stream", prefetch_depth=2)
    model = _model(tiny, placement, SimBackend(gpu_profile()))
    for _ in range(3):  # three steps of every unit: 18 acquisitions
        offload_logits(model, PROMPT)
    n_layouts = len(set(model.layouts.values()))  # the layers share one; embed, norm and lm_head one each
    assert n_layouts < len(model.layouts) and len(made) <= model.ring.n_slots * n_layouts < 18


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    hf = make_hf_model("llama", num_hidden_layers=3, max_position_embeddings=1024)
    folder = save_hf_model(hf, tmp_path_factory.mktemp("streamer") / "long")
    return folder, load_spec(folder)


def _generate(model, prompt: list[int], step_tokens: int, mixed: bool) -> list[int]:
    """Greedy tokens of one prompt, in steps of step_tokens; a failure, not a hang, if a read buffer never comes."""
    seq = Sequence(0, prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    gen = Generator(model, max_batch_size=1, max_model_len=700, step_tokens=step_tokens, mixed=mixed)
    errors: list[BaseException] = []
    run = threading.Thread(target=lambda: _catch(errors, run_to_end, gen, [seq]), daemon=True)
    run.start()
    run.join(timeout=60)
    assert not run.is_alive(), "the generator blocked for 60 s (waiting on a read no unit releases?)"
    if errors:
        raise errors[0]
    return seq.output_ids


def _catch(errors: list[BaseException], fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - raised again on the test's thread
        errors.append(e)


@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("weights, compute", [("cpu", "stream"), ("disk", "stream"), ("disk", "cpu")])
def test_a_prompt_longer_than_a_pass_runs_no_lm_head_before_its_last_pass(long_context, weights, compute, mixed):
    """A 600-token prompt in passes of 384: the first pass ends no prompt and samples nothing, so it runs every unit
    but the lm_head (planner/schedule.step_units), which is neither copied nor read then (its copy filled the slot
    the next pass's layer.0 needed: 'layer.0 was not prefetched'; its unread disk read held a read buffer). The
    tokens are those of one pass over the whole prompt, on the CPU backend and on the strict simulated GPU."""
    spec = long_context[1]
    prompt = torch.randint(1, spec.vocab_size, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    kwargs = dict(prefetch_depth=2, read_ahead=2, page_cache=frozenset())
    passes = Placement.uniform(spec, weights, compute, prefill_pass_tokens=384, **kwargs)
    cpu = _model(long_context, passes, CPUBackend())
    ours = _generate(cpu, prompt, 384, mixed)
    whole = _generate(_model(long_context, Placement.uniform(spec, weights, compute, **kwargs), CPUBackend()), prompt,
                      700, mixed)
    assert ours == whole
    assert _generate(_model(long_context, passes, SimBackend(gpu_profile())), prompt, 384, mixed) == ours
    # the lm_head ran in the 3 steps that sampled (the prompt's last pass and 2 decode steps), and only there
    runs = [e for e in cpu.backend.log if e[1] == "lm_head" and e[0] in ("copy", "compute")]
    assert [e[0] for e in runs] == (["copy", "compute"] * 3 if compute == "stream" else [])
    assert sum(s.unit == "lm_head" and s.kind == "disk_read" for s in cpu.timeline.spans) == 3 * (weights == "disk")


def test_the_pricer_copies_the_lm_head_in_the_passes_that_sample_only(long_context):
    """The cost model prices what that run does: a layer is copied once per pass, the lm_head once per pass that
    samples (one 600-token prompt in 2 passes: once; 2 short prompts packed into 2 passes: twice)."""
    spec, hw = long_context[1], gpu_profile()
    units = {u.kind: u for u in spec.units()}
    for n_seqs, n_passes, head_copies in [(1, 2, 1), (2, 2, 2), (1, 1, 1)]:
        phase = Phase("prefill", n_seqs, 600, 300, 0, n_passes)
        for kind, copies in [("layer", n_passes), ("lm_head", head_copies)]:
            cost = unit_cost(spec, units[kind], "fp32", hw, phase, "fp32")
            assert cost.pcie_s == pytest.approx(copies * units[kind].nbytes("fp32") / hw.h2d_pinned_bps), kind


def _read_ahead(reader, n: int) -> list[str]:
    """The units reader has read, once n have been (a failure after 30 s)."""
    for _ in range(3000):
        with reader._cond:
            if len(reader._ready) >= n:
                return list(reader._ready)
        threading.Event().wait(0.01)
    raise AssertionError(f"the reader read {len(reader._ready)} of {n} units in 30 s")


@pytest.mark.parametrize("compute", ["cpu", "stream"])
def test_a_step_prepared_before_it_begins_has_its_reads_done_and_answers_the_same(tiny, compute):
    """PlacedModel.prepare_step, as a verify pass has it before its draft's steps: the step's first disk units are
    read while the host does other work; the step takes those reads (none read twice, none left holding the read
    buffers, also where the prepared kind of step was not the one that ran: a pass that samples nothing, which reads
    no lm_head) and answers as a step not prepared."""
    placement = Placement.uniform(tiny[1], "disk", compute, prefetch_depth=2, read_ahead=2, page_cache=frozenset())
    make = (lambda: SimBackend(gpu_profile())) if compute == "stream" else CPUBackend
    ref = offload_logits(_model(tiny, placement, make()), PROMPT)
    model = _model(tiny, placement, make())
    model.prepare_step("prefill")
    first = model.streamer.reads[True][:2]
    assert "lm_head" not in first and _read_ahead(model.reader, 2) == first
    assert torch.allclose(offload_logits(model, PROMPT), ref, rtol=1e-5, atol=1e-5)
    units = model.streamer.reads[True]  # (on the CPU, not the embedding: its rows are read as looked up)
    assert sorted(s.unit for s in model.timeline.spans if s.kind == "disk_read" and s.unit in units) == sorted(units)
    model.prepare_step("decode")  # then a step of another kind: a prefill pass that samples nothing
    positions = torch.arange(len(PROMPT))[None]
    step = model.make_step(positions, torch.ones_like(positions, dtype=torch.bool), len(PROMPT))
    with torch.inference_mode():
        model.forward(torch.tensor([PROMPT]), step, model.new_cache(1, len(PROMPT)), logits=False)
    assert torch.allclose(offload_logits(model, PROMPT), ref, rtol=1e-5, atol=1e-5)
    model.streamer.settle()  # (a streamed disk unit's buffer goes back once its copy has landed)
    assert not model.reader._live and not model.reader._queue  # every read taken and its buffer given back


def test_a_step_prepared_issues_its_first_copies_and_one_of_another_kind_frees_them(tiny):
    """The first copies of a prepared step are issued before it begins; where the step that runs streams other
    units (here layer.0 streams in prefill and computes on the CPU in decode), they are freed and the answers are
    those of steps not prepared."""
    spec = tiny[1]
    placement = Placement.uniform(spec, "cpu", "stream", prefetch_depth=2, read_ahead=2, page_cache=frozenset())
    placement.units["layer.0"] = UnitPlacement("cpu", "stream", "cpu", "cpu")
    ref = _generate(_model(tiny, placement, SimBackend(gpu_profile())), PROMPT, 64, True)
    model = _model(tiny, placement, SimBackend(gpu_profile()))
    model.prepare_step("prefill")
    assert model.ring.holds("embed") and model.ring.holds("layer.0")
    model.prepare_step("decode")  # once per step: the first call's copies stand
    assert model.ring.holds("layer.0") and not model.ring.holds("layer.1")
    assert torch.allclose(offload_logits(model, PROMPT), offload_logits(
        _model(tiny, placement, SimBackend(gpu_profile())), PROMPT), rtol=1e-5, atol=1e-5)
    seq = Sequence(0, PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    gen = Generator(model, max_batch_size=1, max_model_len=64, step_tokens=64)
    gen.between_steps = lambda: model.prepare_step("prefill")  # copies layer.0, but decode steps run
    run_to_end(gen, [seq])
    assert seq.output_ids == ref
    assert sum(e[0] == "discard" for e in model.backend.log) >= 2
