"""Attention of a GPU layer whose KV cache is in host RAM (FlexGen's placement for a batch whose cache VRAM cannot
hold), for any step: decode, a speculative verify group, a mixed step of prompt chunks and decode tokens.

A group of a few new tokens per sequence (decode, verify) attends on the host in the fused layer's C++ attention:
its q, k, v come down, the output goes up. A prompt chunk attends on the GPU: its new K and V (rope applied there)
come down into the cache, its sequence's keys go up. Every crossing goes through the backend's page-locked paths
(download: one wait; upload: none), so such a layer costs the host one wait per kind of group, not one per tensor
and per chunk as the reference block math's moves would.
"""

from __future__ import annotations

import torch

from offload.kernels import layer as fused
from offload.model.attention import cached_keys, sdpa_over_keys
from offload.model.llama import roped_heads
from offload.model.step import LayerKV, Step
from offload.attention_sizes import IN_PLACE_MAX_QUERIES
from offload.spec import ModelSpec


def decode_like(step: Step) -> bool:
    """Whether a plain step's sequences have a few new tokens each (host tensors only)."""
    return step.positions.shape[1] <= IN_PLACE_MAX_QUERIES


class HostKVAttention:
    """The attention callable of layer_forward (qkv [N, q | k | v] on the device -> [N, n_heads * head_dim]) for
    a device step over a host cache; table(step, view) makes (and caches) the fused layer's table of a host step."""

    def __init__(self, spec: ModelSpec, backend, step: Step, kv: LayerKV, view, table):
        self.spec, self.backend, self.step, self.kv, self.view, self.table = spec, backend, step, kv, view, table

    def __call__(self, qkv: torch.Tensor) -> torch.Tensor:
        step, host = self.step, self.step._host
        if step.groups is None:
            groups = [(step, host, 0)]
        else:
            groups = list(zip(step.groups, host.groups, step.offsets))
        near = [(g, h, t0) for g, h, t0 in groups if decode_like(h)]
        if len(near) == len(groups):  # every group on the host: the whole step's table, one call
            return self._on_host(qkv, host)
        out = torch.empty(qkv.shape[0], self.spec.q_size, dtype=qkv.dtype, device=qkv.device)
        for g, h, t0 in groups:
            n = h.n_tokens
            rows = qkv[t0:t0 + n]
            out[t0:t0 + n] = self._on_host(rows, h) if decode_like(h) else self._on_device(rows, g, h)
        return out

    def _on_host(self, qkv: torch.Tensor, host: Step) -> torch.Tensor:
        """The fused layer's attention on the host over the cache: q, k, v down in one wait, the output up."""
        down = self.backend.download(qkv).to(torch.float32).contiguous()
        att = fused.cached_attention(self.spec, down, self.table(host, self.view), self.view)
        return self.backend.upload(att).to(qkv.dtype)

    def _on_device(self, qkv: torch.Tensor, step: Step, host: Step) -> torch.Tensor:
        """A prompt chunk of one plain step: K, V roped on the device come down into the cache (one wait), its
        sequences' keys go up, attention runs on the device."""
        b, s = host.positions.shape
        q, k, v = roped_heads(self.spec, qkv.view(b, s, -1), step)
        new = self.backend.download(torch.stack((k, v)))  # [2, b, Hkv, s, Dh]
        self.kv.write(host, new[0], new[1])
        keys, values = (self.backend.upload(t.contiguous()) for t in cached_keys(host, self.kv))
        o = sdpa_over_keys(q, keys, values, step, self.spec.sliding_window, self.spec)  # [b, H, s, Dh]
        return o.transpose(1, 2).reshape(b * s, self.spec.q_size)
