"""SamplingParams' fields and bounds are the options' (issue 44 item 16): the job's `sampling` section and
RequestOptions in offload/options.py define them once; SamplingParams keeps vLLM's names and keyword constructor."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from offload.errors import SamplingError
from offload.option_values import parts
from offload.options import RequestOptions, SamplingOptions
from offload.sampling import SamplingParams

VLLM_NAMES = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
              "skip_special_tokens", "include_stop_str_in_output", "n", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "logit_bias", "logprobs", "prompt_logprobs", "structured_outputs")
OPTIONS = SamplingOptions.model_fields | RequestOptions.model_fields


def params_refuse(**values) -> bool:
    try:
        SamplingParams(**values)
    except SamplingError as e:
        assert e.param == next(iter(values)) and str(e).startswith(f"invalid sampling parameter: {e.param} must be ")
        return True
    return False


def options_refuse(**values) -> bool:
    section = SamplingOptions if next(iter(values)) in SamplingOptions.model_fields else RequestOptions
    try:
        section.model_validate(values)
    except ValidationError:
        return True
    return False


def edges(info) -> list[tuple[object, bool]]:
    """(value, refused) pairs on each side of each bound of a number field."""
    kind, bounds, _ = parts(info.annotation, info.metadata)
    step = 1 if kind is int else 0.5
    out = []
    for key, bound in bounds.items():
        outside = {"ge": bound - step, "gt": bound, "le": bound + step, "lt": bound}[key]
        inside = {"ge": bound, "gt": bound + step, "le": bound, "lt": bound - step}[key]
        out += [(outside, True), (inside, False)]
    return out


def test_the_fields_are_the_options_with_vllms_names_and_defaults():
    fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    assert set(fields) == set(VLLM_NAMES)
    assert set(fields) == set(OPTIONS) - {"max_tokens_cap"}, "SamplingParams' fields are the options' but the cap"
    made = SamplingParams()
    for name in fields:
        default = OPTIONS[name].get_default(call_default_factory=True)
        assert getattr(made, name) == (1.0 if name == "temperature" else default), name  # vLLM's temperature
    assert SamplingOptions().temperature == 0.0  # a job is greedy unless it says otherwise
    with pytest.raises(TypeError):
        SamplingParams(16)  # by keyword: the order of the fields is the options'


@pytest.mark.parametrize("name", [n for n in VLLM_NAMES if parts(OPTIONS[n].annotation)[0] in (int, float)])
def test_each_bound_is_the_same_for_the_job_section_and_sampling_params(name):
    cases = edges(OPTIONS[name])
    assert cases, f"{name} has no bounds"
    for value, refused in cases:
        assert params_refuse(**{name: value}) == refused, (name, value)
        assert options_refuse(**{name: value}) == refused, (name, value)


@pytest.mark.parametrize("name, value", [("stop", [""]), ("stop_token_ids", [-1]), ("logit_bias", {5: 100.5}),
                                         ("logit_bias", {-1: 1}), ("ignore_eos", "yes"), ("top_k", 1.5),
                                         ("temperature", float("nan")), ("max_tokens", True), ("seed", "7")])
def test_both_refuse_what_is_outside_a_field(name, value):
    """The section accepted an empty stop string and any logit bias, which every request then failed on."""
    assert params_refuse(**{name: value}), name
    assert options_refuse(**{name: value}) or isinstance(value, str), name  # YAML reads "7" as a number


@pytest.mark.parametrize("values, words", [
    ({"seed": 2**70}, "seed must be an integer from -2**63 to 2**64-1, got 1180591620717411303424"),
    ({"n": 65}, "n must be an integer from 1 to 64, got 65"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
    ({"temperature": -1}, "temperature must be a finite number >= 0, got -1"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative integers, got [-1]"),
    ({"logit_bias": {"5": 200}}, "logit_bias must be a mapping of non-negative integers to numbers in [-100, 100]"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false, got 'yes'"),
])
def test_a_refusal_says_the_range_of_the_option(values, words):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**values)
    assert words in str(e.value)


def test_what_sampling_params_accepts_beyond_the_section_types():
    """One stop string, and logit_bias keys as JSON gives them (strings of digits)."""
    params = SamplingParams(stop="</s>", logit_bias={"5": -100}, stop_token_ids=(2,), seed=-(2**63))
    assert params.stop == ["</s>"] and params.logit_bias == {5: -100} and params.stop_token_ids == [2]


def test_greedy_sampling_takes_the_first_maximum_and_refuses_non_finite_logits():
    """sample's fast paths (the finite check by a sum, numpy's argmax) against their definitions: the first of equal
    maxima, NaN and inf anywhere refused, and finite logits whose sum overflows fp32 still accepted."""
    import torch

    from offload.errors import WeightsError
    from offload.sampling import sample

    greedy, gen = SamplingParams(temperature=0), torch.Generator()
    logits = torch.zeros(1000)
    logits[[7, 300, 999]] = 2.0
    assert sample(logits, greedy, gen) == 7
    assert sample(logits[::2], greedy, gen) == 150  # a strided view
    assert sample(logits, greedy, gen, allowed=torch.arange(1000) > 100) == 300
    huge = torch.full((1000,), 3e38)  # finite, but their sum is inf
    assert sample(huge, greedy, gen) == 0
    for bad in (float("nan"), float("inf"), float("-inf")):
        with_bad = logits.clone()
        with_bad[500] = bad
        with pytest.raises(WeightsError, match="NaN or infinite"):
            sample(with_bad, greedy, gen)
