"""A plan that does not fit says what to raise, and doing what it says makes the plan fit, for budgets all
around the model's size (issue 12, item 10: the advice near the model's size used to contradict itself)."""

from __future__ import annotations

import re

import pytest

from offload.errors import PlanError
from offload.hardware import load_hardware, parse_size
from offload.planner import PlanRequest, plan_for
from offload.spec import spec_from_config

# SmolLM2-135M's shape (the default model): 621 MiB of fp32 weights, 90 MiB of KV cache at 2048 tokens.
SMOL = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
        "max_position_embeddings": 8192, "tie_word_embeddings": True}
SIZE = r"([\d.]+ [KMG]?i?B)"
ADVICE = re.compile(rf"raise --cpu-memory by {SIZE} to hold every weight in RAM"
                    rf"(?:, or (?:by {SIZE} with )?--disk-memory by {SIZE})?")
MIB = 2**20


def _plan(cpu: int, disk: int = 0):
    request = PlanRequest.of(hardware="cpu-desktop", cpu_memory=cpu, disk_memory=disk, dtype="fp32", batch_size=1,
                             host_baseline=0, max_tokens=128)  # the arithmetic of the docstrings below
    return plan_for(spec_from_config(SMOL), load_hardware("cpu-desktop"), request)


@pytest.mark.parametrize("cpu_mib", [100, 300, 360, 372, 500, 700, 740])
def test_following_the_advice_makes_the_plan_fit(cpu_mib):
    with pytest.raises(PlanError) as e:
        _plan(cpu_mib * MIB)
    message = str(e.value)
    assert "or --cpu-memory by as much" not in message
    more_ram, with_disk_ram, disk = ADVICE.search(message).groups()
    assert _plan(cpu_mib * MIB + parse_size(more_ram)).budget.disk_bytes == 0  # every weight in RAM
    if disk is not None:  # or spill: the RAM it says (if any) and the disk it says
        plan = _plan(cpu_mib * MIB + parse_size(with_disk_ram or 0), parse_size(disk))
        assert plan.budget.disk_bytes > 0


def test_short_by_is_exact_and_the_advice_rounds_up():
    """259.98 MiB needed of 100 MiB (weights all on disk; the read-ahead arena holds two layers, and the page
    cache in flight 24 MiB): short by 159.98 MiB; raising RAM by 168.40 MiB (the 5% margin is taken from the
    budget: 0.95 x 268.40 = 254.98, what the placement needs besides it) and the disk by the weights spilled is
    what fits."""
    with pytest.raises(PlanError, match=r"short by 159\.98 MiB.*or by 168\.40 MiB with --disk-memory by 6\d\d\.\d\d MiB"):
        _plan(100 * MIB)


def test_an_impossible_batch_is_told_the_largest_batch_that_fits():
    """batch 100000 of SmolLM2's shape in 2 GiB: the KV cache is what does not fit, so the advice is the largest
    batch that fits (placed: that batch fits and one more does not); no --max-tokens (the cache is sized by
    max_model_len), no quantization saving a few MiB against TiB, no spilling weights to disk for it."""
    request = PlanRequest.of(hardware="cpu-desktop", cpu_memory=2 * 2**30, dtype="fp32", batch_size=100_000,
                             host_baseline=0)
    with pytest.raises(PlanError) as e:
        plan_for(spec_from_config(SMOL), load_hardware("cpu-desktop"), request)
    message = str(e.value)
    largest = int(re.search(r"--batch-size (\d+) is the largest batch that fits", message).group(1))
    assert "--max-tokens" not in message and "--quantization" not in message and "disk" not in message

    def fits(batch: int) -> bool:
        try:
            plan_for(spec_from_config(SMOL), load_hardware("cpu-desktop"), request.with_options(batch_size=batch))
        except PlanError:
            return False
        return True

    assert fits(largest) and not fits(largest + 1)


def test_a_context_too_long_for_one_sequence_is_told_the_longest_that_fits():
    request = PlanRequest.of(hardware="cpu-desktop", cpu_memory=800 * MIB, dtype="fp32", batch_size=1,
                             max_model_len=8192, host_baseline=0)
    with pytest.raises(PlanError, match=r"--max-model-len (\d+) is the longest context that fits") as e:
        plan_for(spec_from_config(SMOL), load_hardware("cpu-desktop"), request)
    tokens = int(re.search(r"--max-model-len (\d+)", str(e.value)).group(1))
    plan_for(spec_from_config(SMOL), load_hardware("cpu-desktop"), request.with_options(max_model_len=tokens))
