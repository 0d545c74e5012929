"""scripts/bench_serve.py's helpers: where a served answer parts from the offline one, how partings are counted, the
percentiles it prints (its runs are in test_scripts_smoke)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_serve import classify, parting_token, percentile  # noqa: E402

WORDS = {1: " the", 2: " sea", 3: " is", 4: " blue", 5: " se", 6: "a"}


def decode(ids: list[int]) -> str:
    return "".join(WORDS[i] for i in ids)


def test_the_parting_token_is_the_first_offline_token_the_served_text_does_not_continue_with():
    assert parting_token([1, 2, 3, 4], " the sea is blue", decode) is None
    assert parting_token([1, 2, 3, 4], " the sea was blue", decode) == 2
    assert parting_token([1, 2, 3, 4], " a sea", decode) == 0
    # the served answer took other tokens that spell the same text so far (" se" + "a" for " sea"): it parts at the
    # first token whose text it does not continue with
    assert parting_token([1, 5, 6, 3], " the sea was", decode) == 3
    assert parting_token([1, 2], " the sea is", decode) == 2  # the served text runs on past the offline one


def test_partings_count_as_near_ties_below_the_gap_and_as_others_from_it():
    assert classify([None, 0.01, 0.049, 0.05, 1.2, None], tie=0.05) == {"identical": 2, "near_tie": 2, "other": 2}


def test_percentiles_are_nearest_rank():
    values = list(range(1, 101))
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100), percentile(values, 1)) == \
        (50, 99, 100, 1)
    assert percentile([3.0], 99) == 3.0
