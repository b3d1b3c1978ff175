"""SparseGPT (Frantar and Alistarh 2023): prune a layer one input column at a time, and after each
column spread the error of the weights just removed over the columns not yet visited, weighted by
the inverse Hessian of the layer's reconstruction loss ||WX - ŴX||² (the OBS update, made cheap
by visiting columns in order so that one Cholesky factor serves every step, as in GPTQ).

    H = 2 X Xᵀ / N over all calibration tokens (from the calibration engine)
    dead inputs (H_jj = 0) are zeroed; H += damp · mean(diag H) · I
    U = Cholesky factor (upper) of H⁻¹
    for each block of `block_size` columns:
        unstructured: prune the `sparsity` share of the block's weights with the smallest
            w² / U_jj² (the OBS saliency: the loss their removal adds), over all rows together
            as the reference implementation does (`mask_selection: row`: each row its share)
        for each column j in it:
            N:M: when j starts a group of M columns, prune the N of each row's group with the
                smallest w² / U_jj²
            q_j = 0 where pruned, else w_j (or, with `quantize`, w_j rounded to the grid, any
                GPTQ rounds to; group scales computed when a group's first column is reached)
            e_j = (w_j - q_j) / U_jj
            W[:, j:block end] -= e_j · U[j, j:block end]        (within the block)
        then W[:, after block] -= E_block · U[block, after block]  (the lazy batched update)

The masks are chosen on the weights as already updated (adaptive mask selection), so earlier
columns' compensation informs which later weights go. The zeros of an earlier pruning (a stage
before this one, or the input model's, by the rule GPTQ keeps masks by) count as the lowest
saliency and are pruned whatever the count, so the new mask contains the old one (and a block
holding more of them than its share ends above the target).

Sample recipe stage:

    - sparsegpt:
        sparsity: 0.5            # or pattern: "2:4" (quoted: YAML reads 2:4 as a number)
        mask_selection: block    # or row: every row exactly as sparse
        block_size: 128          # columns per lazy batched update and per unstructured mask choice
        dampening_frac: 0.01     # of the Hessian's mean diagonal
        quantize: {scheme: W4A16, weights: {group_size: 64}}   # optional: joint quantization
        sparsity_overrides: {mlp.down_proj: 0.3}
        ignore: [lm_head]
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from compress.engine import SolvesOutsideBlocks, block_label, solve_layers
from compress.errors import CompressError
from compress.modeling import get_weight, set_weight
from compress.quant import quantize_dequantize
from compress.schemes import PRESETS, QuantArgs, resolve_scheme
from compress.sparsity import lowest_overall, lowest_per_row, nm_mask, prune_count, pruned_zeros
from compress.stages.base import EngineOptions, QuantArgsOverride, StageContext, done_by
from compress.stages.gptq import (HessianObserver, column_qparams, columns_ahead, enough_tokens, hessian_loss,
                                  inverse_hessian_cholesky, weight_and_hessian)
from compress.stages.magnitude import magnitude_prune
from compress.stages.pruning import LayerTarget, PruningStage, check_weight, count_nonzero, prune_summary, record_layer
from compress.stages.rtn import check_fits_dtype, forget_shared_scale, global_scales, quantize_weight, scale_record

# ---------------------------------------------------------------------------------------------
# The math


def sparsegpt_prune(W: torch.Tensor, H: torch.Tensor, target: LayerTarget, block_size: int = 128, damp: float = 0.01,
                    quant: QuantArgs | None = None, mask_selection: str = "block",
                    keep_zero: torch.Tensor | None = None, global_scale: float | None = None) -> tuple[torch.Tensor, dict]:
    """Prune (and with `quant`, quantize) W [out, in] against Hessian H [in, in]. `global_scale`:
    what rtn.global_scales shares across the layer's fused group (NVFP4's global scale, per-tensor
    FP8's range), as gptq_quantize takes it.

    `keep_zero` (bool [out, in]): an earlier pruning's mask. Those weights are pruned first (their
    saliency counts as lowest), so the new mask contains the old one; without it the updates of
    earlier columns would bring some of them back to life.

    Returns the new weight (float32) and details. Unstructured, `mask_selection` "row": each row
    loses exactly round(sparsity · in) weights, the per-block counts being the differences of the
    rounded running totals; "block": the block's lowest-saliency weights over all rows together
    (the reference implementation's threshold; rows end up unevenly sparse, the layer exactly
    round(sparsity · size)). N:M: the block size is rounded up to a multiple of M so groups never
    straddle blocks (block size only batches updates; for N:M it does not change the result).
    """
    W = W.clone().float()
    H = H.clone().float()
    rows, columns = W.shape
    kept_out = keep_zero.to(W.device) if keep_zero is not None else torch.zeros_like(W, dtype=torch.bool)
    nm = target.nm
    if nm:
        block_size = -(-block_size // nm[1]) * nm[1]
        if columns % nm[1]:
            raise ValueError(f"{columns} input features are not a multiple of M = {nm[1]}")
    group = quant.column_groups if quant is not None else None

    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    qp = None
    if quant is not None and group is None:
        qp = column_qparams(W, quant, global_scale=global_scale).per_column()

    Hinv, damp_used, retries = inverse_hessian_cholesky(H, damp)

    # Over Wᵀ, whose rows are W's columns, contiguous (as in gptq_quantize); masks stay [rows, block].
    Wt = W.t().contiguous()
    Qt = torch.zeros_like(Wt)
    for i1 in range(0, columns, block_size):
        i2 = min(i1 + block_size, columns)
        W1t = Wt[i1:i2].clone()
        Err1t = torch.zeros_like(W1t)
        Hinv1 = Hinv[i1:i2, i1:i2]
        d = torch.diag(Hinv1)
        W1 = W1t.t()  # a view: the block as [rows, block] for the mask choices
        gone1 = kept_out[:, i1:i2]  # an earlier mask: lowest saliency, and pruned whatever the count
        if nm is None and mask_selection == "block":
            k = prune_count(target.sparsity, rows * i2) - prune_count(target.sparsity, rows * i1)
            keep1 = lowest_overall(saliency(W1, d, gone1), k) & ~gone1
        elif nm is None:
            k = prune_count(target.sparsity, i2) - prune_count(target.sparsity, i1)
            keep1 = lowest_per_row(saliency(W1, d, gone1), k) & ~gone1
        else:
            keep1 = torch.ones_like(W1, dtype=torch.bool)
        for i in range(i2 - i1):
            col = i1 + i
            if nm is not None and i % nm[1] == 0:
                n, m = nm
                group_gone = gone1[:, i : i + m]
                keep1[:, i : i + m] = nm_mask(saliency(W1[:, i : i + m], d[i : i + m], group_gone), n, m) & ~group_gone
            if group is not None and col % group == 0:
                # Scales from the group's current (already error-compensated) values, with the
                # weights already known to be pruned left out of the range.
                ahead = columns_ahead(W1t[i : i + group] * keep1[:, i : i + group].t(), 0, Wt, i2, group).t()
                qp = column_qparams(ahead, quant, global_scale=global_scale).per_column()
            w = W1t[i]
            q = w if quant is None else quantize_dequantize(w, qp)
            q = q.masked_fill(~keep1[:, i], 0.0)
            Qt[col] = q
            err = torch.sub(w, q, out=Err1t[i]).div_(d[i])
            W1t[i + 1 :].addcmul_(Hinv1[i, i + 1 :, None], err, value=-1)  # W[:, j] -= err · Hinv[col, j]
        Wt[i2:] -= Hinv[i1:i2, i2:].t() @ Err1t
    Q = Qt.t().contiguous()
    return Q, {"damp": damp_used, "damp_retries": retries, "dead_columns": int(dead.sum())}


def saliency(W1: torch.Tensor, d: torch.Tensor, gone: torch.Tensor) -> torch.Tensor:
    """OBS saliency w² / [H⁻¹]_jj² of the weights W1 [rows, cols] (d: those columns' U_jj); the
    weights of an earlier mask (`gone`) lowest of all."""
    return (W1.pow(2) / d.pow(2)[None, :]).masked_fill(gone, -1.0)


def magnitude_baseline(W: torch.Tensor, target: LayerTarget, quant: QuantArgs | None = None,
                       global_scale: float | None = None) -> torch.Tensor:
    """What SparseGPT is compared with on the same Hessian: magnitude pruning (the magnitude
    stage's defaults), then round-to-nearest when quantizing jointly."""
    pruned = magnitude_prune(W, target)
    if quant is None:
        return pruned
    return quantize_weight(pruned, quant, global_scale)


# ---------------------------------------------------------------------------------------------
# The stage


class JointQuantization(BaseModel):
    """`quantize:` of a sparsegpt stage: the weights' scheme, as a quantization stage takes it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    scheme: Optional[str] = Field(None, description=f"preset: {', '.join(PRESETS)}")
    weights: Optional[QuantArgsOverride] = None

    @model_validator(mode="after")
    def _weights_only(self) -> "JointQuantization":
        if self.scheme is not None and self.scheme.upper() not in PRESETS:
            raise ValueError(f"unknown scheme '{self.scheme}'; presets are {', '.join(PRESETS)}")
        if self.scheme is None and self.weights is None:
            raise ValueError("set a scheme preset (e.g. W4A16) or weights settings")
        self.args()  # a scheme that does not resolve is refused here
        if self.scheme is not None and PRESETS[self.scheme.upper()].get("input_activations"):
            raise ValueError(f"joint quantization quantizes weights only; {self.scheme} also quantizes activations: "
                             "use a weight-only preset (e.g. W8A16) and a later stage for activations")
        return self

    def args(self) -> QuantArgs:
        weights = self.weights.model_dump(exclude_none=True) if self.weights is not None else None
        return resolve_scheme(self.scheme, weights, None).weights


class SparseGPT(SolvesOutsideBlocks, EngineOptions, PruningStage):
    """SparseGPT pruning (optionally with joint quantization), block by block through the calibration engine."""

    block_size: int = Field(128, gt=0, description="columns per lazy batched update and per unstructured mask choice")
    dampening_frac: float = Field(0.01, gt=0, description="damping as a fraction of the Hessian's mean diagonal")
    quantize: Optional[JointQuantization] = Field(None, description="quantize the kept weights in the same pass: {scheme, weights}")
    min_tokens: int = Field(16, ge=1, description="a layer that sees fewer calibration tokens falls back to magnitude pruning")
    mask_selection: Literal["row", "block"] = Field(
        "block", description="unstructured: each row's share of a block (row: every row exactly as sparse), or the "
                           "block's lowest over all rows (block: the reference implementation's)")

    def model_dump(self, **kw):  # the saved recipe: unset scheme overrides would read as explicit nulls
        out = super().model_dump(**kw)
        joint = out.get("quantize")
        if isinstance(joint, dict) and isinstance(joint.get("weights"), dict):
            joint["weights"] = {k: v for k, v in joint["weights"].items() if v is not None} or None
        return out

    def observe(self, name: str, module: torch.nn.Module) -> HessianObserver:
        return HessianObserver(module, conv1d=type(module).__name__ == "Conv1D")

    def compress_block(self, index: int, block: torch.nn.Module, prefix: str, layers: dict, observers: dict,
                       ctx: StageContext, runner) -> None:
        quant = self.quantize.args() if self.quantize is not None else None
        order = list(layers)
        # NVFP4's global scale, per-tensor FP8's range: one per fused group, from the weights as they are
        scales = global_scales(layers, quant) if quant is not None else {}
        solvable = enough_tokens(layers, observers, self.min_tokens, ctx, lambda name, module, tokens, why: self._magnitude(
            name, module, ctx, tokens, f"{why}: magnitude pruning", scales.get(name)))

        def solve(name: str, device: torch.device) -> tuple:
            W, H = weight_and_hessian(name, layers[name], observers[name], device)
            target = self._targets[name]
            earlier = pruned_zeros(W, None, ctx.layers.get(name))  # an earlier pruning's zeros (GPTQ's rule)
            try:
                Q, info = sparsegpt_prune(W, H, target, self.block_size, self.dampening_frac, quant, self.mask_selection,
                                          keep_zero=earlier, global_scale=scales.get(name))
            except FloatingPointError as exc:
                raise CompressError(f"layer {name}: {exc}", "raise dampening_frac or give more calibration samples") from None
            baseline = magnitude_baseline(W, target, quant, scales.get(name))
            return W, Q, info, hessian_loss(W, Q, H), hessian_loss(W, baseline, H)

        def apply(name: str, result: tuple) -> None:
            W, Q, info, loss, base_loss = result
            module = layers[name]
            ctx.progress(f"{block_label(index)}: {name} loss {loss:.3g} (magnitude {base_loss:.3g})", order.index(name) + 1, len(order))
            if quant is not None:
                check_fits_dtype(name, Q, module.weight.dtype, quant)
            set_weight(module, Q.to(module.weight.device))
            extra = {"sparsegpt_loss": loss, "magnitude_loss": base_loss, "tokens": observers[name].tokens, **info}
            if quant is not None:
                extra.update(weights=quant.model_dump(mode="json"), **scale_record(quant, scales.get(name)))
                forget_shared_scale(ctx.layers.setdefault(name, {}))
            if info["damp_retries"]:
                extra["note"] = f"Hessian not positive definite: damping raised to {info['damp']:g}"
            record_layer(ctx, name, "sparsegpt", self._targets[name], W, Q, **extra)
            self._done.add(name)

        solve_layers(solvable, solve, apply, ctx.devices)

    def _magnitude(self, name: str, module: torch.nn.Module, ctx: StageContext, tokens: int, note: str,
                   global_scale: float | None = None) -> None:
        """The fallback for a layer SparseGPT cannot solve, recorded as such (`global_scale`: its
        fused group's, see sparsegpt_prune; without one, its own)."""
        quant = self.quantize.args() if self.quantize is not None else None
        W = get_weight(module)
        check_weight(name, W)
        if quant is not None and global_scale is None:
            global_scale = global_scales({name: module}, quant).get(name)
        Q = magnitude_baseline(W, self._targets[name], quant, global_scale)
        if quant is not None:
            check_fits_dtype(name, Q, module.weight.dtype, quant)
        set_weight(module, Q)
        extra = {"weights": quant.model_dump(mode="json"), **scale_record(quant, global_scale)} if quant is not None else {}
        if quant is not None:
            forget_shared_scale(ctx.layers.setdefault(name, {}))
        record_layer(ctx, name, "sparsegpt", self._targets[name], W, Q, sparsegpt_loss=None, magnitude_loss=None,
                     tokens=tokens, damp_retries=0, note=note, **extra)
        self._done.add(name)

    def preflight_shapes(self, model: torch.nn.Module, records: dict[str, dict], source: torch.nn.Module) -> None:
        self._refuse_quantized(self.select(model, "sparsegpt"), records)

    def _refuse_quantized(self, selected: dict, records: dict[str, dict]) -> None:
        """SparseGPT updates the weights it keeps to make up for those it prunes: on a layer an
        earlier stage (or the input model) quantized, that moves them off the grid, and the output
        would be written dense with the grid lost; unless it quantizes them again (`quantize:`)."""
        if self.quantize is not None:
            return
        for name in selected:
            rec = records.get(name) or {}
            if rec.get("weights"):
                raise CompressError(f"stage sparsegpt: layer {name} was quantized ({QuantArgs(**rec['weights']).describe()}) by "
                                    f"{done_by(rec)}; SparseGPT's updates to the weights it keeps "
                                    "would move them off that grid",
                                    "prune before quantizing, or give sparsegpt `quantize:` to prune and quantize in one pass "
                                    "(magnitude and wanda only set weights to zero, which keeps the grid)")

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        selected = self.select(model, "sparsegpt")
        self._refuse_quantized(selected, ctx.layers)
        self._targets, self._done = self.layer_targets(selected, "sparsegpt"), set()
        nonzero_before = count_nonzero(model)
        summary = self.engine(ctx).run(model, ctx.calibration.samples, self, selected, ctx)
        # A layer no calibration forward reaches is pruned by magnitude, and the report says so.
        for name in selected:
            if name not in self._done:
                self._magnitude(name, selected[name], ctx, 0, "no calibration input reached this layer: magnitude pruning")
        done = [ctx.layers[n] for n in selected]
        solved = [r for r in done if r["sparsegpt_loss"] is not None]
        out = {"method": "sparsegpt", "scheme": self.describe_target()}
        if self.quantize is not None:
            out["scheme"] += f" + {self.quantize.args().describe()}"
        out.update(prune_summary(model, selected, nonzero_before, ctx.layers))
        out.update({
            "magnitude_fallback": len(done) - len(solved),
            "mean_sparsegpt_loss": sum(r["sparsegpt_loss"] for r in solved) / max(len(solved), 1),
            "mean_magnitude_loss": sum(r["magnitude_loss"] for r in solved) / max(len(solved), 1),
            "damping_raised": sum(1 for r in done if r["damp_retries"]),
            **summary,
        })
        return out
