"""GPTQ (Frantar, Ashkboos, Hoefler, Alistarh 2022): quantize a layer's weight one input column
at a time, and after each column spread its rounding error over the columns not yet quantized,
weighted by the inverse Hessian of the layer's reconstruction loss ||WX - ŴX||².

    H = 2 X Xᵀ / N over all calibration tokens (from the calibration engine)
    dead inputs (H_jj = 0) are zeroed; H += damp · mean(diag H) · I
    U = Cholesky factor (upper) of H⁻¹
    for each block of `block_size` columns, for each column j in it:
        q_j = quant(w_j)                  group scales computed when a group's first column is reached
        e_j = (w_j - q_j) / U_jj
        W[:, j:block end] -= e_j · U[j, j:block end]        (within the block)
    then W[:, after block] -= E_block · U[block, after block]  (the lazy batched update)

Act-order (the default, `actorder: static`) processes columns in decreasing diag(H), the inputs
that matter most first, while the most columns remain to absorb their error; with it each group's
scales are fixed from the unquantized weight before the permutation, so groups stay contiguous in
the original order and the checkpoint packs as usual. `actorder: group` chooses a group's scales
when its first column is reached, as without act-order, so a group's columns may carry several
grids (written dense); `actorder: false` keeps the columns in order.

quant() is whatever grid the scheme names, as rtn rounds to it: integer codes, FP4 blocks (NVFP4,
MXFP4), FP8 per tensor, channel or 128x128 tile (a tile's rows share its scale), MXFP8 and MXFP6.

Every step above works row by row given H, so layers that read the same input (q/k/v; gate/up)
and so share H are solved stacked into one weight (`gptq_quantize_stacked`): one factorisation
and one pass over the columns for the group.

Sample recipe stage:

    - gptq:
        scheme: W4A16           # int4, group 128, symmetric
        weights: {group_size: 64}
        block_size: 128
        dampening_frac: 0.01
        actorder: static        # or group, or false (see GPTQ.actorder)
        shrink_grid: 0          # > 0: search shrunk ranges per group (Hessian-weighted error)

A pruned layer keeps its zeros at zero: GPTQ then only moves the surviving weights
(`preserve_sparsity`; by default where the layer's record says it was pruned, here or in the input,
see sparsity.zeros_are_a_mask, and in an unrecorded layer with at least 10 % exact zeros).
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import torch
from pydantic import Field, field_validator, model_validator

from compress import activations
from compress.engine import SolvesOutsideBlocks, block_label, solve_layers, token_rows
from compress.errors import CompressError
from compress.modeling import get_weight, set_weight, weight_shape
from compress.moe import static_input_range
from compress.quant import QParams, compute_qparams, quantize_dequantize, range_qparams, relative_error
from compress.schemes import QuantArgs
from compress.sparsity import pruned_zeros
from compress.stages.base import EngineOptions, QuantizationStage, StageContext, check_weight
from compress.stages.rtn import check_fits_dtype, forget_shared_scale, global_scales, quantize_weight, scale_record

# ---------------------------------------------------------------------------------------------
# The math: plain functions on tensors


def hessian_loss(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> float:
    """||WX - QX||² / N, from H = 2 X Xᵀ / N: the quantity GPTQ minimises, per token."""
    delta = (W - Q).float()
    return float(((delta @ H) * delta).sum() / 2)


# x xᵀ is symmetric, so the Hessian's sum is accumulated in row panels of about this many inputs,
# each only from the diagonal rightwards: for k panels that is (k + 1) / 2k of the products
# (30-35 % less time measured at 1536 and 2048 inputs on the CPU, where the down projection's
# Hessian costs more than the block's forward). Narrower layers are one panel, the plain product.
GRAM_PANEL = 512


def gram_panels(n: int) -> list[tuple[int, int]]:
    parts = max(1, n // GRAM_PANEL)
    return [(n * j // parts, n * (j + 1) // parts) for j in range(parts)]


def add_gram_upper_(total: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """total += xᵀ x [n, n], for x [tokens, n], on the panels from the diagonal rightwards only (what
    lies below them is left as it is): `symmetric_from_upper_` completes the sum."""
    for lo, hi in gram_panels(x.shape[1]):
        total[lo:hi, lo:].addmm_(x[:, lo:hi].t(), x[:, lo:])
    return total


def gram_upper(x: torch.Tensor) -> torch.Tensor:
    """xᵀ x on the panels from the diagonal rightwards, zeros below them."""
    if len(gram_panels(x.shape[1])) == 1:
        return x.t() @ x
    return add_gram_upper_(x.new_zeros(x.shape[1], x.shape[1]), x)


def symmetric_from_upper_(H: torch.Tensor) -> torch.Tensor:
    """In place: below the diagonal panels, the transpose of what lies above them."""
    for lo, hi in gram_panels(H.shape[0])[:-1]:
        H[hi:, lo:hi] = H[lo:hi, hi:].t()
    return H


def inverse_hessian_cholesky(H: torch.Tensor, damp: float, max_damp: float = 10.0) -> tuple[torch.Tensor, float, int]:
    """Upper Cholesky factor of (H + λI)⁻¹ with λ = damp · mean(diag H).

    A Hessian that is not positive definite (too few tokens, collinear inputs, float error) is
    retried with ten times the damping until `max_damp`; the damping used and the retries are
    returned so the report can say so.
    """
    mean_diag = torch.diag(H).mean().abs()
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    # With J the order-reversing permutation and J H J = L Lᵀ: H⁻¹ = J L⁻ᵀ L⁻¹ J = Uᵀ U for
    # U = J L⁻¹ J, which is upper triangular. So one factorisation and one triangular solve give U,
    # where factorising, inverting and factorising H⁻¹ again costs 20-30 % more at 1536 to 4096
    # inputs (measured on the CPU) for the same accuracy.
    frac, attempt = damp, 0
    while frac <= max_damp * (1 + 1e-9):
        L, info = torch.linalg.cholesky_ex((H + frac * mean_diag * eye).flip(0, 1))
        if info == 0:
            # eye.mT: the same identity, laid out column-major as LAPACK wants its right-hand side,
            # which saves a transposing copy (a third of the solve's time at 1536 inputs on the CPU)
            U = torch.linalg.solve_triangular(L, eye.mT, upper=False).flip(0, 1)
            if bool(torch.isfinite(U).all()):  # a factor too near singular to invert is retried too
                return U, frac, attempt
        frac, attempt = frac * 10, attempt + 1
    raise FloatingPointError(f"Hessian is not positive definite even with damping {frac / 10:g}")


def _per_tile(x: torch.Tensor, rows: int, reduce) -> torch.Tensor:
    """x [R, 1] (one value per row) reduced over each run of `rows` rows, an FP8 tile's height
    (`reduce`: torch.amax or torch.sum; the zero padding of a last, shorter tile changes neither),
    and spread back to [R, 1]."""
    R = x.shape[0]
    tiles = torch.nn.functional.pad(x.reshape(-1), (0, (-R) % rows)).reshape(-1, rows)
    return reduce(tiles, dim=1).repeat_interleave(rows)[:R].reshape(R, 1)


def column_qparams(W: torch.Tensor, args: QuantArgs, weight: torch.Tensor | None = None,
                    shrink_grid: int = 0, max_shrink: float = 0.2, global_scale=None) -> QParams:
    """Per-row (or per-tensor) parameters for the columns of W: one group's columns, or FP8 tiles'
    (one scale per block_structure[0] rows, shared across each tile). With `shrink_grid`, each
    row's (tile's) range is shrunk to r · (min, max) for r from 1 down to 1 - max_shrink, keeping
    the r whose rounding error Σ_j weight_j (w_j - q_j)² is least (weight: the columns' Hessian
    diagonal). `global_scale` (a float, or one per row [rows, 1]) is what rtn.global_scales shares
    across a fused group: NVFP4's global scale, or per-tensor FP8's largest |w|."""
    if args.strategy == "tensor":
        if args.type == "float":  # FP8: at the group's shared range, else the weight's own
            top = W.abs().amax() if global_scale is None else torch.as_tensor(global_scale, device=W.device).max()
            return range_qparams(-top.reshape(1, 1), top.reshape(1, 1), args)
        return compute_qparams(W, args.num_bits, args.symmetric, "tensor", full_range=args.full_range)
    lo, hi = W.amin(1, keepdim=True), W.amax(1, keepdim=True)
    tile_rows = args.block_structure[0] if args.strategy == "block" else None
    if tile_rows:  # FP8 tiles are symmetric: each row's range is its tile's
        hi = _per_tile(torch.maximum(-lo, hi), tile_rows, torch.amax)
        lo = -hi
    qp = range_qparams(lo, hi, args, global_scale)
    if not shrink_grid:
        return qp
    weight = torch.ones(W.shape[1], device=W.device) if weight is None else weight

    def rounding_error(qp: QParams) -> torch.Tensor:
        err = ((W - quantize_dequantize(W, qp)).pow(2) * weight).sum(1, keepdim=True)
        return _per_tile(err, tile_rows, torch.sum) if tile_rows else err

    best_err, best = rounding_error(qp), qp
    for i in range(1, shrink_grid + 1):
        r = 1 - max_shrink * i / shrink_grid
        cand = range_qparams(lo * r, hi * r, args, global_scale)
        err = rounding_error(cand)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = QParams(torch.where(better, cand.scale, best.scale), torch.where(better, cand.zero_point, best.zero_point),
                       qp.qmin, qp.qmax, qp.element)
    return best


def columns_ahead(W1t: torch.Tensor, i: int, Wt: torch.Tensor, i2: int, count: int) -> torch.Tensor:
    """The `count` columns from column i of the current block on, as rows of the transposed weights
    (W1t: the block's, Wt: the whole weight's; see gptq_quantize): the rest of the block, then the
    columns past its end (i2). Only those are copied; the whole rest would cost O(columns² / group)
    per layer."""
    ahead = W1t[i : i + count]
    if ahead.shape[0] < count and i2 < Wt.shape[0]:  # the group runs past the block
        ahead = torch.cat([ahead, Wt[i2 : i2 + count - ahead.shape[0]]])
    return ahead


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, args: QuantArgs, block_size: int = 128, damp: float = 0.01,
                  actorder: bool = False, static_groups: bool = False, shrink_grid: int = 0,
                  keep_zero: torch.Tensor | None = None, global_scale=None) -> tuple[torch.Tensor, dict]:
    """Quantize W [out, in] against Hessian H [in, in]; returns the dequantized Q and details.

    `keep_zero` (bool [out, in]): weights that must stay exactly zero (a pruning mask). They are
    "quantized" to 0 and their error is spread like any other, so the kept weights compensate.
    `global_scale`: NVFP4's per-tensor scale (a float, or [out, 1] for stacked weights); its block
    scales are then chosen as the columns are reached, like integer group scales. For per-tensor
    FP8, the largest |w| of the layer's fused group, which its one scale is taken from.
    """
    W = W.clone().float()
    H = H.clone().float()
    columns = W.shape[1]
    group = args.column_groups  # FP8 tiles: their columns are a group's, their rows share its scale
    if keep_zero is not None:
        keep_zero = keep_zero.to(W.device)

    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    diag = torch.diag(H)
    qp = None if group else column_qparams(W, args, diag, shrink_grid, global_scale=global_scale).per_column()
    group_qparams = None
    if group and static_groups:
        group_qparams = [column_qparams(W[:, g : g + group], args, diag[g : g + group], shrink_grid,
                                         global_scale=global_scale).per_column()
                         for g in range(0, columns, group)]

    perm = None
    if actorder:
        perm = torch.argsort(diag, descending=True)
        W, H, diag = W[:, perm], H[perm][:, perm], diag[perm]
        if keep_zero is not None:
            keep_zero = keep_zero[:, perm]

    Hinv, damp_used, retries = inverse_hessian_cholesky(H, damp)

    # The loop runs over Wᵀ: column j of W is row j of Wᵀ, one contiguous stretch of memory, so
    # each column's rounding and each update below is one contiguous read and write (on the CPU
    # about twice as fast per column as W's strided columns, with the same result).
    Wt = W.t().contiguous()
    Qt = torch.zeros_like(Wt)
    dropped = keep_zero.t() if keep_zero is not None else None
    original_columns = perm.tolist() if perm is not None else range(columns)
    for i1 in range(0, columns, block_size):
        i2 = min(i1 + block_size, columns)
        W1t = Wt[i1:i2].clone()
        Err1t = torch.zeros_like(W1t)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if group is not None:
                if group_qparams is not None:
                    qp = group_qparams[original_columns[col] // group]
                elif col % group == 0:
                    # Scales from the group's current (already error-compensated) values.
                    ahead = columns_ahead(W1t, i, Wt, i2, group).t()
                    qp = column_qparams(ahead, args, diag[col : col + group], shrink_grid, global_scale=global_scale).per_column()
            w = W1t[i]
            q = quantize_dequantize(w, qp, out=Qt[col])
            if dropped is not None:
                q.masked_fill_(dropped[col], 0.0)
            # The error, spread over the block's later columns: W[:, j] -= err · Hinv[col, j]
            err = torch.sub(w, q, out=Err1t[i]).div_(Hinv1[i, i])
            W1t[i + 1 :].addcmul_(Hinv1[i, i + 1 :, None], err, value=-1)
        Wt[i2:] -= Hinv[i1:i2, i2:].t() @ Err1t  # and over the columns after the block, in one product

    Q = Qt.t().contiguous()  # [out, in] in the usual layout for callers
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    return Q, {"damp": damp_used, "damp_retries": retries, "dead_columns": int(dead.sum())}


def stackable(args: QuantArgs, rows: list[int]) -> bool:
    """Can weights of these row counts be solved stacked? Their scales must belong to single rows
    or groups of a row: not a per-tensor scale, which spans a whole weight, nor FP8 tiles unless
    every weight is whole tiles high (a tile across two weights would give them one scale)."""
    if args.strategy == "tensor":
        return False
    return args.strategy != "block" or all(r % args.block_structure[0] == 0 for r in rows)


def gptq_quantize_stacked(weights: list[torch.Tensor], H: torch.Tensor, args: QuantArgs,
                          keep_zero: list[torch.Tensor | None] | None = None, global_scales: list[float] | None = None,
                          **options) -> tuple[list[torch.Tensor], dict]:
    """GPTQ for several weights [out_i, in] that share one Hessian (layers reading the same input:
    q/k/v, gate/up). Each row's result depends only on that row and H, so the weights are solved
    stacked, in one factorisation and one pass over the columns, and split again; the result is
    each weight's own up to float reassociation. Not for per-tensor scales, which span a whole
    weight, nor FP8 tiles that would straddle two weights (see stackable). `options` are
    gptq_quantize's."""
    if len(weights) > 1 and not stackable(args, [w.shape[0] for w in weights]):
        raise ValueError("a per-tensor scale or an FP8 tile would span two weights: solve such layers one by one")
    masks = keep_zero or [None] * len(weights)
    stacked_mask = None
    if any(m is not None for m in masks):
        stacked_mask = torch.cat([m if m is not None else torch.zeros(W.shape, dtype=torch.bool, device=W.device)
                                  for m, W in zip(masks, weights)])
    W = torch.cat(weights) if len(weights) > 1 else weights[0]
    g = None
    if global_scales is not None:  # each weight's NVFP4 global scale (per-tensor FP8: range) on its own rows
        g = torch.cat([torch.full((w.shape[0], 1), float(s), device=W.device) for w, s in zip(weights, global_scales)])
    Q, info = gptq_quantize(W, H, args, keep_zero=stacked_mask, global_scale=g, **options)
    return list(Q.split([w.shape[0] for w in weights])), info


# ---------------------------------------------------------------------------------------------
# Statistics from the calibration engine


class HessianObserver:
    """Accumulates Σ x xᵀ (float32; for wide layers only its upper panels, see GRAM_PANEL) and the
    token count over a layer's inputs, padding excluded; with `track_range`, also the input range
    for static activation quantization.

    Layers that read one tensor (q/k/v; gate/up) add the same product: the observer that computes
    it keeps it for the others, so a batch costs one matrix product per distinct input rather
    than one per layer. Which observers lead is learned from the batch before (the first batch
    accumulates in place, as a layer read by no other does throughout), so a layer's inputs
    are never assumed shared, only recognised as the same tensor."""

    # the last input added, under its mask: (the mask, token rows, x xᵀ or None when it went
    # straight into the sum, the observer that added it)
    _recent = activations.LastInput()

    def __init__(self, module: torch.nn.Module, conv1d: bool = False, track_range: bool = False):
        in_features = module.weight.shape[0 if conv1d else 1]
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float32, device=module.weight.device)
        self.tokens = 0
        self.track_range = track_range
        self.lo, self.hi = float("inf"), float("-inf")
        self.shared = False  # another layer read this layer's last input: keep the product for it

    def add(self, inputs: tuple, output, mask: torch.Tensor | None) -> None:
        recent = self._recent.get(inputs[0], id(mask))
        if recent is not None and recent[3] is not self:
            _, x, product, leader = recent
            leader.shared = True
            if product is not None:
                self.sum.add_(product)
            else:  # this batch the leader did not expect a follower
                add_gram_upper_(self.sum, x)
        else:
            x = token_rows(inputs, mask)
            product = None
            if self.shared:
                product = gram_upper(x)
                self.sum.add_(product)
            else:
                add_gram_upper_(self.sum, x)
            self._recent.put(inputs[0], id(mask), (mask, x, product, self))  # the mask held: its id stays its own
        self.tokens += x.shape[0]
        if self.track_range:
            self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))

    def hessian(self) -> torch.Tensor:
        # A NaN or Inf anywhere in the inputs propagates into the sum: one check suffices.
        if not torch.isfinite(self.sum).all():
            raise FloatingPointError("non-finite calibration activations reach this layer (NaN/Inf, or float16 overflow)")
        return symmetric_from_upper_(2 * self.sum / max(self.tokens, 1))


def observed_range(name: str, observers: dict) -> tuple[tuple[float, float] | None, str | None]:
    """moe.static_input_range from the ranges the block's HessianObservers tracked."""
    return static_input_range(name, {n: (o.lo, o.hi) for n, o in observers.items() if o.track_range and o.tokens})


def enough_tokens(layers: dict, observers: dict, min_tokens: int, ctx: StageContext, fallback) -> list[str]:
    """Names of the layers that saw at least `min_tokens` calibration tokens, to be solved; each of
    the others (a rarely routed MoE expert) goes to `fallback(name, module, tokens, why)` now. Every
    layer gets its report row here, in layer order, whichever device finishes it first."""
    solvable = []
    for name, module in layers.items():
        ctx.layers.setdefault(name, {})
        tokens = observers[name].tokens
        if tokens >= min_tokens:
            solvable.append(name)
        else:
            fallback(name, module, tokens, f"saw {tokens} calibration tokens (< min_tokens {min_tokens})" if tokens
                     else "saw no calibration tokens")
    return solvable


def shared_hessian_groups(names: list[str], observers: dict) -> list[tuple[str, ...]]:
    """The layers in groups with bit-identical Hessians, in layer order: layers that read the same
    input (q/k/v; gate/up) accumulate the same sums. GPTQ treats rows independently given H, so a
    group is solved as one stacked weight: one factorisation and one pass over the columns instead
    of one per layer (on a GPU, where each column is a few small kernels, that is most of the time)."""
    groups: list[list[str]] = []
    for name in names:
        obs = observers[name]
        # torch.equal is False for different shapes, so layers of other widths never match
        twin = next((g for g in groups if observers[g[0]].tokens == obs.tokens and torch.equal(observers[g[0]].sum, obs.sum)), None)
        if twin is None:
            groups.append([name])
        else:
            twin.append(name)
    return [tuple(g) for g in groups]


def layer_weight(name: str, module: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """A layer's weight [out, in] on `device`; a damaged one stops the run with the layer's name."""
    W = get_weight(module).to(device)
    check_weight(name, W)
    return W


def weight_and_hessian(name: str, module: torch.nn.Module, observer: HessianObserver,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's weight [out, in] and Hessian on `device`; a damaged weight or non-finite
    activations stop the run with the layer's name."""
    W = layer_weight(name, module, device)
    try:
        H = observer.hessian().to(device)
    except FloatingPointError as exc:
        raise CompressError(f"layer {name}: {exc}", "check the model's weights, or load it in float32 (--dtype float32)") from None
    return W, H


# ---------------------------------------------------------------------------------------------
# The stage


class GPTQ(SolvesOutsideBlocks, EngineOptions, QuantizationStage):
    """GPTQ weight quantization, block by block through the calibration engine."""

    block_size: int = Field(128, gt=0, description="columns per lazy batched update")
    dampening_frac: float = Field(0.01, gt=0, description="damping as a fraction of the Hessian's mean diagonal")
    actorder: Union[Literal["static", "group"], bool] = Field(
        "static", description="column order. static: decreasing Hessian diagonal, each group's scales fixed from the "
        "unquantized weight first (groups stay contiguous: packs as usual); group: decreasing diagonal, a group's "
        "scales chosen when its first column is reached (groups then mix columns: written dense); false: columns in "
        "order; true: group, or static with static_groups: true. compressed-tensors' names weight (= static) and "
        "dynamic (= group) are read as those")
    static_groups: Optional[bool] = Field(
        None, description="fix every group's scales from the unquantized weight before any column is quantized "
        "(implied by actorder: static)")
    true_sequential: bool = Field(
        False, description="calibrate each group of layers that share an input (q/k/v, o, gate/up, down) on inputs "
        "carrying the error of the groups quantized before it: one more partial forward per group")
    shrink_grid: int = Field(0, ge=0, le=1000, description="search this many shrunk ranges per row/group for the least Hessian-weighted rounding error (0: min/max)")
    preserve_sparsity: Optional[bool] = Field(
        None, description="keep exactly-zero weights at zero (a pruning mask); default: in layers an earlier stage pruned, "
        "and in layers no stage recorded where at least 10 % of weights are zero (not in layers only quantized)")
    min_tokens: int = Field(16, ge=1, description="a layer (a rarely routed MoE expert) that sees fewer calibration tokens falls back to round-to-nearest")

    @field_validator("actorder", mode="before")
    @classmethod
    def _compressed_tensors_names(cls, value):
        # compressed-tensors (and so llm-compressor recipes) call static "weight" and group "dynamic"
        return {"weight": "static", "dynamic": "group"}.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _actorder_and_static_groups(self) -> "GPTQ":
        if "actorder" not in self.model_fields_set and self.static_groups is False:
            # a recipe from before act-order was the default: static_groups: false meant columns in order
            object.__setattr__(self, "actorder", False)
        if self.actorder == "static" and self.static_groups is False:
            raise ValueError("actorder: static fixes group scales up front; for scales chosen as columns are reached "
                             "use actorder: group")
        if self.actorder == "group" and self.static_groups:
            raise ValueError("actorder: group chooses group scales as columns are reached; for fixed ones use actorder: static")
        return self

    @property
    def reorders_columns(self) -> bool:
        """Columns are quantized in decreasing Hessian diagonal (the inputs that matter most first,
        while the most columns remain to absorb their error)."""
        return self.actorder is not False

    @property
    def fixed_group_scales(self) -> bool:
        """Group scales come from the unquantized weight before any column is quantized, so each
        group keeps one grid over contiguous columns however the columns are ordered."""
        return self.actorder == "static" or bool(self.static_groups)

    def observe(self, name: str, module: torch.nn.Module) -> HessianObserver:
        acts = self.resolved_scheme().input_activations
        return HessianObserver(module, conv1d=type(module).__name__ == "Conv1D",
                               track_range=acts is not None and not acts.dynamic)

    def compress_block(self, index: int, block: torch.nn.Module, prefix: str, layers: dict, observers: dict,
                       ctx: StageContext, runner) -> None:
        scheme = self.resolved_scheme()
        args = scheme.weights
        order = list(layers)
        # NVFP4's global scale, per-tensor FP8's range: one per fused group (q/k/v, gate/up), from the weights as they are
        scales = global_scales(layers, args)
        solvable = enough_tokens(layers, observers, self.min_tokens, ctx, lambda name, module, tokens, why: self._round_to_nearest(
            name, module, ctx, tokens, f"{why}: round-to-nearest",
            scales.get(name), *observed_range(name, observers)))

        def solve(group: tuple[str, ...], device: torch.device) -> list[tuple]:
            # The group's layers read one input, so one Hessian serves them all (see shared_hessian_groups).
            first, H = weight_and_hessian(group[0], layers[group[0]], observers[group[0]], device)
            Ws = [first] + [layer_weight(name, layers[name], device) for name in group[1:]]
            masks = [self._pruning_mask(W, ctx.layers.get(name)) for name, W in zip(group, Ws)]
            g = [scales[name] for name in group] if scales else None
            try:
                Qs, info = gptq_quantize_stacked(Ws, H, args, masks, g, block_size=self.block_size, damp=self.dampening_frac,
                                                 actorder=self.reorders_columns, static_groups=self.fixed_group_scales,
                                                 shrink_grid=self.shrink_grid)
            except FloatingPointError as exc:
                raise CompressError(f"layer {', '.join(group)}: {exc}", "raise dampening_frac or give more calibration samples") from None
            results = []
            for name, W, Q, mask in zip(group, Ws, Qs, masks):
                layer_info = {**info, "sparsity_preserved": float(mask.float().mean())} if mask is not None else dict(info)
                layer_info.update(scale_record(args, scales.get(name)))
                rtn = quantize_weight(W, args, scales.get(name))
                results.append((Q, layer_info, hessian_loss(W, Q, H), hessian_loss(W, rtn, H), relative_error(W, Q)))
            return results

        applied = 0

        def apply(group: tuple[str, ...], results: list[tuple]) -> None:
            nonlocal applied
            for name, result in zip(group, results):
                applied += 1
                self._record(scheme, index, name, layers[name], observers[name], result, ctx, (applied, len(order)))
                if len(group) > 1:
                    ctx.layers[name]["solved_together"] = list(group)
                else:
                    ctx.layers[name].pop("solved_together", None)  # from an earlier GPTQ stage

        groups = []  # layers sharing a Hessian are solved stacked where their scales allow it
        for group in shared_hessian_groups(solvable, observers):
            together = stackable(args, [weight_shape(layers[n])[0] for n in group])
            groups += [group] if together else [(n,) for n in group]
        solve_layers(groups, solve, apply, ctx.devices)

    def _record(self, scheme, index: int, name: str, module: torch.nn.Module, obs: HessianObserver, result: tuple,
                ctx: StageContext, done: tuple[int, int]) -> None:
        """Write one solved layer back, attach its activation quantization, and record it."""
        Q, info, gptq_loss, rtn_loss, rel_error = result
        ctx.progress(f"{block_label(index)}: {name} loss {gptq_loss:.3g} (rtn {rtn_loss:.3g})", *done)
        check_fits_dtype(name, Q, module.weight.dtype, scheme.weights)
        set_weight(module, Q.to(module.weight.device))
        record = {"stage": "gptq", "shape": list(Q.shape), "weights": scheme.weights.model_dump(mode="json"),
                  "relative_error": rel_error, "gptq_loss": gptq_loss, "rtn_loss": rtn_loss,
                  "tokens": obs.tokens, **info}
        forget_shared_scale(ctx.layers[name])  # an earlier stage's; `info` has this one's
        if info["damp_retries"]:
            record["note"] = f"Hessian not positive definite: damping raised to {info['damp']:g}"
        if self.reorders_columns and not self.fixed_group_scales and scheme.weights.column_groups:
            record["mixed_group_scales"] = True  # actorder: group; what packing names when it writes dense
        if scheme.input_activations is not None:
            a = scheme.input_activations
            rng = None if a.dynamic else (obs.lo, obs.hi)
            activations.attach(module, a, rng)
            record["input_activations"] = a.model_dump(mode="json")
            if rng:
                record["activation_range"] = list(rng)
        ctx.layers[name].update(record)  # keeps what earlier stages recorded (e.g. AWQ scales)

    def _pruning_mask(self, W: torch.Tensor, record: dict | None) -> torch.Tensor | None:
        """Where W is exactly zero, if this layer's zeros are a pruning mask to keep: as
        `preserve_sparsity` says, or else as the layer's record does (zeros_are_a_mask)."""
        return pruned_zeros(W, self.preserve_sparsity, record)

    def _round_to_nearest(self, name: str, module: torch.nn.Module, ctx: StageContext, tokens: int, note: str,
                          global_scale: float | None = None, rng: tuple[float, float] | None = None,
                          range_note: str | None = None) -> None:
        """The fallback for a layer GPTQ cannot solve, recorded as such. Its inputs are quantized as
        the scheme says, a static range being `rng` (observed_range, which says in `range_note`
        where a range not its own came from); with none, its inputs stay unquantized."""
        scheme = self.resolved_scheme()
        args = scheme.weights
        W = get_weight(module)
        check_weight(name, W)
        if args.fp4_format == "nvfp4" and global_scale is None:
            global_scale = global_scales({name: module}, args)[name]
        rtn = quantize_weight(W, args, global_scale)
        check_fits_dtype(name, rtn, module.weight.dtype, args)
        set_weight(module, rtn)
        record = ctx.layers.setdefault(name, {})
        forget_shared_scale(record)
        record.update({
            "stage": "gptq", "shape": list(W.shape), "weights": args.model_dump(mode="json"),
            "relative_error": relative_error(W, rtn), "gptq_loss": None, "rtn_loss": None,
            "tokens": tokens, "damp_retries": 0, "note": note,
            **scale_record(args, global_scale)})
        a = scheme.input_activations
        if a is not None:
            if a.dynamic:
                rng = None
            elif range_note:
                record["note"] += "; " + range_note
            if a.dynamic or rng is not None:
                activations.attach(module, a, rng)
                record["input_activations"] = a.model_dump(mode="json")
                if rng is not None:
                    record["activation_range"] = list(rng)

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        selected = self.select(model, "gptq")
        summary = self.engine(ctx).run(model, ctx.calibration.samples, self, selected, ctx)
        # A layer no calibration forward reaches falls back to round-to-nearest, and the report says so.
        for name in selected:
            if "gptq_loss" not in ctx.layers.get(name, {}):
                self._round_to_nearest(name, selected[name], ctx, 0, "no calibration input reached this layer: round-to-nearest",
                                       None, *static_input_range(name, {}))
        done = [ctx.layers[n] for n in selected]
        solved = [r for r in done if r["gptq_loss"] is not None]
        summary.update({
            "layers": len(done),
            "rtn_fallback": len(done) - len(solved),
            "scheme": self.resolved_scheme().describe(),
            "mean_gptq_loss": sum(r["gptq_loss"] for r in solved) / max(len(solved), 1),
            "mean_rtn_loss": sum(r["rtn_loss"] for r in solved) / max(len(solved), 1),
            "damping_raised": sum(1 for r in done if r["damp_retries"]),
            # layers sharing a Hessian (q/k/v, gate/up) are one solve
            "solves": len({tuple(ctx.layers[n].get("solved_together", [n]))
                           for n in selected if ctx.layers[n]["gptq_loss"] is not None}),
        })
        experts = {n: ctx.layers[n].get("tokens") for n in selected if ".experts." in n and n.endswith("gate_proj")}
        if experts:  # how many calibration tokens the router sent to each expert
            summary["expert_tokens"] = experts
        return summary
