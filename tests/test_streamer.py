"""The streamer as the host sees it (offload/runtime/streamer.py): a streamed unit's weights are views of its slot
made once per slot and layout."""

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
