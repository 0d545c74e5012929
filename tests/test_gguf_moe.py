"""Mixture-of-experts GGUF files (Mixtral as llama, Qwen2-MoE as qwen2moe, Qwen3-MoE as qwen3moe), written by
scripts/make_gguf.py as llama.cpp's converter writes them and quantized by llama.cpp itself: offload reads each
expert from its slice of the layer's stacked experts tensor, as stored.

References: transformers holding the file's own weights (gguf-py's dequantization, tests/gguf_support.hf_from_gguf):
an F16 file is held to the fp32 tolerance (1e-4 of the logit range) and greedy tokens equal; a q8_0 file, whose
kernels take int16 activations, to 1e-3 (as in tests/test_gguf.py) and greedy tokens equal. llama.cpp on the same
file: its greedy tokens on the written F16 file are transformers', and on quantized files its logits are within
3e-2 of offload's (measured: 1.7e-2 at most for q8_0, whose activations llama.cpp rounds to int8 and offload to
int16; 1e-2 for q4_0, both int8). q4_0 is not held to the dequantized transformers: int8 activations flip a
near-tied router choice of the tiny Mixtral (3.4 of a logit range of 11), in llama.cpp as in offload."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_logits_close, hf_logits, make_hf_model, offload_logits, save_hf_model
from gguf_support import hf_from_gguf
from offload.engine import run_to_end
from offload.errors import WeightsError
from offload.generate import Generator
from offload.kernels import PackedWeight
from offload.planner.placement import Placement
from offload.runtime.backends.cpu import CPUBackend
from offload.runtime.executor import PlacedModel
from offload.sampling import SamplingParams
from offload.sequence import Sequence
from offload.spec import load_spec
from offload.weights.gguf import GGUFFile
from offload.weights.gguf_config import gguf_spec
from offload.weights.gguf_source import GGUFSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import make_gguf  # noqa: E402

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]
PROMPT = [100, 2000, 345, 77, 9000, 12, 40000, 5, 17]
TOLERANCE = {"F16": 1e-4, "Q8_0": 1e-3, "llama.cpp": 3e-2}
# llama.cpp's qwen2moe has no dense layers: the tiny Qwen2-MoE's layer 1 (mlp_only_layers) is made MoE too
OVERRIDES = {"qwen2_moe": {"mlp_only_layers": []}}
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """arch -> (transformers model, its folder, the F16 GGUF written from the folder); tables and tokenizers of
    these files go to a cache folder of the module's own."""
    root = tmp_path_factory.mktemp("gguf-moe")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OFFLOAD_CACHE", str(root / "cache"))
        out = {}
        for arch in ARCHS:
            hf = make_hf_model(arch, vocab_size=make_gguf.default_vocab_size(), **OVERRIDES.get(arch, {}))
            folder = save_hf_model(hf, root / arch)
            make_gguf.write_f16_from_hf(root / f"{arch}.gguf", folder)
            out[arch] = (hf, folder, root / f"{arch}.gguf")
        yield out


def placed(path: Path) -> PlacedModel:
    """The model of a GGUF file, tensors as stored, every unit on the CPU."""
    spec = gguf_spec(GGUFFile(path))
    return PlacedModel(spec, GGUFSource(GGUFFile(path), spec, torch.float32), Placement.uniform(spec, "cpu", "cpu"),
                       CPUBackend())


def greedy(model, prompt: list[int], n: int = 8) -> list[int]:
    seq = Sequence(0, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    run_to_end(Generator(model, max_batch_size=1), [seq])
    return seq.output_ids


def hf_greedy(hf, prompt: list[int], n: int = 8) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_spec_from_moe_metadata_is_the_folders(files, arch):
    """Expert counts and widths, the shared expert, top-k renormalisation (llama.cpp's per-architecture choice,
    which the tiny configs share), q/k norms and head size come back from the metadata."""
    _, folder, path = files[arch]
    ours, theirs = gguf_spec(GGUFFile(path)), load_spec(folder)
    assert ours.architecture == arch and ours.moe == theirs.moe
    fields = ("hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "qkv_bias", "o_bias", "qk_norm")
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]
    assert [u.name for u in ours.units()] == [u.name for u in theirs.units()]
    assert ours.moe.norm_topk == make_gguf.LLAMA_CPP_NORM_TOPK[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_f16_moe_gguf_equals_transformers(files, arch):
    hf, _, path = files[arch]
    ref, model = hf_from_gguf(hf, path), placed(path)
    assert_logits_close(offload_logits(model, PROMPT), hf_logits(ref, PROMPT), rel=TOLERANCE["F16"])
    assert greedy(model, PROMPT) == hf_greedy(ref, PROMPT)


_LLAMA_CPP_CHILD = """
import json, sys
import numpy as np
from llama_cpp import Llama
path, ids, n, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = Llama(model_path=path, n_threads=2, n_ctx=64, verbose=False, logits_all=True)
llm.eval(ids)
np.save(out, np.array(llm.scores[:len(ids)], dtype=np.float32))
tokens = []
for _ in range(n):
    tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    llm.eval([tokens[-1]])
print("TOKENS", json.dumps(tokens))
"""


def llama_cpp_run(path: Path, prompt: list[int], n: int = 8) -> tuple[torch.Tensor, list[int]]:
    """llama.cpp on a GGUF file: the logits [S, V] of the prompt, then n greedy tokens. In a child process:
    llama-cpp-python redirects the process's output while it loads."""
    out = path.with_suffix(".logits.npy")
    done = subprocess.run([sys.executable, "-c", _LLAMA_CPP_CHILD, str(path), json.dumps(prompt), str(n), str(out)],
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    assert done.returncode == 0 and lines, done.stderr[-2000:]
    return torch.from_numpy(np.load(out)), json.loads(lines[0][7:])


@needs_llama_cpp
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_quantized_moe_gguf_read_as_stored(files, tmp_path, arch, kind):
    """Experts kept in llama.cpp's blocks, the router in fp32; logits against llama.cpp on the same file, and for
    q8_0 against transformers on the dequantized weights with greedy tokens equal (see the module's tolerances)."""
    hf, _, f16 = files[arch]
    path = tmp_path / f"{arch}.{kind}.gguf"
    make_gguf.quantize(f16, path, kind, threads=2)
    model = placed(path)
    experts = GGUFSource(GGUFFile(path), model.spec, torch.float32).load(model.spec.units()[2])
    assert isinstance(experts.down[5], PackedWeight) and experts.down[5].fmt == kind.lower()
    assert experts.router.dtype == torch.float32  # the router stays in the compute format
    ours = offload_logits(model, PROMPT)
    assert_logits_close(ours, llama_cpp_run(path, PROMPT, 0)[0], rel=TOLERANCE["llama.cpp"])
    if kind == "Q8_0":
        ref = hf_from_gguf(hf, path)
        assert_logits_close(ours, hf_logits(ref, PROMPT), rel=TOLERANCE[kind])
        assert greedy(model, PROMPT) == hf_greedy(ref, PROMPT)


@needs_llama_cpp
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_runs_the_written_file_as_transformers_does(files, arch):
    """llama.cpp (its own loader and graph for the architecture) on the written F16 file gives transformers'
    greedy tokens on the same weights: names, layouts, q/k row order and metadata are what llama.cpp expects."""
    hf, _, path = files[arch]
    assert llama_cpp_run(path, PROMPT)[1] == hf_greedy(hf_from_gguf(hf, path), PROMPT)


def test_experts_on_disk_are_read_from_their_slices_of_the_file(files, tmp_path, monkeypatch):
    """An F32 file in the fp32 compute dtype: every expert's gate, up and down is read from its own slice of the
    stacked tensors (and the F32 router in place), none spilled; the tokens are those of the model held in RAM."""
    from offload import LLM

    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path / "cache"))
    _, folder, _ = files["qwen3_moe"]
    path = tmp_path / "f32.gguf"
    make_gguf.write_f16_from_hf(path, folder, f32=True)
    spec = gguf_spec(GGUFFile(path))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    runs = {}
    for weights, page_cache in (("cpu", None), ("disk", frozenset())):
        placement = Placement.uniform(spec, weights, "cpu", page_cache=page_cache)
        llm = LLM(str(path), placement=placement, backend="cpu", host_baseline=0, dtype="fp32")
        runs[weights] = (llm.generate([PROMPT], params)[0].token_ids, llm)
    assert runs["disk"][0] == runs["cpu"][0]
    disk = runs["disk"][1].model.disk
    assert not [n for n in disk.spilled if n.startswith("experts.")]
    extents = disk.extents["experts.1"]
    assert {e.path for e in extents} == {str(path)}
    n = spec.moe.n_experts
    stacked = GGUFFile(path).tensors["blk.1.ffn_down_exps.weight"]
    downs = sorted(e.offset for e in extents if stacked.offset <= e.offset < stacked.offset + stacked.n_bytes)
    assert downs == [stacked.offset + e * stacked.n_bytes // n for e in range(n)]  # one slice per expert, in order


def _written_with(tmp_path: Path, folder: Path, monkeypatch, name: str, edit) -> GGUFFile:
    """The folder written as GGUF with the tensor of that GGUF name replaced by edit(array) (None: left out)."""
    real = make_gguf._layer_tensors

    def edited(spec, i, get, dtype):
        for n, a in real(spec, i, get, dtype):
            a = edit(a) if n == name else a
            if a is not None:
                yield n, a

    monkeypatch.setattr(make_gguf, "_layer_tensors", edited)
    path = tmp_path / f"{name}.gguf"
    make_gguf.write_f16_from_hf(path, folder)
    return GGUFFile(path)


def test_a_missing_or_misshapen_experts_tensor_is_named(files, tmp_path, monkeypatch):
    _, folder, _ = files["mixtral"]
    gf = _written_with(tmp_path, folder, monkeypatch, "blk.1.ffn_up_exps.weight", lambda a: None)
    with pytest.raises(WeightsError, match=r"no tensor for .*experts\.0\.w3.* \(GGUF name blk\.1\.ffn_up_exps\.weight"):
        GGUFSource(gf, gguf_spec(gf), torch.float32)
    gf = _written_with(tmp_path, folder, monkeypatch, "blk.0.ffn_gate_exps.weight", lambda a: a[:5])
    with pytest.raises(WeightsError, match=r"ffn_gate_exps\.weight\[0\] .* has shape \[5, 64, 64\]"):
        GGUFSource(gf, gguf_spec(gf), torch.float32)


@pytest.mark.parametrize("change,needle", [({"norm_topk_prob": True}, "norm_topk_prob is True"),
                                           ({"mlp_only_layers": [1]}, "dense MLP")])
def test_writer_refuses_what_llama_cpp_would_run_differently(tmp_path, change, needle):
    hf = make_hf_model("qwen2_moe", vocab_size=make_gguf.default_vocab_size(), **{"mlp_only_layers": [], **change})
    folder = save_hf_model(hf, tmp_path / "hf")
    with pytest.raises(SystemExit, match=needle):
        make_gguf.write_f16_from_hf(tmp_path / "m.gguf", folder)
