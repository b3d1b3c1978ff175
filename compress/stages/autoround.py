"""AutoRound, or SignRound (Cheng et al. 2024, "Optimize Weight Rounding via Signed Gradient
Descent for the Quantization of LLMs"): learn, for every weight, whether to round it up or down,
and for every group how far to clip its range, so that each transformer block computes with its
quantized weights what it computed in float on the calibration set.

    W̃ = s · (clamp(round(W / s + z + V), qmin, qmax) - z)
        V ∈ [-0.5, 0.5]      one rounding offset per weight; 0 is round-to-nearest
        s, z                 from the group's range shrunk to [β · min W, α · max W],
                             α, β ∈ [0.5, 1]; 1 is the full min/max range
    loss = mean over tokens of || Y - block_W̃(X) ||²
        X: the block's inputs in the compressed model (carrying the earlier blocks' error)
        Y: the float model's output of this block (`reference: float_model`, AutoRound's default),
           or the float block's output on X itself (`reference: same_inputs`)
    for t in 1..iters, on a random mini-batch of calibration samples:
        V -= lr_t · sign(∂loss/∂V);   α, β -= minmax_lr_t · sign(∂loss/∂α, ∂loss/∂β)
        lr_t falls linearly from lr to 0; round() passes gradients straight through
        keep the V, α, β of the step with the least loss
    write W̃ with those, in the same format as round-to-nearest and GPTQ

Only V, α and β are learned; the float weights never change, so the result is a rounding of the
original weights, stored and loaded like any other. Signed steps make the learning rate mean
something: `iters` steps of lr = 1 / iters, decaying linearly, move an offset by at most 0.5 in
all, from 0 to either bound. The grid is the project's own (absmax, or `full_range`), as for RTN
and GPTQ; Intel's auto-round steps a symmetric group by max|w| / 2^(b-1) instead.

Float grids (NVFP4, MXFP4, MXFP6, MXFP8, FP8 per channel) learn the same two things.
A float element is a grid whose spacing doubles from one binade to the next, so an offset of at
most 0.5 in element units would reach past a small weight's neighbours (e4m3's spacing near zero
is 2^-9) and leave most large ones where they are (e2m1's spacing above 4 is 2). Here V is in
units of the weight's own bracket instead:

    a = W / s,  s the stored step (an e4m3 value under NVFP4's global scale, a power of two for
                MX) of the group's range shrunk to α · max|W|
    l ≤ |a| < u  the element values either side, t = (|a| - l) / (u - l)
    W̃ = s · sign(a) · (l + (u - l) · round(t + V)),  a tie to the value with an even mantissa

so, as on the integer grid, every weight can round to either value beside it and no further,
and V = 0, α = 1 is round-to-nearest exactly. The stored step is not differentiable (it is
rounded to e4m3 or to a power of two); its gradient is taken as if it scaled with α, and α moves
the step only where it crosses to another stored value. Intel's auto-round adds V to a in element units instead.
Measured on ref-llama by the benchmark protocol (200 steps; `python -m compress.bench --only
'ref-llama AutoRound NVFP4,ref-llama AutoRound MXFP4'`, BENCHMARKS.md of 2026-11-28 05:17 here,
the same rows with element-unit offsets patched in for the comparison), KL to the float model TS
/ WT2: NVFP4 1.80e-4 / 4.04e-4 here against 2.58e-4 / 6.18e-4 in element units, MXFP4 2.53e-4 /
6.19e-4 against 2.61e-4 / 7.41e-4.

One departure from auto-round: an asymmetric group's zero point is rounded without a gradient
(auto-round passes it straight through). Measured on ref-llama (W4 zero-point g64, 32 windows, 50
steps, seeds 0-2) the straight-through version ended every time at a higher mean block loss
(0.596, 0.608, 0.602 against 0.577, 0.561, 0.578), with KL to the float model no better.

A step's mini-batch is made of the engine's calibration batches (`batch_size`, by default up to
1024 tokens per forward on a CPU), as many as hold `samples_per_step` samples; when one batch
holds more, each step sees that whole batch.

One safeguard beyond the paper: after tuning, the block's loss over the whole calibration set is
compared with round-to-nearest's, and a block whose learned rounding does worse (a mini-batch's
best is not the set's) keeps round-to-nearest; the report says so.

Sample recipe stage:

    - autoround:
        scheme: W4A16           # integer weights, any group size, symmetric or not; or NVFP4A16, MXFP4A16, ...
        weights: {group_size: 64}
        iters: 200
        samples_per_step: 8
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal, Optional

import torch
from pydantic import Field, PrivateAttr, model_validator

from compress.engine import ActivationStore, BlockRunner
from compress.modeling import get_weight, set_weight
from compress.quant import ELEMENT_GRIDS, _grouped, element_spacing, range_qparams, relative_error, round_ste
from compress.schemes import QuantArgs
from compress.seeding import seeded_generator
from compress.sparsity import pruned_zeros
from compress.stages.base import EngineOptions, QuantizationStage, StageContext, check_weight
from compress.stages.rtn import check_fits_dtype, forget_shared_scale, global_scales, quantize_weight, scale_record

# ---------------------------------------------------------------------------------------------
# The math: plain functions on tensors

V_BOUND = 0.5  # a weight may round to either neighbour on the grid, never further
MIN_CLIP = 0.5  # a group's range may shrink to half, as far as AWQ's clipping search goes


def group_width(args: QuantArgs, columns: int) -> int:
    """Columns per scale: the group (NVFP4's block) size, or the whole row per channel."""
    return args.group_size if args.strategy in ("group", "tensor_group") else columns


def rounded_weight(W: torch.Tensor, V: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, args: QuantArgs,
                   keep_zero: torch.Tensor | None = None, global_scale: float | None = None) -> torch.Tensor:
    """W̃ for W [out, in] with offsets V [out, in] and clipping factors alpha, beta [out, groups, 1]
    (on the group's max and min; a float grid is symmetric and takes alpha on max|W|);
    differentiable in V, alpha and beta (round() straight through). With V = 0 and alpha = beta = 1
    this is round-to-nearest exactly. `keep_zero`: pruned weights that stay zero. `global_scale`:
    NVFP4's per-tensor scale (rtn.global_scales)."""
    rows, cols = W.shape
    width = group_width(args, cols)
    Wg, pad = _grouped(W, width)                     # [out, groups, width]
    Vg, _ = _grouped(V, width)
    if args.type == "float":
        top = Wg.abs().amax(-1, keepdim=True) * alpha.detach()
        qp = range_qparams(-top, top, args, global_scale)
        step = qp.scale * (alpha / alpha.detach())  # the stored step; its gradient as if it scaled with alpha
        out = element_offset_round(Wg / step, Vg, qp.element) * step
    else:
        lo, hi = Wg.amin(-1, keepdim=True) * beta, Wg.amax(-1, keepdim=True) * alpha
        qp = range_qparams(lo, hi, args)
        codes = torch.clamp(round_ste(Wg / qp.scale + qp.zero_point + Vg), qp.qmin, qp.qmax)
        out = (codes - qp.zero_point) * qp.scale
    out = out.reshape(rows, -1)[:, :cols]
    return out if keep_zero is None else out.masked_fill(keep_zero, 0.0)


def element_offset_round(a: torch.Tensor, V: torch.Tensor, element: int) -> torch.Tensor:
    """a (in element units) rounded on the float element's grid (4: E2M1, 6: E2M3, 8: E4M3),
    saturating, as the integer grid rounds a + V: with l ≤ |a| < u the element values either side
    and t = (|a| - l) / (u - l), the magnitude becomes l + (u - l) · round(t + V), where round()
    breaks a tie towards the value with an even mantissa (round-to-nearest's rule, so V = 0 is
    round-to-nearest bit for bit). So a weight reaches the value below or above it and no further;
    one exactly on a value moves only at V = ±0.5, to the one beside it with an even mantissa
    (as integer code 3 goes to 2 or 4, and 2 stays). Positive V rounds away from zero. Straight
    through: inside the grid's range the gradient is 1 in a and the bracket's width in V; a
    saturated weight (|a| beyond the largest value, under a clipped range) passes none, as the
    integer grid's clamp passes none."""
    largest = ELEMENT_GRIDS[element][2]
    magnitude = a.detach().abs().clamp_(max=largest)
    spacing = element_spacing(magnitude, element)
    scaled = magnitude.div_(spacing)  # in spacings: the value below, plus the place between it and the next
    spacings_below = scaled.floor()  # the value at or below, in spacings
    shifted = scaled.sub_(spacings_below).add_(V.detach())  # t + V, in [-0.5, 1.5)
    up = shifted > 0.5
    ties = shifted.abs() == 0.5
    if bool(ties.any()):
        # The last mantissa bit of the value below is that of its count of spacings, an integer
        # whose leading bit sits above the mantissa. Odd: the tie goes to the value above it
        # (t + V = 0.5), or at t = 0, V = -0.5 to the one below, in the same binade (odd is never a
        # binade's first value).
        odd = torch.remainder(spacings_below, 2) == 1
        up |= (shifted == 0.5) & odd
        spacings_below -= ((shifted == -0.5) & odd).float()
    rounded = spacings_below.add_(up).mul_(spacing).clamp_(max=largest)
    sign = torch.sign(a.detach())
    proxy = a + V * spacing * sign
    proxy = torch.where(a.detach().abs() <= largest, proxy, proxy.detach())
    return proxy + (rounded.mul_(sign) - proxy).detach()


def sign_step(parameters: list[torch.Tensor], lr: float, low: float, high: float) -> None:
    """One signed gradient step on each tensor, then back into [low, high]."""
    with torch.no_grad():
        for p in parameters:
            if p.grad is not None:
                p.sub_(lr * torch.sign(p.grad)).clamp_(low, high)
                p.grad = None


def block_loss(output: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean squared error per token (summed over features), padding excluded."""
    err = (output.float() - target.float()).pow(2).sum(-1)
    return err[mask].mean() if mask is not None else err.mean()


# ---------------------------------------------------------------------------------------------
# The stage


class AutoRound(EngineOptions, QuantizationStage):
    """Rounding and clipping learned by signed gradient descent on each block's output."""

    iters: int = Field(200, ge=1, description="signed gradient steps per block")
    lr: Optional[float] = Field(None, gt=0, description="step size for the rounding offsets; default 1 / iters")
    minmax_lr: Optional[float] = Field(None, gt=0, description="step size for the clipping factors; default lr")
    samples_per_step: int = Field(8, ge=1, description="calibration samples in each step's mini-batch")
    reference: Literal["float_model", "same_inputs"] = Field(
        "float_model", description="target of each block: the float model's own output of the block (AutoRound's "
        "default), or the float block's output on the compressed model's inputs")
    minmax: bool = Field(True, description="learn the clipping factors too (false: rounding offsets only)")
    preserve_sparsity: Optional[bool] = Field(
        None, description="keep exactly-zero weights at zero (a pruning mask); default: in layers an earlier stage pruned, "
        "and in layers no stage recorded where at least 10 % of weights are zero (not in layers only quantized)")
    # besides the engine's inputs: the float path's inputs and each block's targets (compress plan)
    activation_copies: ClassVar[int] = 3
    _float_inputs: Optional[ActivationStore] = PrivateAttr(None)  # the float model's inputs to block _float_block
    _float_block: int = PrivateAttr(-1)
    _float_restarts: list = PrivateAttr(default_factory=list)  # blocks where the float path restarted
    _blocks: list = PrivateAttr(default_factory=list)  # per block: its loss, round-to-nearest's, whether RTN was kept

    @model_validator(mode="after")
    def _learnable_scheme(self) -> "AutoRound":
        scheme = self.resolved_scheme()
        if scheme.weights.strategy in ("tensor", "block"):
            raise ValueError("AutoRound learns per-group or per-channel clipping: use strategy group, tensor_group (NVFP4) "
                             "or channel (FP8 tiles and per-tensor scales need rtn or gptq)")
        if scheme.input_activations is not None:
            raise ValueError("AutoRound tunes weights only: use a weight-only scheme (W4A16, W8A16, NVFP4A16, ...), "
                             "or gptq / rtn for activation quantization")
        return self

    def observe(self, name: str, module: torch.nn.Module) -> None:
        return None  # no per-layer statistics: the block's own outputs are the objective

    def compress_block(self, index: int, block: torch.nn.Module, prefix: str, layers: dict, observers: dict,
                       ctx: StageContext, runner: BlockRunner) -> None:
        names = {name: name[len(prefix):] + ".weight" for name in layers}  # parameter names inside the block
        weights = {}
        for name, module in layers.items():
            weights[name] = get_weight(module).to(ctx.device)
            check_weight(name, weights[name])
        keep_zero = {n: pruned_zeros(W, self.preserve_sparsity, ctx.layers.get(n)) for n, W in weights.items()}
        targets = self._targets(index, runner)
        try:
            self._tune_block(index, block, names, layers, weights, keep_zero, targets, ctx, runner)
        finally:
            targets.close()

    def _tune_block(self, index: int, block: torch.nn.Module, names: dict, layers: dict, weights: dict,
                    keep_zero: dict, targets: ActivationStore, ctx: StageContext, runner: BlockRunner) -> None:
        args = self.resolved_scheme().weights
        native = {n: (type(layers[n]).__name__ == "Conv1D", layers[n].weight.dtype) for n in layers}
        scales = global_scales(layers, args)  # NVFP4's per-tensor scale, shared by a fused group; else empty

        V = {n: torch.zeros_like(W, requires_grad=True) for n, W in weights.items()}
        shape = {n: (W.shape[0], math.ceil(W.shape[1] / group_width(args, W.shape[1])), 1) for n, W in weights.items()}
        alpha = {n: torch.ones(shape[n], device=ctx.device, requires_grad=self.minmax) for n in weights}
        beta = {n: torch.ones(shape[n], device=ctx.device, requires_grad=self.minmax) for n in weights}

        def parameters() -> dict[str, torch.Tensor]:
            out = {}
            for n, W in weights.items():
                q = rounded_weight(W, V[n], alpha[n], beta[n], args, keep_zero[n], scales.get(n))
                transposed, dtype = native[n]
                out[names[n]] = (q.t() if transposed else q).to(dtype)
            return out

        def loss_on(j: int, quantized: dict[str, torch.Tensor]) -> torch.Tensor:
            return block_loss(runner.forward(j, parameters=quantized), targets.get(j), runner.mask(j))

        # each batch's tokens, padding excluded, read once (a spilled batch loads from disk)
        batch_tokens = [self._tokens(runner, j) for j in range(len(runner))]
        rtn_loss = self._full_loss(runner, loss_on, parameters, batch_tokens)
        lr = self.lr or 1.0 / self.iters
        minmax_lr = self.minmax_lr or lr
        per_batch = max(1, runner.store.get(0).shape[0])
        batches_per_step = min(len(runner), max(1, math.ceil(self.samples_per_step / per_batch)))
        generator = seeded_generator(ctx.seed * 1_000_003 + index)
        order: list[int] = []
        learned = {"V": V, "alpha": alpha, "beta": beta}
        best_loss, best = float("inf"), None  # best: a snapshot of `learned`
        frozen = [p for p in block.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)  # only V, α and β learn
        try:
            with torch.enable_grad():
                for step in range(self.iters):
                    if len(order) < batches_per_step:  # a new pass over the calibration set, reshuffled
                        order += torch.randperm(len(runner), generator=generator).tolist()
                    chosen, order = order[:batches_per_step], order[batches_per_step:]
                    quantized = parameters()  # once per step: every batch of the step uses the same W̃
                    tokens = [batch_tokens[j] for j in chosen]
                    if len(set(tokens)) == 1:  # batches of equal size (packed windows): their mean
                        loss = sum(loss_on(j, quantized) for j in chosen) / len(chosen)
                    else:  # per token, as block_loss is: a short sample weighs as few tokens as it has
                        loss = sum(loss_on(j, quantized) * n for j, n in zip(chosen, tokens)) / sum(tokens)
                    value = float(loss.detach())
                    if value < best_loss:  # the parameters this loss was computed with
                        best_loss = value
                        best = {k: {n: t.detach().clone() for n, t in part.items()} for k, part in learned.items()}
                    loss.backward()
                    decay = 1 - step / self.iters
                    sign_step(list(V.values()), lr * decay, -V_BOUND, V_BOUND)
                    if self.minmax:
                        sign_step([*alpha.values(), *beta.values()], minmax_lr * decay, MIN_CLIP, 1.0)
                    ctx.progress(f"block {index + 1}: autoround loss {value:.4g} (rtn {rtn_loss:.4g})", step + 1, self.iters)
                del quantized, loss  # the last step's graph holds a copy of the block's weights
        finally:
            for p in frozen:
                p.requires_grad_(True)

        if best is not None:  # None: no step gave a finite loss
            with torch.no_grad():
                for k, part in learned.items():
                    for n, t in part.items():
                        t.copy_(best[k][n])
        tuned_loss = self._full_loss(runner, loss_on, parameters, batch_tokens) if best is not None else math.inf
        kept_rtn = not tuned_loss <= rtn_loss
        final_loss = rtn_loss if kept_rtn else tuned_loss
        with torch.no_grad():
            for n, W in weights.items():
                g = scales.get(n)
                Q = quantize_weight(W, args, g) if kept_rtn else rounded_weight(W, V[n], alpha[n], beta[n], args, global_scale=g)
                if keep_zero[n] is not None:
                    Q = Q.masked_fill(keep_zero[n], 0.0)
                # how many rounding decisions the offsets overturned, at the learned clipping
                flipped = 0.0
                if not kept_rtn:
                    nearest = rounded_weight(W, torch.zeros_like(W), alpha[n], beta[n], args, keep_zero[n], g)
                    flipped = float((Q != nearest).float().mean())
                check_fits_dtype(n, Q, native[n][1], args)
                self._record(ctx, n, layers[n], W, Q, args, {
                    **scale_record(args, g), "autoround_loss": final_loss, "rtn_loss": rtn_loss,
                    "tuned_loss": tuned_loss if math.isfinite(tuned_loss) else None,
                    "kept_rtn": kept_rtn, "iters": self.iters, "rounding_flipped": flipped,
                    "clip_alpha_mean": float(alpha[n].mean()),
                    **({"clip_beta_mean": float(beta[n].mean())} if args.type == "int" else {}),
                    **({"sparsity_preserved": float(keep_zero[n].float().mean())} if keep_zero[n] is not None else {})})
        self._blocks.append({"block": index, "loss": final_loss, "rtn_loss": rtn_loss, "kept_rtn": kept_rtn,
                             "layers": list(layers)})
        ctx.progress(f"block {index + 1}: autoround loss {final_loss:.4g} (rtn {rtn_loss:.4g})"
                     + (": kept round-to-nearest" if kept_rtn else ""), self.iters, self.iters)

    def _targets(self, index: int, runner: BlockRunner) -> ActivationStore:
        """Each batch's float output of this block: on the float model's own path (advanced here,
        block by block) or on the compressed model's inputs."""
        # The two extra streams (targets, float-path inputs) take a third of the budget each.
        budget = None if runner.store.budget is None else runner.store.budget // 3
        store = ActivationStore(runner.device, runner.store.keep_on_device, budget)
        with torch.no_grad():
            if self.reference == "same_inputs":
                for j in range(len(runner)):
                    store.append(runner.forward(j))
                return store
            if self._float_inputs is None or self._float_block != index:
                # The first block's inputs are the float model's too. After a block this stage did
                # not see (none of its layers selected), the float path has no inputs for this one:
                # it restarts from the compressed model's, and the summary says where.
                if index > 0:
                    self._float_restarts.append(index)
                self._close_float_inputs()
                self._float_inputs = ActivationStore(runner.device, runner.store.keep_on_device, budget)
                for j in range(len(runner)):
                    self._float_inputs.append(runner.store.get(j))
            for j in range(len(runner)):
                store.append(runner.forward(j, hidden=self._float_inputs.get(j)))
            # The float path's next inputs are these outputs. A second store holds them (sharing the
            # tensors, unless spilled), since `store` is closed after this block.
            self._close_float_inputs()
            self._float_inputs = ActivationStore(runner.device, runner.store.keep_on_device, budget)
            for j in range(len(runner)):
                self._float_inputs.append(store.get(j))
            self._float_block = index + 1
        return store

    def _close_float_inputs(self) -> None:
        if self._float_inputs is not None:
            self._float_inputs.close()
            self._float_inputs = None

    @staticmethod
    def _tokens(runner: BlockRunner, j: int) -> int:
        """Batch j's tokens, padding excluded."""
        mask = runner.mask(j)
        return int(mask.sum()) if mask is not None else math.prod(runner.store.get(j).shape[:2])

    @staticmethod
    def _full_loss(runner: BlockRunner, loss_on, parameters, batch_tokens: list[int]) -> float:
        """The block's loss over every calibration batch, weighted by its tokens."""
        total = 0.0
        with torch.no_grad():
            quantized = parameters()
            for j, n in enumerate(batch_tokens):
                total += float(loss_on(j, quantized)) * n
        return total / max(sum(batch_tokens), 1)

    def _record(self, ctx: StageContext, name: str, module: torch.nn.Module, W: torch.Tensor, Q: torch.Tensor,
                args: QuantArgs, info: dict) -> None:
        set_weight(module, Q)
        record = ctx.layers.setdefault(name, {})
        forget_shared_scale(record)
        record.update({"stage": "autoround", "shape": list(W.shape), "weights": args.model_dump(mode="json"),
                       "relative_error": relative_error(W, Q), **info})

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        selected = self.select(model, "autoround")
        self._blocks, self._float_block, self._float_restarts = [], -1, []
        try:
            summary = self.engine(ctx).run(model, ctx.calibration.samples, self, selected, ctx)
        finally:
            self._close_float_inputs()
        args = self.resolved_scheme().weights
        # Layers outside the transformer blocks (a BERT pooler, a targeted lm_head) have no block
        # output to learn from: round-to-nearest, and the report says so.
        tuned_layers = {n for b in self._blocks for n in b["layers"]}
        outside = {n: m for n, m in selected.items() if n not in tuned_layers}
        scales = global_scales(outside, args)
        for name, module in outside.items():
            W = get_weight(module)
            check_weight(name, W)
            Q = quantize_weight(W, args, scales.get(name))
            check_fits_dtype(name, Q, module.weight.dtype, args)
            self._record(ctx, name, module, W, Q, args, {**scale_record(args, scales.get(name)), "autoround_loss": None,
                                                          "rtn_loss": None, "note": "outside the transformer blocks: round-to-nearest"})
        blocks = self._blocks
        summary.update({
            "layers": len(selected), "rtn_fallback": len(selected) - len(tuned_layers),
            "scheme": self.resolved_scheme().describe(), "iters": self.iters,
            "block_losses": [[b["loss"], b["rtn_loss"]] for b in blocks],
            "mean_block_loss": sum(b["loss"] for b in blocks) / max(len(blocks), 1),
            "mean_rtn_block_loss": sum(b["rtn_loss"] for b in blocks) / max(len(blocks), 1),
            "blocks_kept_rtn": sum(1 for b in blocks if b["kept_rtn"]),
            "float_path_restarts": self._float_restarts,
        })
        return summary
