"""The KV cache's format as an option (kv_cache_dtype, llama.cpp's --cache-type-k, vLLM's --kv-cache-dtype): the plan
sizes and prices the cache in it, the runtime stores it so on every path, and the answers stay those of the compute
format's cache within bf16's rounding.

Tolerance: teacher-forced prompt logprobs (prompt chunks of 16 tokens, so each chunk's attention reads the earlier
chunks' keys from the cache) within 0.05 nats of the fp32 cache's, on the CPU's paths and the simulated GPU's (fp32
compute there: a bf16 cache of a bf16 compute's keys would be lossless); a bf16 key or value is off by at most 2^-9
of itself, and the tiny random model's logprobs part by 0.01 typically."""

from __future__ import annotations

import pytest
import torch

from conftest import gpu_profile, make_hf_model, save_hf_model
from offload import LLM, SamplingParams
from offload.engine import run_to_end
from offload.errors import ConfigError
from offload.generate import Generator
from offload.planner import PlanRequest, plan_for
from offload.sequence import Sequence
from offload.spec import load_spec

CONTEXT = 96


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_hf_model(make_hf_model("llama", num_hidden_layers=2, max_position_embeddings=CONTEXT),
                         tmp_path_factory.mktemp("kvdtype") / "tiny")


def test_the_plan_holds_and_reads_a_bf16_cache_in_half_the_bytes(folder):
    plans = {kv: plan_for(load_spec(folder), gpu_profile("cpu-desktop"),
                          PlanRequest.of(model=str(folder), kv_cache_dtype=kv, dtype="fp32", max_model_len=CONTEXT,
                                         batch_size=4, host_baseline=0))
             for kv in ("auto", "bf16")}
    fp32, bf16 = plans["auto"], plans["bf16"]
    assert bf16.workload.cache_format == "bf16" and fp32.workload.cache_format == "fp32"
    assert 2 * bf16.tier("cpu").kv_bytes == fp32.tier("cpu").kv_bytes > 0
    assert bf16.decode.cpu_s < fp32.decode.cpu_s  # each decode step reads half the keys' bytes
    assert "KV cache bf16" in bf16.table().splitlines()[0]
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        PlanRequest.of(model=str(folder), kv_cache_dtype="q8_0")


def _prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The logprob of each prompt token after the first, prefilled in steps of 16 tokens."""
    seq = Sequence(0, prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    run_to_end(Generator(llm.model, max_model_len=CONTEXT, max_batch_size=1, step_tokens=16), [seq])
    return torch.tensor([p.logprob for p in seq.prompt_logprobs[1:]])


@pytest.mark.parametrize("where", ["cpu fused", "cpu reference", "simulated gpu"])
def test_a_16_bit_cache_gives_the_compute_formats_logprobs_within_its_rounding(folder, where):
    options = {"cpu fused": dict(backend="cpu", quantization="q8_0"), "cpu reference": dict(backend="cpu"),
               "simulated gpu": dict(backend="sim", hardware=gpu_profile(), prefill_chunk_tokens=8, dtype="fp32")}[where]
    prompt = torch.randint(1, 160, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    got = {}
    for kv in ("auto", "bf16"):
        llm = LLM(str(folder), max_model_len=CONTEXT, kv_cache_dtype=kv, **options)
        if where == "cpu reference":
            llm.model.fuse = False
        assert (llm.plan.n_gpu_units > 0) == (where == "simulated gpu")
        cache = llm.model.new_cache(1, CONTEXT)
        assert {t.dtype for layer in cache for t in (layer.k, layer.v)} == {llm.model.kv_dtype}
        got[kv] = _prompt_logprobs(llm, prompt)
    assert llm.model.kv_dtype == torch.bfloat16 and llm.model.dtype == torch.float32
    assert (got["auto"] - got["bf16"]).abs().max() <= 0.05
    assert not torch.equal(got["auto"], got["bf16"])  # the cache's format changed what attention read
