"""Issue 32 items 15 and 16: --max-tokens is the default for requests that do not set max_tokens (and says so), a
cap is its own option (sampling.max_tokens_cap, --max-tokens-cap), a max_tokens beyond the context is a warning at
validate time, and a boolean is refused where a number is expected (a negative seed stays allowed)."""

from __future__ import annotations

import pytest

from jobs_support import completion_line, make_tiny_chat_model, read_records, run_cli, write_batch, write_job
from offload.cli.main import build_parser
from offload.errors import ConfigError

CONTEXT = 512  # the tiny chat model's max_position_embeddings (below the default max_model_len of 2048)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "model")


def job(tmp_path, model_dir, lines, **sections):
    write_batch(tmp_path / "in.jsonl", lines)
    base = {"model": {"path": str(model_dir)}, "input": {"path": "in.jsonl"}, "output": {"path": "o.jsonl"},
            "sampling": {"max_tokens": 4, "temperature": 0}, "schedule": {"batch_size": 4},
            "report": {"print": False, "progress": False}}
    return write_job(tmp_path / "job.yaml", **{**base, **sections})


def flag_help(command: str, dest: str) -> str:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return next(a.help for a in sub.choices[command]._actions if a.dest == dest).replace("%%", "%")


# --- item 15 ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["plan", "validate", "run"])
def test_max_tokens_help_says_it_is_the_default_of_requests_without_one(command):
    text = flag_help(command, "max_tokens")
    assert "that does not set max_tokens itself" in text and "(sampling.max_tokens; default 16)" in text
    assert "cap" not in text.lower()


@pytest.mark.parametrize("command", ["validate", "run"])
def test_max_tokens_cap_help_says_it_caps_every_body(command):
    text = flag_help(command, "max_tokens_cap")
    assert "whatever its body asks" in text and "(sampling.max_tokens_cap" in text


def test_the_cap_holds_requests_whose_body_asks_more(tmp_path, tiny_model):
    """ignore_eos: without the cap, 'long' would generate its 50 tokens."""
    config = job(tmp_path, tiny_model, [completion_line("long", "Once upon a time", max_tokens=50, ignore_eos=True),
                                        completion_line("short", "Once upon a time", max_tokens=3, ignore_eos=True),
                                        completion_line("unset", "Once upon a time", ignore_eos=True)])
    code, message = run_cli("run", config, "--max-tokens-cap", "5")
    assert code == 0, message
    used = {r["custom_id"]: r["response"]["body"]["usage"]["completion_tokens"] for r in read_records(tmp_path /
                                                                                                     "o.jsonl")}
    assert used == {"long": 5, "short": 3, "unset": 4}  # capped; a smaller body kept; the default (4) for none


def test_without_a_cap_the_body_decides(tmp_path, tiny_model):
    config = job(tmp_path, tiny_model, [completion_line("long", "Once upon a time", max_tokens=9, ignore_eos=True)])
    assert run_cli("run", config, "--max-tokens", "2")[0] == 0  # --max-tokens is no cap: the body's 9 stands
    assert read_records(tmp_path / "o.jsonl")[0]["response"]["body"]["usage"]["completion_tokens"] == 9


def warnings_of(message: str) -> list[str]:
    return [line for line in message.splitlines() if "beyond the context" in line]


def test_validate_warns_of_a_default_max_tokens_beyond_the_context(tmp_path, tiny_model):
    config = job(tmp_path, tiny_model, [completion_line("a", "hi")], sampling={"max_tokens": 600})
    code, message = run_cli("validate", config)
    assert code == 0 and ": ok;" in message
    [line] = warnings_of(message)
    assert line.startswith("offload: ") and f"context of {CONTEXT} tokens" in line
    assert "sampling.max_tokens (--max-tokens) is 600" in line and "model.max_model_len" in line


def test_validate_warns_of_a_body_beyond_the_context_of_max_model_len(tmp_path, tiny_model):
    lines = [completion_line("big", "hi", max_tokens=100), completion_line("fine", "hi", max_tokens=10)]
    config = job(tmp_path, tiny_model, lines, model={"path": str(tiny_model), "max_model_len": 64})
    code, message = run_cli("validate", config)
    [line] = warnings_of(message)
    assert code == 0 and "context of 64 tokens" in line and "custom_id 'big' asks 100" in line
    assert "'fine'" not in line and "sampling.max_tokens (" not in line


def test_validate_does_not_warn_within_the_context_or_under_the_cap(tmp_path, tiny_model):
    config = job(tmp_path, tiny_model, [completion_line("big", "hi", max_tokens=5000)], sampling={"max_tokens": 600})
    code, message = run_cli("validate", config, "--max-tokens-cap", "100")
    assert code == 0 and not warnings_of(message)
    config = job(tmp_path, tiny_model, [completion_line("a", "hi", max_tokens=CONTEXT - 1)])
    code, message = run_cli("validate", config)
    assert code == 0 and not warnings_of(message) and "beyond" not in message


# --- item 16 ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, flags", [
    ("max_tokens", []), ("temperature", []), ("max_tokens_cap", []),
    (None, ["--set", "sampling.max_tokens=true"]), (None, ["--set", "sampling.seed=false"]),
])
def test_a_boolean_where_a_number_is_expected_is_refused_naming_the_field(tmp_path, tiny_model, key, flags):
    sampling = {"max_tokens": 4, **({key: True} if key else {})}
    config = job(tmp_path, tiny_model, [completion_line("a", "hi")], sampling=sampling)
    code, message = run_cli("validate", config, *flags)
    field = key or flags[1].split("=")[0].removeprefix("sampling.")
    assert code == 2 and f"key 'sampling.{field}'" in message and "Traceback" not in message
    assert "True" in message or "False" in message


def test_llm_refuses_a_boolean_max_tokens_naming_it():
    from offload import LLM

    with pytest.raises(ConfigError, match="option max_tokens: expected a number, found True"):
        LLM("default", max_tokens=True)
    with pytest.raises(ConfigError, match="option batch_size: expected a number, found False"):
        LLM("default", batch_size=False)


def test_a_boolean_body_max_tokens_is_an_error_line_naming_it(tmp_path, tiny_model):
    config = job(tmp_path, tiny_model, [completion_line("b", "hi", max_tokens=True), completion_line("ok", "hi")])
    code, message = run_cli("validate", config)
    assert code == 2 and "custom_id 'b'" in message and "max_tokens" in message and "'ok'" not in message


def test_a_negative_seed_stays_allowed(tmp_path, tiny_model):
    """OpenAI's schema takes any 64-bit seed: in the YAML, as a flag, and in a body."""
    config = job(tmp_path, tiny_model, [completion_line("a", "hi", seed=-7, temperature=0.5)],
                 sampling={"max_tokens": 4, "seed": -(2**63)})
    code, message = run_cli("validate", config)
    assert code == 0, message
    code, message = run_cli("validate", config, "--seed", "-5")
    assert code == 0, message
