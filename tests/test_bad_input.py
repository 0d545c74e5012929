"""Bad input: one clear sentence naming the file or tensor, exit code 2 from the CLI, no traceback."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from conftest import make_hf_model, save_hf_model, write_config
from offload.cli.main import main
from offload.errors import OffloadError, SamplingError
from offload.sampling import SamplingParams


@pytest.fixture
def folder(tmp_path):
    return save_hf_model(make_hf_model("llama"), tmp_path / "model")


def run_cli(capsys, model, *extra) -> str:
    """Run `offload generate` expecting failure; return the one-line error."""
    code = main(["generate", "--model", str(model), "--prompt", "hi", *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("offload: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_missing_model_path(capsys, tmp_path):
    msg = run_cli(capsys, tmp_path / "nope")
    assert "nope" in msg and "does not exist" in msg


def test_folder_without_config(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    msg = run_cli(capsys, tmp_path / "empty")
    assert "config.json" in msg and "empty" in msg


def test_git_lfs_pointer(capsys, folder):
    (folder / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123456\n")
    msg = run_cli(capsys, folder)
    assert "git-lfs pointer" in msg and "model.safetensors" in msg and "git lfs pull" in msg


def test_truncated_safetensors(capsys, folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    msg = run_cli(capsys, folder)
    assert "truncated" in msg and "model.safetensors" in msg


def test_sharded_index_names_missing_shard(capsys, tmp_path):
    folder = save_hf_model(make_hf_model("llama"), tmp_path / "sharded", max_shard_size="60KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (folder / shard).unlink()
    msg = run_cli(capsys, folder)
    assert shard in msg and "missing" in msg


def test_tensor_missing(capsys, folder):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    msg = run_cli(capsys, folder)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "missing" in msg


def test_tensor_shape_disagrees_with_config(capsys, folder):
    write_config(folder, intermediate_size=96)
    msg = run_cli(capsys, folder)
    assert "model.layers.0.mlp.gate_proj.weight" in msg and "[128, 64]" in msg and "[96, 64]" in msg


def test_unsupported_architecture(capsys, folder):
    write_config(folder, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    msg = run_cli(capsys, folder)
    assert "gpt2" in msg and "llama, mistral, qwen2" in msg


def test_unsupported_rope_type(capsys, folder):
    write_config(folder, rope_parameters={"rope_type": "mrope", "factor": 4.0, "rope_theta": 10000.0})
    msg = run_cli(capsys, folder)
    assert "mrope" in msg and "dynamic" in msg


@pytest.mark.parametrize("flags, word", [
    (["--temperature", "-0.5"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--min-p", "2"], "min_p"),
])
def test_invalid_sampling_parameters_cli(capsys, folder, flags, word):
    msg = run_cli(capsys, folder, *flags)
    assert word in msg


@pytest.mark.parametrize("kwargs, word", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(top_k=-3), "top_k"), (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_parameters_api(kwargs, word):
    with pytest.raises(SamplingError, match=word):
        SamplingParams(**kwargs)


def test_debug_flag_shows_traceback(folder):
    write_config(folder, model_type="gpt2")
    with pytest.raises(OffloadError):
        main(["generate", "--model", str(folder), "--prompt", "hi", "--debug"])


def test_prompt_longer_than_context(tmp_path):
    from offload import LLM

    llm = LLM(str(save_hf_model(make_hf_model("llama"), tmp_path / "m")))
    with pytest.raises(OffloadError, match=r"prompts\[0\]: the prompt has 70 tokens but this run's context .* is 64"):
        llm.generate([[1] * 70])
