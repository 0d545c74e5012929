"""Load time to first token: a bf16 checkpoint quantized at load, against the same load from the packed cache.

Builds a random Llama checkpoint on disk (bf16 safetensors, sharded as Hugging Face shards, with config.json)
of Llama-3.1-8B's widths (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab 128256), 32 layers if
the disk and RAM allow, else fewer (said). Then, each in a fresh process, times LLM(path, quantization) plus a
1-token generate: without the cache (OFFLOAD_PACKED_CACHE=0), the first load with it (read bf16, quantize,
write the cache) and the second (read the cache); and prints second / first (issue 14 asks >= 5x faster) and
each load's peak RSS. Then it writes the same weights as a Q4_0 GGUF file (the blocks offload's q4_0 makes,
which are gguf-py's bit for bit; llama.cpp's q/k row order; a byte-level vocabulary of the model's size) and times
LLM(file) from it, first and second launch (the first builds the GGUF tokenizer and table caches). All loads read
files the page cache may hold (they were just written): warm loads unless --cold. Random matrices are made once
per shape and written for every layer (reading and quantizing cost the same).

  python scripts/bench_load.py --layers 8            # --gguf FILE also times LLM(FILE) of another GGUF file
  python scripts/bench_load.py --smoke               # 2 tiny layers (hidden 64), the cached loads and one GGUF launch
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, INTERMEDIATE, N_HEADS, N_KV_HEADS, VOCAB, FULL_LAYERS = 4096, 14336, 32, 8, 128256, 32
SHARD_BYTES = 5 * 2**30  # Hugging Face's default max_shard_size
MARGIN_BYTES = 4 * 2**30  # RAM and disk left over for everything else


def layer_params() -> int:
    head_dim = HIDDEN // N_HEADS
    attn = HIDDEN * (HIDDEN + 2 * N_KV_HEADS * head_dim) + HIDDEN * HIDDEN
    return attn + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN


def layers_that_fit(want: int, folder: Path) -> int:
    """Most layers (<= want) whose bf16 checkpoint + q4_0 cache fit the disk, and whose load fits in RAM."""
    free_disk = shutil.disk_usage(folder if folder.exists() else folder.parent).free
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for n in range(want, 0, -1):
        params = n * layer_params() + 2 * VOCAB * HIDDEN
        disk = params * 2 + params * 18 // 32  # bf16 + q4_0 (18 bytes per 32 weights)
        load_ram = params * 18 // 32 + VOCAB * HIDDEN * 4 + SHARD_BYTES  # packed + fp32 embedding + a shard
        if disk + MARGIN_BYTES <= free_disk and load_ram + MARGIN_BYTES <= ram:
            return n
    raise SystemExit(f"not even one layer fits: {free_disk / 2**30:.1f} GiB free disk, {ram / 2**30:.1f} GiB RAM")


def build_checkpoint(folder: Path, n_layers: int) -> None:
    """Random bf16 weights as HF shards + model.safetensors.index.json + config.json."""
    import torch

    from offload.weights.cache import write_safetensors

    gen = torch.Generator().manual_seed(0)
    made: dict[tuple[int, ...], torch.Tensor] = {}

    def rand(*shape: int) -> torch.Tensor:
        if shape not in made:
            made[shape] = (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)
        return made[shape]

    head_dim, kv = HIDDEN // N_HEADS, N_KV_HEADS * HIDDEN // N_HEADS
    names = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
             "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                  p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": (kv, HIDDEN),
                  p + "self_attn.v_proj.weight": (kv, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                  p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN), p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                  p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE)}
    shards, shard, shard_bytes = [], {}, 0
    for name, shape in names.items():
        t = torch.ones(shape, dtype=torch.bfloat16) if name.endswith("norm.weight") else rand(*shape)
        if shard and shard_bytes + t.nbytes > SHARD_BYTES:
            shards.append(shard)
            shard, shard_bytes = {}, 0
        shard[name], shard_bytes = t, shard_bytes + t.nbytes
    shards.append(shard)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for k, tensors in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / file, tensors)
        weight_map |= {name: file for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTERMEDIATE, "num_attention_heads": N_HEADS, "num_key_value_heads": N_KV_HEADS,
              "head_dim": head_dim, "num_hidden_layers": n_layers, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def drop_page_cache() -> None:
    """Write back and drop the page cache (root only), so that the next load reads the disk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def timed_load(model: str, quantization: str, env: dict, cold: bool = False) -> dict:
    """Seconds from LLM(...) to one generated token, and peak RSS, in a fresh process."""
    if cold:
        drop_page_cache()
    code = ("import json, resource, sys, time\n"
            "from offload import LLM, SamplingParams\n"
            "t0 = time.perf_counter()\n"
            "llm = LLM(sys.argv[1], quantization=sys.argv[2])\n"
            "llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))\n"
            "print(json.dumps({'s': time.perf_counter() - t0,\n"
            "                  'peak_rss_bytes': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))\n")
    out = subprocess.run([sys.executable, "-c", code, model, quantization], env={**os.environ, **env},
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the load of {model} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=FULL_LAYERS, help="decoder layers (default 32, fewer if "
                        "the disk or RAM is short)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/offload-bench-load"), help="checkpoint and cache")
    parser.add_argument("--quantization", default="q4_0", choices=["q4_0", "q8_0"])
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and cache afterwards")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each load (needs root)")
    parser.add_argument("--skip-uncached", action="store_true", help="skip the load without the cache")
    parser.add_argument("--gguf", type=Path, help="also time LLM(FILE) of a GGUF file (needs offload.weights.gguf)")
    parser.add_argument("--smoke", action="store_true", help="2 layers of hidden 64 in a temp folder, without the "
                        "uncached load and the second GGUF launch: seconds (the figures mean nothing)")
    args = parser.parse_args()
    launches = ("first", "second")
    if args.smoke:
        global HIDDEN, INTERMEDIATE, N_HEADS, N_KV_HEADS, VOCAB
        HIDDEN, INTERMEDIATE, N_HEADS, N_KV_HEADS, VOCAB = 64, 128, 4, 2, 512
        args.layers, args.skip_uncached, args.keep = 2, True, False
        args.dir = Path(tempfile.mkdtemp(prefix="bench-load-"))
        launches = ("first",)

    n_layers = layers_that_fit(args.layers, args.dir)
    if n_layers < args.layers:
        print(f"{args.layers} layers do not fit this machine's disk or RAM; using {n_layers} layers of 8B widths")
    folder, cache = args.dir / f"llama-{'tiny' if args.smoke else '8b-widths'}-{n_layers}l", args.dir / "cache"
    try:
        if not (folder / "config.json").is_file():
            t0 = time.perf_counter()
            build_checkpoint(folder, n_layers)
            print(f"built {folder} ({n_layers} layers, "
                  f"{sum(f.stat().st_size for f in folder.iterdir()) / 2**30:.2f} GiB bf16) "
                  f"in {time.perf_counter() - t0:.0f} s")
        shutil.rmtree(cache, ignore_errors=True)
        env = {"OFFLOAD_CACHE": str(cache)}
        loads = {}
        if not args.skip_uncached:
            loads["no cache (read bf16 + quantize)"] = timed_load(
                str(folder), args.quantization, {**env, "OFFLOAD_PACKED_CACHE": "0"}, args.cold)
        first = loads["first (+ write the cache)"] = timed_load(str(folder), args.quantization, env, args.cold)
        second = loads["second (from the cache)"] = timed_load(str(folder), args.quantization, env, args.cold)
        print(f"{'cold' if args.cold else 'warm'} page cache, {args.quantization}, {n_layers} layers:")
        for name, r in loads.items():
            print(f"  {name:34s} {r['s']:7.1f} s to first token, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")
        plain = loads.get("no cache (read bf16 + quantize)")
        print(f"second / first: {second['s'] / first['s']:.3f} ({first['s'] / second['s']:.1f}x faster; goal >= 5x)"
              + (f"; first / no cache: {first['s'] / plain['s']:.2f} (the cost of writing it)" if plain else ""))
        gguf = folder.with_suffix(".Q4_0.gguf")
        if not gguf.is_file():
            t0 = time.perf_counter()
            write_q4_0_gguf(folder, gguf)
            print(f"wrote {gguf.name} ({gguf.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")
        for launch in launches:
            time_gguf(gguf, env, args.cold, f"Q4_0 GGUF, {launch} launch")
        if args.gguf:
            time_gguf(args.gguf, env, args.cold, f"GGUF {args.gguf.name}")
    finally:
        if not args.keep:  # only what this script made
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)
            folder.with_suffix(".Q4_0.gguf").unlink(missing_ok=True)
            if args.smoke:
                shutil.rmtree(args.dir, ignore_errors=True)


def write_q4_0_gguf(folder: Path, out: Path) -> None:
    """The checkpoint's weights as a Q4_0 GGUF file laid out as llama.cpp's converter does (norms F32)."""
    import gguf
    import numpy as np
    import torch

    from offload.kernels import pack
    from offload.weights.loader import Checkpoint
    from offload.weights.model_files import model_spec

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from gguf_support import add_byte_tokenizer, gguf_name, permute

    spec, ckpt = model_spec(folder), Checkpoint(folder)
    w = gguf.GGUFWriter(str(out), "llama")
    for key, value in (("block_count", spec.n_layers), ("context_length", spec.max_position_embeddings),
                       ("embedding_length", spec.hidden_size), ("feed_forward_length", spec.intermediate_size),
                       ("head_count", spec.n_heads), ("head_count_kv", spec.n_kv_heads)):
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_rope_freq_base(spec.rope.theta)
    w.add_vocab_size(spec.vocab_size)
    add_byte_tokenizer(w, spec.vocab_size)
    for t in spec.tensors():
        value = ckpt.get(t.name, torch.float32)
        if t.role != "linear" and t.role != "embedding":
            w.add_tensor(gguf_name(t.name), value.numpy())
            continue
        if ".q_proj." in t.name or ".k_proj." in t.name:
            value = torch.from_numpy(permute(value.numpy(), spec.n_heads if ".q_proj." in t.name else spec.n_kv_heads))
        raw = pack(value, "q4_0").to_rows().to_gguf()
        w.add_tensor(gguf_name(t.name), np.ascontiguousarray(raw), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def time_gguf(path: Path, env: dict, cold: bool, label: str) -> None:
    r = timed_load(str(path), "none", env, cold)
    print(f"  {label:34s} {r['s']:7.1f} s to first token, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
