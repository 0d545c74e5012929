"""Every option a user can set, defined once: one typed section per concern, each field with its type, default,
unit and help. The job YAML is these sections; `LLM(...)` takes the plan's options as keywords of the same names;
the CLI's flags and their help are made from the fields (cli/job_flags.py); the planner reads PlanRequest, which holds
the same sections. Later sections (speculative decoding, the server) are added here the same way; docs/options.md
lists them all (`python -m offload.cli.options_doc` writes it).

A field's `name` is what it is called outside the YAML: the keyword of LLM(...) and the flag (`cpu_memory`,
`--cpu-memory` for memory.cpu). `cli` says which commands take it as a flag: "plan" (plan, validate, run, serve,
generate, simulate), "sampling" (validate, run, serve, generate: a request's defaults), "job" (validate, run), "serve"
(serve), or none (YAML and --set only); a command may also take a few options by key (cli/job_flags.add_option_flags:
eval-kl's dtype, simulate's trace). Pure data: no torch, no transformers."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, InstanceOf, ValidationError,
                      model_validator)

from offload.errors import ConfigError
from offload.formats import DTYPES, KV_DTYPES, QUANTIZATIONS
from offload.hardware import HardwareProfile, parse_size
from offload.reasoning import HARMONY_PARSER, THINK_PARSERS
from offload.tool_parsers import AUTO_PARSERS

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # OpenAI's schema takes any 64-bit seed; torch's manual_seed takes these
MAX_LOGPROBS = 20  # top logprobs a request may ask for per token (vLLM's max_logprobs; OpenAI chat's top_logprobs)
MAX_N = 64  # samples per prompt at most
DEFAULT_PREFILL_CHUNK_TOKENS = 512  # tokens a layer computes at once in prefill: bounds the working set
BACKENDS = ("auto", "cpu", "cuda", "sim")  # auto: CUDA where a GPU is visible, else the CPU; sim: the simulated GPU
ENGINES = ("local", "ray")
INPUT_FORMATS = ("openai", "text")
# a chat answer's reasoning split off into reasoning_content (offload/reasoning.py): auto by the model family's parser,
# else where the chat template mentions <think>; qwen3 and deepseek_r1 (<think>) and openai_gptoss (gpt-oss's harmony
# channels), vLLM's --reasoning-parser names, whatever the model; none: never
REASONING_PARSERS = ("auto", *THINK_PARSERS, HARMONY_PARSER, "none")
DEFAULT_REASONING_PARSER = "auto"  # offload run's batch jobs and LLM.chat split this way too
# how a chat answer to tool_choice auto is read for tool calls (offload/tool_parsers.py): auto by the model (gpt-oss's
# harmony, else <tool_call> where the template mentions it, else Llama 3's JSON); hermes, llama3_json and openai,
# vLLM's --tool-call-parser names, whatever the model; none: never (the answer stays content)
TOOL_CALL_PARSERS = ("auto", *AUTO_PARSERS, "none")
DEFAULT_TOOL_CALL_PARSER = "auto"  # offload run's batch jobs and LLM.chat read calls this way too


def option(default: Any = ..., help: str = "", *, name: str | None = None, cli: str | None = None,
           unit: str | None = None, flag: str | None = None, **bounds) -> Any:
    """A field with its help, its outside name, which commands take it as a flag, and its unit."""
    extra = {k: v for k, v in (("name", name), ("cli", cli), ("unit", unit), ("flag", flag)) if v is not None}
    if "default_factory" in bounds:
        return Field(description=help, json_schema_extra=extra, **bounds)
    return Field(default, description=help, json_schema_extra=extra, **bounds)


def _no_bool(value: Any) -> Any:
    """A number field refuses true/false (pydantic would read them as 1 and 0)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, found {value!r}")
    return value


def _size(value: Any) -> int | None:
    """Bytes from 22GiB, 64GB, 512MiB or a plain number; None stays None (the tier's default)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 22GiB, found {value!r}")
    if isinstance(value, str) and value.strip().startswith("-") or isinstance(value, (int, float)) and value < 0:
        raise ValueError(f"expected a size of 0 or more such as 22GiB, found {value!r}")
    try:
        return parse_size(value)
    except ConfigError:
        raise ValueError(f"expected a size such as 22GiB, 64GB or 512MiB, found {value!r}") from None


Whole = Annotated[int, BeforeValidator(_no_bool)]
Number = Annotated[float, BeforeValidator(_no_bool)]
Size = Annotated[int | None, BeforeValidator(_size)]
Bytes = Annotated[int, BeforeValidator(_size)]  # a size that must be given (no tier default to fall back on)
Baseline = Annotated[int | Literal["auto"], BeforeValidator(lambda v: v if v == "auto" else _size(v) or 0)]
TokenId = Annotated[Whole, Field(ge=0)]
Text = Annotated[str, Field(min_length=1)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)


class ModelOptions(Section):
    """Which model to load and how its weights are stored."""

    path: str = option("default", "model folder, .gguf file, a Hub id (org/name) in the local Hugging Face cache, "
                       "a name in configs/models, or 'default'", name="model", cli="plan")
    quantization: Literal[QUANTIZATIONS] = option("none", "linear weights: none keeps them as stored",
                                                  name="quantization", cli="plan")
    dtype: Literal[DTYPES] = option("auto", "compute format: auto is bf16 where a GPU is planned, else fp32",
                                    name="dtype", cli="plan")
    max_model_len: Whole | None = option(None, "tokens per sequence the KV cache holds (default 2048, at most the "
                                         "model's context)", name="max_model_len", cli="plan", unit="tokens", ge=2)
    kv_cache_dtype: Literal[KV_DTYPES] = option("auto", "KV cache format (llama.cpp's --cache-type-k, vLLM's "
                                                "--kv-cache-dtype): auto keeps the compute format; bf16 halves an "
                                                "fp32 (CPU) cache's memory and what each decode step reads; the CPU's "
                                                "fused layer reads fp32 and bf16 caches, an fp16 one runs the "
                                                "slower reference math", name="kv_cache_dtype", cli="plan")


class HardwareOptions(Section):
    """The machine the plan is for and the backend that runs it (`hardware: NAME` is short for profile: NAME)."""

    profile: str | InstanceOf[HardwareProfile] | None = option(None, "hardware preset name or profile YAML (default: this machine's calibrated "
                                 "profile, else an estimate)", name="hardware", cli="plan")
    backend: Literal[BACKENDS] = option("auto", "auto: CUDA where a GPU is visible, else the CPU; cpu computes "
                                        "in fp32 even where a GPU is planned; sim runs the plan's GPU units on a "
                                        "simulated GPU (the CPU computes them, as strict as CUDA about where tensors "
                                        "live and counting host syncs)", name="backend", cli="plan")


class MemoryOptions(Section):
    """Budget per tier; unset means the planner's default share of what the machine has. The CPU budget covers
    the whole process (its own baseline included), in LLM(...) as in a job."""

    gpu: Size = option(None, "GPU budget such as 22GiB (default 90% of VRAM)", name="gpu_memory", cli="plan",
                       unit="bytes")
    cpu: Size = option(None, "RAM budget of the whole process such as 48GiB (default 80% of RAM)",
                       name="cpu_memory", cli="plan", unit="bytes")
    disk: Size = option(None, "disk budget for spilled weights such as 200GB (default 0: no spilling)",
                        name="disk_memory", cli="plan", unit="bytes")
    baseline: Baseline = option("auto", "RAM the process holds before any weight (Python, torch, the tokenizer), "
                                "counted in the CPU budget; auto: the figure the last run on this machine "
                                "recorded, else 512MiB", name="host_baseline", unit="bytes")
    on_exceed: Literal["warn", "stop"] = option("warn", "when the memory held while running passes the CPU budget")


class ScheduleOptions(Section):
    """How many sequences run together and how weights are staged; unset lets the planner choose."""

    batch_size: Whole | None = option(None, "sequences in flight (default: the batch with the best predicted "
                                      "throughput)", name="batch_size", cli="plan", ge=1)
    prefetch_depth: Whole | None = option(None, "staging slots and read-ahead buffers (default: searched, 1-4)",
                                          name="prefetch_depth", cli="plan", ge=1)
    prefill_chunk_tokens: Whole = option(DEFAULT_PREFILL_CHUNK_TOKENS, "tokens one layer computes at once in "
                                         "prefill", name="prefill_chunk_tokens", cli="plan", unit="tokens", ge=1)


class SamplingOptions(Section):
    """Defaults for every request (a request's own body overrides them), and a cap no body passes. With
    RequestOptions, these fields (but the cap) are SamplingParams': its names, types and bounds (sampling.py)."""

    max_tokens: Whole = option(16, "tokens generated per request that does not set max_tokens itself (vLLM's "
                               "and OpenAI completions' default is 16); the plan is sized for it",
                               name="max_tokens", cli="plan", unit="tokens", ge=1)
    max_tokens_cap: Whole | None = option(None, "at most this many tokens per request, whatever its body asks "
                                          "(default: up to the context)", name="max_tokens_cap", cli="job",
                                          unit="tokens", ge=1)
    temperature: Number = option(0.0, "0 is greedy", name="temperature", cli="sampling", ge=0)
    top_p: Number = option(1.0, "sample from the most likely tokens whose probabilities add up to top_p (1: all)",
                           name="top_p", cli="sampling", gt=0, le=1)
    top_k: Whole = option(0, "sample from the top_k most likely tokens (0 or -1: all)", name="top_k",
                          cli="sampling", ge=-1)
    min_p: Number = option(0.0, "drop tokens less likely than min_p times the most likely one (0: none)",
                           name="min_p", cli="sampling", ge=0, le=1)
    seed: Whole | None = option(None, "per-request seed base (any 64-bit value)", name="seed", cli="sampling",
                                ge=SEED_MIN, le=SEED_MAX)
    stop: list[Text] = option(help="a string that ends a completion (repeatable)", name="stop", cli="sampling",
                              default_factory=list)
    ignore_eos: bool = option(False, "keep generating past the end-of-sequence token")
    presence_penalty: Number = option(0.0, "subtracted once from each token already generated (OpenAI's)",
                                      ge=-2, le=2)
    frequency_penalty: Number = option(0.0, "subtracted per time a token was generated (OpenAI's)", ge=-2, le=2)
    repetition_penalty: Number = option(1.0, "a prompt or output token's logit divided by it where positive, "
                                        "multiplied where negative (vLLM's; 1 changes nothing)", gt=0)
    logit_bias: dict[TokenId, Annotated[Number, Field(ge=-100, le=100)]] = option(
        help="token id: bias in [-100, 100] added to its logit (OpenAI's)", default_factory=dict)


class RequestOptions(Section):
    """What one request sets besides the sampling section's fields, as a request body or LLM.generate's
    SamplingParams gives it (vLLM's names); a job does not default these."""

    stop_token_ids: list[TokenId] = option(help="token ids that end a completion", default_factory=list)
    skip_special_tokens: bool = option(True, "leave special tokens out of the text")
    include_stop_str_in_output: bool = option(False, "keep the stop string that ended a completion in its text")
    n: Whole = option(1, "samples of the prompt; they share its prefill (the KV of the prompt is copied)", ge=1,
                      le=MAX_N)
    logprobs: Whole | None = option(None, "the sampled token's logprob and this many top ones, per output token "
                                    "(vLLM's)", ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: Whole | None = option(None, "the same for each prompt token after the first (OpenAI's echo)",
                                           ge=0, le=MAX_LOGPROBS)
    structured_outputs: Any | None = option(None, "what the output must match (vLLM's): a StructuredOutputsParams or "
                                            "a dict with one of json (a schema), regex, choice, grammar (GBNF), "
                                            "json_object (offload/structured.py; a body's response_format says the "
                                            "same)")


class InputOptions(Section):
    """The requests: OpenAI Batch JSONL, or a text file with one prompt per line."""

    path: str = option(..., "batch JSONL or prompts file", name="input", cli="job")
    format: Literal[INPUT_FORMATS] = option("openai", "openai (Batch API JSONL) or text (one prompt per line)",
                                            name="input_format", cli="job")
    chat: bool = option(True, "text prompts go through the model's chat template")


class OutputOptions(Section):
    """Where results go; an existing file is resumed unless overwrite is set."""

    path: str | None = option(None, "output JSONL (default: <input stem>.outputs.jsonl beside the input)",
                              name="output", cli="job")
    overwrite: bool = option(False, "start over; earlier outputs are kept as numbered backups")
    retry_failed: bool = option(True, "a rerun retries the requests whose output is an error line")


class ReportOptions(Section):
    """The end-of-run report and its optional trace and plot."""

    path: str | None = option(None, "report JSON (default: <output stem>.report.json)", name="report", cli="job")
    trace: str | None = option(None, "write a Chrome/Perfetto trace JSON here", name="trace", cli="job")
    plot: str | None = option(None, "write a timeline PNG here", name="plot", cli="job")
    progress: bool = option(True, "a progress bar (also off when not a terminal)", name="progress", cli="job",
                            flag="--no-progress")
    print: bool = option(True, "print the report at the end")
    echo: bool = option(False, "print each answer as it finishes", name="echo", cli="job", flag="--echo")


def _ray_address(value: Any) -> Any:
    import re

    host_port = re.compile(r"[A-Za-z0-9_.\-\[\]:]+:[0-9]{1,5}")  # the head's GCS (Ray Client's ray:// is not used)
    if isinstance(value, str) and value not in ("auto", "local") and not host_port.fullmatch(value):
        raise ValueError(f"expected 'auto' (a running cluster), 'local' (one started for this job) or HOST:PORT "
                         f"such as 10.0.0.5:6379, found {value!r}")
    return value


class DistributedOptions(Section):
    """engine: ray: the Ray cluster, the replicas (one LLM each, planned on its node) and what each reserves."""

    address: Annotated[str, AfterValidator(_ray_address)] = option("auto", "auto: the cluster this machine is in")
    replicas: Whole | None = option(None, "default: as many as the cluster's CPUs (and GPUs) hold", ge=1)
    cpus_per_replica: Number = option(1.0, "CPUs Ray reserves for each replica", gt=0)
    gpus_per_replica: Number = option(0.0, "GPUs Ray reserves for each replica (0: none)", ge=0)
    shard_size: Whole | None = option(None, "requests handed to a replica at once (default: its planned batch)",
                                      ge=1)
    max_restarts: Whole = option(3, "per replica, after its process or node is lost", ge=0)


class ServeOptions(Section):
    """`offload serve`: where it listens, who may call it, how many requests may wait for a slot, where its batches
    live, the largest upload, whether a chat answer's reasoning is split off its content, and how its tool calls
    are read."""

    host: str = option("127.0.0.1", "address to listen on: 127.0.0.1 is this machine only, 0.0.0.0 every "
                       "interface", name="host", cli="serve")
    port: Whole = option(8000, "TCP port to listen on", name="port", cli="serve", ge=1, le=65535)
    api_key: str | None = option(None, "require `Authorization: Bearer KEY` on every route but /health (default: "
                                 "none required; also read from OFFLOAD_API_KEY)", name="api_key", cli="serve",
                                 min_length=1)
    state_dir: str | None = option(None, "the server's state folder, locked against a second server: the Batch "
                                   "API's files and batches live there (default: none, and no Batch API)",
                                   name="state_dir", cli="serve")
    max_waiting: Whole = option(256, "requests that may wait for a KV slot at once; past it a request gets 503 "
                                "with Retry-After", name="max_waiting", cli="serve", ge=1)
    max_upload_bytes: Bytes = option(200_000_000, "largest file POST /v1/files takes, such as 200MB (OpenAI's "
                                    "Batch API limit); past it 413", name="max_upload", cli="serve", unit="bytes",
                                    gt=0)
    reasoning_parser: Literal[REASONING_PARSERS] = option(
        DEFAULT_REASONING_PARSER, "a chat answer's reasoning goes to its message's reasoning_content (a stream's "
        "delta.reasoning_content), out of its content, as vLLM's --reasoning-parser does: auto is openai_gptoss for "
        "gpt-oss, else qwen3 where the model's chat template mentions <think> (Qwen3, QwQ, DeepSeek-R1); qwen3 or "
        "deepseek_r1 (vLLM's names, one parser here): the <think>...</think> block; openai_gptoss: the harmony "
        "channels (analysis is reasoning, final the content); none: the answer stays whole in content",
        name="reasoning_parser", cli="serve")
    tool_call_parser: Literal[TOOL_CALL_PARSERS] = option(
        DEFAULT_TOOL_CALL_PARSER, "how a chat answer to tool_choice auto is read for tool calls (message.tool_calls), "
        "as vLLM's --tool-call-parser: auto is openai for gpt-oss, else hermes where the model's chat template "
        "mentions <tool_call>, else llama3_json; hermes: <tool_call>{...}</tool_call> blocks (Qwen, Hermes); "
        "llama3_json: an answer that is a JSON call (Llama 3.1); openai: gpt-oss's harmony calls to functions.NAME; "
        "none: the answer stays content (required and named tool_choice are still answered as calls)",
        name="tool_call_parser", cli="serve")
    enable_auto_tool_choice: bool = option(
        False, "vLLM's switch, taken so its command lines run unchanged; it changes nothing: tool_choice auto is "
        "always served here (tool_call_parser none leaves its answers as text)", name="enable_auto_tool_choice",
        cli="serve", flag="--enable-auto-tool-choice")


class PrefixCacheOptions(Section):
    """The prefix cache (vLLM's automatic prefix caching): a prompt that begins as an earlier one did takes those
    tokens' K and V from the cache instead of computing them, in `offload run`, the Batch API, the server and LLM."""

    enabled: bool = option(True, "reuse the K and V of prompt prefixes seen before (the server, jobs and LLM); "
                           "--no-enable-prefix-caching turns it off, as vLLM's flag does",
                           name="enable_prefix_caching", cli="plan", flag="--no-enable-prefix-caching")
    host_memory: Size = option(None, "host RAM for blocks the KV pool evicts, such as 2GiB, inside memory.cpu "
                               "(default: half the CPU budget the plan leaves free; 0: none)",
                               name="prefix_cache_host_memory", cli="plan", unit="bytes")


# prompt lookup, a smaller model, the model's own weights in a smaller format with a KV cache of their own, and the
# same copy drafting over the model's own KV cache (SubSpec's substitutes: of a GPU plan's far units only)
SPECULATIVE_METHODS = ("ngram", "draft_model", "self", "substitute")
# the draft's weight format unless speculative.quantization says: the model's own weights made smaller (self), a
# draft model read as stored (draft_model)
DRAFT_QUANTIZATION = {"self": "q4_0", "substitute": "q4_0", "draft_model": "none"}


class SpeculativeOptions(Section):
    """Speculative decoding (vLLM's speculative_config): a drafter proposes tokens and the model checks them all in
    one pass over its weights. Greedy answers stay the same; sampled ones keep the model's distribution."""

    method: Literal[SPECULATIVE_METHODS] | None = option(None, "ngram: prompt lookup, tokens that followed the "
                                                         "same n-gram earlier in the prompt or output (no model); "
                                                         "draft_model: a smaller model with the same tokenizer "
                                                         "(model); self: the model's own weights in a smaller "
                                                         "format (quantization); substitute: that copy drafting "
                                                         "over the model's own KV cache (no cache or prefill of "
                                                         "its own; on a plan with GPU layers, copies of the far "
                                                         "units only, beside the resident ones); none: no "
                                                         "speculation")
    model: str | None = option(None, "draft_model: the draft model (a folder, a GGUF file or a Hub id in the local "
                               "cache), with the model's tokenizer; substitute: a GGUF file of the same model whose "
                               "weights are the copies, read as stored (any type offload reads, such as Q2_K)")
    quantization: Literal[QUANTIZATIONS] | None = option(None, "the draft's weight format (default: self and "
                                                         "substitute: q4_0 or q8_0, whichever the planner predicts "
                                                         "faster at its format's prior acceptance, q4_0 where "
                                                         "nothing is planned; draft_model none)")
    num_speculative_tokens: Whole | None = option(None, "tokens proposed per step (default: chosen from the "
                                                  "acceptance rate measured as the run goes, at most "
                                                  "max_speculative_tokens)", ge=1, le=32)
    max_speculative_tokens: Whole = option(8, "the most tokens the adaptive choice proposes per step", ge=1, le=32)
    max_branches: Whole = option(4, "draft_model, self and substitute: the most second candidates a sequence's "
                                 "proposals carry (a tree: where the draft is unsure of a token, its next likeliest "
                                 "one is checked in the same pass, where its expected gain pays its cost; models "
                                 "with sliding-window ring caches and structured outputs propose chains); 0: chains "
                                 "only", ge=0, le=8)
    prompt_lookup_max: Whole = option(4, "ngram: the longest n-gram looked up", ge=1)
    prompt_lookup_min: Whole = option(1, "ngram: the shortest n-gram looked up", ge=1)

    @property
    def draft_quantization(self) -> str:
        """The draft's weight format: quantization where set, else its method's (DRAFT_QUANTIZATION); a substitute's
        copies from a file of their own: none (as stored)."""
        if self.quantization is None and self.method == "substitute" and self.model:
            return "none"
        return self.quantization or DRAFT_QUANTIZATION[self.method]

    def draft_path(self, model_path):
        """Where the draft's weights come from: model where set (draft_model, substitute's copies), else the
        model's own path (model_path)."""
        return self.model or model_path

    @model_validator(mode="after")
    def _consistent(self):
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.method == "draft_model" and not self.model:
            raise ValueError("method draft_model needs model: the draft model's path (a smaller model with the same "
                             "tokenizer)")
        if self.method == "self" and self.model:
            raise ValueError("method self drafts with the model's own weights; drop model, or use method draft_model "
                             "(or substitute, with model a GGUF file of the same model)")
        return self


PLAN_SECTIONS = {"model": ModelOptions, "hardware": HardwareOptions, "memory": MemoryOptions,
                 "schedule": ScheduleOptions}  # with sampling.max_tokens: what decides a plan


def fields_of(section: type[Section]) -> dict[str, Any]:
    """A section's fields: key -> pydantic FieldInfo."""
    return dict(section.model_fields)


def extra(info) -> dict:
    return info.json_schema_extra or {}


def named_options(sections: dict[str, type[Section]]) -> dict[str, tuple[str, Any]]:
    """Outside name -> (dotted YAML key, FieldInfo), for every field with a name."""
    out = {}
    for section_name, section in sections.items():
        for key, info in fields_of(section).items():
            if "name" in extra(info):
                out[extra(info)["name"]] = (f"{section_name}.{key}", info)
    return out


def default_of(key: str) -> Any:
    """The one default of a dotted option key such as 'sampling.max_tokens'."""
    section_name, field_name = key.split(".")
    info = {**PLAN_SECTIONS, "sampling": SamplingOptions}[section_name].model_fields[field_name]
    return info.get_default(call_default_factory=True)


def request_sections(named: dict[str, Any], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plan's sections from options by their outside names (LLM's keywords), over base's values where given
    (a PlanRequest's), each checked as the job YAML's is: {'model': ModelOptions, 'hardware': HardwareOptions,
    'memory': MemoryOptions, 'schedule': ScheduleOptions, 'max_tokens': int}. None is the option's default; a
    ConfigError names the first keyword that is unknown or wrong, and what it takes."""
    import difflib

    known = named_options(PLAN_SECTIONS) | {"max_tokens": ("sampling.max_tokens",
                                                          SamplingOptions.model_fields["max_tokens"])}
    raw: dict[str, dict] = {name: dict(base[name]) if base else {} for name in PLAN_SECTIONS}
    raw["sampling"] = {"max_tokens": base["max_tokens"]} if base else {}
    for name, value in named.items():
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"the options are {', '.join(sorted(known))}"
            raise ConfigError(f"unknown option {name!r}; {hint}")
        section, key = known[name][0].split(".")
        if value is not None or name == "hardware":
            raw[section][key] = value
        else:
            raw[section].pop(key, None)
    sections = {}
    for section, cls in {**PLAN_SECTIONS, "sampling": SamplingOptions}.items():
        try:
            sections[section] = cls.model_validate(raw[section])
        except ValidationError as e:
            err = e.errors()[0]
            name = next(n for n, (k, _) in known.items() if k == f"{section}.{err['loc'][0]}")
            msg = err["msg"].removeprefix("Value error, ")
            msg = msg[:1].lower() + msg[1:] + ("" if "found" in msg else f", found {err.get('input')!r}")
            raise ConfigError(f"option {name}: {msg}") from None
    return {**{name: sections[name] for name in PLAN_SECTIONS}, "max_tokens": sections["sampling"].max_tokens}
