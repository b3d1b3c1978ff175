"""Quality measurements, as ../shared/BENCH_PROTOCOL.md defines them.

Causal LMs: token perplexity on non-overlapping windows of a text file (float32), word perplexity
(exp of the same total negative log-likelihood divided by the number of whitespace-separated words
in the evaluated text, the lm-eval definition), and, against a baseline, the mean KL(p_base || p)
of the next-token distributions and top-1 agreement over all positions.

Encoders: sentence embeddings (attention-mask-weighted mean of the last hidden state,
L2-normalised); mean cosine to the baseline's embeddings and nearest-neighbour agreement.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from compress.calibration import read_texts, token_windows
from compress.errors import CompressError


def eval_windows(tokenizer, spec: str, seq_len: int = 256, max_windows: int = 256) -> torch.Tensor:
    text = "\n".join(read_texts(spec))
    windows = token_windows(tokenizer, text, seq_len)
    if len(windows) == 0:
        raise CompressError(f"evaluation text {spec} is shorter than one {seq_len}-token window", "give a longer file")
    return windows[:max_windows]


def eval_sentences(spec: str, max_sentences: int = 200, min_chars: int = 40) -> list[str]:
    lines = [ln.strip() for ln in read_texts(spec, lines=True)]
    sentences = [ln for ln in lines if len(ln) > min_chars][:max_sentences]
    if len(sentences) < 2:
        raise CompressError(f"evaluation text {spec} has fewer than 2 lines longer than {min_chars} characters", "give a file of sentences")
    return sentences


@torch.no_grad()
def causal_metrics(model, windows: torch.Tensor, tokenizer=None, baseline=None, batch_size: int = 8,
                   device: torch.device | str = "cpu", progress=lambda *_: None) -> dict:
    nll, predicted, kl, agree, positions = 0.0, 0, 0.0, 0, 0
    for start in range(0, len(windows), batch_size):
        progress("evaluating", start, len(windows))
        ids = windows[start : start + batch_size].to(device)
        logp = F.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
        targets = ids[:, 1:]
        nll -= float(logp[:, :-1].gather(-1, targets.unsqueeze(-1)).sum())
        predicted += targets.numel()
        if baseline is not None:
            base_logp = F.log_softmax(baseline(input_ids=ids).logits.float(), dim=-1)
            kl += float((base_logp.exp() * (base_logp - logp)).sum())
            agree += int((base_logp.argmax(-1) == logp.argmax(-1)).sum())
            positions += ids.numel()
    progress("evaluating", len(windows), len(windows))
    out = {
        "windows": len(windows),
        "tokens_predicted": predicted,
        "token_perplexity": math.exp(nll / predicted),
    }
    if tokenizer is not None:
        words = len(tokenizer.decode(windows.reshape(-1).tolist()).split())
        out["words"] = words
        out["word_perplexity"] = math.exp(nll / max(words, 1))
    if baseline is not None:
        out["kl_divergence"] = kl / positions
        out["top1_agreement"] = agree / positions
    return out


@torch.no_grad()
def sentence_embeddings(model, tokenizer, sentences: list[str], batch_size: int = 32, max_length: int = 128,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    chunks = []
    for start in range(0, len(sentences), batch_size):
        enc = tokenizer(sentences[start : start + batch_size], padding=True, truncation=True,
                        max_length=max_length, return_tensors="pt").to(device)
        hidden = model(**enc).last_hidden_state.float()
        mask = enc["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        chunks.append(F.normalize(pooled, dim=-1).cpu())
    return torch.cat(chunks)


def nearest_neighbours(emb: torch.Tensor) -> torch.Tensor:
    sim = emb @ emb.t()
    sim.fill_diagonal_(-float("inf"))
    return sim.argmax(-1)


@torch.no_grad()
def encoder_metrics(model, tokenizer, sentences: list[str], baseline=None, device="cpu") -> dict:
    emb = sentence_embeddings(model, tokenizer, sentences, device=device)
    out: dict = {"sentences": len(sentences)}
    if baseline is not None:
        base = sentence_embeddings(baseline, tokenizer, sentences, device=device)
        cos = (emb * base).sum(-1)
        out["mean_cosine"] = float(cos.mean())
        out["embedding_error"] = 1.0 - out["mean_cosine"]
        out["min_cosine"] = float(cos.min())
        out["nn_agreement"] = float((nearest_neighbours(emb) == nearest_neighbours(base)).float().mean())
    return out


def evaluate(model, tokenizer, datasets: list[str], baseline=None, causal: bool = True, seq_len: int = 256,
             max_windows: int = 256, max_sentences: int = 200, batch_size: int = 8, device="cpu",
             baseline_cache: dict | None = None, progress=lambda *_: None) -> dict:
    """Metrics per dataset; the baseline's own perplexity too when it is given (for the increase)."""
    results = {}
    for spec in datasets:
        if causal:
            windows = eval_windows(tokenizer, spec, seq_len, max_windows)
            r = causal_metrics(model, windows, tokenizer, baseline, batch_size, device, progress)
            if baseline is not None:
                key = (spec, seq_len, max_windows)
                if baseline_cache is None or key not in baseline_cache:
                    b = causal_metrics(baseline, windows, tokenizer, None, batch_size, device)
                    if baseline_cache is not None:
                        baseline_cache[key] = b
                else:
                    b = baseline_cache[key]
                r["baseline_token_perplexity"] = b["token_perplexity"]
                r["baseline_word_perplexity"] = b["word_perplexity"]
                r["ppl_increase_pct"] = 100.0 * (r["token_perplexity"] / b["token_perplexity"] - 1.0)
        else:
            sentences = eval_sentences(spec, max_sentences)
            r = encoder_metrics(model, tokenizer, sentences, baseline, device)
        results[spec] = r
    return results


def gate(results: dict, max_ppl_increase: float | None = None, max_kl: float | None = None,
         min_top1: float | None = None, min_cosine: float | None = None) -> list[dict]:
    """Threshold checks for CI: one row per (dataset, threshold)."""
    checks = []
    for spec, r in results.items():
        for metric, limit, ok in (
            ("ppl_increase_pct", max_ppl_increase, lambda v, t: v <= t),
            ("kl_divergence", max_kl, lambda v, t: v <= t),
            ("top1_agreement", min_top1, lambda v, t: v >= t),
            ("mean_cosine", min_cosine, lambda v, t: v >= t),
        ):
            if limit is None:
                continue
            if metric not in r:
                raise CompressError(
                    f"threshold on {metric} cannot be checked for {spec}",
                    "KL/top-1/perplexity increase need --baseline on a causal LM; cosine needs --baseline on an encoder",
                )
            value = r[metric]
            checks.append({"dataset": spec, "metric": metric, "value": value, "threshold": limit,
                           "passed": bool(ok(value, limit)) and math.isfinite(value)})
    return checks
