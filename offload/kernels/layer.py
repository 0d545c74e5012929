"""Fused CPU decoder layer: one C++ call (csrc/layer.cpp) instead of ~25 torch ops per layer and token.

Same math as offload.model.llama.layer_forward (the reference, which tests compare against) for CPU blocks with
packed or dense float linears (FusedLayer.dense: some for steps of few tokens only), of the families runs_math_of
names (all ours). Activations come fp32, or bf16 as a GPU plan computes (widened to fp32 once a call, the output
rounded back, bf16 weights' inputs rounded as unfused linears take them); KV caches are fp32 or bf16 (K and V
rounded as they are stored, widened as attention reads them), so a bf16 plan's caches and hidden states stay in
the format it budgets. Whoever places the weights decides to use it and builds the handles once: a FusedLayer per
layer (its weights' C++ view), a KVView per cache, a StepTable per step; nothing is stored on the model's objects.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from offload import attention_sizes
from offload.errors import KernelError
from offload.formats import CPU_KERNELS, FUSED_COMPUTE, torch_dtype
from offload.kernels import _C, ACTIVE_PATH_ID, PackedWeight
from offload.kernels.dispatch import PATH_IDS
from offload.kernels.step_tokens import ring_token_table, token_table

_F32, _BF16 = torch.float32, torch.bfloat16
ACTIVATIONS = tuple(torch_dtype(f) for f in FUSED_COMPUTE)  # the activation and KV cache formats it takes
FUSABLE = _C is not None and hasattr(_C, "layer_forward")  # the extension has the fused layer
HAS_CACHED_ATTENTION = _C is not None and hasattr(_C, "cached_attention")  # ... and its attention alone
HAS_UNIT_RUN = _C is not None and hasattr(_C, "run_units")  # ... and runs of units, a final norm in them

# the gated MLP's activations the fused layer has (csrc/layer.h GateAct); swiglu_oai: gpt-oss's experts' only
GATE_ACTS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}


def runs_math_of(spec) -> bool:
    """Whether the fused layer computes this model's block math: Llama's (RMSNorm before attention and the MLP,
    SiLU), with q/k norms and biases; rope over whole heads or their first rotary_dim (Phi-4-mini), scaled by any
    rope's attention_factor (YaRN, LongRoPE: it is in the step's cos and sin); Gemma 2/3's norms after attention and
    the MLP, GELU-tanh, score scale and soft-cap, per-layer windows and the sliding layers' rope; OLMo 2's norms only
    after attention and the MLP and q/k norms over all heads; gpt-oss's sinks (one more logit per head in the
    softmax's denominator) and its experts' biases and clamped SwiGLU. A layer whose cache is a ring (spec.kv_ring:
    Gemma's and gpt-oss's sliding layers) reads it through a block table that wraps (ring_table), in steps of at
    most RING_SLACK + 1 new tokens a sequence (ring_fits: a longer chunk would overwrite keys its first queries
    see before they attend; it runs the reference block math, which attends in slices)."""
    moe_act = "silu" if spec.moe is None else spec.moe.activation
    return spec.family.activation in GATE_ACTS and moe_act in GATE_ACTS


def _is_f32_cpu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype is _F32 and t.device.type == "cpu" and t.is_contiguous()


def _is_float_cpu(t) -> bool:
    """fp32 or bf16 contiguous CPU memory (a bf16 plan's norms are made fp32 once, when the handle is built)."""
    return isinstance(t, torch.Tensor) and t.dtype in ACTIVATIONS and t.device.type == "cpu"


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    """t as contiguous fp32 CPU memory: itself where it is already, else a copy (kept by the handle); None: None."""
    return t if t is None or _is_f32_cpu(t) else t.to("cpu", _F32).contiguous()


@dataclass(frozen=True)
class FusedLayer:
    """One layer's weights as the C++ layer reads them (raw pointers); holds the weights so they stay valid."""

    weights: object  # the LayerWeights the pointers point into, and fp32 copies of its bf16 norms and biases
    view: object  # _C.fused_weights(...)
    moe: bool = False  # the attention part of a MoE layer: returns [.., 2D] (residual | normed h)
    local: bool = False  # turns by the sliding layers' own rope (Gemma 3): the step table's cos_local, sin_local
    dense: bool = False  # has dense linears for few tokens only (has_dense): steps of up to F32_KERNEL_ROWS tokens


@dataclass(frozen=True)
class FusedExperts:
    """One MoE layer's routed experts as the C++ code reads them; holds the weights so they stay valid."""

    weights: object  # the ExpertWeights (a split-off MLP: its MLPWeights and a one-expert router), kept alive
    view: object  # _C.fused_experts(...)


@dataclass(frozen=True)
class FusedNorm:
    """A model's final RMSNorm (fp32 weights) as the last unit of a run: the C++ loop norms the last layer's output
    while it is in the caches (the Python path to it after the layers ran cold: 150-230 us a decode step)."""

    weight: torch.Tensor  # [D] fp32, contiguous
    eps: float


@dataclass(frozen=True)
class KVView:
    """A KV cache as the C++ layer reads it: rows, slots per row, and the K and V pointers."""

    kv: object  # the LayerKV, kept alive
    n_rows: int
    n_slots: int
    k_ptr: int
    v_ptr: int
    bf16: bool = False  # K and V held as bf16
    ring: int | None = None  # a ring layer's: its slots per sequence (keys found through ring tables)

    @property
    def key(self) -> tuple:
        """What a step table for this cache depends on."""
        return self.n_rows, self.n_slots, self.ring


@dataclass(frozen=True)
class StepTable:
    """One step's token table and fp32 cos/sin rows for caches of one shape: made once, read by every layer."""

    key: tuple  # KVView.key of the caches it serves
    tokens: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    cos_local: torch.Tensor | None = None  # [N, rotary_dim] of the sliding layers' rope, where it differs (Gemma 3)
    sin_local: torch.Tensor | None = None
    blocks: torch.Tensor | None = None  # int64: the sequences' block tables as flat slots (a pooled cache), see
    # token_table; None: each sequence's keys are one run

    @property
    def blocks_ptr(self) -> int:
        return 0 if self.blocks is None else self.blocks.data_ptr()


HAS_MOE = _C is not None and hasattr(_C, "experts_forward")  # the extension has MoE layers and experts


def weights_fusable(w, moe: bool = False) -> bool:
    """Whether a layer's weights suit the fused layer: packed (or dense fp32) linears, fp32 or bf16 CPU norms and
    biases (moe: the attention part of a MoE layer, whose MLP is its shared expert or none)."""
    mlp = (w.gate_up, w.down) if not moe or w.gate_up is not None else ()
    if (w.post_attn_norm is None) != (w.post_mlp_norm is None):
        return False
    if not FUSABLE or (moe and not HAS_MOE) or not all(_packed(m, dense=True) for m in (w.qkv, w.o, *mlp)):
        return False
    if (w.shared_gate is not None) != (moe and bool(mlp)) or (w.q_norm is None) != (w.k_norm is None):
        return False
    floats = (w.attn_norm, w.mlp_norm, w.qkv_bias, w.o_bias, w.gate_up_bias, w.down_bias, w.q_norm, w.k_norm,
              w.shared_gate, w.post_attn_norm, w.post_mlp_norm, w.sinks)  # None: none (OLMo 2's input norms)
    return all(b is None or _is_float_cpu(b) for b in floats)


def can_fuse(w, x: torch.Tensor, kv) -> bool:
    """Whether fused_layer_forward can run this layer: extension built, fp32 or bf16 CPU activations and cache,
    packed linears of formats with fused kernels (formats.CPU_KERNELS), fp32 or bf16 norms and biases."""
    return x.dtype in ACTIVATIONS and x.is_cpu and kv_view(kv) is not None and weights_fusable(w)


def fuse_layer(spec, w, moe: bool = False, index: int | None = None) -> FusedLayer | None:
    """The C++ view of a layer's weights, or None where they do not suit the fused layer (moe: a MoE layer's
    attention part; index: the layer's number, which a model whose layers differ in window and rope needs)."""
    if not weights_fusable(w, moe) or (spec.variant.layer_windows and index is None):
        return None
    view, floats = _make_fused_weights(spec, w, moe, index)
    return FusedLayer((w, floats), view, moe, _turns_local(spec, index), has_dense(w))


def fuse_experts(moe, w) -> FusedExperts | None:
    """The C++ view of a MoE layer's routed experts (ExpertWeights), or None unless every expert's linears are
    packed and the router and the biases (gpt-oss's) are fp32 or bf16 CPU memory (made fp32 once, here)."""
    biases = [b for b in (w.router_bias, *(w.gate_up_bias or ()), *(w.down_bias or ())) if b is not None]
    if not HAS_MOE or moe.activation not in GATE_ACTS or not all(_is_float_cpu(t) for t in (w.router, *biases)) or \
            not all(_packed(m) for m in w.gate_up + w.down):
        return None
    router, router_bias = _f32(w.router), _f32(w.router_bias)
    gate_up_bias, down_bias = ([None] * moe.n_experts if b is None else [_f32(t) for t in b]
                               for b in (w.gate_up_bias, w.down_bias))
    gate_up = [_linear_tuple(m, gate_up_bias[e], f"expert {e} gate_up") for e, m in enumerate(w.gate_up)]
    down = [_linear_tuple(m, down_bias[e], f"expert {e} down") for e, m in enumerate(w.down)]
    if tuple(router.shape) != (moe.n_experts, gate_up[0][0][5]) or \
            (router_bias is not None and tuple(router_bias.shape) != (moe.n_experts,)):
        raise KernelError(f"fused experts: the router must be [{moe.n_experts}, hidden] and its bias "
                          f"[{moe.n_experts}], got {list(router.shape)} and "
                          f"{None if router_bias is None else list(router_bias.shape)}")
    gate = (GATE_ACTS[moe.activation], moe.swiglu_alpha, moe.swiglu_limit)
    view = _C.fused_experts(moe.top_k, gate_up, down, router.data_ptr(),
                            0 if router_bias is None else router_bias.data_ptr(), int(moe.norm_topk), gate)
    return FusedExperts((w, router, router_bias, gate_up_bias, down_bias), view)


def fuse_mlp(w, activation: str = "silu") -> FusedExperts | None:
    """The C++ view of a split-off dense MLP (MLPWeights) as one expert every token takes (a router of one zero
    row: softmax gives it weight exactly 1), or None where it does not suit it (float weights, biases, Gemma's
    GELU and norm after the MLP). Run it with fused_experts_forward."""
    biased = w.gate_up_bias is not None or w.down_bias is not None or getattr(w, "post_mlp_norm", None) is not None
    if not HAS_MOE or biased or activation != "silu" or not (_packed(w.gate_up) and _packed(w.down)):
        return None
    router = torch.zeros(1, w.gate_up.shape[1])
    view = _C.fused_experts(1, [_linear_tuple(w.gate_up, None, "gate_up")], [_linear_tuple(w.down, None, "down")],
                            router.data_ptr(), 0, 1, (GATE_ACTS["silu"], 0.0, 0.0))
    return FusedExperts((w, router), view)


def fuse_norm(w: torch.Tensor, eps: float) -> FusedNorm | None:
    """The final norm as a run's last unit, for fp32 weights (fp32 activations: run_fused refuses bf16 ones)."""
    ok = HAS_UNIT_RUN and _is_f32_cpu(w) and w.dim() == 1
    return FusedNorm(w, eps) if ok else None


def fused_experts_forward(experts: FusedExperts, x: torch.Tensor, path: str | None = None) -> torch.Tensor:
    """offload.model.moe.experts_forward in one C++ call, the router's choice included: x [..., 2D] fp32 or bf16
    (residual | normed h) -> [..., D] in x's format. path: a kernel path of PATH_IDS (tests compare them), else the
    active one."""
    d = x.shape[-1] // 2
    _check_activations(x, "fused experts")
    x = x.contiguous()
    out = x.new_empty(*x.shape[:-1], d)
    path_id = ACTIVE_PATH_ID if path is None else PATH_IDS[path]
    _C.experts_forward(experts.view, path_id, torch.get_num_threads(), x.numel() // (2 * d), x.data_ptr(), 0, 0,
                       out.data_ptr(), int(x.dtype is _BF16))
    return out


def kv_view(kv) -> KVView | None:
    """The C++ view of a KV cache, or None unless it is fp32 or bf16 contiguous CPU memory (K and V alike)."""
    k, v = kv.k, kv.v
    if not FUSABLE or k.dtype != v.dtype or k.dtype not in ACTIVATIONS or k.device.type != "cpu" or \
            not (k.is_contiguous() and v.is_contiguous()):
        return None
    return KVView(kv, k.shape[0], k.shape[1], k.data_ptr(), v.data_ptr(), k.dtype is _BF16, getattr(kv, "ring", None))


def ring_chunk() -> int:
    """New tokens a sequence a ring layer's fused call takes at most (attention_sizes.RING_SLACK read now: the rings
    were made with it): every key is written before attention, and none that a query of the call still sees may be
    overwritten."""
    return attention_sizes.RING_SLACK + 1


def ring_fits(step) -> bool:
    """Whether a ring layer's fused call can take this step (at most ring_chunk() new tokens a sequence)."""
    groups = step.groups if step.groups is not None else (step,)
    return all(g.positions.shape[1] <= ring_chunk() for g in groups)


def step_table(spec, step, view: KVView) -> StepTable:
    """The token table and cos/sin rows of a step for caches shaped like view (a model whose layers differ in
    window: each layer's handle cuts its keys; whose sliding layers turn by a rope of their own: both tables)."""
    window = None if spec.variant.layer_windows else spec.sliding_window
    tokens, blocks = token_table(step, view.n_rows, view.n_slots, window) if view.ring is None else \
        ring_token_table(step, view.n_rows, view.n_slots, view.ring)
    dh = spec.rotary_dim  # the dimensions rope turns: the whole head, or its first part
    if spec.variant.local_rope is None:
        return StepTable(view.key, tokens, _rows_f32(step.cos, dh), _rows_f32(step.sin, dh), blocks=blocks)
    cos, sin = (t.reshape(-1, 2 * dh).to("cpu", _F32) for t in (step.cos, step.sin))
    return StepTable(view.key, tokens, cos[:, :dh].contiguous(), sin[:, :dh].contiguous(),
                     cos[:, dh:].contiguous(), sin[:, dh:].contiguous(), blocks)


def fused_layer_forward(spec, w, x: torch.Tensor, step, kv, path: str | None = None,
                        index: int | None = None) -> torch.Tensor:
    """layer_forward(spec, w, x, step, kv, index=index) in one C++ call, handles made on the spot: x [B, S, D] fp32
    or bf16. path: a kernel path of PATH_IDS (tests compare them), else the active one."""
    layer, view = fuse_layer(spec, w, index=index), kv_view(kv)
    if layer is None or view is None:
        raise KernelError("fused layer: these weights or this cache do not suit the fused layer (check can_fuse)")
    return fused_layers_forward([layer], x, step_table(spec, step, view), [view], path=path)


def fused_layers_forward(layers: list, x: torch.Tensor, table: StepTable | list, views: list,
                         ends: list[float] | None = None, path: str | None = None) -> torch.Tensor:
    """Consecutive fused units with their caches: x [B, S, D] fp32 or bf16 -> [B, S, D] in x's format (each unit
    widens its input to fp32 and rounds its output back); appends K, V to each cache (fp32 or bf16). table: the
    step's table for every layer's cache, or one per unit (None for experts) where the caches differ (a model whose
    sliding layers keep rings).

    layers: FusedLayer (dense layers, or a MoE layer's attention part, which hands over [B, S, 2D]) and
    FusedExperts (its routed experts, or a split-off MLP, taking that hand-over), with views[j] the KV cache of a
    layer and None for experts. Appends each unit's end time (time.perf_counter) to ends if given, for the
    timeline. A caller that runs the same units every step builds their FusedRun once (fused_run) and calls
    run_fused.
    """
    return run_fused(fused_run(layers, views), x, table, ends, path)


@dataclass(frozen=True, eq=False)
class FusedRun:
    """Consecutive fused units with their KV caches as one C++ object, called once a step for all of them: the
    units stream megabytes of weights through the CPU caches, so Python run between two of them runs cold and costs
    several times its usual time. keys: the cache shapes its step tables are for, in order."""

    layers: tuple
    views: tuple
    run: object  # _C.UnitRun
    keys: tuple
    kinds: tuple[bool, ...]  # True: experts (or a split-off MLP)
    wide: tuple[bool, ...]  # True: a MoE layer's attention part, handing over [.., 2D]
    local_keys: frozenset  # the tables a layer of the sliding layers' own rope reads
    key_views: tuple  # a cache view of each key (to build its step table from)

    def holds(self, layers: list, views: list) -> bool:
        """Whether this run is of these units and caches."""
        return len(layers) == len(self.layers) and all(a is b for a, b in zip(layers, self.layers)) and \
            all(a is b for a, b in zip(views, self.views))

    def of_caches(self, kvs: list) -> bool:
        """Whether this run's caches are these (None for units without one)."""
        return len(kvs) == len(self.views) and all(kv is (v.kv if v is not None else None)
                                                   for kv, v in zip(kvs, self.views))


def fused_run(layers: list, views: list) -> FusedRun:
    """The FusedRun of layers with their caches' views (None for experts), in model order."""
    if len(layers) != len(views) or not layers:
        raise KernelError(f"fused layers: {len(layers)} layers but {len(views)} KV caches; pass one cache per layer")
    norms = [isinstance(u, FusedNorm) for u in layers]
    kinds = tuple(isinstance(u, (FusedExperts, FusedNorm)) for u in layers)  # True: no KV cache of its own
    wide = tuple(not e and u.moe for u, e in zip(layers, kinds))
    if [False, *wide[:-1]] != [kinds[0] and not norms[0], *(e and not n for e, n in zip(kinds[1:], norms[1:]))] \
            or any(norms[:-1]) or (norms[-1] and (len(layers) == 1 or wide[-2])):
        raise KernelError("fused layers: experts (or a split-off MLP) take the hand-over of the attention part "
                          "just before them, and only they do, and a final norm ends a run of layers; pass the "
                          "units in model order")
    if any((v is None) != e for v, e in zip(views, kinds)):
        raise KernelError("fused layers: a layer has no KV cache, or experts have one; pass None for experts")
    keys = tuple(dict.fromkeys(v.key for v in views if v is not None))
    units = [(u.weight.data_ptr(), u.eps, u.weight.numel()) if n else (u.view,) if e else
             (u.view, keys.index(v.key), int(u.local), int(w), v.k_ptr, v.v_ptr, int(v.bf16))
             for u, v, e, w, n in zip(layers, views, kinds, wide, norms)]
    local = frozenset(keys.index(v.key) for u, v, e in zip(layers, views, kinds) if not e and u.local)
    key_views = tuple(next(v for v in views if v is not None and v.key == k) for k in keys)
    return FusedRun(tuple(layers), tuple(views), _C.unit_run(units), keys, kinds, wide, local, key_views)


def run_fused(run: FusedRun, x: torch.Tensor, table: StepTable | list | dict, ends: list[float] | None = None,
              path: str | None = None) -> torch.Tensor:
    """fused_layers_forward for a run built before (table may also be a dict: each of run.keys' step table)."""
    b, s, width = x.shape
    tables = _run_tables(run, table, b * s, width)
    _check_activations(x, "fused layers")
    if x.dtype is not _F32 and isinstance(run.layers[-1], FusedNorm):
        raise KernelError("fused layers: a run ending in the final norm takes fp32 activations; norm bf16 ones apart")
    x = x.contiguous()
    path_id = ACTIVE_PATH_ID if path is None else PATH_IDS[path]
    narrow = [x.new_empty(b, s, width) for _ in range(2)]  # they alternate: a unit never writes what it reads
    wide = x.new_empty(b, s, 2 * width) if any(run.wide) else narrow[0]  # read by the experts after it (a run
    # begins with a layer, fused_run: x is never a hand-over)
    times = torch.empty(len(run.layers), dtype=torch.float64) if ends is not None else None
    began = time.perf_counter()
    _C.run_units(run.run, path_id, torch.get_num_threads(), b * s, x.data_ptr(), narrow[0].data_ptr(),
                 narrow[1].data_ptr(), wide.data_ptr(), tables, int(x.dtype is _BF16),
                 0 if times is None else times.data_ptr())
    if ends is not None:
        ends += [began + t for t in times.tolist()]
    return wide if run.wide[-1] else narrow[(len(run.layers) - 1) % 2]


def _run_tables(run: FusedRun, table, n_tokens: int, width: int) -> list[int]:
    """The pointers of each of the run's step tables (cos, sin, local cos, local sin, tokens, blocks), checked
    against its caches and the step's tokens."""
    if isinstance(table, dict):  # by cache shape
        tables = [table[k] for k in run.keys]
    elif isinstance(table, list):
        if len(table) != len(run.layers):
            raise KernelError(f"fused layers: {len(table)} step tables for {len(run.layers)} units; pass one each")
        by_key = {}
        for t, v in zip(table, run.views):
            if (v is None) != (t is None) or (v is not None and by_key.setdefault(v.key, t) is not t):
                raise KernelError("fused layers: a layer has no step table, or two caches of one shape have "
                                  "different ones; build each layer's table from its cache's view")
        tables = [by_key[k] for k in run.keys]
    else:
        tables = [table] * len(run.keys)
    ptrs = []
    for i, (t, key) in enumerate(zip(tables, run.keys)):
        if t.key != key:
            raise KernelError(f"fused layers: KV caches of shapes {[list(v.kv.k.shape) for v in run.views if v]} do "
                              f"not match their step tables; build each layer's table from its cache's view")
        if t.tokens.shape[0] != n_tokens:
            raise KernelError(f"fused layer: {n_tokens} tokens of width {width} do not match the step's token table "
                              f"of {t.tokens.shape[0]} tokens; build the table for this step")
        cos, sin, tokens, blocks = _table_ptrs(t, False)
        ptrs += [cos, sin, *(_table_ptrs(t, True)[:2] if i in run.local_keys else (0, 0)), tokens, blocks]
    return ptrs


def cached_attention(spec, qkv: torch.Tensor, table: StepTable, view: KVView, path: str | None = None,
                     index: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The fused layer's attention alone, for layer index whose linears ran elsewhere (None: as a layer of full
    attention): qkv [N, q | k | v] fp32 (rope applied in place), this step's K and V written to the cache; returns
    [N, n_heads * head_dim]. path: a kernel path of PATH_IDS (tests compare them), else the active one. sinks: the
    layer's [n_heads] (gpt-oss), or None."""
    n = qkv.shape[0]
    if table.tokens.shape[0] != n or not _is_f32_cpu(qkv) or qkv.shape[1] != spec.q_size + 2 * spec.kv_size:
        raise KernelError(f"cached attention: qkv {list(qkv.shape)} does not match the step's {table.tokens.shape[0]} "
                          f"tokens of width {spec.q_size + 2 * spec.kv_size} (fp32, contiguous)")
    if sinks is not None and tuple(sinks.shape) != (spec.n_heads,):
        raise KernelError(f"cached attention: sinks must be [{spec.n_heads}], got {list(sinks.shape)}")
    sinks = _f32(sinks)
    att = torch.empty(n, spec.q_size, dtype=_F32)
    path_id = ACTIVE_PATH_ID if path is None else PATH_IDS[path]
    _C.cached_attention(_shape(spec, spec.intermediate_size, index), path_id, torch.get_num_threads(), n,
                        qkv.data_ptr(), att.data_ptr(), *_table_ptrs(table, _turns_local(spec, index)),
                        view.k_ptr, view.v_ptr, int(view.bf16),
                        0 if sinks is None else sinks.data_ptr())
    return att


def _rows_f32(t: torch.Tensor, dh: int) -> torch.Tensor:
    """t [B, 1, S, dh] (dh: the dimensions rope turns) as contiguous fp32 CPU memory of [B * S, dh] (t itself when it
    is already: every op between the layers' C++ calls runs with cold caches)."""
    return t if _is_f32_cpu(t) else t.reshape(-1, dh).to("cpu", _F32).contiguous()


def _check_activations(x: torch.Tensor, what: str) -> None:
    if x.dtype not in ACTIVATIONS or x.device.type != "cpu":
        raise KernelError(f"{what}: activations must be fp32 or bf16 CPU tensors, got {x.dtype} on {x.device}")


def _shape(spec, width: int, index: int | None) -> tuple:
    """The C++ LayerShape of layer index: (n_heads, n_kv_heads, head_dim, width, eps, scale, softcap, window,
    rotary_dim), softcap 0 for none and window 0 where the step table cuts the keys (every layer slides alike, or
    none does, or index is None)."""
    window = spec.window(index) if spec.variant.layer_windows and index is not None else None
    return (spec.n_heads, spec.n_kv_heads, spec.head_dim, width, spec.rms_norm_eps, spec.attn_scale,
            spec.variant.attn_softcap or 0.0, window or 0, spec.rotary_dim)


def _turns_local(spec, index: int | None) -> bool:
    """Whether layer index turns by the sliding layers' own rope (Gemma 3's sliding layers)."""
    return spec.variant.local_rope is not None and index is not None and spec.window(index) is not None


def _table_ptrs(table: StepTable, local: bool) -> tuple[int, int, int, int]:
    """What a layer reads of the step's table: the cos and sin rows it turns by (the model's rope, or the sliding
    layers' own), the token table and the block tables."""
    if local and table.cos_local is None:
        raise KernelError("fused layer: a layer turns by the sliding layers' rope but the step table has none; "
                          "build the table with this model's spec")
    cos, sin = (table.cos_local, table.sin_local) if local else (table.cos, table.sin)
    return cos.data_ptr(), sin.data_ptr(), table.tokens.data_ptr(), table.blocks_ptr


def _make_fused_weights(spec, w, moe: bool = False, index: int | None = None):
    """(the C++ view of a layer's weights, the fp32 copies of its bf16 floats the view points into)."""
    names = ("qkv_bias", "o_bias", "gate_up_bias", "down_bias", "attn_norm", "mlp_norm", "q_norm", "k_norm",
             "shared_gate", "post_attn_norm", "post_mlp_norm", "sinks")
    floats = {n: _f32(getattr(w, n)) for n in names}
    linears = [_linear_tuple(m, floats[f"{name}_bias"], name) if m is not None else [] for m, name in
               ((w.qkv, "qkv"), (w.o, "o"), (w.gate_up, "gate_up"), (w.down, "down"))]
    over_all = spec.family.qk_norm_over == "all"  # OLMo 2: q and k normed whole, all heads together
    sizes = {"attn_norm": spec.hidden_size, "mlp_norm": spec.hidden_size, "post_attn_norm": spec.hidden_size,
             "post_mlp_norm": spec.hidden_size, "q_norm": spec.q_size if over_all else spec.head_dim,
             "k_norm": spec.kv_size if over_all else spec.head_dim, "sinks": spec.n_heads}
    for name, size in sizes.items():
        if floats[name] is not None and tuple(floats[name].shape) != (size,):
            raise KernelError(f"fused layer: {name} must be [{size}], got {list(floats[name].shape)}")
    width = w.gate_up.shape[0] // 2 if w.gate_up is not None else 0  # a MoE layer's shared expert, or none
    ptr = lambda n: 0 if floats[n] is None else floats[n].data_ptr()  # noqa: E731
    extras = (ptr("q_norm"), ptr("k_norm"), ptr("shared_gate"), int(moe), ptr("post_attn_norm"),
              ptr("post_mlp_norm"), GATE_ACTS[spec.family.activation], int(over_all), ptr("sinks"))
    view = _C.fused_weights(_shape(spec, width, index), ptr("attn_norm"), ptr("mlp_norm"), linears, extras)
    return view, floats


def _packed(m, dense: bool = False) -> bool:
    """A PackedWeight of a format with fused CPU kernels, or a stack of them (a StackedWeight's parts run one after
    another in the fused layer); dense: a dense float CPU weight too (offload's float kernels read it in place)."""
    parts = getattr(m, "parts", (m,))
    return all(isinstance(p, PackedWeight) and p.fmt_id >= 0 or dense and _dense(p) for p in parts)


_DENSE_FORMATS = {_F32: "fp32", _BF16: "bf16", torch.float16: "fp16"}  # a dense weight's dtype -> its kernels' format


def _dense(m) -> bool:
    """A dense fp32, bf16 or fp16 CPU weight, 2-D and contiguous."""
    return isinstance(m, torch.Tensor) and m.dtype in _DENSE_FORMATS and m.is_cpu and m.is_contiguous() and m.dim() == 2


def has_dense(w) -> bool:
    """Whether a layer's linears include dense weights the fused layer runs at few tokens only: fp32 and fp16 (the
    fp32 kernels), bf16 rows the AVX-512 BF16 tiles do not take (K not a multiple of 32). Its fused view then runs
    steps of up to formats.F32_KERNEL_ROWS tokens (torch's matmul is the faster past them). bf16 rows the tiles take
    run them at any rows, or the fp32-widening kernel on a CPU without native bf16, as ops.linear chooses too."""
    return any(_dense(p) and (p.dtype is not _BF16 or p.shape[1] % 32 != 0)
               for m in (w.qkv, w.o, w.gate_up, w.down) if m is not None for p in getattr(m, "parts", (m,)))


def _linear_tuple(m, bias: torch.Tensor | None, name: str) -> list[tuple]:
    """The parts of one linear as the C++ layer takes them: [(fmt, qs, d, bias, M, K)], one per row block."""
    rows, cols = m.shape
    if bias is not None and tuple(bias.shape) != (rows,):
        raise KernelError(f"fused layer: {name} bias must be [{rows}], got {list(bias.shape)}")
    parts = getattr(m, "parts", (m,))
    out, row = [], 0
    for p in parts:
        part_bias = 0 if bias is None else bias[row: row + p.shape[0]].data_ptr()
        if isinstance(p, torch.Tensor):  # a dense float weight, read in place
            out.append((CPU_KERNELS[_DENSE_FORMATS[p.dtype]], p.data_ptr(), 0, part_bias, p.shape[0], p.shape[1]))
        else:
            out.append((p.fmt_id, p.qs_ptr, p.d_ptr, part_bias, p.shape[0], p.shape[1]))
        row += p.shape[0]
    return out
