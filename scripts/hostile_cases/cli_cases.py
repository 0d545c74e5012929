"""Command lines: job configs (YAML types, nesting, anchors, huge numbers, odd files), every command's flags (bad
sizes, negative, zero, NaN and infinite numbers, clashing and missing values) and model folders of each family with
one thing broken (config.json values, missing tensors, wrong shapes)."""

from __future__ import annotations

import math

from hostile_cases import cases

# ---------------------------------------------------------------------------------------------------------- configs


def _yaml(text: str):
    """A job config of this text (in place of the good one)."""
    return lambda fx, f: ["validate", fx.write_job(f, text)]


def _job(command: str = "validate", **sections):
    return lambda fx, f: [command, fx.write_job(f, **sections)]


def _binary(fx, f):
    (f / "job.yaml").write_bytes(bytes(range(256)) * 4)
    return ["validate", f / "job.yaml"]


def _laughs(levels: int = 9) -> str:
    """A billion laughs: each alias list holds nine of the one before (9^9 strings once expanded)."""
    lines = ['a0: &a0 ["lol"]'] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nsampling:\n  stop: *a{levels - 1}\n"


YAML = {
    "empty file": _yaml(""),
    "only a comment": _yaml("# a config to fill in\n"),
    "binary file": _binary,
    "a folder": lambda fx, f: ["validate", f],
    "top-level number": _yaml("42\n"),
    "billion laughs in stop": lambda fx, f: ["validate", fx.write_job(f, _laughs() + _model_lines(fx))],
    "recursive alias": lambda fx, f: ["validate", fx.write_job(f, "sampling: &s\n  stop: *s\n" + _model_lines(fx))],
    "merge key of a list": _yaml("base: &b [1, 2]\nmodel:\n  <<: *b\n"),
    "python object tag": _yaml("model: !!python/object/apply:os.system ['echo pwned']\n"),
    "two documents": _yaml("model: default\n---\ninput: in.jsonl\n"),
    "10,000 nested lists": _yaml("model: " + "[" * 10_000 + "]" * 10_000 + "\n"),
    "tab indentation": _yaml("model:\n\tpath: default\n"),
    "max_tokens 1e400": _job(sampling={"max_tokens": 1e400}),
    "max_tokens 10^30": (_job(sampling={"max_tokens": 10**30}), "ok"),  # documented: a warning, answers stop at
    # the context
    "max_model_len NaN": _job(model={"max_model_len": math.nan}),
    "temperature infinite": _job(sampling={"temperature": math.inf}),
    "stop holds null": _job(sampling={"stop": [None]}),
    "stop an empty string": _job(sampling={"stop": [""]}),
    "logit_bias key a word": _job(sampling={"logit_bias": {"abc": 1}}),
    "logit_bias 1000": _job(sampling={"logit_bias": {5: 1000}}),
    "cpu budget 1e999GiB": _job(memory={"cpu": "1e999GiB"}),
    "gpu budget NaN": _job(memory={"gpu": "nanGiB"}),
    "batch_size true": _job(schedule={"batch_size": True}),
    "memory a scalar": _job(memory="5GiB"),
    "unicode key": _job(sampling={"tëmperature": 1}),
    "zero-width space in the model path": lambda fx, f: ["validate", fx.write_job(
        f, model={"path": str(fx.model) + "\u200b"})],
    "model path a number": _job(model={"path": 12}),
    "output path empty": _job(output={"path": ""}),
    "input /dev/zero": _job(input={"path": "/dev/zero"}),
    "trace under /proc": _job("run", report={"trace": "/proc/no-such/trace.json", "print": False}),
    "speculative lookup min above max": _job(speculative={"method": "ngram", "prompt_lookup_min": 5,
                                                         "prompt_lookup_max": 2}),
    "speculative draft missing": _job(speculative={"method": "draft_model", "model": "/nowhere/draft"}),
    "hardware profile /etc/passwd": _job(hardware={"profile": "/etc/passwd"}),
    "hardware profile binary": lambda fx, f: [
        "validate", fx.write_job(f, hardware={"profile": str(_bytes(f, "hw.yaml", bytes(range(256))))})],
    "hardware profile a folder": lambda fx, f: ["validate", fx.write_job(f, hardware={"profile": str(f)})],
    "hardware profile with NaN RAM": lambda fx, f: ["plan", "--model", fx.model, "--hardware",
                                                    _hw(f, "cpu.memory", ".nan")],
    "hardware profile with negative bandwidth": lambda fx, f: ["plan", "--model", fx.model, "--hardware",
                                                               _hw(f, "disk.read_bandwidth", "-5")],
}


def _model_lines(fx) -> str:
    return f"model:\n  path: {fx.model}\ninput:\n  path: {fx.input}\n"


def _bytes(folder, name: str, data: bytes):
    (folder / name).write_bytes(data)
    return folder / name


def _hw(folder, key: str, value: str):
    """A hardware profile: the t4-server preset saved as YAML with one key (section.key) changed."""
    import yaml

    from offload.hardware import load_hardware, save_hardware

    path = save_hardware(load_hardware("t4-server"), folder / "hw.yaml")
    data = yaml.safe_load(path.read_text())
    section, name = key.split(".")
    data[section][name] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(data))
    return path

# ------------------------------------------------------------------------------------------------------------ flags


def _flags(command: str, *flags, model: bool = True, job: bool = False):
    def make(fx, f):
        head = [command] + (["--model", fx.model] if model else []) + (
            ["--input", fx.input, "--output", f / "o.jsonl"] if job else [])
        return [*head, *[a(fx, f) if callable(a) else a for a in flags]]
    return make


FLAGS = {
    "generate max-tokens 0": _flags("generate", "--prompt", "hi", "--max-tokens", "0"),
    "generate temperature nan": _flags("generate", "--prompt", "hi", "--temperature", "nan"),
    "generate temperature inf": _flags("generate", "--prompt", "hi", "--temperature", "inf"),
    "generate top-p 1e309": _flags("generate", "--prompt", "hi", "--top-p", "1e309"),
    "generate top-k -2": _flags("generate", "--prompt", "hi", "--top-k", "-2"),
    "generate seed 1e3": _flags("generate", "--prompt", "hi", "--seed", "1e3"),
    "generate empty raw prompt": _flags("generate", "--raw", "--prompt", ""),
    "generate max-model-len 10^11": (_flags("generate", "--prompt", "hi", "--max-model-len", "99999999999"), "ok"),
    # documented: max_model_len is at most the model's context
    "generate prompt of a million characters": _flags("generate", "--prompt", "x" * 1_000_000,
                                                      "--max-model-len", "64"),
    "generate dtype int8": _flags("generate", "--prompt", "hi", "--dtype", "int8"),
    "generate backend tpu": _flags("generate", "--prompt", "hi", "--backend", "tpu"),
    "generate cpu budget 1 byte": _flags("generate", "--prompt", "hi", "--cpu-memory", "1B"),
    "generate gpu budget 1e400GiB": _flags("generate", "--prompt", "hi", "--gpu-memory", "1e400GiB"),
    "generate stop empty": _flags("generate", "--prompt", "hi", "--stop", ""),
    "plan prefetch depth 0": _flags("plan", "--prefetch-depth", "0"),
    "plan prefill chunk 0": _flags("plan", "--prefill-chunk-tokens", "0"),
    "plan batch 1.5": _flags("plan", "--batch-size", "1.5"),
    "plan disk budget a word": _flags("plan", "--disk-memory", "plenty"),
    "plan misspelt preset": _flags("plan", "--hardware", "h100"),
    "plan hardware a missing YAML": _flags("plan", "--hardware", "/nowhere/hw.yaml"),
    "plan set without =": _flags("plan", "--set", "sampling.top_p"),
    "plan set an unknown section": _flags("plan", "--set", "nope.key=1"),
    "plan set a section to a number": _flags("plan", "--set", "sampling=3"),
    "plan set with no key": _flags("plan", "--set", "=5"),
    "plan set max_tokens to a list": _flags("plan", "--set", "sampling.max_tokens=[1, 2]"),
    "simulate decode steps 0": _flags("simulate", "--decode-steps", "0"),
    "simulate decode steps -5": _flags("simulate", "--decode-steps", "-5"),
    "simulate requests -1": _flags("simulate", "--requests", "-1"),
    "simulate prompt-len 0": _flags("simulate", "--prompt-len", "0"),
    "simulate prompt-len 10^9": _flags("simulate", "--prompt-len", "1000000000"),
    "simulate acceptance 1.5": _flags("simulate", "--speculative-acceptance", "1.5"),
    "simulate acceptance nan": _flags("simulate", "--speculative-acceptance", "nan"),
    "run max-tokens-cap 0": _flags("run", "--max-tokens-cap", "0", job=True),
    "run input-format yaml": _flags("run", "--input-format", "yaml", job=True),
    "run ray not an address": _flags("run", "--ray", "not an address", job=True),
    "run report is the input": _flags("run", "--report", lambda fx, f: fx.input, job=True),
    "run trace is the output": _flags("run", "--trace", lambda fx, f: f / "o.jsonl", job=True),
    "validate min-p 2": _flags("validate", "--min-p", "2", job=True),
    "serve port 0": _flags("serve", "--port", "0", "--print-config"),
    "serve port 70000": _flags("serve", "--port", "70000"),
    "serve max-waiting 0": _flags("serve", "--max-waiting", "0"),
    "serve max-upload -1B": _flags("serve", "--max-upload", "-1B"),
    "serve empty api key": _flags("serve", "--api-key", ""),
    "serve state dir a file": _flags("serve", "--state-dir", lambda fx, f: fx.input, "--port", "0"),
    "serve reasoning parser foo": _flags("serve", "--reasoning-parser", "foo"),
    "serve empty host": _flags("serve", "--host", ""),
    "eval-kl ctx 0": _flags("eval-kl", "--reference", lambda fx, f: fx.model, "--text", lambda fx, f: fx.input,
                            "--ctx", "0"),
    "eval-kl chunks -1": _flags("eval-kl", "--reference", lambda fx, f: fx.model, "--text",
                                lambda fx, f: fx.input, "--chunks", "-1"),
    "eval-kl text a binary file": _flags("eval-kl", "--reference", lambda fx, f: fx.model, "--text",
                                         lambda fx, f: _bytes(f, "t.txt", bytes(range(256)) * 64)),
    "eval-kl reference missing": _flags("eval-kl", "--reference", "/nowhere", "--text", lambda fx, f: fx.input),
    "cache with no subcommand": _flags("cache", model=False),
    "cache clear of a missing model": _flags("cache", "clear", "--model", "/nowhere/model", model=False),
    "calibrate output a folder": _flags("calibrate", "--output", lambda fx, f: f, model=False),
    "log level twice and quiet": _flags("plan", "--quiet", "--log-level", "loud"),
}

# ----------------------------------------------------------------------------------------------------------- models


def _family(family: str, command: str = "validate", config=None, **changes):
    def make(fx, f):
        model = fx.model_copy(f, family, config, **changes)
        return [command, "--model", model, "--input", fx.input] if command == "validate" else \
            [command, "--model", model, "--input", fx.input, "--output", f / "o.jsonl", "--max-model-len", "64"]
    return make


def _gemma3_multimodal(text_config):
    """A multimodal Gemma 3 config (model_type gemma3) whose text_config is text_config(the text model's)."""
    def config(c):
        return {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": 2,
                "text_config": text_config(c)}
    return config


def _longrope(short, long, partial=1.0):
    def config(c):
        return {**c, "rope_parameters": None, "original_max_position_embeddings": 32, "partial_rotary_factor": partial,
                "rope_scaling": {"rope_type": "longrope", "short_factor": short, "long_factor": long}}
    return config


def _tensors(change):
    def make(fx, f):
        return ["run", "--model", fx.weights_copy(f, change), "--input", fx.input, "--output", f / "o.jsonl",
                "--max-model-len", "64"]
    return make


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def _reshape(name, shape):
    import torch

    return lambda t: {**t, name: torch.zeros(shape, dtype=t[name].dtype)}


def _retype(name):
    import torch

    return lambda t: {**t, name: t[name].to(torch.int8)}


MODELS = {
    "qwen3 head_dim 0": _family("qwen3", head_dim=0),
    "qwen3 head_dim a string": _family("qwen3", head_dim="32"),
    "qwen3 kv heads 3 of 4": _family("qwen3", num_key_value_heads=3),
    "qwen3 kv heads 0": _family("qwen3", num_key_value_heads=0),
    "qwen3 sliding window -1": _family("qwen3", use_sliding_window=True, sliding_window=-1),
    "qwen3 vocab a word": _family("qwen3", vocab_size="big"),
    "qwen3 tie_word_embeddings a word": _family("qwen3", "run", tie_word_embeddings="yes"),
    "gemma2 query_pre_attn_scalar 0": _family("gemma2", query_pre_attn_scalar=0),
    "gemma2 attention softcap -1": _family("gemma2", attn_logit_softcapping=-1),
    "gemma2 final softcap a word": _family("gemma2", final_logit_softcapping="x"),
    "gemma2 sliding window 0.5": _family("gemma2", sliding_window=0.5),
    "gemma2 layer_types too short": _family("gemma2", layer_types=["sliding_attention"]),
    "gemma3 text_config a list": _family("gemma3_text", config=_gemma3_multimodal(lambda c: [c])),
    "gemma3 text_config without layers": _family("gemma3_text", config=_gemma3_multimodal(
        lambda c: {k: v for k, v in c.items() if k not in ("num_hidden_layers", "model_type")})),
    "gemma3 text_config layers a string": _family("gemma3_text", config=_gemma3_multimodal(
        lambda c: {**c, "num_hidden_layers": "3"})),
    "gemma3 sliding_window_pattern 0": _family("gemma3_text", sliding_window_pattern=0, layer_types=None),
    "gemma3 local rope base NaN": _family("gemma3_text", rope_parameters=None, rope_local_base_freq=math.nan),
    "gemma3 sliding rope section a word": _family("gemma3_text", rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}, "sliding_attention": "x"}),
    "phi3 partial_rotary_factor 0": _family("phi3", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                     "partial_rotary_factor": 0}),
    "phi3 partial_rotary_factor 1.5": _family("phi3", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                       "partial_rotary_factor": 1.5}),
    "phi3 partial_rotary_factor a word": _family("phi3", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                          "partial_rotary_factor": "half"}),
    "phi3 longrope short list": _family("phi3", config=_longrope([1.0] * 3, [1.0] * 8)),
    "phi3 longrope words": _family("phi3", config=_longrope(["a"] * 8, [1.0] * 8)),
    "phi3 longrope negative": _family("phi3", config=_longrope([1.0] * 8, [-1.0] * 8)),
    "phi3 longrope null": _family("phi3", config=_longrope(None, [1.0] * 8)),
    "phi3 longrope of a half head": _family("phi3", config=_longrope([1.0] * 8, [1.0] * 8, partial=0.5)),
    "gpt_oss layer_types unknown": _family("gpt_oss", layer_types=["sliding_attention", "chunked_attention"]),
    "gpt_oss layer_types a string": _family("gpt_oss", layer_types="sliding_attention"),
    "gpt_oss sliding window -5": _family("gpt_oss", sliding_window=-5),
    "gpt_oss sliding window a string": _family("gpt_oss", sliding_window="128"),
    "gpt_oss no experts": _family("gpt_oss", num_local_experts=0),
    "gpt_oss more experts per token than experts": _family("gpt_oss", num_experts_per_tok=9),
    "gpt_oss swiglu_limit NaN": _family("gpt_oss", "run", swiglu_limit=math.nan),
    "config.json a folder": lambda fx, f: ["validate", "--model", _config_folder(fx, f), "--input", fx.input],
    "config.json empty": lambda fx, f: ["validate", "--model", _config_bytes(fx, f, b""), "--input", fx.input],
    "config.json 10,000 nested objects": lambda fx, f: ["validate", "--model", _config_bytes(
        fx, f, b'{"a": ' * 10_000 + b"1" + b"}" * 10_000), "--input", fx.input],
    "missing q_proj": _tensors(_drop("model.layers.1.self_attn.q_proj.weight")),
    "missing the embedding": _tensors(_drop("model.embed_tokens.weight")),
    "down_proj of the wrong shape": _tensors(_reshape("model.layers.0.mlp.down_proj.weight", (64, 64))),
    "norm weight a matrix": _tensors(_reshape("model.norm.weight", (64, 2))),
    "an int8 q_proj": _tensors(_retype("model.layers.0.self_attn.q_proj.weight")),
    "chat template that does not parse": lambda fx, f: ["generate", "--model", _template(
        fx, f, "{% for m in messages %}{{ m.content "), "--prompt", "hi", "--max-tokens", "2"],
    "chat template that raises": lambda fx, f: ["generate", "--model", _template(
        fx, f, "{{ raise_exception('no system role') }}"), "--prompt", "hi", "--max-tokens", "2"],
}


def _config_folder(fx, f):
    model = fx.model_copy(f)
    (model / "config.json").unlink()
    (model / "config.json").mkdir()
    return model


def _config_bytes(fx, f, data: bytes):
    model = fx.model_copy(f)
    (model / "config.json").write_bytes(data)
    return model


def _template(fx, f, text: str):
    model = fx.model_copy(f)
    (model / "chat_template.jinja").unlink()
    (model / "chat_template.jinja").write_text(text)
    return model


CASES = cases("cli", {**YAML, **FLAGS, **MODELS})
