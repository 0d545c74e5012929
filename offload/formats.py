"""Every weight and compute format offload knows, by name, with its size: the one place these names live.

Storage formats are what weights occupy (the planner sizes them, the kernels read them); compute formats are
what activations and the KV cache are held in. `quantization` (a user option) names a storage format for the
linear weights, or "none" to keep them in the compute format. Pure data: no torch at import.
"""

from __future__ import annotations

QK = 32  # weights per quantization block, as GGUF's Q8_0 / Q4_0: one fp16 scale per block
FLOAT_FORMATS = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes per weight
QUANT_QS_BYTES = {"q8_0": QK, "q4_0": QK // 2}  # quant bytes per block, the scale excluded
QUANT_BLOCK_BYTES = {f: 2 + n for f, n in QUANT_QS_BYTES.items()}  # bytes per block of QK weights
# Formats read from GGUF files and kept in GGUF's own block bytes, in row order (no split, no tiling):
# (weights per block, bytes per block). Q4_1: fp16 d, fp16 m, 16 nibble bytes. The K-quants use super-blocks
# of 256: Q4_K 4.5 bits per weight, Q5_K 5.5, Q6_K 6.5625 (ggml-common.h block_q4_K, block_q5_K, block_q6_K).
GGUF_BLOCKS = {"q4_1": (32, 20), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}
WEIGHT_FORMATS = tuple(FLOAT_FORMATS) + tuple(QUANT_BLOCK_BYTES) + tuple(GGUF_BLOCKS)  # every storage format sized
PACKED_FORMATS = ("q8_0", "q4_0", "bf16", "fp16") + tuple(GGUF_BLOCKS)  # what the CPU kernels multiply by
FUSED_COMPUTE = ("fp32", "bf16")  # compute formats the fused CPU layer takes (activations and KV caches)
ALIGN_BYTES = 64  # each plane of a unit's flat buffer starts at a multiple of this (SIMD loads, dtype views)
# The weight format of a plan for a GGUF model run as stored: each linear keeps its file's format (ModelSpec
# tensors carry it); the planner sizes every tensor by its own format.
AS_STORED = "gguf"
QUANTIZATIONS = ("none",) + tuple(QUANT_BLOCK_BYTES)  # the user option; none keeps the compute format

# Names a user may give for the compute format, and the config.json torch_dtype names, mapped to ours.
DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16",
                 "float16": "fp16"}
DTYPES = ("auto",) + tuple(DTYPE_ALIASES)  # what LLM(dtype=...) and model.dtype accept
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
