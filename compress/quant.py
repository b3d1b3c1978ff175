"""Round-to-nearest quantization as plain functions on tensors.

Two integer schemes, following the course formulas (shared/seeds/003), generalised from 8 bits to
any width from 2 to 8:

* absmax (symmetric): codes in [-(2^(b-1) - 1), 2^(b-1) - 1], e.g. [-127, 127] for 8 bits.
      q = round(x / step),  step = max|x| / (2^(b-1) - 1),  x_hat = q * step
  (The course writes the multiplier 127 / max|x|; `step` is its inverse, the size of one code.)

* full-range absmax (symmetric, `full_range`): codes in [-2^(b-1), 2^(b-1) - 1], all 2^b of them,
      step = max|x| / (2^(b-1) - 0.5),  q = clamp(round(x / step)),  x_hat = q * step
  The grid compressed-tensors (and so llm-compressor) uses: one level more, a step 2^(b-1) - 0.5
  over 2^(b-1) - 1 finer (14 % at 3 bits), at the price of the positive extreme landing half a
  step short. Worst-case rounding error max|x| / (2^b - 1) against absmax's max|x| / (2^b - 2).

* zero-point (asymmetric): codes in [-2^(b-1), 2^(b-1) - 1], e.g. [-128, 127].
      step = (max - min) / (2^b - 1),  zero_point = -round(min / step) - 2^(b-1)
      q = clamp(round(x / step + zero_point)),  x_hat = (q - zero_point) * step

The range always includes 0 (min <= 0 <= max), as every deployed kernel assumes, so that a zero
weight (pruned, padding) stays exactly zero.

Granularity is chosen by how the statistics are reduced: per tensor, per output channel (row of a
weight), per group of `group_size` consecutive input columns, or per token (row of an activation).
A width that `group_size` does not divide gets a shorter last group.

FP8 (e4m3) is supported as a float format: scale so that max|x| maps to 448, cast, cast back.
MXFP8 (the OCP microscaling format): FP8 in blocks of 32 consecutive columns, each with a
power-of-two (e8m0) step, the smallest at which the block's extreme stays below 448 steps.
MXFP6: the same blocks of FP6 e2m3 (±{0, 0.125, ..., 7.5}: steps of 1/8 below 2, 1/4 below 4, 1/2
up to 7.5), weights only. Both have a section of their own below, after FP4's.

FP4 (e2m1: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}) in blocks, the two formats NVIDIA Blackwell and the
OCP microscaling spec define, each element rounded to the nearest value at its block's step:
* NVFP4: blocks of 16, each with an FP8 e4m3 scale, times one float32 global scale per tensor
      step = e4m3(max|block| · g / 6) / g
* MXFP4: blocks of 32, each with a power-of-two (e8m0) step
See the FP4 section below for how g and the steps are chosen.
Nothing here knows about models, hooks or devices.

Scales are float32 values; inside `scales_stored_as(torch.bfloat16)` (or float16) every weight
scale computed here is rounded up to a value that dtype holds exactly. The pipeline sets it to the
dtype a half-precision model is saved in, because compressed-tensors readers (transformers, vLLM)
hold a layer's scales in the model's dtype: with float32 scales they would compute with slightly
different weights from the ones that were evaluated. Rounding up keeps every value in range.

Degenerate inputs have defined results (tests/test_quant_properties.py): an all-zero slice gets
step 1 (any step holds it exactly); a step is never below the smallest normal float32, so x / step
cannot overflow for subnormal ranges; max - min is formed as max/n - min/n, so ranges near
float32's maximum do not overflow to an infinite step; and NaN or Inf elements are left as they
are while the range is taken over the finite elements, so one bad value neither hides (it stays
visible to the stages' checks, which name the layer) nor spoils the rest of its slice.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

FP8_E4M3_MAX = 448.0
MXFP8_GROUP = 32  # MXFP8's blocks: FP8 in groups of this many columns, power-of-two (e8m0) steps
_TINY = torch.finfo(torch.float32).tiny
_F32_MAX = torch.finfo(torch.float32).max


def _positive_step(scale: torch.Tensor) -> torch.Tensor:
    """Step 1 for an all-zero slice; otherwise at least the smallest normal float32."""
    return torch.where(scale > 0, scale.clamp(min=_TINY), torch.ones_like(scale))


_SCALE_DTYPE: ContextVar[torch.dtype] = ContextVar("scale_dtype", default=torch.float32)


@contextmanager
def scales_stored_as(dtype: torch.dtype):
    """Within: weight scales are values `dtype` represents exactly (no-op for float32)."""
    token = _SCALE_DTYPE.set(dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32)
    try:
        yield
    finally:
        _SCALE_DTYPE.reset(token)


def storable_scale(scale: torch.Tensor) -> torch.Tensor:
    """`scale` rounded up to the nearest value of the current scale dtype (as float32); a scale
    that dtype cannot hold (float16 overflow) stays as it is, and is then stored in float32."""
    dtype = _SCALE_DTYPE.get()
    if dtype == torch.float32:
        return scale
    with torch.no_grad():  # torch before 2.13 has no derivative of nextafter
        rounded = scale.to(dtype)
        rounded = torch.where(rounded.float() < scale, torch.nextafter(rounded, torch.full_like(rounded, float("inf"))), rounded)
        stored = torch.where(torch.isfinite(rounded) & (rounded > 0), rounded.float(), scale)
    # A scale learned by gradient (AutoRound's clipping, QAT) passes through straight; adding the
    # exact zero `scale - scale.detach()` keeps the stored value bit for bit.
    return stored + (scale - scale.detach()) if scale.requires_grad else stored


def _finite_or_zero(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x with NaN/Inf replaced by 0 (which every range holds already), and where they were; None
    when all is finite. The common case costs one sum: a NaN or Inf makes it non-finite, and a
    sum that overflows only sends finite values the long way round."""
    if bool(torch.isfinite(x.sum())):
        return x, None
    finite = torch.isfinite(x)
    if bool(finite.all()):
        return x, None
    return torch.where(finite, x, torch.zeros_like(x)), finite


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

    scale: torch.Tensor  # size of one integer step (a float grid: the value of its 1.0), float32
    zero_point: torch.Tensor  # integer-valued float32 tensor (all zeros for absmax and float grids)
    qmin: float  # smallest code: an integer, or a float element's most negative value
    qmax: float
    # codes are the values of a float element, not integers: 4 E2M1 (FP4), 6 E2M3 (FP6), 8 E4M3
    # (FP8), each rounded to nearest and saturating at the element's largest (float_qparams)
    element: int | None = None

    def per_column(self) -> "QParams":
        """Per-row parameters [rows, 1] (or [1, 1]) flattened to broadcast against one column
        [rows]: what GPTQ and SparseGPT round each column with."""
        return QParams(self.scale.reshape(-1), self.zero_point.reshape(-1), self.qmin, self.qmax, self.element)


def absmax_qparams(absmax: torch.Tensor, bits: int, full_range: bool = False) -> QParams:
    """Symmetric parameters from the largest magnitude of each slice; `full_range` adds code
    -2^(b-1), with ±max|x| half a step inside the grid's reach on both sides."""
    qmin, qmax = int_range(bits, symmetric=not full_range)
    # An all-zero slice would give step 0; any positive step represents it exactly.
    scale = storable_scale(_positive_step(absmax.float() / (qmax + 0.5 if full_range else qmax)))
    return QParams(scale, torch.zeros_like(scale), qmin, qmax)


def zeropoint_qparams(xmin: torch.Tensor, xmax: torch.Tensor, bits: int) -> QParams:
    """Asymmetric parameters from the min and max of each slice (range widened to hold 0)."""
    qmin, qmax = int_range(bits, symmetric=False)
    xmin = torch.clamp(xmin.float(), max=0.0)
    xmax = torch.clamp(xmax.float(), min=0.0)
    # xmax/n - xmin/n: (xmax - xmin) overflows float32 for ranges near its maximum
    scale = storable_scale(_positive_step(xmax / (qmax - qmin) - xmin / (qmax - qmin)))
    zero_point = -torch.round(xmin / scale) + qmin
    return QParams(scale, zero_point, qmin, qmax)


def range_qparams(lo: torch.Tensor, hi: torch.Tensor, args, global_scale=None) -> QParams:
    """The grid of `args` (a QuantArgs: FP4, FP8, MXFP8, MXFP6, absmax or zero-point) for slices
    whose ranges are [lo, hi], e.g. a range shrunk by a clipping search. `global_scale`: NVFP4's."""
    if args.fp4_format:
        return fp4_qparams(torch.maximum(-lo, hi), global_scale)
    if args.type == "float":  # float grids are symmetric
        return float_qparams(torch.maximum(-lo, hi), args.num_bits, power_of_two=args.byte_block_scales)
    if args.symmetric:
        return absmax_qparams(torch.maximum(-lo, hi), args.num_bits, args.full_range)
    return zeropoint_qparams(lo, hi, args.num_bits)


def quantize(x: torch.Tensor, qp: QParams) -> torch.Tensor:
    """Integer codes (as float32 holding integers) for x; a float grid's element values (NaN: 0)."""
    if qp.element:
        return _ROUND_TO_ELEMENT_[qp.element](x.float() / qp.scale).nan_to_num_(nan=0.0)
    return torch.clamp(torch.round(x.float() / qp.scale + qp.zero_point), qp.qmin, qp.qmax)


def dequantize(q: torch.Tensor, qp: QParams) -> torch.Tensor:
    # Saturates at float32's largest value: for ranges near it, the zero point's rounding can put
    # the grid's end half a step beyond, which would read back as Inf.
    if qp.element:  # float codes have no zero point (and GPTQ calls this once per column)
        return (q * qp.scale).clamp_(-_F32_MAX, _F32_MAX)
    return ((q - qp.zero_point) * qp.scale).clamp_(-_F32_MAX, _F32_MAX)


def quantize_dequantize(x: torch.Tensor, qp: QParams, out: torch.Tensor | None = None) -> torch.Tensor:
    """dequantize(quantize(x, qp), qp), bit for bit, written into `out` when given. GPTQ and
    SparseGPT call this once per weight column, thousands of times a layer, where on the CPU each
    tensor operation's fixed cost outweighs its arithmetic: so it takes as few of them as it can."""
    out = torch.div(x.float(), qp.scale, out=out)
    if qp.element:
        out = _ROUND_TO_ELEMENT_[qp.element](out).nan_to_num_(nan=0.0)
    else:
        out = out.add_(qp.zero_point).round_().clamp_(qp.qmin, qp.qmax).sub_(qp.zero_point)
    return out.mul_(qp.scale).clamp_(-_F32_MAX, _F32_MAX)


def _grouped(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """View a [rows, cols] tensor as [rows, n_groups, group_size], zero-padding a partial last group.

    Zero padding leaves every group's statistics unchanged because the range always includes 0.
    """
    rows, cols = x.shape
    pad = (-cols) % group_size
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(rows, (cols + pad) // group_size, group_size), pad  # sizes given: rows may be 0


def compute_qparams(
    x: torch.Tensor, bits: int, symmetric: bool, strategy: str, group_size: int | None = None, full_range: bool = False
) -> QParams:
    """Quantization parameters of a 2-D tensor [rows, cols] at the given granularity.

    strategy: "tensor" (one scale), "channel" (one per row: output channel of a weight),
    "token" (one per row of an activation; same reduction as channel), "group" (one per row and
    block of `group_size` columns). The returned parameters broadcast against the tensor as
    `grouped(x)` lays it out: [rows, n_groups, 1] for groups, [rows, 1] or [1, 1] otherwise.
    """
    x, _ = _finite_or_zero(x.float())
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
        return absmax_qparams(x.abs().amax(dim=dims, keepdim=True), bits, full_range)
    return zeropoint_qparams(x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True), bits)


def fake_quantize(
    x: torch.Tensor,
    bits: int,
    symmetric: bool,
    strategy: str,
    group_size: int | None = None,
    qparams: QParams | None = None,
    full_range: bool = False,
) -> torch.Tensor:
    """Quantize then dequantize a 2-D tensor, returning float32 values on the integer grid.

    `qparams` may be given (static activation ranges from calibration); otherwise they are computed
    from x itself (weights, or dynamic per-token activations).
    """
    original = x
    x, finite = _finite_or_zero(x.float())
    if qparams is None:
        qparams = compute_qparams(x, bits, symmetric, strategy, group_size, full_range)
    if strategy == "group":
        grouped, pad = _grouped(x, group_size)  # type: ignore[arg-type]
        out = quantize_dequantize(grouped, qparams).reshape(x.shape[0], grouped.shape[1] * grouped.shape[2])
        out = out[:, : x.shape[1]] if pad else out
    else:
        out = quantize_dequantize(x, qparams)
    return out if finite is None else torch.where(finite, out, original.float())


def fp8_step(absmax: torch.Tensor, storable: bool = False) -> torch.Tensor:
    """The FP8 (e4m3) scale that maps `absmax` onto 448, the format's largest value; `storable`:
    rounded up to a value of the stage's scale dtype (storable_scale)."""
    scale = _positive_step(absmax.float() / FP8_E4M3_MAX)
    return storable_scale(scale) if storable else scale


def float_qparams(absmax: torch.Tensor, element_bits: int, power_of_two: bool = False) -> QParams:
    """A float weight grid for slices whose largest magnitude is `absmax`, for quantize and
    dequantize, GPTQ's columns and AWQ's clipping search: FP8 e4m3 (`element_bits` 8) at the
    storable step that maps absmax onto 448 (fp8_step), or, with `power_of_two`, an MX block's
    step (mx_steps) for e4m3 (MXFP8) or e2m3 (6: MXFP6). FP4 blocks are fp4_qparams'."""
    if power_of_two:
        largest, limit = _MX_ELEMENTS[element_bits]
        step = mx_steps(absmax, limit)
    elif element_bits == 8:
        largest, step = FP8_E4M3_MAX, fp8_step(absmax, storable=True)
    else:
        raise ValueError(f"float weights with float scales are FP8 (8 bits), not {element_bits} bits")
    return QParams(step, torch.zeros_like(step), -largest, largest, element=element_bits)


def as_tiles(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A 2-D tensor as one row per tile of `rows` x `cols` (row-major over tiles), zero-padded at
    the edges: [ceil(R/rows) * ceil(C/cols), rows * cols]. A tile taller or wider than the tensor
    is cut to it: the same single tile down or across, without padding that holds nothing (a
    [100000, 100000] tile would otherwise pad a small layer to 40 GB)."""
    R, C = x.shape
    rows, cols = min(rows, R), min(cols, C)
    padded = torch.nn.functional.pad(x, (0, (-C) % cols, 0, (-R) % rows))
    tiles = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols).transpose(1, 2)
    return tiles.reshape(-1, rows * cols)


def from_tiles(tiles: torch.Tensor, rows: int, cols: int, shape: torch.Size) -> torch.Tensor:
    """The inverse of as_tiles: a [R, C] tensor of `shape` from its tiles, the padding dropped."""
    R, C = shape
    rows, cols = min(rows, R), min(cols, C)
    n_rows, n_cols = -(-R // rows), -(-C // cols)
    whole = tiles.reshape(n_rows, n_cols, rows, cols).transpose(1, 2).reshape(n_rows * rows, n_cols * cols)
    return whole[:R, :C]


def fake_quantize_fp8(x: torch.Tensor, strategy: str, absmax: torch.Tensor | None = None,
                      storable: bool = False, group_size: int | None = None,
                      block_structure: list[int] | None = None, power_of_two: bool = False) -> torch.Tensor:
    """Round x to float8 e4m3 after scaling its range onto the format's [-448, 448], one scale per
    tensor, row (channel, token), `group_size` columns of a row (group: dynamic activations; with
    `power_of_two`, MXFP8's blocks of 32 and their steps, see mx_steps) or `block_structure` tile
    of a 2-D weight (block). `storable` (weights): the scale rounded up to a value of the stage's
    scale dtype (storable_scale), the one a half-precision checkpoint stores and its readers
    multiply by (a power of two is one already)."""
    if not hasattr(torch, "float8_e4m3fn"):
        raise RuntimeError("this torch build has no float8_e4m3fn dtype; FP8 needs torch >= 2.1")
    if power_of_two:
        if strategy != "group" or group_size != MXFP8_GROUP:
            raise ValueError(f"power-of-two FP8 steps are MXFP8's, in groups of {MXFP8_GROUP}")
        return fake_quantize_mx(x, 8)
    # groups and tiles: each one a row of its own, rounded as a channel is (zero padding leaves
    # every range as it is), then laid out again
    if absmax is None and strategy == "group" and group_size:
        flat = x.reshape(-1, x.shape[-1])
        grouped, _ = _grouped(flat, group_size)
        out = fake_quantize_fp8(grouped, "channel", storable=storable)
        return out.reshape(flat.shape[0], grouped.shape[1] * group_size)[:, : flat.shape[1]].reshape(x.shape)
    if absmax is None and strategy == "block" and block_structure and x.dim() == 2:
        out = fake_quantize_fp8(as_tiles(x, *block_structure), "channel", storable=storable)
        return from_tiles(out, *block_structure, x.shape)
    x32, finite = _finite_or_zero(x.float())
    if absmax is None:
        if strategy in ("channel", "token"):
            absmax = x32.abs().amax(dim=-1, keepdim=True)
        elif strategy == "tensor":
            absmax = x32.abs().amax()
        else:
            raise ValueError(f"FP8 supports tensor, channel, token, group (with group_size) and block (2-D, with "
                             f"block_structure) strategies, not {strategy!r}")
    scale = fp8_step(absmax, storable)
    out = (x32 / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    raw = absmax.float() / FP8_E4M3_MAX
    subnormal = (raw < torch.finfo(torch.float32).tiny) & (raw > 0)  # _positive_step raised those steps
    if bool(subnormal.any()):
        # A range below ~5e-36 puts the step among float32's subnormals (raised to the smallest
        # normal above, which misplaces x / step: 1e-36 came back as 1.03e-36): those slices are
        # computed in float64. Everywhere else float32, the arithmetic packing's exactness check repeats.
        s64 = absmax.double() / FP8_E4M3_MAX
        s64 = torch.where(s64 > 0, s64, torch.ones_like(s64))
        out64 = ((x32.double() / s64).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).double() * s64).float()
        out = torch.where(subnormal, out64, out)
    return out if finite is None else torch.where(finite, out, x.float())


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """||reference - approx||_F / ||reference||_F, the per-layer figure in reports."""
    ref = reference.float()
    denom = ref.norm()
    if denom == 0:
        return 0.0 if approx.float().norm() == 0 else float("inf")
    return float((ref - approx.float()).norm() / denom)


def _one_row_per_group(weight: torch.Tensor, strategy: str, group_size: int | None,
                       block_structure: list[int] | None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A [rows, cols] weight as one row per scale group, and (groups down, groups across, group
    length), the layout its scales take. FP8 tiles are zero-padded at the edges (zeros verify at
    any scale)."""
    rows, cols = weight.shape
    if strategy == "group":
        if not group_size or cols % group_size:
            raise ValueError(f"{cols} columns are not a whole number of groups of {group_size}")
        shape = (rows, cols // group_size, group_size)
    elif strategy == "channel":
        shape = (rows, 1, cols)
    elif strategy == "tensor":
        shape = (1, 1, rows * cols)
    elif strategy == "block" and block_structure:
        br, bc = block_structure
        tiles = as_tiles(weight, br, bc)
        return tiles, (-(-rows // br), -(-cols // bc), tiles.shape[1])
    else:
        raise ValueError(f"weights cannot be packed with strategy {strategy!r}")
    return weight.reshape(-1, shape[-1]), shape


# e4m3's positive values, largest first (codes 0x01 to 0x7E; 0x7F is NaN)
_E4M3_VALUES_DOWN = torch.arange(126, 0, -1, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()


def recover_qparams(weight: torch.Tensor, bits: int, symmetric: bool, strategy: str, group_size: int | None = None,
                    float8: bool = False, block_structure: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Scales (and zero points) that reproduce an already-quantized weight bit for bit.

    Why recovered rather than recorded: stages leave each weight as dequantized values
    w = cast((q - z) · s) in the model's dtype and do not hand their scales on (GPTQ's group
    scales come from error-compensated columns, AWQ's from clipped ranges, so they cannot be
    recomputed from the original weights). Recovering them needs no cooperation from any stage,
    present or future, and is not an estimate: every group is *verified*, its codes (computed as
    compressed-tensors computes them, clamp(round(w / s + z))) times the float32 scale, cast to
    the weight's dtype, must give back every element exactly, and a group that does not is
    reported (the caller then refuses to pack, or writes dense). The recovered scale need not be
    the stage's own (a group that never reaches its extreme codes may be stored at a finer step);
    the dequantized values are the same, which is what a checkpoint must carry.

    How, for one group: a first scale s0 = extent / top, where top is the code of the group's
    extreme (the grid's end first, as round-to-nearest and AWQ leave it; then every smaller one,
    for GPTQ). Each element bounds s: c · s must round to w, so s lies in [lo(w) / c, hi(w) / c],
    [lo, hi] being the reals that round to w in its dtype. The bounds from the small codes (which
    a slightly wrong s0 cannot round to the wrong integer) give an interval; then each element
    allows the scales at which either code it takes across the interval (round(w / s) is monotone
    in s) rounds back to it, which narrows the interval until it holds the true scale. Its
    midpoint, its ends (a product that ties between two values rounds to the even one) and their
    float32 neighbours are tried. The zero point is the lowest (or highest) code's offset.

    weight: [rows, cols] in its own dtype. Returns (scale [rows, n_groups] float32, zero_point
    [rows, n_groups] int8 or None when symmetric, number of groups that failed to verify); for
    FP8 tiles (strategy block) a group is a tile, and the scales are [row tiles, column tiles].
    """
    if strategy == "block" and not float8:  # tiles are FP8's
        raise ValueError(f"weights cannot be packed with strategy {strategy!r}")
    w, shape = _one_row_per_group(weight.detach(), strategy, group_size, block_structure)
    if float8:
        # the extreme's e4m3 value: 448 first, as round-to-nearest leaves it, then every smaller
        # one (GPTQ's scales come from the weight before its updates, which may move the extreme)
        qmin, qmax, top = -FP8_E4M3_MAX, FP8_E4M3_MAX, _E4M3_VALUES_DOWN
    else:
        qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1  # the format's range (absmax uses one code less)
        # the code of the group's extreme (or its code span, asymmetric): the grid's ends first, as
        # round-to-nearest and AWQ leave them (absmax's qmax; the full range's -2^(b-1)), then every
        # smaller one (GPTQ may stop short of the end)
        top = [qmax, qmax + 1, *range(qmax - 1, 0, -1)] if symmetric else list(range(2**bits - 1, 0, -1))
    ends = 2 if symmetric and not float8 else 1
    scale, zp, ok = _quick_groups(w, top[:ends], qmin, qmax, symmetric, float8)
    for steps in (1, 2, 3) if not float8 else ():  # the smallest nonzero weight as 1, 2 or 3 steps
        if bool(ok.all()):
            break
        bad = (~ok).squeeze(-1).nonzero().squeeze(-1)
        codes = (_extreme_codes(w[bad], symmetric) * steps).clamp_(max=qmax - qmin + 1)
        s_b, z_b, ok_b = _solve_groups(w[bad], codes, 1, qmin, qmax, symmetric, float8)
        scale[bad], zp[bad], ok[bad] = s_b, z_b, ok_b
    if not bool(ok.all()):
        bad = (~ok).squeeze(-1).nonzero().squeeze(-1)
        s_b, z_b, ok_b = _search_groups(w[bad], top, ends, len(w), qmin, qmax, symmetric, float8)
        scale[bad], zp[bad], ok[bad] = s_b, z_b, ok_b
    failed = int((~ok).sum())
    scale = scale.reshape(shape[0], shape[1])
    zero_point = None if symmetric or float8 else zp.reshape(shape[0], shape[1]).to(torch.int8)
    if strategy == "tensor":
        scale = scale.reshape(1)
        zero_point = None if zero_point is None else zero_point.reshape(1)
    return scale, zero_point, failed


def _extreme_codes(w: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """Each group's extreme as a code, read off the group itself: its extent (_group_extent) over
    its smallest nonzero magnitude, which on a grid is |q - z| · s >= s and, in a group of more
    than a few weights, usually one step. A learned scale (QAT, AutoRound) or GPTQ can leave the
    extreme anywhere short of the grid's end; this names its code at once, where the search goes
    through every code from the end down. [n, 1] float32, at least 1."""
    x = w.float()
    magnitude = x.abs()
    unit = torch.where(magnitude > 0, magnitude, torch.full_like(x, float("inf"))).amin(-1, keepdim=True)
    return torch.round(_group_extent(x, symmetric) / unit).nan_to_num_(nan=1.0, posinf=1.0).clamp_(min=1)


def _group_extent(x: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """What a group's extreme code times its scale spans: max |x| (symmetric), or the range that
    includes 0 (asymmetric: the code span times the scale). [n, 1] for groups x [n, group]."""
    if symmetric:
        return x.abs().amax(-1, keepdim=True)
    return x.amax(-1, keepdim=True).clamp(min=0) - x.amin(-1, keepdim=True).clamp(max=0)


def _search_groups(w: torch.Tensor, top: list[float], ends: int, total: int, qmin: float, qmax: float, symmetric: bool,
                   float8: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The interval search (_solve_groups) over every extreme code and starting scale, each
    attempt only on the groups not yet verified. It gives up early when, after the grid's ends,
    most of the weight's `total` groups are unverified and a sample of them is off every grid
    too (not a quantized weight, or not this scheme): a search over every code is then wasted."""
    scale = zp = ok = None
    # A weight of a few groups (a [1, 64] gate, per channel: one group) is always searched in
    # full: one group off the grid's ends is then no sign that the weight is off every grid.
    too_many = 0.5 * total if total > 8 else float("inf")
    for i, t in enumerate(top):
        for start in range(_STARTS):
            if ok is None:
                scale, zp, ok = _solve_groups(w, t, start, qmin, qmax, symmetric, float8)
                if int((~ok).sum()) > too_many:
                    break
                continue
            if bool(ok.all()):
                break
            bad = (~ok).squeeze(-1).nonzero().squeeze(-1)
            s_b, z_b, ok_b = _solve_groups(w[bad], t, start, qmin, qmax, symmetric, float8)
            scale[bad], zp[bad], ok[bad] = s_b, z_b, ok_b
        if bool(ok.all()):
            break
        if i == ends - 1 and int((~ok).sum()) > too_many:
            # Most groups miss the grid's ends. Learned scales (QAT, AutoRound) can leave every
            # group's extreme short of them, so a few of those groups are searched in full first,
            # where each holds no more distinct values than the grid has codes, as one on a grid does.
            sample = (~ok).squeeze(-1).nonzero().squeeze(-1)[:_SAMPLE]
            few_values = all(len(torch.unique(group)) <= qmax - qmin + 1 for group in w[sample])
            if not few_values or not bool(_search_groups(w[sample], top[ends:], 0, len(sample), qmin, qmax, symmetric,
                                                         float8)[2].any()):
                break
    return scale, zp, ok


_SAMPLE = 8  # groups searched in full before a weight whose groups mostly miss the grid's ends is given up


_STARTS = 6  # starting scales per extreme code: least squares, then s0 and four nudges of it


def _verify(w: torch.Tensor, x: torch.Tensor, s: torch.Tensor, qmin: float, qmax: float, symmetric: bool,
            float8: bool, zero_point: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Do the codes the format would store for groups w [n, group] (x: w in float32) at scales
    s [n, 1] (as compressed-tensors computes them: clamp(round(w / s + z))) give w back exactly?
    ([n, 1] verified, and the zero point used: `zero_point` [n, 1] when given, else the one that
    puts the group's lowest or highest code at the grid's end.)"""
    if float8:
        return (((x / s).clamp(qmin, qmax).to(torch.float8_e4m3fn).float() * s).to(w.dtype) == w).all(-1, keepdim=True), \
            torch.zeros_like(s)
    if zero_point is not None:
        options = [zero_point]
    elif symmetric:
        options = [torch.zeros_like(s)]
    else:  # the lowest code at the group's minimum, or the highest at its maximum
        m = torch.round(x / s)
        options = [qmin - m.amin(-1, keepdim=True).clamp(max=0), qmax - m.amax(-1, keepdim=True).clamp(min=0)]
    ok, chosen = None, None
    for zp in options:
        zp = zp.clamp(qmin, qmax)
        q = torch.round(x / s + zp).clamp(qmin, qmax)
        good = (((q - zp) * s).to(w.dtype) == w).all(-1, keepdim=True)
        chosen = zp if chosen is None else torch.where(ok, chosen, zp)
        ok = good if ok is None else ok | good
    return ok, chosen


def _quick_groups(w: torch.Tensor, tops: list[float], qmin: float, qmax: float, symmetric: bool,
                  float8: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The common case first, cheaply: a group whose extreme sits at a grid end (round-to-nearest,
    AWQ, most GPTQ groups) has extent / top within a rounding or two of its scale (or, for a
    scale of the weight's half dtype, that value rounded to it). Only the groups none of these
    verify go to the interval search. (scale, zero point, verified), each [n, 1]."""
    x = w.float()
    extent = _group_extent(x, symmetric or float8)
    scale = zp = ok = None
    for top in tops:
        s0 = extent / top
        s0 = torch.where(s0 > 0, s0, torch.ones_like(s0))
        up, down = torch.full_like(s0, float("inf")), torch.full_like(s0, -float("inf"))
        cands = [s0, torch.nextafter(s0, up), torch.nextafter(s0, down)]
        if w.dtype in (torch.bfloat16, torch.float16):  # FP8's scales too (fp8_step's storable rounding)
            near = s0.to(w.dtype)
            cands += [near.float(), torch.nextafter(near, up.to(w.dtype)).float(), torch.nextafter(near, down.to(w.dtype)).float()]
        for cand in cands:
            todo = None if ok is None else (~ok).squeeze(-1).nonzero().squeeze(-1)
            if todo is None:
                ok, zp = _verify(w, x, cand, qmin, qmax, symmetric, float8)
                scale = cand.clone()
            elif len(todo):
                good, zp_t = _verify(w[todo], x[todo], cand[todo], qmin, qmax, symmetric, float8)
                scale[todo] = torch.where(good, cand[todo], scale[todo])
                zp[todo] = torch.where(good, zp_t, zp[todo])
                ok[todo] = good
            if bool(ok.all()):
                return scale, zp, ok
    return scale, zp, ok


def _solve_groups(w: torch.Tensor, top: float, start: int, qmin: float, qmax: float, symmetric: bool,
                  float8: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """recover_qparams on groups [n, group] with the group's extreme at code `top`, from starting
    scale number `start`: (scale [n, 1], zero point [n, 1], verified [n, 1])."""
    x = w.float()
    inf = torch.full_like(w, float("inf"))
    x64 = x.double()
    lo = (x64 + torch.nextafter(w, -inf).double()) / 2  # the reals that round to w in its dtype
    hi = (x64 + torch.nextafter(w, inf).double()) / 2
    extent = _group_extent(x, symmetric or float8)

    def codes(s: torch.Tensor) -> torch.Tensor:
        if float8:
            return (x / s).clamp(qmin, qmax).to(torch.float8_e4m3fn).float()
        return torch.round(x / s)

    def allowed(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per element, the scales for which its code c times the scale rounds back to it
        (everything for a zero weight at code 0, nothing for a nonzero one)."""
        c = c.double()
        a, b = lo / c, hi / c
        a, b = torch.where(c < 0, b, a), torch.where(c < 0, a, b)
        zero = c == 0
        a = torch.where(zero, torch.where(x64 == 0, -float("inf"), float("inf")), a)
        b = torch.where(zero, torch.where(x64 == 0, float("inf"), -float("inf")), b)
        return a, b

    def refine(scale: torch.Tensor, small: float | None) -> torch.Tensor:
        """Narrow an interval of scales: first from the small codes, which a scale a little off
        cannot round to the wrong integer; then each element allows the scales at which one of
        the codes it takes across the interval (round(w / s) is monotone in s) rounds back to it."""
        c = codes(scale)
        use = c != 0
        if small is not None:
            few = use & (c.abs() <= small)
            use = torch.where(few.any(-1, keepdim=True), few, use)
        a, b = allowed(c)
        s_lo = torch.where(use, a, torch.full_like(a, -float("inf"))).amax(-1, keepdim=True)
        s_hi = torch.where(use, b, torch.full_like(b, float("inf"))).amin(-1, keepdim=True)
        for _ in range(4):
            valid = torch.isfinite(s_lo) & torch.isfinite(s_hi) & (s_lo <= s_hi)
            before = (s_lo, s_hi)
            ends = [codes(torch.where(valid, end, scale.double()).float()) for end in (s_hi, s_lo)]
            spans = []
            for code in ends:
                a, b = allowed(code)
                a, b = torch.maximum(a, s_lo), torch.minimum(b, s_hi)
                spans.append((a, b, a < b))  # a single point is a tie in rounding: not a solution
            (a1, b1, e1), (a2, b2, e2) = spans
            a = torch.where(e1 & e2, torch.minimum(a1, a2), torch.where(e1, a1, torch.where(e2, a2, s_lo.expand_as(a1))))
            b = torch.where(e1 & e2, torch.maximum(b1, b2), torch.where(e1, b1, torch.where(e2, b2, s_hi.expand_as(b1))))
            s_lo = torch.where(valid, a.amax(-1, keepdim=True), s_lo)
            s_hi = torch.where(valid, b.amin(-1, keepdim=True), s_hi)
            if torch.equal(before[0], s_lo) and torch.equal(before[1], s_hi):
                break  # no interval narrowed: every code is settled
        valid = torch.isfinite(s_lo) & torch.isfinite(s_hi) & (s_lo <= s_hi)
        # the midpoint, and the ends: a product that ties between two values of the weight's
        # dtype rounds to the even one, so the only solution may lie on an end
        return [torch.where(valid, v, scale.double()).float() for v in ((s_lo + s_hi) / 2, s_lo, s_hi)]

    def check(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _verify(w, x, s, qmin, qmax, symmetric, float8)

    scale = ok = zp = None
    s0 = extent / top
    s0 = torch.where(s0 > 0, s0, torch.ones_like(s0))  # an all-zero group: any scale
    # starting points: least squares over the group, then s0 and nudges of it (the rounding of
    # the range itself can put one code off, for 8-bit codes in bfloat16)
    if start == 0:
        c = codes(s0)
        norm = (c * c).sum(-1, keepdim=True)
        start_scale = torch.where(norm > 0, (x * c).sum(-1, keepdim=True) / norm.clamp(min=1), s0)
    else:
        start_scale = s0 * (1 + (0.0, 2**-9, -(2**-9), 2**-8, -(2**-8))[start - 1])
    trials = []
    for cand in refine(start_scale, None if float8 else torch.clamp(torch.as_tensor(top, dtype=torch.float32) / 4, min=2.0)):
        # and the float32 neighbours, for a value that rounded out of its interval
        up, down = torch.full_like(cand, float("inf")), torch.full_like(cand, -float("inf"))
        trials += [cand, torch.nextafter(cand, up), torch.nextafter(cand, down)]
    if w.dtype in (torch.bfloat16, torch.float16) and not float8:
        # a stage under scales_stored_as(dtype) used a scale of the weight's own dtype, within one
        # of its steps of s0: try those too (their 8-bit products round coarsely, so the
        # intervals above can miss them)
        near = start_scale.to(w.dtype)
        trials += [torch.nextafter(near, torch.full_like(near, d)).float() for d in (float("inf"), -float("inf"))] + [near.float()]
    for trial in trials:
        good, zp_t = check(trial)
        if scale is None:
            scale, ok, zp = trial, good, zp_t
        else:
            fix = good & ~ok
            scale, zp, ok = torch.where(fix, trial, scale), torch.where(fix, zp_t, zp), ok | good
        if bool(ok.all()):
            break
    return scale, zp, ok


def scales_as(weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, bits: int, strategy: str,
              group_size: int | None, dtype: torch.dtype, float8: bool = False,
              block_structure: list[int] | None = None) -> torch.Tensor | None:
    """recover_qparams' float32 scales as values of `dtype` that give back `weight` just as
    exactly, or None when some group has none (its scale is then kept in float32).

    A stage that ran under `scales_stored_as(dtype)` used such a scale, and it lies in the interval
    every recovered scale comes from, within one step of `dtype` of the recovered one: the nearest
    value and its two neighbours are tried, each group verified as recover_qparams verifies."""
    w, _ = _one_row_per_group(weight.detach(), strategy, group_size, block_structure)
    x = w.float()
    z = torch.zeros(w.shape[0], 1) if zero_point is None else zero_point.reshape(-1, 1).float()
    qmin, qmax = (-FP8_E4M3_MAX, FP8_E4M3_MAX) if float8 else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    nearest = scale.reshape(-1, 1).to(dtype)
    chosen = ok = None
    for cand in (nearest, torch.nextafter(nearest, torch.full_like(nearest, float("inf"))),
                 torch.nextafter(nearest, torch.full_like(nearest, -float("inf")))):
        s = cand.float()
        good = _verify(w, x, s, qmin, qmax, symmetric=zero_point is None, float8=float8, zero_point=z)[0]
        good = good & torch.isfinite(s) & (s > 0)
        chosen = cand if chosen is None else torch.where(ok, chosen, cand)
        ok = good if ok is None else ok | good
        if bool(ok.all()):
            return chosen.reshape(scale.shape)
    return None


# --- FP4 (E2M1) with block scales: NVFP4 and MXFP4 -----------------------------------------------

FP4_E2M1_MAX = 6.0
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_GROUP, MXFP4_GROUP = 16, 32
_E4M3_SMALLEST = 2.0**-9  # e4m3's smallest subnormal


def round_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """Each element to the nearest E2M1 value, saturating at ±6, keeping x's sign; NaN gives 0;
    float32 out. No gradient: rounding has none."""
    return _round_to_fp4_(x.detach().to(torch.float32, copy=True)).nan_to_num_(nan=0.0)


@functools.lru_cache(maxsize=None)
def _fp4_bit_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_round_to_fp4_`'s int32 constants as 0-dim tensors on `device`: a Python number in a tensor
    operation is wrapped into a new tensor on every call, a few µs on the CPU, and GPTQ rounds a
    layer one column at a time."""
    def const(bits: int) -> torch.Tensor:
        return torch.tensor(bits, dtype=torch.int32, device=device)
    return const(0x7F800000), const(0x00800000), const(0x3F000000)  # exponent field, one binade, 0.5


def _round_to_fp4_(a: torch.Tensor) -> torch.Tensor:
    """a (float32) rounded in place to the nearest E2M1 value, saturating at ±6; NaN stays NaN.

    E2M1's magnitudes are a fixed-point grid per binade (step 0.5 below 2, 1 below 4, 2 up to 6), so
    rounding a/step to an integer rounds to the nearest value, and torch.round's half-to-even is
    exactly the round-half-to-even of the format (a tie goes to the value whose mantissa bit is 0:
    0.25 → 0, 0.75 → 1, 5 → 4), on either sign. The step is half of 2^floor(log2|a|), and at least
    0.5, read off a's bits: the exponent field alone (sign and mantissa cleared) is that power of
    two, one less in the field halves it, and a clamp on the bits gives the floor (zero, subnormals
    and |a| < 1 get 0.5). Dividing and multiplying by a power of two is exact. GPTQ rounds column by
    column and W4A4 rounds every activation, so this runs often: one new buffer, the rest in place
    (on the CPU every fresh buffer costs page faults)."""
    exponent_field, one_binade, half = _fp4_bit_constants(a.device)
    a.clamp_(-FP4_E2M1_MAX, FP4_E2M1_MAX)
    step = torch.bitwise_and(a.view(torch.int32), exponent_field)
    step = step.sub_(one_binade).clamp_(min=half).view(torch.float32)
    return a.div_(step).round_().mul_(step)


def nvfp4_global_scale(absmax: torch.Tensor | float) -> float:
    """The per-tensor NVFP4 scale g: a power of two, the largest at which max|W| · g / 6 still fits
    e4m3's 448, so the block scales use e4m3's top binades. (compressed-tensors' observers take
    g = 448 · 6 / max|W| itself.) A power of two changes no block's precision, since e4m3 is
    equally fine in every normal binade, and makes every step s / g, and every weight code · s / g,
    exact in float32 and bfloat16: what a model computes with is exactly what the checkpoint
    stores, and packing can recover the block scales from the weights alone."""
    m = float(absmax)
    if not m > 0 or not torch.isfinite(torch.tensor(m)):
        return 1.0
    _, exponent = torch.frexp(torch.tensor(FP8_E4M3_MAX * FP4_E2M1_MAX / m, dtype=torch.float64))
    # floor(log2(448 · 6 / m)) (frexp's mantissa is in [0.5, 1)), capped where float32 ends: a range
    # below ~1e-35 would otherwise give an infinite g
    return float(2.0 ** min(int(exponent) - 1, 126))


def fp4_steps(block_absmax: torch.Tensor, global_scale, underflow_to_zero: bool = False) -> torch.Tensor:
    """Each block's step (the value of E2M1's 1.0) from its largest magnitude.

    NVFP4 (`global_scale` g given): the e4m3 value nearest max|block| · g / 6, over g: the block's
    extreme lands on ±6 (a scale that rounded down saturates it by at most 1/16). A block whose
    scale underflows e4m3 (max|block| · g / 6 < 2^-10: all zero, or tiny beside the tensor's
    largest) gets e4m3's smallest value, 2^-9, which stores its values as well as any; with
    `underflow_to_zero` (activations) it gets 0.125 instead, which rounds it to zero, as
    compressed-tensors' quantized forward does, so the simulated inputs are the ones it computes.
    MXFP4 (None): mx_steps with 7 steps as the limit, so saturation costs it less than one step,
    the error it would have at the next power up, while every other element keeps the finer grid
    (compressed-tensors' rule; the OCP spec's 2^(floor(log2 max) - 2) saturates by up to two
    steps). An all-zero block gets step 1."""
    m = block_absmax.float()
    if global_scale is not None:
        s8 = (m * global_scale / FP4_E2M1_MAX).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
        return torch.where(s8 > 0, s8, torch.full_like(s8, 0.125 if underflow_to_zero else _E4M3_SMALLEST)) / global_scale
    return mx_steps(m, 7.0)


def mx_steps(block_absmax: torch.Tensor, limit: float) -> torch.Tensor:
    """A microscaling block's step: the smallest power of two at which the block's largest
    magnitude stays strictly below `limit` steps (7 for FP4 e2m1, whose largest value is 6; 448
    for FP8 e4m3, its largest value; 7.75 for FP6 e2m3, whose largest is 7.5). That is
    compressed-tensors' rule: the block's maximum rounded to a power of two (up from 1.75 times
    one, at e2m3's mantissa from 1.9375), over 2^floor(log2 of the element's largest value).
    Steps stay within e8m0's 2^-127 .. 2^127; an all-zero block gets 1."""
    m = block_absmax.float()
    _, exponent = torch.frexp(m / limit)  # m / limit = mantissa · 2^exponent, mantissa in [0.5, 1): 2^exponent > m / limit
    exponent = exponent.clamp(-127, 127).float()
    return torch.where(m > 0, torch.exp2(exponent), torch.ones_like(m))


def nvfp4_input_global_scale(absmax: float) -> float:
    """NVFP4 activations' global scale from the calibrated range: 448 · 6 / max|x|, as
    compressed-tensors stores `input_global_scale` and vLLM computes with it. (Unlike the weights'
    scale it needs no power of two: no activation is stored or recovered.)"""
    return FP8_E4M3_MAX * FP4_E2M1_MAX / absmax if absmax > 0 else 1.0


def fp4_qparams(block_absmax: torch.Tensor, global_scale, underflow_to_zero: bool = False) -> QParams:
    """Steps (shaped as `block_absmax`) as QParams on the FP4 grid, for quantize/dequantize."""
    step = fp4_steps(block_absmax, global_scale, underflow_to_zero)
    return QParams(step, torch.zeros_like(step), -FP4_E2M1_MAX, FP4_E2M1_MAX, element=4)


def fake_quantize_fp4(x: torch.Tensor, group_size: int, global_scale: float | None = None,
                      activations: bool = False) -> torch.Tensor:
    """x [rows, cols] rounded to FP4 in blocks of `group_size` consecutive columns (NVFP4 with a
    `global_scale`, MXFP4 without); float32 out. NaN/Inf elements stay as they are. `activations`:
    NVFP4 blocks whose scale underflows become zero (fp4_steps). No gradient: it rounds in place."""
    x = original = x.detach()
    x, finite = _finite_or_zero(x.float())
    grouped, pad = _grouped(x, group_size)
    step = fp4_steps(grouped.abs().amax(-1, keepdim=True), global_scale, underflow_to_zero=activations)
    out = _round_to_fp4_(grouped / step).mul_(step).clamp_(-_F32_MAX, _F32_MAX).reshape(x.shape[0], grouped.shape[1] * group_size)
    out = out[:, : x.shape[1]] if pad else out
    return out if finite is None else torch.where(finite, out, original.float())


def _blocks(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A quantized weight [rows, cols] as one row per block of `group_size` columns: as stored,
    in float32, and each block's largest magnitude [blocks, 1] (what block-step recovery starts from)."""
    cols = weight.shape[1]
    if cols % group_size:
        raise ValueError(f"{cols} columns are not a whole number of groups of {group_size}")
    w = weight.detach().reshape(-1, group_size)
    x = w.float()
    return w, x, x.abs().amax(-1, keepdim=True)


def recover_fp4_steps(weight: torch.Tensor, group_size: int, global_scale: float | None) -> tuple[torch.Tensor, int]:
    """Block steps that reproduce an FP4-quantized weight bit for bit (recover_qparams' job for
    the float grids): a block's largest magnitude is code · step for one of E2M1's seven nonzero
    values, so step = max / code exactly for the right one; each candidate is verified over the
    whole block, and must be storable (step · g an e4m3 value, or a power of two for MXFP4).
    Returns (steps [rows, cols / group_size] float32, number of blocks that failed)."""
    rows, cols = weight.shape
    w, x, top = _blocks(weight, group_size)
    steps = torch.ones_like(top) if global_scale is None else torch.full_like(top, 1.0 / global_scale)
    ok = top == 0
    for code in reversed(FP4_E2M1_VALUES[1:]):
        cand = top / code
        if global_scale is None:
            mantissa, _ = torch.frexp(cand)
            storable = (mantissa == 0.5) & (cand >= 2.0**-127) & (cand <= 2.0**127)
        else:
            s8 = cand * global_scale
            storable = (s8 <= FP8_E4M3_MAX) & (s8.to(torch.float8_e4m3fn).float() == s8)
        exact = ((round_to_fp4(x / cand) * cand).to(w.dtype) == w).all(-1, keepdim=True)
        good = storable & exact & ~ok
        steps = torch.where(good, cand, steps)
        ok = ok | good
    return steps.reshape(rows, cols // group_size), int((~ok).sum())


# --- MX formats with 6- and 8-bit elements: MXFP6 and MXFP8 ------------------------------------
# Blocks of 32 consecutive columns (along each token for inputs), each with a power-of-two step
# (mx_steps) stored as an e8m0 exponent; the elements FP8 e4m3 (MXFP8) or FP6 e2m3 (MXFP6, weights
# only). MXFP4, the same blocks of e2m1, is the FP4 section's.

FP6_E2M3_MAX = 7.5
MXFP6_LIMIT = 7.75  # the block maximum rounded to a power of two at e2m3's 3 mantissa bits: up from 1.9375 times one


def round_to_fp6(x: torch.Tensor) -> torch.Tensor:
    """Each element to the nearest FP6 e2m3 value, ties to even, saturating at ±7.5, keeping x's
    sign; NaN gives 0; float32 out."""
    return _round_to_fp6_(x.detach().to(torch.float32, copy=True)).nan_to_num_(nan=0.0)


def _round_to_fp6_(a: torch.Tensor) -> torch.Tensor:
    """a (float32) rounded in place to FP6 e2m3; NaN stays NaN. As E2M1 (_round_to_fp4_), a
    fixed-point grid per binade: the step is 2^(floor(log2|a|) - 3), at least 1/8."""
    a.clamp_(-FP6_E2M3_MAX, FP6_E2M3_MAX)
    exponent_field, three_binades, eighth = _fp6_bit_constants(a.device)
    step = torch.bitwise_and(a.view(torch.int32), exponent_field)
    step = step.sub_(three_binades).clamp_(min=eighth).view(torch.float32)
    return a.div_(step).round_().mul_(step)


@functools.lru_cache(maxsize=None)
def _fp6_bit_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """round_to_fp6's int32 constants on `device` (see _fp4_bit_constants)."""
    def const(bits: int) -> torch.Tensor:
        return torch.tensor(bits, dtype=torch.int32, device=device)
    return const(0x7F800000), const(3 << 23), const(0x3E000000)  # exponent field, three binades, 1/8


def _round_to_e4m3_(a: torch.Tensor) -> torch.Tensor:
    """a (float32) rounded in place to FP8 e4m3, saturating at ±448; NaN stays NaN."""
    return a.copy_(a.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn))


# element bits -> its rounding in place (float32, saturating, NaN kept): what QParams.element
# names, and what the MX formats round their blocks with
_ROUND_TO_ELEMENT_ = {4: _round_to_fp4_, 6: _round_to_fp6_, 8: _round_to_e4m3_}

# MX element bits -> (largest element, mx_steps' limit). The limit is compressed-tensors' rule:
# e4m3's extreme stays below 448 steps (so none saturates); e2m3's below 7.75, so an extreme
# between 7.5 and 7.75 steps saturates to 7.5, by less than half a step.
_MX_ELEMENTS = {8: (FP8_E4M3_MAX, FP8_E4M3_MAX), 6: (FP6_E2M3_MAX, MXFP6_LIMIT)}

# element bits -> (mantissa bits, spacing of the subnormals, largest value) of E2M1, E2M3, E4M3
ELEMENT_GRIDS = {4: (1, 0.5, FP4_E2M1_MAX), 6: (3, 0.125, FP6_E2M3_MAX), 8: (3, 2.0**-9, FP8_E4M3_MAX)}


def element_spacing(magnitude: torch.Tensor, element: int) -> torch.Tensor:
    """For magnitudes (float32, from 0 to the element's largest value): the spacing of the float
    element's values (`element` bits: 4 E2M1, 6 E2M3, 8 E4M3) around each, from the value at or
    below it to the next one up. The element is a fixed-point grid per binade: the spacing in
    [2^e, 2^(e+1)) is 2^(e - mantissa bits), and below the smallest normal value the subnormals'
    (the smallest binade's). Read off the bits as `_round_to_fp4_` reads its step: the exponent
    field alone is 2^e, and each mantissa bit less in the field halves it. A power of two, so
    magnitude / spacing is exact. (Past the largest value it gives its binade's spacing, though no
    value follows: clamp first.)"""
    mantissa_bits, subnormal, _ = ELEMENT_GRIDS[element]
    field = torch.bitwise_and(magnitude.contiguous().view(torch.int32), 0x7F800000)
    smallest = int(torch.tensor(subnormal, dtype=torch.float32).view(torch.int32))
    return field.sub_(mantissa_bits << 23).clamp_(min=smallest).view(torch.float32)


def fake_quantize_mx(x: torch.Tensor, element_bits: int) -> torch.Tensor:
    """x rounded to MXFP8 (`element_bits` 8) or MXFP6 (6) along its last dimension: blocks of 32,
    elements at each block's power-of-two step; float32 out, of x's shape. NaN/Inf elements stay as
    they are."""
    _, limit = _MX_ELEMENTS[element_bits]
    flat = x.detach().reshape(-1, x.shape[-1])
    x32, finite = _finite_or_zero(flat.float())
    grouped, pad = _grouped(x32, MXFP8_GROUP)
    step = mx_steps(grouped.abs().amax(-1, keepdim=True), limit)
    out = _ROUND_TO_ELEMENT_[element_bits](grouped / step).mul_(step).clamp_(-_F32_MAX, _F32_MAX)
    out = out.reshape(flat.shape[0], grouped.shape[1] * MXFP8_GROUP)
    out = out[:, : flat.shape[1]] if pad else out
    out = out if finite is None else torch.where(finite, out, flat.float())
    return out.reshape(x.shape)


def recover_mx_steps(weight: torch.Tensor, element_bits: int = 8) -> tuple[torch.Tensor, int]:
    """Power-of-two steps that reproduce an MXFP8 (`element_bits` 8) or MXFP6 (6) weight
    [rows, cols] bit for bit, one per block of 32 columns, each verified over the whole block:
    first mx_steps of the block's largest magnitude (the library's rule on the weights as they
    are), then half of it (when e4m3 rounded the block's extreme up to exactly 448 steps, that
    rule lands one power higher, and a block with an element only the finer step holds needs it).
    Returns (steps [rows, cols / 32] float32, number of blocks that failed)."""
    largest, limit = _MX_ELEMENTS[element_bits]
    to_grid_ = _ROUND_TO_ELEMENT_[element_bits]
    rows, cols = weight.shape
    w, x, top = _blocks(weight, MXFP8_GROUP)
    steps = torch.ones_like(top)
    ok = top == 0  # an all-zero block holds at any step: 1, as mx_steps gives it
    for cand in (mx_steps(top, limit), mx_steps(top, limit) / 2):
        storable = (cand >= 2.0**-127) & (cand <= 2.0**127)
        exact = ((to_grid_(x / cand) * cand).to(w.dtype) == w).all(-1, keepdim=True)
        good = storable & exact & ~ok & (top / cand <= largest)
        steps = torch.where(good, cand, steps)
        ok = ok | good
    return steps.reshape(rows, cols // MXFP8_GROUP), int((~ok).sum())



# --- Differentiable fake quantization, for quantization-aware training -------------------------

def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward: the straight-through estimator (Bengio et al. 2013)."""
    return x + (torch.round(x) - x).detach()


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x forward, bit for bit; its gradient multiplied by `factor` backward."""
    scaled = x * factor
    return x.detach() + (scaled - scaled.detach())


def lsq_gradient_factor(elements_per_scale: int, qmax: int) -> float:
    """LSQ's step-size gradient scale g = 1 / sqrt(N · Q_P) (Esser et al. 2020, section 2.2): without
    it a scale, which collects the gradient of every weight it serves, learns orders of magnitude
    faster than the weights themselves."""
    return 1.0 / (elements_per_scale * qmax) ** 0.5


def fake_quantize_ste(weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int,
                      group_size: int | None = None) -> torch.Tensor:
    """dequantize(quantize(weight)) that gradients flow through: to `weight` straight through the
    rounding (and not at all outside the grid's range), to `scale` as LSQ defines it, which
    autograd derives from this expression: d/ds [round(w/s) · s] = round(w/s) - w/s inside the
    range, qmin - z or qmax - z where clamped. Clamping before rounding gives the same values as
    after (the bounds are integers) and LSQ's gradients.

    weight [rows, cols]; scale and zero_point shaped as compute_qparams returns them ([rows, 1]
    or [1, 1], or [rows, n_groups, 1] with `group_size`). `zero_point` is held fixed."""
    if group_size:
        grouped, pad = _grouped(weight, group_size)
        codes = round_ste(torch.clamp(grouped / scale + zero_point, qmin, qmax))
        out = ((codes - zero_point) * scale).reshape(weight.shape[0], -1)
        return out[:, : weight.shape[1]] if pad else out
    codes = round_ste(torch.clamp(weight / scale + zero_point, qmin, qmax))
    return (codes - zero_point) * scale
