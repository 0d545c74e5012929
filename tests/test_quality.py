"""offload eval-kl (offload/quality.py): llama-perplexity's chunking rule, the KL/top-1/PPL arithmetic against a
direct torch computation on tiny models, and the command's one-sentence errors."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from conftest import make_hf_model, offload_logits, save_hf_model
from gguf_support import write_gguf
from offload.cli.main import main
from offload.errors import ConfigError
from offload.quality import KLSums, chunk_logits, chunk_tokens, evaluate, scored_rows
from offload.spec import load_spec
from offload.weights.loader import Checkpoint
from offload.weights.sources import load_model


def test_chunks_are_whole_and_begin_with_bos_where_the_model_adds_one():
    ids = list(range(100, 121))  # 21 tokens: two chunks of 8, the last 5 tokens dropped (llama-perplexity's)
    assert chunk_tokens(ids, 8) == [list(range(100, 108)), list(range(108, 116))]
    assert chunk_tokens(ids, 8, bos_id=1) == [[1, *range(101, 108)], [1, *range(109, 116)]]
    assert chunk_tokens(ids, 8, n_chunks=1) == [list(range(100, 108))]
    assert chunk_tokens(ids, 8, n_chunks=5) == chunk_tokens(ids, 8)


def test_the_second_half_of_each_chunk_is_scored():
    # n_ctx 8: first = 4; rows 4, 5, 6 predict tokens 5, 6, 7 (n_ctx - 1 - n_ctx/2 = 3 per chunk)
    assert list(scored_rows(8)) == [4, 5, 6]
    assert list(scored_rows(9)) == [4, 5, 6, 7]
    assert len(scored_rows(512)) == 255


def test_a_text_shorter_than_two_chunks_is_refused():
    with pytest.raises(ConfigError, match="15 tokens, fewer than the 2 x 8"):
        chunk_tokens(list(range(15)), 8)


def test_sums_give_the_formulas_values_on_toy_rows():
    # two rows of a 2-token vocabulary; the reference is sure of token 0, the model 50/50 on row 0
    ref = torch.log(torch.tensor([[0.75, 0.25], [0.5, 0.5]], dtype=torch.float64))
    logits = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]], dtype=torch.float64))
    sums = KLSums()
    sums.add(ref, logits, torch.tensor([0, 1]))
    r = sums.result()
    kl0 = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    kl1 = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert r.kld.value == pytest.approx((kl0 + kl1) / 2, rel=1e-12)
    assert r.ppl.value == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.1)) / 2), rel=1e-12)
    assert r.ppl_ref.value == pytest.approx(math.exp(-(math.log(0.75) + math.log(0.5)) / 2), rel=1e-12)
    # row 0: the model's tie goes to the first index, as llama.cpp's strict > does; row 1 agrees on 0 too
    assert (r.n_tokens, r.same_top.value) == (2, 1.0)


def _models(tmp_path):
    """A tiny model and the same with noise on its lm_head (offload's reference Model: the plain block loop)."""
    folder = save_hf_model(make_hf_model("llama"), tmp_path / "tiny")
    ref = load_model(Checkpoint(folder), load_spec(folder))
    noise = 0.05 * torch.randn(ref.lm_head.shape, generator=torch.Generator().manual_seed(1))
    return ref, replace(ref, lm_head=ref.lm_head + noise)


def test_chunked_passes_give_the_single_pass_logits(tmp_path):
    ref, _ = _models(tmp_path)
    ids = torch.randint(0, 160, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    rows = scored_rows(16)
    whole = offload_logits(ref, ids)[rows.start: rows.stop]
    assert torch.allclose(chunk_logits(ref, ids, rows, pass_tokens=5, logits_rows=2), whole, atol=1e-4)


def test_kl_against_itself_is_zero_and_against_a_perturbed_model_the_direct_value(tmp_path):
    ref, perturbed = _models(tmp_path)
    ids = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    chunks = chunk_tokens(ids, 16)
    logits_of = lambda m: lambda c, rows: chunk_logits(m, c, rows, 16, 8)  # noqa: E731

    same = evaluate(logits_of(ref), logits_of(ref), chunks)
    # 0 up to the reference log-probabilities held in fp32 (rounding of ~1e-8 nats)
    assert same.n_tokens == 2 * 7 and same.kld.value == pytest.approx(0, abs=1e-6)
    assert same.same_top.value == 1.0 and same.ppl.value == pytest.approx(same.ppl_ref.value, rel=1e-6)

    r = evaluate(logits_of(perturbed), logits_of(ref), chunks)
    kl, agree, nll = [], [], []
    for c in chunks:  # the definition, written out: sum p_ref (log p_ref - log p) over the scored rows
        p_ref = torch.log_softmax(offload_logits(ref, c).double(), -1)[8:15]
        p = torch.log_softmax(offload_logits(perturbed, c).double(), -1)[8:15]
        kl += (p_ref.exp() * (p_ref - p)).sum(-1).tolist()
        agree += (p.argmax(-1) == p_ref.argmax(-1)).tolist()
        nll += (-p.gather(1, torch.tensor(c[9:16])[:, None])[:, 0]).tolist()
    assert r.kld.value == pytest.approx(sum(kl) / len(kl), rel=1e-4) and r.kld.value > 1e-4
    assert r.same_top.value == pytest.approx(sum(agree) / len(agree))
    assert r.ppl.value == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)
    n = len(kl)  # llama.cpp's ±: the standard error of the mean
    mean = sum(kl) / n
    assert r.kld.err == pytest.approx(math.sqrt((sum(k * k for k in kl) / n - mean ** 2) / (n - 1)), rel=1e-3)


@pytest.fixture
def gguf_pair(tmp_path):
    hf = make_hf_model("llama", vocab_size=300)
    return write_gguf(hf, tmp_path / "m.q8_0.gguf", "Q8_0"), write_gguf(hf, tmp_path / "m.f32.gguf", "F32")


def test_eval_kl_prints_the_table(gguf_pair, tmp_path, capsys):
    model, reference = gguf_pair
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 4)  # 180 byte-level tokens: 5 chunks of 32
    assert main(["eval-kl", "--model", str(model), "--reference", str(reference), "--text", str(text),
                 "--ctx", "32", "--chunks", "2"]) == 0
    out = capsys.readouterr().out
    assert "tokens     30 scored" in out and "mean KLD" in out and "same top-1" in out


@pytest.mark.parametrize("case, expected", [
    ("model", "--model {tmp}/missing.gguf does not exist"),
    ("text", "--text {tmp}/missing.txt is not a file"),
    ("short", "fewer than the 2 x 512 (--ctx) that llama-perplexity requires"),
    ("chunks", "--chunks 0: give 1 or more"),
])
def test_eval_kl_bad_input_is_one_sentence(gguf_pair, tmp_path, capsys, case, expected):
    model, reference = gguf_pair
    text = tmp_path / "text.txt"
    text.write_text("a short text")
    args = {"--model": str(model), "--reference": str(reference), "--text": str(text)}
    if case == "model":
        args["--model"] = str(tmp_path / "missing.gguf")
    elif case == "text":
        args["--text"] = str(tmp_path / "missing.txt")
    elif case == "chunks":
        args["--chunks"] = "0"
    assert main(["eval-kl", *[x for kv in args.items() for x in kv]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("offload: error: ") and expected.format(tmp=tmp_path) in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
