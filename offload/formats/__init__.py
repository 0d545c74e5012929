"""Every weight and compute format offload knows, by name, with its size: the one place these names live.

Storage formats are what weights occupy (the planner sizes them, the kernels read them); compute formats are
what activations and the KV cache are held in. `quantization` (a user option) names a storage format for the
linear weights, or "none" to keep them in the compute format. GGUF_TYPES is the table of the GGUF tensor types
offload reads (ggml's type_traits): each block layout written once, and the loader, the planner's sizes, the CPU
kernels' format codes and the GPU dequantizers all read it. Pure data: no torch at import; each type's
dequantizers live beside the table (offload.formats.dequant_np, offload.formats.dequant_torch), named after it.
"""

from __future__ import annotations

from dataclasses import dataclass

QK = 32  # weights per quantization block, as GGUF's Q8_0 / Q4_0: one fp16 scale per block


@dataclass(frozen=True)
class GGUFType:
    """One GGUF tensor type as offload holds it: its block layout, and what computes with it."""

    name: str  # offload's name (q5_0)
    ggml_name: str  # GGUF's (Q5_0)
    ggml_type: int  # ggml's type id (gguf.GGMLQuantizationType)
    block_weights: int  # weights per block (1 for floats)
    block_bytes: int
    # (field, bytes, kind) in block order, as ggml-common.h's block_<type>: kind "f16" is a half-precision scale,
    # "e8m0" a power-of-two scale byte (MXFP4), "ue4m3" fp8 scale bytes (NVFP4), "bits+f16" IQ1_M's 3-bit sub-block
    # scales, its fp16 d in the top nibbles of their uint16s; "bits" packed quants, signs or sub-block scales
    fields: tuple[tuple[str, int, str], ...]
    # how offload keeps it: "float" (a dense tensor), "split" (offload's quant and scale planes, tiled for its
    # kernels), "blocks" (GGUF's block bytes unchanged, rows in order)
    layout: str
    cpu_kernel: int | None = None  # csrc/kernels.h enum WFmt of its fused CPU kernels; None: dequantize, multiply
    triton: tuple[int, int] | None = None  # (kernel id, scales per block) in kernels/triton_gguf.py; None: torch
    kin: tuple[str, ...] = ()  # formats whose measured CPU rates price it when a profile has none of its own
    calibrated: bool = False  # `offload calibrate` measures its CPU matmul curves

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_weights

    @property
    def f16_offsets(self) -> tuple[int, ...]:
        """Byte offsets of the fp16 fields (d, m, dmin) within a block."""
        out, at = [], 0
        for _, n_bytes, kind in self.fields:
            if kind == "f16":
                out.append(at)
            at += n_bytes
        return tuple(out)

    def dequantize_np(self, blocks):
        """uint8 blocks [n, block_bytes] -> fp32 [n, block_weights], bit for bit gguf-py's (numpy)."""
        from offload.formats import dequant_np

        return getattr(dequant_np, self.name)(blocks)

    def dequantize_torch(self, blocks):
        """uint8 blocks [..., n, block_bytes] -> fp32 [..., n, block_weights] on the blocks' device (torch)."""
        from offload.formats import dequant_torch

        return getattr(dequant_torch, self.name)(blocks)


_F16 = (("d", 2, "f16"),)
_K_SCALES = (("d", 2, "f16"), ("dmin", 2, "f16"), ("scales", 12, "bits"))
# Types without a fused CPU kernel run dequantized to fp32 and multiplied (kernels.linear): priced as fp32
_DEQUANTIZED = ("fp32",)
# Where a profile has no curves of a type's own, those of a kernel of its kind: blocks of 32, super-blocks of 256
_KIN_32, _KIN_256 = ("q4_1", "q4_0"), ("q4_k", "q4_0")
GGUF_TYPES = tuple(GGUFType(**t) for t in (
    dict(name="fp32", ggml_name="F32", ggml_type=0, block_weights=1, block_bytes=4, fields=(), layout="float",
         cpu_kernel=6),
    dict(name="bf16", ggml_name="BF16", ggml_type=30, block_weights=1, block_bytes=2, fields=(), layout="float",
         cpu_kernel=2),
    dict(name="fp16", ggml_name="F16", ggml_type=1, block_weights=1, block_bytes=2, fields=(), layout="float",
         cpu_kernel=3),
    dict(name="q8_0", ggml_name="Q8_0", ggml_type=8, block_weights=32, block_bytes=34,
         fields=_F16 + (("qs", 32, "bits"),), layout="split", cpu_kernel=0),
    dict(name="q4_0", ggml_name="Q4_0", ggml_type=2, block_weights=32, block_bytes=18,
         fields=_F16 + (("qs", 16, "bits"),), layout="split", cpu_kernel=1),
    dict(name="q4_1", ggml_name="Q4_1", ggml_type=3, block_weights=32, block_bytes=20,
         fields=_F16 + (("m", 2, "f16"), ("qs", 16, "bits")), layout="blocks", cpu_kernel=8, triton=(0, 1),
         kin=("q4_0",), calibrated=True),
    dict(name="q5_0", ggml_name="Q5_0", ggml_type=6, block_weights=32, block_bytes=22,
         fields=_F16 + (("qh", 4, "bits"), ("qs", 16, "bits")), layout="blocks", cpu_kernel=12, kin=_KIN_32,
         calibrated=True),
    dict(name="q5_1", ggml_name="Q5_1", ggml_type=7, block_weights=32, block_bytes=24,
         fields=_F16 + (("m", 2, "f16"), ("qh", 4, "bits"), ("qs", 16, "bits")), layout="blocks", cpu_kernel=13,
         kin=_KIN_32, calibrated=True),
    dict(name="q2_k", ggml_name="Q2_K", ggml_type=10, block_weights=256, block_bytes=84,
         fields=(("scales", 16, "bits"), ("qs", 64, "bits"), ("d", 2, "f16"), ("dmin", 2, "f16")), layout="blocks",
         cpu_kernel=15, triton=(4, 16), kin=_KIN_256, calibrated=True),
    dict(name="q3_k", ggml_name="Q3_K", ggml_type=11, block_weights=256, block_bytes=110,
         fields=(("hmask", 32, "bits"), ("qs", 64, "bits"), ("scales", 12, "bits"), ("d", 2, "f16")),
         layout="blocks", cpu_kernel=14, kin=_KIN_256, calibrated=True),
    dict(name="q4_k", ggml_name="Q4_K", ggml_type=12, block_weights=256, block_bytes=144,
         fields=_K_SCALES + (("qs", 128, "bits"),), layout="blocks", cpu_kernel=9, triton=(1, 8), kin=("q4_0",),
         calibrated=True),
    dict(name="q5_k", ggml_name="Q5_K", ggml_type=13, block_weights=256, block_bytes=176,
         fields=_K_SCALES + (("qh", 32, "bits"), ("qs", 128, "bits")), layout="blocks", cpu_kernel=10, triton=(2, 8),
         kin=("q4_k", "q4_0")),
    dict(name="q6_k", ggml_name="Q6_K", ggml_type=14, block_weights=256, block_bytes=210,
         fields=(("ql", 128, "bits"), ("qh", 64, "bits"), ("scales", 16, "bits"), ("d", 2, "f16")), layout="blocks",
         cpu_kernel=11, triton=(3, 16), kin=("q8_0",), calibrated=True),
    dict(name="iq4_nl", ggml_name="IQ4_NL", ggml_type=20, block_weights=32, block_bytes=18,
         fields=_F16 + (("qs", 16, "bits"),), layout="blocks", cpu_kernel=16, kin=_KIN_32, calibrated=True),
    dict(name="iq4_xs", ggml_name="IQ4_XS", ggml_type=23, block_weights=256, block_bytes=136,
         fields=_F16 + (("scales_h", 2, "bits"), ("scales_l", 4, "bits"), ("qs", 128, "bits")), layout="blocks",
         cpu_kernel=17, kin=_KIN_256, calibrated=True),
    dict(name="iq3_xxs", ggml_name="IQ3_XXS", ggml_type=18, block_weights=256, block_bytes=98,
         fields=_F16 + (("qs", 64, "bits"), ("signs_scales", 32, "bits")), layout="blocks", kin=_DEQUANTIZED),
    dict(name="iq3_s", ggml_name="IQ3_S", ggml_type=21, block_weights=256, block_bytes=110,
         fields=_F16 + (("qs", 64, "bits"), ("qh", 8, "bits"), ("signs", 32, "bits"), ("scales", 4, "bits")),
         layout="blocks", kin=_DEQUANTIZED),
    dict(name="iq2_xxs", ggml_name="IQ2_XXS", ggml_type=16, block_weights=256, block_bytes=66,
         fields=_F16 + (("qs", 64, "bits"),), layout="blocks", kin=_DEQUANTIZED),
    dict(name="iq2_xs", ggml_name="IQ2_XS", ggml_type=17, block_weights=256, block_bytes=74,
         fields=_F16 + (("qs", 64, "bits"), ("scales", 8, "bits")), layout="blocks", kin=_DEQUANTIZED),
    dict(name="iq2_s", ggml_name="IQ2_S", ggml_type=22, block_weights=256, block_bytes=82,
         fields=_F16 + (("qs", 32, "bits"), ("signs", 32, "bits"), ("qh", 8, "bits"), ("scales", 8, "bits")),
         layout="blocks", kin=_DEQUANTIZED),
    dict(name="tq2_0", ggml_name="TQ2_0", ggml_type=35, block_weights=256, block_bytes=66,
         fields=(("qs", 64, "bits"), ("d", 2, "f16")), layout="blocks", kin=_DEQUANTIZED),
    dict(name="tq1_0", ggml_name="TQ1_0", ggml_type=34, block_weights=256, block_bytes=54,
         fields=(("qs", 48, "bits"), ("qh", 4, "bits"), ("d", 2, "f16")), layout="blocks", kin=_DEQUANTIZED),
    dict(name="iq1_s", ggml_name="IQ1_S", ggml_type=19, block_weights=256, block_bytes=50,
         fields=_F16 + (("qs", 32, "bits"), ("qh", 16, "bits")), layout="blocks", kin=_DEQUANTIZED),
    dict(name="iq1_m", ggml_name="IQ1_M", ggml_type=29, block_weights=256, block_bytes=56,
         fields=(("qs", 32, "bits"), ("qh", 16, "bits"), ("scales", 8, "bits+f16")), layout="blocks",
         kin=_DEQUANTIZED),
    dict(name="mxfp4", ggml_name="MXFP4", ggml_type=39, block_weights=32, block_bytes=17,
         fields=(("e", 1, "e8m0"), ("qs", 16, "bits")), layout="blocks", cpu_kernel=18, kin=("iq4_nl", "q4_0")),
    dict(name="nvfp4", ggml_name="NVFP4", ggml_type=40, block_weights=64, block_bytes=36,
         fields=(("d", 4, "ue4m3"), ("qs", 32, "bits")), layout="blocks", kin=_DEQUANTIZED),
))
GGUF_TYPE = {t.name: t for t in GGUF_TYPES}  # by offload's name
GGUF_NAMES = {t.ggml_name: t.name for t in GGUF_TYPES}  # GGUF's type name -> offload's

FLOAT_FORMATS = {t.name: t.block_bytes for t in GGUF_TYPES if t.layout == "float"}  # bytes per weight
QUANT_BLOCK_BYTES = {t.name: t.block_bytes for t in GGUF_TYPES if t.layout == "split"}  # bytes per block of QK
QUANT_QS_BYTES = {f: n - 2 for f, n in QUANT_BLOCK_BYTES.items()}  # quant bytes per block, the scale excluded
# Formats read from GGUF files and kept in GGUF's own block bytes, in row order (no split, no tiling):
# (weights per block, bytes per block)
GGUF_BLOCKS = {t.name: (t.block_weights, t.block_bytes) for t in GGUF_TYPES if t.layout == "blocks"}
WEIGHT_FORMATS = tuple(FLOAT_FORMATS) + tuple(QUANT_BLOCK_BYTES) + tuple(GGUF_BLOCKS)  # every storage format sized
CPU_KERNELS = {t.name: t.cpu_kernel for t in GGUF_TYPES if t.cpu_kernel is not None}  # format -> csrc WFmt code
# what a PackedWeight holds (kernels.linear takes): every storage format but fp32 (a plain tensor)
PACKED_FORMATS = tuple(QUANT_BLOCK_BYTES) + tuple(f for f in FLOAT_FORMATS if f != "fp32") + tuple(GGUF_BLOCKS)
FUSED_COMPUTE = ("fp32", "bf16")  # compute formats the fused CPU layer takes (activations and KV caches)
# fp32 weights against fp32 activations go through offload's fp32 kernels (and the fused CPU layer) up to this many
# rows (decode steps, speculative verify passes, small batches), torch's matmul beyond. On a 2-core Zen 4,
# SmolLM2-135M's shapes ran 2.0x torch's at 1 row, 2.7x at 4, 1.5x at 16-128 and 1.2x at 512: torch's fp32
# matrix-vector product read the weights at half the memory's rate, and its cost grew with the rows
# (csrc/fgemm_avx512.cpp, fgemm_avx2.cpp). The planner prices the same choice (planner.costs.path_at).
F32_KERNEL_ROWS = 64
ALIGN_BYTES = 64  # each plane of a unit's flat buffer starts at a multiple of this (SIMD loads, dtype views)
# The weight format of a plan for a GGUF model run as stored: each linear keeps its file's format (ModelSpec
# tensors carry it); the planner sizes every tensor by its own format.
AS_STORED = "gguf"
KEPT_FLOAT = "bf16"  # the float format a GGUF linear keeps as stored (run by offload's bf16 kernels on the CPU)
QUANTIZATIONS = ("none",) + tuple(QUANT_BLOCK_BYTES)  # the user option; none keeps the compute format

# Names a user may give for the compute format, and the config.json torch_dtype names, mapped to ours.
DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16",
                 "float16": "fp16"}
DTYPES = ("auto",) + tuple(DTYPE_ALIASES)  # what LLM(dtype=...) and model.dtype accept
KV_DTYPES = ("auto", "fp32", "bf16", "fp16")  # what LLM(kv_cache_dtype=...) and model.kv_cache_dtype accept
_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def format_nbytes(n_elements: int, fmt: str) -> int:
    """Bytes taken by n_elements weights stored in fmt (quantized formats need a multiple of their block)."""
    if fmt in FLOAT_FORMATS:
        return n_elements * FLOAT_FORMATS[fmt]
    if fmt in QUANT_BLOCK_BYTES:
        return (n_elements // QK) * QUANT_BLOCK_BYTES[fmt]
    if fmt in GGUF_BLOCKS:
        per_block, block_bytes = GGUF_BLOCKS[fmt]
        return (n_elements // per_block) * block_bytes
    from offload.errors import ConfigError

    raise ConfigError(f"unknown weight format {fmt!r}; use one of {', '.join(WEIGHT_FORMATS)}")


def is_quantized(fmt: str) -> bool:
    """Whether fmt is a block-quantized storage format (offload's split q8_0/q4_0 or a GGUF block format)."""
    return fmt in QUANT_BLOCK_BYTES or fmt in GGUF_BLOCKS


def compute_format(dtype: str, has_gpu: bool) -> str:
    """The compute format for a dtype option: 'auto' is bf16 where the hardware has a GPU, fp32 on the CPU."""
    if dtype == "auto":
        return "bf16" if has_gpu else "fp32"
    if dtype not in DTYPE_ALIASES:
        from offload.errors import ConfigError

        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPE_ALIASES[dtype]


def kv_format(kv_cache_dtype: str, compute: str) -> str:
    """The KV cache's format for a kv_cache_dtype option: 'auto' is the compute format."""
    if kv_cache_dtype not in KV_DTYPES:
        from offload.errors import ConfigError

        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of {', '.join(KV_DTYPES)}")
    return compute if kv_cache_dtype == "auto" else kv_cache_dtype


def weight_format(quantization: str, compute: str) -> str:
    """The storage format of the linear weights: the quantization, or the compute format when it is 'none'."""
    if quantization not in QUANTIZATIONS:
        from offload.errors import ConfigError

        raise ConfigError(f"quantization {quantization!r} is not supported; use one of {', '.join(QUANTIZATIONS)}")
    return compute if quantization == "none" else quantization


def torch_dtype(fmt: str):
    """The torch dtype of a float format (fp32, bf16, fp16)."""
    import torch

    return getattr(torch, _TORCH_NAMES[fmt])


def format_of_dtype(dtype) -> str:
    """Our name (fp32, bf16, fp16) of a torch dtype or a config.json torch_dtype string."""
    return DTYPE_ALIASES[str(dtype).removeprefix("torch.")]
