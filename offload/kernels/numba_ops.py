"""numba fallback kernels, used when the C++ extension is not built: same math as csrc/ref.cpp."""

from __future__ import annotations

import numba
import numpy as np

from offload.formats import QK


@numba.njit(cache=True)
def _block_amax(x, i, b):
    """Largest |x| in block b of row i."""
    amax = np.float32(0.0)
    for j in range(QK):
        amax = max(amax, abs(x[i, b * QK + j]))
    return amax


@numba.njit(cache=True, parallel=True)
def quantize_x(x):
    """fp32 [N, K] -> (int8 [N, K], scales fp32 [N, K/32], scale * block sums fp32 [N, K/32])."""
    n, k = x.shape
    nb = k // QK
    qs = np.empty((n, k), dtype=np.int8)
    d = np.empty((n, nb), dtype=np.float32)
    s = np.empty((n, nb), dtype=np.float32)
    for i in numba.prange(n):
        for b in range(nb):
            amax = _block_amax(x, i, b)
            inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            tot = 0
            for j in range(QK):
                q = int(np.rint(x[i, b * QK + j] * inv))  # ties to even, as the C++ kernels
                qs[i, b * QK + j] = q
                tot += q
            d[i, b] = amax / np.float32(127.0)
            s[i, b] = d[i, b] * np.float32(tot)
    return qs, d, s


@numba.njit(cache=True, parallel=True)
def quantize_x16(x):
    """fp32 [N, K] -> (int16 [N, K], scales fp32 [N, K/32]): the activations for q8_0 weights."""
    n, k = x.shape
    nb = k // QK
    qs = np.empty((n, k), dtype=np.int16)
    d = np.empty((n, nb), dtype=np.float32)
    for i in numba.prange(n):
        for b in range(nb):
            amax = _block_amax(x, i, b)
            inv = np.float32(32767.0) / amax if amax != 0 else np.float32(0.0)
            for j in range(QK):
                qs[i, b * QK + j] = int(np.rint(x[i, b * QK + j] * inv))
            d[i, b] = amax / np.float32(32767.0)
    return qs, d


@numba.njit(cache=True, parallel=True)
def gemm_q8_0(wq, wd, xq, xd, y):
    """y [N, M] = dequant(x) @ dequant(w).T for int8 quants wq [M, K] (fp32 scales wd) and int16 xq."""
    m, k = wq.shape
    n = xq.shape[0]
    for r in numba.prange(m):
        for t in range(n):
            acc = np.float32(0.0)
            for b in range(k // QK):
                dot = 0
                for j in range(b * QK, b * QK + QK):
                    dot += np.int32(wq[r, j]) * np.int32(xq[t, j])
                acc += wd[r, b] * xd[t, b] * np.float32(dot)
            y[t, r] = acc


@numba.njit(cache=True, parallel=True)
def gemm_q4_0(wq, wd, xq, xd, y):
    """y [N, M] for q4_0 nibbles wq [M, K/2] (GGUF order within each block) with fp32 scales wd [M, K/32]."""
    m = wq.shape[0]
    k = wq.shape[1] * 2
    n = xq.shape[0]
    for r in numba.prange(m):
        for t in range(n):
            acc = np.float32(0.0)
            for b in range(k // QK):
                dot = 0
                for j in range(QK // 2):
                    v = np.int32(wq[r, b * QK // 2 + j])
                    dot += ((v & 15) - 8) * np.int32(xq[t, b * QK + j])
                    dot += ((v >> 4) - 8) * np.int32(xq[t, b * QK + j + 16])
                acc += wd[r, b] * xd[t, b] * np.float32(dot)
            y[t, r] = acc
