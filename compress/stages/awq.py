"""AWQ, activation-aware weight quantization (Lin et al. 2024).

A few input channels carry much larger activations than the rest; the weights that multiply them
matter most. AWQ scales those weight columns up before rounding (so they round more finely) and
divides the preceding operation's output by the same scales, which leaves the float model
unchanged. Per mapping (see compress/mappings.py) of a preceding op to the layers that read it:

    a   = mean |x| per input channel over the calibration tokens
    s   = a^α / w^(1-α), normalised so max(s)·min(s) = 1, for α on a grid in [0, 1]
          (w: mean normalised |W| per input channel; `duo_scaling: false` gives s = a^α)
    err = || m(X) - m_s,Q(X) ||²   m: the mapping's `inspect` module (attention, MLP, a projection;
                                   the whole block if unset), with this mapping's layers scaled and
                                   quantized and the rest in float, on calibration inputs
    keep the α with the least error (s = 1, plain round-to-nearest, is scored too)

Scoring a module's output, not each layer's, matters: it weighs an error in q or k by what it
does through the softmax, and an error in gate by what it does through SiLU and down_proj. For the MLP
mappings the inspected output's error is exactly the block's output error (the MLP's output is
what it adds to the residual stream); for attention it leaves out how the MLP reacts, as
published AWQ does (on ref-llama both choose the same α). Where the inspected module reads the
smoothed norm's output itself (attention after input_layernorm, the MLP after its norm), its
call is cached once and each candidate calls just that module on the cached input divided by s
(equal to folding s into the norm); otherwise the block runs up to the inspected module, with the
norm folded, and stops there. Where the inspected module is the mapping's one scaled layer
(v -> o, up -> down, an expert's up -> down) no forward is needed: the error is
||X Wᵀ - (X/s) Q(W diag(s))ᵀ||² on that layer's sampled inputs X.

Every fold is checked on calibration batches (mappings.fold; the experts' own up -> down together,
mappings.fold_branches), so a map that is not exact for the model is refused rather than applied.

Then, per layer, a clipping search: for each output row and group, shrink the quantization range
to r · max (r from 1 down to 1 - max_shrink) and keep the r whose group output error is least.

Sample recipe stage:

    - awq:
        scheme: W4A16          # or NVFP4A16, MXFP4A16, MXFP6A16...: the same search on their float grids
        weights: {group_size: 64}
        grid: 20
"""

from __future__ import annotations

import zlib
from typing import Any, Optional

import torch
from pydantic import Field, PrivateAttr, model_validator

from compress.engine import calibration_batches, padding_changes_results, resolve_batch_size, token_rows
from compress.mappings import Mapping, apply_scales, fold, fold_branches, in_block, mappings_for, scale_inputs
from compress.moe import routes_tokens
from compress.modeling import get_weight, set_weight
from compress.quant import nvfp4_global_scale, quantize_dequantize, range_qparams, relative_error
from compress.schemes import QuantArgs
from compress.seeding import seeded_generator
from compress.stages.base import EngineOptions, QuantizationStage, StageContext, check_weight
from compress.stages.rtn import check_fits_dtype, forget_shared_scale, global_scales, quantize_weight, scale_record

# ---------------------------------------------------------------------------------------------
# The math: plain functions on tensors


def output_error(X: torch.Tensor, W: torch.Tensor, Q: torch.Tensor) -> float:
    """||X Wᵀ - X Qᵀ||² summed over tokens and outputs."""
    return float(((W - Q) @ X.t()).pow(2).sum())


def weight_magnitude(weights: list[torch.Tensor], group_size: int | None) -> torch.Tensor:
    """Mean over output rows of |W| normalised by its group's largest magnitude, per input channel."""
    W = torch.cat(weights).abs()
    g = group_size or W.shape[1]
    Wg = _group_view(W, g)
    Wg = Wg / Wg.amax(-1, keepdim=True).clamp(min=1e-12)
    return Wg.reshape(W.shape[0], -1)[:, : W.shape[1]].mean(0)


def candidate_scales(mean_abs: torch.Tensor, grid: int, w_mean: torch.Tensor | None = None) -> list[tuple[float, torch.Tensor]]:
    """(α, s) for α on an even grid in [0, 1]: s = a^α, or with `w_mean` (duo scaling, as current
    AWQ implementations do) s = a^α / w^(1-α); normalised so that max(s) · min(s) = 1."""
    mean_abs = mean_abs.clamp(min=1e-6)
    out = []
    for alpha in torch.linspace(0, 1, grid).tolist():
        s = mean_abs.pow(alpha)
        if w_mean is not None:
            s = (s / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        out.append((alpha, s / (s.max() * s.min()).sqrt()))
    return out


def _group_view(t: torch.Tensor, group: int) -> torch.Tensor:
    pad = (-t.shape[-1]) % group
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    return t.reshape(*t.shape[:-1], -1, group)


def clip_search(X: torch.Tensor, W: torch.Tensor, args: QuantArgs, grid: int = 20, max_shrink: float = 0.5,
                global_scale: float | None = None) -> tuple[torch.Tensor, float]:
    """Quantize W [out, in] with per (row, group) ranges shrunk to the ratio that minimises each
    group's output error on X [tokens, in]; returns the dequantized weight and the mean ratio.
    FP4 blocks take NVFP4's `global_scale`."""
    group = args.group_size if args.strategy in ("group", "tensor_group") else W.shape[1]
    Wg = _group_view(W, group)                    # [out, n_groups, group]
    Xg = _group_view(X.float(), group).permute(1, 0, 2)   # [n_groups, tokens, group]
    # A group's output error Σ_t (δ · x_t)² is δᵀ G δ with G = Σ_t x_t x_tᵀ, the group's own
    # [group, group] Gram matrix: made once, it lets each candidate cost out · in · group rather
    # than out · in · tokens, and never builds an [out, n_groups, tokens] product (gigabytes for
    # a 7B layer at 4096 tokens). Only where groups are narrower than the tokens are many: a
    # per-channel "group" is the whole input, and its outputs are the smaller thing to square.
    gram = Xg.transpose(1, 2) @ Xg if group < X.shape[0] else None  # [n_groups, group, group]
    if args.symmetric:
        hi0 = Wg.abs().amax(-1, keepdim=True)
        lo0 = -hi0
    else:
        lo0, hi0 = Wg.amin(-1, keepdim=True), Wg.amax(-1, keepdim=True)

    def quantized(ratio: torch.Tensor) -> torch.Tensor:
        qp = range_qparams(lo0 * ratio, hi0 * ratio, args, global_scale)
        return quantize_dequantize(Wg, qp)

    best_err = torch.full(hi0.shape, float("inf"), device=W.device)
    best_ratio = torch.ones(hi0.shape, device=W.device)
    for i in range(int(max_shrink * grid) + 1):
        ratio = torch.full(hi0.shape, 1 - i / grid, device=W.device)
        delta = Wg - quantized(ratio)                                   # [out, n_groups, group]
        if gram is not None:
            err = (delta * torch.einsum("gkl,ogl->ogk", gram, delta)).sum(-1, keepdim=True)  # δᵀ G δ per group
        else:
            err = torch.einsum("ogk,gtk->ogt", delta, Xg).pow(2).sum(-1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, ratio, best_ratio)
    Q = quantized(best_ratio).reshape(W.shape[0], -1)[:, : W.shape[1]]
    return Q, float(best_ratio.mean())


# ---------------------------------------------------------------------------------------------
# Statistics from the calibration engine


def scaled_layer_error(X: torch.Tensor, W: torch.Tensor, s: torch.Tensor, args: QuantArgs) -> float:
    """||X Wᵀ - (X/s) Q(W diag(s))ᵀ||² over the tokens of X [tokens, in]: one layer's output error
    with its input columns scaled by s before rounding (X Wᵀ = (X/s)(W diag(s))ᵀ exactly)."""
    Ws = W * s
    g = nvfp4_global_scale(Ws.abs().amax()) if args.fp4_format == "nvfp4" else None
    return output_error(X / s, Ws, quantize_weight(Ws, args, g))


def input_magnitude(observers: list["InputSampler"], routed: bool) -> torch.Tensor:
    """mean |x| per input channel over what the mapping's quantized layers read: in a dense block
    they read one tensor (q, k, v), so one layer's sample stands for all; in a block that routes
    tokens, each expert reads its own subset, so every layer's sampled tokens count."""
    if not routed:
        return observers[0].inputs().abs().mean(0)
    xs = [o.inputs() for o in observers]
    return sum(x.abs().sum(0) for x in xs) / sum(x.shape[0] for x in xs)


class InputSampler:
    """Keeps up to `per_batch` random tokens of each batch's input to one layer (padding excluded)."""

    def __init__(self, per_batch: int, seed: int):
        self.per_batch = per_batch
        self.generator = seeded_generator(seed)
        self.samples: list[torch.Tensor] = []
        self.tokens = 0

    def add(self, inputs: tuple, output, mask: torch.Tensor | None) -> None:
        x = token_rows(inputs, mask)
        self.tokens += x.shape[0]
        if x.shape[0] > self.per_batch:
            keep = torch.randperm(x.shape[0], generator=self.generator)[: self.per_batch].sort().values
            x = x[keep.to(x.device)]
        self.samples.append(x)

    def inputs(self) -> torch.Tensor:
        X = torch.cat(self.samples)
        if not torch.isfinite(X).all():
            raise FloatingPointError("non-finite calibration activations reach this layer")
        return X


# ---------------------------------------------------------------------------------------------
# The stage


class AWQ(EngineOptions, QuantizationStage):
    """AWQ scale search and clipping, then round-to-nearest, block by block."""

    grid: int = Field(20, ge=2, le=1000, description="points of the α grid in [0, 1]")
    duo_scaling: bool = Field(True, description="scales from activation and weight magnitudes: a^α / w^(1-α)")
    clip: bool = Field(True, description="search a clipping ratio per row or group (per-tensor scales and FP8 tiles "
                       "round to nearest)")
    clip_grid: int = Field(20, ge=2, le=1000, description="clipping ratios are 1 - i/clip_grid")
    max_shrink: float = Field(0.5, gt=0, lt=1, description="smallest clipping ratio is 1 - max_shrink")
    max_tokens: int = Field(4096, gt=0, description="calibration tokens kept per layer for the searches")
    mappings: Optional[list[Mapping]] = Field(None, description="replace the architecture's smoothing map")
    quantize: bool = Field(True, description="false: only apply the scales, leaving quantization to a later stage (e.g. gptq)")
    _mappings: list = PrivateAttr(default_factory=list)
    _forwards: int = PrivateAttr(1)  # calibration batches per block: each keeps its share of max_tokens
    _in_blocks: set = PrivateAttr(default_factory=set)  # the selected layers the engine handed to compress_block

    @model_validator(mode="after")
    def _weights_only(self) -> "AWQ":
        if self.quantize and self.resolved_scheme().input_activations is not None:
            # AWQ scales and rounds weights; the activations' static ranges would have to be observed
            # again after its folds change the inputs, which the rtn and gptq stages do
            raise ValueError("AWQ quantizes weights only: for activation quantization (W4A4, W8A8) set quantize: false "
                             "here, which applies the scales, and follow with an rtn or gptq stage of this scheme")
        return self

    def observe(self, name: str, module: torch.nn.Module) -> InputSampler:
        per_batch = max(1, self.max_tokens // self._forwards)
        return InputSampler(per_batch, seed=zlib.crc32(name.encode()))

    def compress_block(self, index: int, block: torch.nn.Module, prefix: str, layers: dict, observers: dict,
                       ctx: StageContext, runner) -> None:
        args = self.resolved_scheme().weights
        self._in_blocks.update(layers)
        input_scale: dict[str, torch.Tensor] = {}
        output_scale: dict[str, torch.Tensor] = {}  # a quantized layer that is a mapping's smoothed op (up, v)
        tokens_per_batch = max(1, next(iter(observers.values())).tokens // max(1, len(runner)))
        n_batches = max(1, -(-self.max_tokens // tokens_per_batch))  # enough batches for max_tokens
        references: dict = {}  # the float outputs of each inspected module (None: the block)
        branch_folds, branch_batches = [], 1  # experts' own up -> down: folded and checked together, after the rest
        originals = {n: get_weight(m) for n, m in layers.items()}  # for the round-to-nearest comparison
        original_scales = global_scales(layers, args)  # NVFP4's, of the unscaled weights
        for mapping in in_block(self._mappings, block):
            names = [prefix + b for b in mapping.balance if prefix + b in layers]  # the ones quantized here
            seen = [observers[n] for n in names if observers[n].tokens]  # an expert may see no token
            if not seen:
                continue  # nothing to quantize here (ignored layers), or no calibration token reached it
            prev = block.get_submodule(mapping.smooth)
            balance = [layers[n] for n in names]
            scaled = [block.get_submodule(b) for b in mapping.balance]  # and any other reader of prev (a router)
            mean_abs = input_magnitude(seen, routed=routes_tokens(block))
            w_mean = weight_magnitude([get_weight(m) for m in balance], args.group_size) if self.duo_scaling else None
            saved = [p.detach().clone() for m in (prev, *scaled) for p in m.parameters(recurse=False)]

            def restore() -> None:
                with torch.no_grad():
                    for p, v in zip((p for m in (prev, *scaled) for p in m.parameters(recurse=False)), saved):
                        p.copy_(v)

            errors = {}
            # s = 1 (plain round-to-nearest) is always a candidate, so AWQ never does worse on this score.
            candidates = {None: torch.ones_like(mean_abs), **dict(candidate_scales(mean_abs, self.grid, w_mean))}
            single = mapping.balance == [mapping.inspect] and len(names) == 1
            check_batches = 1 if single else n_batches
            if single:
                # The inspected module is the one layer scaled (v -> o, up -> down, an expert's up ->
                # down): its output error is a function of its own inputs, which its observer has
                # sampled, so no candidate needs a forward through the block.
                X = seen[0].inputs() / input_scale.get(names[0], 1.0)  # as the layer reads them now
                W = get_weight(balance[0]).to(X.device)
                errors = {alpha: scaled_layer_error(X, W, s.to(X.device), args) for alpha, s in candidates.items()}
                reference = None  # the block is untouched: the fold check takes its own
            else:
                # Where the inspected module reads prev's output itself (a norm feeding attention or
                # the MLP), each candidate calls just that module, on its cached input divided by s,
                # as published AWQ scores: the block is not run up to it again for every α.
                inspected = block.get_submodule(mapping.inspect) if mapping.inspect else None
                calls = runner.calls(mapping.inspect, mapping.smooth, n_batches) if inspected is not None else None
                if calls is not None:
                    reference = [call.run(inspected) for call in calls]
                else:
                    if mapping.inspect not in references:
                        references[mapping.inspect] = runner.outputs(n_batches, mapping.inspect)
                    reference = references[mapping.inspect]
                for alpha, s in candidates.items():
                    if calls is None:
                        apply_scales(prev, scaled, s)
                    else:
                        scale_inputs(scaled, s)
                    scales = global_scales(dict(zip(names, balance)), args)  # NVFP4: of the scaled weights
                    for name, layer in zip(names, balance):
                        set_weight(layer, quantize_weight(get_weight(layer), args, scales.get(name)))
                    if calls is None:
                        out = runner.outputs(n_batches, mapping.inspect)
                    else:
                        out = [call.run(inspected, (call.input.float() / s.to(call.input.device)).to(call.input.dtype))
                               for call in calls]
                    errors[alpha] = sum(float((o.float() - r.float()).pow(2).sum()) for o, r in zip(out, reference))
                    restore()
            alpha = min(errors, key=errors.get)  # None: no scaling helped
            s = candidates[alpha]
            if alpha is None and not mapping._branch:
                # Nothing is folded, but the map must still be one that folds exactly: a map that is not
                # (a reader of the smoothed op left out, a scale through an activation) scores every
                # candidate badly, and would otherwise pass as "no scaling helped" instead of being refused.
                fold(mapping, block, candidates[max(a for a in candidates if a is not None)], runner, f"block {index}",
                     check_batches, before=reference)
                restore()
            if alpha is not None and mapping._branch:
                branch_folds.append((mapping, s))  # no other mapping reads its layers
                branch_batches = max(branch_batches, check_batches)
            elif alpha is not None:  # checked on the batches scored (an expert's output exists only where tokens reach it)
                fold(mapping, block, s, runner, f"block {index}", check_batches, before=reference)
            if alpha is not None and prefix + mapping.smooth in layers:
                output_scale[prefix + mapping.smooth] = s  # its rows now give y / s
            for n in names:
                input_scale[n] = s  # these layers now read X / s
                ctx.layers.setdefault(n, {}).update({"awq_alpha": alpha, "awq_smooth": prefix + mapping.smooth,
                                                     "awq_block_error": errors[alpha], "awq_rtn_block_error": errors[None]})
            ctx.progress(f"block {index + 1}: {mapping.smooth} -> {', '.join(mapping.balance)} α={alpha} "
                         f"err {errors[alpha]:.3g} (rtn {errors[None]:.3g})", 0, 1)
        fold_branches(branch_folds, block, runner, f"block {index}", branch_batches)
        if not self.quantize:
            return
        scales = global_scales(layers, args)  # NVFP4's, per-tensor FP8's: one per fused group, of the scaled weights
        for name, module in layers.items():
            if not observers[name].tokens:  # an expert no calibration token reached: nothing to search on
                # NVFP4: its fused group's scale, which vLLM expects gate and up to share
                self._round_to_nearest(name, module, args, scales.get(name), ctx, {"tokens": 0},
                                       "no calibration token reached this layer (an expert the router never chose): "
                                       "round-to-nearest")
                continue
            X = observers[name].inputs()
            if name in input_scale:
                X = X / input_scale[name]
            W = get_weight(module).to(X.device)
            if self.clip and args.strategy not in ("tensor", "block"):  # ranges of one row (or a row's group)
                Q, ratio = clip_search(X, W, args, self.clip_grid, self.max_shrink, scales.get(name))
            else:
                Q, ratio = quantize_weight(W, args, scales.get(name)), 1.0
            X0, W0 = observers[name].inputs(), originals[name].to(X.device)
            rtn = quantize_weight(W0, args, original_scales.get(name))
            check_fits_dtype(name, Q, module.weight.dtype, args)
            set_weight(module, Q)
            # Errors in the input model's coordinates, as the round-to-nearest figures beside them:
            # undo the folds' column scaling (inputs X / s) and row scaling (outputs y / s)
            col = input_scale.get(name, torch.ones(W.shape[1])).to(W.device)
            row = output_scale.get(name, torch.ones(W.shape[0])).to(W.device)
            W_in, Q_in = (T * row.unsqueeze(1) / col.unsqueeze(0) for T in (W, Q))
            record = ctx.layers.setdefault(name, {})
            forget_shared_scale(record)
            record.update(scale_record(args, scales.get(name)))
            record.update({"stage": "awq", "shape": list(W.shape), "weights": args.model_dump(mode="json"),
                           "relative_error": relative_error(W_in, Q_in), "clip_ratio": ratio,
                           "output_error": output_error(X0, W_in, Q_in) / X.shape[0],
                           "rtn_output_error": output_error(X0, W0, rtn) / X.shape[0], "tokens": observers[name].tokens,
                           "search_tokens": X.shape[0]})

    @staticmethod
    def _round_to_nearest(name: str, module: torch.nn.Module, args: QuantArgs, global_scale: float | None,
                          ctx: StageContext, extra: dict, note: str) -> None:
        """A layer AWQ has nothing to search on, rounded to nearest and recorded with why (and with
        the NVFP4 `global_scale` it was rounded with, which packing stores)."""
        W = get_weight(module)
        Q = quantize_weight(W, args, global_scale)
        check_fits_dtype(name, Q, module.weight.dtype, args)
        set_weight(module, Q)
        record = ctx.layers.setdefault(name, {})
        forget_shared_scale(record)
        record.update({"stage": "awq", "shape": list(W.shape), "weights": args.model_dump(mode="json"),
                       "relative_error": relative_error(W, Q), **extra, "note": note,
                       **scale_record(args, global_scale)})

    def preflight(self, model: torch.nn.Module) -> None:
        mappings_for(model, self.mappings, self.blocks)  # no map for the architecture, or one naming no module
        super().preflight(model)

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        selected = self.select(model, "awq")
        self._mappings = mappings_for(model, self.mappings, self.blocks)
        self._in_blocks = set()
        samples = ctx.calibration.samples
        self._forwards = max(1, len(calibration_batches(samples, resolve_batch_size(self.batch_size, ctx.device, samples,
                                                                                   padding_changes_results(model) is not None))))
        summary = self.engine(ctx).run(model, ctx.calibration.samples, self, selected, ctx)
        outside = [n for n in selected if n not in self._in_blocks]
        if self.quantize:
            # Layers outside the transformer blocks (a BERT pooler, a targeted lm_head) are in no
            # smoothing map: round-to-nearest, and the report says so.
            args = self.resolved_scheme().weights
            for name in outside:
                check_weight(name, get_weight(selected[name]))
                g = global_scales({name: selected[name]}, args).get(name)  # NVFP4's, else None
                self._round_to_nearest(name, selected[name], args, g, ctx, {}, "outside the transformer blocks: round-to-nearest")
        # (records of this stage's own rounding: with quantize: false, none; an earlier AWQ's are not counted)
        done = [ctx.layers[n] for n in selected if "output_error" in ctx.layers.get(n, {})] if self.quantize else []
        unreached = sum(1 for n in self._in_blocks if ctx.layers.get(n, {}).get("tokens") == 0
                        and ctx.layers[n].get("stage") == "awq") if self.quantize else 0
        summary.update({"layers": len(done) + unreached + (len(outside) if self.quantize else 0),
                        "scheme": self.resolved_scheme().describe(), "mappings": len(self._mappings),
                        "rtn_no_tokens": unreached, "rtn_outside_blocks": len(outside) if self.quantize else 0,
                        "smoothed_layers": sum(1 for n in selected if ctx.layers.get(n, {}).get("awq_alpha") is not None)})
        if done:
            summary["mean_output_error"] = sum(r["output_error"] for r in done) / len(done)
            summary["mean_rtn_output_error"] = sum(r["rtn_output_error"] for r in done) / len(done)
        return summary
