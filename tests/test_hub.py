"""Hub ids (org/name) resolve through the local Hugging Face cache, never the network by default; a missing id
is one sentence naming where offload looked and how to download it; an existing local folder wins."""

from __future__ import annotations

import pytest

from conftest import make_hf_model, save_hf_model
from offload import LLM, SamplingParams
from offload.cli.main import main
from offload.errors import WeightsError
from offload.jobs.config import check_files
from offload.weights.default_model import resolve_model
from offload.weights.hub import hub_cache_dir, is_repo_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_model(hub, repo_id: str, seed: int = 0):
    """A tiny model laid out as huggingface_hub caches it: models--org--name/{refs/main, snapshots/<commit>/}."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return save_hf_model(make_hf_model("llama", seed=seed), repo / "snapshots" / COMMIT)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("OFFLOAD_ALLOW_DOWNLOAD", raising=False)
    return tmp_path / "hub"


def test_a_hub_id_resolves_to_its_snapshot_and_loads(hub):
    snapshot = fake_hub_model(hub, "tiny-org/tiny-llama")
    assert resolve_model("tiny-org/tiny-llama") == snapshot
    out = LLM("tiny-org/tiny-llama").generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.token_ids) == 4


def test_hf_home_is_read_when_the_lookup_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    snapshot = fake_hub_model(tmp_path / "hf" / "hub", "org/name")
    assert resolve_model("org/name") == snapshot


def test_a_missing_hub_id_says_where_offload_looked_and_how_to_download(hub, monkeypatch):
    import huggingface_hub

    calls = []
    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: calls.append(k) or real(*a, **k))
    with pytest.raises(WeightsError) as e:
        resolve_model("no-org/no-model")
    message = str(e.value)
    assert "no-org/no-model" in message and str(hub) in message and "hf download no-org/no-model" in message
    assert calls and all(k["local_files_only"] for k in calls)  # the network is never tried by default


def test_the_cli_prints_a_missing_hub_id_in_one_line_and_exits_2(hub, capsys):
    assert main(["generate", "--model", "no-org/no-model", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1  # checked as plan checks it, naming the key
    assert err[0].startswith("offload: error: command line: key 'model.path': model no-org/no-model ")
    assert main(["plan", "--model", "no-org/no-model"]) == 2
    assert "hf download no-org/no-model" in capsys.readouterr().err


def test_a_job_naming_a_missing_hub_id_lists_it_as_a_problem(hub):
    problems = check_files({"model": {"path": "no-org/no-model"}})
    assert len(problems) == 1 and problems[0].startswith("key 'model.path': model no-org/no-model ")


def test_an_existing_local_folder_named_like_an_id_wins(hub, tmp_path, monkeypatch):
    fake_hub_model(hub, "org/name", seed=1)
    local = save_hf_model(make_hf_model("llama"), tmp_path / "work" / "org" / "name")
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model("org/name").resolve() == local.resolve()


@pytest.mark.parametrize("name, is_id", [("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("org/name.v1", True),
                                         ("./org/name", False), ("/abs/name", False), ("a/b/c", False),
                                         ("~/name", False), ("org/..", False), ("default", False)])
def test_what_reads_as_a_hub_id(name, is_id):
    assert is_repo_id(name) == is_id
