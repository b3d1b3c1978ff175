"""`compress plan`: what a recipe would do to a model, from its config alone (no weights loaded).

The model is built on the meta device, so shapes and names are exact while no memory is used.
After a stage that reshapes the model (structured pruning, distillation into kept layers) the
later stages are planned on the shapes it leaves (pipeline.StageShapes): the first channels, heads
or blocks stand in for those calibration will keep, which gives the same shapes (only the names of
the kept blocks' per-layer kinds, on models whose blocks differ, may differ from the run's).
"""

from __future__ import annotations

import torch

from compress import modeling, packing
from compress.errors import CompressError
from compress.pipeline import (StageShapes, check_data_files, check_offloadable, check_sequence_lengths, inherited_records,
                               preflight, requantized_warning, stage_weights, tied_layers)
from compress.recipe import Recipe
from compress.schemes import QuantArgs, QuantScheme, packed_weight_bits, scale_bits_of
from compress.sparsity import parse_pattern
from compress.targets import LINEAR_TYPES, mixed_fused_groups, mixed_fused_warning, select_modules, unused_patterns


def build_meta_model(model_ref: str):
    config = modeling.load_config(model_ref)
    with torch.device("meta"):
        net = modeling.model_class(config).from_config(config)
    return net, config


def _prunes_only_zeros(name: str, stage, target, before: dict | None, earlier: tuple[str, int] | None, cuts: int) -> bool:
    """Whether pruning to `target` can only remove weights an earlier pruning already zeroed: where
    every group the method compares within holds its share of zeros (a zero scores lowest in every
    method, and SparseGPT's updates for removing zeros are zero). `earlier`: what that pruning
    compared within ("N:M", "layer", or "part": rows or column blocks) and how many structured cuts
    came before it; `cuts`: how many came before this stage. An earlier N:M pattern gives every
    group of M its N, so every row, every block of whole groups and the layer have their share; a
    layer-wide magnitude pruning gives only the layer its count, which is what layer-wide magnitude
    compares within, not Wanda's rows nor SparseGPT's column blocks (magnitude 0.5 then Wanda 0.5
    leaves ref-llama's layers at up to 52 %); rows pruned to their share each round it per row,
    which a layer-wide count can exceed. A structured cut in between takes zeros away with the
    channels it removes."""
    if (before or {}).get("sparsity") is None:
        return False
    within, cuts_then = earlier or ("N:M" if before.get("pattern") else None, 0)  # an input model's own zeros
    if cuts_then != cuts:
        return False
    if before.get("pattern"):
        n, m = parse_pattern(before["pattern"])
        if target.pattern is not None:
            return target.pattern == before["pattern"]
        whole_groups = getattr(stage, "block_size", m) % m == 0  # SparseGPT's column blocks
        return target.sparsity <= n / m + 1e-9 and whole_groups
    if target.pattern is not None:
        return False
    return (name == "magnitude" and not getattr(stage, "per_row", False) and within == "layer"
            and before["sparsity"] >= target.sparsity - 1e-9)


def _describe(name: str, stage, target=None, alpha: float | None = None) -> str:
    """A stage without a quantization scheme, as the plan shows it on a layer: pruning, the
    layer's own target (`target`, from the stage's overrides) or else the stage's; smoothing, the
    layer's `alpha`."""
    if alpha is not None:
        return f"{name} alpha {alpha:g}"
    pattern = target.pattern if target is not None else getattr(stage, "pattern", None)
    if pattern:
        return f"{name} {pattern}"
    if target is not None:
        return f"{name} sparsity {target.sparsity:g}"
    if hasattr(stage, "sparsity"):
        return f"{name} sparsity {stage.sparsity if stage.sparsity is not None else 0.5:g}"
    return name


def _training_bytes(recipe: Recipe, params: int, model_bytes: int) -> int:
    """What a distill or qat stage holds besides the model: float32 gradients and AdamW's two
    moments for every parameter (an upper bound: frozen parts have none), and a teacher the size
    of the input model when it distills from one (a different teacher: its size is not known
    from this model's config, so the input model's stands in)."""
    most = 0
    for name, stage in recipe.stages:
        if name not in ("distill", "qat"):
            continue
        teacher = getattr(stage, "kd_weight", 0) > 0 or bool(getattr(stage, "hidden", None))
        most = max(most, 3 * params * 4 + (model_bytes if teacher else 0))
    return most


def _smoothed_mappings(net: torch.nn.Module, stage) -> list[tuple[str, list[str]]]:
    """(smooth op, balance layers) of every mapping a smoothing stage folds, by full name."""
    from compress.mappings import mapped_layers, mappings_for

    try:
        return mapped_layers(net, mappings_for(net, stage.mappings, stage.blocks), stage.blocks)
    except CompressError:  # refused by preflight, and so by the plan
        return []


def _smoothed_layers(net: torch.nn.Module, stage) -> list[str]:
    """The layers a smoothing stage rescales: each block's mapped smooth op and balance layers."""
    return [n for smooth, balance in _smoothed_mappings(net, stage) for n in (smooth, *balance)]


def _smoothing_alphas(net: torch.nn.Module, stage) -> dict[str, float]:
    """The layers SmoothQuant balances (its maps' layers it does not `ignore`), each with the alpha
    its mapping takes (alpha_overrides, as the run resolves them)."""
    selected = select_modules(net, ["Linear"], stage.ignore)
    alphas = {}
    for _, balance in _smoothed_mappings(net, stage):
        names = [n for n in balance if n in selected]
        alpha = stage.alpha_for({n: selected[n] for n in names})
        alphas.update({n: alpha for n in names})
    return alphas


def _format(recipe: Recipe, net: torch.nn.Module, assignments: dict, unpackable: list[str], exact: bool,
            dtype: torch.dtype) -> tuple[str, str, str | None]:
    """(format, why, refusal): what the run will write, decided as the run decides it
    (packing.decide, on the recipe's `format`), on the model as it will be saved. `unpackable`:
    layers the stages will leave off any grid the format holds. `refusal`: `format: packed` that
    cannot be. Not `exact`: the shapes saved depend on what calibration keeps; the run decides."""
    planned = {n: {"weights": a["weights"].model_dump(mode="json"),  # the records a run writes, as the format reads them
                   **({"input_activations": a["activations"].model_dump(mode="json")} if a["activations"] else {})}
               for n, a in assignments.items() if a["weights"]}
    if not exact and not unpackable and planned and recipe.format != "dense" and recipe.offload != "disk":
        return "packed", "if every quantized layer can be packed once the model is reshaped (decided when saving)", None
    kv_cache = any(name == "kv_cache" for name, _ in recipe.stages)
    try:
        decision = packing.decide(net, planned, recipe.format, offloaded=recipe.offload == "disk", kv_cache=kv_cache,
                                  known=unpackable, dtype=dtype)
    except CompressError as exc:  # format: packed, and some layer cannot be
        return "packed", exc.message, str(exc)
    return decision.format, decision.reason, None


def _linear_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Every linear layer's [out, in], in the model's order."""
    return {n: list(modeling.weight_shape(m)) for n, m in model.named_modules() if type(m).__name__ in LINEAR_TYPES}


def _trained_layers(recipe: Recipe, model: torch.nn.Module, linear: list[str]) -> dict[str, list[str]]:
    """layer -> the distill stages that train its weight (those its `freeze` patterns leave)."""
    from compress.stages.distill import frozen_parameters

    trained: dict[str, list[str]] = {}
    listed = {id(p): k for k, p in model.named_parameters()}  # a tied weight (lm_head) under its first name
    for name, stage in recipe.stages:
        if name != "distill":
            continue
        try:
            frozen = frozen_parameters(model, stage.freeze, name)
        except CompressError:  # refused by the run's own checks, which the plan lists
            frozen = {}
        for n in linear:
            if not frozen.get(listed.get(id(model.get_submodule(n).weight), f"{n}.weight"), False):
                trained.setdefault(n, []).append(name)
    return trained


def _untargeted(recipe: Recipe, shape: list[int], input_shape: list[int] | None, trained: list[str]) -> dict:
    """A layer no quantization or pruning stage selects: its shape as saved, and the stages that
    still change it: a structured cut (its shape differs from the input's) and training."""
    cut = ["structured"] if shape != input_shape and any(name == "structured" for name, _ in recipe.stages) else []
    return {"shape": shape, "stage": " → ".join(cut + trained) or "-",
            "cut_from": input_shape if input_shape is not None and shape != input_shape else None}


def _listed(layers: list[str]) -> str:
    """The first three of a warning's layers, and how many more."""
    return ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")


def _as_stored(assignment: dict) -> QuantArgs:
    """A layer's weight scheme at the code width the format stores (int8 codes for W4A8)."""
    from compress.packing import stored_code_bits

    w, a = assignment["weights"], assignment["activations"]
    if w.fp4_format:
        return w
    width = stored_code_bits(w.model_dump(mode="json"), a.model_dump(mode="json") if a is not None else None)
    return w if width == w.num_bits else w.model_copy(update={"num_bits": width})


def make_plan(recipe: Recipe, model_ref: str, dtype: str = "auto") -> dict:
    """`dtype`: --dtype as the run would get it (auto: the checkpoint's own)."""
    if dtype != "auto" and dtype not in modeling.DTYPES:
        raise CompressError(f"unknown dtype {dtype!r}", f"use auto or one of {', '.join(modeling.DTYPES)}")
    net, config = build_meta_model(model_ref)
    dtype = modeling.DTYPES[dtype] if dtype != "auto" else modeling.saved_dtype(config)
    dtype_bits = dtype.itemsize * 8
    # What the run refuses before any work, the plan refuses too (and exits as the run would).
    refusals = []
    for check in (lambda: check_data_files(recipe), lambda: check_sequence_lengths(recipe, config),
                  lambda: check_offloadable(recipe) if recipe.offload == "disk" else None,
                  lambda: modeling.check_offload_model(net, model_ref) if recipe.offload == "disk" else None):
        try:
            check()
        except CompressError as exc:
            refusals.append(str(exc))
    inherited = inherited_records(model_ref)  # a compress output: what its layers came with
    refusals += [str(exc) for exc in preflight(recipe, net, inherited=inherited)]
    params = sum(p.numel() for p in net.parameters())
    assignments: dict[str, dict] = {}  # layer -> what the stages do to it; names and shapes follow reshaping stages
    warnings: list[str] = []
    partial: dict[tuple[int, str, int], list[str]] = {}  # (stage, name, group size) -> layers with a partial last group
    requantized: dict[tuple[int, str, str], list[str]] = {}  # (stage, name, earlier scheme) -> layers quantized twice
    repruned: dict[tuple[int, str, str], list[str]] = {}  # (stage, name, what it prunes to) -> layers already as sparse
    pruned_within: dict[str, tuple[str, int]] = {}  # layer -> what its last pruning compared within, cuts before it
    unpackable: dict[str, str] = {}  # layer -> why the format cannot hold what its stages leave
    guessed = False
    with StageShapes(recipe, net, assignments) as walk:
        modules = dict(walk.model.named_modules())
        input_shapes = _linear_shapes(walk.model)
        for n, rec in inherited.items():
            if n in modules:
                weights = QuantArgs(**rec["weights"]) if rec.get("weights") else None
                assignments[n] = {"stage": rec["stage"], "shape": list(modeling.weight_shape(modules[n])),
                                  "scheme": weights.describe() if weights else f"pruned {rec.get('pattern') or rec.get('sparsity')}",
                                  "weights": weights, "activations": None,
                                  "sparsity": rec.get("sparsity"), "pattern": rec.get("pattern")}
        for i, (name, stage, model) in enumerate(walk):
            cuts = sum(1 for earlier, _ in recipe.stages[:i] if earlier == "structured")
            if not walk.exact and not guessed:
                guessed = True
                warnings.append(f"stage {i + 1} ({name}) and later ones are planned on a guess: the blocks an earlier "
                                "structured stage removes are chosen by calibration, and this model's blocks differ "
                                "(the plan keeps the first ones); the run checks them when they start")
            if name == "smoothquant":  # it rescales the layers its maps name: off any grid an earlier stage left
                for n in _smoothed_layers(model, stage):
                    if (assignments.get(n) or {}).get("weights") is not None:
                        unpackable[n] = f"{n}, rescaled by smoothquant after it was quantized"
            targets = getattr(stage, "targets", None)
            alphas = _smoothing_alphas(model, stage) if name == "smoothquant" else {}
            if targets is None and not alphas:
                continue
            ignore = getattr(stage, "ignore", [])
            for p in unused_patterns(model, targets or []):
                warnings.append(f"stage {i + 1} ({name}): target '{p}' matches no linear layer")
            if "ignore" in getattr(stage, "model_fields_set", {"ignore"}):  # the default lm_head, on an encoder, is no news
                for p in unused_patterns(model, ignore):
                    warnings.append(f"stage {i + 1} ({name}): ignore entry '{p}' matches no linear layer")
            chosen = {n: model.get_submodule(n) for n in alphas} if alphas else select_modules(model, targets, ignore)
            head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
            if not chosen and not hasattr(stage, "select"):  # one with select is refused (pipeline.preflight)
                warnings.append(f"stage {i + 1} ({name}): selects no layer at all")
            elif head is not None and any(m is head for m in chosen.values()):
                head_name = next(n for n, m in chosen.items() if m is head)
                tied = tied_layers(model, {head_name: head}).get(head_name)
                warnings.append(f"stage {i + 1} ({name}): selects the output layer {head_name} too; is that meant?"
                                + (f" Its weight is tied to {tied}, which changes with it" if tied else ""))
            scheme = stage.resolved_scheme() if hasattr(stage, "resolved_scheme") else None
            joint = stage_weights(stage) if scheme is None else None  # SparseGPT's `quantize:`
            rescales = scheme is not None and stage_weights(stage) is None  # AWQ's quantize: false scales only
            rescaled = f"{name} scales for {scheme.describe()} (quantize: false)" if rescales else None
            if rescales:
                scheme = None
            # GPTQ's act-order without static groups mixes scales within a group: the run writes dense
            mixed = (getattr(stage, "reorders_columns", False) and not getattr(stage, "fixed_group_scales", False)
                     and scheme is not None and bool(scheme.weights.column_groups))
            try:  # a pruning stage's target per layer (an override or N:M that does not fit is refused by preflight)
                pruned_to = stage.layer_targets(chosen, name) if hasattr(stage, "layer_targets") else {}
            except CompressError:
                pruned_to = {}
            for n, m in chosen.items():
                out_f, in_f = modeling.weight_shape(m)
                target = pruned_to.get(n)
                described = rescaled or (_describe(name, stage, target, alphas.get(n)) + (f" + {joint.describe()}" if joint else ""))
                entry = {"stage": name, "shape": [out_f, in_f], "scheme": scheme.describe() if scheme else described,
                         "weights": scheme.weights if scheme else joint,
                         "activations": scheme.input_activations if scheme else None}
                if n in alphas:  # as the run records it
                    entry["smoothquant_alpha"] = alphas[n]
                if mixed:
                    unpackable[n] = f"{n}, solved by GPTQ with actorder: group (its groups mix scales)"
                elif entry["weights"] is not None:
                    unpackable.pop(n, None)  # quantized again, on its own grid
                before = assignments.get(n)
                if rescales and (before or {}).get("weights") is not None:
                    unpackable[n] = f"{n}, rescaled by {name} after it was quantized"
                # Quantized, then quantized again: the second grid rounds the first one's values
                # (rtn W8A16 then rtn W4A16). QAT at the same scheme is meant to start from it.
                if (before or {}).get("weights") is not None and entry["weights"] is not None and \
                        not (name == "qat" and before["weights"] == entry["weights"]):
                    requantized.setdefault((i, name, f"{before['stage']}: {before['scheme']}"), []).append(n)
                if target is not None:
                    entry.update(sparsity=target.sparsity, pattern=target.pattern)
                    if _prunes_only_zeros(name, stage, target, before, pruned_within.get(n), cuts) and entry["weights"] is None:
                        repruned.setdefault((i, name, target.describe()), []).append(
                            f"{n} ({before.get('pattern') or format(before['sparsity'], 'g')})")
                    layer_wide = name == "magnitude" and not getattr(stage, "per_row", False)
                    pruned_within[n] = ("N:M" if target.pattern else "layer" if layer_wide else "part", cuts)
                if before is not None and "scheme" in before:  # stages chain on a layer: pruned, then quantized, ...
                    entry["stage"] = f"{before['stage']} → {name}"
                    entry["scheme"] = f"{before['scheme']} → {entry['scheme']}"
                    if entry["weights"] is None:  # a later stage that does not quantize keeps the earlier grid
                        entry["weights"], entry["activations"] = before["weights"], before["activations"]
                    if entry.get("sparsity") is None and before.get("sparsity") is not None:  # and the zeros
                        entry["sparsity"], entry["pattern"] = before["sparsity"], before.get("pattern")
                    if "smoothquant_alpha" in before:
                        entry.setdefault("smoothquant_alpha", before["smoothquant_alpha"])
                assignments[n] = entry
                if scheme and scheme.weights and scheme.weights.strategy == "group" and in_f % scheme.weights.group_size:
                    partial.setdefault((i, name, scheme.weights.group_size), []).append(f"{n} ({in_f})")
        shapes = _linear_shapes(walk.model)  # as saved: after every cut
        linear = list(shapes)
        trained = _trained_layers(recipe, walk.model, linear)
        order = {n: i for i, n in enumerate(linear)}  # experts unfused here, as the stages see them
    for n in [n for n, a in assignments.items() if "scheme" not in a]:
        del assignments[n]  # the shape a cut recorded of a layer no stage selects
    # in the model's order, whichever stage (or the input model's records) named a layer first
    assignments = dict(sorted(assignments.items(), key=lambda item: order.get(item[0], len(order))))
    unpackable = {n: why for n, why in unpackable.items() if n in assignments}  # layers of removed blocks go
    for (i, name, group), layers in partial.items():
        warnings.append(f"stage {i + 1} ({name}): {len(layers)} layer{'s' if len(layers) > 1 else ''} with an input width "
                        f"that is not a multiple of group_size {group}, whose last group is partial: {_listed(layers)}")
    for (i, name, target), layers in repruned.items():
        warnings.append(f"stage {i + 1} ({name}) prunes {len(layers)} layer{'s' if len(layers) > 1 else ''} to {target} "
                        f"that an earlier stage already pruned as far: it changes nothing there: {_listed(layers)}")
    for (i, name, earlier), layers in requantized.items():
        warnings.append(f"{requantized_warning(i, name, earlier, len(layers))}: {_listed(layers)}")
    saved = walk.model  # as it will be saved: reshaped, experts fused
    fmt, fmt_reason, refused = _format(recipe, saved, assignments, list(unpackable.values()), walk.exact, dtype)
    if refused:
        refusals.append(refused)
    if fmt == "packed":
        schemes = {n: QuantScheme(weights=a["weights"], input_activations=a["activations"]).describe()
                   for n, a in assignments.items() if a["weights"] is not None}
        mixed = mixed_fused_groups(linear, schemes)
        if mixed:
            warnings.append(mixed_fused_warning(mixed))
    params_after = sum(p.numel() for p in saved.parameters())

    quantized_params = sum(a["shape"][0] * a["shape"][1] for a in assignments.values() if a["weights"])
    packed_bits = sum(packed_weight_bits(*a["shape"], _as_stored(a), scale_bits_of(dtype)) for a in assignments.values() if a["weights"])
    packed_bits += (params_after - quantized_params) * dtype_bits
    model_bytes = params * dtype.itemsize
    largest = max((a["shape"][0] * a["shape"][1] for a in assignments.values()), default=0)
    cal = recipe.calibration
    hidden = getattr(config, "hidden_size", 0) or 0
    # Stages that keep more than the engine's one stream of block inputs (AutoRound: the float
    # model's path and its targets too) say how many with `activation_copies`.
    copies = max((getattr(stage, "activation_copies", 1) for _, stage in recipe.stages), default=1)
    act_bytes = (cal.num_samples * cal.seq_len * hidden * 4 * copies) if cal else 0
    eval_bytes = params * 4 * 2 if recipe.evaluation and recipe.evaluation.datasets else 0
    train_bytes = _training_bytes(recipe, params, model_bytes)
    return {
        "model": model_ref,
        "architecture": (getattr(config, "architectures", None) or ["?"])[0],
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": params,
        "parameters_after": params_after,  # fewer where a stage removes channels, heads or blocks
        "linear_layers": len(linear),
        "assignments": {n: {k: (v.describe() if isinstance(v, QuantArgs) else v) for k, v in a.items()} for n, a in assignments.items()},
        "unassigned": [n for n in linear if n not in assignments],
        # what the stages that select no layers (structured cuts, distillation's training) do to the rest
        "unassigned_detail": {n: _untargeted(recipe, shapes[n], input_shapes.get(n), trained.get(n, []))
                              for n in linear if n not in assignments},
        "warnings": warnings,
        "refusals": refusals,
        "format": fmt,
        "format_reason": fmt_reason,
        "estimates": {
            # The model in its dtype, a float32 working copy of the largest layer (x3: weight,
            # its quantized copy, and scratch), the calibration activations of one layer input,
            # and for the evaluation a float32 copy of the model and of the baseline.
            # Training stages add their optimizer state and teacher (_training_bytes).
            "peak_memory_bytes": model_bytes + 3 * largest * 4 + act_bytes + eval_bytes + train_bytes,
            "training_bytes": train_bytes,
            "output_bytes_dequantized": params_after * dtype.itemsize,
            "output_bytes_packed": packed_bits // 8,
            "bits_per_parameter_packed": packed_bits / params_after,
        },
    }
