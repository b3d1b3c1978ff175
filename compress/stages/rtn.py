"""Round-to-nearest (RTN) quantization: absmax or zero-point, per tensor, channel or group.

No calibration is needed for the weights; a static activation scheme observes input ranges on
the calibration set. Sample recipe stage:

    - rtn:
        scheme: W4A16          # compressed-tensors preset
        weights: {group_size: 64, symmetric: false}
        ignore: [lm_head]
"""

from __future__ import annotations

import torch

from compress import activations
from compress.modeling import get_weight, set_weight
from compress.quant import fake_quantize, fake_quantize_fp8, relative_error
from compress.schemes import QuantArgs
from compress.stages.base import QuantizationStage, StageContext, check_weight


def quantize_weight(weight: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """Round a [out_features, in_features] weight to the scheme's grid; returns float32."""
    if args.type == "float":
        return fake_quantize_fp8(weight, args.strategy)
    return fake_quantize(weight, args.num_bits, args.symmetric, args.strategy, args.group_size, full_range=args.full_range)


class RoundToNearest(QuantizationStage):
    """Round each target weight to the nearest point of its quantization grid."""

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        scheme = self.resolved_scheme()
        modules = self.select(model, "rtn")
        wargs = scheme.weights
        for i, (name, module) in enumerate(modules.items()):
            ctx.progress(f"rtn {name}", i, len(modules))
            weight = get_weight(module)  # [out, in], float32 copy
            check_weight(name, weight)
            q = quantize_weight(weight.to(ctx.device), wargs).cpu()
            set_weight(module, q)
            ctx.layers.setdefault(name, {}).update({
                "stage": "rtn",
                "shape": list(weight.shape),
                "weights": wargs.model_dump(mode="json"),
                "relative_error": relative_error(weight, q),
            })
        ctx.progress("rtn", len(modules), len(modules))

        if scheme.input_activations is not None:
            aargs = scheme.input_activations
            ranges = {}
            if not aargs.dynamic:
                ctx.progress("rtn: observing activation ranges", 0, 1)
                model.to(ctx.device)
                ranges = activations.observe_ranges(model, modules, ctx.calibration.samples, ctx.device)
                model.to("cpu")
            for name, module in modules.items():
                activations.attach(module, aargs, ranges.get(name))
                ctx.layers[name]["input_activations"] = aargs.model_dump(mode="json")
                if name in ranges:
                    ctx.layers[name]["activation_range"] = list(ranges[name])

        errors = [r["relative_error"] for n, r in ctx.layers.items() if n in modules]
        return {
            "layers": len(modules),
            "scheme": scheme.describe(),
            "mean_relative_error": sum(errors) / len(errors),
            "max_relative_error": max(errors),
        }
