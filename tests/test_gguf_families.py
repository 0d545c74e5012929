"""GGUF files of the families of offload/families.py beyond Llama's (issue 45): Qwen3 (with YaRN too), Gemma 2, Gemma 3,
Phi-3, OLMo 2 and Seed-OSS as llama.cpp's converter writes them (tests/gguf_support.write_gguf: gguf-py's own tensor
names, Gemma's norms plus 1, Phi-3's fused qkv and gate|up and its LongRoPE factor tensors) give the Hugging Face
folder's model (gpt-oss's files: tests/test_gguf_gpt_oss.py).

F32 files: logits within 1e-4 of transformers' logit range (as tests/test_families.py holds the folder) and the
greedy tokens of LLM(folder). Q8_0 files as the converter's --outtype q8_0 writes them (gguf-py's quantizer, the
embedding Q8_0 too): logits within 1e-3 of transformers holding the file's own weights (gguf_support.hf_from_gguf;
measured at most 3e-4: offload's q8_0 kernels round activations to int16). Q8_0 files with an F32 embedding, which
then hold what offload's q8_0 of the folder holds (its embedding stays float for lookup): the model is
LLM(folder, quantization='q8_0'), logits within 1e-6 of its range (measured: equal; gguf-py's Q8_0 blocks are
offload's) and the same greedy tokens. Against the folder's q8_0, a file with a Q8_0 embedding moves the tiny random
models' logits by 2-7% of their range (the embedding's own rounding, which Gemma scales by sqrt(hidden)) and flips
greedy tokens, too loose to tell a misread tensor. Prompts reach past the sliding windows (6) and LongRoPE's and
YaRN's original context (16). The metadata llama.cpp leaves to its loader (Gemma 3's pattern and local rope base, the 27B Gemmas'
attention scale) is checked on files of metadata alone."""

from __future__ import annotations

import gguf
import pytest
import torch

from conftest import assert_logits_close, hf_logits, make_hf_model, offload_logits, save_hf_model
from gguf_support import hf_from_gguf, write_gguf
from offload.errors import WeightsError
from offload.weights.gguf import GGUFFile
from offload.weights.gguf_config import gguf_config, gguf_spec
from test_families import CASES

# test_families' cases as GGUF files can hold them: the Gemmas scale scores by head_dim (llama.cpp's rule but for its
# 27B models) and Gemma 2's files always tie the lm_head; a vocabulary that fits the byte tokenizer
GEMMA = dict(query_pre_attn_scalar=32, tie_word_embeddings=True)
GGUF_CASES = {
    "qwen3-gqa4": ("qwen3", CASES["qwen3-gqa4"][1]),
    "gemma2-gqa8": ("gemma2", {**CASES["gemma2-gqa8"][1], **GEMMA}),
    # llama.cpp's Gemma 3: every sixth layer global; an untied lm_head is written as output
    "gemma3-gqa4": ("gemma3_text", {**CASES["gemma3-gqa4"][1], "query_pre_attn_scalar": 32, "num_hidden_layers": 6,
                                    "sliding_window_pattern": 6}),
    # a period of 3 (sliding_window_pattern key), linear scaling of the global layers, a local base of 1000
    "gemma3-rope-linear": ("gemma3_text", {**CASES["gemma3-rope-linear"][1], **GEMMA}),
    "phi3-partial-rotary": ("phi3", CASES["phi3-partial-rotary"][1]),
    "olmo2-gqa4": ("olmo2", CASES["olmo2-gqa4"][1]),
    "seed-oss-out-bias-gqa8": ("seed_oss", CASES["seed-oss-out-bias-gqa8"][1]),
    "phi3-longrope": ("phi3", CASES["phi3-longrope"][1]),
    # YaRN past a trained context of 16 (the converter writes rope.scaling.type yarn, its factor and that context)
    "qwen3-yarn": ("qwen3", {**CASES["qwen3-gqa4"][1], "max_position_embeddings": 64, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
}
VOCAB = 300


def _prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(GGUF_CASES))
def case(request, tmp_path_factory):
    """(transformers model, its folder, its GGUF files by kind)."""
    arch, overrides = GGUF_CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(arch, **{**overrides, "vocab_size": VOCAB})
    folder = save_hf_model(hf, root / "hf")
    files = {q: write_gguf(hf, root / f"{request.param}-{q}.gguf", q, arch=arch) for q in ("F32", "Q8_0")}
    files["Q8_0, F32 embedding"] = write_gguf(hf, root / f"{request.param}-q8-f32-embedding.gguf", "Q8_0", arch=arch,
                                              types={"token_embd.weight": "F32"})
    return hf, folder, files


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """GGUF tables and tokenizers of these throwaway files go to a cache folder of the test's own."""
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path / "cache"))


def _greedy(llm, ids: list[int]) -> list[int]:
    from offload import SamplingParams

    return llm.generate([ids], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].outputs[0].token_ids


def test_f32_file_gives_the_folders_logits_and_tokens(case):
    from offload import LLM

    hf, folder, files = case
    ids = _prompt(24)
    llm = LLM(str(files["F32"]), max_model_len=64)
    assert_logits_close(offload_logits(llm.model, ids), hf_logits(hf, ids))
    assert _greedy(llm, ids) == _greedy(LLM(str(folder), max_model_len=64), ids)


def test_q8_0_file_gives_transformers_on_its_weights(case):
    from offload import LLM

    hf, _, files = case
    ids = _prompt(24, seed=3)
    llm = LLM(str(files["Q8_0"]), max_model_len=64)
    assert llm.spec.stored_format == "q8_0"
    assert_logits_close(offload_logits(llm.model, ids), hf_logits(hf_from_gguf(hf, files["Q8_0"]), ids), rel=1e-3)


def test_q8_0_file_gives_offloads_q8_0_of_the_folder(case):
    """The file's Q8_0 tensors used as stored; its F32 ones (a tied lm_head: the embedding) quantized as the
    folder's are."""
    from offload import LLM

    hf, folder, files = case
    ids = _prompt(24, seed=2)
    ours = LLM(str(files["Q8_0, F32 embedding"]), max_model_len=64, quantization="q8_0")
    ref = LLM(str(folder), max_model_len=64, quantization="q8_0")
    assert ours.spec.stored_format == "q8_0"
    assert_logits_close(offload_logits(ours.model, ids), offload_logits(ref.model, ids), rel=1e-6)
    assert _greedy(ours, ids) == _greedy(ref, ids)


def test_the_files_spec_is_the_folders(case):
    """Every number the family's math reads, from the file's metadata as from config.json (LongRoPE's factors from
    its tensors, its attention factor from the two context lengths as transformers computes it)."""
    from offload.spec import load_spec
    from offload.weights.model_files import model_spec

    _, folder, files = case
    ours, ref = model_spec(files["F32"]), load_spec(folder)
    assert ours.family is ref.family and ours.variant == ref.variant and ours.rope == ref.rope
    assert (ours.head_dim, ours.sliding_window, ours.tie_word_embeddings) == \
           (ref.head_dim, ref.sliding_window, ref.tie_word_embeddings)


def _metadata_file(path, arch: str, n_layers: int = 2, hidden: int = 64, n_heads: int = 4, **keys):
    """A GGUF file of metadata only (no tensors): arch's hyperparameters plus keys (suffixes of arch's namespace)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(2 * hidden)
    w.add_head_count(n_heads)
    w.add_head_count_kv(1)
    w.add_vocab_size(VOCAB)
    for key, value in keys.items():
        add = {bool: w.add_bool, int: w.add_uint32, float: w.add_float32, str: w.add_string,
               list: w.add_array}[type(value)]
        add(f"{arch}.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


@pytest.mark.parametrize("arch, n_layers, hidden, n_heads, head_dim, scalar", [
    ("gemma2", 46, 4608, 32, 128, 144),  # Gemma 2 27B: hidden / heads, as llama.cpp (and config.json) has it
    ("gemma2", 42, 3584, 16, 256, 256),  # Gemma 2 9B: head_dim
    ("gemma3", 62, 5376, 32, 128, 168),  # Gemma 3 27B
    ("gemma3", 34, 2560, 8, 256, 256)])  # Gemma 3 4B
def test_gemma_attention_scale_follows_llama_cpp(tmp_path, arch, n_layers, hidden, n_heads, head_dim, scalar):
    gf = _metadata_file(tmp_path / "m.gguf", arch, n_layers, hidden, n_heads, **{"attention.key_length": head_dim})
    assert gguf_config(gf)["query_pre_attn_scalar"] == scalar


def test_gemma3_defaults_are_llama_cpps(tmp_path):
    """A file with a window but no pattern and no local base: every sixth layer global, local layers at 10000."""
    gf = _metadata_file(tmp_path / "m.gguf", "gemma3", 12, **{"attention.sliding_window": 512,
                                                              "rope.freq_base": 1e6, "attention.key_length": 16})
    spec = gguf_spec(gf)
    assert spec.variant.layer_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(12))
    assert spec.variant.local_rope.theta == 10000.0 and spec.rope.theta == 1e6
    assert gguf_spec(_metadata_file(tmp_path / "none.gguf", "gemma3", 12)).variant.layer_windows == ()


def test_sliding_window_pattern_of_each_layer(tmp_path):
    """A pattern stored as one bool per layer (true: sliding) gives those layers the window."""
    pattern = [True, False, False, True]
    gf = _metadata_file(tmp_path / "m.gguf", "gemma3", 4, **{"attention.sliding_window": 8,
                                                             "attention.sliding_window_pattern": pattern})
    assert gguf_spec(gf).variant.layer_windows == (8, None, None, 8)


def test_phi3_rotary_dimensions_are_kept_exactly(tmp_path):
    """rope.dimension_count of every even width up to a 256-wide head gives that many rotated dimensions (a factor
    of rotary / head_dim alone would round below some of them)."""
    from offload.families import BY_MODEL_TYPE, family_math

    for head_dim in (96, 128, 256):
        for rotary in range(2, head_dim + 1, 2):
            gf = _metadata_file(tmp_path / f"{head_dim}-{rotary}.gguf", "phi3", hidden=4 * head_dim,
                                **{"rope.dimension_count": rotary})
            config = gguf_config(gf)
            math_ = family_math(BY_MODEL_TYPE["phi3"], config, "f", 2, head_dim)
            assert (math_.rotary_dim or head_dim) == rotary


def test_longrope_needs_its_factor_tensors(tmp_path):
    gf = _metadata_file(tmp_path / "m.gguf", "phi3", **{"rope.scaling.type": "longrope",
                                                        "rope.scaling.original_context_length": 16})
    with pytest.raises(WeightsError, match=r"rope_factors_short\.weight.*convert the model again"):
        gguf_config(gf)


def test_an_olmo2_file_with_sliding_layers_is_refused_as_olmo3(tmp_path):
    """llama.cpp writes OLMo 3 as olmo2 with a window (3 sliding layers to 1 full), which offload does not run:
    read as OLMo 2, every layer would slide."""
    gf = _metadata_file(tmp_path / "m.gguf", "olmo2", 4, **{"attention.sliding_window": 8})
    with pytest.raises(WeightsError, match="OLMo 3.*use an OLMo 2 model"):
        gguf_config(gf)
    assert gguf_config(_metadata_file(tmp_path / "olmo2.gguf", "olmo2", 4))["model_type"] == "olmo2"


def test_an_unsupported_architecture_names_the_new_ones(tmp_path):
    gf = _metadata_file(tmp_path / "m.gguf", "gpt2")
    with pytest.raises(WeightsError, match="GGUF architecture 'gpt2' is not supported") as e:
        gguf_config(gf)
    for arch in ("qwen3", "gemma2", "gemma3", "phi3", "gpt-oss"):
        assert arch in str(e.value)


@pytest.mark.parametrize("keys, needle", [
    ({}, r"needs metadata key qwen3\.rope\.scaling\.original_context_length"),
    ({"rope.scaling.original_context_length": 16, "rope.scaling.yarn_log_multiplier": 0.1},
     r"yarn_log_multiplier 0\.1.* is not supported")])
def test_yarn_that_is_not_transformers_is_refused(tmp_path, keys, needle):
    """A file of YaRN without its trained context, or with llama.cpp's knobs that transformers' YaRN lacks
    (DeepSeek's log multiplier), is one error naming the key, not a model computed another way."""
    gf = _metadata_file(tmp_path / "m.gguf", "qwen3", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                                         **keys})
    with pytest.raises(WeightsError, match=needle):
        gguf_config(gf)

