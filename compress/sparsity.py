"""Pruning math as plain functions on tensors: importance scores, masks, and checks.

Every weight here is [out_features, in_features] (a Linear's layout; GPT-2's Conv1D is transposed
by compress.modeling.get_weight before it gets here). A mask is a bool tensor of the same shape,
True where the weight is kept.

Scores:
* magnitude: |W|. Needs no data, and ignores that some input channels carry much larger
  activations than others.
* Wanda (Sun, Liu, Bair, Kolter 2023): |W_ij| · ||X_j||₂, the weight times the norm of its input
  channel over the calibration tokens. It is the size of the weight's contribution to the output,
  so it keeps small weights on channels with large (outlier) activations.

Masks:
* unstructured: the `sparsity` share of the lowest scores is pruned, either within each output
  row (Wanda: every output keeps the same number of inputs) or across the whole layer
  (classic magnitude pruning).
* N:M (semi-structured): in each row, N of every M consecutive input weights are pruned, the
  lowest-scored ones. 2:4 is what sparse tensor cores accelerate. N counts the zeros, as
  SparseGPT and Wanda write it (for 2:4 and 4:8 it is also NVIDIA's "N nonzero of M").

Nothing here knows about models, hooks or devices.
"""

from __future__ import annotations

import re

import torch

_PATTERN = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_pattern(pattern: str) -> tuple[int, int]:
    """'2:4' -> (2, 4): N zeros in every M consecutive input weights; 0 < N < M."""
    match = _PATTERN.match(str(pattern))
    if not match:
        raise ValueError(f"pattern {pattern!r} is not N:M, e.g. 2:4 or 4:8")
    n, m = int(match.group(1)), int(match.group(2))
    if not 0 < n < m:
        raise ValueError(f"pattern {pattern!r}: N zeros out of M needs 0 < N < M, e.g. 2:4 or 4:8")
    return n, m


def magnitude_scores(W: torch.Tensor) -> torch.Tensor:
    """|W|: the smallest weights are the ones pruned."""
    return W.float().abs()


def wanda_scores(W: torch.Tensor, input_norm: torch.Tensor) -> torch.Tensor:
    """|W_ij| · ||X_j||₂; `input_norm` [in_features] is each input channel's L2 norm over tokens."""
    if input_norm.shape != (W.shape[1],):
        raise ValueError(f"input_norm has shape {tuple(input_norm.shape)}, expected ({W.shape[1]},)")
    return W.float().abs() * input_norm.float().to(W.device)[None, :]


def prune_count(sparsity: float, size: int) -> int:
    """How many of `size` weights a `sparsity` share prunes (rounded to nearest)."""
    if not 0 <= sparsity < 1:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    return int(round(sparsity * size))


def lowest_per_row(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Keep-mask pruning exactly the k lowest scores of each row, however many scores tie (a
    threshold would prune every tied weight)."""
    mask = torch.ones_like(scores, dtype=torch.bool)
    if k:
        mask.scatter_(1, torch.topk(scores, k, dim=1, largest=False).indices, False)
    return mask


def unstructured_mask(scores: torch.Tensor, sparsity: float, per_row: bool = True) -> torch.Tensor:
    """Keep-mask pruning the lowest-scored `sparsity` share, per output row or per layer:
    exactly round(sparsity · n) weights of each row (or of the layer)."""
    if per_row:
        return lowest_per_row(scores, prune_count(sparsity, scores.shape[1]))
    return lowest_overall(scores, prune_count(sparsity, scores.numel()))


def lowest_overall(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Keep-mask pruning exactly the k lowest scores of the whole tensor, rows taking what they get."""
    mask = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)  # contiguous, whatever the scores' layout
    if k:
        idx = torch.topk(scores.flatten(), k, largest=False).indices
        mask.view(-1)[idx] = False
    return mask


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep-mask pruning the n lowest-scored of every m consecutive input weights in each row."""
    if not 0 < n < m:
        raise ValueError(f"N:M pruning needs 0 < N < M, got {n}:{m}")
    rows, cols = scores.shape
    if cols % m:
        raise ValueError(f"{cols} input features are not a multiple of M = {m}; the {n}:{m} pattern cannot tile them")
    groups = scores.reshape(rows, cols // m, m)
    idx = torch.topk(groups, n, dim=2, largest=False).indices
    mask = torch.ones_like(groups, dtype=torch.bool)
    mask.scatter_(2, idx, False)
    return mask.reshape(rows, cols)


def sparsity(W: torch.Tensor) -> float:
    """Share of exact zeros."""
    return float((W == 0).sum()) / max(W.numel(), 1)


def check_nm(W: torch.Tensor, n: int, m: int) -> bool:
    """True when every m consecutive input weights of every row hold at least n zeros."""
    rows, cols = W.shape
    if cols % m:
        return False
    return bool(((W.reshape(rows, cols // m, m) == 0).sum(dim=2) >= n).all())


def zeros_are_a_mask(record: dict | None) -> bool | None:
    """What a layer's record (the run's per-layer notes) says of its exact zeros, as pruned_zeros'
    `keep`: True where a pruning stage recorded its sparsity, a stage kept zeros as a mask
    (`sparsity_preserved`) or the input brought them (`input_zeros`, from a model pruned by another
    tool); False where a stage quantized it and nothing says it was pruned (its zeros are codes
    that rounded to zero, about one weight in seven on a 4-bit grid, as free to move as any other);
    None where no stage recorded it (the 10 % rule decides)."""
    record = record or {}
    if record.get("sparsity") or record.get("sparsity_preserved") or record.get("input_zeros"):
        return True
    if record.get("weights"):
        return False
    return None


def pruned_zeros(W: torch.Tensor, keep: bool | None = None, record: dict | None = None) -> torch.Tensor | None:
    """Where W is exactly zero, if those zeros are a pruning mask that later stages must keep:
    always with keep=True, never with False; by default (None) as the layer's `record` says
    (zeros_are_a_mask), and where it says nothing, where at least 10 % of the weights are zero,
    since a dense layer's few exact zeros are not a mask. GPTQ, AutoRound and the training stages
    share this rule."""
    if keep is None:
        keep = zeros_are_a_mask(record)
    zero = W == 0
    if keep is False:
        return None
    if keep is None and float(zero.float().mean()) < 0.1:
        return None
    return zero
