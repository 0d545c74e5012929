"""`offload serve` under concurrent streaming clients, against the offline run and against llama-cpp-python's server.

Two measurements, each a server started here on 127.0.0.1 at a free port (a subprocess, waited for until it
answers), driven by asyncio clients over HTTP (httpx, server-sent events), greedy, a fixed max_tokens, answers
running their length (offload: ignore_eos; llama.cpp: min_tokens = max_tokens), every run bounded in time:

- load (default): --clients (64) concurrent streaming chat requests, each a distinct conversation, on --model.
  Prints completed / sent, p50 and p99 time to first token, total generated tokens/s and per-request decode
  tokens/s. Then the same conversations offline through offload.LLM(...).chat in this process (after the server
  has stopped) and how many texts are identical; where one parts, the token it parts at (the first offline token
  the served text does not continue with) and the top-2 logit gap there under the offline model, run alone: the
  kernels sum in another order at another token count, which a near-tie (gap < --tie, 0.05) can turn into another
  token. A parting at a larger gap would be a bug: each is printed.
- --against-llamacpp: the same GGUF file served by offload serve (its defaults: weights as stored, fp32 compute,
  the planner's batch) and by `python -m llama_cpp.server` (--n_threads and --n_threads_batch = this machine's
  cores, n_ctx = offload's max_model_len, logits_all false, interrupt_requests false (so that concurrent requests
  wait their turn rather than end the one running), its AMX and repacking buffers off (NO_EXTRA_BUFTS),
  OMP_WAIT_POLICY=PASSIVE (llamacpp_env), the rest its defaults), one server at a time, in
  alternating rounds (offload, llama.cpp, offload, llama.cpp ...). Each round: one warm-up request, then 1 client
  sending --sequential requests one after another (median per-request decode tokens/s and time to first
  token), then 16 clients at once (total generated tokens/s). Prints the medians over --rounds and the ratios
  offload / llama.cpp. llama-cpp-python's server answers one request at a time.

Usage: python scripts/bench_serve.py [--model default] [--clients 64] [--max-tokens 32] [--time-limit-s 300]
       python scripts/bench_serve.py --against-llamacpp [--rounds 3] [--sequential 4] [--max-tokens 32]
--smoke runs the load measurement on a tiny random model (4 clients, 4 tokens) and, where llama-cpp-python is
installed, the comparison on the default model's GGUF file with a few tokens: seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

TOPICS = ["the sea", "a city at night", "the moon", "jazz", "a pine forest", "winter", "a small robot", "bread",
          "volcanoes", "honey bees", "a lighthouse", "chess", "rain", "the desert", "trains", "coffee"]
ASKS = ["Write one sentence about {}.", "Give me three facts about {}.", "Describe {} to a child.",
        "Write a short poem about {}."]
TIE = 0.05  # top-2 logit gap below which a parting is a near-tie (issue 33)
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Answer:
    """One streamed answer as the client saw it."""

    text: str
    n_tokens: int
    ttft_s: float  # request sent to first text
    total_s: float  # request sent to the last byte
    finish_reason: str | None

    @property
    def decode_tps(self) -> float:
        """Tokens/s after the first token."""
        return (self.n_tokens - 1) / max(self.total_s - self.ttft_s, 1e-9)


def conversations(n: int) -> list[list[dict]]:
    """n distinct one-message conversations."""
    return [[{"role": "user", "content": ASKS[(i // len(TOPICS)) % len(ASKS)].format(TOPICS[i % len(TOPICS)])
              + ("" if i < len(TOPICS) * len(ASKS) else f" (take {i})")}] for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(cmd: list[str], port: int, ready_path: str, log: Path, timeout_s: float = 300, env: dict | None = None):
    """A server subprocess on 127.0.0.1:port (env added to this process's), once ready_path answers 200: its base
    URL and process; stopped (SIGINT, then kill) after."""
    import httpx

    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n{log.read_text()[-3000:]}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"the server did not answer {ready_path} in {timeout_s:.0f} s; see {log}")
                time.sleep(0.5)
            yield f"http://127.0.0.1:{port}/v1", proc
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def offload_cmd(model: str, port: int, extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "offload", "serve", "--model", model, "--port", str(port), "--quiet", *extra]


async def stream(client, url: str, body: dict, max_tokens: int) -> Answer:
    """One streamed request; tokens by the usage chunk where sent, else max_tokens for an answer that ran its
    length (llama-cpp-python's stream carries no usage), else the text chunks."""
    text, chunks, usage, finish, first = "", 0, None, None, None
    start = time.perf_counter()
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - start
                text, chunks = text + piece, chunks + bool(piece)
                finish = choice.get("finish_reason") or finish
    total = time.perf_counter() - start
    n = usage["completion_tokens"] if usage else max_tokens if finish == "length" else chunks
    return Answer(text, n, total if first is None else first, total, finish)


async def run_clients(base: str, bodies: list[list[dict]], url: str, max_tokens: int,
                      time_limit_s: float) -> tuple[list[Answer | None], float]:
    """Each list of bodies is one client sending them one after another, all clients at once; the answers in
    order (None for a request that failed or did not finish within time_limit_s) and the wall seconds."""
    import httpx

    async def client_run(c, mine: list[dict]) -> list[Answer | None]:
        out = []
        for body in mine:
            try:
                out.append(await stream(c, f"{base}{url}", body, max_tokens))
            except (httpx.HTTPError, RuntimeError) as e:
                print(f"  a request failed: {e}", file=sys.stderr)
                out.append(None)
        return out

    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=len(bodies) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(time_limit_s), limits=limits) as c:
        start = time.perf_counter()
        tasks = [asyncio.ensure_future(client_run(c, mine)) for mine in bodies]
        done, pending = await asyncio.wait(tasks, timeout=time_limit_s)
        wall = time.perf_counter() - start
        for t in pending:
            t.cancel()
    return [a for t in tasks for a in (t.result() if t in done else [None] * len(bodies[tasks.index(t)]))], wall


def peak_rss_bytes(pid: int) -> int:
    """A process's peak resident memory (Linux: VmHWM), 0 where it cannot be read."""
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0
    return int(line.split()[1]) * 1024


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


def parting_token(offline_ids: list[int], served: str, decode) -> int | None:
    """The first offline token the served text does not continue with (None where the texts are equal): the
    position where the served answer took another token. decode(ids) -> text."""
    if decode(offline_ids) == served:
        return None
    return next((k for k in range(len(offline_ids)) if not served.startswith(decode(offline_ids[:k + 1]))),
                len(offline_ids))


def classify(gaps: list[float | None], tie: float = TIE) -> dict[str, int]:
    """Counts of identical answers (gap None), partings at a near-tie (gap < tie) and partings at a larger gap."""
    return {"identical": sum(g is None for g in gaps), "near_tie": sum(g is not None and g < tie for g in gaps),
            "other": sum(g is not None and g >= tie for g in gaps)}


def greedy_body(max_tokens: int, server: str) -> dict:
    """What makes an answer greedy and run its length on each server."""
    extra = {"ignore_eos": True, "stream_options": {"include_usage": True}} if server == "offload" else \
        {"min_tokens": max_tokens}
    return {"max_tokens": max_tokens, "temperature": 0, **extra}


def load(args) -> None:
    """--clients concurrent streaming chat requests against offload serve, then the offline run (see above)."""
    chats = conversations(args.clients)
    port = free_port()
    cmd = offload_cmd(args.model, port, ["--max-tokens", str(args.max_tokens), *args.serve_args])
    bodies = [[{"messages": m, **greedy_body(args.max_tokens, "offload")}] for m in chats]
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp, \
            serving(cmd, port, "/health", Path(tmp) / "serve.log") as (base, proc):
        answers, wall = asyncio.run(run_clients(base, bodies, "/chat/completions", args.max_tokens,
                                                args.time_limit_s))
        peak_bytes = peak_rss_bytes(proc.pid)
    done = [a for a in answers if a is not None]
    print(f"offload serve {' '.join(cmd[4:])}; {args.clients} concurrent streaming chat requests, greedy, "
          f"{args.max_tokens} tokens each (ignore_eos), limit {args.time_limit_s:.0f} s")
    print(f"completed: {len(done)} of {len(answers)} in {wall:.1f} s; the server's peak resident memory "
          f"{peak_bytes / 2**30:.2f} GiB; load average {os.getloadavg()[0]:.1f}")
    if not done:
        return
    ttfts = [a.ttft_s for a in done]
    print(f"time to first token: p50 {percentile(ttfts, 50):.2f} s, p99 {percentile(ttfts, 99):.2f} s")
    print(f"generated tok/s: {sum(a.n_tokens for a in done) / wall:.1f} total; per request (decode) p50 "
          f"{percentile([a.decode_tps for a in done], 50):.2f}, p1 {percentile([a.decode_tps for a in done], 1):.2f}")
    compare_offline(args, chats, answers)


def compare_offline(args, chats: list[list[dict]], answers: list[Answer | None]) -> None:
    """The same conversations through offload.LLM.chat, greedy; identical texts, and the gap where one parts."""
    sys.path.insert(0, str(HERE))
    from bench_batch import top2_gap

    from offload import LLM, SamplingParams

    llm = LLM(args.model, max_tokens=args.max_tokens)
    offline = llm.chat(chats, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True))

    def decode(ids):
        return llm.tokenizer.decode(ids, skip_special_tokens=True)

    gaps, lines = [], []
    for i, (out, answer) in enumerate(zip(offline, answers)):
        if answer is None:
            continue
        k = parting_token(out.token_ids, answer.text, decode)
        gap = None if k is None else top2_gap(llm, out.prompt_token_ids + out.token_ids[:k])
        gaps.append(gap)
        if gap is not None:
            lines.append((gap, f"  request {i} parts at token {k} of {len(out.token_ids)}, top-2 logit gap "
                               f"{gap:.4f}: offline {decode(out.token_ids[k:k + 3])!r}, served "
                               f"{answer.text[len(decode(out.token_ids[:k])):][:12]!r}"))
    counts = classify(gaps, args.tie)
    print(f"against the offline run (LLM.chat, same model and max_tokens): identical {counts['identical']}, parting "
          f"at a near-tie (top-2 gap < {args.tie}) {counts['near_tie']}, parting at a larger gap {counts['other']}")
    for gap, line in sorted(lines):
        if gap >= args.tie or args.verbose:
            print(line)


def llamacpp_server_missing() -> str | None:
    """What is missing for llama-cpp-python's server (the package, or its `server` extra), or None."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed"
    if any(importlib.util.find_spec(m) is None for m in ("sse_starlette", "starlette_context", "pydantic_settings",
                                                          "fastapi", "uvicorn")):
        return "llama-cpp-python's server extra is not installed (pip install 'llama-cpp-python[server]')"
    return None


def against_llamacpp(args) -> None:
    """offload serve against llama-cpp-python's server on the same GGUF file, alternating rounds (see above)."""
    from offload.weights.default_model import resolve_model

    if missing := llamacpp_server_missing():
        raise SystemExit(f"--against-llamacpp needs llama-cpp-python's server: {missing}")
    gguf = resolve_model(args.model)
    if not gguf.is_file() or gguf.suffix != ".gguf":
        raise SystemExit(f"--against-llamacpp needs a GGUF file (both servers read it); {gguf} is not one")
    threads = os.cpu_count() or 1
    prompts = [f"{ASKS[i % len(ASKS)].format(TOPICS[i % len(TOPICS)])} Answer:" for i in range(16)]
    results: dict[str, list[dict]] = {"offload": [], "llama.cpp": []}
    cmds, load_before = {}, os.getloadavg()[0]
    for _ in range(args.rounds):
        for name in results:
            port = free_port()
            cmds[name] = offload_cmd(str(gguf), port, ["--max-model-len", str(args.n_ctx)]) if name == "offload" \
                else llamacpp_cmd(gguf, port, threads, args.n_ctx, args.llamacpp_extra_bufts)
            ready, env = ("/health", {}) if name == "offload" else ("/v1/models", llamacpp_env(args))
            with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp, \
                    serving(cmds[name], port, ready, Path(tmp) / "serve.log", env=env) as (base, _):
                results[name].append(one_round(base, name, prompts, args))
    print(f"same GGUF file {gguf.name}, {threads} cores (load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after); completions, greedy, {args.max_tokens} tokens per answer; median of "
          f"{args.rounds} rounds, the servers alternating")
    for name, cmd in cmds.items():
        shown = ["python", *(["-m", "llama_cpp.server"] if NO_EXTRA_BUFTS in cmd else []),
                 *(Path(c).name if c.startswith("/") else c for c in cmd[1:] if c not in ("-c", NO_EXTRA_BUFTS))]
        env = " ".join(f"{k}={v}" for k, v in llamacpp_env(args).items()) if name == "llama.cpp" else ""
        print(f"  {name}: {env + ' ' if env else ''}{' '.join(shown)}" + (
            "" if args.llamacpp_extra_bufts or name == "offload" else
            "; llama.cpp's extra buffer types (AMX, repacking) off"))
    med = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in results.items()}
    for name, m in med.items():
        print(f"{name:>9}: 1 client: decode {m['decode_tps']:6.1f} tok/s, TTFT {m['ttft_s'] * 1000:6.0f} ms, "
              f"end to end {m['e2e_tps']:6.1f} tok/s; 16 clients: {m['total_tps']:6.1f} generated tok/s "
              f"(p50 TTFT {m['ttft16_s']:.2f} s)")
    o, ll = med["offload"], med["llama.cpp"]
    print(f"offload / llama.cpp: 1 client decode {o['decode_tps'] / ll['decode_tps']:.2f}x, end to end "
          f"{o['e2e_tps'] / ll['e2e_tps']:.2f}x, TTFT {o['ttft_s'] / ll['ttft_s']:.2f}x (lower is faster); "
          f"16 clients total generated tok/s {o['total_tps'] / ll['total_tps']:.2f}x")


# llama.cpp's extra buffer types (its AMX matmul, weight repacking) off: llama-cpp-python 0.3.36 built here dies
# in ggml_backend_amx_mul_mat (a general-protection fault) on any prompt of more than one token on the 2-core Xeon
# (AMX) this was written on; off, its prompts run on the AVX-512 kernels
NO_EXTRA_BUFTS = ("import runpy, llama_cpp.llama_cpp as c; d = c.llama_model_default_params\n"
                  "def params():\n    p = d(); p.use_extra_bufts = False; return p\n"
                  "c.llama_model_default_params = params; runpy.run_module('llama_cpp.server', run_name='__main__')")


def llamacpp_cmd(gguf: Path, port: int, threads: int, n_ctx: int, extra_bufts: bool) -> list[str]:
    run = ["-m", "llama_cpp.server"] if extra_bufts else ["-c", NO_EXTRA_BUFTS]
    return [sys.executable, *run, "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
            "--logits_all", "false", "--interrupt_requests", "false"]


def llamacpp_env(args) -> dict:
    """OpenMP's threads sleep when idle rather than spin: on a shared 2-core machine, llama.cpp's spinning threads
    (its default) fell from 35-40 to 0.7-2.8 decode tok/s while another process ran (measured on the 2-core Xeon
    this was written on)."""
    return {} if args.llamacpp_omp_active else {"OMP_WAIT_POLICY": "PASSIVE"}


def one_round(base: str, name: str, prompts: list[str], args) -> dict:
    """Warm-up, 1 client sending --sequential requests, 16 clients at once: this server's figures."""
    def bodies(ps: list[str]) -> list[dict]:
        return [{"prompt": p, **greedy_body(args.max_tokens, name)} for p in ps]

    asyncio.run(run_clients(base, [bodies(["Hello"])], "/completions", args.max_tokens, args.time_limit_s))
    one, _ = asyncio.run(run_clients(base, [bodies(prompts[:args.sequential])], "/completions", args.max_tokens,
                                     args.time_limit_s))
    many, wall = asyncio.run(run_clients(base, [bodies([p]) for p in prompts], "/completions", args.max_tokens,
                                         args.time_limit_s))
    if None in one or None in many:
        raise SystemExit(f"{name}: {(one + many).count(None)} requests did not complete within the time limit")
    short = [a for a in one + many if a.n_tokens != args.max_tokens]
    if short:
        print(f"  {name}: {len(short)} answers ran {sorted({a.n_tokens for a in short})} tokens, not "
              f"{args.max_tokens}", file=sys.stderr)
    return {"decode_tps": statistics.median(a.decode_tps for a in one),
            "ttft_s": statistics.median(a.ttft_s for a in one),
            "e2e_tps": statistics.median(a.n_tokens / a.total_s for a in one),
            "total_tps": sum(a.n_tokens for a in many) / wall,
            "ttft16_s": statistics.median(a.ttft_s for a in many)}


def smoke(args) -> None:
    """The load measurement on a tiny random model, 4 clients of 4 tokens; the comparison where llama.cpp is."""
    from make_llama import tiny

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        args.model, args.clients, args.max_tokens = str(tiny(Path(tmp) / "tiny", tokenizer=True)), 4, 4
        args.serve_args = ["--backend", "cpu", "--max-model-len", "256"]
        load(args)
    if missing := llamacpp_server_missing():
        print(f"{missing}: the comparison with its server is skipped")
        return
    args.model, args.rounds, args.sequential, args.max_tokens = "default", 1, 2, 4
    against_llamacpp(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--clients", type=int, default=64, help="concurrent streaming requests (load)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--time-limit-s", type=float, default=300, help="the most one batch of clients may take")
    parser.add_argument("--tie", type=float, default=TIE, help="top-2 logit gap below which a parting is a near-tie")
    parser.add_argument("--verbose", action="store_true", help="print every parting, near-ties too")
    parser.add_argument("--against-llamacpp", action="store_true", help="offload serve against llama_cpp.server")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each server (llama.cpp)")
    parser.add_argument("--sequential", type=int, default=4, help="requests of the 1-client run (llama.cpp)")
    parser.add_argument("--n-ctx", type=int, default=2048, help="context of both servers (llama.cpp)")
    parser.add_argument("--llamacpp-extra-bufts", action="store_true",
                        help="leave llama.cpp's extra buffer types (AMX, repacking) on (see NO_EXTRA_BUFTS)")
    parser.add_argument("--llamacpp-omp-active", action="store_true",
                        help="leave llama.cpp's OpenMP threads spinning when idle (see llamacpp_env)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, a few clients and tokens: seconds")
    args = parser.parse_args()
    args.serve_args = []
    sys.path.insert(0, str(HERE))
    if args.smoke:
        return smoke(args)
    if args.against_llamacpp:
        return against_llamacpp(args)
    load(args)


if __name__ == "__main__":
    main()
