"""GGUF models: metadata -> ModelSpec, tensors used as stored, logits against transformers reading the same file,
split files, and bad files refused with one sentence."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_logits_close, hf_logits, make_hf_model, offload_logits
from gguf_support import K_TINY, write_gguf
from offload.errors import WeightsError

IDS = [5, 17, 42, 99, 3, 200, 7]
# offload's q4_0 kernels quantize activations to int8 per block of 32 (as llama.cpp does): logits move by up to
# ~1-2% of their range against a float reference; q8_0 takes int16 activations (1e-4 in test_quant).
# Q4_1 and the K-quants take int8 activations too (as llama.cpp's q8_1/q8_K); on the tiny random models below
# the measured differences were 7e-4 (Q4_K, Q5_K) to 3.4e-2 (Q6_K, whose random int8 sub-block scales make some
# logits hinge on a few large weights).
TOLERANCE = {"F32": 1e-4, "F16": 1e-3, "Q8_0": 1e-3, "Q4_0": 3e-2, "Q4_1": 5e-2, "Q4_K": 5e-2, "Q5_K": 5e-2,
             "Q6_K": 5e-2}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """GGUF tables and tokenizers of these throwaway files go to a cache folder of the test's own."""
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path / "cache"))


def _transformers(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_f32_gguf_equals_transformers_tokens_and_logits(tmp_path, arch):
    from offload import LLM, SamplingParams

    path = write_gguf(make_hf_model(arch, vocab_size=300), tmp_path / f"tiny-{arch}.gguf", "F32", arch=arch)
    llm, ref = LLM(str(path)), _transformers(path)
    assert_logits_close(offload_logits(llm.model, IDS), hf_logits(ref, IDS), rel=TOLERANCE["F32"])
    ours = llm.generate([IDS], SamplingParams(max_tokens=10, temperature=0))[0].token_ids
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([IDS]), max_new_tokens=10, do_sample=False)[0, len(IDS):].tolist()
    assert ours[: len(theirs)] == theirs


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0"])
def test_quantized_gguf_logits_close_to_transformers(tmp_path, qtype):
    from offload import LLM

    path = write_gguf(make_hf_model("llama", vocab_size=300), tmp_path / f"tiny-{qtype}.gguf", qtype)
    llm = LLM(str(path))
    assert llm.plan.weight_format == "gguf"
    assert_logits_close(offload_logits(llm.model, IDS), hf_logits(_transformers(path), IDS), rel=TOLERANCE[qtype])


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_block_formats_logits_close_to_transformers(tmp_path, qtype):
    """Q4_1 and the K-quants computed as stored (a 256-wide model: K-quant rows are whole super-blocks)."""
    from offload import LLM
    from offload.kernels import PackedWeight

    model = make_hf_model("llama", **{**K_TINY, "vocab_size": 300})
    path = write_gguf(model, tmp_path / f"tiny-{qtype}.gguf", qtype, random_quants=True)
    llm = LLM(str(path))
    assert llm.spec.stored_format == qtype.lower()
    from offload.weights.gguf import GGUFFile
    from offload.weights.gguf_source import GGUFSource

    layer = GGUFSource(GGUFFile(path), llm.spec, torch.float32).load(llm.spec.units()[1])
    assert isinstance(layer.down, PackedWeight) and layer.down.fmt == qtype.lower()
    assert_logits_close(offload_logits(llm.model, IDS), hf_logits(_transformers(path), IDS), rel=TOLERANCE[qtype])


def test_table_cache_is_used_and_invalidated(tmp_path, monkeypatch):
    """A second open reads the cached table, not the file's metadata; a changed file is parsed again."""
    import gguf

    from offload.weights.gguf import GGUFFile

    path = write_gguf(make_hf_model("llama", vocab_size=300), tmp_path / "m.gguf", "Q8_0")
    first = GGUFFile(path)
    calls = []
    real = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: calls.append(a) or real(*a, **k))
    again = GGUFFile(path)
    assert calls == [] and again.tensors == first.tensors and again.fields == first.fields
    write_gguf(make_hf_model("llama", vocab_size=300, num_hidden_layers=3), path, "Q8_0")
    assert len(GGUFFile(path).tensors) > len(first.tensors) and len(calls) == 1


def test_tensors_are_used_as_stored(tmp_path):
    """q8_0 blocks go straight into the kernels' layout: the packed weight dequantizes to gguf-py's values."""
    import gguf

    from offload.kernels import PackedWeight
    from offload.weights.gguf import GGUFFile
    from offload.weights.gguf_source import GGUFSource
    from offload.weights.model_files import model_spec

    path = write_gguf(make_hf_model("qwen2", vocab_size=300), tmp_path / "q8.gguf", "Q8_0", arch="qwen2")
    spec = model_spec(path)
    source = GGUFSource(GGUFFile(path), spec, torch.float32)
    down = source.linear("model.layers.1.mlp.down_proj.weight")
    assert isinstance(down, PackedWeight) and down.fmt == "q8_0"
    stored = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    expect = gguf.quants.dequantize(stored.data, stored.tensor_type)
    assert torch.equal(down.dequantize(), torch.from_numpy(expect.reshape(down.shape)))


def test_mixed_type_layer_logits(tmp_path):
    """A layer whose v (and up) are stored in other types than q and k, as in Q4_K_M files."""
    from offload import LLM
    from offload.kernels.ops import StackedWeight

    types = {"blk.0.attn_v.weight": "Q8_0", "blk.1.ffn_up.weight": "F32", "blk.1.attn_k.weight": "F16"}
    path = write_gguf(make_hf_model("llama", vocab_size=300), tmp_path / "mixed.gguf", "Q4_0", types=types)
    llm = LLM(str(path))
    assert_logits_close(offload_logits(llm.model, IDS), hf_logits(_transformers(path), IDS), rel=TOLERANCE["Q4_0"])
    from offload.weights.gguf import GGUFFile
    from offload.weights.gguf_source import GGUFSource

    layer = GGUFSource(GGUFFile(path), llm.spec, torch.float32).load(llm.spec.units()[1])
    assert isinstance(layer.qkv, StackedWeight) and [p.shape[0] for p in layer.qkv.parts] == [64, 32, 32]
    from offload.kernels.layer import FUSABLE, weights_fusable

    assert weights_fusable(layer) == FUSABLE  # the C++ layer runs the parts one after another


def test_spec_from_metadata(tmp_path):
    from offload.weights.model_files import model_spec

    model = make_hf_model("qwen2", vocab_size=300, tie_word_embeddings=True, rope_theta=50000.0, rms_norm_eps=1e-6,
                          max_position_embeddings=96)
    spec = model_spec(write_gguf(model, tmp_path / "q.gguf", "Q8_0", arch="qwen2"))
    assert (spec.architecture, spec.vocab_size, spec.hidden_size, spec.intermediate_size) == ("qwen2", 300, 64, 128)
    assert (spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim) == (2, 4, 2, 16)
    assert spec.tie_word_embeddings and spec.qkv_bias and spec.max_position_embeddings == 96
    assert spec.rope.theta == 50000.0 and spec.rms_norm_eps == pytest.approx(1e-6)
    assert spec.stored_format == "q8_0"


def test_planner_counts_stored_bytes(tmp_path):
    """Under the 'gguf' weight format a layer's linears count their own types' bytes (hand-computed)."""
    from offload.formats import AS_STORED
    from offload.weights.model_files import model_spec

    types = {"blk.0.attn_v.weight": "Q4_0"}
    spec = model_spec(write_gguf(make_hf_model("llama", vocab_size=300), tmp_path / "m.gguf", "Q8_0", types=types))
    layer0 = spec.units()[1]
    # q 64x64, k 32x64, o 64x64, gate/up 128x64, down 64x128 in q8_0 (34 bytes per 32); v 32x64 in q4_0 (18 per 32);
    # two norms of 64 fp32
    q8 = (64 * 64 + 32 * 64 + 64 * 64 + 2 * 128 * 64 + 64 * 128) // 32 * 34
    assert layer0.nbytes(AS_STORED, "fp32") == q8 + 32 * 64 // 32 * 18 + 2 * 64 * 4
    embed = spec.units()[0]
    assert embed.nbytes(AS_STORED, "fp32") == 300 * 64 * 4  # dequantized for lookup


def test_split_gguf_loads_as_one_model(tmp_path):
    from offload import LLM

    model = make_hf_model("llama", vocab_size=300)
    one = write_gguf(model, tmp_path / "one" / "m.gguf", "Q8_0", mkdir=True)
    split = write_gguf(model, tmp_path / "split" / "m.gguf", "Q8_0", mkdir=True, split_max_tensors=8)
    shards = sorted(split.parent.glob("*.gguf"))
    assert len(shards) > 2 and shards[0].name.endswith("-00001-of-%05d.gguf" % len(shards))
    ref = offload_logits(LLM(str(one)).model, IDS)
    assert torch.equal(offload_logits(LLM(str(shards[1])).model, IDS), ref)
    shards[-1].unlink()
    with pytest.raises(WeightsError, match="shards of a split GGUF model"):
        LLM(str(shards[0]))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "offload", *args], capture_output=True, text=True, timeout=300)


def _bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    good = write_gguf(make_hf_model("llama", vocab_size=300), tmp_path / "good.gguf", "Q8_0")
    data = good.read_bytes()
    cases = {}
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) * 2 // 3])
    cases["truncated"] = (tmp_path / "cut.gguf", "truncated")
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + data[4:])
    cases["magic"] = (tmp_path / "magic.gguf", "not a GGUF file")
    (tmp_path / "arch.gguf").write_bytes(data.replace(b"llama", b"gpt2\0", 1))
    cases["architecture"] = (tmp_path / "arch.gguf", "architecture")
    cases["tensor type"] = (write_gguf(make_hf_model("llama", vocab_size=300), tmp_path / "q1_0.gguf", "Q8_0",
                                       types={"blk.1.ffn_down.weight": "Q1_0"}, random_quants=True),
                            "stored as Q1_0")
    cases["tokenizer"] = (write_gguf(make_hf_model("llama", vocab_size=300), tmp_path / "notok.gguf", "Q8_0",
                                     tokenizer=False), "no tokenizer")
    return cases


def test_bad_gguf_files_get_one_sentence(tmp_path):
    from offload import LLM

    for what, (path, message) in _bad_files(tmp_path).items():
        with pytest.raises(WeightsError, match=message):
            LLM(str(path))


def test_bad_gguf_cli_exits_2_without_traceback(tmp_path):
    for what, (path, message) in _bad_files(tmp_path).items():
        done = _cli("generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "2")
        assert done.returncode == 2, (what, done.stderr)
        assert "Traceback" not in done.stderr and message in done.stderr, (what, done.stderr)


def test_unsupported_type_requantized_on_request(tmp_path, monkeypatch):
    """Asked for q8_0, a tensor of a type gguf-py dequantizes but offload does not read is dequantized with gguf-py
    and quantized again, with a warning. gguf-py 0.19 dequantizes no type outside offload's table: MXFP4 is taken out
    of it here to stand for one."""
    from gguf_support import hf_from_gguf
    from offload import LLM
    from offload.weights import gguf

    model = make_hf_model("llama", vocab_size=300)
    path = write_gguf(model, tmp_path / "mxfp4.gguf", "Q8_0", types={"blk.1.ffn_down.weight": "MXFP4"})
    monkeypatch.setattr(gguf, "GGUF_NAMES", {k: v for k, v in gguf.GGUF_NAMES.items() if k != "MXFP4"})
    with pytest.raises(WeightsError, match="stored as MXFP4, .* pass a quantization"):
        LLM(str(path))
    with pytest.warns(UserWarning, match="stored as MXFP4, .* dequantized and quantized again"):
        llm = LLM(str(path), quantization="q8_0")
    assert_logits_close(offload_logits(llm.model, IDS), hf_logits(hf_from_gguf(model, path), IDS), rel=1e-2)


def test_a_type_gguf_py_cannot_dequantize_is_refused_even_on_request(tmp_path):
    """Q1_0 (llama.cpp's, which neither offload nor gguf-py 0.19 reads): refused by name with a quantization asked
    too, where it would fail in gguf-py's dequantize while loading."""
    from offload import LLM

    path = write_gguf(make_hf_model("llama", vocab_size=300), tmp_path / "q1_0.gguf", "Q8_0",
                      types={"blk.1.ffn_down.weight": "Q1_0"}, random_quants=True)
    with pytest.raises(WeightsError, match=r"blk\.1\.ffn_down\.weight .* stored as Q1_0, .* gguf-py cannot dequantize"):
        LLM(str(path), quantization="q8_0")


def test_job_config_accepts_gguf_path(tmp_path):
    from offload.jobs.config import check_files

    path = write_gguf(make_hf_model("llama", vocab_size=300), tmp_path / "m.gguf", "Q8_0")
    (tmp_path / "in.jsonl").write_text("")
    raw = {"model": {"path": str(path)}, "input": {"path": str(tmp_path / "in.jsonl")}}
    assert check_files(raw) == []
    raw["model"]["path"] = str(tmp_path / "missing.gguf")
    assert check_files(raw)


def test_unpermute_inverts_llama_cpp_permutation():
    from gguf_support import permute
    from offload.weights.gguf_source import _unpermute_rows

    w = np.arange(32 * 3).reshape(32, 3)
    for heads in (1, 2, 4):
        assert np.array_equal(permute(w, heads)[_unpermute_rows(32, heads)], w)


def test_benchmark_gguf_writer_keeps_a_folders_weights(tmp_path):
    """scripts/make_gguf.write_f16_from_hf (what bench_cpu_decode hands llama.cpp): offload reading the written
    file gives the folder's greedy tokens (q/k rows permuted to GGUF's order and back; F16 weights)."""
    from conftest import make_hf_model, save_hf_model
    from offload import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from make_gguf import default_vocab_size, write_f16_from_hf

    folder = save_hf_model(make_hf_model(vocab_size=default_vocab_size()), tmp_path / "hf")
    write_f16_from_hf(tmp_path / "model.gguf", folder)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [100, 2000, 345, 77, 9000]}
    want = LLM(str(folder)).generate(prompt, params)[0].token_ids
    assert LLM(str(tmp_path / "model.gguf")).generate(prompt, params)[0].token_ids == want
