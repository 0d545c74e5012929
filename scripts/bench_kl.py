"""Quality of every llama.cpp-quantized type, offload's and llama.cpp's side by side: mean KL divergence, top-1
agreement and perplexity of each file against the same tool's run of the F32 file, as `llama-perplexity
--kl-divergence` measures them (offload/quality.py), over the same text (data/alice29.txt) and chunks.

llama.cpp's quantizer (llama-cpp-python) writes each type from the F32 file; llama.cpp's figures come from its
logits (logits_all=True), chunked and scored as llama-perplexity does, each file run in a subprocess (a crash
inside llama.cpp costs that row, not the run). A file offload cannot load is reported with its error.

The models:
  smollm2    SmolLM2-135M (hidden 576); its only real weights are the Q4_1 file, so its "F32" reference is that
             file dequantized (by llama.cpp's quantizer)
  llama-0.8b the random ~0.8B Llama of scripts/make_llama.py (hidden 2048, intermediate 4608), converted to an F32
             GGUF by scripts/make_gguf.py (write_f16_from_hf)

  python scripts/bench_kl.py --model smollm2 --chunks 16 --types Q8_0,Q4_0
  python scripts/bench_kl.py --model llama-0.8b --chunks 4 --types Q8_0,Q4_0
  python scripts/bench_kl.py --smoke     # a tiny model, 2 chunks of 32 tokens: seconds

llama-cpp-python is not in CI; without it, only offload's side runs (smoke: the F32 file against itself).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "data" / "alice29.txt"
# the list (34), then the types offload computes today
TYPES = ("Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL", "Q5_0", "Q5_1", "IQ3_XXS",
         "Q4_1", "Q6_K")
NO_LLAMA_CPP = ("llama.cpp's side skipped: llama-cpp-python is not installed (pip install llama-cpp-python; it "
                "builds from source and is not in CI)")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("smollm2", "llama-0.8b"), default="smollm2")
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated llama.cpp file types")
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=16, help="chunks scored (llama-perplexity's default is all)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (offload plans its own)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench-kl",
                    help="where the F32 and quantized files are written and kept for the next run")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 2 chunks of 32 tokens")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)  # the subprocess's job (quantize, llama-cpp)
    return ap.parse_args(argv)


# --- the files --------------------------------------------------------------------------------------------------

def quantize(src: Path, dst: Path, kind: str, threads: int) -> None:
    """dst: src as llama.cpp's quantizer writes it in kind (ALL_F32: dequantized); exits non-zero where it refuses."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{'ALL_F32' if kind == 'F32' else 'MOSTLY_' + kind}")
    params.nthread = threads
    params.allow_requantize = kind == "F32"  # SmolLM2's reference: its Q4_1 file dequantized
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        sys.exit(f"llama.cpp's quantizer refused {kind}")


def in_subprocess(*job: str) -> tuple[str | None, str]:
    """Run one worker job in a fresh process: (None or the reason it failed, its last stdout line)."""
    out = subprocess.run([sys.executable, __file__, "--worker", *job], capture_output=True, text=True)
    last = (out.stdout.strip().splitlines() or [""])[-1]
    if out.returncode != 0:
        lines = (out.stderr.strip() or out.stdout.strip() or f"exit status {out.returncode}").splitlines()
        return lines[-1][:200], last
    return None, last


def f32_file(model: str, workdir: Path, threads: int) -> Path:
    """The model's F32 GGUF file in workdir, written unless it is there."""
    path = workdir / f"{model}.F32.gguf"
    if path.is_file():
        return path
    if model == "smollm2":
        from offload.weights.default_model import find_gguf

        error, _ = in_subprocess("quantize", str(find_gguf()), str(path), "F32", str(threads))
        if error:
            sys.exit(f"could not dequantize SmolLM2's Q4_1 file: {error}")
    else:
        from make_gguf import write_f16_from_hf
        from make_llama import main as make_llama

        folder = workdir / f"{model}-hf"
        make_llama(["--out", str(folder), "--dtype", "fp32"])
        write_f16_from_hf(path, folder, f32=True)
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    return path


# --- the two tools ----------------------------------------------------------------------------------------------

def offload_side(f32: Path, files: dict[str, Path], text: str, ctx: int, n_chunks: int) -> tuple[dict, list[int]]:
    """type -> KLResult or the error offload gives, each file against offload's F32 run; and the tokens."""
    import torch

    from offload.api import LLM
    from offload.errors import OffloadError
    from offload.quality import KLSums, adds_bos, chunk_tokens, llm_logits, scored_rows

    ref = LLM(str(f32), batch_size=1, max_model_len=ctx)
    ids = ref.tokenizer.encode(text)
    chunks = chunk_tokens(ids, ctx, n_chunks, adds_bos(ref.tokenizer))
    rows = scored_rows(ctx)
    ref_logprobs = [torch.log_softmax(llm_logits(ref)(c, rows), dim=-1) for c in chunks]
    del ref
    out = {}
    for kind, path in files.items():
        try:
            llm = LLM(str(path), batch_size=1, max_model_len=ctx)
        except OffloadError as e:
            out[kind] = f"not loadable yet: {e}"
            continue
        sums = KLSums()
        for c, lp in zip(chunks, ref_logprobs):
            sums.add(lp, llm_logits(llm)(c, rows), torch.tensor(c[rows.start + 1: rows.stop + 1]))
        out[kind] = sums.result()
        del llm
        gc.collect()
        print(f"  offload {kind}: {out[kind].kld}", flush=True)
    return out, ids


def without_repacking() -> None:
    """Load weights as stored, without llama.cpp's extra buffer types: on this machine's AMX CPU, llama-cpp-python
    0.3.36 segfaults in the first llama_decode of every quantized file it repacked for AMX (F32 files run). The
    Llama class reads its model parameters from llama_model_default_params, so the worker process replaces it."""
    import llama_cpp.llama_cpp as low

    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params


def llama_cpp_worker(path: str, text_path: str, ctx: int, n_chunks: int, threads: int, ref: str, mode: str) -> None:
    """In a subprocess: llama.cpp's logits of each chunk of the text; mode 'reference' stores the log-probs of the
    scored rows in ref (.npy), mode 'score' prints the KL sums against them as JSON, with the tokens' count."""
    import numpy as np
    import torch
    import llama_cpp

    from offload.quality import KLSums, chunk_tokens, scored_rows

    without_repacking()
    llm = llama_cpp.Llama(path, n_ctx=ctx, n_batch=ctx, logits_all=True, n_threads=threads, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    ids = llm.tokenize(Path(text_path).read_bytes(), add_bos=True, special=False)
    bos = llm.token_bos() if llama_cpp.llama_vocab_get_add_bos(vocab) else None
    chunks, rows = chunk_tokens(ids, ctx, n_chunks, bos), scored_rows(ctx)
    store = np.lib.format.open_memmap(ref, "w+" if mode == "reference" else "r", np.float32,
                                      (len(chunks), len(rows), llm.n_vocab()))
    sums = KLSums()
    for i, chunk in enumerate(chunks):
        llm.reset()
        llm.eval(chunk)
        logits = torch.from_numpy(np.array(llm.scores[rows.start: rows.stop]))
        if mode == "reference":
            store[i] = torch.log_softmax(logits, dim=-1).numpy()
        else:
            sums.add(torch.from_numpy(np.array(store[i])), logits, torch.tensor(chunk[rows.start + 1: rows.stop + 1]))
    store.flush()
    print(json.dumps({"sums": vars(sums), "tokens": ids}))


def llama_cpp_side(f32: Path, files: dict[str, Path], loaded: set[str], args) -> tuple[dict, list[int] | None]:
    """type -> KLResult or the reason llama.cpp gave none, each file offload loaded against llama.cpp's F32 run;
    and llama.cpp's tokens of the text."""
    from offload.quality import KLSums

    ref = args.workdir / f"{f32.stem}.llama-cpp-logprobs.npy"
    common = [str(args.text), str(args.ctx), str(args.chunks), str(args.threads), str(ref)]
    error, line = in_subprocess("llama-cpp", str(f32), *common, "reference")
    if error:
        return {kind: f"llama.cpp's F32 run failed: {error}" for kind in files}, None
    tokens = json.loads(line)["tokens"]
    out = {}
    for kind, path in files.items():
        if kind not in loaded:
            continue
        error, line = in_subprocess("llama-cpp", str(path), *common, "score")
        out[kind] = f"llama.cpp failed: {error}" if error else KLSums(**json.loads(line)["sums"]).result()
        print(f"  llama.cpp {kind}: {out[kind] if error else out[kind].kld}", flush=True)
    ref.unlink()
    return out, tokens


# --- the table --------------------------------------------------------------------------------------------------

def table(model: str, ours: dict, theirs: dict) -> str:
    head = (f"{'type':8} {'offload KLD':>22} {'llama.cpp KLD':>22} {'KLD ratio':>9} {'top-1 %':>8} {'llama.cpp':>9} "
            f"{'diff pts':>8} {'PPL':>9} {'llama.cpp':>9}")
    lines = [head]
    for kind, r in ours.items():
        q = theirs.get(kind, "no llama.cpp figure")
        if isinstance(r, str):
            lines.append(f"{kind:8} {r}")
        elif isinstance(q, str):
            lines.append(f"{kind:8} {str(r.kld):>22}  {q}; offload top-1 {100 * r.same_top.value:.2f} %, "
                         f"PPL {r.ppl.value:.4f}")
        else:
            lines.append(f"{kind:8} {str(r.kld):>22} {str(q.kld):>22} {r.kld.value / q.kld.value:9.3f} "
                         f"{100 * r.same_top.value:8.2f} {100 * q.same_top.value:9.2f} "
                         f"{100 * (r.same_top.value - q.same_top.value):+8.2f} {r.ppl.value:9.4f} {q.ppl.value:9.4f}")
    some = next((r for r in ours.values() if not isinstance(r, str)), None)
    if some is not None:
        lines.append(f"PPL of the F32 reference: offload {some.ppl_ref}"
                     + next((f", llama.cpp {q.ppl_ref}" for q in theirs.values() if not isinstance(q, str)), ""))
    if model == "smollm2":
        lines.append("SmolLM2's F32 reference is its Q4_1 file dequantized (its only real weights)")
    return "\n".join(lines)


def run(model: str, kinds: list[str], args) -> int:
    args.workdir.mkdir(parents=True, exist_ok=True)
    have_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    if not have_llama_cpp and not args.smoke:
        sys.exit("bench_kl.py needs llama-cpp-python, for llama.cpp's quantizer and its figures (pip install "
                 "llama-cpp-python; it builds from source and is not in CI); --smoke runs offload's side alone")
    f32 = f32_file(model, args.workdir, args.threads)
    files = {"F32": f32} if args.smoke and not have_llama_cpp else {}
    for kind in kinds if have_llama_cpp else ():
        path = args.workdir / f"{model}.{kind}.gguf"
        error = None if path.is_file() else in_subprocess("quantize", str(f32), str(path), kind, str(args.threads))[0]
        if error:
            print(f"{kind}: skipped, llama.cpp's quantizer refused it ({error})")
        else:
            files[kind] = path
    text = args.text.read_text(encoding="utf-8")
    print(f"{model}: {len(files)} files, {args.chunks} chunks of {args.ctx} tokens of {args.text.name}", flush=True)
    ours, ids = offload_side(f32, files, text, args.ctx, args.chunks)
    theirs, tokens = llama_cpp_side(f32, files, {k for k, r in ours.items() if not isinstance(r, str)}, args) \
        if have_llama_cpp else ({}, None)
    if not have_llama_cpp:
        print(NO_LLAMA_CPP)
        theirs = {kind: "llama-cpp-python not installed" for kind in ours}
    elif tokens is not None:
        print(f"llama.cpp and offload tokenize the text the same: {tokens == ids} ({len(ids)} tokens)")
    print(table(model, ours, theirs))
    return 0


def smoke(args) -> int:
    """A tiny random model with SmolLM2's tokenizer, its F32 file, and Q8_0/Q4_0 where llama.cpp is installed."""
    from make_gguf import default_vocab_size, write_f16_from_hf
    from make_llama import tiny

    with tempfile.TemporaryDirectory(prefix="bench-kl-smoke-") as tmp:
        args.workdir, args.ctx, args.chunks = Path(tmp), 32, 2
        write_f16_from_hf(Path(tmp) / "tiny.F32.gguf", tiny(Path(tmp) / "hf", vocab=default_vocab_size()),
                          f32=True)
        return run("tiny", ["Q8_0", "Q4_0"], args)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        job, *rest = args.worker
        if job == "quantize":
            quantize(Path(rest[0]), Path(rest[1]), rest[2], int(rest[3]))
        else:
            llama_cpp_worker(rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4]), rest[5], rest[6])
        return 0
    if args.smoke:
        return smoke(args)
    return run(args.model, [k.strip().upper() for k in args.types.split(",") if k.strip()], args)


if __name__ == "__main__":
    sys.exit(main())
