"""CPU prefill and decode tokens/s: offload against llama.cpp on the same weights, same threads, same run.

Prompts of about 200 and 2,000 tokens (--prompt-lens), then --decode-tokens greedy tokens; medians of --repeats,
the two tools alternating run by run (llama.cpp in a fresh child each time, warmed up on each prompt first).
--model picks the weights:
- default: the default model (SmolLM2-135M): offload with each quantization (none, q8_0, q4_0, requantized from
  its Q4_1 file) against llama.cpp on that Q4_1 file;
- a GGUF file: offload using its tensors as stored, and llama.cpp, on that file;
- a Hugging Face folder (Llama, Mistral, or a Mixtral / Qwen2-MoE / Qwen3-MoE mixture of experts): its weights
  written as an F16 GGUF file and quantized by llama.cpp to Q8_0 and Q4_0 (in a temporary folder); offload
  (tensors as stored) and llama.cpp run each file.
llama.cpp runs through llama-cpp-python, in a child process (its column is skipped with a message if that
package is not installed; a Hugging Face folder is then quantized by offload itself, q8_0 and q4_0). Prints
offload's ratio against llama.cpp for each row.

  python scripts/bench_cpu_decode.py --threads 2
  python scripts/bench_cpu_decode.py --smoke    # a tiny random folder, 16- and 32-token prompts, 4 tokens: seconds
  python scripts/bench_cpu_decode.py --model model.Q4_K_M.gguf
  python scripts/bench_cpu_decode.py --model path/to/llama-folder --prompt-lens 200,2000 --repeats 2
  python scripts/bench_cpu_decode.py --model model.gguf --kv-cache-dtype bf16   # a 16-bit KV cache, as llama.cpp's
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from offload import LLM, SamplingParams
from offload.planner.placement import Placement
from offload.weights.default_model import find_gguf

def prompt_ids(n: int, vocab: int) -> list[int]:
    """n token ids spread over the vocabulary (fixed; no tokenizer needed)."""
    return [100 + (i * 7919) % max(vocab - 200, 1) for i in range(n)]


class OffloadRunner:
    """offload with every block computed on the CPU, loaded once; run(ids) times one prompt and its decode."""

    def __init__(self, model: str, quantization: str, prompts: list[list[int]], n_decode: int,
                 kv_cache_dtype: str = "auto"):
        longest = max(len(p) for p in prompts) + n_decode + 8
        self.llm = LLM(model, quantization=quantization, backend="cpu", batch_size=1,
                       placement=_all_cpu(model), max_model_len=longest, kv_cache_dtype=kv_cache_dtype)
        self.params = SamplingParams(max_tokens=n_decode, temperature=0, ignore_eos=True)
        for ids in prompts:
            self.llm.generate({"prompt_token_ids": ids}, self.params)  # warm-up

    def run(self, ids: list[int]) -> tuple[float, float]:
        """(prefill tok/s, decode tok/s) of one generate over the prompt."""
        self.llm.timeline.clear()
        self.llm.generate({"prompt_token_ids": ids}, self.params)
        t = self.llm.timeline
        return t.phase_tokens["prefill"] / t.phase_time_s["prefill"], t.phase_tokens["decode"] / t.phase_time_s["decode"]

    def close(self) -> None:
        self.llm.model.close()


def _all_cpu(model: str) -> Placement:
    from offload.weights.default_model import resolve_model
    from offload.weights.model_files import model_spec

    return Placement.uniform(model_spec(resolve_model(model)), "cpu", "cpu")


def bench_llama_cpp(gguf: str, prompts: list[list[int]], n_decode: int, threads: int, repeats: int):
    """Per prompt: median (prefill tok/s, decode tok/s) of llama.cpp on the GGUF file, or None if it is not
    installed.

    Runs in a child process: llama-cpp-python redirects the process's stdout while it loads.
    """
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "llama_cpp.json"
        args = json.dumps([gguf, prompts, n_decode, threads, repeats])
        out = subprocess.run([sys.executable, __file__, "--llama-cpp-child", args, str(result)],
                             capture_output=True, text=True)
        if out.returncode != 0 or not result.is_file():
            print(f"llama.cpp run failed: {out.stderr.strip().splitlines()[-1:]}")
            return None
        return [tuple(r) for r in json.loads(result.read_text())]


def amx_cpu() -> bool:
    """Whether the CPU has AMX (llama-cpp-python 0.3.36 then repacks quantized weights for it, and segfaults)."""
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _llama_cpp_child(gguf: str, prompts: list[list[int]], n_decode: int, threads: int,
                     repeats: int) -> list[tuple[float, float]]:
    import numpy as np
    from llama_cpp import Llama

    if amx_cpu():  # llama.cpp's AMX-repacked buffers crash on this CPU: its weights as stored (see bench_kl)
        from bench_kl import without_repacking

        without_repacking()
    n_ctx = max(len(p) for p in prompts) + n_decode + 16
    llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512, verbose=False)
    results = []
    for ids in prompts:
        prefill, decode = [], []
        for _ in range(repeats + 1):  # the first run is a warm-up
            llm.reset()
            start = time.perf_counter()
            llm.eval(ids)
            mid = time.perf_counter()
            for _ in range(n_decode):  # greedy on the last position's logits (llama.cpp keeps only those)
                logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
                llm.eval([int(np.argmax(logits))])
            end = time.perf_counter()
            prefill.append(len(ids) / (mid - start))
            decode.append(n_decode / (end - mid))
        results.append((statistics.median(prefill[1:]), statistics.median(decode[1:])))
    return results


def _medians(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def alternate(offload_model: str, quantization: str, gguf: str | None, prompts: list[list[int]], n_decode: int,
              threads: int, repeats: int, kv_cache_dtype: str = "auto"):
    """(ours, theirs): per prompt, median (prefill tok/s, decode tok/s) of offload and of llama.cpp on the GGUF file
    (theirs None without llama-cpp-python, a failed run or gguf None). The two tools alternate, one run each per
    repeat: this machine's speed drifts over minutes."""
    runner = OffloadRunner(offload_model, quantization, prompts, n_decode, kv_cache_dtype)
    mine: list[list[tuple[float, float]]] = [[] for _ in prompts]
    theirs: list[list[tuple[float, float]]] = [[] for _ in prompts]
    try:
        for _ in range(repeats):
            torch.set_num_threads(threads)
            for i, ids in enumerate(prompts):
                mine[i].append(runner.run(ids))
            ref_run = bench_llama_cpp(gguf, prompts, n_decode, threads, 1) if gguf else None
            for i, r in enumerate(ref_run or []):
                theirs[i].append(r)
    finally:
        runner.close()
    return [_medians(m) for m in mine], ([_medians(t) for t in theirs] if all(theirs) else None)


def variants(model: str, tmp: Path, threads: int) -> list[tuple[str, str, str, str]]:
    """(label, model for offload, offload's quantization, GGUF file for llama.cpp) for each row."""
    path = Path(model)
    if model == "default":
        gguf = str(find_gguf())
        return [(q, "default", q, gguf) for q in ("none", "q8_0", "q4_0")]
    if path.is_file():
        return [("as stored", str(path), "none", str(path))]
    if not (path / "config.json").is_file():
        sys.exit(f"--model {model}: expected 'default', a GGUF file or a Hugging Face folder with config.json")
    if importlib.util.find_spec("llama_cpp") is None:  # no llama.cpp to quantize or run: offload quantizes
        return [(f"{q} (quantized)", str(path), q, None) for q in ("q8_0", "q4_0")]
    sys.path.insert(0, str(Path(__file__).parent))
    from make_gguf import quantize, write_f16_from_hf

    f16 = tmp / "f16.gguf"
    write_f16_from_hf(f16, path)
    rows = []
    for kind in ("Q8_0", "Q4_0"):
        out = tmp / f"{path.name}.{kind}.gguf"
        quantize(f16, out, kind, threads)
        rows.append((kind.lower() + " (as stored)", str(out), "none", str(out)))
    f16.unlink()
    return rows


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--llama-cpp-child":  # the result goes to a file: see above
        Path(sys.argv[3]).write_text(json.dumps(_llama_cpp_child(*json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="'default', a GGUF file or a Hugging Face folder")
    ap.add_argument("--gguf", help="the same as --model with a GGUF file")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--prompt-lens", default="200,2000", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="offload's KV cache (auto: the compute format, fp32 on the CPU; llama.cpp keeps f16)")
    ap.add_argument("--smoke", action="store_true", help="a tiny random Hugging Face folder, short prompts: seconds")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = args.gguf or args.model
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            sys.path.insert(0, str(Path(__file__).parent))
            from make_gguf import smoke_vocab_size
            from make_llama import tiny

            model = str(tiny(Path(tmp) / "tiny", smoke_vocab_size()))
            args.prompt_lens, args.decode_tokens, args.repeats = "16,32", 4, 1
        lengths = [int(n) for n in args.prompt_lens.split(",")]
        rows = variants(model, Path(tmp), args.threads)
        from offload.weights.default_model import resolve_model
        from offload.weights.model_files import model_spec

        vocab = model_spec(resolve_model(rows[0][1])).vocab_size
        prompts = [prompt_ids(n, vocab) for n in lengths]
        print(f"{Path(model).name if model != 'default' else 'default model'}: prompts of "
              f"{', '.join(map(str, lengths))} tokens, then {args.decode_tokens} greedy tokens; {args.threads} threads; "
              f"median of {args.repeats}")
        has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
        for label, offload_model, quant, gguf in rows:
            ours, ref = alternate(offload_model, quant, gguf, prompts, args.decode_tokens, args.threads, args.repeats,
                                  args.kv_cache_dtype)
            for i, n in enumerate(lengths):
                pre, dec = ours[i]
                line = f"offload {label:16s} {n:5d}-token prompt: prefill {pre:8.1f} tok/s, decode {dec:7.1f} tok/s"
                if ref is not None:
                    line += (f" | llama.cpp {Path(gguf).name}: prefill {ref[i][0]:8.1f}, decode {ref[i][1]:7.1f}"
                             f" | ratio prefill {pre / ref[i][0]:.2f}x, decode {dec / ref[i][1]:.2f}x")
                print(line, flush=True)
        if not has_llama_cpp:
            print("llama.cpp column skipped: llama-cpp-python is not installed (pip install llama-cpp-python)")


if __name__ == "__main__":
    main()
