"""Round-to-nearest quantization as plain functions on tensors.

Two integer schemes, following the course formulas (shared/seeds/003), generalised from 8 bits to
any width from 2 to 8:

* absmax (symmetric): codes in [-(2^(b-1) - 1), 2^(b-1) - 1], e.g. [-127, 127] for 8 bits.
      q = round(x / step),  step = max|x| / (2^(b-1) - 1),  x_hat = q * step
  (The course writes the multiplier 127 / max|x|; `step` is its inverse, the size of one code.)

* zero-point (asymmetric): codes in [-2^(b-1), 2^(b-1) - 1], e.g. [-128, 127].
      step = (max - min) / (2^b - 1),  zero_point = -round(min / step) - 2^(b-1)
      q = clamp(round(x / step + zero_point)),  x_hat = (q - zero_point) * step

The range always includes 0 (min <= 0 <= max), as every deployed kernel assumes, so that a zero
weight (pruned, padding) stays exactly zero.

Granularity is chosen by how the statistics are reduced: per tensor, per output channel (row of a
weight), per group of `group_size` consecutive input columns, or per token (row of an activation).
A width that `group_size` does not divide gets a shorter last group.

FP8 (e4m3) is supported as a float format: scale so that max|x| maps to 448, cast, cast back.
Nothing here knows about models, hooks or devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_E4M3_MAX = 448.0


def int_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """Smallest and largest integer code for `bits`-bit absmax or zero-point quantization."""
    if not 2 <= bits <= 8:
        raise ValueError(f"integer quantization supports 2 to 8 bits, got {bits}")
    if symmetric:
        return -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


@dataclass
class QParams:
    """Step size and zero point, shaped to broadcast against the grouped tensor."""

    scale: torch.Tensor  # size of one integer step, float32
    zero_point: torch.Tensor  # integer-valued float32 tensor (all zeros for absmax)
    qmin: int
    qmax: int


def absmax_qparams(absmax: torch.Tensor, bits: int) -> QParams:
    """Symmetric parameters from the largest magnitude of each slice."""
    qmin, qmax = int_range(bits, symmetric=True)
    scale = absmax.float() / qmax
    # An all-zero slice would give step 0; any positive step represents it exactly.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return QParams(scale, torch.zeros_like(scale), qmin, qmax)


def zeropoint_qparams(xmin: torch.Tensor, xmax: torch.Tensor, bits: int) -> QParams:
    """Asymmetric parameters from the min and max of each slice (range widened to hold 0)."""
    qmin, qmax = int_range(bits, symmetric=False)
    xmin = torch.clamp(xmin.float(), max=0.0)
    xmax = torch.clamp(xmax.float(), min=0.0)
    scale = (xmax - xmin) / (qmax - qmin)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero_point = -torch.round(xmin / scale) + qmin
    return QParams(scale, zero_point, qmin, qmax)


def quantize(x: torch.Tensor, qp: QParams) -> torch.Tensor:
    """Integer codes (as float32 holding integers) for x."""
    return torch.clamp(torch.round(x.float() / qp.scale + qp.zero_point), qp.qmin, qp.qmax)


def dequantize(q: torch.Tensor, qp: QParams) -> torch.Tensor:
    return (q - qp.zero_point) * qp.scale


def _grouped(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """View a [rows, cols] tensor as [rows, n_groups, group_size], zero-padding a partial last group.

    Zero padding leaves every group's statistics unchanged because the range always includes 0.
    """
    rows, cols = x.shape
    pad = (-cols) % group_size
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(rows, -1, group_size), pad


def compute_qparams(
    x: torch.Tensor, bits: int, symmetric: bool, strategy: str, group_size: int | None = None
) -> QParams:
    """Quantization parameters of a 2-D tensor [rows, cols] at the given granularity.

    strategy: "tensor" (one scale), "channel" (one per row: output channel of a weight),
    "token" (one per row of an activation; same reduction as channel), "group" (one per row and
    block of `group_size` columns). The returned parameters broadcast against the tensor as
    `grouped(x)` lays it out: [rows, n_groups, 1] for groups, [rows, 1] or [1, 1] otherwise.
    """
    x = x.float()
    if strategy == "group":
        if not group_size or group_size <= 0:
            raise ValueError("group quantization needs a positive group_size")
        x, _ = _grouped(x, group_size)
        dims: tuple[int, ...] = (-1,)
    elif strategy in ("channel", "token"):
        dims = (-1,)
    elif strategy == "tensor":
        dims = tuple(range(x.dim()))
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    if symmetric:
        return absmax_qparams(x.abs().amax(dim=dims, keepdim=True), bits)
    return zeropoint_qparams(x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True), bits)


def fake_quantize(
    x: torch.Tensor,
    bits: int,
    symmetric: bool,
    strategy: str,
    group_size: int | None = None,
    qparams: QParams | None = None,
) -> torch.Tensor:
    """Quantize then dequantize a 2-D tensor, returning float32 values on the integer grid.

    `qparams` may be given (static activation ranges from calibration); otherwise they are computed
    from x itself (weights, or dynamic per-token activations).
    """
    if qparams is None:
        qparams = compute_qparams(x, bits, symmetric, strategy, group_size)
    if strategy == "group":
        grouped, pad = _grouped(x.float(), group_size)  # type: ignore[arg-type]
        out = dequantize(quantize(grouped, qparams), qparams).reshape(x.shape[0], -1)
        return out[:, : x.shape[1]] if pad else out
    return dequantize(quantize(x, qparams), qparams)


def fake_quantize_fp8(x: torch.Tensor, strategy: str, absmax: torch.Tensor | None = None) -> torch.Tensor:
    """Round x to float8 e4m3 after scaling its range onto the format's [-448, 448]."""
    if not hasattr(torch, "float8_e4m3fn"):
        raise RuntimeError("this torch build has no float8_e4m3fn dtype; FP8 needs torch >= 2.1")
    x32 = x.float()
    if absmax is None:
        if strategy in ("channel", "token"):
            absmax = x32.abs().amax(dim=-1, keepdim=True)
        elif strategy == "tensor":
            absmax = x32.abs().amax()
        else:
            raise ValueError(f"FP8 supports tensor, channel and token strategies, not {strategy!r}")
    scale = absmax.float() / FP8_E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x32 / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """||reference - approx||_F / ||reference||_F, the per-layer figure in reports."""
    ref = reference.float()
    denom = ref.norm()
    if denom == 0:
        return 0.0 if approx.float().norm() == 0 else float("inf")
    return float((ref - approx.float()).norm() / denom)
