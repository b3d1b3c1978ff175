"""Quantization-aware training: fine-tune through fake-quantized weights, then save them quantized.

    - qat:
        scheme: W3A16
        weights: {strategy: channel}
        scales: learned          # LSQ (Esser et al. 2020); `fixed` keeps the initial scales;
                                 # `rtn` takes them from the current weights each step (float grids)
        kd_weight: 1.0           # distill from the full-precision input model (the default)...
        ce_weight: 0.0           # ...or train on the text itself (kd_weight: 0, ce_weight: 1)
        data: {dataset: calibration/default.txt, num_samples: 512}
        train: {steps: 200, lr: 1.0e-4}

Each target layer's weight is replaced, for the forward pass, by dequantize(quantize(W)); the
rounding passes gradients straight through (STE) so W keeps learning, and with `scales: learned`
the step sizes learn too, by LSQ's gradient (through their logarithm: see FakeQuantWeight). The starting scales are those of the weights as
they arrive: an earlier PTQ stage at the same scheme (GPTQ, AWQ, RTN) hands over its grid
exactly, so QAT starts from the PTQ result; otherwise round-to-nearest's. After training each
weight is set to its final quantized values, recorded like any quantization stage's, and saved
in the same packed format. A run whose held-out KD (or loss) ends above its start gives the start back
(`keep_start_if_worse`).

Float grids (FP8, MXFP8, MXFP6, MXFP4, NVFP4) train with `scales: rtn`, their default: each step
the layer computes with exactly what the rtn stage makes of its current weights (FP8's storable
step, an MX block's power of two, NVFP4's FP8 group scales), the rounding passed straight through.
Their scales are a function of the weights, as every tool derives them, so there is nothing else
to learn; the value a fused group shares (NVFP4's global scale, per-tensor FP8's range) is fixed
at the start from the group's weights, as rtn fixes it, and recorded for packing. The last
step's rounding is the saved model. An earlier stage's float grid is kept where rtn's rounding of
its weights gives them back (`qat_init` in the report says which).

Dynamic activation quantization can be trained through too (the inputs are rounded in the
forward pass as the saved model rounds them, integer or float, their gradient passed straight
through).
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from pydantic import Field, model_validator
from torch.nn.utils import parametrize

from compress import activations
from compress.errors import CompressError
from compress.modeling import get_weight, set_weight
from compress.quant import (QParams, compute_qparams, fake_quantize_ste, int_range, lsq_gradient_factor, recover_qparams,
                            relative_error, scale_gradient, storable_scale)
from compress.schemes import QuantArgs
from compress.seeding import seeded_generator
from compress.stages.base import QuantizationStage, StageContext, check_weight
from compress.stages.distill import (DistillLoss, check_training, input_is_quantized, load_teacher, pruning_masks,
                                     run_training, trainable_parameters, uses_teacher)
from compress.stages.rtn import (check_fits_dtype, forget_shared_scale, global_scales, quantize_weight, recorded_shared_scale,
                                 scale_record)
from compress.stages.structured import input_layer_name
from compress.targets import Pattern
from compress.training import TrainingConfig
from compress.training_data import TrainingData


class FakeQuantWeight(torch.nn.Module):
    """A parametrization of a linear layer's weight: the layer computes with quantize-dequantize
    of its float weight, which stays the trained parameter."""

    def __init__(self, weight: torch.Tensor, args: QuantArgs, qparams: QParams, learn_scale: bool, transposed: bool):
        super().__init__()
        self.group_size = args.group_size if args.strategy == "group" else None
        self.qmin, self.qmax = qparams.qmin, qparams.qmax
        self.transposed = transposed  # GPT-2's Conv1D stores [in, out]
        # Training runs on float32 copies (training.in_float32); the forward computes with what a
        # checkpoint in the model's own dtype holds: scales rounded up to it (storable_scale, as
        # every stage stores them) and the dequantized weights rounded to it.
        self.stored_dtype = weight.dtype
        self.register_buffer("scale", qparams.scale.clone())  # the starting step sizes (the fixed ones)
        self.register_buffer("zero_point", qparams.zero_point.clone())
        # Learned, a step size is its start times exp(log_scale): AdamW moves every parameter by
        # about lr a step whatever its gradient (LSQ's gradient scale assumes SGD), so a step of
        # the logarithm changes a 4-bit scale and a 40x smaller 8-bit one by the same share, and
        # never through zero (an absolute step of lr took 8-bit scales of 5e-4 negative).
        self.log_scale = torch.nn.Parameter(torch.zeros_like(qparams.scale)) if learn_scale else None
        out_f, in_f = (weight.shape[1], weight.shape[0]) if transposed else tuple(weight.shape)
        per_scale = self.group_size or (in_f if args.strategy == "channel" else out_f * in_f)
        self.grad_factor = lsq_gradient_factor(per_scale, self.qmax)

    def current_scale(self) -> torch.Tensor:
        return self.scale if self.log_scale is None else self.scale * self.log_scale.exp()

    def fix_scale(self, scale: torch.Tensor) -> None:
        """Hold the step sizes at `scale` from now on (the learned ones, as the checkpoint stores them)."""
        self.scale.copy_(scale)
        self.log_scale = None

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        w = weight.t() if self.transposed else weight
        scale = self.scale if self.log_scale is None else scale_gradient(self.current_scale(), self.grad_factor)
        q = fake_quantize_ste(w.float(), storable_scale(scale), self.zero_point, self.qmin, self.qmax, self.group_size)
        q = q.to(self.stored_dtype).to(weight.dtype)  # (gradients pass the casts unchanged)
        return q.t() if self.transposed else q


class RoundToNearestWeight(torch.nn.Module):
    """A parametrization for `scales: rtn`: the layer computes with the rtn stage's rounding of its
    current weight (scales derived from the weight at every step), the gradient passed straight
    through to the float weight. `shared`: the fused group's value (rtn.global_scales), fixed."""

    def __init__(self, weight: torch.Tensor, args: QuantArgs, shared: float | None, transposed: bool):
        super().__init__()
        self.args, self.shared, self.transposed = args, shared, transposed
        self.stored_dtype = weight.dtype  # as FakeQuantWeight: the rounded weights as the checkpoint holds them

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        w = weight.t() if self.transposed else weight
        with torch.no_grad():
            q = quantize_weight(w.detach().float(), self.args, self.shared).to(self.stored_dtype).to(w.dtype)
        out = w + (q - w).detach()
        return out.t() if self.transposed else out


def break_half_precision_ties(latent: torch.Tensor, fq: RoundToNearestWeight, generator: torch.Generator) -> None:
    """Move each float32 training copy of a half-precision weight a random part of half its dtype's
    spacing towards the grid point rtn rounds it to. A bfloat16 weight carries 8 significant bits
    and an MX or FP4 step a power of two, so about one weight in 16 sits exactly halfway between two
    grid points; any first update would carry every such tie across at once, on the gradient's
    side: on ref-llama in bfloat16 that one step raised MXFP6's KL to the teacher 27-fold, whatever
    the learning rate. Spread within the interval the half-precision value stands for, as a float32
    weight would be, the ties cross only as training moves them, and the rounding at the start is
    unchanged (checked: a weight whose rounding it would change stays where it was)."""
    q = fq(latent)
    mantissa, exponent = torch.frexp(latent)  # latent = m * 2^exponent, |m| in [0.5, 1)
    # half the spacing of the dtype's values there (eps = 2^-mantissa bits), the one below at a power of two
    exponent = exponent - 2 - (mantissa.abs() == 0.5).int()
    half_spacing = torch.ldexp(torch.full_like(latent, torch.finfo(fq.stored_dtype).eps), exponent)
    moved = latent + torch.sign(q - latent) * half_spacing * torch.rand(latent.shape, generator=generator).to(latent.device)
    # towards its own grid point no weight crosses a rounding boundary; should a group's step (set
    # by its largest weight) still change, the weights whose rounding changed stay where they were
    moved = torch.where(fq(moved) == q, moved, latent)
    if torch.equal(fq(moved), q):
        latent.copy_(moved)


def _source_weight(source: torch.nn.Module | None, name: str, shape: torch.Size, rec: dict) -> torch.Tensor | None:
    """The float weight of the input model's layer `name`, where it is comparable: same shape
    (structured pruning changes it) and no smoothing folded into it (AWQ, SmoothQuant scale the
    weights)."""
    if source is None or any(k in rec for k in ("awq_alpha", "smoothquant_alpha")):
        return None
    try:
        module = source.get_submodule(name)
    except AttributeError:
        return None
    weight = get_weight(module) if hasattr(module, "weight") else None
    return weight if weight is not None and weight.shape == shape else None


def _arrives_on(record: dict, args: QuantArgs) -> bool:
    """Whether an earlier stage (or the input model) left the layer quantized at exactly `args`."""
    return bool(record.get("weights")) and QuantArgs(**record["weights"]) == args


class _ActivationSTE:
    """Forward pre-hook: round the layer's input as the saved model does, pass the gradient straight through."""

    def __init__(self, args: QuantArgs):
        self.quantizer = activations.ActivationFakeQuant(args)  # the saved model's own input rounding

    def __call__(self, module, inputs):
        x = inputs[0]
        q = self.quantizer.rounded(x.detach())
        return (x + (q - x).detach(), *inputs[1:])


class QAT(DistillLoss, QuantizationStage):
    """Fine-tune the target layers through fake quantization, distilling from the input model."""

    scales: Optional[Literal["learned", "fixed", "rtn"]] = Field(
        None, description="learned: LSQ step sizes; fixed: the starting ones; rtn: round-to-nearest's of the current weights "
        "at every step (default: learned on integer grids, rtn on float grids, which take only rtn)")
    scale_lr: Optional[float] = Field(None, gt=0, description="peak learning rate of the scales' logarithm: about the share by which a "
                                    "step size changes per step (default: train.lr)")
    freeze: list[Pattern] = Field(default_factory=list, description="parameters kept fixed: name patterns (suffix, or re:)")
    keep_start_if_worse: bool = Field(True, description="when training ends with a higher held-out KD (or loss, without "
                                      "a teacher) than it started with, keep the starting grid (the earlier stage's, or round-to-nearest's)")
    data: TrainingData = Field(default_factory=TrainingData)
    train: TrainingConfig = Field(default_factory=TrainingConfig)

    @model_validator(mode="after")
    def _trainable_scheme(self) -> "QAT":
        scheme = self.resolved_scheme()
        if scheme.weights.type != "int" and self.scales not in (None, "rtn"):
            raise ValueError(f"scales: {self.scales} trains integer grids' step sizes; a float grid's scales follow its "
                             "weights (FP8's step, MX's powers of two, NVFP4's group scales): use scales: rtn, the default there")
        act = scheme.input_activations
        if act is not None and not act.dynamic:
            raise ValueError("qat trains through dynamic activations only (a static range is calibrated on the final "
                             "weights: add an rtn stage after qat, or use a dynamic activation scheme)")
        return self

    @property
    def scale_mode(self) -> str:
        """The scales as trained: `scales`, or its default for the weights' grid."""
        return self.scales or ("learned" if self.resolved_scheme().weights.type == "int" else "rtn")

    @property
    def needs_calibration(self) -> bool:
        return self.data.dataset is None and self.data.generate is None

    def preflight_shapes(self, model: torch.nn.Module, records: dict[str, dict], source: torch.nn.Module) -> None:
        self._check_teacher(records, getattr(source.config, "_name_or_path", None) or None)
        check_training(self, "qat", model, int(model.config.num_hidden_layers), source.config)

    def _check_teacher(self, records: dict[str, dict], source_model: str | None) -> None:
        """The default teacher is the input model: when that is already quantized it would teach
        its own rounding, and the KL it reports would be against it, not the float model."""
        if uses_teacher(self, "qat") and self.teacher is None and input_is_quantized(records, source_model):
            raise CompressError(f"stage qat: the input model{' ' + source_model if source_model else ''} is quantized, and "
                                "with no teacher set it would distill from itself",
                                "set the stage's teacher to the float model it came from, or kd_weight: 0 and ce_weight: 1 "
                                "to train on the text alone")

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        scheme = self.resolved_scheme()
        wargs = scheme.weights
        modules = self.select(model, "qat")
        masks = pruning_masks(model, ctx)  # before the weights become parametrized
        self._check_teacher(ctx.layers, ctx.source_model)
        teacher, teacher_ref = load_teacher(self.teacher, model, ctx, "qat") if uses_teacher(self, "qat") else (None, None)
        # Layers that arrive quantized (an earlier stage's grid, or the input's): what QAT received
        # is not float, so its change from them is not the layer's error. Where QAT keeps that grid,
        # the earlier error still describes it; on another grid (W8 in, W4 out) it does not.
        arrived_quantized = {n: _arrives_on(ctx.layers[n], wargs) for n in modules if "weights" in ctx.layers.get(n, {})}
        mode = self.scale_mode
        # the value a fused group shares, fixed for the run as rtn fixes it: the earlier stage's own
        # where the layer arrives on this scheme (from its rounded weights it could differ)
        shared = global_scales(modules, wargs) if mode == "rtn" else {}
        for name in shared:
            recorded = recorded_shared_scale(wargs, ctx.layers[name]) if arrived_quantized.get(name) else None
            shared[name] = shared[name] if recorded is None else recorded
        before, scales, hooks = {}, [], []
        for name, module in modules.items():
            weight = get_weight(module)
            check_weight(name, weight)
            before[name] = weight
            transposed = type(module).__name__ == "Conv1D"
            if mode == "rtn":
                fq = RoundToNearestWeight(module.weight, wargs, shared.get(name), transposed)
                with torch.no_grad():
                    start = fq(module.weight)
                check_fits_dtype(name, start.float(), module.weight.dtype, wargs)  # refused before training, not as a NaN loss
                origin = "round-to-nearest"
                if arrived_quantized.get(name):  # an earlier stage's weights on this grid: what rtn's rounding keeps of them
                    earlier = ctx.layers[name].get("stage", "earlier stage")
                    moved = int((start != module.weight).sum())
                    # a group whose largest code is below the grid's largest (GPTQ's NVFP4 or FP8 steps,
                    # fixed before its updates) takes a smaller step from rtn: those groups are re-rounded
                    origin = (f"{earlier} grid" if not moved else
                              f"round-to-nearest of {earlier}'s weights ({moved} of {start.numel()} moved)")
            else:
                qparams, origin = self._initial_qparams(name, module, weight, wargs, ctx)
                fq = FakeQuantWeight(module.weight, wargs, qparams, mode == "learned", transposed)
                if mode == "learned":
                    scales.append(fq.log_scale)
            parametrize.register_parametrization(module, "weight", fq)
            ctx.layers.setdefault(name, {})["qat_init"] = origin
            if scheme.input_activations is not None:
                hooks.append(module.register_forward_pre_hook(_ActivationSTE(scheme.input_activations)))

        trainable = trainable_parameters(model, self.freeze, "qat")
        trainable = [p for p in trainable if not any(p is s for s in scales)]
        extra = [{"params": scales, "lr": self.scale_lr or self.train.lr, "weight_decay": 0.0}] if scales else []
        def break_ties() -> None:
            generator = seeded_generator(ctx.seed)
            with torch.no_grad():
                for module in modules.values():
                    fq = module.parametrizations.weight[0]
                    if isinstance(fq, RoundToNearestWeight) and fq.stored_dtype in (torch.bfloat16, torch.float16):
                        break_half_precision_ties(module.parametrizations.weight.original, fq, generator)

        def onto_grid() -> None:
            """After the last step: each float32 weight becomes its quantized value, so the codes
            saved are those training reached (rounding the float32 weights to a half-precision
            dtype first would move some across a rounding boundary), and the held-out figure
            measured next is the saved model's."""
            with torch.no_grad():
                for module in modules.values():
                    module.parametrizations.weight.original.copy_(module.weight)

        try:
            summary = run_training(self, "qat", model, teacher, teacher_ref, ctx, self.data, self.train,
                                   trainable=trainable, extra_groups=extra, masks=masks, settle=onto_grid,
                                   starting="the starting weights and grid", begin=break_ties)
        finally:
            for h in hooks:
                h.remove()
        errors = []
        # The float weights a layer's error is measured against: what QAT received, unless an
        # earlier stage had already quantized it (GPTQ then QAT): then the input model's own,
        # which the teacher is by default.
        source = teacher if teacher is not None and teacher_ref == ctx.source_model else None
        for name, module in modules.items():
            with torch.no_grad():
                fq = module.parametrizations.weight[0]
                if isinstance(fq, FakeQuantWeight):
                    fq.fix_scale(storable_scale(fq.current_scale()))  # learned steps, as the checkpoint's dtype holds them
                final = module.weight.detach().clone()  # the parametrized, quantized weight
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
            check_fits_dtype(name, final, module.weight.dtype, wargs)
            set_weight(module, (final.t() if type(module).__name__ == "Conv1D" else final).float())
            rec = ctx.layers[name]
            forget_shared_scale(rec)
            final = get_weight(module)
            change = relative_error(before[name], final)
            err, against = change, "the weights qat received"
            if name in arrived_quantized:
                earlier = rec.get("stage", "an earlier stage")
                float_weight = _source_weight(source, input_layer_name(model, name), final.shape, rec)
                if float_weight is not None:
                    err, against = relative_error(float_weight, final), "the input model's weights"
                elif arrived_quantized[name] and "relative_error" in rec:
                    # no float weight to compare with, same grid: the earlier stage's error stands, the change beside it
                    err, against = rec["relative_error"], f"the weights {earlier} received (before qat)"
                else:
                    against = f"the weights qat received ({earlier}'s, on another grid: the float model's were not at hand)"
            errors.append(err)
            rec.update({"stage": "qat", "shape": list(before[name].shape), "weights": wargs.model_dump(mode="json"),
                        "relative_error": err, "relative_error_against": against, "qat_relative_change": change,
                        "scales": mode, **scale_record(wargs, shared.get(name))})
            if scheme.input_activations is not None:
                activations.attach(module, scheme.input_activations)
                rec["input_activations"] = scheme.input_activations.model_dump(mode="json")
        summary.update({"scheme": scheme.describe() + f", QAT ({mode} scales)", "layers": len(modules),
                        "mean_relative_error": sum(errors) / len(errors), "max_relative_error": max(errors)})
        return summary

    @staticmethod
    def _initial_qparams(name: str, module: torch.nn.Module, weight: torch.Tensor, args: QuantArgs,
                         ctx: StageContext) -> tuple[QParams, str]:
        """The grid the weight is already on when an earlier stage quantized it at this scheme
        (verified exactly), else round-to-nearest's."""
        qmin, qmax = int_range(args.num_bits, args.symmetric and not args.full_range)
        if _arrives_on(ctx.layers.get(name, {}), args) and args.strategy in ("channel", "group", "tensor"):
            stored = module.weight.detach()
            stored = stored.t() if type(module).__name__ == "Conv1D" else stored
            try:
                scale, zero, failed = recover_qparams(stored, args.num_bits, args.symmetric, args.strategy, args.group_size)
            except ValueError:
                failed = 1
            if not failed:
                zero = torch.zeros_like(scale) if zero is None else zero.float()
                if args.strategy == "group":
                    scale, zero = scale.unsqueeze(-1), zero.unsqueeze(-1)
                elif args.strategy == "tensor":
                    scale, zero = scale.reshape(1, 1), zero.reshape(1, 1)
                return QParams(scale.float(), zero, qmin, qmax), f"{ctx.layers[name].get('stage', 'earlier stage')} grid"
        return (compute_qparams(weight, args.num_bits, args.symmetric, args.strategy, args.group_size, args.full_range),
                "round-to-nearest")
