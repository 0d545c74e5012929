"""Tiled block order (csrc/kernels.h) of q8_0/q4_0 weights: a pure reordering, read correctly by every consumer."""

import pytest
import torch

import offload.kernels as K
from offload.kernels.packed import tile_blocks, untile_blocks
from offload.runtime import device_quant, unit_store

# M % 4 = 0..3, M < 4, odd and even block counts (K/32 = 1, 3, 18, 9)
SHAPES = [(8, 64), (9, 96), (10, 576), (11, 288), (3, 32), (1, 64), (4, 32), (16, 576)]


def weights(m: int, k: int, fmt: str, seed: int = 0) -> K.PackedWeight:
    g = torch.Generator().manual_seed(seed)
    return K.pack(torch.randn(m, k, generator=g), fmt)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("m,k", SHAPES)
def test_tiling_is_a_reversible_reordering(fmt, m, k):
    rows = weights(m, k, fmt).to_rows()
    tiled = rows.to_tiled()
    assert tiled.tiled and not rows.tiled and tiled.nbytes == rows.nbytes
    assert torch.equal(tiled.to_rows().qs, rows.qs) and torch.equal(tiled.to_rows().d.view(torch.int16),
                                                                     rows.d.view(torch.int16))
    assert sorted(tiled.qs.view(torch.uint8).flatten().tolist()) == sorted(rows.qs.view(torch.uint8).flatten().tolist())
    assert torch.equal(tiled.dequantize(), rows.dequantize())
    assert (tiled.to_gguf() == rows.to_gguf()).all()
    if m >= 4 and k // 32 >= 3:  # something actually moved (one pair per row is the same in both orders)
        assert not torch.equal(tiled.qs, rows.qs)


def test_tiled_order_matches_its_definition():
    """Tile t, pair p, row r holds row 4t+r's blocks 2p and 2p+1; then the 4 rows' odd last block."""
    m, k, bb = 8, 96, 16  # q4_0: 16 bytes per block, 3 blocks per row (one pair, one odd block)
    rows = weights(m, k, "q4_0").to_rows()
    tiled = rows.to_tiled()
    q = rows.qs.view(torch.uint8).reshape(m, 3, bb)
    flat = tiled.qs.view(torch.uint8).reshape(-1)
    for t in range(2):
        base = t * 4 * 3 * bb
        for r in range(4):
            pair = flat[base + r * 2 * bb: base + (r + 1) * 2 * bb]
            assert torch.equal(pair, q[4 * t + r, :2].reshape(-1))
            odd = flat[base + 8 * bb + r * bb: base + 8 * bb + (r + 1) * bb]
            assert torch.equal(odd, q[4 * t + r, 2])
        d = tiled.d.view(torch.int16).reshape(-1)[t * 12: (t + 1) * 12]
        want = rows.d.view(torch.int16)[4 * t: 4 * t + 4]
        assert torch.equal(d[:8], want[:, :2].reshape(-1)) and torch.equal(d[8:], want[:, 2])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("m,k", SHAPES)
def test_scalar_reference_gives_the_same_bits_in_both_orders(fmt, m, k):
    w = weights(m, k, fmt)
    x = torch.randn(3, k)
    assert torch.equal(K.linear_ref(x, w.to_tiled()), K.linear_ref(x, w.to_rows()))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("m,k", SHAPES)
def test_device_dequantize_reads_tiled_order(fmt, m, k, monkeypatch):
    w = weights(m, k, fmt).to_tiled()
    want = w.to_rows().dequantize()
    assert torch.equal(device_quant.dequantize(w.qs, w.d, fmt, torch.float32, tiled=True), want)
    x = torch.randn(2, k)
    monkeypatch.setattr(device_quant, "DEQUANT_CHUNK_ELEMENTS", 5 * k)  # row slices: whole tiles, then the tail
    dq = device_quant.DeviceQuantWeight(fmt, (m, k), w.qs, w.d, tiled=True)
    torch.testing.assert_close(dq.apply(x, None), x @ want.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("on_device", [False, True])
def test_unit_store_keeps_the_block_order(on_device):
    w = weights(10, 96, "q4_0").to_tiled()
    layout = unit_store.layout_of(w)
    buf = torch.empty(layout.n_bytes, dtype=torch.uint8)
    unit_store.write_into(layout, w, buf)
    back = unit_store.materialize(layout, buf, on_device=on_device)
    assert back.tiled
    x = torch.randn(1, 96)
    if on_device:  # dequantized with torch ops, as on a GPU
        torch.testing.assert_close(back.apply(x, None), x @ w.dequantize().T, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(K.linear(x, back), K.linear(x, w))


def test_block_order_helpers_roundtrip_on_raw_planes():
    w = weights(13, 160, "q8_0").to_rows()
    qs, d = tile_blocks(w.qs, w.d, "q8_0")
    qs2, d2 = untile_blocks(qs, d, "q8_0")
    assert torch.equal(qs2, w.qs) and torch.equal(d2.view(torch.int16), w.d.view(torch.int16))


def test_half_weights_have_no_tiled_order():
    with pytest.raises(K.KernelError, match="tiled"):
        K.PackedWeight("bf16", (2, 8), torch.zeros(2, 8, dtype=torch.bfloat16), None, tiled=True)


def test_gpu_only_units_are_stored_in_row_order_and_cpu_units_tiled(tmp_path):
    from conftest import make_hf_model, save_hf_model

    from offload.weights.sources import RandomSource
    from offload.runtime.backends.cpu import CPUBackend
    from offload.runtime.executor import PlacedModel
    from offload.planner.placement import Placement, UnitPlacement
    from offload.spec import load_spec

    spec = load_spec(save_hf_model(make_hf_model("llama", num_hidden_layers=3), tmp_path / "m"))
    place = Placement.uniform(spec, "cpu", "cpu")
    place.units["layer.0"] = UnitPlacement("gpu", "gpu", "gpu", "gpu")
    place.units["layer.1"] = UnitPlacement("cpu", "stream", "stream", "gpu")
    place.units["layer.2"] = UnitPlacement("cpu", "stream", "cpu", "cpu")
    model = PlacedModel(spec, RandomSource(spec, torch.float32, "q4_0"), place, CPUBackend())
    tiled = {name: any(e.tiled for e in layout.entries) for name, layout in model.layouts.items()}
    assert tiled["layer.0"] is False and tiled["layer.1"] is False  # dequantized on the device only
    assert tiled["layer.2"] is K.TILED  # computed by the CPU kernels in decode


def test_random_weights_are_untiled_once_for_every_layer(tmp_path, monkeypatch):
    """RandomSource shares one matrix per shape between layers: GPU-only layers store its row order, made on the
    first layer's load and reused (a 70B q4_0 layer took 2-5 s to untile), and it is that matrix's true row order."""
    from conftest import make_hf_model, save_hf_model

    from offload.kernels import packed
    from offload.planner.placement import Placement, UnitPlacement
    from offload.runtime.backends.cpu import CPUBackend
    from offload.runtime.executor import PlacedModel
    from offload.spec import load_spec
    from offload.weights.sources import RandomSource

    if not K.TILED:
        pytest.skip("these kernels take row order: nothing is untiled")
    spec = load_spec(save_hf_model(make_hf_model("llama", num_hidden_layers=3), tmp_path / "m"))
    untiled = []
    monkeypatch.setattr(packed, "untile_blocks", lambda *a: untiled.append(a[2]) or untile_blocks(*a))

    def build(n_gpu_layers: int) -> tuple[PlacedModel, RandomSource]:
        place = Placement.uniform(spec, "cpu", "cpu")
        for i in range(n_gpu_layers):
            place.units[f"layer.{i}"] = UnitPlacement("gpu", "gpu", "gpu", "gpu")
        source = RandomSource(spec, torch.float32, "q4_0")
        return PlacedModel(spec, source, place, CPUBackend()), source

    build(1)
    one_layer = len(untiled)
    untiled.clear()
    model, source = build(3)
    assert one_layer > 0 and len(untiled) == one_layer  # the second and third layers untile nothing
    layer = source.load(spec.units()[1])
    for i in range(3):
        held = model.resident[f"layer.{i}"].o  # stored in row order, as the device kernels take it
        assert not any(e.tiled for e in model.layouts[f"layer.{i}"].entries)
        qs, d = untile_blocks(layer.o.qs, layer.o.d, "q4_0")
        assert torch.equal(held.qs, qs) and torch.equal(held.d.view(torch.int16), d.view(torch.int16))
