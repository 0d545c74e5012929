"""Quality of a model against a reference over a text, as llama.cpp's `llama-perplexity --kl-divergence` measures it
(tools/perplexity/perplexity.cpp): the text is tokenized once and cut into whole chunks of n_ctx tokens, the first
token of each chunk replaced by BOS where the tokenizer adds one; each chunk is run from an empty KV cache and
the tokens from n_ctx/2 + 1 on are scored, each by the logits of the token before it (n_ctx - 1 - n_ctx/2 per
chunk). Perplexity is exp(mean NLL), KL divergence the mean over scored tokens of sum p_ref (log p_ref - log p),
"same top p" the share of scored tokens whose argmax agrees; each with llama.cpp's ± (the standard error).

llama-perplexity stores the reference's log-probabilities in 16 bits over their top 16 nats and drops the terms
where p_ref < e^-16; here both are kept in full (fp32, summed in fp64), a difference far below the ± on any text.
Nothing here loads a model: `chunk_logits` runs anything with Model's forward/logits interface, and `KLSums`
takes logits from any tool (scripts/bench_kl.py feeds it llama.cpp's)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from offload.errors import ConfigError

ROWS_AT_ONCE = 64  # scored rows turned into log-probabilities at once: 64 x 49152 x fp64 is 25 MB


def scored_rows(n_ctx: int) -> range:
    """The rows of a chunk whose logits are scored (llama.cpp's first = n_ctx/2, up to the last but one); row j
    predicts the chunk's token j + 1."""
    return range(n_ctx // 2, n_ctx - 1)


def chunk_tokens(ids: list[int], n_ctx: int, n_chunks: int | None = None,
                 bos_id: int | None = None) -> list[list[int]]:
    """The text's whole chunks of n_ctx tokens (at most n_chunks), each beginning with bos_id where it is given
    (the model adds BOS). llama-perplexity's rule: at least 2 x n_ctx tokens."""
    if n_ctx < 4:
        raise ConfigError(f"--ctx {n_ctx} leaves no token to score; give 4 or more (llama-perplexity uses 512)")
    if len(ids) < 2 * n_ctx:
        raise ConfigError(f"the text is {len(ids)} tokens, fewer than the 2 x {n_ctx} (--ctx) that llama-perplexity "
                          f"requires; give a longer text or a smaller --ctx")
    n = len(ids) // n_ctx if n_chunks is None else min(n_chunks, len(ids) // n_ctx)
    chunks = [list(ids[i * n_ctx: (i + 1) * n_ctx]) for i in range(n)]
    if bos_id is not None:
        for chunk in chunks:
            chunk[0] = bos_id
    return chunks


def adds_bos(tokenizer) -> int | None:
    """The BOS id where the tokenizer puts one before a text (llama.cpp's add_bos), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    plain = tokenizer.encode("a", add_special_tokens=False)
    return bos if bos is not None and tokenizer.encode("a")[:1] == [bos] != plain[:1] else None


def chunk_logits(model, ids: list[int], rows: range, pass_tokens: int, logits_rows: int) -> torch.Tensor:
    """fp32 logits [len(rows), V] of one chunk run from an empty cache, pass_tokens tokens per forward pass (the
    plan's prefill pass) and at most logits_rows rows of logits at once (what the plan budgets)."""
    n = len(ids)
    cache = model.new_cache(1, n)
    out = []
    with torch.inference_mode():
        for start in range(0, n, pass_tokens):
            end = min(start + pass_tokens, n)
            positions = torch.arange(start, end)[None]
            step = model.make_step(positions, torch.ones_like(positions, dtype=torch.bool), trash_slot=n)
            wanted = [j - start for j in rows if start <= j < end]
            hidden = model.forward(torch.tensor([ids[start:end]]), step, cache, logits=bool(wanted))[0]  # [S, D]
            for i in range(0, len(wanted), logits_rows):
                more = i + logits_rows < len(wanted)
                out.append(model.logits(hidden[wanted[i: i + logits_rows]], more=more))
    return torch.cat(out)


def llm_logits(llm):
    """(ids, rows) -> fp32 logits of one chunk at rows, from an offload.LLM run in its plan's passes."""
    gen = llm.generator
    return lambda ids, rows: chunk_logits(llm.model, ids, rows, gen.step_tokens, gen.logits_rows)


@dataclass(frozen=True)
class Estimate:
    value: float
    err: float  # llama.cpp's ±: the standard error of the mean

    def __str__(self) -> str:
        return f"{self.value:.6f} ± {self.err:.6f}"


@dataclass(frozen=True)
class KLResult:
    n_tokens: int  # scored tokens
    ppl: Estimate  # the model's perplexity
    ppl_ref: Estimate
    ln_ppl_ratio: Estimate  # ln(PPL / PPL_ref)
    kld: Estimate  # mean KL divergence of the model from the reference, nats
    same_top: Estimate  # share of scored tokens whose argmax is the reference's (0..1)


@dataclass
class KLSums:
    """llama.cpp's running sums (kl_divergence_result): add() each chunk's scored rows, then result()."""

    count: int = 0
    same_top: int = 0
    nll: float = 0.0
    nll2: float = 0.0
    nll_ref: float = 0.0
    nll_ref2: float = 0.0
    nll_nll_ref: float = 0.0
    kld: float = 0.0
    kld2: float = 0.0

    def add(self, ref_logprobs: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """ref_logprobs, logits [N, V] of the same scored rows; targets [N]: the token each row predicts."""
        for i in range(0, len(targets), ROWS_AT_ONCE):
            ref = ref_logprobs[i: i + ROWS_AT_ONCE].double()
            logp = torch.log_softmax(logits[i: i + ROWS_AT_ONCE].double(), dim=-1)
            t = targets[i: i + ROWS_AT_ONCE].long()[:, None]
            nll, nll_ref = -logp.gather(1, t)[:, 0], -ref.gather(1, t)[:, 0]
            kld = (ref.exp() * (ref - logp)).sum(-1)
            self.count += len(t)
            self.same_top += int((logp.argmax(-1) == ref.argmax(-1)).sum())
            self.nll += float(nll.sum())
            self.nll2 += float((nll * nll).sum())
            self.nll_ref += float(nll_ref.sum())
            self.nll_ref2 += float((nll_ref * nll_ref).sum())
            self.nll_nll_ref += float((nll * nll_ref).sum())
            self.kld += float(kld.sum())
            self.kld2 += float((kld * kld).sum())

    def result(self) -> KLResult:
        n = self.count
        log_ppl, log_ppl_ref = _mean_err(self.nll, self.nll2, n), _mean_err(self.nll_ref, self.nll_ref2, n)
        cov = (self.nll_nll_ref / n - (self.nll / n) * (self.nll_ref / n)) / (n - 1) if n >= 10 else 0.0
        ratio_err = math.sqrt(max(log_ppl.err ** 2 + log_ppl_ref.err ** 2 - 2 * cov, 0.0))
        top = self.same_top / n
        return KLResult(
            n_tokens=n,
            ppl=Estimate(math.exp(log_ppl.value), math.exp(log_ppl.value) * log_ppl.err),
            ppl_ref=Estimate(math.exp(log_ppl_ref.value), math.exp(log_ppl_ref.value) * log_ppl_ref.err),
            ln_ppl_ratio=Estimate(log_ppl.value - log_ppl_ref.value, ratio_err),
            kld=_mean_err(self.kld, self.kld2, n),
            same_top=Estimate(top, math.sqrt(top * (1 - top) / (n - 1)) if n > 1 else 0.0))


def _mean_err(total: float, total2: float, n: int) -> Estimate:
    """llama.cpp's mean_and_uncertainty: the mean and its standard error (0 for 10 values or fewer)."""
    mean = total / n
    var = total2 / n - mean * mean
    return Estimate(mean, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0)


def evaluate(model_logits, ref_logits, chunks: list[list[int]], on_chunk=None) -> KLResult:
    """KL, top-1 and perplexity of a model against a reference over chunks; model_logits(ids, rows) and
    ref_logits(ids, rows) give fp32 logits [len(rows), V] (chunk_logits for offload). on_chunk(i, sums) after each
    chunk, for progress."""
    sums = KLSums()
    for i, ids in enumerate(chunks):
        rows = scored_rows(len(ids))
        ref = torch.log_softmax(ref_logits(ids, rows).float(), dim=-1)
        targets = torch.tensor(ids[rows.start + 1: rows.stop + 1])
        sums.add(ref, model_logits(ids, rows), targets)
        if on_chunk is not None:
            on_chunk(i, sums)
    return sums.result()


def format_result(r: KLResult, model: str, reference: str) -> str:
    """The table `offload eval-kl` prints."""
    lines = [f"model      {model}", f"reference  {reference}", f"tokens     {r.n_tokens} scored",
             f"PPL(model)               {r.ppl}", f"PPL(ref)                 {r.ppl_ref}",
             f"ln(PPL(model)/PPL(ref))  {r.ln_ppl_ratio}", f"mean KLD                 {r.kld}",
             f"same top-1               {100 * r.same_top.value:.3f} ± {100 * r.same_top.err:.3f} %"]
    return "\n".join(lines)
