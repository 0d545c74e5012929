"""The streamer as the host sees it (offload/runtime/streamer.py): a disk unit's compute is launched before the host
waits for its copy (its read buffer still goes back only once the copy has landed: tests/test_sim.py removes that
wait and gets a wrong answer), and a streamed unit's weights are views of its slot made once per slot and layout."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import gpu_profile, make_hf_model, offload_logits, save_hf_model
from offload.planner import Placement
from offload.planner.placement import UnitPlacement
from offload.runtime import streamer
from offload.runtime.backends.cpu import CPUBackend
from offload.runtime.backends.sim import SimBackend
from offload.runtime.executor import PlacedModel
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
