"""Running a recipe end to end, and evaluating a checkpoint: the Python API behind the CLI.

    load model -> build calibration set (if a stage needs one) -> run stages in order
    -> save into a temporary directory -> evaluate against the untouched original -> move into place
"""

from __future__ import annotations

import inspect
import json
import numbers
import os
import shutil
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable

import torch
import yaml

from compress import activations, modeling, packing, tasks as lm_tasks
from compress.calibration import build_calibration, draw_seed, is_local_spec, read_texts, resolve_data_path
from compress.checkpoint import INCOMPLETE_MARKER, AtomicOutput, PeakMemory, dir_weight_bytes, kill_point, watch_progress
from compress.errors import CompressError
from compress.evaluate import eval_sentences, eval_windows, evaluate, gate, task_gate, threshold_problem
from compress.launcher import process_rank
from compress.moe import fuse_experts, fused_experts_of, unfuse_experts
from compress.quant import scales_stored_as
from compress.recipe import EvaluationConfig, Recipe
from compress.report import versions, write_json, write_reports
from compress.schemes import QuantArgs, QuantScheme, packed_weight_bits
from compress.seeding import seed_everything
from compress.stages import STAGES
from compress.stages.base import INPUT_MODEL, StageContext
from compress.targets import LINEAR_TYPES, mixed_fused_groups, mixed_fused_warning

Progress = Callable[[str, int, int], None]


def pick_device(device: str = "auto") -> torch.device:
    """`--device`'s device; given several (cuda:0,cuda:1), the first: see pick_devices."""
    return pick_devices(device)[0]


def pick_devices(spec: str = "auto") -> list[torch.device]:
    """`--device`: auto, cpu, cuda, cuda:N, or several comma-separated (cuda:0,cuda:1). Blocks are
    calibrated on the first; GPTQ's and SparseGPT's per-layer solves are spread over all of them
    (a device named twice gets two workers)."""
    devices = []
    for device in [d.strip() for d in spec.split(",") if d.strip()] or ["auto"]:
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise CompressError(f"unknown device {device!r}", "use auto, cpu, cuda or cuda:N (several: cuda:0,cuda:1)")
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise CompressError(f"--device {device} was asked but no CUDA device is available", "use --device auto or cpu")
            index = device.partition(":")[2]
            if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
                raise CompressError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)",
                                    f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
            device = f"cuda:{int(index) if index else torch.cuda.current_device()}"
        devices.append(torch.device(device))
    return devices


def run_recipe(recipe: Recipe, model: str | None = None, output: str | None = None, force: bool = False,
               device: str = "auto", dtype: str = "auto", seed: int = 0,
               progress: Progress | None = None, format: str | None = None, resume: bool = False,
               baseline: str | None = None, cache_dir: str | None = None) -> dict:
    """Run every stage of `recipe` and write the compressed checkpoint; returns report.json's content.

    `format`: packed (compressed-tensors), dense (dequantized weights in the model's dtype) or auto
    (packed when every quantized layer can be expressed); overrides the recipe's `format:`.
    `resume` (or a `cache_dir`): store each completed stage in the stage cache and start after the
    last stage already there (compress.stagecache); a training stage that was interrupted continues
    from its newest checkpoint in the work directory beside the output (kept when a run stops
    early, removed when it completes). `baseline`: the model the output is evaluated against
    (default: the input model; `compress distill` gives the teacher).

    Under `accelerate launch` every process runs the stages (training stages split their batches
    across processes); only the main process saves, evaluates and returns the report, the others
    return {"skipped": True}."""
    progress = progress or (lambda *_: None)
    if not isinstance(recipe, Recipe):
        raise CompressError(f"recipe: expected a Recipe, got a {type(recipe).__name__}",
                            "pass load_recipe(PATH) or parse_recipe(TEXT)")
    model, output = modeling.model_reference(model, "model"), modeling.model_reference(output, "output")
    baseline, cache_dir = modeling.model_reference(baseline, "baseline"), modeling.model_reference(cache_dir, "cache_dir")
    requested = format or recipe.format
    if requested not in ("auto", "packed", "dense"):
        raise CompressError(f"unknown format {requested!r}", "use packed, dense or auto")
    if requested == "packed" and recipe.offload == "disk" and any(stage_weights(st) for _, st in recipe.stages):
        raise packing.OFFLOADED_NOT_PACKABLE
    model_ref = model or recipe.model
    if not model_ref:
        raise CompressError(f"{recipe.source}: no model given", "set `model:` in the recipe or pass --model")
    out_dir = output or recipe.output
    if not out_dir:
        raise CompressError(f"{recipe.source}: no output directory given", "set `output:` in the recipe or pass --output")
    model_path = modeling.resolve_model(model_ref)
    # inputs that must survive the output's replacement: the model, a distillation teacher
    inputs = [model_path] + [modeling.resolve_model(t) for _, st in recipe.stages if isinstance(t := getattr(st, "teacher", None), str)]
    protect = [p for p in inputs if Path(p).exists()]
    main_process = process_rank() == 0
    # refuses a bad destination before any work
    atomic = AtomicOutput(out_dir, force=force, protect=protect) if main_process else nullcontext()
    dest = Path(out_dir).expanduser().resolve()
    check_data_files(recipe)
    model_config = modeling.load_config(model_ref)
    check_sequence_lengths(recipe, model_config)
    task_request = recipe.evaluation.tasks if recipe.evaluation is not None else None
    task_manager = None
    if task_request is not None:
        task_manager = lm_tasks.prepare(task_request, modeling.is_causal_lm(model_config), model_ref)
    cache_root = None
    if resume or cache_dir:
        from compress import stagecache

        cache_root = stagecache.prepare(cache_dir, recipe, inputs=protect, output=dest)
    if recipe.offload == "disk":
        check_offloadable(recipe)
        if Path(model_path).is_dir() and packing.is_packed(model_path):
            raise CompressError(f"offload: disk reads dense checkpoints; {model_ref} is packed (compressed-tensors)",
                                "drop offload: disk, or start from a checkpoint written with --format dense")
        from compress.offload import fixed_mmap_threshold

        # Before anything large is allocated: a heap already fragmented by loading and tokenizing
        # keeps its size, and the threshold then only helps from there on (make bench measured the
        # 12-layer offload peak at 899-946 MiB when it was set later, 735 MiB when set here).
        fixed_mmap_threshold()
    devices = pick_devices(device)
    dev = devices[0]
    seed_everything(seed)
    progress = watch_progress(progress)

    progress("loading model", 0, 1)
    if recipe.offload == "disk":
        net, tokenizer, config = modeling.load_skeleton(model_ref, dtype=dtype)
    else:
        net, tokenizer, config = modeling.load_model(model_ref, dtype=dtype, device="cpu")
    kill_point("loaded")
    source = {
        "ref": model_ref,
        "path": model_path,
        "weights_sha256": modeling.weights_hash(model_ref),
        "dtype": str(next(net.parameters()).dtype).removeprefix("torch."),  # as the run loaded it (--dtype)
        "dtype_on_disk": str(modeling.saved_dtype(config)).removeprefix("torch."),
        "parameters": modeling.count_parameters(net),
        # the input's weight files (a packed checkpoint's, not its dequantized size in memory)
        "bytes": (dir_weight_bytes(model_path) if model_path and Path(model_path).is_dir() else 0) or modeling.model_bytes(net),
        "architecture": (getattr(config, "architectures", None) or [type(net).__name__])[0],
    }

    inherited = inherited_records(model_ref)
    refused = preflight(recipe, net, packed=requested == "packed", inherited=inherited)
    if refused:
        raise refused[0]
    calibration = None
    if recipe.calibration is not None:  # built even for stages that do not need it: its fingerprint is provenance
        progress("tokenizing calibration data", 0, 1)
        calibration = build_calibration(recipe.calibration, tokenizer, run_seed=seed, encoder=not modeling.is_causal_lm(config))
        kill_point("calibrated")
    # What evaluation will need is checked now, not after the stages have run for hours: local
    # evaluation files give the windows (or sentences) it scores (a conversation needs a chat
    # template; a file too short gives none), and lm-eval's chat_template.
    for spec in recipe.evaluation.datasets if recipe.evaluation else []:
        if resolve_data_path(spec) is not None:
            if modeling.is_causal_lm(config):
                eval_windows(tokenizer, spec, recipe.evaluation.seq_len, recipe.evaluation.max_windows)
            else:
                eval_sentences(spec, recipe.evaluation.max_sentences, tokenizer=tokenizer)
    if task_request is not None:
        lm_tasks.check_tokenizer(task_request.chat_template, tokenizer)

    report = {
        "versions": versions(),
        "recipe_source": recipe.source,
        "seed": seed,
        "device": str(dev),
        **({"devices": [str(d) for d in devices]} if len(devices) > 1 else {}),
        "offload": recipe.offload,
        "source_model": source,
        "calibration": None if calibration is None else {
            "source": calibration.source, "fingerprint": calibration.fingerprint,
            "num_samples": len(calibration.samples), "tokens": calibration.num_tokens,
            **({"shuffle_seed": draw_seed(recipe.calibration, seed)} if recipe.calibration.shuffle else {})},
    }
    ctx = StageContext(device=dev, devices=devices, calibration=calibration, seed=seed, progress=progress, tokenizer=tokenizer,
                       source_model=model_ref, source_hash=source["weights_sha256"], resume=resume or bool(cache_dir),
                       work_dir=dest.parent / f".{dest.name}.work")
    RUNNING["work_dir"] = ctx.work_dir  # for the interruption message: training checkpoints kept there
    RUNNING["offload"] = recipe.offload == "disk"  # ... and no stage cache (offload: disk refuses --resume)
    for name, record in inherited.items():
        ctx.layers[name] = dict(record)
    # An input written by compress with quantized activations or an FP8 KV cache keeps them, as it
    # is evaluated: the records start from what its load attached.
    ctx.kv_cache = activations.attached_kv(net)
    for name, record in activations.attached_inputs(net).items():
        ctx.layers.setdefault(name, {}).update(record)
    record_input_zeros(net, ctx.layers)
    cache = None
    if cache_root is not None:
        cache = stagecache.open_cache(cache_root, recipe, modeling.local_dir(model_ref), source, calibration, seed, devices)
    RUNNING["cache"] = cache  # for the interruption message: which stages a rerun would not redo
    with atomic as tmp:
        if recipe.offload == "disk":
            # Blocks stream from the input checkpoint through the engine into tmp's shards.
            from compress.engine import find_blocks
            from compress.offload import DiskOffload

            path, blocks = find_blocks(net, getattr(recipe.stages[0][1], "blocks", None))
            ctx.offload = DiskOffload(net, modeling.local_dir(model_ref), tmp, n_shards=len(blocks) + 1)
            ctx.offload.load_outside(path)
        report["stages"] = _run_stages(recipe, net, ctx, cache)
        if not main_process:
            return {"skipped": True, "rank": process_rank()}
        if cache is not None:
            report["cache"] = cache.describe()
        report["layers"] = ctx.layers
        warnings = [w for s in report["stages"] for w in s.get("warnings", [])]
        if warnings:
            report["warnings"] = warnings
        if ctx.kv_cache is not None:
            report["kv_cache"] = ctx.kv_cache

        progress("saving", 0, 1)
        decision = packing.decide(net, ctx.layers, requested, offloaded=ctx.offload is not None, kv_cache=ctx.kv_cache)
        packed = None
        if decision.format == "packed":
            try:
                packed = packing.pack_model(net, ctx.layers, ctx.kv_cache)
            except packing.NotPackable as exc:
                if requested == "packed":
                    raise
                decision = packing.Decision("dense", f"the packed format cannot reproduce it exactly: {exc.message}"
                                            + packing.dense_notes(ctx.layers, ctx.kv_cache))
        report["format"] = {"format": decision.format, "reason": decision.reason}
        if decision.format == "packed":
            mixed = mixed_fused_groups(_linear_names(net, ctx.layers), layer_schemes(ctx.layers))
            if mixed:
                report.setdefault("warnings", []).append(mixed_fused_warning(mixed))
        with saved_use_cache([net.config, config], modeling.load_config(model_ref)):
            if ctx.offload is not None:
                ctx.offload.finish()
                config.save_pretrained(tmp)
                generation = modeling.local_dir(model_ref) / "generation_config.json"
                if generation.is_file():
                    (tmp / generation.name).write_bytes(generation.read_bytes())
            elif decision.format == "packed":
                report["format"].update(packing.save_packed(net, ctx.layers, tmp, packed))
            else:
                net.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        kill_point("saving")
        effective = recipe.effective()
        if effective["calibration"] is not None:  # the seed the draw used, so that the saved recipe repeats it
            effective["calibration"]["seed"] = draw_seed(recipe.calibration, seed)
        effective["model"] = model_ref
        effective["output"] = str(out_dir)
        effective["format"] = requested
        (tmp / "recipe.yaml").write_text(yaml.safe_dump(effective, sort_keys=False))
        write_json(tmp / "compress.json", {
            "format": "compressed-tensors/1" if decision.format == "packed" else "compress-dequantized/1",
            "format_reason": decision.reason, "source_model": source, "stages": [n for n, _ in recipe.stages],
            "recipe": effective, "layers": ctx.layers, **({"kv_cache": ctx.kv_cache} if ctx.kv_cache else {})})
        report["output"] = size_summary(net, ctx.layers, tmp)
        if ctx.offload is None:
            report["output"].update(packing.quantized_size(tmp, net, ctx.layers))
        if recipe.evaluation is not None and (recipe.evaluation.datasets or task_request is not None):
            if ctx.offload is not None:
                report["evaluation_note"] = "skipped: the model was offloaded to disk; run `compress eval` on the output"
            else:
                _reset_model_dtype(net)
                reference, reference_tokenizer, _ = modeling.load_model(baseline or model_ref, dtype="float32", device=dev)
                report["evaluation"] = evaluate(
                    net.to(dev), tokenizer, recipe.evaluation.datasets, baseline=reference,
                    causal=modeling.is_causal_lm(config), **_eval_kwargs(recipe.evaluation), device=dev, progress=progress)
                if task_manager is not None:
                    report["tasks"] = lm_tasks.score(net, tokenizer, task_request, task_manager, recipe.evaluation.batch_size,
                                                     (reference, reference_tokenizer), progress=progress)
                del reference
                net.to("cpu")
        write_reports(tmp, report)
    shutil.rmtree(ctx.work_dir, ignore_errors=True)  # the run is complete: its checkpoints are spent
    RUNNING.update(work_dir=None, cache=None, offload=False)
    return report


# The run in progress in this process (the CLI runs one), for what an interruption leaves behind.
RUNNING: dict = {"work_dir": None, "cache": None, "offload": False}


def kept_training_step(work_dir: Path | None) -> int | None:
    """The newest complete training checkpoint's step in an interrupted run's work directory."""
    steps = [int(p.parent.name.removeprefix("step-")) for p in work_dir.glob("*/step-*/complete")] if work_dir else []
    return max(steps) if steps else None


def _run_stages(recipe: Recipe, net: torch.nn.Module, ctx: StageContext, cache=None) -> list[dict]:
    """Each stage in order, timed, with its peak memory; with a stage cache, the stages already
    in it are restored instead of run, and each stage run is stored."""
    reports = []
    swaps = unfuse_experts(net) if ctx.offload is None else []  # MoE experts as plain Linear layers meanwhile
    try:
        start = cache.restore(net, ctx, reports) if cache is not None else 0
        saved_dtype = next(net.parameters()).dtype  # a half-precision checkpoint holds its scales so too
        reshaped = None  # the first stage that changed the model's shapes
        for index, (name, stage) in enumerate(recipe.stages[start:], start):
            ctx.stage_index = index
            warnings = forget_earlier_grids(index, name, stage, net, ctx.layers)
            tied = tied_weights(name, stage, net)
            with PeakMemory() as mem, scales_stored_as(saved_dtype):
                summary = stage.apply(net, ctx)
            warnings += tied_warnings(index, name, net, tied) + [  # the stage's own, named as its stage where they are not
                w if w.startswith("stage ") else f"stage {index + 1} ({name}): {w}" for w in summary.pop("warnings", [])]
            reports.append({"name": name, "wall_s": mem.wall_s, "peak_rss_mib": mem.peak_rss / 2**20,
                            "peak_cuda_mib": mem.peak_cuda / 2**20, "summary": summary,
                            **({"warnings": warnings} if warnings else {})})  # stored with it in the stage cache
            if reshaped is None and getattr(stage, "reshapes", False):
                reshaped = f"stage {index + 1} ({name})"
            if cache is not None and reshaped is not None:
                # a rerun loads the model in its original shapes, which no entry from here on fits:
                # storing one would write the whole model for nothing
                cache.skipped[index] = f"after {reshaped}, which changes the model's shapes"
            elif cache is not None:
                cache.store(index, net, ctx, reports[-1])
            kill_point(f"stage-done:{index}")
        if ctx.offload is None:  # (offloaded blocks are on disk by now; no stage there moves pruned weights)
            _measure_sparsity(net, ctx.layers)  # while the experts are still their own Linear layers
    finally:
        fuse_experts(swaps)
    return reports


@contextmanager
def saved_use_cache(configs: list, source_config):
    """The input's `use_cache` in the config saved: loading turns it off for calibration's forward
    passes, which is not a property of the checkpoint (a plain forward on it would return no cache)."""
    value = getattr(source_config, "use_cache", None)
    before = [getattr(c, "use_cache", None) for c in configs]
    for c in configs:
        if value is not None and hasattr(c, "use_cache"):
            c.use_cache = value
    try:
        yield
    finally:
        for c, b in zip(configs, before):
            if b is not None:
                c.use_cache = b


# What an earlier quantization recorded of its own work (losses, token counts, notes, how its
# groups were solved): when a later stage quantizes the layer again, these describe weights that
# are gone. The grid (`weights`, replaced by the new stage's), the activation scheme and range
# (its fake-quant stays attached), zeros and smoothing still describe the layer and stay.
DROPPED_WHEN_REQUANTIZED = ("gptq_loss", "rtn_loss", "autoround_loss", "tuned_loss", "tokens", "damp_retries", "note",
                            "solved_together", "mixed_group_scales", "output_error", "rtn_output_error", "clip_ratio",
                            "search_tokens", "relative_error", "global_scale", "qat_init", "kept_rtn", "rounding_flipped",
                            "clip_alpha_mean", "clip_beta_mean")


def forget_earlier_grids(index: int, name: str, stage, net: torch.nn.Module, layers: dict[str, dict]) -> list[str]:
    """A quantization stage on layers an earlier stage (or the input model) already quantized
    rounds the earlier grid's values again (rtn W4 then rtn W8 stores W4's values as W8): say so,
    as `compress plan` does (the warnings returned), and drop what the earlier quantization
    recorded of its own work, which would otherwise stand beside the new stage's. QAT is meant to
    start from an earlier grid and reports against it itself: it is warned about only onto another
    grid, as the plan does, and its records are left alone."""
    weights = stage_weights(stage)
    if weights is None or not hasattr(stage, "select"):
        return []
    qat = name == "qat"
    again: dict[str, list[str]] = {}
    for n in stage.select(net, name):
        record = layers.get(n, {})
        if record.get("weights") is None or (qat and QuantArgs(**record["weights"]) == weights):
            continue
        earlier = f"{record.get('stage', 'an earlier stage')}: {QuantArgs(**record['weights']).describe()}"
        again.setdefault(earlier, []).append(n)
        if not qat:
            for key in DROPPED_WHEN_REQUANTIZED:
                record.pop(key, None)
            record["requantized_from"] = earlier
    tail = ("QAT trains from those values, and measures its errors against the input model's weights where it has them"
            if qat else "their errors are measured from those values, not from the float weights")
    return [requantized_warning(index, name, earlier, len(names)) + f": {tail} (first: {names[0]})"
            for earlier, names in again.items()]


def layer_schemes(layers: dict[str, dict]) -> dict[str, str]:
    """Each quantized layer's scheme as reports describe it, from its record."""
    return {n: QuantScheme(weights=r["weights"], input_activations=r.get("input_activations")).describe()
            for n, r in layers.items() if r.get("weights")}


def _linear_names(net: torch.nn.Module, layers: dict[str, dict]) -> list[str]:
    """The model's linear layers, and those a record names that are not modules (unfused experts)."""
    names = [n for n, m in net.named_modules() if type(m).__name__ in LINEAR_TYPES]
    seen = set(names)
    return names + [n for n in layers if n not in seen]


def tied_layers(net: torch.nn.Module, layers: dict[str, torch.nn.Module]) -> dict[str, str]:
    """Each of `layers` whose weight is the very tensor of another parameter (a tied lm_head and
    input embedding), with that parameter's name."""
    names: dict[int, list[str]] = {}
    for pname, param in net.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(pname)
    out = {}
    for name, module in layers.items():
        others = [p for p in names.get(id(getattr(module, "weight", None)), []) if p != f"{name}.weight"]
        if others:
            out[name] = others[0]
    return out


def tied_weights(name: str, stage, net: torch.nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """The stage's target layers whose weight is tied to another parameter: (that parameter's
    name, a copy of the weight as it is before the stage)."""
    if not hasattr(stage, "select"):
        return {}
    modules = dict(net.named_modules())
    return {layer: (other, modules[layer].weight.detach().to("cpu", copy=True))
            for layer, other in tied_layers(net, stage.select(net, name)).items()}


def tied_warnings(index: int, name: str, net: torch.nn.Module, tied: dict[str, tuple[str, torch.Tensor]]) -> list[str]:
    """A stage that changed a tied weight changed its twin too (the input embeddings of a model
    with tie_word_embeddings, when a recipe takes lm_head): say so, as nothing else would. (A stage
    that only targeted it, AWQ scaling other layers, changed nothing: no word.)"""
    modules = dict(net.named_modules())
    return [f"stage {index + 1} ({name}) changed {layer}, whose weight is tied to {other}: that changed too "
            f"(ignore {layer}, or untie the weights in the model, to keep it)"
            for layer, (other, before) in tied.items()
            if layer in modules and not torch.equal(modules[layer].weight.detach().cpu(), before)]


def requantized_warning(index: int, name: str, earlier: str, count: int) -> str:
    """What the run and `compress plan` say of a stage that quantizes already-quantized layers."""
    return (f"stage {index + 1} ({name}) quantizes {count} layer{'s' if count > 1 else ''} that are already quantized "
            f"({earlier}), rounding the earlier grid's values again")


def _measure_sparsity(net: torch.nn.Module, layers: dict) -> None:
    """A pruned layer's recorded sparsity is re-read from its final weights, so that a later stage
    that let pruned weights move off zero shows in the report."""
    modules = dict(net.named_modules())
    for name, rec in layers.items():
        if "sparsity" in rec and name in modules:
            w = modules[name].weight
            rec["sparsity"] = 1 - int(torch.count_nonzero(w)) / w.numel()


def reshapes(stage) -> bool:
    """Whether a stage changes the model's shapes (structured pruning; distillation into kept layers)."""
    return getattr(stage, "reshapes", False)


class StageShapes:
    """Each stage of a recipe with the model as that stage will see it, before any of them runs:
    `net` itself (experts unfused, as the stages see them) until a stage reshapes the model, then a
    meta-device twin cut as that stage will cut it (`stage.reshape`), so that checks and the plan
    of later stages see the shapes they will get. `records` (per layer, as StageContext.layers)
    follow the cuts. `exact` turns False when the shapes after a cut are not known: the cut cannot
    be made (its stage is refused anyway), or they depend on what calibration keeps (blocks that
    differ from each other; `reshape` returns False), after which the twin is a guess. After the
    walk, `model` is the model as it will be saved (experts fused again).

        with StageShapes(recipe, net, records) as walk:
            for name, stage, model in walk: ...
    """

    def __init__(self, recipe: Recipe, net: torch.nn.Module, records: dict[str, dict]):
        self.recipe, self.net, self.records = recipe, net, records
        self.model, self.exact = net, True

    def __enter__(self) -> "StageShapes":
        # The twin is taken before unfusing, so that it can be fused again for the format decision.
        self.twin = modeling.meta_twin(self.net) if any(reshapes(s) for _, s in self.recipe.stages) else None
        self.swaps = [unfuse_experts(self.net)] + ([unfuse_experts(self.twin)] if self.twin is not None else [])
        return self

    def __iter__(self):
        for name, stage in self.recipe.stages:
            yield name, stage, self.model
            if reshapes(stage) and self.exact:
                self.model = self.twin
                try:
                    self.exact = stage.reshape(self.model, self.records)
                except CompressError:  # refused by the stage's own checks (preflight_shapes)
                    self.exact = False

    def __exit__(self, *exc) -> None:
        for swaps in reversed(self.swaps):
            fuse_experts(swaps)


def check_offloadable(recipe: Recipe) -> None:
    if len(recipe.stages) != 1 or not hasattr(recipe.stages[0][1], "observe"):
        raise CompressError(f"{recipe.source}: offload: disk runs one block-by-block stage (e.g. gptq); "
                            f"this recipe has {', '.join(n for n, _ in recipe.stages)}",
                            "split the recipe, or drop offload: disk")


def check_data_files(recipe: Recipe) -> None:
    """Missing local data files are reported before any model is loaded or compressed."""
    specs = list(recipe.evaluation.datasets) if recipe.evaluation else []
    if recipe.calibration is not None:
        cal = recipe.calibration.dataset
        specs += [cal] if isinstance(cal, str) else list(cal)
    for spec in specs:
        if resolve_data_path(spec) is None and is_local_spec(spec):
            raise CompressError(f"{recipe.source}: data file not found: {spec}",
                                "check the path; relative paths are tried from the current directory, then the project root")


def _reset_model_dtype(net: torch.nn.Module) -> None:
    net.float()  # the protocol evaluates in float32; the checkpoint is already saved in its own dtype


def _eval_kwargs(cfg: EvaluationConfig) -> dict:
    return {"seq_len": cfg.seq_len, "max_windows": cfg.max_windows, "max_sentences": cfg.max_sentences,
            "batch_size": cfg.batch_size}


def size_summary(net: torch.nn.Module, layers: dict, checkpoint_dir: Path | None = None,
                 stored_bits: int | None = None) -> dict:
    """Parameters (and how many are nonzero), bytes on disk, and bits/parameter on disk and once packed.

    `stored_bits`: width of the unquantized parameters as saved (defaults to the model's dtype)."""
    params = modeling.count_parameters(net)
    stored_bits = stored_bits or next(net.parameters()).element_size() * 8  # scales are stored at it too
    modules = dict(net.named_modules())
    packed_bits = 0
    quantized_params = 0
    for name, rec in layers.items():  # a layer of the model, or one expert's layer of fused experts
        if "weights" in rec and (name in modules or fused_experts_of(net, name) is not None):
            out_f, in_f = rec["shape"]
            packed_bits += packed_weight_bits(out_f, in_f, QuantArgs(**rec["weights"]), 16 if stored_bits == 16 else 32)
            quantized_params += out_f * in_f
    other_bits = (params - quantized_params) * stored_bits
    on_disk = dir_weight_bytes(checkpoint_dir) if checkpoint_dir else modeling.model_bytes(net)
    # None with offload: disk, where the weights are no longer in memory
    nonzero = None if any(p.is_meta for p in net.parameters()) else sum(int(torch.count_nonzero(p)) for p in net.parameters())
    return {
        "parameters": params,
        "nonzero_parameters": nonzero,  # below `parameters` once pruned; stored densely all the same
        "quantized_parameters": quantized_params,
        "bytes_on_disk": on_disk,
        "bits_per_parameter_on_disk": on_disk * 8 / params,
        "bits_per_parameter_packed": (packed_bits + other_bits) / params,
    }


# What a compress checkpoint's records hand to a run on it: a layer's grid and its zeros, and with
# them its error against the float model it came from (a stage here that cannot measure its own
# against the float weights, QAT on a W4 input, reports that one beside its change).
INHERITED_KEYS = ("weights", "sparsity", "target_sparsity", "pattern", "input_zeros", "sparsity_preserved")
INHERITED_WITH = ("relative_error",)


def record_input_zeros(net: torch.nn.Module, layers: dict[str, dict]) -> None:
    """Linear layers the input brings with at least 10 % exact zeros and no record of where they
    came from (a model pruned by another tool): their share is recorded as `input_zeros`, so that
    the zeros stay a mask after a stage here quantizes the layer and records only its grid
    (sparsity.zeros_are_a_mask), in this run and, through compress.json, in the next."""
    from compress.sparsity import zeros_are_a_mask

    for name, module in net.named_modules():
        weight = getattr(module, "weight", None)
        if type(module).__name__ not in LINEAR_TYPES or weight is None or weight.is_meta:
            continue  # (offload: disk keeps weights on disk: unknown until loaded)
        if zeros_are_a_mask(layers.get(name)) is not None:
            continue  # its record already says (pruned here, or quantized here and never pruned)
        share = float((weight == 0).float().mean())
        if share >= 0.1:
            layers.setdefault(name, {})["input_zeros"] = share


def inherited_records(model_ref: str) -> dict[str, dict]:
    """What a compress output's compress.json says its layers came with: the grid its weights are
    on and the zeros its pruning left ({} for any other model). A run on it starts from them as a
    stage starts from an earlier stage's records, so pruned weights stay zero through training, a
    grid that a later cut or update would break is refused, and one that is kept is written packed.
    Each keeps its stage, marked as the input model's (stages.base.from_input)."""
    path = Path(modeling.resolve_model(model_ref))
    layers = modeling.read_meta(path).get("layers", {}) if path.is_dir() else {}
    inherited = {}
    for name, record in layers.items():
        kept = {k: record[k] for k in INHERITED_KEYS if record.get(k) is not None}
        if kept:
            kept.update({k: record[k] for k in INHERITED_WITH if record.get(k) is not None})
            if isinstance(record.get("shape"), list):  # what the packed size is counted from
                kept["shape"] = record["shape"]
            stage = str(record.get("stage", "compress"))
            inherited[name] = {"stage": stage if stage.endswith(INPUT_MODEL) else stage + INPUT_MODEL, **kept}
    return inherited


def preflight(recipe: Recipe, net: torch.nn.Module, packed: bool = False, inherited: dict | None = None) -> list[CompressError]:
    """What the stages would refuse, found before any of them runs: of the architecture
    (Stage.preflight), of the shapes each will see and of what the stages before it, or the input
    model (`inherited`), will have done (Stage.preflight_shapes), targets matching nothing; and with
    `packed` (--format packed), a quantized layer the format cannot write (a group size that does
    not divide it, a tied weight), not after hours of calibration."""
    refused = []
    # what the stages will do to each layer: its grid (weights), N:M pattern, and which stage
    records: dict[str, dict] = {n: dict(r) for n, r in (inherited or {}).items()}
    with StageShapes(recipe, net, records) as walk:
        for name, stage, model in walk:
            if not walk.exact:  # the model this stage gets is not known: it is checked when it starts
                continue
            try:
                stage.preflight(model)
                if hasattr(stage, "preflight_shapes"):
                    stage.preflight_shapes(model, records, source=net)
                if hasattr(stage, "select"):
                    chosen = stage.select(model, name)
                    if hasattr(stage, "check_overrides"):  # sparsity_overrides keys, likewise
                        stage.check_overrides(chosen, name)
                    _plan_records(records, stage, name, chosen)
            except CompressError as exc:
                refused.append(exc)
    if packed and walk.exact:
        problems = packing.expressible(walk.model, {n: r for n, r in records.items() if "weights" in r})
        if problems:
            refused.append(packing.not_packable(problems))
    return refused


def _plan_records(records: dict[str, dict], stage, name: str, chosen: dict) -> None:
    """What a stage will record of its layers, as far as later checks need it: the weight scheme
    it quantizes to, the N:M pattern it prunes to."""
    weights = stage_weights(stage)
    targets = stage.layer_targets(chosen, name) if hasattr(stage, "layer_targets") else {}
    for n in chosen:
        rec = records.setdefault(n, {})
        if weights is not None:
            rec.update({"stage": name, "weights": weights.model_dump(mode="json")})
        if n in targets and targets[n].pattern:
            rec.update({"stage": name, "pattern": targets[n].pattern})


def stage_weights(stage) -> QuantArgs | None:
    """The weight scheme a stage quantizes to: a quantization stage's (None for AWQ's `quantize:
    false`, which only scales), SparseGPT's joint one, or None."""
    if hasattr(stage, "resolved_scheme"):
        return stage.resolved_scheme().weights if getattr(stage, "quantize", True) is not False else None
    joint = getattr(stage, "quantize", None)
    return joint.args() if joint is not None and hasattr(joint, "args") else None


def check_sequence_lengths(recipe: Recipe, config) -> None:
    """Every sequence length in the recipe fits the model's positions, before any work."""
    if recipe.calibration is not None:
        modeling.check_context(config, recipe.calibration.seq_len, "calibration.seq_len")
    if recipe.evaluation is not None and modeling.is_causal_lm(config):  # encoders score sentences, not windows
        modeling.check_context(config, recipe.evaluation.seq_len, "evaluation.seq_len")
    for i, (name, stage) in enumerate(recipe.stages):
        data = getattr(stage, "data", None)  # its seq_len counts only for its own text; else the calibration's
        if getattr(data, "seq_len", None) is not None and (data.dataset is not None or data.generate is not None):
            modeling.check_context(config, data.seq_len, f"stages.{i}.{name}.data.seq_len")


def evaluate_model(model: str, datasets: list[str], baseline: str | None = None, device: str = "auto",
                   seq_len: int = 256, max_windows: int = 256, max_sentences: int = 200, batch_size: int = 8,
                   thresholds: dict | None = None, tasks: lm_tasks.TaskRequest | None = None,
                   progress: Progress | None = None) -> dict:
    """`compress eval` as a function: metrics per dataset and per lm-eval task, size, and
    threshold checks. `datasets`: a list of text files or dataset names (one alone may be given
    as it is); `thresholds`: {name: value} with the names of `compress eval`'s threshold options
    (max_kl, min_top1, ...), each checked as the CLI checks it, before any model is loaded."""
    progress = progress or (lambda *_: None)
    model, baseline = modeling.model_reference(model, "model"), modeling.model_reference(baseline, "baseline")
    datasets = [datasets] if isinstance(datasets, (str, os.PathLike)) else list(datasets or [])
    datasets = [os.fspath(d) for d in datasets]
    for name, value, least in (("seq_len", seq_len, 2), ("max_windows", max_windows, 1), ("max_sentences", max_sentences, 1),
                               ("batch_size", batch_size, 1)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            raise CompressError(f"{name}={value!r}: must be a whole number of at least {least}", f"pass {name} >= {least}")
    seq_len, max_windows, max_sentences, batch_size = int(seq_len), int(max_windows), int(max_sentences), int(batch_size)
    dev = pick_device(device)
    on_tasks = list(inspect.signature(task_gate).parameters)[1:]  # the thresholds are the gates' keywords
    known = list(inspect.signature(gate).parameters)[1:] + on_tasks
    unknown = [k for k in (thresholds or {}) if k not in known]  # a misspelled one, even set to None
    thresholds = {k: v for k, v in (thresholds or {}).items() if v is not None}
    if unknown:  # before any model is loaded
        raise CompressError(f"unknown threshold {unknown[0]!r}", f"use one of {', '.join(known)}")
    for key, value in thresholds.items():
        problem = threshold_problem(key, value)
        if problem:
            raise CompressError(f"--{key.replace('_', '-')}: {problem}", "give a threshold the metric can meet and miss")
    thresholds = {k: float(v) for k, v in thresholds.items()}  # a numpy float would reach report.json as text
    against = next((k for k in ("max_ppl_increase", "max_kl", "min_top1", "min_cosine", "max_task_drop") if k in thresholds), None)
    if against and baseline is None:
        raise CompressError(f"--{against.replace('_', '-')} compares against the uncompressed model", "pass --baseline")
    task_thresholds = {k: thresholds.pop(k, None) for k in on_tasks}
    if not datasets and not (tasks and tasks.names):
        raise CompressError("no evaluation data given", "pass --data FILE, a text file (e.g. calibration/heldout-tinyshakespeare.txt), "
                            "or --tasks NAMES")
    on_data = next(iter(thresholds), None)
    if on_data and not datasets:  # a gate that checks nothing must not pass
        raise CompressError(f"--{on_data.replace('_', '-')} is checked on the evaluation text, and none was given (--data)",
                            "pass --data FILE, or drop the threshold")
    on_task = next((k for k, v in task_thresholds.items() if v is not None), None)
    if on_task and not (tasks and tasks.names):  # likewise
        raise CompressError(f"--{on_task.replace('_', '-')} applies to lm-eval tasks, and none were given", "pass --tasks NAMES")
    progress("loading model", 0, 1)
    model_config = modeling.load_config(model)
    # A threshold the model's kind has no metric for is refused before any model is loaded.
    wrong = ("min_cosine",) if modeling.is_causal_lm(model_config) else ("max_ppl_increase", "max_kl", "min_top1")
    for key in (k for k in wrong if thresholds.get(k) is not None):
        kind = "a causal language model" if modeling.is_causal_lm(model_config) else "an encoder"
        fits = "--max-kl, --min-top1, --max-ppl-increase" if modeling.is_causal_lm(model_config) else "--min-cosine"
        raise CompressError(f"--{key.replace('_', '-')} cannot be checked on {model}: it is {kind}", f"use {fits}")
    manager = None
    if tasks and tasks.names:
        manager = lm_tasks.prepare(tasks, modeling.is_causal_lm(model_config), model)
    if modeling.is_causal_lm(model_config):  # encoders score sentences: --seq-len is not used
        modeling.check_context(model_config, seq_len, "--seq-len")
    if baseline is not None:
        try:
            modeling.resolve_model(baseline)
            modeling.load_config(baseline)  # a hub id that cannot be loaded fails here, named as the baseline
        except CompressError as exc:  # say which of the two models it is
            raise CompressError(f"--baseline: {exc.message}", exc.hint) from None
    net, tokenizer, config = modeling.load_model(model, dtype="float32", device=dev)
    base = None
    if baseline is not None:
        base, base_tok, base_config = modeling.load_model(baseline, dtype="float32", device=dev)
        if modeling.is_causal_lm(base_config) != modeling.is_causal_lm(config):
            raise CompressError(f"--baseline {baseline} and --model {model} are not the same kind of model", "compare a model with its uncompressed original")
        if getattr(base_config, "vocab_size", None) != getattr(config, "vocab_size", None):
            raise CompressError(f"--baseline {baseline} has a different vocabulary from {model}", "compare a model with its uncompressed original")
        if base_tok is not None and tokenizer is not None and base_tok.get_vocab() != tokenizer.get_vocab():
            # both models read the ids of --model's tokenizer: with another tokenizer the baseline
            # would be scored on text it never sees, and a broken tokenizer could pass the gate
            raise CompressError(f"--baseline {baseline} and --model {model} have tokenizers that map text to different ids",
                                "compare a model with its uncompressed original, saved with the same tokenizer")
        if base_tok is not None and tokenizer is not None:
            # the same vocabulary can still split text otherwise (other merges, normalizer or
            # pre-tokenizer): then both models read ids the baseline's tokenizer never gives
            for spec in datasets:
                sample = "\n".join(read_texts(spec, tokenizer=tokenizer))[:TOKENIZER_CHECK_CHARS]
                ours, theirs = (t(sample, add_special_tokens=False, verbose=False)["input_ids"] for t in (tokenizer, base_tok))
                if ours != theirs:
                    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                    raise CompressError(f"--baseline {baseline} and --model {model} have tokenizers that split {spec} "
                                        f"differently (from token {at} on)",
                                        "compare a model with its uncompressed original, saved with the same tokenizer")
    causal = modeling.is_causal_lm(config)
    start = time.perf_counter()
    results = evaluate(net, tokenizer, datasets, baseline=base, causal=causal, seq_len=seq_len, max_windows=max_windows,
                       max_sentences=max_sentences, batch_size=batch_size, device=dev, progress=progress)
    task_results = {}
    if manager is not None:
        task_results = lm_tasks.score(net, tokenizer, tasks, manager, batch_size, (base, base_tok) if base is not None else None,
                                      task_thresholds, progress)
    layers = modeling.read_meta(modeling.resolve_model(model)).get("layers", {})
    path = Path(modeling.resolve_model(model))
    size = size_summary(net.cpu(), layers, path if path.is_dir() else None, stored_bits=modeling.saved_dtype(config).itemsize * 8)
    size["packed"] = getattr(config, "quantization_config", None) is not None  # the file is already packed
    checks = gate(results, **thresholds) + task_gate(task_results, **task_thresholds)
    return {"model": model, "baseline": baseline, "kind": "causal-lm" if causal else "encoder",
            "results": results, "tasks": task_results, "size": size, "checks": checks,
            "passed": all(c["passed"] for c in checks), "wall_s": time.perf_counter() - start}


# How much of each evaluation text both tokenizers must split alike (a broken tokenizer differs
# within a few sentences; the whole of a large text would double the tokenizing).
TOKENIZER_CHECK_CHARS = 200_000


def inspect_checkpoint(path: str | Path) -> dict:
    """`compress inspect` as a function: what was done to a checkpoint written by compress.

    Returns compress.json and report.json as they are, plus a summary: the format (and why), the
    source model and its weights' hash, the recipe and stages, each layer's scheme, sparsity and
    bytes on disk against its float16 bytes, and the sizes before and after."""
    path = Path(path)
    meta_file, report_file = path / "compress.json", path / "report.json"
    if not path.is_dir():
        raise CompressError(f"{path} {'is not a directory' if path.exists() else 'does not exist'}",
                            "pass a directory written by `compress quantize`")
    if (path / INCOMPLETE_MARKER).exists():  # as every command that reads a model refuses it
        raise CompressError(f"{path} is an unfinished compress output (the run writing it was interrupted)",
                            "inspect a finished output; the next run into the same destination removes this one")
    if not meta_file.is_file():
        raise CompressError(f"{path} has no compress.json: it was not written by compress", "inspect a compress output directory")
    meta = modeling.read_meta(path)
    # what every compress output's compress.json holds (run_recipe writes them all): without them
    # the summary would be a page of None about a file compress did not write
    missing = [k for k, kind in (("format", str), ("source_model", dict), ("stages", list), ("layers", dict))
               if not isinstance(meta.get(k), kind)]
    if missing:
        raise CompressError(f"{meta_file}: damaged (no {', '.join(missing)})", "write the checkpoint again")
    try:
        report = json.loads(report_file.read_text()) if report_file.is_file() else {}
    except ValueError as exc:
        raise CompressError(f"{report_file}: damaged ({exc})", "write the checkpoint again") from None
    if not isinstance(report, dict):
        raise CompressError(f"{report_file}: damaged (not the object compress writes)", "write the checkpoint again")
    recipe = meta.get("recipe")
    if recipe is None and (path / "recipe.yaml").is_file():
        recipe = yaml.safe_load((path / "recipe.yaml").read_text())
    layers = meta.get("layers", {})
    tensor_sizes = packing.tensor_bytes(path)
    prefixes = {k.rsplit(".", 1)[0] for k in tensor_sizes}
    saved_as = {}  # layer -> its key on disk, where that differs: experts saved in the family's own
    if any(name not in prefixes for name in layers):  # layout (Mixtral's block_sparse_moe.experts.3.w1)
        from compress.plan import build_meta_model

        try:
            saved_as = packing.expert_keys(build_meta_model(str(path))[0])
        except Exception:  # a config this transformers cannot build: the layers are counted by their names
            saved_as = {}
    rows = {}
    for name, rec in layers.items():
        key = saved_as.get(name, name)
        stored = {k[len(key) + 1:]: v for k, v in tensor_sizes.items() if k.startswith(key + ".") and "." not in k[len(key) + 1:]}
        shape = rec.get("shape") or []
        params = shape[0] * shape[1] if len(shape) == 2 else None
        rows[name] = {"shape": shape, "stage": rec.get("stage"), "weights": rec.get("weights"),
                      "input_activations": rec.get("input_activations"), "sparsity": rec.get("sparsity"),
                      "pattern": rec.get("pattern"), "relative_error": rec.get("relative_error"),
                      "tensors": sorted(stored), "bytes_on_disk": sum(stored.values()),
                      "float16_bytes": params * 2 if params else None,
                      # which MLP channels or heads a structured stage kept, on the layer it records them
                      **{k: rec[k] for k in ("kept_channels", "kept_heads", "kept_kv_heads") if k in rec}}
    quantized = [r for r in rows.values() if r["weights"] and r["float16_bytes"]]
    q_disk, q_fp16 = sum(r["bytes_on_disk"] for r in quantized), sum(r["float16_bytes"] for r in quantized)
    packed = packing.is_packed(path)
    src = meta.get("source_model", {})
    summary = {
        "path": str(path),
        "format": "packed" if packed else "dense",
        "format_reason": meta.get("format_reason"),
        "quantization_config": json.loads((path / "config.json").read_text()).get("quantization_config") if packed else None,
        "source_model": {k: src.get(k) for k in ("ref", "architecture", "parameters", "dtype", "dtype_on_disk", "bytes", "weights_sha256")},
        "stages": meta.get("stages", []),
        "recipe": recipe,
        "layers": rows,
        "kv_cache": meta.get("kv_cache"),
        # bytes_on_disk: the weight files (headers included), as the run's report counts them
        "sizes": {"source_bytes": src.get("bytes"), "bytes_on_disk": dir_weight_bytes(path) or sum(tensor_sizes.values()),
                  "quantized_layers_bytes_on_disk": q_disk, "quantized_layers_float16_bytes": q_fp16,
                  "quantized_layers_ratio_to_float16": q_disk / q_fp16 if q_fp16 else None},
    }
    return {"summary": summary, "compress": meta, "report": report}


__all__ = ["run_recipe", "evaluate_model", "inspect_checkpoint", "pick_device", "pick_devices", "size_summary", "STAGES"]
