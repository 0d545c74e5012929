"""A GGUF file whose metadata holds a number the math cannot use (issue 44 item 4, its GGUF half): a NaN or
negative rope base, a negative norm epsilon, a layer count past the planner's cap. Each is one error line (exit 2)
naming the key and the value, and says that the file, not a config.json the user does not have, is to be fetched
or converted again; validate (no weights read) sees it too."""

from __future__ import annotations

import math

import pytest

from conftest import make_hf_model
from gguf_support import K_TINY, write_gguf
from jobs_support import completion_line, run_cli, write_batch

pytest.importorskip("gguf")

# name -> (config values written into the file's metadata, words of the error)
CASES = {
    "rope base NaN": ({"rope_theta": math.nan}, ["key 'rope_theta' must be a finite number", "found nan"]),
    "rope base 0": ({"rope_theta": 0.0}, ["key 'rope_theta'", "found 0.0"]),
    "rope base negative": ({"rope_theta": -5.0}, ["key 'rope_theta'", "found -5.0"]),
    "rope base infinite": ({"rope_theta": math.inf}, ["key 'rope_theta'", "found inf"]),
    "norm epsilon negative": ({"rms_norm_eps": -1.0}, ["key 'rms_norm_eps' must be a finite number greater than 0",
                                                       "found -1.0"]),
    "norm epsilon NaN": ({"rms_norm_eps": math.nan}, ["key 'rms_norm_eps'", "found nan"]),
    "norm epsilon 0": ({"rms_norm_eps": 0.0}, ["key 'rms_norm_eps'", "found 0.0"]),
    "a million layers": ({"num_hidden_layers": 10**6}, ["'num_hidden_layers' is 1,000,000, above the 10,000"]),
    "context past the cap": ({"max_position_embeddings": 10**8}, ["'max_position_embeddings' is 100,000,000"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_number_in_gguf_metadata_is_one_line_blaming_the_file(tmp_path, name):
    values, words = CASES[name]
    model = make_hf_model("llama", **{**K_TINY, "vocab_size": 300})
    for key, value in values.items():  # the metadata only: the tensors stay the two layers' own
        setattr(model.config, key, value)
    path = write_gguf(model, tmp_path / "bad.gguf")
    write_batch(tmp_path / "in.jsonl", [completion_line("a", "hi")])
    for command in (["generate", "--model", path, "--prompt", "hi", "--max-tokens", 2],
                    ["validate", "--model", path, "--input", tmp_path / "in.jsonl"]):
        code, message = run_cli(*command)
        errors = [line for line in message.splitlines() if line.startswith("offload: error:")]
        assert code == 2 and len(errors) == 1 and "Traceback" not in message, (command[0], message)
        for word in [str(path), *words, "the GGUF file's metadata holds it", "download the file again"]:
            assert word in errors[0], (command[0], word, errors[0])
        assert "config.json" not in errors[0]
