"""A tree of proposals verified in one pass (model/step.py's tree_step): positions by depth, keys in the tree's
order, each token seeing its ancestors only. The fused C++ layer (its key maps) and the reference layer (its mask)
agree on every kernel path, and each tree token's row equals, bit for bit on the fused layer, the row the same
token gets in a chain of its own path: the rule that keeps greedy answers the model's own."""

from __future__ import annotations

import pytest
import torch

import offload.kernels.layer as fused
from offload.model.llama import layer_forward
from offload.model.step import LayerKV, ragged_step, tree_key_maps, tree_mask
from offload.rope_spec import RopeSpec
from offload.spec import ModelSpec
from test_fused_layer import ATTENTION_PATHS, _weights

MAX_LEN = 400
TABLE = torch.tensor([[16 * b for b in (3, 0, 7, 1, 4, 2, 6, 5, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                        21, 22, 23, 24)]])  # blocks out of order: keys through the table
PARENTS = (-1, 0, 1, -1, 0, 3)  # a chain of three, a second first token, a second token after the first, and
# a token after the second first one


def _spec(window=None) -> ModelSpec:
    return ModelSpec(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=96, n_layers=1,
                     n_heads=4, n_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope=RopeSpec(),
                     max_position_embeddings=MAX_LEN, sliding_window=window)


def _positions(base: int, parents: tuple[int, ...]) -> list[int]:
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return [base] + [base + d for d in depth]


def test_key_maps_name_the_ancestors_where_they_are_not_at_their_positions():
    maps = tree_key_maps(10, PARENTS)
    assert maps == (None, None, None, None, (14,), (11, 15), (14, 16))
    mask = tree_mask(_positions(10, PARENTS), maps, 17, None)[0, 0]
    assert mask.shape == (7, 17) and mask[:, :11].all()  # the cache and the last token: every token's
    seen = [set(torch.nonzero(row[11:]).flatten().add(11).tolist()) for row in mask]
    assert seen == [set(), {11}, {11, 12}, {11, 12, 13}, {14}, {11, 15}, {14, 16}]
    windowed = tree_mask(_positions(10, PARENTS), maps, 17, 3)[0, 0]  # keys within 3 positions of each token
    assert windowed[6].nonzero().flatten().tolist() == [10, 14, 16]  # positions 10, 11 (key 14), 12 (key 16)
    with pytest.raises(ValueError, match="follow one before them"):
        tree_key_maps(10, (-1, 2, 0))


def _steps(spec, n_cached: int, parents: tuple[int, ...]):
    """(the prompt's step, the tree's step) over TABLE: the prompt's n_cached tokens, then the tree after them."""
    prompt = ragged_step(spec, torch.float32, [(torch.arange(n_cached)[None], TABLE, None, None)], MAX_LEN,
                         "prefill")
    tree = ragged_step(spec, torch.float32, [(torch.tensor([_positions(n_cached, parents)]), TABLE, None,
                                              parents)], MAX_LEN, "decode")
    return prompt, tree


def _cache(spec, w, prompt, n_cached):
    kv = LayerKV(1, spec.n_kv_heads, MAX_LEN, spec.head_dim, torch.float32)
    x = torch.randn(1, n_cached, spec.hidden_size, generator=torch.Generator().manual_seed(3))
    layer_forward(spec, w, x, prompt, kv)
    return kv


def _copy(kv):
    out = LayerKV(1, kv.k.shape[2], MAX_LEN, kv.k.shape[3], kv.k.dtype)
    out.k.copy_(kv.k), out.v.copy_(kv.v)
    return out


@pytest.mark.skipif(not fused.FUSABLE, reason="the fused layer needs the C++ extension")
@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("n_cached,window,fmt", [(19, None, "dense"), (300, None, "q8_0"), (40, 9, "dense")])
def test_the_fused_layer_verifies_a_tree_as_the_reference_does(path, n_cached, window, fmt):
    """Outputs within 1e-5 x max |ref| of the reference layer's (its mask over the tree's keys; q8_0 1e-4, as
    test_fused_layer states), the cache the same; 300 cached keys take the decode path's two key splits."""
    spec = _spec(window)
    w = _weights(spec, fmt, False)
    prompt, tree = _steps(spec, n_cached, PARENTS)
    kv = _cache(spec, w, prompt, n_cached)
    kv_ref = _copy(kv)
    x = torch.randn(1, 1 + len(PARENTS), spec.hidden_size, generator=torch.Generator().manual_seed(4))
    ref = layer_forward(spec, w, x, tree, kv_ref)
    out = fused.fused_layer_forward(spec, w, x, tree, kv, path)
    tol = (1e-4 if fmt == "q8_0" else 1e-5) * ref.abs().max()
    assert (out - ref).abs().max() <= tol
    assert (kv.k - kv_ref.k).abs().max() <= tol and (kv.v - kv_ref.v).abs().max() <= tol


@pytest.mark.skipif(not fused.FUSABLE, reason="the fused layer needs the C++ extension")
@pytest.mark.parametrize("path", [p for p in ATTENTION_PATHS if p != "scalar"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_tree_tokens_row_is_its_own_chains_bit_for_bit(path, kv_dtype):
    """Each token of the tree against the same tokens as a chain of its path (the last token, its ancestors, it),
    on a cache that holds 150 keys: the same sums in the same order, equal to the bit."""
    spec, n_cached = _spec(), 150
    w = _weights(spec, "dense", False)
    prompt, tree = _steps(spec, n_cached, PARENTS)
    kv = _cache(spec, w, prompt, n_cached)
    if kv_dtype is torch.bfloat16:
        kv.k, kv.v = kv.k.bfloat16(), kv.v.bfloat16()
    x = torch.randn(1, 1 + len(PARENTS), spec.hidden_size, generator=torch.Generator().manual_seed(5))
    out = fused.fused_layer_forward(spec, w, x, tree, _copy(kv), path)
    for node in range(len(PARENTS)):
        path_nodes = [node]
        while PARENTS[path_nodes[-1]] >= 0:
            path_nodes.append(PARENTS[path_nodes[-1]])
        rows = [0] + [1 + i for i in reversed(path_nodes)]
        chain = ragged_step(spec, torch.float32, [(torch.arange(n_cached, n_cached + len(rows))[None], TABLE, None,
                                                   None)], MAX_LEN, "decode")
        alone = fused.fused_layer_forward(spec, w, x[:, rows], chain, _copy(kv), path)
        assert torch.equal(alone[0, -1], out[0, 1 + node]), node


def test_a_trees_keys_past_its_positions_are_checked_against_the_cache():
    """The block a tree's last keys lie in (past its positions' blocks) is checked like the rest of its table."""
    from offload.errors import KernelError
    from offload.kernels.step_tokens import token_table

    spec, parents = _spec(), (-1, -1, -1, -1)  # four first tokens: positions 14 and 15, keys up to 18
    table = torch.tensor([[0, 9999]])  # positions 0-15 in block 0; keys 16-31 in a block past the cache
    step = ragged_step(spec, torch.float32, [(torch.tensor([_positions(14, parents)]), table, None, parents)],
                       MAX_LEN, "decode")
    with pytest.raises(KernelError, match="outside the KV cache"):
        token_table(step.groups[0], 1, MAX_LEN + 1, None)


def test_a_tree_step_cut_in_two_runs_as_the_whole():
    """A tree's group cut into two parts (a step run in chunks): each part keeps its tokens' key maps and sees up to
    its last key, and the reference layer over the two parts gives the whole's outputs and cache."""
    spec = _spec()
    w = _weights(spec, "dense", False)
    prompt, tree = _steps(spec, 19, PARENTS)
    kv = _cache(spec, w, prompt, 19)
    kv_parts = _copy(kv)
    x = torch.randn(1, 1 + len(PARENTS), spec.hidden_size, generator=torch.Generator().manual_seed(6))
    whole = layer_forward(spec, w, x, tree, kv)
    group = tree.groups[0]
    first, second = group.slice(0, 4), group.slice(4, 7)
    assert first.key_maps == group.key_maps[:4] and first.n_keys == 23  # the last token, three chain keys
    assert second.key_maps == group.key_maps[4:] and second.n_keys == 26
    parts = [layer_forward(spec, w, x[:, a:b], part, kv_parts) for (a, b), part in (((0, 4), first), ((4, 7), second))]
    assert (torch.cat(parts, dim=1) - whole).abs().max() <= 1e-5 * whole.abs().max()  # other kernels, other sums
    assert torch.equal(kv.k, kv_parts.k) and torch.equal(kv.v, kv_parts.v)
