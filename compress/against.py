"""`compress bench --against llmcompressor`: each recipe run by compress and by llm-compressor on the
same model and the same calibration windows, both checkpoints scored by the same evaluation.

    translate   the recipe's stages into llm-compressor modifiers (same scheme, targets, ignore
                list and the settings both tools share); stages it has no one-shot equivalent for
                (magnitude pruning, structured pruning, distillation, QAT) leave the row compress-only
    run         compress/llmcompressor_runner.py in the other environment's Python, handed the
                calibration token ids compress built; it times `oneshot` and reads its peak RSS
    score       its compressed-tensors checkpoint loaded by compress (dequantized, activation
                quantization re-attached from its quantization_config) and evaluated against the
                same saved baseline as the compress row

llm-compressor pins its own torch, transformers and compressed-tensors, so it lives in its own
environment: `--against-python` (or COMPRESS_LLMCOMPRESSOR_PYTHON) names that Python.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from compress.errors import CompressError
from compress.schemes import fp4_format, mx_format

RUNNER = Path(__file__).with_name("llmcompressor_runner.py")
TOOLS = ("llmcompressor",)
NOISY_PPL_PCT = 0.1  # percent: increases this small go up or down by chance with the rounding (RTN W4 g64 lowers
#                     ref-llama's Tiny Shakespeare perplexity); KL separates methods there


class Untranslatable(Exception):
    """The recipe has a stage or setting llm-compressor cannot run one-shot; the message says which."""


# ---------------------------------------------------------------------------------------------
# Recipe -> modifiers


def ct_targets(patterns: list[str]) -> list[str]:
    """compress's targets as llm-compressor matches them: class names and `re:` as they are; a
    name or dotted suffix (which compress matches at a dot boundary) as an anchored regex."""
    out = []
    for p in patterns:
        if p.startswith("re:") or p in ("Linear", "Conv1D") or re.fullmatch(r"[A-Z][A-Za-z0-9]*", p):
            out.append(p)
        else:
            # `\.?`: llm-compressor's pruning modifiers name a target that is itself a leaf
            # (lm_head) with a trailing dot ("lm_head."), and would otherwise prune it.
            out.append(f"re:(.*\\.)?{re.escape(p)}\\.?$")
    return out


def _config_groups(cfg) -> dict:
    scheme = cfg.resolved_scheme()
    group = {"targets": ct_targets(cfg.targets),
             "weights": scheme.weights.model_dump(mode="json", exclude_none=True)}
    if scheme.input_activations is not None:
        group["input_activations"] = scheme.input_activations.model_dump(mode="json", exclude_none=True)
    for part, args in group.items():
        if isinstance(args, dict):
            args.pop("full_range", None)  # compressed-tensors' symmetric grid is always the full one
            if args.get("strategy") not in ("group", "tensor_group"):
                args.pop("group_size", None)
            if fp4_format(args):  # as compressed-tensors' NVFP4 / MXFP4 presets
                nv = fp4_format(args) == "nvfp4"
                args["scale_dtype"] = args["zp_dtype"] = "torch.float8_e4m3fn" if nv else "torch.uint8"
                if part == "input_activations" and nv:
                    args.update(dynamic="local", observer="static_minmax")
            elif mx_format(args):  # as compressed-tensors' MXFP8 and MXFP6 presets: e8m0 scales
                args["scale_dtype"] = args["zp_dtype"] = "torch.uint8"
    return {"group_0": group}


def _grid_note(name: str, cfg) -> list[str]:
    w = cfg.resolved_scheme().weights
    if w.type == "int" and w.symmetric and not w.full_range:
        return [f"{name}: compress rounded to absmax's 2^b - 1 codes; llm-compressor's symmetric grid has all 2^b "
                "(compress's `full_range: true`)"]
    return []


def _pruning_args(name: str, cfg) -> dict:
    if cfg.sparsity_overrides:
        raise Untranslatable(f"{name}: sparsity_overrides (per-layer sparsity) has no llm-compressor equivalent")
    if cfg.sparsity is not None:
        sparsity = cfg.sparsity
    elif cfg.pattern:
        n, m = (int(x) for x in cfg.pattern.split(":"))
        sparsity = n / m
    else:
        sparsity = 0.5  # compress's default
    return {"sparsity": sparsity, "mask_structure": cfg.pattern or "0:0",
            "targets": ct_targets(cfg.targets), "ignore": ct_targets(cfg.ignore)}


def llmcompressor_modifiers(recipe) -> tuple[list[dict], list[str]]:
    """(modifiers as {class, args}, notes on settings that differ) for a parsed recipe; raises
    Untranslatable when a stage has no one-shot counterpart."""
    mods: list[dict] = []
    notes: list[str] = []
    for name, cfg in recipe.stages:
        if name == "rtn":
            mods.append({"class": "QuantizationModifier",
                         "args": {"config_groups": _config_groups(cfg), "ignore": ct_targets(cfg.ignore)}})
            notes += _grid_note(name, cfg)
        elif name == "gptq":
            if cfg.reorders_columns and not cfg.fixed_group_scales:
                # compressed-tensors 0.20 refuses it: "actorder='group' has been removed"
                raise Untranslatable("gptq: actorder: group (scales chosen as columns are reached) is gone from "
                                     "llm-compressor; only static act-order ('weight') is translated")
            actorder = "weight" if cfg.reorders_columns else None
            mods.append({"class": "GPTQModifier",
                         "args": {"config_groups": _config_groups(cfg), "ignore": ct_targets(cfg.ignore),
                                  "block_size": cfg.block_size, "dampening_frac": cfg.dampening_frac,
                                  "actorder": actorder}})
            if cfg.shrink_grid:
                notes.append("gptq shrink_grid: llm-compressor ran its default min/max observer")
            if cfg.true_sequential:
                notes.append("gptq true_sequential: llm-compressor calibrated each decoder layer's modules in one pass")
            notes += _grid_note(name, cfg)
        elif name == "awq":
            if cfg.mappings:
                raise Untranslatable("awq: custom mappings are not translated")
            mods.append({"class": "AWQModifier", "args": {"duo_scaling": cfg.duo_scaling, "n_grid": cfg.grid}})
            if cfg.clip:
                notes.append("awq clip: llm-compressor's AWQ has no clipping search")
            if cfg.quantize:
                mods.append({"class": "QuantizationModifier",
                             "args": {"config_groups": _config_groups(cfg), "ignore": ct_targets(cfg.ignore)}})
                notes += _grid_note(name, cfg)
        elif name == "autoround":
            # llm-compressor's AutoRoundModifier (Intel's auto-round inside) learns the same offsets
            # and clipping with the float model's block outputs as targets; it has no switch for
            # the other reference or for rounding-only tuning, and one learning rate for both.
            if cfg.reference != "float_model" or not cfg.minmax or (cfg.minmax_lr and cfg.minmax_lr != cfg.lr):
                raise Untranslatable("autoround: llm-compressor runs only reference float_model, minmax true, "
                                     "minmax_lr equal to lr")
            mods.append({"class": "AutoRoundModifier",
                         "args": {"config_groups": _config_groups(cfg), "ignore": ct_targets(cfg.ignore),
                                  "iters": cfg.iters, "batch_size": cfg.samples_per_step, "lr": cfg.lr,
                                  # its default compiles each block first: tens of seconds on a CPU
                                  "enable_torch_compile": False}})
            notes += _grid_note(name, cfg)
            if cfg.resolved_scheme().weights.type == "int" and cfg.resolved_scheme().weights.symmetric:
                notes.append("autoround: llm-compressor's AutoRound (Intel's auto-round) steps a symmetric group by "
                             "max|w| / 2^(b-1) with a signed scale (the larger extreme at code -2^(b-1)), a finer grid "
                             "than compress's max|w| / (2^(b-1) - 1) (absmax) or / (2^(b-1) - 0.5) (full_range)")
        elif name == "smoothquant":
            if cfg.mappings or cfg.alpha_overrides:
                raise Untranslatable("smoothquant: custom mappings and alpha_overrides are not translated")
            mods.append({"class": "SmoothQuantModifier",
                         "args": {"smoothing_strength": cfg.alpha, "ignore": ct_targets(cfg.ignore)}})
        elif name == "sparsegpt":
            if cfg.quantize is not None:
                raise Untranslatable("sparsegpt: joint quantization (quantize:) has no llm-compressor equivalent")
            mods.append({"class": "SparseGPTModifier",
                         "args": {**_pruning_args(name, cfg), "block_size": cfg.block_size,
                                  "dampening_frac": cfg.dampening_frac}})
            if cfg.mask_selection == "row" and not cfg.pattern:
                notes.append("sparsegpt mask_selection row: llm-compressor chooses over each block's rows together")
        elif name == "wanda":
            mods.append({"class": "WandaPruningModifier", "args": _pruning_args(name, cfg)})
        elif name == "kv_cache":
            # llm-compressor calibrates the cache within a quantization modifier (kv_cache_scheme)
            if not mods or mods[-1]["class"] not in ("QuantizationModifier", "GPTQModifier"):
                raise Untranslatable("kv_cache: llm-compressor calibrates the KV cache only within a quantization "
                                     "modifier; put kv_cache right after an rtn or gptq stage")
            from compress.activations import KV_SCHEME

            mods[-1]["args"]["kv_cache_scheme"] = dict(KV_SCHEME)
        else:
            raise Untranslatable(f"{name}: llm-compressor has no one-shot {name} stage")
    return mods, notes


# ---------------------------------------------------------------------------------------------
# Running it in the other environment


def find_python(against: str, python: str | None) -> str:
    """The interpreter that has `against` installed: --against-python, the environment variable,
    or this one. Checked by importing it, so a wrong path fails before any work."""
    if against not in TOOLS:
        raise CompressError(f"--against {against}: unknown tool", f"use one of: {', '.join(TOOLS)}")
    # Absolute (the runner starts in its own directory), but not resolved: a venv's python is a
    # symlink to the base interpreter, and only the link's path finds the venv's packages.
    python = os.path.abspath(python or os.environ.get("COMPRESS_LLMCOMPRESSOR_PYTHON") or sys.executable)
    if not Path(python).exists():
        raise CompressError(f"--against-python {python}: no such file", "give the python of the environment where llm-compressor is installed")
    try:
        probe = subprocess.run([python, "-I", "-c", "import llmcompressor; print(llmcompressor.__version__)"],
                               capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CompressError(f"--against-python {python}: cannot run it ({exc})", "give a working python interpreter") from None
    if probe.returncode != 0:
        raise CompressError(f"llm-compressor is not installed for {python}",
                            "install it in its own environment (python -m venv v && v/bin/pip install torch==2.13.0 "
                            "llmcompressor) and pass --against-python v/bin/python")
    return python


def run_llmcompressor(python: str, model: str, causal: bool, calibration, modifiers: list[dict], workdir: Path,
                      seed: int = 0) -> dict:
    """One oneshot run in the other environment; returns the runner's result.json plus the log path."""
    import torch

    workdir.mkdir(parents=True, exist_ok=True)
    samples = calibration.samples if calibration is not None else None
    # The runner works in `workdir`: paths it is given must not be relative to here.
    model = str(Path(model).resolve()) if Path(model).exists() else model
    spec = {"model": model, "causal": causal, "seed": seed, "threads": torch.get_num_threads(),
            "output": str((workdir / "checkpoint").resolve()), "modifiers": modifiers,
            "calibration": None if samples is None else {
                "input_ids": [s["input_ids"][0].tolist() for s in samples],
                "attention_mask": [s.get("attention_mask", torch.ones_like(s["input_ids"]))[0].tolist() for s in samples]}}
    spec_path = (workdir / "spec.json").resolve()
    spec_path.write_text(json.dumps(spec))
    (workdir / "result.json").unlink(missing_ok=True)
    log = workdir / "llmcompressor.log"
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run([python, "-I", str(RUNNER), str(spec_path)], stdout=fh, stderr=subprocess.STDOUT,
                              cwd=workdir, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not (workdir / "result.json").is_file():
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        return {"error": (lines[-1] if lines else f"exit code {proc.returncode}")[:300], "log": str(log)}
    result = json.loads((workdir / "result.json").read_text())
    result.update({"checkpoint": spec["output"], "log": str(log), "process_wall_s": wall})
    return result


# ---------------------------------------------------------------------------------------------
# The side-by-side table


def _ratio(a, b) -> str:
    if a is None or b is None or b == 0:
        return "–"
    return f"{a / b:.2f}"


def render_side_by_side(rows: list[dict], specs: list[str], causal: bool) -> list[str]:
    """Markdown lines: compress against llm-compressor, one line per recipe."""
    short = [Path(s).parent.name + "/" + Path(s).name for s in specs]
    lines = ["## Side by side: compress and llm-compressor", "",
             "Same model, same calibration token ids (built once by compress and handed to both), same evaluation "
             "against the same saved baseline. Wall s: compress's stages (report.json `stages[].wall_s`) against "
             "llm-compressor's `oneshot` call. Memory: peak RSS of each tool's process through loading and "
             "compression, less its RSS after imports and before loading the model (the libraries themselves differ); "
             "absolute peaks in brackets. Ratios are compress / llm-compressor: below 1 favours compress. A perplexity "
             f"ratio marked ~ divides by an increase under {NOISY_PPL_PCT} %, where perplexity moves by noise (compare KL).", ""]
    quality = ("KL", "kl_divergence", ".3e") if causal else ("1 − cos", "embedding_error", ".3e")
    header = ["recipe"]
    for s in short:
        header += [f"{quality[0]} {s} (compress / llm-c)", f"ratio {s}"]
        if causal:
            header += [f"Δppl % {s} (compress / llm-c)", f"ratio {s}"]
    header += ["wall s (compress / llm-c)", "ratio", "memory MiB (compress / llm-c)", "ratio"]
    lines += ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    notes: list[str] = []
    patches: set[str] = set()
    for r in rows:
        a = r.get("against")
        if a is None:
            continue
        if "error" in r:
            lines.append(f"| {r['row']} | compress failed: {r['error']} |" + " |" * (len(header) - 2))
            continue
        if "skipped" in a or "error" in a:
            why = a.get("skipped") or f"llm-compressor failed: {a['error']}"
            lines.append(f"| {r['row']} | {why} |" + " |" * (len(header) - 2))
            continue
        cells = [r["row"]]
        for spec in specs:
            ours, theirs = r["evaluation"][spec], a["evaluation"][spec]
            k, f = quality[1], quality[2]
            cells += [f"{format(ours[k], f)} / {format(theirs[k], f)}", _ratio(ours[k], theirs[k])]
            if causal:
                po, pt = ours.get("ppl_increase_pct"), theirs.get("ppl_increase_pct")
                ratio = _ratio(po, pt) if pt is not None and pt > 0 else "–"
                cells += [f"{po:+.3f} / {pt:+.3f}", ratio if pt is None or pt >= NOISY_PPL_PCT else f"~{ratio}"]
        mo = r["stage_peak_rss_mib"] - r["rss_before_load_mib"]
        mt = a["peak_rss_mib"] - a["rss_before_load_mib"]
        cells += [f"{r['stage_wall_s']:.2f} / {a['wall_s']:.2f}", _ratio(r["stage_wall_s"], a["wall_s"]),
                  f"{mo:.0f} ({r['stage_peak_rss_mib']:.0f}) / {mt:.0f} ({a['peak_rss_mib']:.0f})", _ratio(mo, mt)]
        lines.append("| " + " | ".join(cells) + " |")
        notes += [f"- {r['row']}: {n}" for n in a.get("notes", [])]
        notes += [f"- {r['row']}: llm-compressor logged: {n}" for n in a.get("said", [])]
        patches.update(a.get("patches", []))
    versions = next((a["versions"] for a in (r.get("against") or {} for r in rows) if "versions" in a), None)
    if versions:
        lines += ["", "llm-compressor environment: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + "."]
    if notes:
        lines += ["", "Settings that differ between the two, and what llm-compressor said about its run:"] + notes
    if patches:
        lines += ["", "Run on a machine without a GPU, the llm-compressor runner applied: " + "; ".join(sorted(patches)) + "."]
    return lines + ["", ""]
