"""Quality measurements, as ../shared/BENCH_PROTOCOL.md defines them.

Causal LMs: token perplexity on non-overlapping windows of a text file (float32), word perplexity
(exp of the same total negative log-likelihood divided by the number of whitespace-separated words
in the scored text, as lm-eval defines it; each window's first token is context, its words left
out), and, against a baseline, the mean KL(p_base || p)
of the next-token distributions and top-1 agreement over all positions.

Encoders: sentence embeddings (attention-mask-weighted mean of the last hidden state,
L2-normalised); mean cosine to the baseline's embeddings and nearest-neighbour agreement.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from compress.calibration import leading_windows, read_texts, token_windows
from compress.errors import CompressError



def _exp(x: float) -> float:
    """exp(x), infinite past float range rather than an OverflowError (NaN stays NaN: a model
    with NaN outputs has no perplexity, not an infinite one)."""
    return math.exp(x) if x < 709.0 or math.isnan(x) else math.inf

def eval_windows(tokenizer, spec: str, seq_len: int = 256, max_windows: int = 256) -> torch.Tensor:
    text = "\n".join(read_texts(spec, tokenizer=tokenizer))
    # Only the prefix the first max_windows windows need is tokenized (the same windows as the
    # whole file's: see calibration.leading_windows); a file shorter than that is tokenized whole.
    windows = leading_windows(tokenizer, text, seq_len, max_windows)
    if windows is not None:
        return windows
    windows = token_windows(tokenizer, text, seq_len)
    if len(windows) == 0:
        raise CompressError(f"evaluation text {spec} is shorter than one {seq_len}-token window", "give a longer file")
    return windows[:max_windows]


def eval_sentences(spec: str, max_sentences: int = 200, min_chars: int = 40, tokenizer=None) -> list[str]:
    lines = [ln.strip() for ln in read_texts(spec, lines=True, tokenizer=tokenizer)]
    sentences = [ln for ln in lines if len(ln) > min_chars][:max_sentences]
    if len(sentences) < 2:
        raise CompressError(f"evaluation text {spec} has fewer than 2 lines longer than {min_chars} characters", "give a file of sentences")
    return sentences


class BaselineStore:
    """What the baseline gives on the evaluation data, saved once: for a causal LM its next-token
    log-probabilities on evaluation windows, for an encoder its sentence embeddings. Log-probabilities are written once as raw
    float32 files (one per set of windows, named by the windows' hash) and read back one batch
    at a time, so that many compressed models can be compared with one baseline without running
    it again. Reading uses plain file reads, not a memory map, so the pages do not count towards
    the reader's resident memory. The values are exactly those the baseline's forward pass gives
    (same batches, same float32 log-softmax), so KL and top-1 do not change."""

    def __init__(self, directory):
        from pathlib import Path

        self.directory = Path(directory)

    def _path(self, windows: torch.Tensor, batch_size: int):
        import hashlib

        digest = hashlib.sha256(windows.numpy().tobytes() + str(batch_size).encode()).hexdigest()[:24]
        return self.directory / f"baseline-logprobs-{digest}.f32"

    def has(self, windows: torch.Tensor, batch_size: int) -> bool:
        return self._path(windows, batch_size).is_file()

    def write(self, baseline, windows: torch.Tensor, batch_size: int, device="cpu", tokenizer=None) -> dict:
        """Save the baseline's log-probabilities on `windows`; returns its own causal_metrics
        (perplexity), from the same forward passes."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(windows, batch_size)
        tmp = path.with_suffix(".part")
        with open(tmp, "wb") as fh:
            metrics = causal_metrics(baseline, windows, tokenizer, None, batch_size, device, save_logprobs=fh)
        tmp.replace(path)
        return metrics

    def batches(self, windows: torch.Tensor, batch_size: int, vocab: int):
        """Yields [batch, seq_len, vocab] float32 tensors in the order causal_metrics asks for them."""
        seq_len = windows.shape[1]
        with open(self._path(windows, batch_size), "rb") as fh:
            for start in range(0, len(windows), batch_size):
                n = min(batch_size, len(windows) - start)
                buf = bytearray(n * seq_len * vocab * 4)
                if fh.readinto(buf) != len(buf):
                    raise CompressError(f"baseline log-probabilities in {self.directory} are truncated", "delete them and rerun")
                yield torch.frombuffer(buf, dtype=torch.float32).reshape(n, seq_len, vocab)

    def _embeddings_path(self, sentences: list[str]):
        import hashlib

        return self.directory / f"baseline-embeddings-{hashlib.sha256(chr(0).join(sentences).encode()).hexdigest()[:24]}.pt"

    def write_embeddings(self, baseline, tokenizer, sentences: list[str], device="cpu") -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        torch.save(sentence_embeddings(baseline, tokenizer, sentences, device=device), self._embeddings_path(sentences))

    def embeddings(self, sentences: list[str]) -> torch.Tensor | None:
        path = self._embeddings_path(sentences)
        return torch.load(path) if path.is_file() else None


@torch.no_grad()
def causal_metrics(model, windows: torch.Tensor, tokenizer=None, baseline=None, batch_size: int = 8,
                   device: torch.device | str = "cpu", progress=lambda *_: None, baseline_logprobs=None,
                   prefix_windows: int | None = None, save_logprobs=None) -> dict:
    """Perplexity of `model` on `windows`; with a baseline model (or its saved log-probabilities,
    an iterator of batches) also KL and top-1 agreement. `prefix_windows`: the same figures over
    only the first N windows too (under "prefix"), from the same forward passes. `save_logprobs`:
    a binary file each batch's float32 log-probabilities are written to."""
    nll, predicted, kl, agree, positions = 0.0, 0, 0.0, 0, 0
    prefix = None
    compare = baseline is not None or baseline_logprobs is not None
    for start in range(0, len(windows), batch_size):
        progress("evaluating", start, len(windows))
        ids = windows[start : start + batch_size].to(device)
        logp = F.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
        if save_logprobs is not None:  # BaselineStore.write: these become every later comparison's baseline
            save_logprobs.write(logp.cpu().contiguous().numpy().tobytes())
        targets = ids[:, 1:]
        nll -= float(logp[:, :-1].gather(-1, targets.unsqueeze(-1)).sum())
        predicted += targets.numel()
        if compare:
            if baseline_logprobs is not None:
                base_logp = next(baseline_logprobs).to(logp.device)
            else:
                base_logp = F.log_softmax(baseline(input_ids=ids).logits.float(), dim=-1)
            # p log(p / q) is 0 where p = 0 (a logit of -inf in the baseline), not 0 · inf = NaN;
            # the difference of logs inside, not p log p - p log q: no cancellation at tiny KL
            terms = base_logp.exp() * (base_logp - logp)
            kl += float(terms.masked_fill(base_logp == -math.inf, 0.0).sum())
            agree += int((base_logp.argmax(-1) == logp.argmax(-1)).sum())
            positions += ids.numel()
        if prefix_windows is not None and start + len(ids) == prefix_windows:
            prefix = {"windows": prefix_windows, "token_perplexity": _exp(nll / predicted)}
            if compare:
                prefix.update(kl_divergence=kl / positions, top1_agreement=agree / positions)
    progress("evaluating", len(windows), len(windows))
    out = {
        "windows": len(windows),
        "tokens_predicted": predicted,
        "token_perplexity": _exp(nll / predicted),
    }
    if tokenizer is not None:
        # the words of the scored text: each window's first token is context, never predicted
        # (counting it made a 2-token window's word perplexity fall below its token perplexity)
        words = sum(len(tokenizer.decode(w[1:].tolist()).split()) for w in windows)
        out["words"] = words
        # text with few spaces (Chinese, say) has few "words": the figure may be past float range
        out["word_perplexity"] = _exp(nll / max(words, 1))
    if compare:
        out["kl_divergence"] = kl / positions
        out["top1_agreement"] = agree / positions
    if prefix is not None:
        out["prefix"] = prefix
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
def encoder_metrics(model, tokenizer, sentences: list[str], baseline=None, device="cpu",
                    baseline_embeddings: torch.Tensor | None = None) -> dict:
    emb = sentence_embeddings(model, tokenizer, sentences, device=device)
    out: dict = {"sentences": len(sentences)}
    if baseline is not None or baseline_embeddings is not None:
        base = baseline_embeddings if baseline_embeddings is not None else sentence_embeddings(baseline, tokenizer, sentences, device=device)
        cos = (emb * base).sum(-1)
        out["mean_cosine"] = float(cos.mean())
        out["embedding_error"] = 1.0 - out["mean_cosine"]
        out["min_cosine"] = float(cos.min())
        out["nn_agreement"] = float((nearest_neighbours(emb) == nearest_neighbours(base)).float().mean())
    return out


def evaluate(model, tokenizer, datasets: list[str], baseline=None, causal: bool = True, seq_len: int = 256,
             max_windows: int = 256, max_sentences: int = 200, batch_size: int = 8, device="cpu",
             baseline_cache: dict | None = None, progress=lambda *_: None,
             baseline_store: "BaselineStore | None" = None, prefix_windows: int | None = None) -> dict:
    """Metrics per dataset; the baseline's own perplexity too when it is given (for the increase).

    `baseline_store`: saved baseline log-probabilities, used instead of running `baseline` on
    windows it holds (the baseline is still needed for its perplexity unless `baseline_cache`
    has it). `prefix_windows`: see causal_metrics."""
    results = {}
    for spec in datasets:
        if causal:
            windows = eval_windows(tokenizer, spec, seq_len, max_windows)
            saved = None
            if baseline_store is not None and baseline_store.has(windows, batch_size):
                vocab = model.get_output_embeddings().weight.shape[0]
                saved = baseline_store.batches(windows, batch_size, vocab)
            r = causal_metrics(model, windows, tokenizer, None if saved is not None else baseline, batch_size, device,
                               progress, baseline_logprobs=saved, prefix_windows=prefix_windows)
            if baseline is not None or saved is not None:
                key = (spec, seq_len, max_windows)
                if baseline_cache is not None and key in baseline_cache:
                    b = baseline_cache[key]
                elif baseline is not None:
                    b = causal_metrics(baseline, windows, tokenizer, None, batch_size, device)
                    if baseline_cache is not None:
                        baseline_cache[key] = b
                else:
                    raise CompressError(f"no baseline perplexity for {spec}", "pass the baseline model or a baseline_cache that holds it")
                r["baseline_token_perplexity"] = b["token_perplexity"]
                r["baseline_word_perplexity"] = b["word_perplexity"]
                r["ppl_increase_pct"] = 100.0 * (r["token_perplexity"] / b["token_perplexity"] - 1.0)
        else:
            sentences = eval_sentences(spec, max_sentences, tokenizer=tokenizer)
            saved = baseline_store.embeddings(sentences) if baseline_store is not None else None
            r = encoder_metrics(model, tokenizer, sentences, baseline, device, baseline_embeddings=saved)
        results[spec] = r
    return results


# Each threshold's valid range (low, high; None: unbounded) and whether it is a minimum, which at
# its metric's lowest value could never fail.
THRESHOLDS = {"max_ppl_increase": (None, None, False), "max_kl": (0, None, False), "min_top1": (0, 1, True),
              "min_cosine": (-1, 1, True), "min_task_score": (0, None, False), "max_task_drop": (None, None, False)}


def threshold_problem(name: str, value) -> str | None:
    """What is wrong with a gate threshold, or None: it must be a finite number (NaN compares
    false with everything and would make the verdict meaningless) within its metric's range."""
    low, high, minimum = THRESHOLDS[name]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's numbers too
        return f"must be a number, not {value!r}"
    if not math.isfinite(value):
        return f"must be a finite number, not {value}"
    if (low is not None and value < low) or (high is not None and value > high):
        return f"{value:g} is outside [{'-inf' if low is None else f'{low:g}'}, {'inf' if high is None else f'{high:g}'}]"
    if minimum and value == low:
        return f"{value:g} can never fail: the metric is never below it"
    return None


def gate(results: dict, max_ppl_increase: float | None = None, max_kl: float | None = None,
         min_top1: float | None = None, min_cosine: float | None = None) -> list[dict]:
    """Threshold checks for CI: one row per (dataset, threshold)."""
    checks = []
    for spec, r in results.items():
        for metric, limit, comparison in (
            ("ppl_increase_pct", max_ppl_increase, "<="),
            ("kl_divergence", max_kl, "<="),
            ("top1_agreement", min_top1, ">="),
            ("mean_cosine", min_cosine, ">="),
        ):
            if limit is None:
                continue
            if metric not in r:
                raise CompressError(
                    f"threshold on {metric} cannot be checked for {spec}",
                    "KL/top-1/perplexity increase need --baseline on a causal LM; cosine needs --baseline on an encoder",
                )
            value = r[metric]
            checks.append(check(spec, metric, value, comparison, limit))
    return checks


def check(dataset: str, metric: str, value: float, comparison: str, threshold: float) -> dict:
    """One threshold check; `comparison` ("<=" or ">=") says which side of the threshold passes,
    so a reader of the JSON or JUnit need not know each metric's direction. NaN never passes."""
    within = value <= threshold if comparison == "<=" else value >= threshold
    return {"dataset": dataset, "metric": metric, "value": value, "comparison": comparison, "threshold": threshold,
            "passed": bool(within) and math.isfinite(value)}


def task_gate(tasks: dict, min_task_score: float | None = None, max_task_drop: float | None = None) -> list[dict]:
    """Threshold checks on lm-eval tasks: each task's primary metric, and how much worse than the
    baseline it scores (compress.tasks.worsening)."""
    checks = []
    for name, r in tasks.items():
        if min_task_score is not None:
            checks.append(check(f"task {name}", r["metric"], r["score"], ">=", min_task_score))
        if max_task_drop is not None:
            if "score_drop" not in r:
                raise CompressError("--max-task-drop compares against the uncompressed model", "pass --baseline")
            checks.append(check(f"task {name}", f"{r['metric']} worse than baseline by", r["score_drop"], "<=", max_task_drop))
    return checks
