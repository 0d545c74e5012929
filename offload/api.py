"""The Python API: offload.LLM(model).generate(prompts, SamplingParams(...)), shaped like vLLM's."""

from __future__ import annotations

import json
import logging
import threading
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from pydantic import ValidationError


from offload.attention_sizes import pool_tokens
from offload.errors import ConfigError
from offload.formats import compute_format, kv_format, torch_dtype
from offload.engine import run_to_end
from offload.generate import Generator
from offload.planner import Placement, PlanRequest, plan_for, plan_spec
from offload.planner.speculation import MODEL_DRAFTS, SpeculationPrice
from offload.planner.prefix_price import host_tier_bytes
from offload.planner.substitutes import SubstituteLayout
from offload.substitute_draft import check_substitute, load_substitute
from offload.options import (DEFAULT_REASONING_PARSER, DEFAULT_TOOL_CALL_PARSER, PrefixCacheOptions, SpeculativeOptions,
                             default_of)
from offload.profile.timeline import Timeline
from offload.reasoning import AnswerSplit, answer_split
from offload.runtime.backends import make_backend, missing_gpu, simulated_gpu_warning
from offload.runtime.device_quant import set_gpu_crossover
from offload.runtime.executor import PlacedModel
from offload.runtime import speedprobe
from offload.runtime.host_memory import check_budget_fits_machine
from offload.sampling import SamplingParams, TokenLogprob
from offload.sequence import Sequence
from offload.speculative import make_speculator
from offload.system import memory_limit_bytes
from offload.weights.default_model import resolve_model
from offload.weights.model_files import load_tokenizer, model_spec, weight_source
from offload.tool_parsers import finish_reason, parse_answer, tool_parser
from offload.tools import ToolChoice, from_body as tools_of
from offload.weights.prompts import encode_chat, encode_text, with_reasoning_effort

DEFAULT_MAX_BATCH_SIZE = 32  # sequences in flight when a placement is given and no batch size
MAX_SEQS = 256  # sequences in flight at most when the planner chose the batch (vLLM's max_num_seqs)

log = logging.getLogger("offload")


@dataclass
class CompletionOutput:
    """One completion (sample `index` of the request's n): text, generated token ids, why it ended ('stop' or
    'length'), and each token's logprob with the top ones when SamplingParams.logprobs asked for them. LLM.chat's
    answer from a model that thinks (its chat template mentions <think>, or it is gpt-oss) has its reasoning (the
    <think> block's text; harmony's analysis channel) in reasoning_content and the rest in text (the token ids hold
    both)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None  # LLM.chat with tools: the calls made, in OpenAI's shape (text: the rest)


@dataclass
class RequestOutput:
    """The result for one prompt, as vLLM returns it; .text/.token_ids/.finish_reason are shortcuts."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob | None] | None = None  # SamplingParams.prompt_logprobs: None for token 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache gave (vLLM's name)

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
    """A model loaded for generation; model is a Hugging Face folder, a Hub id (org/name) in the local Hugging Face
    cache, or 'default'. Quantized weights come from the packed-weight cache after the first load (weights/cache.py).

    Where each block goes comes from the planner (memory budgets, hardware profile, workload: see PlanRequest
    for every option and its default) unless a Placement is given; max_batch_size None lets the planner choose
    the batch with the best predicted throughput. The executor runs the placement on the CUDA backend if a GPU
    is present, else on the CPU backend.
    """

    def __init__(self, model: str | Path = default_of("model.path"), *, placement: Placement | None = None,
                 disk_dir: str | None = None, max_batch_size: int | None = None,
                 speculative_config: dict | None = None, prefix_cache: dict | None = None, **options):
        """options: the plan's options by their outside names (offload/options.py, the same as the job YAML's
        and the flags': quantization, dtype, kv_cache_dtype, max_model_len, hardware, backend, gpu_memory,
        cpu_memory (the whole process, as memory.cpu), disk_memory, host_baseline, batch_size, prefetch_depth,
        prefill_chunk_tokens, max_tokens). max_batch_size is the old name of batch_size. speculative_config: the job YAML's
        `speculative` section as a dict (vLLM's name), e.g. {"method": "ngram", "num_speculative_tokens": 4};
        prefix_cache: the job YAML's `prefix_cache` section as a dict (enable_prefix_caching and
        prefix_cache_host_memory are its fields' keywords)."""
        speculative = speculative_options(speculative_config)
        prefix = prefix_cache_options(prefix_cache, {name: options.pop(name) for name in PREFIX_CACHE_NAMES
                                                     if name in options})
        if max_batch_size is not None:
            if options.get("batch_size") is not None:
                raise ConfigError("LLM got both batch_size and max_batch_size (its old name); pass batch_size only")
            warnings.warn("LLM(max_batch_size=...) is now LLM(batch_size=...)", DeprecationWarning, stacklevel=2)
            options["batch_size"] = max_batch_size
        self._load(PlanRequest.of(model=str(model), **options), placement, disk_dir, speculative, prefix)

    @classmethod
    def from_request(cls, request: PlanRequest, *, placement: Placement | None = None,
                     disk_dir: str | None = None, speculative_config=None, prefix_cache=None) -> "LLM":
        """An LLM planned from a PlanRequest (what `offload plan` prints for the same request)."""
        llm = cls.__new__(cls)
        llm._load(request, placement, disk_dir, speculative_options(speculative_config),
                  prefix_cache_options(prefix_cache))
        return llm

    def _load(self, request: PlanRequest, placement: Placement | None, disk_dir: str | None,
              speculative: SpeculativeOptions | None = None, prefix: PrefixCacheOptions | None = None,
              shared: dict | None = None, text: bool = True):
        """shared: device-resident units another model holds (a substitute draft's, PlacedModel); text: load the
        tokenizer (a substitute draft reads and writes token ids only: its copies' file may carry none)."""
        if placement is not None and not isinstance(placement, Placement):
            raise ConfigError(f"LLM(placement=...) takes a Placement (what offload.planner.plan_for returns), found "
                              f"{type(placement).__name__}; leave it out to let the planner place the model")
        draft, request, speculative = self._draft_first(speculative, request, placement)
        self.speculative = speculative
        self.request = request
        self._in_use, self._user = threading.Lock(), None  # one generation loop at a time (acquire)
        self.speed_probes: list[speedprobe.SpeedProbe] = []  # of the CPU's speed around a job, for its report
        self.path = resolve_model(request.model.path)
        self.spec = model_spec(self.path)
        self.plan = None
        if placement is None:
            check_profile_gpu(request)
        backend = request.hardware.backend
        self.backend = make_backend(backend, request.profile() if backend == "sim" else None)
        if placement is None:
            hw = request.profile()
            set_gpu_crossover(hw.gpu_crossover())  # linear()'s kernel by rows, as this profile measured it
            self.plan = plan_for(self.spec, hw, request)
            if request.hardware.profile is None:  # this machine's profile: the budgets must fit what it has now
                check_budget_fits_machine(self.plan.budget, self.backend)
            self.spec = plan_spec(self.spec, self.plan)  # its units: with the dense MLPs split off if it chose so
            placement = Placement.from_plan(self.plan)
            compute = self.plan.workload.compute_format
            self.max_batch_size = self.plan.workload.batch_size
            # the plan budgets KV for its batch at the whole context; the pool hands slots out by need, so more
            # short sequences run at once (up to vLLM's default of 256 and the step's tokens) unless the batch
            # size was given
            max_seqs = request.schedule.batch_size or min(max(MAX_SEQS, self.max_batch_size),
                                                          placement.prefill_pass_tokens)
        else:
            set_gpu_crossover({})  # no profile: the fused kernel at every row count
            if any(name.startswith("mlp.") for name in placement.units):  # dense MLPs placed apart from their layers
                self.spec = replace(self.spec, split_mlp=True)
            compute = compute_format(request.model.dtype, self.backend.device.type != "cpu")
            self.max_batch_size = max_seqs = request.schedule.batch_size or DEFAULT_MAX_BATCH_SIZE
        dtype = torch_dtype(compute)
        source = weight_source(self.path, self.spec, dtype, request.model.quantization)
        self.model = PlacedModel(self.spec, source, placement, self.backend, dtype, disk_dir,
                                 kv_dtype=torch_dtype(kv_format(request.model.kv_cache_dtype, compute)), shared=shared)
        self.tokenizer = load_tokenizer(self.path) if text else None
        self.max_model_len = request.context_len(self.spec)
        self.generator = Generator(self.model, self.tokenizer, self._eos_ids(), max_seqs, self.max_model_len,
                                   placement.prefill_pass_tokens,
                                   kv_tokens=pool_tokens(self.max_batch_size, self.max_model_len),
                                   logits_rows=self.max_batch_size)
        self.generator.between_steps = self._probe_cpu_speed_if_due
        self._use_prefix_cache(prefix or PrefixCacheOptions())
        self._use_speculation(speculative, draft)

    def _draft_first(self, speculative: SpeculativeOptions | None, request: PlanRequest, placement):
        """(the draft, the request for the model, the speculative options kept): where the planner places the model,
        a model draft planned first on the whole request (plan_draft_first; None and no options where it does not
        pay), its held bytes in draft_bytes and its price in draft_price; else no draft and request as it is."""
        self.draft_bytes = {"gpu": 0, "cpu": 0}  # what a speculative draft holds of the budgets (planned first)
        # the request the draft and the model share, and the draft's price on it (planner/speculation.py)
        self.whole_request, self.draft_price = request, None
        if speculative is None or speculative.method not in MODEL_DRAFTS or placement is not None:
            return None, request, speculative
        draft, request, self.draft_price, speculative = plan_draft_first(speculative, request)
        if draft is None:
            return None, request, None  # dropped: it does not pay (plan_draft_first logged why)
        self.draft_bytes = {"gpu": draft.plan_held[0], "cpu": draft.plan_held[1]}
        return draft, request, speculative

    def _use_speculation(self, speculative: SpeculativeOptions | None, draft: LLM | None) -> None:
        """The generator's speculator: a model draft loaded (with a placement given: planned on its own) and
        checked against this model, or prompt lookup, or none."""
        if speculative is not None and speculative.method in MODEL_DRAFTS:
            if isinstance(draft, SubstituteLayout):
                draft = load_substitute(speculative, self, draft)
            draft = draft or load_draft(speculative, self)
            check_draft_vocab(draft, self)
            if speculative.method == "substitute":
                check_substitute(draft, self)
                draft.model.share_embedding(self.model)
        self.generator.speculator = spec = make_speculator(speculative, draft)
        if spec is not None:  # a verify pass's rows in one read of the lm_head: a batch of 1 and its proposals (more
            # at a larger batch run in a second read); they take spec.most_tokens more rows of vocab_size fp32 logits
            self.generator.logits_rows = self.max_batch_size + spec.most_tokens

    def _use_prefix_cache(self, prefix: PrefixCacheOptions) -> None:
        """The generator's prefix cache as the options say: on or off, its host tier sized within the plan's room."""
        self.generator.prefix_caching = prefix.enabled
        self.generator.prefix_host_bytes = host_tier_bytes(self.plan, prefix.host_memory) if prefix.enabled else 0

    @property
    def speculative_stats(self) -> dict | None:
        """What speculative decoding did so far (proposed, accepted, acceptance_rate, tokens_per_pass), or None
        when it is off."""
        speculator = self.generator.speculator
        if speculator is None:
            return None
        draft_s = speculator.draft_seconds
        return {**speculator.stats.as_dict(), "draft_s": draft_s,
                "decode_tokens_per_s": speculator.stats.decode_tokens_per_s(draft_s)}

    @property
    def timeline(self) -> Timeline:
        """Every copy, read and block computed so far, for the report."""
        return self.model.timeline

    def probe_cpu_speed(self) -> None:
        """Add a probe of the CPU's speed now to speed_probes, in the format whose calibrated curves price this
        plan's CPU layers and on the thread count its steps start on; none where the plan has no CPU layers or its
        hardware profile no reference probe of that format (speedprobe.probe_format)."""
        fmt = speedprobe.probe_format(self.spec, self.plan, self.request.profile())
        if fmt is not None:
            probe = speedprobe.probe(fmt, threads=max(self.model.threads.counts))
            # stamped on the clock the generator times its steps by (a simulated device keeps its own)
            now = self.generator.now()
            self.speed_probes.append(replace(probe, at_s=now - probe.duration_s / 2))

    def _probe_cpu_speed_if_due(self) -> None:
        """Between the steps of a job that probes the CPU's speed (speed_probes begun): another probe when due."""
        if speedprobe.probe_due(self.speed_probes, self.generator.now()):
            self.probe_cpu_speed()

    def _eos_ids(self) -> tuple[int, ...]:
        """The token ids that end an answer: the eos ids of config.json, generation_config.json and the tokenizer,
        and the family's stop tokens the tokenizer has (gpt-oss's <|return|> and <|call|>)."""
        ids = set(self.spec.eos_token_ids)
        gen_config = self.path / "generation_config.json"
        if gen_config.is_file():
            eos = json.loads(gen_config.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        if self.tokenizer is not None and self.spec.family.stop_tokens:
            vocab = self.tokenizer.get_vocab()
            ids |= {vocab[token] for token in self.spec.family.stop_tokens if token in vocab}
        return tuple(sorted(ids))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Complete each prompt (a string, a list of token ids, or {'prompt_token_ids': [...]})."""
        if not isinstance(prompts, (str, dict, list, tuple)):
            raise ConfigError(f"prompts must be a string, a list of token ids, {{'prompt_token_ids': [...]}} or a list "
                              f"of these, got {type(prompts).__name__}")
        prompts = [prompts] if isinstance(prompts, (str, dict)) or _is_token_list(prompts) else list(prompts)
        params = _broadcast(sampling_params, len(prompts))
        seqs, texts = [], []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            text, ids = self._tokenize(prompt)
            texts.append(text)
            seqs.append(Sequence(request_id=i, prompt_ids=ids, params=p))
        callback = None if on_finish is None else (lambda s: on_finish(self.output_of(s, texts[s.request_id])))
        self.acquire("another LLM.generate call")
        try:
            run_to_end(self.generator, seqs, callback)
            self.model.flush()  # device timings resolved once per call, not per step
        finally:
            self.release()
        return [self.output_of(s, t) for s, t in zip(seqs, texts)]

    def acquire(self, user: str) -> None:
        """Hold the model for one generation loop (a generate call, or offload serve's engine thread) until
        release(); ConfigError names the one holding it already: the model runs one loop at a time."""
        if not self._in_use.acquire(blocking=False):
            raise ConfigError(f"this LLM is in use by {self._user}, and it runs one generation loop at a time; "
                              f"wait for that to finish, or load a second LLM")
        self._user = user

    def release(self) -> None:
        self._user = None
        self._in_use.release()

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             reasoning_effort: str | None = None, tools: list[dict] | None = None, tool_choice=None,
             parallel_tool_calls: bool | None = None) -> list[RequestOutput]:
        """Generate replies to conversations (one list of {'role', 'content'} dicts, or a list of them);
        chat_template_kwargs go to the chat template (such as {'enable_thinking': False} for Qwen3), and so does
        reasoning_effort ('low', 'medium' or 'high': gpt-oss's template reads it). tools, tool_choice and
        parallel_tool_calls are OpenAI's (offload/tools.py): each answer's calls come in its tool_calls."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = with_reasoning_effort(chat_template_kwargs, reasoning_effort)
        offered = tools_of({"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls})
        ids = [self.apply_chat_template(c, add_generation_prompt, kwargs, offered) for c in conversations]
        splits = [answer_split(self.tokenizer, i, DEFAULT_REASONING_PARSER, self.spec.family.reasoning_parser)
                  for i in ids]
        params = [p if offered is None else offered.sampling(p) for p in _broadcast(sampling_params, len(ids))]
        params = [p if split is None else split.sampling(p) for split, p in zip(splits, params)]
        outputs = self.generate([{"prompt_token_ids": i} for i in ids], params)
        for split, output in zip(splits, outputs):
            parser = tool_parser(self.tokenizer, offered, split, DEFAULT_TOOL_CALL_PARSER)
            if split is not None or parser is not None:
                output.outputs = [_read_answer(sample, split, parser, offered) for sample in output.outputs]
        return outputs

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None, tools: ToolChoice | None = None) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template (a system message folded into the
        first user turn where the template refuses one, as Gemma 2's does; tools as offload/tools.py renders them);
        text far past the context is refused before it is rendered."""
        return encode_chat(self.tokenizer, self.path, conversation, add_generation_prompt, chat_template_kwargs,
                           self.generator.context_len, tools)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, encode_text(self.tokenizer, self.path, prompt, self.generator.context_len)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if _is_token_list(prompt):
            return None, [int(t) for t in prompt]
        raise ConfigError(f"a prompt must be a string, a list of token ids or {{'prompt_token_ids': [...]}}, "
                          f"got {type(prompt).__name__}")

    def output_of(self, seq: Sequence, prompt: str | None = None) -> RequestOutput:
        """The RequestOutput of a finished sequence (its samples, for n > 1)."""
        completions = [CompletionOutput(s.index, self.generator.text_of(s), list(s.output_ids), s.finish_reason,
                                        s.logprobs) for s in seq.group]
        return RequestOutput(str(seq.request_id), prompt, list(seq.prompt_ids), completions, seq.prompt_logprobs,
                             seq.n_prefix_hit)


PREFIX_CACHE_NAMES = {"enable_prefix_caching": "enabled", "prefix_cache_host_memory": "host_memory"}


def prefix_cache_options(config, named: dict | None = None) -> PrefixCacheOptions:
    """LLM's prefix_cache (a dict of the job YAML's prefix_cache section) and its fields' keywords, checked as the
    YAML's section is; ConfigError names what is wrong."""
    if isinstance(config, PrefixCacheOptions) and not named:
        return config
    if config is not None and not isinstance(config, (dict, PrefixCacheOptions)):
        raise ConfigError(f"prefix_cache must be a dict of the prefix_cache options (enabled, host_memory), found "
                          f"{type(config).__name__}")
    raw = config.model_dump() if isinstance(config, PrefixCacheOptions) else dict(config or {})
    raw |= {PREFIX_CACHE_NAMES[name]: value for name, value in (named or {}).items() if value is not None}
    return _section(PrefixCacheOptions, raw, "prefix_cache")


def speculative_options(config) -> SpeculativeOptions | None:
    """LLM's speculative_config checked as the job YAML's speculative section; ConfigError names what is wrong."""
    if config is None or isinstance(config, SpeculativeOptions):
        return config
    if not isinstance(config, dict):
        raise ConfigError(f"speculative_config must be a dict of the speculative options (method, "
                          f"num_speculative_tokens, ...), got {type(config).__name__}")
    return _section(SpeculativeOptions, config, "speculative_config")


def _section(cls, raw: dict, name: str):
    """raw checked as the job YAML's section cls; a ConfigError names the first wrong key as name[key]."""
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = f"{name}[{err['loc'][0]!r}]" if err["loc"] else name
        raise ConfigError(f"{where}: {err['msg'].removeprefix('Value error, ')}") from None


def check_profile_gpu(request: PlanRequest) -> None:
    """ConfigError where the request names a profile with a GPU (a preset, not this machine) that backend auto or
    cuda cannot run here; a warning where it runs anyway (backend cpu or sim)."""
    if request.hardware.profile is None:
        return
    hw = request.profile()
    problem = missing_gpu(hw, request.hardware.backend, request.budget(hw).gpu_bytes)
    if problem:
        raise ConfigError(problem)
    warning = simulated_gpu_warning(hw)
    if warning:
        log.warning(warning)


def plan_draft_first(options: SpeculativeOptions,
                     request: PlanRequest) -> tuple[LLM | None, PlanRequest, SpeculationPrice, SpeculativeOptions]:
    """The draft LLM planned first, on the request's whole budget (batch: the request's, else one sequence), and
    the request for the model with the draft's GPU and CPU bytes taken from its budgets, as the planner prices
    speculation (planner/speculation.py), with the price of its best k (1 or more) at the prior acceptance, and the
    options with the draft's format (a copy of the model's own weights: the faster the planner predicts, unless
    set). Where the draft's room and steps cost more than its proposals gain, no draft (None) and the request as it
    was, unless the user set k."""
    from offload.planner.speculation import choose_draft, draft_held, without_draft

    path = options.draft_path(request.model.path)
    spec = model_spec(resolve_model(request.model.path))
    options, plans, price = choose_draft(spec, request.profile(), request, options, None,
                                         model_spec(resolve_model(path)), options.max_speculative_tokens, min_k=1)
    if not price.pays:
        log.warning(price.verdict(kept=options.num_speculative_tokens is not None))
        if options.num_speculative_tokens is None:
            return None, request, price, options
    if plans.layout is not None:  # copies of a GPU plan's far units: made once the model is (load_substitute)
        return plans.layout, without_draft(request, request.profile(), *plans.layout.plan_held), price, options
    own = options.method != "substitute"  # a substitute's KV cache, embedding and tokenizer are the model's
    draft = LLM.__new__(LLM)
    draft._load(request.with_options(model=path, quantization=options.draft_quantization,
                                     max_model_len=request.context_len(spec),
                                     batch_size=request.schedule.batch_size or 1), None, None, text=own)
    draft.plan_held = draft_held(draft.plan, kv=own, embedding=own)
    return draft, without_draft(request, request.profile(), *draft.plan_held), price, options


def check_draft_vocab(draft: LLM, llm: LLM) -> None:
    if draft.spec.vocab_size != llm.spec.vocab_size:
        raise ConfigError(f"the draft model {draft.path} has a vocabulary of {draft.spec.vocab_size} tokens and the "
                          f"model {llm.spec.vocab_size}; a draft model must share the model's tokenizer")


def load_draft(options: SpeculativeOptions, llm: LLM) -> LLM:
    """The draft LLM of speculative decoding: the model's own weights (self) or options.model (draft_model) in
    options.draft_quantization; llm's context, batch, backend and compute format; its vocabulary must be llm's."""
    request = llm.request
    path = options.draft_path(str(llm.path))
    quantization = options.draft_quantization
    # its own plan, not yet priced with the model's: on this machine, within what the process may use
    given = request.hardware.profile
    room = {"cpu_memory": memory_limit_bytes()} if given is None else {"hardware": given}
    return LLM(path, quantization=quantization, max_model_len=llm.max_model_len, batch_size=llm.max_batch_size,
               backend=request.hardware.backend, dtype=request.model.dtype, **room)


def _read_answer(sample: CompletionOutput, split: AnswerSplit | None, parser: str | None,
                 offered: ToolChoice | None) -> CompletionOutput:
    """A chat answer with its reasoning (its <think> block's text, harmony's analysis) in reasoning_content and its
    tool calls in tool_calls (finish_reason tool_calls), out of text."""
    reasoning, content, calls = parse_answer(sample.text, split, parser, offered.names if offered else ())
    return replace(sample, text=(content or "").strip() if calls else content or "", reasoning_content=reasoning,
                   tool_calls=calls or None, finish_reason=finish_reason(sample.finish_reason, bool(calls)))


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


