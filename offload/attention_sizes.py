"""How much attention over a KV cache allocates on the GPU path, and the decode kernel's split schedule it follows
(offload.model.attention chooses the path, offload.kernels.triton_attention runs the schedule, the planner sizes
both from here; no torch)."""

from __future__ import annotations

IN_PLACE_MAX_QUERIES = 8  # new tokens per sequence up to which a step's attention reads the KV cache in place
# (offload.model.attention; the Triton kernel holds group x queries rows of head_dim fp32 accumulators per program:
# 8 x 8 x 128 = its 8192 at Llama-70B's shape)

# A sliding layer of a model whose layers differ in window (Gemma 2/3, gpt-oss) keeps each sequence's keys in a
# ring of its window and RING_SLACK more slots, in blocks of RING_BLOCK (offload.spec.ModelSpec.kv_ring): a step
# writes at most RING_SLACK + 1 new keys of a sequence before they are attended to (longer chunks attend in
# slices), so the window of every query stays whole
RING_SLACK = 128
RING_BLOCK = 16

# A pooled cache row is read in blocks of KV_BLOCK keys: a sequence's block table (offload.model.step.Step.tables)
# names the slot of each block's first key, so blocks another request computed (the prefix cache's) sit in its
# table beside its own (vLLM's block_size)
KV_BLOCK = 16


def kv_blocks(n_slots: int) -> int:
    """Blocks of KV_BLOCK slots that hold n_slots slots."""
    return -(-n_slots // KV_BLOCK)


def pool_tokens(n_seqs: int, context_len: int) -> int:
    """Slots of a pooled cache row for n_seqs sequences at the whole context: each writes all but its last token's
    keys, in whole blocks, and one slot more takes the writes of padding (the engine's trash slot)."""
    return n_seqs * KV_BLOCK * kv_blocks(context_len - 1) + 1


def ring_slots(window: int) -> int:
    """Slots of a ring holding a sliding layer's keys of one sequence."""
    return -(-(window + RING_SLACK) // RING_BLOCK) * RING_BLOCK


# The Triton decode attention's split-K schedule (offload.kernels.triton_attention runs it, the planner sizes it):
# about two programs per SM in all, each split walking at least DECODE_SPLIT_MIN_KEYS keys (below, a program's fixed
# cost, its q tile and its partial's store, outweighs its keys'; chosen, not measured: 4 tiles of 64 keys, where
# vLLM's flash-decoding partitions hold 512)
SIZING_SMS = 132  # an H100 SXM's (and H200's) streaming multiprocessors, where the device cannot be asked
DECODE_SPLIT_MIN_KEYS = 256


def decode_splits(n_programs: int, max_keys: int, n_sms: int = SIZING_SMS) -> int:
    """Key splits per (sequence, KV head) of the decode attention kernel."""
    wanted = -(-2 * n_sms // max(n_programs, 1))
    return max(1, min(wanted, -(-max_keys // DECODE_SPLIT_MIN_KEYS)))


def decode_partials_bytes(batch: int, n_queries: int, n_heads: int, n_kv_heads: int, head_dim: int, max_keys: int,
                          n_sms: int = SIZING_SMS) -> int:
    """Bytes of the fp32 partials (max, sum, p.V of each split) one decode attention call allocates beside its
    output."""
    splits = decode_splits(batch * n_kv_heads, max_keys, n_sms)
    return 4 * batch * n_kv_heads * splits * (n_heads // n_kv_heads * n_queries) * (2 + head_dim)


def attention_bytes(n_tokens: int, n_keys: int, n_seqs: int, n_heads: int, n_kv_heads: int, head_dim: int,
                    elem_bytes: int = 2) -> int:
    """Bytes attention allocates for n_tokens queries of n_seqs sequences over n_keys keys each: a few tokens per
    sequence read the cache in place, holding the Triton kernel's fp32 partials (decode_partials_bytes); a prefill
    chunk holds its bool mask, repeated for the query heads of a KV head, its sequences' K and V where they are
    gathered (several sequences), and SDPA's fp32 log-sum-exp per query row."""
    group = n_heads // n_kv_heads
    per_seq = -(-n_tokens // max(n_seqs, 1))
    if per_seq <= IN_PLACE_MAX_QUERIES:
        return decode_partials_bytes(n_seqs, per_seq, n_heads, n_kv_heads, head_dim, n_keys)
    mask = (group + 1) * n_tokens * n_keys
    gathered = 2 * n_seqs * n_keys * n_kv_heads * head_dim * elem_bytes if n_seqs > 1 else 0
    return mask + gathered + n_heads * n_tokens * 4
