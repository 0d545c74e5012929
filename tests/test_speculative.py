"""Speculative decoding: prompt lookup's proposals; greedy answers equal decoding without speculation on fp32
placements (CPU, disk, streamed on the simulated device; batch 1 and a mixed batch), rejected proposals rolled
back; sampled tokens keep the model's distribution (chi-square tests); the options and the report."""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from offload import LLM, SamplingParams
from offload.errors import ConfigError
from offload.kernels import ACTIVE_PATH
from offload.speculative import NgramDrafter, Speculator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from make_llama import tiny  # noqa: E402

# chi-square's 0.999 quantile by degrees of freedom: a correct rule fails one run in a thousand
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}
REPEATS = "ab ab ab ab ab ab cd cd cd cd ef ef ef ab ab cd"  # prompt lookup finds n-grams to follow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny(tmp_path_factory.mktemp("spec") / "tiny", vocab=259, tokenizer=True)


def llm_of(model_dir, **spec) -> LLM:
    return LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32",
               speculative_config={"method": "ngram", **spec} if spec is not None else None)


def greedy(n: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


class Fixed:
    """A drafter proposing the same tokens every time."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, tokens: list[int], k: int, seq=None) -> list[int]:
        return self.tokens[:k]


def test_prompt_lookup_follows_the_most_recent_longest_match():
    drafter = NgramDrafter(lookup_max=3, lookup_min=1)
    assert drafter.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # the later 1 2 3 is followed by 7 8
    assert drafter.propose([5, 6, 7, 5, 6], 3) == [7, 5, 6]  # 5 6 -> 7 5 6
    assert drafter.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert drafter.propose([4, 4], 5) == [4]  # what follows stops at the end
    assert NgramDrafter(lookup_max=2, lookup_min=2).propose([1, 9, 2, 1], 2) == []  # 1 alone is too short


def test_greedy_answers_equal_plain_decoding_at_batch_one_and_in_a_mixed_batch(model_dir):
    plain, fixed_k, adaptive = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32"), \
        llm_of(model_dir, num_speculative_tokens=4), llm_of(model_dir)
    prompts = [REPEATS, "The quick brown fox", "xyz xyz xyz xyz xyz", "Hello! " * 6]
    params = [greedy(), greedy(12), greedy(30), greedy(7)]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in fixed_k.generate(prompts[0], params[0])] == want[:1]
    assert [o.token_ids for o in fixed_k.generate(prompts, params)] == want
    assert [o.token_ids for o in adaptive.generate(prompts, params)] == want
    stats = fixed_k.speculative_stats
    assert stats["accepted"] > 0 and stats["accepted"] < stats["proposed"]  # some kept, some rolled back
    assert stats["tokens_per_pass"] > 1


def test_a_verify_pass_reads_the_lm_head_once_at_batch_one(model_dir):
    """A batch of one's step of k proposals computes its k + 1 rows of logits in one read of the lm_head (it took
    k + 1 reads: the generator's rows at once were the batch size)."""
    llm = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32", batch_size=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    gen, calls, rows = llm.generator, [], []
    gen.speculator.drafter = Fixed([5, 6, 7, 8])
    logits, run_step = llm.model.logits, gen.run_step
    llm.model.logits = lambda hidden, more=False: (calls.append(hidden.shape[0]), logits(hidden, more=more))[1]

    def counted(scheduled, cache, trash_slot):
        calls.clear()
        out = run_step(scheduled, cache, trash_slot)
        rows.append((scheduled.n_logits, len(calls)))
        return out
    gen.run_step = counted
    llm.generate(REPEATS, greedy())
    assert max(n for n, _ in rows) == 5 and all(reads == (n > 0) for n, reads in rows)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.skipif(ACTIVE_PATH == "numba", reason="a property of offload's C++ kernels (torch's sum by the rows)")
def test_a_verify_pass_gives_each_row_the_logits_decoding_gives(model_dir, dtype):
    """Passes of 3 and 5 tokens (a verify pass of proposals) give every row the logits one-token steps give, bit
    for bit, past 256 cached keys (the CPU attention's splits): the linears and the attention sum each row in one
    order whatever the step's tokens, so greedy speculation answers as plain decoding does, in bf16 too."""
    from offload.quality import chunk_logits

    llm = LLM(str(model_dir), backend="cpu", max_model_len=512, dtype=dtype)
    ids = torch.randint(3, 250, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = range(288, 300)
    one = chunk_logits(llm.model, ids, rows, 1, 16)
    for tokens in (3, 5):
        assert torch.equal(chunk_logits(llm.model, ids, rows, tokens, 16), one), tokens


def test_a_draft_model_and_the_models_own_smaller_weights_keep_greedy_answers(model_dir):
    """draft_model with the model itself as its draft: every proposal is kept; self at q4_0: some are, and the
    answers are plain decoding's either way; the batch's sequences draft together; each sequence's draft extent is
    freed when it ends."""
    plain = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32")
    prompts, params = ["The quick brown fox", "Hello there", REPEATS], [greedy(20), greedy(9), greedy(16)]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    same = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32",
               speculative_config={"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3})
    assert [o.token_ids for o in same.generate(prompts, params)] == want
    stats = same.speculative_stats
    assert stats["proposed"] > 0 and stats["accepted"] == stats["proposed"] and stats["tokens_per_pass"] > 3
    drafter = same.generator.speculator.drafter
    assert drafter.pool.n_free == drafter.capacity and not drafter._held  # every sequence's extent given back
    # the sequences of a step draft together: 3 passes a step serve them all (one at a time: 3 for each)
    assert drafter.passes < 2 * stats["verified_passes"]
    small = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32",
                speculative_config={"method": "self", "num_speculative_tokens": 2, "quantization": "q4_0"})
    assert [o.token_ids for o in small.generate(prompts, params)] == want
    assert small.generator.speculator.drafter.draft.request.model.quantization == "q4_0"
    assert small.speculative_stats["proposed"] > 0 and small.speculative_stats["draft_s"] > 0


def test_the_models_page_cache_room_leaves_out_the_draft(model_dir, monkeypatch):
    """The model planned beside a draft: its budget is what the draft leaves, and so is the room the page cache has
    to keep its disk units in (the draft's bytes are the process's too: counted, the room is the same as the whole
    budget's)."""
    from offload.planner import PlanRequest, request as request_module
    from offload.planner.speculation import without_draft

    seen = []
    monkeypatch.setattr(request_module, "page_cache_room_bytes", lambda process: seen.append(process) or 64 << 20)
    whole = PlanRequest.of(model=str(model_dir), cpu_memory="2GiB", disk_memory="4GiB", host_baseline="256MiB")
    hw = whole.profile()
    rest = without_draft(whole, hw, 0, 300 << 20)
    whole_budget, rest_budget = whole.budget(hw), rest.budget(hw)
    assert rest_budget.process_cpu_bytes == whole_budget.process_cpu_bytes - (300 << 20)
    assert seen == [2 << 30, 2 << 30, 2 << 30]  # whole's (twice: without_draft reads it) and the rest's


def test_the_drafts_format_is_the_planners_choice_or_written_once(model_dir, monkeypatch):
    """A copy of the model's own weights whose format is unset: the planner prices each format at its prior
    acceptance and loads the faster (its price names it); options.DRAFT_QUANTIZATION decides where nothing plans (a
    placement given), and a format set is kept."""
    from offload import options
    from offload.planner import Placement
    from offload.planner.speculation import OWN_COPY_PRIORS, prior_acceptance

    assert options.SpeculativeOptions(method="self").draft_quantization == "q4_0"
    assert options.SpeculativeOptions(method="draft_model", model="m").draft_quantization == "none"
    assert options.SpeculativeOptions(method="self", quantization="q8_0").draft_quantization == "q8_0"
    assert prior_acceptance(options.SpeculativeOptions(method="substitute", quantization="q8_0")) == 0.95
    assert "q4_0 or q8_0, whichever the planner predicts" in \
        options.SpeculativeOptions.model_fields["quantization"].description
    planned = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32",
                  speculative_config={"method": "self", "num_speculative_tokens": 2})
    chosen = planned.speculative.quantization
    assert chosen in OWN_COPY_PRIORS and planned.draft_price.draft_format == chosen
    assert planned.generator.speculator.drafter.draft.request.model.quantization == chosen
    assert planned.generator.speculator.prior == OWN_COPY_PRIORS[chosen]
    kept = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32",
               speculative_config={"method": "self", "num_speculative_tokens": 2, "quantization": "q4_0"})
    assert kept.generator.speculator.drafter.draft.request.model.quantization == "q4_0"
    monkeypatch.setitem(options.DRAFT_QUANTIZATION, "self", "q8_0")
    given = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32",
                placement=Placement.uniform(planned.spec, "cpu", "cpu"),
                speculative_config={"method": "self", "num_speculative_tokens": 2})
    assert given.generator.speculator.drafter.draft.request.model.quantization == "q8_0"


def test_a_draft_is_planned_first_and_its_bytes_come_out_of_the_models_budget(model_dir):
    """memory.cpu is the whole process: the draft (planned first) holds part of it, the model's plan the rest,
    and a job's memory watch and report hold the process to the sum."""
    from offload.jobs.config import load_config
    from offload.jobs.worker import budget_of

    budget = 2 << 30
    llm = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32", cpu_memory=budget,
              speculative_config={"method": "self"})
    held = llm.draft_bytes["cpu"]
    assert held > 0 and llm.plan.budget.process_cpu_bytes == budget - held
    config = load_config(None, {"model.path": str(model_dir), "memory.cpu": budget}, need_input=False)
    assert budget_of(config, llm)["cpu"] == budget


def test_a_draft_that_does_not_pay_is_dropped_unless_k_is_set(model_dir, caplog):
    """A draft as large as the model (the model itself, as stored) costs a model's pass a proposal: at the prior
    acceptance no k pays, so the LLM runs without it, on the whole budget, and says why (both predicted speeds);
    with num_speculative_tokens set it keeps the draft and says it is predicted slower."""
    from offload.jobs.worker import job_speculation
    from offload.profile.report import JobCounts, speculation_lines

    config = {"method": "draft_model", "model": str(model_dir)}
    with caplog.at_level(logging.WARNING, logger="offload"):
        llm = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32", cpu_memory=2 << 30,
                  speculative_config=config)
    price = llm.draft_price
    assert not price.pays and price.tokens_per_s < price.plain_tokens_per_s
    assert llm.generator.speculator is None and llm.speculative_stats is None and llm.draft_bytes["cpu"] == 0
    assert llm.plan.budget.process_cpu_bytes == 2 << 30  # the whole budget is the model's
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "speculative decoding (draft_model) dropped" in said
    assert f"predicted {price.tokens_per_s:.2f} tok/s (k = {price.k})" in said and price.k >= 1
    assert f"{price.plain_tokens_per_s:.2f} tok/s without the draft" in said
    report = job_speculation(llm, JobCounts())
    assert report["dropped"] and "dropped" in speculation_lines(report)[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="offload"):
        kept = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32",
                   speculative_config={**config, "num_speculative_tokens": 2})
    assert kept.generator.speculator is not None and kept.draft_bytes["cpu"] > 0
    assert "kept, as num_speculative_tokens is set, though predicted slower" in caplog.text
    assert "predicted slower" in " ".join(speculation_lines(job_speculation(kept, JobCounts())))


def test_proposals_the_model_rejects_are_rolled_back(model_dir):
    """A drafter that is always wrong: every step keeps none, and the answer is still plain decoding's."""
    plain = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32")
    wrong = llm_of(model_dir)
    want = plain.generate(REPEATS, greedy())[0].token_ids
    absent = next(t for t in range(3, 259) if t not in want)
    wrong.generator.speculator = Speculator(Fixed([absent] * 6), num_tokens=6)
    assert wrong.generate(REPEATS, greedy())[0].token_ids == want
    assert wrong.speculative_stats["accepted"] == 0 and wrong.speculative_stats["tokens_per_pass"] == 1


@pytest.mark.parametrize("where,compute", [("disk", "cpu"), ("disk", "stream")])
def test_greedy_answers_equal_plain_decoding_on_disk_and_streamed_placements(tmp_path, where, compute):
    from conftest import gpu_profile, make_hf_model, save_hf_model
    from offload.engine import run_to_end
    from offload.generate import Generator
    from offload.planner import Placement
    from offload.runtime.backends.cpu import CPUBackend
    from offload.runtime.backends.sim import SimBackend
    from offload.runtime.executor import PlacedModel
    from offload.sequence import Sequence
    from offload.weights.loader import Checkpoint
    from offload.weights.model_files import model_spec
    from offload.weights.sources import CheckpointSource

    path = save_hf_model(make_hf_model("llama"), tmp_path / "tiny")
    spec = model_spec(path)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 9, 3, 9], [11, 12, 13]]

    def run(speculator):
        backend = SimBackend(gpu_profile()) if compute == "stream" else CPUBackend()
        model = PlacedModel(spec, CheckpointSource(Checkpoint(path), spec, torch.float32, "none"),
                            Placement.uniform(spec, where, compute, page_cache=frozenset()), backend)
        generator = Generator(model, max_batch_size=4, max_model_len=64)
        generator.speculator = speculator
        prepare = model.prepare_step  # the verify pass's first copies and reads, issued before the drafting
        model.prepare_step = lambda phase, samples=True: (prepared.append(phase), prepare(phase, samples))
        seqs = [Sequence(i, p, greedy(10)) for i, p in enumerate(prompts)]
        run_to_end(generator, seqs)
        return [s.output_ids for s in seqs]

    speculator, prepared = Speculator(NgramDrafter(3, 1), num_tokens=3), []
    assert run(None) and not prepared
    assert run(speculator) == run(None) and speculator.stats.proposed > 0
    assert prepared and set(prepared) <= {"prefill", "decode"} and speculator.stats.verified_passes > 0


def chi_square(counts: Counter, probs: dict[int, float], n: int) -> tuple[float, int]:
    """Pearson's statistic of counts against n draws of probs, and its degrees of freedom."""
    stat = sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in probs.items() if p > 0)
    assert set(counts) <= {t for t, p in probs.items() if p > 0}, "a token outside the distribution's support"
    return stat, sum(p > 0 for p in probs.values()) - 1


@pytest.mark.parametrize("proposal", ["likeliest", "middle", "outside"])
def test_the_rejection_rule_keeps_the_distribution(proposal):
    """One row of logits, one proposal from prompt lookup (a point mass): the token taken is distributed as the
    sampler's own distribution (temperature and top-k applied), whatever the proposal."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, 0.8, -3.0, 0.0])
    params = SamplingParams(temperature=0.8, top_k=5)
    from offload.sampling import probabilities

    p = probabilities(logits, params)
    order = p.argsort(descending=True).tolist()
    draft = {"likeliest": order[0], "middle": order[2], "outside": order[-1]}[proposal]
    speculator, gen, n, taken = Speculator(Fixed([draft])), torch.Generator().manual_seed(1), 4000, []
    for _ in range(n):
        speculator.verify([logits, logits], [draft], params, gen, [], [], lambda t, row: taken.append(t) or False)
    stat, df = chi_square(Counter(taken), dict(enumerate(p.tolist())), n)
    assert stat < CHI2_999[df], (proposal, stat, Counter(taken))
    kept = speculator.stats.accepted / n
    assert abs(kept - float(p[draft])) < 4 * (float(p[draft]) * (1 - float(p[draft])) / n) ** 0.5 + 1e-9


def test_sampled_generation_keeps_the_models_distribution(model_dir):
    """Many seeds of a tiny model, a drafter that always proposes the same token: the second token, given the
    first, is distributed as the model's own distribution after them (a chi-square test): the first is sampled
    from the prompt's logits, the second in a step that verified the proposal."""
    from offload.sampling import probabilities

    llm, n_runs = LLM(str(model_dir), backend="cpu", max_model_len=64, dtype="fp32"), 1500
    prompt = {"prompt_token_ids": llm.generate("ab", greedy(1))[0].prompt_token_ids}
    likely = llm.generate(prompt, greedy(2))[0].token_ids
    llm.generator.speculator = Speculator(Fixed([likely[1]]), num_tokens=1)
    outs = llm.generate([prompt] * n_runs, [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=s,
                                                            ignore_eos=True) for s in range(n_runs)])
    assert llm.speculative_stats["proposed"] >= n_runs  # every second token was a verified one
    pairs = Counter(tuple(o.token_ids[:2]) for o in outs)
    common = Counter(first for first, _ in pairs.elements()).most_common(1)[0][0]
    seconds = Counter({second: c for (first, second), c in pairs.items() if first == common})
    llm.generator.speculator = None
    after = llm.generate({"prompt_token_ids": prompt["prompt_token_ids"] + [common]},
                         SamplingParams(max_tokens=1, temperature=0, logprobs=8))[0].outputs[0].logprobs[0]
    raw = torch.full((259,), float("-inf"))  # log-softmax's top 8: top-k 4 and softmax need no more
    for token, logprob in after.top:
        raw[token] = logprob
    p = probabilities(raw, SamplingParams(temperature=1.0, top_k=4))
    n = sum(seconds.values())
    stat, df = chi_square(seconds, {i: float(v) for i, v in enumerate(p.tolist()) if v > 0}, n)
    assert n > 200 and stat < CHI2_999[df], (stat, df, seconds)


def test_the_speculative_options_are_checked(model_dir):
    with pytest.raises(ConfigError, match=r"speculative_config\['method'\]"):
        LLM(str(model_dir), backend="cpu", speculative_config={"method": "medusa"})
    with pytest.raises(ConfigError, match="prompt_lookup_min .* must not exceed"):
        LLM(str(model_dir), backend="cpu", speculative_config={"method": "ngram", "prompt_lookup_min": 9})
    with pytest.raises(ConfigError, match="method draft_model needs model"):
        LLM(str(model_dir), backend="cpu", speculative_config={"method": "draft_model"})
    with pytest.raises(ConfigError, match="speculative_config must be a dict"):
        LLM(str(model_dir), backend="cpu", speculative_config="ngram")


def test_a_job_reports_what_speculation_did_and_its_predicted_speed_against_the_measured(model_dir, tmp_path):
    """One request at batch 1: its 20 tokens are one from the prompt's step and 19 from decode steps; the report
    gives the decode speed measured (tokens over the steps' and the drafting's seconds) and the price of the steps
    run (planner.speculation.run_tokens_per_s at the measured acceptance, k and context, on the profile moved to
    the job's CPU speed) over it."""
    from offload.jobs.run import run_batch
    from offload.options import SpeculativeOptions
    from offload.planner import PlanRequest
    from offload.planner.speculation import plan_speculation, run_tokens_per_s
    from offload.profile.report import format_report
    from offload.weights.model_files import model_spec

    (tmp_path / "in.jsonl").write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                                   "body": {"prompt": REPEATS, "max_tokens": 20,
                                                            "ignore_eos": True}}) + "\n")
    report = run_batch({"model": {"path": str(model_dir), "max_model_len": 256},
                        "hardware": {"backend": "cpu"}, "schedule": {"batch_size": 1},
                        "input": {"path": str(tmp_path / "in.jsonl")},
                        "speculative": {"method": "ngram", "num_speculative_tokens": 3},
                        "report": {"print": False}}, progress=False)
    spec = report["speculative"]
    assert spec["proposed"] > 0 and 0 <= spec["acceptance_rate"] <= 1
    assert spec["decode_tokens"] == 19 and spec["mean_batch"] == 1
    verified_tokens = round(spec["tokens_per_pass"] * spec["verified_passes"])  # and one a step without proposals
    assert spec["decode_tokens"] == verified_tokens + spec["decode_steps"] - spec["verified_passes"]
    measured = spec["decode_tokens"] / (spec["decode_s"] + spec["draft_s"])
    assert spec["measured_tokens_per_s"] == pytest.approx(measured, rel=1e-12)
    request, speed = PlanRequest.of(model=str(model_dir), max_model_len=256), report["machine_speed"]
    hw = request.profile() if speed is None else request.profile().at_speed(speed["memory"], speed["compute"],
                                                                            speed.get("attention"))
    plans = plan_speculation(model_spec(model_dir), hw, request,
                             SpeculativeOptions(method="ngram", num_speculative_tokens=3),
                             context=round(spec["mean_context"]))
    k, share = round(spec["proposed"] / spec["verified_passes"]), spec["verified_passes"] / spec["decode_steps"]
    predicted = run_tokens_per_s(plans, spec["acceptance_rate"], k, share)
    assert spec["predicted_k"] == k and spec["predicted_tokens_per_s"] == pytest.approx(predicted, rel=1e-9)
    assert spec["predicted_over_measured"] == pytest.approx(predicted / measured, rel=1e-9)
    assert 0 < spec["forecast_over_measured"] < float("inf") and spec["forecast_k"] == 3
    text = format_report(report)
    assert f"{spec['predicted_over_measured']:.2f}x of measured" in text and "the prior acceptance 0.70" in text


def _llama_8b_with_1b_draft(gpu_memory: str):
    """llama-3.1-8b at q4_0 on an rtx4090 budget of gpu_memory, with the 1B draft at q4_0: (spec, draft spec,
    speculative options, plan request)."""
    from offload.options import SpeculativeOptions
    from offload.planner import PlanRequest
    from offload.weights.model_files import model_spec

    spec, draft = (model_spec(ROOT / "configs" / "models" / name) for name in ("llama-3.1-8b", "llama-3.2-1b"))
    options = SpeculativeOptions(method="draft_model", model=str(ROOT / "configs/models/llama-3.2-1b"),
                                 quantization="q4_0")
    request = PlanRequest.of(model=str(ROOT / "configs/models/llama-3.1-8b"), quantization="q4_0",
                             hardware="rtx4090-ddr5", gpu_memory=gpu_memory, max_model_len=4096)
    return spec, draft, options, request


def test_the_planner_prices_speculation_and_falls_back_to_no_proposals_where_they_do_not_pay():
    """llama-3.1-8b on a 4 GiB rtx4090 budget (its layers stream over PCIe) with the 1B draft in VRAM: proposals
    pay at acceptance 0.7 (a pass over 8 tokens costs little more than over 1); at acceptance 0 they never do."""
    from offload.hardware import load_hardware
    from offload.options import SpeculativeOptions
    from offload.planner.speculation import expected_tokens, price_speculation

    assert expected_tokens(0.0, 5) == 1 and abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    spec, draft, options, request = _llama_8b_with_1b_draft("4GiB")
    hw = load_hardware("rtx4090-ddr5")
    good = price_speculation(spec, hw, request, options, 0.7, draft)
    assert good.k > 0 and good.speedup > 1.2 and good.draft_gpu_bytes > 0 and good.draft_s > 0
    assert abs(good.tokens_per_s - good.tokens_per_pass / (good.verify_s + good.draft_s)) < 1e-9
    useless = price_speculation(spec, hw, request, options, 0.0, draft)
    assert useless.k == 0 and useless.draft_s == 0
    fixed = price_speculation(spec, hw, request, SpeculativeOptions(method="ngram", num_speculative_tokens=3), 0.5)
    assert fixed.k == 3 and fixed.draft_s == 0 and fixed.draft_gpu_bytes == 0


def test_a_moe_verify_pass_reads_its_tokens_union_of_experts_and_speculation_is_declined_where_it_loses():
    """Qwen3-30B-A3B at q4_0 partly offloaded (8 GiB of an rtx4090): a verify pass over k + 1 tokens reads the
    experts all of them are routed to (128 x (1 - (120/128)^8) = 51.6 of 128 for 8 tokens, against 8 for one), so it
    costs over 3x a plain step and prompt lookup at acceptance 0.5 is not worth one proposal; a dense 8B in RAM
    reads the same weights for 1 token or 8, and takes most of what it may (as ik_llama.cpp measured multi-token
    prediction losing on a partly offloaded MoE, 19.6 -> 11.4 tok/s, where it wins on dense models)."""
    from offload.options import SpeculativeOptions
    from offload.planner import PlanRequest
    from offload.planner.speculation import plan_speculation, price_on
    from offload.weights.model_files import model_spec

    options = SpeculativeOptions(method="ngram")
    plans = {}
    for name, gpu in (("qwen3-30b-a3b", "8GiB"), ("llama-3.1-8b", "0")):
        request = PlanRequest.of(model=str(ROOT / "configs/models" / name), quantization="q4_0",
                                 hardware="rtx4090-ddr5", gpu_memory=gpu, cpu_memory="64GiB", max_model_len=4096)
        spec = model_spec(ROOT / "configs/models" / name)
        plans[name] = plan_speculation(spec, request.profile(), request, options)
        if spec.moe is not None:
            assert spec.moe.expected_experts(8) == pytest.approx(128 * (1 - (120 / 128) ** 8))
    moe, dense = plans["qwen3-30b-a3b"], plans["llama-3.1-8b"]
    assert moe.pass_s(7) > 3 * moe.pass_s(0) and dense.pass_s(7) < 1.3 * dense.pass_s(0)
    assert price_on(moe, options, 0.5, 8).k == 0
    dense_price = price_on(dense, options, 0.5, 8)
    assert dense_price.k >= 4 and dense_price.speedup > 1.5


def test_the_planner_chooses_the_copys_format_by_its_predicted_speed_at_each_formats_prior():
    """SmolLM2-135M's fp32 weights in RAM: a q8_0 substitute (prior 0.95: the default model's q8_0 copies kept
    0.97-0.99 of their proposals) is predicted faster than a q4_0 one (0.7), so it is chosen and the price names it;
    at one acceptance stated for both, the cheaper q4_0. Llama-3.1-70B at q4_0 on a 22 GiB rtx4090 (method self): a
    q8_0 copy leaves the model no placement, so the q4_0 one is priced, with no error."""
    from offload.options import SpeculativeOptions
    from offload.planner import PlanRequest
    from offload.planner.speculation import choose_draft
    from offload.weights.model_files import model_spec

    def choose(name, acceptance=None, method="substitute", **budget):
        request = PlanRequest.of(model=str(ROOT / "configs/models" / name), max_model_len=4096, **budget)
        spec = model_spec(ROOT / "configs/models" / name)
        return choose_draft(spec, request.profile(), request, SpeculativeOptions(method=method), acceptance, spec)

    options, _, price = choose("smollm2-135m", quantization="none", dtype="fp32", hardware="cpu-desktop",
                               gpu_memory=0)
    assert options.quantization == price.draft_format == "q8_0" and price.acceptance == 0.95 and price.k >= 3
    assert "(substitute, q8_0 copy, acceptance 0.95)" in price.line()
    assert choose("smollm2-135m", 0.7, quantization="none", dtype="fp32", hardware="cpu-desktop",
                  gpu_memory=0)[2].draft_format == "q4_0"
    options, _, price = choose("llama-3.1-70b", method="self", quantization="q4_0", hardware="rtx4090-ddr5",
                               gpu_memory="22GiB", cpu_memory="64GiB")
    assert options.quantization == "q4_0" and price.draft_format == "q4_0"


def test_a_draft_that_pushes_the_models_layers_off_the_gpu_is_weighed(caplog):
    """llama-3.1-8b at q4_0 on an rtx4090 with the 1B draft: at 6 GiB the model alone keeps 3.8 GiB of its weights
    in VRAM, and the draft's 1.3 GiB push some of them to the CPU (3.4 GiB left), which costs more than the
    proposals gain: plan_draft_first drops the draft (loading nothing) and says why; at 8 GiB the draft pays."""
    from offload.api import plan_draft_first
    from offload.planner import plan_for
    from offload.planner.speculation import plan_speculation, price_on

    spec, draft, options, request = _llama_8b_with_1b_draft("6GiB")
    hw = request.profile()
    on_gpu = lambda plan: plan.tier("gpu").weights_bytes  # noqa: E731
    plans = plan_speculation(spec, hw, request, options, draft)
    assert on_gpu(plan_for(spec, hw, request.with_options(batch_size=1))) - on_gpu(plans.target) >= 2**28
    with caplog.at_level(logging.WARNING, logger="offload"):
        none, same, price, _ = plan_draft_first(options, request)
    assert none is None and same == request and not price.pays and price.k >= 1 and price.draft_gpu_bytes > 0
    assert price == price_on(plans, options, 0.7, options.max_speculative_tokens, min_k=1)
    assert "speculative decoding (draft_model) dropped" in caplog.text
    assert price_on(plan_speculation(spec, hw, request.with_options(gpu_memory="8GiB"), options, draft), options,
                    0.7, min_k=1).pays


def test_the_steps_run_are_priced_as_the_planner_prices_k_and_a_batch_is_not():
    """run_tokens_per_s with every step carrying the planner's k is the planner's own price; with none, the model's
    1-token step on what the draft leaves; a run that decoded two sequences a step gets no batch-1 price."""
    from offload.hardware import load_hardware
    from offload.planner.speculation import (against_measured, branch_gain, plan_speculation, price_on,
                                             run_tokens_per_s)

    spec, draft, options, request = _llama_8b_with_1b_draft("4GiB")
    hw = load_hardware("rtx4090-ddr5")
    plans = plan_speculation(spec, hw, request, options, draft, context=300)
    price = price_on(plans, options, 0.6)
    tree = run_tokens_per_s(plans, 0.6, price.k, 1.0, price.branches, branch_gain(0.6, price.branches))
    assert price.k > 0 and price.branches > 0 and tree == pytest.approx(price.tokens_per_s)  # a tree pays there
    chains = price_on(plans, options.model_copy(update={"max_branches": 0}), 0.6)
    assert chains.branches == 0 and run_tokens_per_s(plans, 0.6, chains.k, 1.0) == pytest.approx(chains.tokens_per_s)
    assert chains.tokens_per_s < price.tokens_per_s and "second candidates (kept at 0.60" in price.line()
    assert run_tokens_per_s(plans, 0.6, price.k, 0.0) == pytest.approx(1 / plans.pass_s(0))
    stats = {"decode_tokens_per_s": 30.0, "mean_batch": 2.0, "mean_context": 300.0, "acceptance_rate": 0.6,
             "proposed": 40, "verified_passes": 10, "decode_steps": 10}
    batch = against_measured(spec, hw, request, options, stats, 0.7, draft)
    assert batch["predicted_over_measured"] is None and "2.00 sequences a step" in batch["predicted_for"]
    one = against_measured(spec, hw, request, options, {**stats, "mean_batch": 1.0}, 0.7, draft)
    assert one["predicted_k"] == 4 and one["predicted_over_measured"] == pytest.approx(
        run_tokens_per_s(plans, 0.6, 4, 1.0) / 30.0)
    runs = against_measured(spec, hw, request, options, {**stats, "mean_batch": 1.0, "tokens_per_pass": 2.5,
                                                         "acceptance_by_depth": [0.5, 0.9]}, 0.7, draft)
    assert runs["predicted_tokens_per_pass"] == pytest.approx(1 + 0.5 + 0.45 + 0.405 + 0.3645)  # k = 4, by depth
    assert runs["tokens_per_pass_over_measured"] == pytest.approx(runs["predicted_tokens_per_pass"] / 2.5)
    assert runs["predicted_tokens_per_s"] == pytest.approx(run_tokens_per_s(plans, [0.5, 0.9], 4, 1.0))


def test_simulate_prints_the_chosen_k_and_refuses_an_acceptance_without_a_method():
    import subprocess

    model = ["--model", str(ROOT / "configs/models/llama-3.1-8b"), "--hardware", "rtx4090-ddr5", "--gpu-memory",
             "4GiB", "--quantization", "q4_0", "--decode-steps", "2", "--prompt-len", "16", "--batch-size", "1"]
    done = subprocess.run([sys.executable, "-m", "offload", "simulate", *model, "--set", "speculative.method=ngram",
                           "--speculative-acceptance", "0.6"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "speculative decoding (ngram, acceptance 0.60): k = " in done.stdout
    bad = subprocess.run([sys.executable, "-m", "offload", "simulate", *model, "--speculative-acceptance", "0.6"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "needs a speculative method" in bad.stderr and "Traceback" not in bad.stderr


def test_plan_prints_the_priced_speculation_and_puts_it_in_its_json():
    import json
    import subprocess

    model = ["--model", str(ROOT / "configs/models/llama-3.1-8b"), "--hardware", "rtx4090-ddr5", "--gpu-memory",
             "4GiB", "--quantization", "q4_0", "--batch-size", "1", "--set", "speculative.method=ngram",
             "--speculative-acceptance", "0.6"]
    runs = [subprocess.run([sys.executable, "-m", "offload", "plan", *model, *extra], capture_output=True, text=True,
                           timeout=300) for extra in ((), ("--json",))]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr + runs[1].stderr
    priced = json.loads(runs[1].stdout)["speculative"]
    assert priced["method"] == "ngram" and priced["acceptance"] == 0.6 and priced["k"] >= 1
    line = next(x for x in runs[0].stdout.splitlines() if x.startswith("speculative decoding (ngram, acceptance 0.60)"))
    assert f"k = {priced['k']}," in line and f"predicted {priced['tokens_per_s']:.2f} tok/s" in line
    gpu_plan = [a if a != "speculative.method=ngram" else "speculative.method=substitute" for a in model]
    priced = subprocess.run([sys.executable, "-m", "offload", "plan", *gpu_plan], capture_output=True, text=True,
                            timeout=300)  # copies of the far units beside the resident ones, in VRAM or RAM
    assert priced.returncode == 0 and "copies of the far units (" in priced.stdout, priced.stderr


def _fitted(step_s, drafter=None) -> Speculator:
    """A Speculator whose fit has seen decode steps of 1-8 tokens taking step_s(n_tokens) seconds."""
    from types import SimpleNamespace

    spec = Speculator(drafter or NgramDrafter(4, 1))
    for n in (1, 2, 4, 8, 1, 2, 4, 8):
        spec.observe_step(SimpleNamespace(n_tokens=n, n_seqs=1, kv_read_tokens=100), step_s(n), 1)
    return spec


def test_k_counts_every_sequences_proposals_and_falls_to_zero_at_large_batch():
    """A step of n sequences with k proposals each carries n k more tokens: where a token costs 0.005 s beside a
    0.1 s read of the weights, one sequence takes many proposals, 32 take one, 64 none."""
    spec = _fitted(lambda n: 0.1 + 0.005 * n)
    assert spec.choose_k(1) >= 4 and spec.choose_k(32) == 1 and spec.choose_k(64) == 0


def test_k_weighs_a_draft_models_measured_pass():
    """Proposals from a draft model cost its passes: at 0.05 s a pass beside a 0.1 s step, k stays small; free
    proposals (prompt lookup) on the same steps take the most."""
    class Drafter:  # a draft model's timing as ModelDrafter records it
        seconds, passes = 0.5, 10

    step = (lambda n: 0.1 + 0.0001 * n)
    assert _fitted(step, Drafter()).choose_k(1) <= 2 and _fitted(step).choose_k(1) >= 6


def test_k_prices_the_acceptance_by_depth():
    """Proposals kept in runs: depth 0 kept at 0.5, and past a kept one 0.9. One rate over all of them (0.6) prices
    a 3-proposal chain at 1.74 tokens a pass, the rates by depth at 2.17 (the chain's real mean), so k goes further
    at the same costs; verify() counts each depth it checks."""
    from offload.planner.speculation import expected_tokens

    class Drafter:  # 0.03 s a draft pass beside a 0.1 s step
        seconds, passes = 3.0, 100

    assert expected_tokens(0.6, 3) == pytest.approx(1 + 0.6 + 0.36 + 0.216)
    assert expected_tokens([0.5, 0.9], 3) == pytest.approx(1 + 0.5 + 0.45 + 0.405)
    step = (lambda n: 0.1 + 0.0001 * n)
    flat, runs = _fitted(step, Drafter()), _fitted(step, Drafter())
    flat.stats.reached, flat.stats.kept_at = [1000], [600]
    runs.stats.reached, runs.stats.kept_at = [1000, 500, 450, 405], [500, 450, 405, 365]
    assert runs.choose_k(1) > flat.choose_k(1)
    spec = Speculator(Fixed([1, 2, 3]), num_tokens=3)
    taken = []
    rows = [torch.nn.functional.one_hot(torch.tensor(t), 8).float() for t in (1, 2, 7, 5)]  # keeps 1, 2; rejects 3
    spec.verify(rows, [1, 2, 3], greedy(), None, [0], [], lambda token, row: taken.append(token) or True)
    assert taken == [1, 2, 7] and spec.stats.reached == [1, 1, 1] and spec.stats.kept_at == [1, 1, 0]
    assert spec.stats.as_dict()["acceptance_by_depth"] == [1.0, 1.0, 0.0]


def test_a_substitute_drafts_over_the_models_cache_and_keeps_greedy_answers(model_dir):
    """method substitute: the q4_0 copy drafts over the model's own KV cache (no cache of its own, nothing
    prefilled by the draft: its passes are the proposals' alone), answers stay plain decoding's, its bytes leave
    out a KV cache; a draft whose layers would keep their caches elsewhere than the model's is refused in one line."""
    from offload.planner import PlanRequest
    from offload.planner.speculation import plan_speculation
    from offload.options import SpeculativeOptions
    from offload.weights.model_files import model_spec

    plain = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32")
    prompts, params = ["The quick brown fox", "Hello there", REPEATS], [greedy(20), greedy(9), greedy(16)]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    sub = LLM(str(model_dir), backend="cpu", max_model_len=256, dtype="fp32",
              speculative_config={"method": "substitute", "num_speculative_tokens": 3})
    drafter, chunks = sub.generator.speculator.drafter, []
    schedule = drafter.generator.schedule
    drafter.generator.schedule = lambda running: (s := schedule(running), chunks.extend(n for _, n in s.chunks))[0]
    assert [o.token_ids for o in sub.generate(prompts, params)] == want
    stats = sub.speculative_stats
    assert chunks and set(chunks) == {1}  # each proposal's run computes the sequence's last token, not its prompt
    assert not hasattr(drafter, "pool") and drafter.draft.request.model.quantization == sub.speculative.quantization
    draft = drafter.draft.model  # it looks tokens up in the model's embedding, its own copy let go
    assert draft._embed_from is sub.model and draft._embed_name not in draft.host_weights
    assert 0 < stats["accepted"] <= stats["proposed"] and drafter.passes <= 3 * stats["verified_passes"]
    request = PlanRequest.of(model=str(model_dir), max_model_len=256, hardware="rtx4090-ddr5", gpu_memory=0)
    spec = model_spec(model_dir)
    held = {m: plan_speculation(spec, request.profile(), request, SpeculativeOptions(method=m)).draft_cpu_bytes
            for m in ("self", "substitute")}
    assert held["substitute"] < held["self"]  # no KV cache or embedding of its own
    from offload.planner.request import plan_for
    from offload.planner.speculation import draft_held

    plan = plan_for(spec, request.profile(), request.with_options(quantization="q4_0"))
    embed = next(u for u in plan.units if u.kind == "embed")
    assert draft_held(plan, kv=False)[1] - draft_held(plan, kv=False, embedding=False)[1] == embed.weight_bytes > 0
    from offload.planner.placement import Placement

    with pytest.raises(ConfigError, match="caches where the model's do"):  # the model placed on the CPU by hand,
        # the draft planned on its own, onto the (simulated) GPU
        LLM(str(model_dir), backend="sim", hardware="rtx4090-ddr5", placement=Placement.uniform(spec, "cpu", "cpu"),
            max_model_len=256, dtype="fp32", speculative_config={"method": "substitute", "num_speculative_tokens": 2})
