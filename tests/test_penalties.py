"""Penalties and logit bias (issue 33 item 3's sampling parameters): vLLM's and OpenAI's definitions, checked
against a scalar reference, through generation, a job's request bodies and their errors."""

from __future__ import annotations

import pytest
import torch

from conftest import make_hf_model, save_hf_model
from offload import LLM, SamplingParams
from offload.errors import SamplingError
from offload.sampling import apply_penalties


def reference(logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """One token at a time, as vLLM's docs state the rules."""
    out = list(logits)
    for t in range(len(out)):
        if t in prompt or t in output:  # repetition: over the prompt and the output
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        n = output.count(t)  # frequency and presence: over the output only
        out[t] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
        out[t] += p.logit_bias.get(t, 0.0)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_penalties_equal_the_scalar_reference(seed):
    g = torch.Generator().manual_seed(seed)
    vocab = 40
    logits = torch.randn(vocab, generator=g) * 3
    prompt = torch.randint(0, vocab, (12,), generator=g).tolist()
    output = torch.randint(0, vocab, (9,), generator=g).tolist()
    p = SamplingParams(presence_penalty=float(torch.rand(1, generator=g)) * 4 - 2,
                       frequency_penalty=float(torch.rand(1, generator=g)) * 4 - 2,
                       repetition_penalty=0.5 + float(torch.rand(1, generator=g)) * 1.5,
                       logit_bias={str(int(torch.randint(0, vocab, (1,), generator=g))): 7.5, 3: -100, 10**6: 5})
    got = apply_penalties(logits, p, prompt, output)
    assert got.tolist() == pytest.approx(reference(logits.tolist(), p, prompt, output), abs=1e-5)
    assert logits.shape == got.shape and not SamplingParams().penalized and p.penalized


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3),
                                          ("repetition_penalty", 0), ("logit_bias", {"5": 101}),
                                          ("logit_bias", {"x": 1}), ("logit_bias", [1, 2])])
def test_out_of_range_penalties_name_their_field(field, value):
    with pytest.raises(SamplingError, match=rf"invalid sampling parameter: {field}") as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_generation_follows_the_bias_and_the_penalties(tmp_path):
    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=2), tmp_path / "tiny")
    llm = LLM(str(folder), host_baseline=0)
    prompt = [5, 9, 17, 33]
    forced = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                   logit_bias={42: 100}))[0]
    assert forced.token_ids == [42] * 6
    # presence 2 with the bias 100 on two tokens: the first is taken once, then it carries -2 and the second wins
    both = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logit_bias={42: 100, 43: 100},
                          presence_penalty=2.0)
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                                  logit_bias={42: 100, 43: 100}))[0].token_ids[0]
    assert llm.generate([prompt], both)[0].token_ids == [plain, 85 - plain]


def test_a_job_body_takes_the_penalties_and_names_a_bad_one(tmp_path):
    import json

    from offload.jobs.batch import read_requests

    lines = [{"custom_id": "ok", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": [1, 2], "presence_penalty": 0.5, "frequency_penalty": 0.25,
                       "repetition_penalty": 1.1, "logit_bias": {"7": -100}}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": [1, 2], "frequency_penalty": 9}}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    requests, bad = read_requests(path, "openai", {})
    (ok,) = requests
    assert (ok.params.presence_penalty, ok.params.frequency_penalty, ok.params.repetition_penalty,
            ok.params.logit_bias) == (0.5, 0.25, 1.1, {7: -100})
    (wrong,) = bad
    assert "frequency_penalty" in wrong.message and "bad" in wrong.message
