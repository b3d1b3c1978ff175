"""Round-to-nearest (RTN) quantization: absmax or zero-point, per tensor, channel or group.

No calibration is needed for the weights; a static activation scheme observes input ranges on
the calibration set, through the calibration engine (one block on the device at a time; the
layers outside the blocks, such as a BERT pooler, on the model's own run after the last block),
with the weights already rounded, as the model will run. Sample recipe stage:

    - rtn:
        scheme: W4A16          # compressed-tensors preset
        weights: {group_size: 64, symmetric: false}
        ignore: [lm_head]
"""

from __future__ import annotations

import torch

from compress import activations
from compress.engine import observe_layers, token_rows
from compress.errors import CompressError
from compress.modeling import get_weight, set_weight
from compress.moe import static_input_range
from compress.quant import fake_quantize, fake_quantize_fp4, fake_quantize_fp8, fake_quantize_mx, nvfp4_global_scale, relative_error
from compress.schemes import QuantArgs, mx_format
from compress.stages.base import QuantizationStage, StageContext, check_weight
from compress.targets import fused_groups


def quantize_weight(weight: torch.Tensor, args: QuantArgs, global_scale: float | None = None) -> torch.Tensor:
    """Round a [out_features, in_features] weight to the scheme's grid; returns float32.
    NVFP4 takes the layer's `global_scale`, per-tensor FP8 the largest |w| its scale is taken from
    (both from global_scales); without one, the weight's own."""
    if args.fp4_format == "nvfp4":
        g = global_scale if global_scale is not None else nvfp4_global_scale(weight.abs().amax())
        return fake_quantize_fp4(weight, args.group_size, g)
    if args.fp4_format == "mxfp4":
        return fake_quantize_fp4(weight, args.group_size)
    if mx_format(args.model_dump()):  # MXFP8, MXFP6
        return fake_quantize_mx(weight, args.num_bits)
    if args.type == "float":
        absmax = torch.tensor(global_scale) if global_scale is not None and args.strategy == "tensor" else None
        return fake_quantize_fp8(weight, args.strategy, absmax=absmax, storable=True, block_structure=args.block_structure)
    return fake_quantize(weight, args.num_bits, args.symmetric, args.strategy, args.group_size, full_range=args.full_range)


def check_fits_dtype(name: str, q: torch.Tensor, dtype: torch.dtype, args: QuantArgs) -> None:
    """A grid whose steps are powers of two (MXFP4, MXFP6, MXFP8) can round a block's extreme up
    past the largest value of the model's dtype (float16: 64000 -> 65536): the layer would hold Inf.
    Refused, naming the layer, rather than saved (rtn, gptq and awq check what they write)."""
    if dtype.is_floating_point and bool((q.abs() > torch.finfo(dtype).max).any()):
        raise CompressError(f"layer {name}: {args.describe()} rounds its largest weights to "
                            f"{float(q.abs().max()):g}, past {str(dtype).removeprefix('torch.')}'s largest value",
                            "load the model in bfloat16 or float32 (--dtype)")


def global_scales(modules: dict[str, torch.nn.Module], args: QuantArgs) -> dict[str, float]:
    """The per-tensor value each layer shares with the group an engine fuses it into (q/k/v,
    gate/up: targets.fused_groups), from the group's largest weight, since the fused matrix has
    one: NVFP4's global scale, or the largest |w| per-tensor FP8 takes its scale from (vLLM
    re-rounds each part of a fused FP8 matrix to the largest part's scale when it loads it; at
    that scale already, it runs what was evaluated). Empty for every other scheme."""
    nvfp4 = args.fp4_format == "nvfp4"
    if not nvfp4 and not (args.type == "float" and not args.fp4_format and args.strategy == "tensor"):
        return {}
    scales = {}
    for group in fused_groups(list(modules)):
        top = max(float(get_weight(modules[n]).abs().amax()) for n in group)
        scales.update({n: nvfp4_global_scale(top) if nvfp4 else top for n in group})
    return scales


def scale_record(args: QuantArgs, shared: float | None) -> dict:
    """What a layer's record keeps of global_scales' value, for packing: NVFP4's global scale, or
    per-tensor FP8's largest |w| (packing finds the other schemes' scales from the weights)."""
    if shared is None:
        return {}
    return {"global_scale": shared} if args.fp4_format == "nvfp4" else {"fp8_absmax": shared}


def recorded_shared_scale(args: QuantArgs, record: dict) -> float | None:
    """scale_record's value read back from a layer's record (None where it holds none)."""
    return record.get("global_scale" if args.fp4_format == "nvfp4" else "fp8_absmax")


def forget_shared_scale(record: dict) -> None:
    """Drop an earlier stage's scale_record from a layer's record, before a stage that quantizes
    the layer anew adds its own (where its scheme has one)."""
    record.pop("global_scale", None)
    record.pop("fp8_absmax", None)


class RangeObserver:
    """Min and max of a layer's input over the calibration tokens, padding excluded: its static
    activation range."""

    def __init__(self, name: str):
        self.name, self.lo, self.hi, self.tokens = name, float("inf"), float("-inf"), 0

    def add(self, inputs: tuple, output, mask: torch.Tensor | None) -> None:
        x = token_rows(inputs, mask)
        if not x.numel():
            return
        lo, hi = float(x.min()), float(x.max())
        if not (torch.isfinite(torch.tensor([lo, hi])).all()):
            raise CompressError(f"layer {self.name}: non-finite calibration activations reach this layer "
                                "(NaN/Inf, or float16 overflow)", "check the model's weights, or load it in float32 (--dtype float32)")
        self.lo, self.hi, self.tokens = min(lo, self.lo), max(hi, self.hi), self.tokens + x.shape[0]


class RoundToNearest(QuantizationStage):
    """Round each target weight to the nearest point of its quantization grid."""

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        scheme = self.resolved_scheme()
        modules = self.select(model, "rtn")
        wargs = scheme.weights
        scales = global_scales(modules, wargs)
        for i, (name, module) in enumerate(modules.items()):
            ctx.progress(f"rtn {name}", i, len(modules))
            weight = get_weight(module)  # [out, in], float32 copy
            check_weight(name, weight)
            q = quantize_weight(weight.to(ctx.device), wargs, scales.get(name)).cpu()
            check_fits_dtype(name, q, module.weight.dtype, wargs)
            set_weight(module, q)
            record = ctx.layers.setdefault(name, {})
            forget_shared_scale(record)
            record.update({
                "stage": "rtn",
                "shape": list(weight.shape),
                "weights": wargs.model_dump(mode="json"),
                "relative_error": relative_error(weight, q),
                **scale_record(wargs, scales.get(name)),
            })
        ctx.progress("rtn", len(modules), len(modules))

        calibration: dict = {}  # static activation ranges: the calibration engine's summary
        if scheme.input_activations is not None:
            aargs = scheme.input_activations
            observed = {}
            if not aargs.dynamic:
                observers, calibration = observe_layers(model, ctx, modules, lambda name, module: RangeObserver(name))
                observed = {name: (obs.lo, obs.hi) for name, obs in observers.items() if obs.tokens}
            for name, module in modules.items():
                rng = None
                if not aargs.dynamic:  # an expert the router never chose borrows its siblings' range
                    rng, note = static_input_range(name, observed)
                    if note:
                        ctx.layers[name]["note"] = note
                    if rng is None:
                        continue
                activations.attach(module, aargs, rng)
                ctx.layers[name]["input_activations"] = aargs.model_dump(mode="json")
                if rng is not None:
                    ctx.layers[name]["activation_range"] = list(rng)

        errors = [r["relative_error"] for n, r in ctx.layers.items() if n in modules]
        return {
            "layers": len(modules),
            "scheme": scheme.describe(),
            "mean_relative_error": sum(errors) / len(errors),
            "max_relative_error": max(errors),
            **calibration,
        }
