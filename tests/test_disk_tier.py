"""The disk tier: disk units are read from the files that already hold their bytes (a safetensors checkpoint in the
compute dtype, a GGUF file's blocks, the packed-weight cache), not from a copy written for the run; whatever the
source, a model run from disk gives the same greedy tokens as the same model held in RAM."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_model, save_hf_model
from gguf_support import K_TINY, write_gguf

from offload import LLM, SamplingParams
from offload.errors import PlanError
from offload.planner import Placement
from offload.weights.model_files import model_spec

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]


def _run(path, weights: str, **kwargs) -> tuple[list[list[int]], LLM]:
    spec = model_spec(path)
    page_cache = kwargs.pop("page_cache", None)
    placement = Placement.uniform(spec, weights, "cpu", page_cache=page_cache)
    llm = LLM(str(path), placement=placement, backend="cpu", host_baseline=0, **kwargs)
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return [o.token_ids for o in out], llm


def _same_tokens_from_disk(path, **kwargs) -> LLM:
    """Tokens of the model in RAM, from disk units the page cache keeps (computed in place where they can be) and
    from disk units read ahead and dropped from the page cache, all equal; the last LLM is returned."""
    in_ram, _ = _run(path, "cpu", **kwargs)
    kept, kept_llm = _run(path, "disk", **kwargs)
    read, llm = _run(path, "disk", page_cache=frozenset(), **kwargs)
    assert kept == in_ram and read == in_ram
    assert not llm.model._in_place and llm.model.reader is not None
    llm.kept = kept_llm.model
    return llm


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_checkpoint_in_the_compute_dtype_is_read_in_place(tmp_path, dtype):
    model = make_hf_model("llama")
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    path = save_hf_model(model, tmp_path / "tiny")
    llm = _same_tokens_from_disk(path, dtype=dtype)
    disk = llm.model.disk
    assert disk.spilled == [] and disk.spill_folder is None  # no spill folder is made at all
    assert {e.path for ex in disk.extents.values() for e in ex} == {str(path / "model.safetensors")}
    assert "embed" in llm.model._embed_rows  # read a row at a time
    kept = llm.kept  # the page cache keeps them: every layer and the lm_head computed in place, nothing read ahead
    assert kept._in_place == set(kept.disk.sizes) - {"embed"} and kept.reader is None


def test_a_checkpoint_in_another_dtype_is_spilled_once_converted(tmp_path):
    path = save_hf_model(make_hf_model("llama").to(torch.bfloat16), tmp_path / "tiny")
    llm = _same_tokens_from_disk(path, dtype="fp32")
    assert sorted(llm.model.disk.spilled) == sorted(llm.model.disk.sizes)


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
def test_quantized_units_are_read_from_the_packed_cache(tmp_path, monkeypatch, quantization):
    monkeypatch.setenv("OFFLOAD_PACKED_CACHE", "1")
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path / "cache"))
    path = save_hf_model(make_hf_model("llama"), tmp_path / "tiny")
    _run(path, "cpu", quantization=quantization)  # writes the cache entry
    llm = _same_tokens_from_disk(path, quantization=quantization)
    disk = llm.model.disk
    assert disk.spilled == []
    files = {e.path for ex in disk.extents.values() for e in ex}
    assert files and all(f.startswith(str(tmp_path / "cache")) or f.endswith("model.safetensors") for f in files)


@pytest.mark.parametrize("qtype,in_file", [("F32", True), ("Q4_1", True), ("Q4_K", True), ("Q6_K", True),
                                           ("Q8_0", False)])
def test_gguf_blocks_are_read_from_the_gguf_file(tmp_path, qtype, in_file):
    """q4_1 and the K-quants keep GGUF's blocks (and q/k rows are put back in order after the read); q8_0 is
    split into planes in the kernels' order, which no file holds, so it is spilled."""
    k_quant = qtype.endswith("_K")
    model = make_hf_model("llama", **({**K_TINY, "vocab_size": 300} if k_quant else {"vocab_size": 300}))
    path = write_gguf(model, tmp_path / f"tiny-{qtype}.gguf", qtype, random_quants=k_quant)
    llm = _same_tokens_from_disk(path, dtype="fp32")
    layers = [n for n in llm.model.disk.sizes if n.startswith("layer.")]
    spilled = [n for n in llm.model.disk.spilled if n.startswith("layer.")]
    assert layers and spilled == ([] if in_file else layers)
    if in_file:
        assert any(e.rows is not None for e in llm.model.disk.extents["layer.0"])  # q and k rows reordered


def test_units_dropped_from_the_page_cache_read_the_same(tmp_path):
    path = save_hf_model(make_hf_model("llama"), tmp_path / "tiny")
    in_ram, _ = _run(path, "cpu")
    dropped, llm = _run(path, "disk", page_cache=frozenset())
    assert dropped == in_ram and llm.model.disk.drop == set(llm.model.disk.sizes)
    assert llm.model.reader.max_in_use >= 1


@pytest.mark.parametrize("qtype,quantization", [("Q4_1", "none"), ("Q4_1", "q8_0"), ("Q8_0", "none")])
def test_a_planned_disk_tier_the_page_cache_keeps_loads_and_runs_in_place(tmp_path, monkeypatch, qtype,
                                                                         quantization):
    """The planner counts no read-ahead for disk units the page cache keeps and the CPU computes; the load maps
    each of them in place, from a copy laid out for the kernels where the file's bytes are not (q/k rows
    reordered, a format converted): such a plan had failed to load ("the plan sized the disk read-ahead at 0
    bytes")."""
    from offload.planner import request as planner_request

    model = make_hf_model("llama", vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    path = write_gguf(model, tmp_path / f"small-{qtype}.gguf", qtype)
    monkeypatch.setattr(planner_request, "page_cache_room_bytes", lambda cpu_bytes: 2**30)
    kw = dict(quantization=quantization, backend="cpu", host_baseline=0, max_model_len=64, batch_size=2)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ram = LLM(str(path), **kw)
    cpu = ram.plan.tier("cpu")
    held = (cpu.kv_bytes + cpu.workspace_bytes + cpu.weights_bytes) / (1 - cpu.margin_bytes / cpu.budget_bytes)
    for eighths in range(1, 8):  # the largest budget short of the weights by which a layer goes to disk
        try:
            llm = LLM(str(path), cpu_memory=int(held - eighths * cpu.weights_bytes / 8), disk_memory="1GiB", **kw)
        except PlanError as e:  # the disk reads' own room does not fit yet
            if "does not fit" not in str(e):
                raise
            continue
        on_disk = {u.name for u in llm.plan.units if u.weight_tier == "disk"}
        if any(n.startswith("layer.") for n in on_disk):
            break
    assert any(n.startswith("layer.") for n in on_disk)
    assert all(u.page_cached for u in llm.plan.units if u.weight_tier == "disk" and u.kind != "embed")
    assert llm.plan.read_buffer_bytes == 0 and llm.model.reader is None
    assert llm.model._in_place == on_disk - {"embed"}
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert out == [o.outputs[0].token_ids for o in ram.generate(PROMPTS, params)]


@pytest.mark.parametrize("compute", ["cpu", "stream"])
def test_logits_in_pieces_read_the_lm_head_once_per_step(tmp_path, compute):
    """A step samples more sequences than the logits rows computed at once (the plan budgets that many): the
    lm_head, read from disk and dropped from the page cache (computed on the CPU, or copied to a simulated device
    from there), is read once for all the pieces; the second piece had waited forever for a read that no one had
    scheduled."""
    import threading

    from conftest import gpu_profile
    from offload.engine import run_to_end
    from offload.generate import Generator
    from offload.runtime.backends.cpu import CPUBackend
    from offload.runtime.backends.sim import SimBackend
    from offload.runtime.executor import PlacedModel
    from offload.sequence import Sequence
    from offload.weights.loader import Checkpoint
    from offload.weights.sources import CheckpointSource

    path = save_hf_model(make_hf_model("llama"), tmp_path / "tiny")
    spec = model_spec(path)
    prompts = [[1 + i, 2, 3 + i] for i in range(6)]
    outs, reads, steps = {}, [], []
    for where in ("cpu", "disk"):
        placement = Placement.uniform(spec, where, compute if where == "disk" else "cpu", page_cache=frozenset())
        backend = SimBackend(gpu_profile()) if compute == "stream" and where == "disk" else CPUBackend()
        model = PlacedModel(spec, CheckpointSource(Checkpoint(path), spec, torch.float32, "none"), placement, backend)
        seqs = [Sequence(i, p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts)]
        observed = []  # the thread governor hears of each step once, with all the rows it sampled
        model.threads.observe = lambda phase, seconds, n_tokens: observed.append(n_tokens)
        generator = Generator(model, max_batch_size=6, max_model_len=64, logits_rows=2)
        run = threading.Thread(target=run_to_end, args=(generator, seqs), daemon=True)
        run.start()
        run.join(timeout=120)
        assert not run.is_alive(), f"generation with the weights on {where} did not finish"
        model.flush()
        outs[where] = [s.output_ids for s in seqs]
        reads = [s for s in model.timeline.spans if s.kind == "disk_read" and s.unit == "lm_head"]
        steps = model.timeline.steps
        assert observed == [len(prompts)] * len(steps)
    assert outs["disk"] == outs["cpu"]
    assert len(reads) == len(steps) > 0
