"""Magnitude pruning: zero the smallest weights by |W|. No calibration data; the baseline that
Wanda and SparseGPT are measured against.

Sample recipe stage:

    - magnitude:
        sparsity: 0.5          # or pattern: "2:4" (quoted: YAML reads 2:4 as a number)
        per_row: false         # compare within the whole layer (classic), or within each output row
        sparsity_overrides: {mlp.down_proj: 0.3}
        ignore: [lm_head]
"""

from __future__ import annotations

import torch
from pydantic import Field

from compress.modeling import get_weight, set_weight
from compress.sparsity import magnitude_scores, nm_mask, unstructured_mask
from compress.stages.base import StageContext
from compress.stages.pruning import LayerTarget, PruningStage, check_weight, count_nonzero, prune_summary, record_layer


def magnitude_prune(W: torch.Tensor, target: LayerTarget, per_row: bool = False) -> torch.Tensor:
    """W with its lowest-|W| weights zeroed to `target` (float32 copy)."""
    scores = magnitude_scores(W)
    mask = nm_mask(scores, *target.nm) if target.nm else unstructured_mask(scores, target.sparsity, per_row)
    return W.float().masked_fill(~mask, 0.0)


class Magnitude(PruningStage):
    """Prune each target layer by weight magnitude."""

    per_row: bool = Field(False, description="unstructured: compare weights within each output row instead of the whole layer")

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        modules = self.select(model, "magnitude")
        targets = self.layer_targets(modules, "magnitude")
        nonzero_before = count_nonzero(model)
        for i, (name, module) in enumerate(modules.items()):
            ctx.progress(f"magnitude {name}", i, len(modules))
            W = get_weight(module)
            check_weight(name, W)
            pruned = magnitude_prune(W, targets[name], self.per_row)
            set_weight(module, pruned)
            record_layer(ctx, name, "magnitude", targets[name], W, pruned)
        ctx.progress("magnitude", len(modules), len(modules))
        return {"method": "magnitude", "scheme": self.describe_target(),
                **prune_summary(model, modules, nonzero_before, ctx.layers)}
