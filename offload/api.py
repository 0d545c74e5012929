"""The Python API: offload.LLM(model).generate(prompts, SamplingParams(...)), shaped like vLLM's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from offload.errors import ConfigError
from offload.generate import Generator, Sequence
from offload.model.model import QUANTIZATIONS
from offload.model.sources import CheckpointSource
from offload.planner import Workload
from offload.runtime.executor import PlacedModel
from offload.runtime.placement import Placement
from offload.runtime.setup import make_backend, make_plan
from offload.runtime.timeline import Timeline
from offload.sampling import SamplingParams
from offload.spec import load_spec
from offload.weights.default_model import resolve_model
from offload.weights.loader import Checkpoint

_DTYPES = {"auto": torch.float32, "fp32": torch.float32, "float32": torch.float32,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


DEFAULT_MAX_MODEL_LEN = 2048  # context the KV cache is budgeted for unless max_model_len says otherwise
DEFAULT_MAX_BATCH_SIZE = 32  # sequences in flight when a placement is given and no batch size
_FORMAT_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class CompletionOutput:
    """One completion: text, generated token ids, and why it ended ('stop' or 'length')."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str


@dataclass
class RequestOutput:
    """The result for one prompt, as vLLM returns it; .text/.token_ids/.finish_reason are shortcuts."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason


class LLM:
    """A model loaded for generation; model is a Hugging Face folder or 'default'.

    max_batch_size None lets the planner choose the batch with the best predicted throughput in the budget.

    Where each block goes comes from the planner (memory budgets, hardware profile, workload) unless a
    Placement is given; the executor then runs that placement on the CUDA backend if a GPU is present,
    else on the CPU backend.
    """

    def __init__(self, model: str | Path = "default", quantization: str = "none", dtype: str = "auto",
                 max_batch_size: int | None = None, *, placement: Placement | None = None, gpu_memory=None,
                 cpu_memory=None, disk_memory=None, hardware=None, backend: str = "auto",
                 max_model_len: int | None = None, prefetch_depth: int = 2, disk_dir: str | None = None):
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype {dtype!r} is not supported; use one of auto, fp32, bf16, fp16")
        if quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization {quantization!r} is not supported; use one of {', '.join(QUANTIZATIONS)}")
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise ConfigError(f"max_batch_size must be a whole number of 1 or more, got {max_batch_size!r}")
        self.path = resolve_model(model)
        self.spec = load_spec(self.path)
        self.backend = make_backend(backend)
        torch_dtype = _DTYPES[dtype] if dtype != "auto" else (
            torch.float32 if self.backend.name == "cpu" else torch.bfloat16)
        self.plan = None
        if placement is None:
            workload = Workload(batch_size=max_batch_size or 1, kv_dtype=_FORMAT_OF_DTYPE[torch_dtype],
                                **_lengths(self.spec, max_model_len))
            self.plan = make_plan(self.spec, quantization, torch_dtype, workload, hardware, gpu_memory,
                                  cpu_memory, disk_memory, prefetch_depth, choose_batch=max_batch_size is None)
            placement = Placement.from_plan(self.plan)
            max_batch_size = self.plan.workload.batch_size
        self.max_batch_size = max_batch_size or DEFAULT_MAX_BATCH_SIZE
        source = CheckpointSource(Checkpoint(self.path), self.spec, torch_dtype, quantization)
        self.model = PlacedModel(self.spec, source, placement, self.backend, torch_dtype, disk_dir)
        self.tokenizer = _load_tokenizer(self.path)
        self.max_model_len = sum(_lengths(self.spec, max_model_len).values())
        self.generator = Generator(self.model, self.tokenizer, self._eos_ids(), self.max_batch_size,
                                   self.max_model_len)

    @property
    def timeline(self) -> Timeline:
        """Every copy, read and block computed so far, for the report."""
        return self.model.timeline

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.spec.eos_token_ids)
        gen_config = self.path / "generation_config.json"
        if gen_config.is_file():
            eos = json.loads(gen_config.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Complete each prompt (a string, a list of token ids, or {'prompt_token_ids': [...]})."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) or _is_token_list(prompts) else list(prompts)
        params = _broadcast(sampling_params, len(prompts))
        seqs, texts = [], []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            text, ids = self._tokenize(prompt)
            texts.append(text)
            seqs.append(Sequence(request_id=i, prompt_ids=ids, params=p))
        callback = None if on_finish is None else (lambda s: on_finish(self._output(s, texts[s.request_id])))
        self.generator.run(seqs, callback)
        return [self._output(s, t) for s, t in zip(seqs, texts)]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to conversations (one list of {'role', 'content'} dicts, or a list of them)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt)} for c in conversations]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template."""
        tok = self._require_tokenizer()
        if not tok.chat_template:
            raise ConfigError(f"the tokenizer in {self.path} has no chat template; pass plain prompts instead")
        ids = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self._require_tokenizer().encode(prompt))
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if _is_token_list(prompt):
            return None, [int(t) for t in prompt]
        raise ConfigError(f"a prompt must be a string, a list of token ids or {{'prompt_token_ids': [...]}}, "
                          f"got {type(prompt).__name__}")

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ConfigError(f"{self.path} has no tokenizer files; pass prompts as token ids")
        return self.tokenizer

    def _output(self, seq: Sequence, prompt: str | None) -> RequestOutput:
        completion = CompletionOutput(0, self.generator.text_of(seq), list(seq.output_ids), seq.finish_reason)
        return RequestOutput(str(seq.request_id), prompt, list(seq.prompt_ids), [completion])


def _is_token_list(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) for t in x)


def _broadcast(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ConfigError(f"got {len(params)} SamplingParams for {n} prompts; pass one, or one per prompt")
    return params


def _lengths(spec, max_model_len: int | None) -> dict:
    """Prompt and generation lengths the plan budgets the KV cache for."""
    total = min(max_model_len or DEFAULT_MAX_MODEL_LEN, spec.max_position_embeddings)
    if total < 2:
        raise ConfigError(f"max_model_len must be at least 2, got {max_model_len}")
    gen = min(128, total // 4) or 1
    return {"prompt_len": total - gen, "gen_len": gen}


def _load_tokenizer(path: Path):
    """The folder's Hugging Face tokenizer, or None if it has no tokenizer files."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
