"""gpt-oss's MXFP4 experts as its Hugging Face checkpoints store them, read as offload holds MXFP4: GGUF's blocks.

A checkpoint stores each stacked expert matrix as <name>_blocks [E, out, G, 16] (two fp4 e2m1 values a byte, the
low nibble first, 32 inputs a block) and <name>_scales [E, out, G] (a power-of-two e8m0 exponent a block, bias
127). GGUF's MXFP4 block is the exponent byte then 16 bytes whose low nibbles are the block's weights 0-15 and
high nibbles 16-31 (ggml's block_mxfp4), with the same exponent. The values are the same bit for bit: only the
nibbles move, as llama.cpp's converter moves them."""

from __future__ import annotations

import torch

BLOCK_BYTES = 17  # formats.GGUF_TYPE["mxfp4"].block_bytes


def gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A checkpoint's blocks [rows, G, 16] and scales [rows, G] (uint8) -> GGUF MXFP4 bytes [rows, G * 17]."""
    rows, groups, _ = blocks.shape
    low, high = blocks & 0x0F, blocks >> 4
    values = torch.stack((low, high), dim=-1).reshape(rows, groups, 32)  # weight 2j low, 2j + 1 high
    packed = values[..., :16] | (values[..., 16:] << 4)  # GGUF: weight j low, j + 16 high
    return torch.cat((scales[..., None], packed), dim=-1).reshape(rows, groups * BLOCK_BYTES).contiguous()


def dequantize(gguf: torch.Tensor) -> torch.Tensor:
    """fp32 [rows, G * 32] of GGUF MXFP4 bytes [rows, G * 17] (GGUF's dequantizer: gguf-py's values)."""
    from offload.formats import GGUF_TYPE

    rows = gguf.shape[0]
    return GGUF_TYPE["mxfp4"].dequantize_torch(gguf.view(rows, -1, BLOCK_BYTES)).reshape(rows, -1)
