"""Predictions that hold: the calibrated CPU cost terms, the plan re-costed for the steps a run took, and the
fit of the overhead terms."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from offload.errors import ConfigError
from offload.hardware import load_hardware, profile_from_dict, profile_to_dict
from offload.planner.recost import recost_steps, step_phase
from offload.planner.search import plan
from offload.planner.types import Budget, Workload
from offload.profile.timeline import StepShape
from offload.spec import spec_from_config

CPU = load_hardware("cpu-desktop")
CURVE = {"q8_0": ((1, 40e9), (16, 100e9), (256, 160e9)), "fp32": ((1, 8e9), (64, 120e9))}
CALIBRATED = replace(CPU, cpu_flops_by_rows=CURVE, cpu_attention={"fused": 30e9, "torch": 20e9, "kv_read": 12e9},
                     overhead_s={"step": 2e-4, "layer": 1e-5, "layer_unfused": 3e-4, "sequence": 5e-5,
                                 "logit": 1e-9, "token": 2e-7})


def _spec(n_layers: int = 6, vocab: int = 4096):
    return spec_from_config({"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8,
                             "num_key_value_heads": 4, "intermediate_size": 1024, "num_hidden_layers": n_layers,
                             "vocab_size": vocab, "max_position_embeddings": 4096}, "test")


def _plan(hw, fmt="q8_0", batch=4, prompt=64, gen=16):
    wl = Workload(batch_size=batch, prompt_len=prompt, gen_len=gen, compute_format="fp32")
    return plan(_spec(), hw, Budget(0, 64 * 2**30), wl, weight_format=fmt)


def test_the_matmul_curve_is_interpolated_in_log_rows_and_held_flat_past_its_ends():
    assert CALIBRATED.cpu_matmul_rate("q8_0", 1) == 40e9
    assert CALIBRATED.cpu_matmul_rate("q8_0", 4) == pytest.approx(70e9)  # half way from 1 to 16 in log(rows)
    assert CALIBRATED.cpu_matmul_rate("q8_0", 4096) == 160e9
    assert CALIBRATED.cpu_matmul_rate("q4_0", 8) == CPU.cpu_flops_for("q4_0")  # no curve: the flat figure


def test_calibrated_terms_survive_the_yaml_round_trip_and_bad_ones_are_named():
    again = profile_from_dict(profile_to_dict(CALIBRATED), "round trip")
    assert again.cpu_flops_by_rows == CURVE and again.cpu_attention == CALIBRATED.cpu_attention
    assert again.overhead_s == CALIBRATED.overhead_s
    data = profile_to_dict(CALIBRATED)
    data["overhead"]["per_token"] = 1e-3
    with pytest.raises(ConfigError, match="overhead.*per_token.*step, layer"):
        profile_from_dict(data, "hw.yaml")
    data = profile_to_dict(CALIBRATED)
    data["cpu"]["flops_by_rows"]["q8_0"] = {0: 1e9}
    with pytest.raises(ConfigError, match="rows must be whole numbers of 1 or more"):
        profile_from_dict(data, "hw.yaml")


def test_overhead_terms_add_to_the_plans_step_time():
    bare, with_overhead = _plan(replace(CALIBRATED, overhead_s={})), _plan(CALIBRATED)
    spec = _spec()
    expected = 2e-4 + spec.n_layers * (1e-5 + 4 * 2e-7) + 4 * 5e-5 + 4 * spec.vocab_size * 1e-9  # 4 tokens a step
    assert with_overhead.decode.overhead_s == pytest.approx(expected)
    assert with_overhead.decode.step_s - bare.decode.step_s == pytest.approx(expected)
    # fp32 weights: the fused layer for steps of up to F32_KERNEL_ROWS tokens (this decode's 4), torch past them (a
    # 64-token prompt of 4 sequences); a bf16 plan's float weights: the fused layer at any size
    dense = _plan(CALIBRATED, fmt="fp32")
    assert dense.decode.overhead_s == pytest.approx(expected)
    prefill = 2e-4 + spec.n_layers * (3e-4 + 256 * 2e-7) + 4 * 5e-5 + 4 * spec.vocab_size * 1e-9
    assert dense.prefill.overhead_s == pytest.approx(prefill)
    wl = Workload(batch_size=4, prompt_len=64, gen_len=16, compute_format="bf16")
    bf16 = plan(spec, CALIBRATED, Budget(0, 64 * 2**30), wl, weight_format="fp32")
    assert bf16.prefill.overhead_s == pytest.approx(prefill - spec.n_layers * (3e-4 - 1e-5))


def test_a_step_of_the_plans_own_shape_costs_what_the_plan_predicts():
    """Re-costing is the plan's own cost model: a decode step of the plan's batch at the plan's mid-generation
    context costs the plan's decode step."""
    p = _plan(CALIBRATED, batch=4, prompt=64, gen=16)
    mid = 64 + 16 // 2
    shape = StepShape("decode", 0.0, 0, 4, 4, 4, attended_keys=4 * mid, kv_read_tokens=4 * mid)
    assert recost_steps(_spec(), CALIBRATED, p, [shape])["decode"] == pytest.approx(p.decode.step_s)


def test_recosting_sums_the_steps_of_each_phase_and_follows_their_shapes():
    p, spec = _plan(CALIBRATED), _spec()
    small = StepShape("decode", 0.0, 0, 2, 2, 2, attended_keys=40, kv_read_tokens=40)
    big = StepShape("decode", 0.0, 0, 64, 64, 64, attended_keys=64 * 900, kv_read_tokens=64 * 900)
    chunk = StepShape("prefill", 0.0, 500, 12, 13, 13, attended_keys=500 * 250 + 12 * 300, kv_read_tokens=5000)
    one = {s: recost_steps(spec, CALIBRATED, p, [s]) for s in (small, big, chunk)}
    both = recost_steps(spec, CALIBRATED, p, [small, big, chunk, small])
    assert both["decode"] == pytest.approx(2 * one[small]["decode"] + one[big]["decode"])
    assert both["prefill"] == pytest.approx(one[chunk]["prefill"])
    assert one[big]["decode"] > 5 * one[small]["decode"]  # 32x the tokens, and long contexts to read
    assert step_phase(chunk).n_tokens == 512 and step_phase(chunk).logit_rows == 13


@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("speeds", [None, ((0.8, 1.1), (1.25, 0.9))])
def test_the_fit_recovers_known_overhead_terms(speeds, given):
    """Steps whose times are the bare cost model plus known terms give those terms back; steps measured while the
    machine ran at another speed (each model's runs at its own) give the terms at the calibrated speed; attention
    rates given (measured apart) are kept as given and the rest fitted around them."""
    from offload.costfit import fit_overheads
    from offload.runtime.speedprobe import MachineSpeed

    bare = replace(CALIBRATED, cpu_attention={"fused": 1e30, "torch": 1e30, "kv_read": 1e30}, overhead_s={})
    truth = replace(CALIBRATED, cpu_attention={"fused": 25e9, "torch": 15e9, "kv_read": 9e9},
                    overhead_s={"step": 3e-4, "layer": 2e-5, "layer_unfused": 4e-4, "sequence": 6e-5, "logit": 2e-9,
                                "token": 1e-6})
    runs = []
    for i, (n_layers, vocab) in enumerate(((3, 4096), (9, 16384))):
        spec = _spec(n_layers, vocab)
        speed = MachineSpeed("q8_0", *speeds[i], 2) if speeds else None
        measured_on = truth.at_speed(speed.memory, speed.compute) if speed else truth
        for fmt in ("q8_0", "fp32"):
            p = plan(spec, bare, Budget(0, 64 * 2**30), Workload(1, 64, 16, compute_format="fp32"), weight_format=fmt)
            steps = []
            for n, ctx, prompt in ((1, 20, 0), (4, 300, 0), (16, 50, 0), (32, 900, 0), (1, 200, 200), (3, 700, 300)):
                shape = StepShape("prefill" if prompt else "decode", 0.0, prompt, n if not prompt else 0, n, n,
                                  attended_keys=(prompt or n) * ctx, kv_read_tokens=n * ctx)
                seconds = sum(recost_steps(spec, measured_on, p, [shape]).values())
                steps.append(replace(shape, seconds=seconds))
            runs.append((spec, fmt, steps, speed))
    attention = {"fused": 25e9, "kv_read": 9e9} if given else None
    fitted = fit_overheads(CALIBRATED, runs, log=lambda *a: None, attention=attention)
    for term, value in truth.overhead_s.items():
        assert fitted.overhead_s[term] == pytest.approx(value, rel=0.02, abs=1e-7), term
    for key, value in truth.cpu_attention.items():
        assert fitted.cpu_attention[key] == pytest.approx(value, rel=0.02), key
    if given:  # kept as given, to the last bit (a fitted rate would land near it, not on it)
        assert {k: fitted.cpu_attention[k] for k in attention} == attention


def test_a_job_report_predicts_for_the_steps_it_ran(tmp_path, tiny_llama_job):
    report = tiny_llama_job
    for phase in ("prefill", "decode"):
        p = report["phases"][phase]
        assert p["predicted_for"] == "the steps run"
        assert p["predicted_over_measured"] == pytest.approx(p["predicted_s_per_token"] / p["measured_s_per_token"])
        assert p["plan_s_per_token"] is not None and p["plan_s_per_token"] != p["predicted_s_per_token"]


@pytest.fixture
def tiny_llama_job(tmp_path):
    import json

    from conftest import make_hf_model, save_hf_model
    from offload.jobs.run import run_batch

    folder = save_hf_model(make_hf_model("llama", num_hidden_layers=2), tmp_path / "tiny")
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": list(range(1, 4 + 3 * i)), "max_tokens": 5 + i}} for i in range(5)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = {"model": {"path": str(folder), "quantization": "q8_0"}, "hardware": "cpu-desktop",
              "input": {"path": str(tmp_path / "in.jsonl")}, "output": {"path": str(tmp_path / "out.jsonl")},
              "sampling": {"temperature": 0, "ignore_eos": True}, "report": {"print": False, "progress": False}}
    return run_batch(config)


def test_a_step_on_one_thread_is_priced_on_the_one_thread_curve():
    hw = replace(CALIBRATED, n_cores=2, cpu_flops_one_thread={"q8_0": ((1, 25e9), (256, 80e9))})
    assert hw.cpu_matmul_rate("q8_0", 1, threads=1) == 25e9
    assert hw.cpu_matmul_rate("q8_0", 1, threads=2) == hw.cpu_matmul_rate("q8_0", 1) == 40e9
    p, spec = _plan(hw), _spec()
    full = StepShape("decode", 0.0, 0, 8, 8, 8, attended_keys=8 * 100, kv_read_tokens=8 * 100, threads=2)
    one = replace(full, threads=1)
    assert recost_steps(spec, hw, p, [one])["decode"] > 1.3 * recost_steps(spec, hw, p, [full])["decode"]


def test_calibrate_measures_curves_and_fits_the_terms_on_small_models(monkeypatch):
    """The whole of offload calibrate's cost part, shrunk: curves per format (and on one thread) with the speed
    probes beside them, the real scheduler on random models, the fit; the profile keeps them through YAML."""
    from offload import costfit
    from offload.runtime import speedprobe

    real_spec = costfit._calibration_spec
    monkeypatch.setattr(costfit, "CURVE_ROWS", (1, 8))
    monkeypatch.setattr(costfit, "CURVE_BYTES", 2**20)
    monkeypatch.setattr(costfit, "FIT_MODELS", ((2, 512), (4, 1024)))
    monkeypatch.setattr(costfit, "FIT_RUNS", ((1, 8, 4), (4, 8, 4), (1, 96, 2)))
    monkeypatch.setattr(costfit, "_calibration_spec", lambda n, vocab=512: spec_from_config(
        {**_small_config(n, vocab)}, "small"))
    monkeypatch.setattr(speedprobe, "PROBE_BYTES", 2**20)
    monkeypatch.setattr(speedprobe, "_WEIGHTS", {})
    monkeypatch.setattr(costfit, "K_CLASSES", (256, 512))
    # the curves of 1 MiB of weights in the caches are noise (0.02 to 1,900 GFLOP/s at 1 row on this busy machine):
    # their consistency checks, which would refuse them, have tests of their own
    monkeypatch.setattr(costfit, "curve_problems", lambda curves: [])
    monkeypatch.setattr(costfit, "N_CLASSES", (64, 256))
    monkeypatch.setattr(costfit, "K_REFERENCE", 256)
    monkeypatch.setattr(costfit, "N_REFERENCE", 256)
    monkeypatch.setattr(costfit, "SHAPE_ROWS", 8)
    monkeypatch.setattr(costfit, "ATTENTION_TOKENS", 96)
    monkeypatch.setattr(costfit, "KV_READ", (2, 96))
    monkeypatch.setattr(costfit, "KV_READ_BYTES", 2**20)
    measured = []
    real_attention = costfit.measure_attention
    monkeypatch.setattr(costfit, "measure_attention", lambda **kw: measured.append(real_attention(**kw)) or measured[-1])
    lines = []
    hw = costfit.calibrate_cpu_costs(CPU, lines.append)
    if measured[0] is not None:  # the C++ layer's attention is measured in rounds, and priced as measured
        assert len(measured) == costfit.ATTENTION_ROUNDS
        assert all(hw.cpu_attention[k] > 0 for k in ("fused", "kv_read"))
        assert any("cpu attention (fused layer)" in line for line in lines)
    assert set(hw.cpu_probe) == set(hw.cpu_flops_by_rows)
    assert all(m > 0 and c > 0 and a >= 0 for m, c, a in hw.cpu_probe.values())
    n_curves = len(hw.cpu_flops_by_rows) + len(hw.cpu_flops_one_thread)
    assert sum("to the reference speed" in line for line in lines) == n_curves  # each curve says how it was scaled
    assert set(hw.cpu_flops_by_rows) == set(costfit.CURVE_FORMATS + costfit.GGUF_CURVE_FORMATS
                                            + costfit.FLOAT_CURVE_FORMATS)
    assert hw.rated_format("q4_k") == "q4_k" and hw.rated_format("q5_k") == "q4_k"
    assert all(len(c) == 2 and all(r > 0 for _, r in c) for c in hw.cpu_flops_by_rows.values())
    assert set(hw.overhead_s) == {"step", "layer", "layer_unfused", "sequence", "logit", "token"}
    assert set(hw.cpu_attention) == {"fused", "torch", "kv_read"}
    assert set(hw.cpu_n_factor) == set(hw.cpu_k_factor) == set(hw.cpu_flops_by_rows)
    small_layer = [t.shape for t in costfit._calibration_spec(1).layer_tensors(0) if t.role == "linear"]
    for fmt in hw.cpu_n_factor:  # the calibration model's own linears are the curves': factor 1
        assert hw.shape_efficiency(fmt, small_layer) == pytest.approx(1.0), fmt
    assert any("overhead fit over" in line for line in lines)
    again = profile_from_dict(profile_to_dict(hw), "round trip")
    assert again.overhead_s == pytest.approx(hw.overhead_s) and again.cpu_flops_by_rows == hw.cpu_flops_by_rows
    assert again.cpu_probe == hw.cpu_probe and again.cpu_n_factor == hw.cpu_n_factor
    assert real_spec(2).n_layers == 2


def test_calibration_moves_each_measurement_to_the_reference_speed(monkeypatch):
    """References from rounds over every format; a curve measured while the machine ran at 0.5x is doubled, and
    attention measured at 0.5x then 2x the reference is kept at its rate at the reference."""
    from offload import costfit
    from offload.runtime.speedprobe import SpeedProbe

    speeds = iter([1.0, 1.0, 1.1, 1.1, 0.9, 0.9, 0.5, 0.5])  # rounds over two formats; then around one curve
    calls = []

    def probe(fmt):
        calls.append(fmt)
        speed = next(speeds)
        return SpeedProbe(fmt, speed * 10e9, speed * 100e9)

    monkeypatch.setattr(costfit, "probe", probe)
    refs = costfit.reference_probes(("q8_0", "q4_0"))
    assert calls == ["q8_0", "q4_0"] * 3 and refs == {"q8_0": (10e9, 100e9, 0.0), "q4_0": (10e9, 100e9, 0.0)}
    monkeypatch.setattr(costfit, "measure_cpu_curve", lambda fmt, rows, **kw: ((1, 5e9), (64, 50e9)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # one curve, not one more on one thread
    curves = costfit.measure_format_curves("q8_0", refs["q8_0"], log=lambda line: None)
    assert len(curves) == 1 and [r for r, _ in curves[0]] == [1, 64]
    assert [f for _, f in curves[0]] == [pytest.approx(10e9), pytest.approx(100e9)]
    speeds = iter([0.5, 0.5, 2.0, 2.0, 1.0, 1.0])  # around each of three attention rounds
    rates = iter([{"fused": 20e9, "kv_read": 4e9}, {"fused": 80e9, "kv_read": 16e9}, {"fused": 40e9, "kv_read": 8e9}])
    monkeypatch.setattr(costfit, "measure_attention", lambda repeats=5: next(rates))
    assert costfit.measure_attention_at_reference((10e9, 100e9)) == {"fused": 40e9, "kv_read": 8e9}
    # with the attention probed: its own speed moves the attention rate (here 4x the matmuls' at each round)
    attention = iter([2.0, 2.0, 8.0, 8.0, 4.0, 4.0])
    speeds = iter([0.5, 0.5, 2.0, 2.0, 1.0, 1.0])
    monkeypatch.setattr(costfit, "probe", lambda fmt: SpeedProbe(fmt, (r := next(speeds)) * 10e9, r * 100e9,
                                                                 next(attention) * 5e9))
    rates = iter([{"fused": 20e9, "kv_read": 4e9}, {"fused": 80e9, "kv_read": 16e9}, {"fused": 40e9, "kv_read": 8e9}])
    assert costfit.measure_attention_at_reference((10e9, 100e9, 5e9)) == {"fused": 10e9, "kv_read": 8e9}


def test_a_curve_bent_by_a_slowdown_is_measured_again_and_the_steady_one_kept(monkeypatch):
    """A slowdown of seconds (3x here) over the middle of a curve, where both probes saw the machine at its speed:
    the curve's fall as rows grow gives it away; it is measured again and the steady one kept. A machine unsteady
    every time keeps the try that moved least, after CURVE_TRIES."""
    from offload import costfit
    from offload.runtime.speedprobe import SpeedProbe

    monkeypatch.setattr(costfit, "probe", lambda fmt: SpeedProbe(fmt, 10e9, 100e9))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    steady = ((1, 5e9), (2, 9e9), (16, 30e9), (64, 50e9), (512, 80e9))
    bent = ((1, 5e9), (2, 9e9), (16, 30e9), (64, 50e9 / 3), (512, 80e9 / 3))
    tries = iter([bent, steady, bent])
    monkeypatch.setattr(costfit, "measure_cpu_curve", lambda fmt, rows, **kw: next(tries))
    lines = []
    [curve] = costfit.measure_format_curves("q8_0", (10e9, 100e9, 0.0), log=lines.append)
    assert list(curve) == [pytest.approx(point) for point in steady]
    assert next(tries) == bent and "measured 2 times" in lines[0]  # the third try was not needed
    worst, less = ((1, 5e9), (2, 40e9), (64, 8e9)), ((1, 5e9), (2, 40e9), (64, 20e9))
    tries = iter([worst, less, worst])
    [curve] = costfit.measure_format_curves("q8_0", (10e9, 100e9, 0.0), log=lambda line: None)
    assert list(curve) == [pytest.approx(point) for point in costfit.monotone_curve(less)]
    assert costfit.unsteadiness(steady, [SpeedProbe("q8_0", 10e9, 100e9), SpeedProbe("q8_0", 13e9, 100e9)]) == 1.3
    assert costfit.unsteadiness(((1, 9e9), (2, 5e9), (4, 6e9)), [SpeedProbe("q8_0", 1, 1)] * 2) == 1.0  # 1 row left out


def _small_config(n_layers: int, vocab: int) -> dict:
    return {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 512, "num_hidden_layers": n_layers, "vocab_size": vocab,
            "max_position_embeddings": 512}


def test_the_shape_factors_weigh_each_linear_by_its_work():
    hw = replace(CALIBRATED, cpu_k_factor={"q8_0": ((512, 0.5), (768, 1.0))})
    assert hw.shape_efficiency("q8_0", [(1000, 512)]) == 0.5 and hw.shape_efficiency("q8_0", [(1000, 768)]) == 1.0
    assert hw.shape_efficiency("q8_0", [(1000, 512), (1000, 768)]) == pytest.approx(1280 / (1024 + 768))
    assert hw.shape_efficiency("q8_0", [(1000, 640)]) == pytest.approx(0.75)  # linear in K between points
    assert hw.shape_efficiency("q4_0", [(1000, 512)]) == 1.0  # not calibrated for q4_0
    both = replace(hw, cpu_n_factor={"q8_0": ((192, 0.8), (2048, 1.0))})  # and by outputs N: the product
    assert both.shape_efficiency("q8_0", [(192, 512)]) == pytest.approx(0.4)
    assert both.shape_efficiency("q8_0", [(192, 768), (4096, 768)]) == pytest.approx((192 + 4096) / (192 / 0.8 + 4096))
    spec = spec_from_config({"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8,
                             "num_key_value_heads": 4, "intermediate_size": 512, "num_hidden_layers": 2,
                             "vocab_size": 1024, "max_position_embeddings": 512}, "k512")
    from offload.planner.costs import Phase, unit_cost

    layer = next(u for u in spec.units() if u.kind == "layer")
    phase = Phase("decode", 16, 16, 100, 100)
    slow, fast = (unit_cost(spec, layer, "q8_0", h, phase, "fp32").cpu_s for h in (hw, CALIBRATED))
    assert slow > 1.5 * fast  # every linear of this model has K = 512: matmuls take twice as long


def test_monotone_curve_pools_a_slow_point_with_its_neighbours():
    from offload.costfit import monotone_curve

    measured = ((1, 40e9), (8, 90e9), (64, 70e9), (128, 130e9), (512, 125e9))
    kept = monotone_curve(measured)
    rates = [r for _, r in kept]
    assert [m for m, _ in kept] == [1, 8, 64, 128, 512]
    assert all(a <= b * (1 + 1e-12) for a, b in zip(rates, rates[1:]))
    assert rates[0] == pytest.approx(40e9)  # points already in order stay as measured
    assert rates[1] == rates[2] == pytest.approx((90e9 * 70e9) ** 0.5)  # the dip pooled: geometric mean
    assert rates[3] == rates[4] == pytest.approx((130e9 * 125e9) ** 0.5)
    assert [r for _, r in monotone_curve(((1, 5.0), (2, 6.0)))] == pytest.approx([5.0, 6.0])


# Issue 44 item 14: `offload calibrate --quick` on a busy machine wrote q4_0 flat at 2 GFLOP/s beside q5_0 at 362,
# and every later plan priced by it. Curves are checked against each other before they are kept.
HEALTHY = ((1, 36e9), (4, 60e9), (16, 90e9), (64, 110e9))  # as this project's VM measures the quantized kernels
FLAT = ((1, 2e9), (4, 2e9), (16, 2e9), (64, 2e9))


def test_curves_that_contradict_each_other_or_the_kernels_are_named():
    from offload.rate_curves import curve_problems

    measured = {"fp32": ((1, 5e9), (4, 18e9), (16, 60e9), (64, 120e9)), "q8_0": ((1, 39e9), (64, 112e9)),
                "q4_0": ((1, 45e9), (64, 154e9)), "q2_k": ((1, 36e9), (64, 66e9)), "q5_1": ((1, 31e9), (64, 61e9))}
    assert curve_problems(measured) == []  # rows 1 and 64 as measured here: rises of 1.8-3.4x, within 2.5x
    named = [p for fmt, p in curve_problems({**measured, "q4_0": FLAT}) if fmt == "q4_0"]
    assert len(named) == len(curve_problems({**measured, "q4_0": FLAT}))  # the others are not blamed
    assert named == ["q4_0's rate does not rise with rows (2 GFLOP/s at 1 row, 2 GFLOP/s at 64)",
                     "q4_0 runs at 2 GFLOP/s at 1 row where the quantized formats' median is 33.5 GFLOP/s",
                     "q4_0 runs at 2 GFLOP/s at 64 rows where the quantized formats' median is 63.5 GFLOP/s"]
    fast = dict(curve_problems({**measured, "q5_1": ((1, 31e9), (64, 1500e9))}))  # 11x the median at 64 rows
    assert list(fast) == ["q5_1"] and "1500 GFLOP/s at 64 rows" in fast["q5_1"]
    assert curve_problems({**measured, "q8_0": ((1, 0.0), (64, 1e9))}) == [("q8_0", "q8_0 has a rate of 0 FLOP/s "
                                                                                   "at 1 row")]
    assert curve_problems({"fp32": FLAT, "q4_0": HEALTHY}) == []  # torch's float matmul and two formats: no median


def _quick_machine(monkeypatch, curve_of):
    """costfit's probes steady at one speed and measure_cpu_curve answering curve_of(fmt, how many times before)."""
    from offload import costfit
    from offload.runtime.speedprobe import SpeedProbe

    counts: dict[str, int] = {}

    def measure(fmt, rows, **kw):
        counts[fmt] = counts.get(fmt, 0) + 1
        return curve_of(fmt, counts[fmt] - 1)

    monkeypatch.setattr(costfit, "probe", lambda fmt: SpeedProbe(fmt, 10e9, 100e9))
    monkeypatch.setattr(costfit, "measure_cpu_curve", measure)
    return counts


def test_a_quick_curve_that_contradicts_the_others_is_measured_again(monkeypatch):
    from offload.quick_calibration import quick_cpu_curves

    counts = _quick_machine(monkeypatch, lambda fmt, before: FLAT if (fmt, before) == ("q4_0", 0) else HEALTHY)
    lines = []
    hw = quick_cpu_curves(load_hardware("cpu-desktop"), lines.append)
    assert list(hw.cpu_flops_by_rows["q4_0"]) == [pytest.approx(point) for point in HEALTHY]
    assert counts["q4_0"] == 2 and counts["q8_0"] == 1
    assert any(line.startswith("cpu matmul curves of q4_0 disagree (q4_0's rate does not rise") and
               "measuring them again" in line for line in lines), lines


def test_quick_curves_that_still_contradict_are_refused_naming_them(monkeypatch):
    from offload.errors import CalibrationError
    from offload.quick_calibration import quick_cpu_curves

    _quick_machine(monkeypatch, lambda fmt, before: FLAT if fmt == "q4_0" else HEALTHY)
    with pytest.raises(CalibrationError, match=r"contradict each other after measuring again: q4_0's rate does not "
                                               r"rise with rows .* no profile was saved"):
        quick_cpu_curves(load_hardware("cpu-desktop"), lambda line: None)


def test_quick_curves_measured_while_the_speed_moved_are_refused(monkeypatch):
    """Probes before and after a curve that disagree by 3x at every try (or rates that fall as rows grow)."""
    from offload import costfit
    from offload.errors import CalibrationError
    from offload.quick_calibration import quick_cpu_curves
    from offload.runtime.speedprobe import SpeedProbe

    _quick_machine(monkeypatch, lambda fmt, before: HEALTHY)
    speeds = iter([1.0, 3.0] * 1000)
    monkeypatch.setattr(costfit, "probe", lambda fmt: SpeedProbe(fmt, 10e9 * (s := next(speeds)), 100e9 * s))
    with pytest.raises(CalibrationError, match=r"the machine's speed moved by 3.00x while fp32's curve was measured"):
        quick_cpu_curves(load_hardware("cpu-desktop"), lambda line: None)
