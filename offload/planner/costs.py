"""The planner's cost model: seconds per unit and phase on each device and link (pure arithmetic, no torch).

Compute time is a roofline: max(FLOPs / rate, bytes touched / memory bandwidth). Transfers are bytes over
bandwidth. A phase step overlaps copies and disk reads with compute (the executor prefetches), so its time
is the largest of: the compute chain (GPU + CPU + device hops, which run one after another), the PCIe
link, the disk, and host-memory traffic (CPU kernels and DMA both read weights from the same DRAM).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, replace
from itertools import accumulate, repeat
from operator import sub
from typing import NamedTuple

from offload.formats import AS_STORED, F32_KERNEL_ROWS, FLOAT_FORMATS, FUSED_COMPUTE, QUANT_BLOCK_BYTES, is_quantized
from offload.hardware import HardwareProfile
from offload.planner.pipeline import Pipeline, entries
from offload.spec import ModelSpec, UnitSpec

HANDED_OVER = ("experts", "mlp")  # unit kinds that take their layer's [residual | normed h] hand-over
HOP_LATENCY_S = 20e-6  # one hidden-state hand-over between CPU and GPU: copy launch plus synchronisation (where
# offload calibrate has not measured it: half a small tensor's round trip, HardwareProfile.handover_s)
ACT_BYTES_GPU = 2  # activations in bf16/fp16 on the GPU
ACT_BYTES_CPU = 4  # activations in fp32 on the CPU
LOGIT_BYTES = 4
PAGE_BYTES = 4096  # each unit in the disk read-ahead arena starts on a page
DROP_PIECE_BYTES = 8 << 20  # a read the page cache is not to keep is done, and dropped, this much at a time
READ_AHEAD_TRAIL_BYTES = 16 << 20  # the OS's read-ahead runs up to this far past such a read
READ_PAGE_CACHE_BYTES = DROP_PIECE_BYTES + READ_AHEAD_TRAIL_BYTES  # page cache dropped reads hold at any time
# One kernel launch, host side, where offload calibrate has not measured it (HardwareProfile.gpu_launch_s): the public
# figure for a PyTorch eager op.
GPU_LAUNCH_S = 5e-6
# Launches of a MoE layer's routed experts on the GPU (offload.model.moe): the grouped Triton path takes a fixed
# count, the router 6, the sort and tiles 9, its two kernels, the sum over slots and the residual 3; the per-expert
# loop (weights the grouped kernels do not take: GGUF block formats) 12, a host sync, then 8 per picked expert.
MOE_GROUPED_LAUNCHES = 20
MOE_LOOP_LAUNCHES = (12, 8)
# Launches of a dense layer's decode on the GPU: the ops it dispatches, views aside, as the simulated GPU counts them
# on a tiny Llama at batch 2 (tests/test_strict_device.py counts them again): 34 outside attention (2 RMSNorms,
# 4 matmuls, rope, the KV append, SiLU and its gate, 2 residual adds) and the decode attention kernel's 2 (its
# split and combine launches; paged_attention on CUDA). Of those, its MLP's: a norm, 2 matmuls, SiLU, gate, the
# residual add. The host issues them one by one, so a unit takes at least its launches' seconds.
ATTENTION_DECODE_LAUNCHES = 2
DENSE_LAYER_LAUNCHES = 34 + ATTENTION_DECODE_LAUNCHES
MLP_LAUNCHES = 11


@dataclass(frozen=True)
class Phase:
    """One step of a phase: n_tokens queries (over all sequences), each attending ctx_len keys on average."""

    name: str  # prefill | decode
    n_seqs: int
    n_tokens: int
    ctx_len: int
    kv_read_len: int  # positions of cached K/V read per sequence in one step (0 in prefill)
    n_passes: int = 1  # passes over the weights the step takes (a long prefill runs in several)
    n_logits: int | None = None  # rows the lm_head computes (None: one per sequence)
    n_threads: int = 0  # CPU threads the step ran on (0: all cores)

    @property
    def logit_rows(self) -> int:
        return self.n_seqs if self.n_logits is None else self.n_logits

    @property
    def logit_passes(self) -> int:
        """Passes that sample a row: one per pass up to one per sequence (a long prompt's passes before its last
        end no prompt and run no lm_head: planner/schedule.step_units)."""
        return min(self.n_passes, self.n_seqs)


def phases_for(batch_size: int, prompt_len: int, gen_len: int,
               pass_tokens: int | None = None) -> tuple[Phase, Phase]:
    """Prefill of the whole batch (causal: half the prompt on average) in passes of at most pass_tokens padded
    tokens, and one decode step mid-generation."""
    mid = prompt_len + max(gen_len, 1) // 2
    n_passes = 1
    if pass_tokens:  # the generator packs whole prompts into passes; a longer prompt takes several of its own
        per_pass = pass_tokens // prompt_len
        n_passes = -(-batch_size // per_pass) if per_pass else batch_size * -(-prompt_len // pass_tokens)
    prefill = Phase("prefill", batch_size, batch_size * prompt_len, max(prompt_len // 2, 1), 0, n_passes)
    decode = Phase("decode", batch_size, batch_size, mid, mid)
    return prefill, decode


@dataclass(frozen=True)
class UnitCost:
    """Seconds one unit takes in one phase step, for each way of running it."""

    gpu_s: float  # compute on the GPU (weights resident or already streamed)
    cpu_s: float  # compute on the CPU from host memory
    pcie_s: float  # copy of the unit's weights host -> device (inf: never streamed)
    disk_s: float  # read of the unit's weights from disk
    host_mem_s: float  # the unit's weights read once from DRAM by DMA (a copy to the GPU moves all of them)
    kv_move_s: float  # prefill only: moving the prompt's KV across PCIe when decode runs elsewhere
    host_cpu_s: float  # the weights a CPU kernel reads from DRAM: all, but of an experts unit only those routed to
    # A layer computed on the GPU whose KV cache lives in host RAM (FlexGen's and NEO's choice at large batch): in
    # decode its attention runs on the CPU where the cache is, so the GPU block is its matmuls (gpu_matmul_s), the
    # CPU reads the cache and attends (attn_host_s), and q, k, v cross to the host and the output back (kv_hop_s);
    # in prefill the layer attends on the GPU (the cached prefix is copied up) and the new K/V cross PCIe (kv_move_s)
    gpu_matmul_s: float = 0.0
    attn_host_s: float = 0.0
    kv_hop_s: float = 0.0


def _roofline(flops: float, nbytes: float, flops_rate: float, mem_bps: float) -> float:
    if flops_rate <= 0 or mem_bps <= 0:
        return math.inf
    return max(flops / flops_rate, nbytes / mem_bps)


def expert_reads(unit: UnitSpec, fmt: str, compute: str, n_tokens: int) -> tuple[float, float]:
    """(bytes of an experts unit a pass of n_tokens reads, activation rows each expert it runs gets): the router
    and the experts the tokens are routed to (expected), each running once for the tokens routed to it."""
    w_bytes = unit.nbytes(fmt, compute)
    router = sum(t.nbytes(fmt, compute) for t in unit.tensors if t.role == "router")
    touched = unit.touched_fraction(n_tokens)
    experts = touched * unit.moe.n_experts
    return router + (w_bytes - router) * touched, n_tokens * unit.moe.top_k / experts if experts else 1.0


def launch_s(hw: HardwareProfile) -> float:
    """Seconds of one GPU kernel launch: measured by offload calibrate, else GPU_LAUNCH_S."""
    return hw.gpu_launch_s or GPU_LAUNCH_S


def hop_latency_s(hw: HardwareProfile, busy: bool = False) -> float:
    """Seconds one hand-over takes besides its bytes: half the measured round trip of a small tensor (busy: while
    weight copies run on another stream, where measured), else HOP_LATENCY_S."""
    round_trip = (hw.handover_busy_s or hw.handover_s) if busy else hw.handover_s
    return round_trip / 2 if round_trip else HOP_LATENCY_S


def unit_launches(spec: ModelSpec, unit: UnitSpec) -> int:
    """Kernel launches of a layer or split-off MLP unit on the GPU (0 for the other kinds: a few, once a step)."""
    if unit.kind == "mlp":
        return MLP_LAUNCHES
    if unit.kind == "layer":
        return DENSE_LAYER_LAUNCHES - (MLP_LAUNCHES if spec.hands_over(unit.index) else 0)
    return 0


def unit_host_s(spec: ModelSpec, unit: UnitSpec, hw: HardwareProfile) -> float:
    """Host seconds a layer or split-off MLP takes to dispatch on the GPU, which bound its time there: measured per
    decode layer by offload calibrate (scaled by the unit's launches), else its launches at the measured launch
    seconds; 0 for a preset (GPU blocks are then rooflines alone)."""
    if hw.gpu_layer_host_s:
        return hw.gpu_layer_host_s * unit_launches(spec, unit) / DENSE_LAYER_LAUNCHES
    return unit_launches(spec, unit) * hw.gpu_launch_s


def moe_launch_s(unit: UnitSpec, fmt: str, compute: str, n_tokens: int,
                 hw: HardwareProfile | None = None) -> float:
    """Seconds of launches (and the loop's host sync) an experts unit adds to a pass on the GPU: a fixed count
    where the grouped kernels take its weights (float, q8_0, q4_0), else a count per expected picked expert; at
    hw's measured launch and hand-over seconds where it has them."""
    launch, sync = (launch_s(hw), hop_latency_s(hw)) if hw is not None else (GPU_LAUNCH_S, HOP_LATENCY_S)
    held = {t.held_format(fmt, compute) for t in unit.tensors if t.role == "linear"}
    if all(f in FLOAT_FORMATS or f in QUANT_BLOCK_BYTES for f in held):
        return hw.gpu_experts_host_s if hw is not None and hw.gpu_experts_host_s else MOE_GROUPED_LAUNCHES * launch
    base, per_expert = MOE_LOOP_LAUNCHES
    return (base + per_expert * unit.moe.expected_experts(n_tokens)) * launch + sync


def cost_kin(spec: ModelSpec, unit: UnitSpec) -> tuple:
    """What a unit's cost in a phase depends on of the unit itself: its kind, its tensors' shapes and stored
    formats, and a layer's sliding window (units of one kin are priced once)."""
    window = spec.window(unit.index) if unit.kind == "layer" else None
    return unit.kind, window, tuple((t.shape, t.stored) for t in unit.tensors)


def unit_cost(spec: ModelSpec, unit: UnitSpec, fmt: str, hw: HardwareProfile, phase: Phase,
              compute: str = "fp16", kv: str = "") -> UnitCost:
    """Cost of one unit in one phase step with weights stored in fmt, activations in compute and KV in kv ("": in
    compute).

    An experts unit computed where its weights are (the CPU, or the GPU once resident or copied) reads only the
    experts its tokens are routed to; a copy to the GPU or a disk read moves all of them (the routing is not known
    when the copy is issued ahead)."""
    kv_elem_bytes = FLOAT_FORMATS[kv or compute]
    if unit.kind == "lm_head":  # copied and read in the passes that sample only
        phase = replace(phase, n_passes=phase.logit_passes)
    w_bytes = unit.nbytes(fmt, compute)
    link = hw.h2d_pinned_bps if hw.has_gpu else 0.0
    if unit.kind == "embed":  # a row gather: only the looked-up rows are touched
        row_bytes = phase.n_tokens * w_bytes // spec.vocab_size
        disk_s = row_bytes / hw.disk_read_bps if hw.disk_read_bps else math.inf
        return UnitCost(_roofline(0, row_bytes, 1, hw.gpu_mem_bps), _roofline(0, row_bytes, 1, hw.cpu_mem_bps),
                        math.inf, disk_s, row_bytes / hw.host_read_rate, 0.0, row_bytes / hw.host_read_rate)
    # the lm_head runs on each sequence's last position only (prefill samples one token per sequence)
    rows = phase.logit_rows if unit.kind == "lm_head" else phase.n_tokens
    flops = unit.matmul_flops(rows)
    passes = phase.n_passes  # every pass reads the weights again
    read_bytes, matmul_rows = w_bytes, rows  # what computing reads of the weights per pass; rows per matmul
    if unit.moe is not None:
        read_bytes, matmul_rows = expert_reads(unit, fmt, compute, -(-phase.n_tokens // passes))
    attn_flops = kv_bytes = kv_move_bytes = 0
    if unit.kind == "layer":  # over the keys this layer attends to: a sliding layer's window, not the context
        attn_flops = spec.attention_flops(phase.n_tokens, phase.ctx_len, unit.index)
        kv_bytes = spec.kv_read_bytes(phase.n_seqs, phase.kv_read_len, kv_elem_bytes, unit.index)
        if phase.name == "prefill":  # every new key crosses, a ring layer's too (its ring keeps the last ones)
            kv_move_bytes = spec.layer_kv_bytes(phase.n_seqs, phase.n_tokens // phase.n_seqs, kv_elem_bytes)
    gpu_s = _gpu_s(unit, hw, unit.rate_format(fmt, compute), -(-rows // passes), flops, attn_flops, read_bytes,
                   kv_bytes)
    cpu_s = _cpu_s(spec, unit, fmt, hw, phase, compute, flops, attn_flops, matmul_rows, read_bytes, kv_bytes)
    floor = passes * read_bytes / hw.gpu_mem_bps if hw.gpu_mem_bps > 0 else math.inf
    gpu_s = max(gpu_s, floor)
    gpu_s = max(gpu_s, passes * unit_host_s(spec, unit, hw))
    if unit.moe is not None:
        gpu_s += passes * moe_launch_s(unit, fmt, compute, -(-phase.n_tokens // passes), hw)
    host_kv = (0.0, 0.0, 0.0)
    if unit.kind == "layer" and phase.name == "decode":
        host_kv = _host_kv_attention(spec, hw, phase, compute, flops, read_bytes, attn_flops, kv_bytes, floor, link)
    return UnitCost(
        gpu_s=gpu_s,
        cpu_s=cpu_s,
        pcie_s=passes * w_bytes / link if link else math.inf,
        disk_s=passes * w_bytes / hw.disk_read_bps if hw.disk_read_bps else math.inf,
        host_mem_s=passes * w_bytes / hw.host_read_rate,
        kv_move_s=kv_move_bytes / link if link else 0.0,
        host_cpu_s=passes * read_bytes / hw.host_read_rate,
        gpu_matmul_s=host_kv[0], attn_host_s=host_kv[1], kv_hop_s=host_kv[2],
    )


def _gpu_s(unit: UnitSpec, hw: HardwareProfile, fmt: str, pass_rows: int, flops: float, attn_flops: float,
           read_bytes: float, kv_bytes: float) -> float:
    """Seconds of one unit on the GPU: its matmuls at the measured rate by rows of the kernel linear() runs
    (HardwareProfile.gpu_matmul_rate; it includes reading the weights), then attention as a roofline; the whole
    unit as a roofline where the profile has no curve for fmt, and for experts units (their grouped kernels are
    not among the measured ones)."""
    rate = hw.gpu_matmul_rate(fmt, pass_rows) if unit.moe is None else None
    if not rate:
        return _roofline(flops + attn_flops, read_bytes + kv_bytes, hw.gpu_flops, hw.gpu_mem_bps)
    return flops / rate + (_roofline(attn_flops, kv_bytes, hw.gpu_flops, hw.gpu_mem_bps) if attn_flops else 0.0)


def _host_kv_attention(spec: ModelSpec, hw: HardwareProfile, phase: Phase, compute: str, flops: float,
                       read_bytes: float, attn_flops: float, kv_bytes: int, floor: float,
                       link: float) -> tuple[float, float, float]:
    """(GPU matmul seconds, CPU attention seconds, hand-over seconds) of a decode step of a GPU layer whose KV cache
    is in host RAM: the CPU reads the cache (kv_read_bps) and attends at the fused layer's attention rate (its
    kernels take fp32 and bf16 caches; others go through torch)."""
    gpu = max(_roofline(flops, read_bytes, hw.gpu_flops, hw.gpu_mem_bps), floor)
    path = "fused" if compute in FUSED_COMPUTE else "torch"
    cpu = kv_bytes / hw.kv_read_bps + attn_flops / hw.attention_rate(path)
    moved = phase.n_tokens * (2 * spec.q_size + 2 * spec.kv_size) * FLOAT_FORMATS[compute]
    return gpu, cpu, (2 * hop_latency_s(hw) + moved / link) if link else 0.0


def _cpu_s(spec: ModelSpec, unit: UnitSpec, fmt: str, hw: HardwareProfile, phase: Phase, compute: str,
           flops: float, attn_flops: float, rows: float, read_bytes: float, kv_bytes: int) -> float:
    """Seconds of one unit on the CPU: its matmuls at the kernel rate for `rows` activation rows (the calibrated
    rate includes reading the weights from DRAM; the flat one is a roofline against read_bytes) and attention."""
    passes = phase.n_passes
    matmul_s = _cpu_matmul_s(unit, fmt, compute, hw, flops, rows, phase.n_threads)
    fmt = hw.rated_format(unit.rate_format(fmt, compute))  # a GGUF unit: its main format (or that one's kin)
    cpu_compute_s = matmul_s + attn_flops / hw.attention_rate(path_at(cpu_path(fmt, compute), phase.n_tokens))
    if hw.cpu_flops_by_rows.get(fmt):
        kv_read = kv_bytes if unit.kind == "layer" else 0  # in the compute format (a bf16 plan's caches: bf16)
        return cpu_compute_s + (passes - 1) * read_bytes / hw.cpu_mem_bps + kv_read / hw.kv_read_bps
    return max(cpu_compute_s, (passes * read_bytes + kv_bytes) / hw.cpu_mem_bps)


def _cpu_matmul_s(unit: UnitSpec, fmt: str, compute: str, hw: HardwareProfile, flops: float, rows: float,
                  threads: int) -> float:
    """Seconds of a unit's matmuls on the CPU: each format's share of its linear weights (a GGUF layer mixes
    q3_k, q4_k and q5_k) at that format's calibrated rate (or its kin's) and shape factors."""
    shares = unit.linear_shares(fmt, compute)
    numel = {f: sum(math.prod(s) for s in shapes) for f, shapes in shares.items()}
    total = sum(numel.values())
    seconds = 0.0
    for held, shapes in shares.items():
        share = numel[held] / total if total else 1.0
        seconds += flops * share / (hw.cpu_matmul_rate(held, rows, threads) * hw.shape_efficiency(held, shapes))
    return seconds


def step_phase_attention_flops(spec: ModelSpec, shape) -> float:
    """Attention FLOPs of one step's shape (a profile.timeline.StepShape) over all layers, as unit_cost counts
    them."""
    n_tokens = max(shape.n_tokens, 1)
    ctx_len = max(round(shape.attended_keys / n_tokens), 1)
    return sum(spec.attention_flops(n_tokens, ctx_len, i) for i in range(spec.n_layers))


def main_format(spec: ModelSpec, fmt: str) -> str:
    """The weight format that speaks for a plan's fmt: a GGUF model run as stored is its file's main format."""
    return spec.stored_format if fmt == AS_STORED else fmt


def cpu_path(fmt: str, compute: str) -> str:
    """Which CPU code runs a plan's layers: offload's fused C++ layer ("fused": packed quantized weights, or a bf16
    plan's float weights, which its bf16 tiles take; fp32 activations, or bf16 as GPU plans compute, widened once
    per layer), the fused layer for steps of up to F32_KERNEL_ROWS tokens and torch ops past them ("fused_few":
    float weights under fp32 compute), or torch ops. path_at says which a step runs."""
    if compute not in FUSED_COMPUTE:
        return "torch"
    return "fused" if is_quantized(fmt) or compute == "bf16" else "fused_few"


def path_at(path: str, n_tokens: int) -> str:
    """The CPU code ("fused" or "torch") a step of n_tokens tokens runs on a plan's cpu_path."""
    if path == "fused_few":
        return "fused" if n_tokens <= F32_KERNEL_ROWS else "torch"
    return path


def overhead_s(hw: HardwareProfile, n_cpu_layers: int, path: str, n_seqs: int, n_logits: int = 0,
               vocab: int = 0, n_tokens: int = 0) -> float:
    """Seconds a step takes besides matmuls, attention and copies (the calibrated overhead terms)."""
    layer = hw.overhead("layer" if path_at(path, n_tokens) == "fused" else "layer_unfused")
    return (hw.overhead("step") + n_cpu_layers * (layer + n_tokens * hw.overhead("token"))
            + n_seqs * hw.overhead("sequence") + n_logits * vocab * hw.overhead("logit"))


def hop_s(spec: ModelSpec, hw: HardwareProfile, phase: Phase, width: int = 1, busy: bool = False) -> float:
    """One hand-over of the hidden states [n_tokens, width x hidden] between CPU and GPU (width 2: a MoE layer's
    attention part hands its experts [residual | normed hidden]); busy: while weight copies share the link."""
    if not hw.has_gpu:
        return 0.0
    return hop_latency_s(hw, busy) + phase.n_tokens * width * spec.hidden_size * ACT_BYTES_GPU / hw.h2d_pinned_bps


@dataclass(frozen=True)
class PhaseCost:
    """Predicted time of one step of a phase and where it goes; busy seconds per resource."""

    phase: str
    tokens_per_step: int
    gpu_s: float
    cpu_s: float
    pcie_s: float
    disk_s: float
    hop_s: float
    host_mem_s: float
    step_s: float
    bound: str  # which resource sets step_s: compute, pcie, disk or host_memory
    overhead_s: float = 0.0  # calibrated per-step, per-layer and per-sequence time, included in step_s
    copy_under_compute_s: float = 0.0  # of the step's weight copies (pcie_s), the seconds a block computes beside
    copy_under_cpu_s: float = 0.0  # ... and of those, the seconds a CPU block computes beside

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else math.inf

    @property
    def s_per_token(self) -> float:
        return self.step_s / self.tokens_per_step

    @property
    def cpu_share(self) -> float:
        """CPU compute against CPU + GPU compute (the "14% CPU / 86% GPU" split)."""
        busy = self.cpu_s + self.gpu_s
        return self.cpu_s / busy if busy > 0 else 0.0

    @property
    def gpu_share(self) -> float:
        busy = self.cpu_s + self.gpu_s
        return self.gpu_s / busy if busy > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tokens_per_s=self.tokens_per_s, s_per_token=self.s_per_token,
                 cpu_share=self.cpu_share, gpu_share=self.gpu_share)
        return d


def combine(phase: str, tokens_per_step: int, gpu_s: float, cpu_s: float, pcie_s: float, disk_s: float,
            hops_s: float, host_mem_s: float, pipeline_s: float = 0.0, overhead: float = 0.0,
            overlap: tuple[float, float] = (0.0, 0.0), gap_s: float = 0.0) -> PhaseCost:
    """The step takes the longer of the pipeline the executor runs (pipeline_s) and any one resource's busy time,
    plus the overhead terms (the host runs them between the blocks); bound names the resource that is busiest
    (compute: the GPU + CPU chain). gap_s: the host's own work before the step (a draft's steps), in the step's
    time, holding the compute and the host's memory but not the link or the disk."""
    candidates = {"compute": gpu_s + cpu_s + hops_s + gap_s, "pcie": pcie_s, "disk": disk_s,
                  "host_memory": host_mem_s + gap_s}
    bound = max(candidates, key=candidates.get)
    return PhaseCost(phase, tokens_per_step, gpu_s, cpu_s, pcie_s, disk_s, hops_s, host_mem_s,
                     max(candidates[bound], pipeline_s) + overhead, bound, overhead, *overlap)


def price_step(spec: ModelSpec, hw: HardwareProfile, phase: Phase, costs: list[UnitCost], kinds: list[str],
               compute: list[str], decode: list[str], weight: list[str], depth: int, path: str,
               steady: bool, cached: frozenset[int] = frozenset(), host_kv: frozenset[int] = frozenset(),
               overlap: bool = True, gap_s: float = 0.0) -> PhaseCost:
    """One step of phase for a placement: units in order with their costs and kinds, where each computes in
    this phase (compute) and in decode (decode: where its KV lives, but for the GPU layers in host_kv, whose KV
    is in host RAM and whose decode attention the CPU runs), where its weights live (weight); the disk units in
    cached are the page cache's: computed in place by the CPU, or copied from it at its rate. Each unit alike in
    all of that is priced once, and the pipeline walks spans and runs of units, not units (pipeline.Pipeline.run):
    a step of 10,000 layers on the GPU and the CPU is a few entries, or two per streamed unit set between CPU ones.
    gap_s: the host's own work before the step, its first copies and reads running under it (Pipeline.run)."""
    busy = "stream" in compute  # hand-overs then wait behind weight copies on the link
    hops = (hop_s(spec, hw, phase, busy=busy), hop_s(spec, hw, phase, 2, busy))  # experts and a split-off MLP take
    # [residual | normed hidden] from their layer
    flags = ([(i in cached) + 2 * (i in host_kv) for i in range(len(costs))] if cached or host_kv
             else repeat(0, len(costs)))
    alike: dict = {}  # units alike (they share a cost object) in all the step reads, by a small number each
    units = [alike.setdefault(key, len(alike)) for key in zip(map(id, costs), compute, decode, weight, kinds, flags)]
    cost_of = dict(zip(map(id, costs), costs))
    terms = [_unit_terms(hw, phase, cost_of[key[0]], *key[1:], hops) for key in alike]
    counts = Counter(units)
    gpu, cpu, pcie, disk, host = (sum(n * terms[u].busy[j] for u, n in counts.items()) for j in range(5))
    n_cpu_layers = sum(n for u, n in counts.items() if terms[u].cpu_layer)
    chain = entries(units, [t.entry for t in terms], [t.device for t in terms])
    device, hand_overs = None, 0.0
    for mode, _, _, _, _, unit_hop, _ in chain:
        where = "cpu" if mode == "cpu" else "gpu"
        hand_overs += unit_hop if device not in (None, where) else 0.0
        device = where
    logits = phase.logit_rows * spec.vocab_size * LOGIT_BYTES / hw.h2d_pinned_bps if device == "gpu" else 0.0
    pipe = Pipeline(depth, chain[0][0] != "cpu" if chain else False, record=overlap)
    pipeline = pipe.run(chain, phase.n_passes, steady, gap_s) + logits
    extra = overhead_s(hw, n_cpu_layers, path, phase.n_seqs, phase.logit_rows, spec.vocab_size, phase.n_tokens)
    return combine(phase.name, phase.n_tokens, gpu, cpu, pcie + logits, disk, hand_overs, host, pipeline, extra,
                   pipe.overlap() if overlap else (0.0, 0.0), gap_s)


class _Terms(NamedTuple):
    """What one unit adds to a step."""

    entry: tuple  # in the pipeline: (mode, weight tier, seconds of its block, of its copy, of its disk read, of
    # its input's hand-over)
    busy: tuple  # (gpu, cpu, pcie, disk, host memory) seconds
    cpu_layer: bool  # whether it pays a CPU layer's overhead
    device: str | None  # where it computes, if it waits for nothing but the block before it (no copy, no read)


def _unit_terms(hw: HardwareProfile, phase: Phase, c: UnitCost, mode: str, dec: str, tier: str, kind: str, flag: int,
               hops: tuple[float, float]) -> _Terms:
    """What one unit adds to a step, computed once for the units alike; flag: 1 if the page cache holds it, 2 if it
    is a GPU layer with its KV cache in host RAM."""
    gpu = cpu = pcie = disk = host = 0.0
    if flag & 1 and tier == "disk":
        if mode == "cpu" and dec == "cpu":  # computed from the page cache's pages where they are
            tier = "cpu"
        elif c.disk_s < math.inf:  # copied out of the page cache on the way to the GPU
            c = replace(c, disk_s=c.disk_s * hw.disk_read_bps / hw.page_cache_rate)
    kv_on_host = dec == "cpu" or flag >= 2
    kv_move = c.kv_move_s if (mode == "cpu") != kv_on_host else 0.0  # prompt KV made here, kept there
    if kv_on_host and mode != "cpu" and phase.name == "decode" and kind == "layer":
        cpu += c.attn_host_s  # the GPU runs the matmuls; q, k, v go to the CPU, which attends where the KV is
        kv_move = c.attn_host_s + c.kv_hop_s
        c = replace(c, gpu_s=c.gpu_matmul_s)
    if mode == "cpu":
        cpu += c.cpu_s
    else:
        gpu += c.gpu_s
        pcie += c.pcie_s if mode == "stream" else 0.0
    pcie += c.kv_move_s if kv_move and phase.name == "prefill" else 0.0
    if tier != "gpu":
        # a copy (or a disk read into RAM) moves every expert; a CPU kernel reads only those routed to
        host += c.host_cpu_s if mode == "cpu" and tier != "disk" else c.host_mem_s
        disk += c.disk_s if tier == "disk" else 0.0
    block_s = (c.cpu_s if mode == "cpu" else c.gpu_s) + kv_move
    entry = (mode, tier, block_s, c.pcie_s if mode == "stream" else 0.0, c.disk_s if tier == "disk" else 0.0,
             hops[kind in HANDED_OVER])
    # a layer's attention part and its experts (or split-off MLP) are a C++ call each on the CPU: each pays a
    # layer's overhead
    cpu_layer = mode == "cpu" and kind in ("layer", *HANDED_OVER)
    device = ("cpu" if mode == "cpu" else "gpu") if mode != "stream" and tier != "disk" else None
    return _Terms(entry, (gpu, cpu, pcie, disk, host), cpu_layer, device)


def page_rounded(n: int) -> int:
    """n bytes rounded up to a whole page: what a unit takes in the read-ahead arena."""
    return -(-n // PAGE_BYTES) * PAGE_BYTES


def read_ahead_bytes(sizes: list[int], depth: int) -> int:
    """The read-ahead arena for disk units of these sizes, read in this order step after step, depth at a time:
    the largest sum of depth consecutive units (cyclically), each rounded up to a page."""
    k = min(depth, len(sizes))
    if len(set(sizes)) <= 1:  # no units, or units alike (thousands of layers): every window is the same
        return k * page_rounded(sizes[0]) if sizes else 0
    sizes = list(map({n: page_rounded(n) for n in set(sizes)}.__getitem__, sizes))
    sums = [0, *accumulate(sizes + sizes[:k - 1])]  # window j is sums[j + k] - sums[j]
    return max(map(sub, sums[k:], sums[:len(sizes)]))


def workspace_bytes(spec: ModelSpec, workload, act_bytes: int, dequant_scratch: bool) -> int:
    """Activations at the largest shape on one device, plus bf16 scratch to dequantize the largest tensor."""
    b, p = workload.batch_size, workload.prompt_len
    chunk = min(b * p, workload.prefill_chunk_tokens)
    hidden = max(min(b * p, workload.prefill_pass_tokens), b) * spec.hidden_size * act_bytes  # one pass's residual
    working = max(spec.activation_bytes(chunk, p, act_bytes),
                  spec.activation_bytes(b, workload.seq_len, act_bytes, n_seqs=b))
    logits = b * spec.vocab_size * LOGIT_BYTES
    largest = max(t.numel for t in spec.layer_tensors(0) if t.role == "linear")
    if spec.moe is not None:  # a MoE layer's largest tensor may be an expert's (layer_tensors holds attention only)
        largest = max(largest, spec.moe.expert_size * spec.hidden_size)
    scratch = largest * 2 if dequant_scratch else 0
    return hidden + working + logits + scratch
