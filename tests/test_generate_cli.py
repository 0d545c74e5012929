"""`offload generate` takes the flags every other command takes, made from offload/options.py (issue 44 item 16):
the plan's (budgets, context, hardware, backend, batch, format), the sampling section's and --set; max_tokens has
the sampling section's one default there as everywhere."""

from __future__ import annotations

import pytest

from jobs_support import make_tiny_chat_model
from offload.api import LLM
from offload.cli.main import build_parser, main
from offload.options import default_of
from offload.sampling import SamplingParams

PLAN_FLAGS = ("cpu_memory", "gpu_memory", "max_model_len", "hardware", "backend", "batch_size", "quantization",
              "dtype", "model", "set")
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "model")


def actions(command: str) -> dict:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {a.dest: a for a in sub.choices[command]._actions}


def caught_chats(monkeypatch) -> list:
    """(the LLM's plan request, the SamplingParams) of each LLM.chat call, which still runs."""
    caught, chat = [], LLM.chat

    def spy(self, messages, sampling_params=None, **kwargs):
        caught.append((self.request, sampling_params))
        return chat(self, messages, sampling_params, **kwargs)

    monkeypatch.setattr(LLM, "chat", spy)
    return caught


def test_generate_takes_the_plan_and_sampling_flags_each_with_help():
    generate, plan = actions("generate"), actions("plan")
    missing = [d for d in (*PLAN_FLAGS, *SAMPLING_FLAGS) if d not in generate]
    assert not missing, f"offload generate lacks {missing}"
    # plan's own output flags: JSON, the explanation, the acceptance it prices speculation at (a run measures its own)
    assert set(plan) - {"json", "explain", "speculative_acceptance"} <= set(generate), \
        "generate takes every flag plan takes"
    silent = [a.option_strings for a in generate.values() if a.option_strings and not a.help]
    assert not silent, f"flags without help: {silent}"
    assert "(sampling.temperature; default 0.0)" in generate["temperature"].help
    assert "(sampling.max_tokens; default 16)" in generate["max_tokens"].help


def test_generate_plans_with_the_flags_and_set_reaches_the_sampling(tiny_model, monkeypatch, capsys):
    caught = caught_chats(monkeypatch)
    code = main(["generate", "--model", str(tiny_model), "--cpu-memory", "2GiB", "--max-model-len", "256",
                 "--batch-size", "2", "--backend", "cpu", "--set", "sampling.seed=3", "--temperature", "0.5",
                 "--top-k", "5", "--stop", "</s>", "--stop", "\n\n", "--max-tokens", "3", "--prompt", "hi"])
    assert code == 0, capsys.readouterr().err
    [(request, params)] = caught
    assert (request.memory.cpu, request.model.max_model_len, request.schedule.batch_size,
            request.hardware.backend) == (2 * 2**30, 256, 2, "cpu")
    assert (params.seed, params.temperature, params.top_k, params.max_tokens) == (3, 0.5, 5, 3)
    assert params.stop == ["</s>", "\n\n"]
    assert len(capsys.readouterr().out.splitlines()) >= 1


def test_generate_reads_a_job_yaml_as_plan_does(tiny_model, tmp_path, monkeypatch, capsys):
    (tmp_path / "job.yaml").write_text(f"model: {tiny_model}\nsampling: {{max_tokens: 2, repetition_penalty: 1.5}}\n"
                                       f"memory: {{cpu: 3GiB}}\n")
    caught = caught_chats(monkeypatch)
    assert main(["generate", str(tmp_path / "job.yaml"), "--prompt", "hi", "--max-tokens", "4"]) == 0
    [(request, params)] = caught
    assert request.memory.cpu == 3 * 2**30 and params.max_tokens == 4 and params.repetition_penalty == 1.5


@pytest.mark.parametrize("command", ["plan", "validate", "run", "serve", "generate"])
def test_max_tokens_has_the_sampling_sections_one_default_on_every_command(command):
    """generate said 128, every other command 16 (vLLM's and OpenAI's)."""
    action = actions(command)["max_tokens"]
    assert action.default is None and "default 16)" in action.help
    assert default_of("sampling.max_tokens") == SamplingParams().max_tokens == 16


def test_generate_without_max_tokens_generates_the_default(tiny_model, monkeypatch, capsys):
    caught = caught_chats(monkeypatch)
    assert main(["generate", "--model", str(tiny_model), "--max-model-len", "128", "--prompt", "hi"]) == 0
    assert caught[0][1].max_tokens == default_of("sampling.max_tokens")


def test_the_issues_command_works_on_the_default_model(monkeypatch, capsys):
    """Issue 44's acceptance line, on the default model where it is on this machine (no download in tests)."""
    from offload.weights.default_model import local_gguf

    if local_gguf() is None:
        pytest.skip("the default model is not on this machine")
    caught = caught_chats(monkeypatch)
    code = main(["generate", "--model", "default", "--cpu-memory", "2GiB", "--max-model-len", "1024", "--set",
                 "sampling.seed=3", "--prompt", "hi"])
    assert code == 0, capsys.readouterr().err
    assert caught[0][1].seed == 3 and caught[0][0].model.max_model_len == 1024
    assert capsys.readouterr().out.strip()
