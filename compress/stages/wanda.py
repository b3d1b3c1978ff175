"""Wanda (Sun, Liu, Bair, Kolter 2023): prune by weights and activations. Each weight is scored
by |W_ij| · ||X_j||₂, its magnitude times the L2 norm of its input channel over the calibration
tokens, and compared only with the other weights of its output row. No weight update, no
Hessian: one pass of statistics per layer through the calibration engine.

Sample recipe stage:

    - wanda:
        sparsity: 0.5          # or pattern: "2:4" (quoted: YAML reads 2:4 as a number)
        sparsity_overrides: {re:.*self_attn.*: 0.4}
        ignore: [lm_head]
        batch_size: auto       # engine keys, as for gptq
"""

from __future__ import annotations

import torch

from compress.engine import SolvesOutsideBlocks, block_label, token_rows
from compress.errors import CompressError
from compress.modeling import get_weight, set_weight
from compress.sparsity import nm_mask, unstructured_mask, wanda_scores
from compress.stages.base import EngineOptions, StageContext
from compress.stages.magnitude import magnitude_prune
from compress.stages.pruning import LayerTarget, PruningStage, check_weight, count_nonzero, prune_summary, record_layer


def wanda_prune(W: torch.Tensor, input_norm: torch.Tensor, target: LayerTarget) -> torch.Tensor:
    """W with its lowest |W|·||x|| weights zeroed, per output row (or per N:M group)."""
    scores = wanda_scores(W, input_norm)
    mask = nm_mask(scores, *target.nm) if target.nm else unstructured_mask(scores, target.sparsity, per_row=True)
    return W.float().masked_fill(~mask, 0.0)


class InputNormObserver:
    """Accumulates Σ x_j² per input channel (float32) and the token count, padding excluded."""

    def __init__(self, module: torch.nn.Module):
        in_features = module.weight.shape[0 if type(module).__name__ == "Conv1D" else 1]
        self.sq_sum = torch.zeros(in_features, dtype=torch.float32, device=module.weight.device)
        self.tokens = 0

    def add(self, inputs: tuple, output, mask: torch.Tensor | None) -> None:
        x = token_rows(inputs, mask)
        self.sq_sum += x.pow(2).sum(0)
        self.tokens += x.shape[0]

    def norm(self) -> torch.Tensor:
        if not torch.isfinite(self.sq_sum).all():
            raise FloatingPointError("non-finite calibration activations reach this layer (NaN/Inf, or float16 overflow)")
        return self.sq_sum.sqrt()


class Wanda(SolvesOutsideBlocks, EngineOptions, PruningStage):
    """Wanda pruning, block by block through the calibration engine."""

    def observe(self, name: str, module: torch.nn.Module) -> InputNormObserver:
        return InputNormObserver(module)

    def compress_block(self, index: int, block: torch.nn.Module, prefix: str, layers: dict, observers: dict,
                       ctx: StageContext, runner) -> None:
        for k, (name, module) in enumerate(layers.items()):
            obs = observers[name]
            W = get_weight(module).to(module.weight.device)
            check_weight(name, W)
            try:
                norm = obs.norm()
            except FloatingPointError as exc:
                raise CompressError(f"layer {name}: {exc}", "check the model's weights, or load it in float32 (--dtype float32)") from None
            if obs.tokens == 0:
                self._magnitude(name, module, ctx, "saw no calibration tokens: magnitude pruning")
                continue
            pruned = wanda_prune(W, norm, self._targets[name])
            set_weight(module, pruned)
            record_layer(ctx, name, "wanda", self._targets[name], W, pruned, tokens=obs.tokens)
            self._done.add(name)
            ctx.progress(f"{block_label(index)}: wanda {name}", k + 1, len(layers))

    def _magnitude(self, name: str, module: torch.nn.Module, ctx: StageContext, note: str) -> None:
        """The fallback for a layer without calibration inputs, recorded as such."""
        W = get_weight(module)
        check_weight(name, W)
        pruned = magnitude_prune(W, self._targets[name], per_row=True)
        set_weight(module, pruned)
        record_layer(ctx, name, "wanda", self._targets[name], W, pruned, tokens=0, note=note)
        self._done.add(name)

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        selected = self.select(model, "wanda")
        self._targets, self._done = self.layer_targets(selected, "wanda"), set()
        nonzero_before = count_nonzero(model)
        summary = self.engine(ctx).run(model, ctx.calibration.samples, self, selected, ctx)
        # A layer no calibration forward reaches is pruned by magnitude, and the report says so.
        for name in selected:
            if name not in self._done:
                self._magnitude(name, selected[name], ctx, "no calibration input reached this layer: magnitude pruning")
        fallback = sum(1 for name in selected if ctx.layers[name]["tokens"] == 0)  # those and experts no token reached
        return {"method": "wanda", "scheme": self.describe_target(),
                **prune_summary(model, selected, nonzero_before, ctx.layers), "magnitude_fallback": fallback, **summary}
