"""The packed-weight cache: a second quantized load reads packed units instead of the checkpoint's floats, gives
the same bytes and tokens, and never uses an entry that is stale, half written or unwritable."""

from __future__ import annotations

import gc
import logging
import os

import pytest
import torch
from safetensors import safe_open

from conftest import make_hf_model, save_hf_model
from offload import LLM, SamplingParams
from offload.cli.main import main
from offload.kernels import PackedWeight
from offload.model.llama import LayerWeights
from offload.spec import load_spec
from offload.weights import cache
from offload.weights.loader import Checkpoint
from offload.weights.sources import CheckpointSource


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    """The cache turned on (conftest turns it off) in a folder of this test's own."""
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(cache.PACKED_CACHE_ENV, "1")
    return tmp_path / "cache" / "packed"


@pytest.fixture
def folder(tmp_path):
    return save_hf_model(make_hf_model("llama", num_hidden_layers=3), tmp_path / "tiny")


class CountingCheckpoint(Checkpoint):
    """A Checkpoint that records the name of every tensor read from it."""

    def __init__(self, folder):
        super().__init__(folder)
        self.read: list[str] = []

    def get(self, name, dtype=None):
        self.read.append(name)
        return super().get(name, dtype)


def load_units(folder, quantization="q4_0"):
    """(every unit's weights by name, names of the checkpoint tensors read) for one load."""
    spec = load_spec(folder)
    ckpt = CountingCheckpoint(folder)
    source = CheckpointSource(ckpt, spec, torch.float32, quantization)
    return {u.name: source.load(u) for u in spec.units()}, ckpt.read


def assert_same(a, b) -> None:
    """Bit-identical unit weights: tensors, PackedWeights (quants, scales, order) and LayerWeights."""
    if isinstance(a, LayerWeights):
        for field in a.__dataclass_fields__:
            assert_same(getattr(a, field), getattr(b, field))
    elif isinstance(a, PackedWeight):
        assert (a.fmt, a.shape, a.tiled) == (b.fmt, b.shape, b.tiled)
        assert torch.equal(a.qs, b.qs) and torch.equal(a.d, b.d)
    elif a is None:
        assert b is None
    else:
        assert a.dtype == b.dtype and torch.equal(a, b)


def complete_entries(root):
    return [e for e in cache.list_entries(root) if e.complete]


@pytest.mark.parametrize("quantization", ["q4_0", "q8_0"])
def test_second_load_reads_packed_units_not_the_checkpoint_and_gives_the_same_bytes(cache_root, folder,
                                                                                    quantization):
    first, read_first = load_units(folder, quantization)
    second, read_second = load_units(folder, quantization)
    assert any(".mlp.gate_proj." in n for n in read_first) and "lm_head.weight" in read_first
    assert sorted(read_second) == ["model.embed_tokens.weight", "model.norm.weight"]  # never quantized
    for name in first:
        assert_same(first[name], second[name])
    assert [e.quantization for e in complete_entries(cache_root)] == [quantization]


def test_cached_load_generates_the_same_greedy_tokens(cache_root, folder, monkeypatch):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 3, 99], [42]]
    monkeypatch.setenv(cache.PACKED_CACHE_ENV, "0")
    uncached = [o.token_ids for o in LLM(str(folder), quantization="q4_0").generate(prompts, params)]
    assert not cache_root.exists()  # OFFLOAD_PACKED_CACHE=0 writes nothing
    monkeypatch.setenv(cache.PACKED_CACHE_ENV, "1")
    writing = [o.token_ids for o in LLM(str(folder), quantization="q4_0").generate(prompts, params)]
    reading = [o.token_ids for o in LLM(str(folder), quantization="q4_0").generate(prompts, params)]
    assert uncached == writing == reading
    assert len(complete_entries(cache_root)) == 1


def test_unit_files_are_plain_safetensors(cache_root, folder):
    load_units(folder)
    (entry,) = complete_entries(cache_root)
    files = sorted(p.name for p in entry.path.iterdir())
    assert files == ["entry.json", "layer.0.safetensors", "layer.1.safetensors", "layer.2.safetensors",
                     "lm_head.safetensors"]
    with safe_open(str(entry.path / "layer.0.safetensors"), "pt") as f:
        qkv = f.get_tensor("layer.0.qkv.qs")
        assert qkv.dtype == torch.uint8 and list(qkv.shape) == [128, 32]  # q+k+v rows [64+32+32], 64/2 bytes


def test_a_changed_checkpoint_gets_a_new_entry_and_the_old_one_goes(cache_root, folder):
    load_units(folder)
    (old,) = complete_entries(cache_root)
    save_hf_model(make_hf_model("llama", num_hidden_layers=3, seed=1), folder)  # same names and shapes
    fresh, read = load_units(folder)
    assert any(".mlp.down_proj." in n for n in read)  # quantized again, not the stale entry
    (new,) = complete_entries(cache_root)
    assert new.path != old.path and not old.path.exists()
    again, _ = load_units(folder)
    for name in fresh:
        assert_same(fresh[name], again[name])


def test_touching_a_weights_file_invalidates_the_entry(cache_root, folder):
    load_units(folder)
    st = (folder / "model.safetensors").stat()
    os.utime(folder / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _, read = load_units(folder)
    assert any(".self_attn.q_proj." in n for n in read)


def test_a_truncated_entry_is_ignored_and_written_again(cache_root, folder):
    reference, _ = load_units(folder)
    (entry,) = complete_entries(cache_root)
    unit_file = entry.path / "layer.1.safetensors"
    unit_file.write_bytes(unit_file.read_bytes()[:1000])
    loaded, read = load_units(folder)
    assert any(n.startswith("model.layers.1.") for n in read)
    for name in reference:
        assert_same(reference[name], loaded[name])
    _, read = load_units(folder)  # repaired by the load that ignored it
    assert sorted(read) == ["model.embed_tokens.weight", "model.norm.weight"]


def test_a_load_that_stops_midway_leaves_no_entry(cache_root, folder, monkeypatch):
    import offload.weights.sources as sources

    real = sources.load_layer

    def crash_at_layer_2(ckpt, spec, i, *args):
        if i == 2:
            raise RuntimeError("killed")
        return real(ckpt, spec, i, *args)

    monkeypatch.setattr(sources, "load_layer", crash_at_layer_2)
    try:
        load_units(folder)
    except RuntimeError:
        pass
    assert not complete_entries(cache_root)
    gc.collect()
    assert list(cache_root.iterdir()) == []  # the temporary folder went with its load
    monkeypatch.setattr(sources, "load_layer", real)
    load_units(folder)
    assert len(complete_entries(cache_root)) == 1


def test_a_crashed_writers_folder_is_never_read_and_is_cleaned_up(cache_root, folder):
    load_units(folder)
    (entry,) = complete_entries(cache_root)
    crashed = cache_root / f"{cache.TMP_PREFIX}{entry.path.name}-999999999-deadbeef"  # no such process
    entry.path.rename(crashed)
    _, read = load_units(folder)
    assert any(".mlp.up_proj." in n for n in read) and not crashed.exists()
    assert len(complete_entries(cache_root)) == 1


def test_an_unwritable_cache_warns_once_and_loads(tmp_path, folder, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("OFFLOAD_CACHE", str(blocker))  # packed/ cannot be made under a file
    monkeypatch.setenv(cache.PACKED_CACHE_ENV, "1")
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("offload.weights.cache")
    logger.addHandler(handler)
    try:
        loaded, _ = load_units(folder)
    finally:
        logger.removeHandler(handler)
    assert len(records) == 1 and "could not write the packed-weight cache" in records[0].getMessage()
    monkeypatch.setenv(cache.PACKED_CACHE_ENV, "0")
    reference, _ = load_units(folder)
    for name in reference:
        assert_same(reference[name], loaded[name])


def test_cache_list_and_clear_on_the_command_line(cache_root, tmp_path, capsys):
    one = save_hf_model(make_hf_model("llama"), tmp_path / "one")
    two = save_hf_model(make_hf_model("llama", seed=2), tmp_path / "two")
    load_units(one, "q4_0")
    load_units(one, "q8_0")
    load_units(two, "q4_0")
    assert main(["cache", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[-1].startswith("3 entries,")
    assert sum(str(one.resolve()) in line for line in lines) == 2 and "q8_0 fp32" in "".join(lines)
    assert main(["cache", "clear", "--model", str(one)]) == 0
    assert capsys.readouterr().out.startswith("removed 2 entries")
    assert [e.model for e in complete_entries(cache_root)] == [str(two.resolve())]
    assert main(["cache", "clear", "--model", str(tmp_path / "three")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no packed weights are cached for" in err[0]
    assert main(["cache", "clear"]) == 0
    assert cache.list_entries(cache_root) == []
