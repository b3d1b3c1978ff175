"""SmoothQuant (Xiao et al. 2023): make activations easy to quantize by moving their outlier
channels' magnitude into the weights.

A few input channels of a layer carry activations far larger than the rest, so one per-tensor
or per-token int8 scale wastes most codes on them. Per mapping (compress/mappings.py) of a
preceding op to the layers reading it:

    s_j = max|X_j|^α / max|W_j|^(1-α)        X_j: channel j of the calibration inputs,
                                             W_j: column j over all the layers of the mapping
    prev output / s,  W · diag(s)            exact in float, before any quantization

α (default 0.5) balances the difficulty between activations and weights and may be set per layer
pattern. This stage only smooths; a following stage quantizes (rtn or gptq with a W8A8 scheme):

    - smoothquant: {alpha: 0.5, alpha_overrides: {"re:.*down_proj": 0.8}}
    - gptq: {scheme: W8A8}
"""

from __future__ import annotations

from typing import Annotated, Optional

import torch
from pydantic import Field, PrivateAttr

from compress.engine import token_rows
from compress.errors import CompressError
from compress.mappings import Mapping, fold, fold_branches, in_block, mapped_layers, mappings_for
from compress.modeling import get_weight
from compress.stages.base import EngineOptions, Stage, StageContext
from compress.targets import Pattern, matches, select_modules


def smoothing_scales(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^α / max|W_j|^(1-α) over the columns j shared by `weights` ([out, in] each)."""
    w_max = torch.cat([w.abs() for w in weights]).amax(0).clamp(min=1e-5)
    return (act_max.clamp(min=1e-5).pow(alpha) / w_max.pow(1 - alpha)).clamp(min=1e-5)


class ChannelMax:
    """max |x| per input channel over every calibration token (padding excluded)."""

    def __init__(self):
        self.max: torch.Tensor | None = None

    def add(self, inputs: tuple, output, mask: torch.Tensor | None) -> None:
        m = token_rows(inputs, mask).abs().amax(0)
        self.max = m if self.max is None else torch.maximum(self.max, m)


class SmoothQuant(EngineOptions, Stage):
    """Per-channel smoothing of activation outliers into the weights, block by block."""

    alpha: float = Field(0.5, ge=0, le=1, description="migration strength: 0 keeps activations, 1 moves all into weights")
    alpha_overrides: dict[Pattern, Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=dict, description="alpha per layer pattern (name, suffix or re:), each in [0, 1] as alpha")
    mappings: Optional[list[Mapping]] = Field(None, description="replace the architecture's smoothing map")
    ignore: list[Pattern] = Field(default_factory=lambda: ["lm_head"], description="layers never smoothed")
    _mappings: list = PrivateAttr(default_factory=list)

    def observe(self, name: str, module: torch.nn.Module) -> ChannelMax:
        return ChannelMax()

    def alpha_for(self, layers: dict[str, torch.nn.Module]) -> float:
        """The first override whose pattern matches any of a mapping's layers, else `alpha`."""
        for pattern, alpha in self.alpha_overrides.items():
            if any(matches(pattern, name, module) for name, module in layers.items()):
                return alpha
        return self.alpha

    def compress_block(self, index: int, block: torch.nn.Module, prefix: str, layers: dict, observers: dict,
                       ctx: StageContext, runner) -> None:
        branch_folds = []  # experts' own up -> down: folded and checked together, after the rest
        for mapping in in_block(self._mappings, block):
            names = [prefix + b for b in mapping.balance if prefix + b in layers]  # the ones smoothed for quantization
            maxima = [observers[n].max for n in names if observers[n].max is not None]  # an expert may see no token
            if not maxima:
                continue
            alpha = self.alpha_for({n: layers[n] for n in names})
            act_max = torch.stack(maxima).amax(0)
            if not torch.isfinite(act_max).all():  # NaN scales would spread into the weights silently
                raise CompressError(f"layer {names[0]}: non-finite calibration activations reach this layer "
                                    "(NaN/Inf, or float16 overflow)", "check the model's weights, or load it in float32 (--dtype float32)")
            s = smoothing_scales(act_max, [get_weight(layers[n]).to(act_max.device) for n in names], alpha)
            if mapping._branch:
                branch_folds.append((mapping, s))
            else:
                fold(mapping, block, s, runner, f"block {index}")  # checked on one batch (an expert it skips: unchecked)
            for n in names:
                ctx.layers.setdefault(n, {}).update({
                    "smoothquant_alpha": alpha, "smoothquant_smooth": prefix + mapping.smooth,
                    "activation_max_before": float(act_max.max()), "activation_max_after": float((act_max / s).max())})
            ctx.progress(f"block {index + 1}: smoothed {mapping.smooth} -> {', '.join(mapping.balance)}", 0, 1)
        fold_branches(branch_folds, block, runner, f"block {index}")

    def preflight(self, model: torch.nn.Module) -> None:
        mappings = mappings_for(model, self.mappings, self.blocks)  # no map for the architecture, or one naming no module
        super().preflight(model)
        balance = {n: model.get_submodule(n) for _, layers in mapped_layers(model, mappings, self.blocks) for n in layers}
        for key in self.alpha_overrides:  # a typo would leave its layers at `alpha`, silently
            if not any(matches(key, n, module) for n, module in balance.items()):
                raise CompressError(f"stage smoothquant: alpha_overrides key '{key}' matches none of the layers it smooths "
                                    f"(e.g. {', '.join(list(balance)[:3])})", "run `compress plan` to see the model's module names")

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        self._mappings = mappings_for(model, self.mappings, self.blocks)
        selected = select_modules(model, ["Linear"], self.ignore)
        summary = self.engine(ctx).run(model, ctx.calibration.samples, self, selected, ctx)
        smoothed = [r for n, r in ctx.layers.items() if "smoothquant_alpha" in r]
        summary.update({"mappings": len(self._mappings), "smoothed_layers": len(smoothed)})
        if smoothed:
            summary["mean_activation_max_ratio"] = sum(r["activation_max_after"] / r["activation_max_before"] for r in smoothed) / len(smoothed)
        return summary
