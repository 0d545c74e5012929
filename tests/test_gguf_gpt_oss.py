"""gpt-oss GGUF files as llama.cpp's converter (GptOssModel) writes them: architecture gpt-oss; the experts' stacked
weights as [E, out, in] with the interleaved gate|up split into ffn_gate_exps and ffn_up_exps, each with its stacked
biases; sinks as attn_sinks.weight, the router as ffn_gate_inp (with its bias), the pre-MLP norm as
post_attention_norm; YaRN's keys (not truncate, which GGUF cannot hold: the family's, false as in the releases).

F32 files (the converter's float experts, tests/gguf_support.write_gguf): logits within 1e-4 of transformers' logit
range, LLM(folder)'s greedy tokens, the folder's spec. MXFP4 files converted from a release laid out as OpenAI's
(tests/test_mxfp4_checkpoint.released: experts as MXFP4 blocks and scales), whose blocks the converter repacks
into GGUF's bit for bit: offload on the file gives offload on the released folder, on every placement (the same
blocks through the same kernels: logits within 1e-6 of the range, the same greedy tokens); transformers is the
folder's reference in test_mxfp4_checkpoint.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from conftest import assert_logits_close, gpu_profile, hf_logits, make_hf_model, offload_logits, save_hf_model
from gguf_support import gguf_name, write_gguf
from offload.engine import run_to_end
from offload.generate import Generator
from offload.planner.placement import Placement
from offload.runtime.backends.cpu import CPUBackend
from offload.runtime.backends.sim import SimBackend
from offload.runtime.executor import PlacedModel
from offload.sampling import SamplingParams
from offload.sequence import Sequence
from offload.spec import load_spec
from offload.weights import mxfp4
from offload.weights.gguf import GGUFFile
from offload.weights.gguf_config import gguf_spec
from offload.weights.gguf_source import GGUFSource
from offload.weights.loader import Checkpoint
from offload.weights.sources import CheckpointSource
from test_families import CASES
from test_mxfp4_checkpoint import released  # noqa: F401 (the fixture of a tiny release, and transformers on it)

F32_CASES = ["gpt-oss-gqa4", "gpt-oss-yarn-gqa8"]  # the default YaRN (factor 32) and one past its original context
VOCAB = 300  # room for the byte tokenizer


def _prompt(n: int, vocab: int = VOCAB, seed: int = 1) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """GGUF tables and tokenizers of these throwaway files go to a cache folder of the test's own."""
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module", params=F32_CASES)
def f32(request, tmp_path_factory):
    """(transformers model, its folder, its F32 GGUF file)."""
    arch, overrides = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(arch, **{**overrides, "vocab_size": VOCAB})
    return hf, save_hf_model(hf, root / "hf"), write_gguf(hf, root / f"{request.param}.gguf", arch=arch)


def _release_as_gguf(hf, folder, path):
    """The converter on a release: each experts tensor's blocks and scales repacked into GGUF's MXFP4 blocks
    (mxfp4.gguf_blocks moves the nibbles as its transform_nibble_layout does), gate|up's rows split into gate (even)
    and up (odd); the other tensors F32."""
    from safetensors.torch import load_file

    tensors, raw = load_file(folder / "model.safetensors"), {}
    for i in range(hf.config.num_hidden_layers):
        stem = f"model.layers.{i}.mlp.experts."
        for stored, parts in (("gate_up_proj", (("gate_proj", 0), ("up_proj", 1))), ("down_proj", (("down_proj", 0),))):
            blocks, scales = tensors[f"{stem}{stored}_blocks"], tensors[f"{stem}{stored}_scales"]
            step = len(parts)
            for proj, first in parts:
                b, s = blocks[:, first::step], scales[:, first::step]  # [E, rows, G, 16], [E, rows, G]
                e, rows, groups, _ = b.shape
                packed = mxfp4.gguf_blocks(b.reshape(e * rows, groups, 16), s.reshape(e * rows, groups))
                raw[gguf_name(f"{stem}{proj}.weight", "gpt-oss")] = (packed.reshape(e, rows, -1).numpy(), "MXFP4")
    return write_gguf(hf, path, arch="gpt_oss", raw=raw, tokenizer=False)  # the release's vocabulary is too small


@pytest.fixture(scope="module")
def mxfp4_file(released, tmp_path_factory):  # noqa: F811
    hf, folder = released
    return hf, folder, _release_as_gguf(hf, folder, tmp_path_factory.mktemp("gpt-oss-mxfp4") / "m.gguf")


def _placed(spec, source, weights: str = "cpu", compute: str = "cpu") -> PlacedModel:
    backend = SimBackend(gpu_profile()) if compute == "stream" else CPUBackend()
    return PlacedModel(spec, source, Placement.uniform(spec, weights, compute), backend)


def _gguf_model(path, weights: str = "cpu", compute: str = "cpu") -> PlacedModel:
    spec = gguf_spec(GGUFFile(path))
    return _placed(spec, GGUFSource(GGUFFile(path), spec, torch.float32), weights, compute)


def _folder_model(folder, weights: str = "cpu", compute: str = "cpu") -> PlacedModel:
    spec = load_spec(folder)
    return _placed(spec, CheckpointSource(Checkpoint(folder), spec, torch.float32), weights, compute)


def _greedy(model, ids: list[int]) -> list[int]:
    seq = Sequence(0, ids, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    run_to_end(Generator(model, max_batch_size=1), [seq])
    return seq.output_ids


def test_f32_file_gives_transformers_logits_and_the_folders_tokens(f32):
    from offload import LLM

    hf, folder, path = f32
    ids = _prompt(24)  # past the sliding window (6) and the YaRN case's original context (16)
    llm = LLM(str(path), max_model_len=64)
    assert_logits_close(offload_logits(llm.model, ids), hf_logits(hf, ids))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ours = llm.generate([ids], params)[0].outputs[0].token_ids
    assert ours == LLM(str(folder), max_model_len=64).generate([ids], params)[0].outputs[0].token_ids


def test_the_files_spec_is_the_folders(f32):
    """Every number the family's math reads, from the metadata as from config.json: the alternating windows,
    YaRN (truncate false), the experts (count, top k, width, biases, the clamped SwiGLU), the biased attention."""
    _, folder, path = f32
    ours, ref = gguf_spec(GGUFFile(path)), load_spec(folder)
    assert ours.family is ref.family and ours.variant == ref.variant and ours.rope == ref.rope
    assert ours.moe == ref.moe and ours.rope.truncate is False
    assert (ours.head_dim, ours.qkv_bias, ours.o_bias, ours.tie_word_embeddings) == \
           (ref.head_dim, ref.qkv_bias, ref.o_bias, ref.tie_word_embeddings)
    assert {t.name: t.shape for t in ours.tensors()} == {t.name: t.shape for t in ref.tensors()}


def test_f32_experts_read_from_disk_give_the_resident_logits(f32):
    """Each expert's weights and biases read straight from their slices of the file's stacked tensors."""
    _, _, path = f32
    ids = _prompt(20, seed=2)
    assert_logits_close(offload_logits(_gguf_model(path, "disk"), ids), offload_logits(_gguf_model(path), ids),
                        rel=1e-6)


def test_the_mxfp4_file_holds_the_releases_experts(mxfp4_file):
    """gguf-py's dequantization of the written experts is transformers' of the release (the test's converter is
    the real one's), and offload reads them as stored."""
    hf, _, path = mxfp4_file
    reader = gguf.GGUFReader(path)
    stacked = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors
               if t.name.startswith("blk.0.ffn_") and t.name.endswith("_exps.weight")}
    gate_up = hf.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].transpose(1, 2).numpy()  # [E, 2F, D]
    assert np.array_equal(stacked["blk.0.ffn_gate_exps.weight"], gate_up[:, 0::2])
    assert np.array_equal(stacked["blk.0.ffn_up_exps.weight"], gate_up[:, 1::2])
    down = hf.state_dict()["model.layers.0.mlp.experts.down_proj"].transpose(1, 2).numpy()
    assert np.array_equal(stacked["blk.0.ffn_down_exps.weight"], down)
    spec = gguf_spec(GGUFFile(path))
    unit = next(u for u in spec.units() if u.kind == "experts")
    assert {t.stored for t in unit.tensors if t.role == "linear"} == {"mxfp4"}
    experts = GGUFSource(GGUFFile(path), spec, torch.float32).load(unit)
    assert experts.gate_up[0].fmt == "mxfp4" and experts.down_bias[0].dtype == torch.float32


@pytest.mark.parametrize("weights,compute", [("cpu", "cpu"), ("disk", "cpu"), ("cpu", "stream")])
def test_the_mxfp4_file_gives_the_released_folders_logits_and_tokens(mxfp4_file, weights, compute):
    """On the CPU (the fused MXFP4 kernels), read from disk, and streamed to the simulated GPU (dequantized there)."""
    _, folder, path = mxfp4_file
    ours, ref = _gguf_model(path, weights, compute), _folder_model(folder, weights, compute)
    ids = _prompt(20, vocab=160, seed=5)
    assert_logits_close(offload_logits(ours, ids), offload_logits(ref, ids), rel=1e-6)
    assert _greedy(ours, ids) == _greedy(ref, ids)
