"""The `compress` command line: a thin layer over the Python API in compress.pipeline.

Global options (--device, --dtype, --seed, --quiet, --json, --debug) may be given before or after
the command name. Exit codes: 0 success (or gate passed), 1 gate failed, 2 bad input, 3 internal
error.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from compress.checkpoint import check_side_output, write_whole
from compress.errors import WRITING_COMMANDS, CompressError
from compress.launcher import process_rank
from compress.schemes import activations_label, weights_label

app = typer.Typer(
    name="compress",
    help="Compress Hugging Face transformers models with YAML recipes: quantize, prune, evaluate, inspect.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

console = Console(stderr=True)  # progress and tables; stdout is kept for --json
GLOBAL_FLAGS = {"--quiet", "-q", "--json", "--debug"}
GLOBAL_OPTIONS = {"--device", "--dtype", "--seed"}


class Settings:
    device = "auto"
    dtype = "auto"
    seed = 0
    quiet = False
    json = False
    debug = False


S = Settings()


@app.callback()
def main_options(
    device: str = typer.Option("auto", help="auto (CUDA when present), cpu, cuda, cuda:N, or several comma-separated "
                               "(cuda:0,cuda:1: GPTQ and SparseGPT solve a block's layers on all of them at once)."),
    dtype: str = typer.Option("auto", help="dtype to load the model in: auto (as saved), float32, bfloat16, float16."),
    seed: int = typer.Option(0, help="random seed for calibration sampling and any stochastic step."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bars or tables."),
    json_out: bool = typer.Option(False, "--json", help="print a machine-readable JSON result on stdout."),
    debug: bool = typer.Option(False, "--debug", help="show full tracebacks on errors."),
):
    S.device, S.dtype, S.seed, S.quiet, S.json, S.debug = device, dtype, seed, quiet or json_out, json_out, debug


@contextmanager
def progress_bar():
    """Yields progress(description, completed, total); silent with --quiet or --json, and when
    stderr is not a terminal (a log file gets no animation from rich, only a stray blank line)."""
    if S.quiet or not console.is_terminal:
        yield lambda *_: None
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("starting", total=1)

        def update(description: str, completed: int, total: int) -> None:
            bar.update(task, description=description, completed=completed, total=max(total, 1))

        yield update


def emit_json(data) -> None:
    from compress.report import strict_json

    sys.stdout.write(strict_json(data, indent=2) + "\n")


@app.command()
def quantize(
    recipe: Path = typer.Option(..., "--recipe", "-r", help="YAML recipe (see `compress recipes`)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="hub id, local directory or `default`; overrides the recipe's model."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="output directory; overrides the recipe's output."),
    force: bool = typer.Option(False, "--force", help="replace an existing output directory."),
    resume: bool = typer.Option(False, "--resume", help="store each completed stage in the stage cache and start after the "
                                "last one already there: continues an interrupted run, or recomputes only from a changed stage on; "
                                "an interrupted training stage (qat, distill) continues from its newest checkpoint."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="where --resume keeps stage results (default: "
                                             "$COMPRESS_CACHE, else ~/.cache/compress); giving it implies --resume."),
    format: Optional[str] = typer.Option(None, "--format", help="packed (compressed-tensors: int4 packed, int8, FP8), dense "
                                         "(dequantized, in the model's dtype) or auto (the default: packed when every quantized layer can be); overrides the recipe."),
    no_eval: bool = typer.Option(False, "--no-eval", help="skip the recipe's evaluation section (as prune and distill do)."),
):
    """Run a recipe's stages on a model and save the compressed checkpoint with its report.

    Example: compress quantize --recipe recipes/w8a16-absmax.yaml --model default --output out/w8
    """
    from compress.pipeline import run_recipe
    from compress.recipe import load_recipe

    if format is not None and format not in ("packed", "dense", "auto"):
        raise CompressError(f"--format {format!r} is not a format", "use packed, dense or auto")
    r = load_recipe(recipe)
    if no_eval:
        r.evaluation = None
    with progress_bar() as progress:
        report = run_recipe(r, model=model, output=output, force=force, device=S.device, dtype=S.dtype,
                            seed=S.seed, progress=progress, format=format, resume=resume,
                            cache_dir=str(cache_dir) if cache_dir else None)
    if report.get("skipped"):
        return  # a process other than the main one under `accelerate launch`: the main one reports
    _show_run(report, output or r.output, header=[f"format: {report['format']['format']} ({escape(report['format']['reason'])})"])


def _show_run(report: dict, out, header: list[str] = (), details: list[str] = ()) -> None:
    """What quantize, prune and distill print after a run: JSON, the warnings alone (--quiet), or the
    warnings and the summary with the command's own lines (`header` before the stages, `details`
    after them)."""
    if S.json:  # (the report's own "output" is the size record)
        emit_json({**report, "output_dir": str(out), "warnings": report.get("warnings", [])})
        return
    for warning in report.get("warnings", []):  # not progress, nor a table: --quiet keeps it
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", soft_wrap=True, highlight=False)
    if not S.quiet:
        _say(f"[green]wrote[/green] {escape(str(out))}")
        for line in header:
            _say(line)
        _print_stages(report)
        for line in details:
            _say(line)
        if report.get("evaluation"):
            _print_results(report["evaluation"])
        if report.get("evaluation_note"):  # asked for but not run (offload: disk)
            _say(f"[yellow]evaluation {escape(report['evaluation_note'])}[/yellow]")
        _say(f"report: {Path(out) / 'report.md'} (and report.html, report.json)")


PRUNE_METHODS = ("magnitude", "wanda", "sparsegpt")
# The recipe keys `compress prune` sets, as its options (a window length has none: a recipe sets it).
PRUNE_OPTIONS = {"num_samples": "--num-samples", "multiple_of": "--multiple-of", "seq_len": "calibration.seq_len (in a recipe: --recipe)"}


@app.command()
def prune(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="hub id, local directory or `default`."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="output directory."),
    method: Optional[str] = typer.Option(None, help="magnitude, wanda or sparsegpt (the default)."),
    sparsity: Optional[float] = typer.Option(None, help="share of each layer's weights set to zero, in [0, 1) (default 0.5)."),
    pattern: Optional[str] = typer.Option(None, help="N:M semi-structured sparsity, e.g. 2:4: N zeros in every M consecutive input weights."),
    structured: Optional[str] = typer.Option(None, help="structured pruning instead: mlp-channels, heads or blocks (the `structured` stage)."),
    ratio: Optional[float] = typer.Option(None, help="with --structured: the share of channels / heads / blocks removed."),
    multiple_of: Optional[int] = typer.Option(None, help="with --structured mlp-channels: keep a multiple of this many channels "
                                              "(the nearest to what --ratio keeps), e.g. a later quantization's group size."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", "-r", help="run this recipe instead of building one from the options."),
    calibration: Optional[str] = typer.Option(None, help="calibration text (wanda, sparsegpt, structured; default: calibration/default.txt)."),
    num_samples: Optional[int] = typer.Option(None, min=1, help="calibration windows of 256 tokens (default 128)."),
    data: list[str] = typer.Option([], "--data", "-d", help="evaluation text(s) (default: the bundled held-out text)."),
    no_eval: bool = typer.Option(False, "--no-eval", help="skip the evaluation against the original."),
    force: bool = typer.Option(False, "--force", help="replace an existing output directory."),
    resume: bool = typer.Option(False, "--resume", help="store each completed stage in the stage cache and start after the "
                                "last one already there: continues an interrupted run, or recomputes only from a changed stage on."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="where --resume keeps stage results (default: "
                                             "$COMPRESS_CACHE, else ~/.cache/compress); giving it implies --resume."),
):
    """Prune a model (unstructured, N:M, or structured) and save the checkpoint with its report.

    Example: compress prune --model default --method sparsegpt --pattern 2:4 --output out/sparse24
    """
    from compress.pipeline import run_recipe
    from compress.recipe import load_recipe

    if recipe is not None:
        given = [f"--{k.replace('_', '-')}" for k, v in {
            "method": method, "sparsity": sparsity, "pattern": pattern, "structured": structured, "ratio": ratio,
            "multiple_of": multiple_of, "calibration": calibration, "num_samples": num_samples, "data": data or None}.items()
            if v is not None]
        if given:
            raise CompressError(f"--recipe runs the recipe's stages and calibration as written; "
                                f"{', '.join(given)} would be ignored",
                                f"drop {'them' if len(given) > 1 else 'it'}, or edit the recipe")
        r = load_recipe(recipe)
        if no_eval:  # as compress quantize --recipe does
            r.evaluation = None
    else:
        r = _parse_built_recipe(_prune_recipe(model, output, method, sparsity, pattern, structured, ratio, multiple_of,
                                              calibration, num_samples, data, no_eval), "compress prune",
                                {"structure": "--structured"})
    try:
        with progress_bar() as progress:
            report = run_recipe(r, model=model, output=output, force=force, device=S.device, dtype=S.dtype,
                                seed=S.seed, progress=progress, resume=resume, cache_dir=str(cache_dir) if cache_dir else None)
    except CompressError as exc:
        if recipe is not None:
            raise
        raise _in_option_terms(exc, PRUNE_OPTIONS) from exc  # the recipe was built from options: name those
    size = report["output"]
    details = []
    if size.get("nonzero_parameters") is not None:
        details.append(f"parameters {size['parameters']:,}, of which nonzero {size['nonzero_parameters']:,} "
                       f"({1 - size['nonzero_parameters'] / size['parameters']:.2%} zeros)")
    _show_run(report, output or r.output, details=details)


def _prune_recipe(model, output, method, sparsity, pattern, structured, ratio, multiple_of, calibration, num_samples,
                  data, no_eval) -> str:
    """The recipe `compress prune` runs, as YAML text, after checking the options agree."""
    import yaml

    from compress.modeling import fit_context, load_config
    from compress.sparsity import parse_pattern

    if not model:
        raise CompressError("no model given", "pass --model: a local directory, a hub id, or `default`")
    if not output:
        raise CompressError("no output directory given", "pass --output")
    if method == "magnitude" and structured is None:
        given = [f"--{k.replace('_', '-')}" for k, v in {"calibration": calibration, "num_samples": num_samples}.items() if v is not None]
        if given:  # taken silently, a user would think the data shaped the mask
            raise CompressError(f"--method magnitude reads no calibration data: {', '.join(given)} would do nothing",
                                "drop it, or use --method wanda or sparsegpt, which weigh weights by their inputs")
    calibration = calibration or "calibration/default.txt"
    num_samples = 128 if num_samples is None else num_samples
    if num_samples <= 0:
        raise CompressError(f"--num-samples {num_samples} must be positive", "e.g. --num-samples 128")
    if structured is not None:
        given = [f"--{k}" for k, v in {"method": method, "sparsity": sparsity, "pattern": pattern}.items() if v is not None]
        if given:
            raise CompressError(f"--structured removes whole structures and takes no {', '.join(given)}",
                                "give --structured KIND --ratio R, or --method with --sparsity / --pattern")
        if ratio is None:
            raise CompressError("--structured needs --ratio, the share of structures removed", "e.g. --structured mlp-channels --ratio 0.25")
        if not 0 < ratio < 1:
            raise CompressError(f"--ratio {ratio:g} is outside (0, 1)", "e.g. --ratio 0.25 removes a quarter")
        name, body = "structured", {"structure": structured, "ratio": ratio}
        if multiple_of is not None:
            if structured != "mlp-channels":
                raise CompressError(f"--multiple-of rounds the MLP channels kept; it does not apply to --structured {structured}",
                                    "drop it, or use --structured mlp-channels")
            body["multiple_of"] = multiple_of
    else:
        if ratio is not None or multiple_of is not None:
            flag = "--ratio" if ratio is not None else "--multiple-of"
            raise CompressError(f"{flag} goes with --structured", "for unstructured pruning give --sparsity or --pattern")
        name = method or "sparsegpt"
        if name not in PRUNE_METHODS:
            raise CompressError(f"--method {name!r} is not a pruning method", f"use one of {', '.join(PRUNE_METHODS)}")
        body = {}
        if sparsity is not None:
            if not 0 <= sparsity < 1:
                raise CompressError(f"--sparsity {sparsity:g} is outside [0, 1)", "e.g. --sparsity 0.5 zeroes half the weights")
            body["sparsity"] = sparsity
        if pattern is not None:
            try:
                n, m = parse_pattern(pattern)
            except ValueError as exc:
                raise CompressError(f"--pattern: {exc}", "N zeros in every M consecutive weights, e.g. --pattern 2:4") from None
            if sparsity is not None and abs(sparsity - n / m) > 1e-9:
                raise CompressError(f"--sparsity {sparsity:g} contradicts --pattern {n}:{m}, which prunes {n / m:g}",
                                    "give one of them")
            body["pattern"] = f"{n}:{m}"
    doc: dict = {"model": model}
    window = fit_context(load_config(model), 256)
    if name != "magnitude":
        doc["calibration"] = {"dataset": calibration, "num_samples": num_samples, "seq_len": window}
    doc["stages"] = [{name: body}]
    if not no_eval:
        doc["evaluation"] = {"datasets": list(data) or ["calibration/heldout-tinyshakespeare.txt"], "seq_len": window}
    doc["output"] = output
    return yaml.safe_dump(doc, sort_keys=False)


@app.command()
def distill(
    teacher: Optional[str] = typer.Option(None, "--teacher", "-t", help="the model to learn from: hub id, local directory or `default`."),
    student: Optional[str] = typer.Option(None, "--student", "-s", help="the model trained (e.g. a pruned copy of the teacher); or give --student-layers instead for a shallower copy of the teacher."),
    student_layers: Optional[str] = typer.Option(None, help="make the student a shallower copy from these blocks, e.g. 0,2,3."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="output directory."),
    data: list[str] = typer.Option([], "--data", "-d", help="training text: file(s) or a hub dataset; repeat for several."),
    generate: Optional[int] = typer.Option(None, min=1, help="train on this many sequences sampled from the teacher instead (data-free)."),
    steps: int = typer.Option(200, min=1, help="optimizer steps."),
    lr: float = typer.Option(1e-4, help="peak learning rate."),
    batch_size: int = typer.Option(8, min=1, help="sequences per step."),
    seq_len: int = typer.Option(256, min=2, help="tokens per training sequence."),
    num_samples: Optional[int] = typer.Option(None, min=1, help="training sequences taken from --data (default: all)."),
    eval_samples: int = typer.Option(16, min=1, help="sequences held out for the held-out loss during training."),
    temperature: float = typer.Option(1.0, help="KD temperature T (the soft loss is scaled by T²)."),
    divergence: str = typer.Option("forward", help="forward KL, reverse KL or jsd."),
    ce_weight: float = typer.Option(0.0, help="λ: weight of the next-token loss on the training text."),
    hidden: list[str] = typer.Option([], help="match hidden states STUDENT:TEACHER (0 the embeddings, i block i's output; the last, -1, after the final norm); repeat for several."),
    hidden_loss: str = typer.Option("auto", help="how hidden states are matched: mse, cosine, or auto (cosine for an encoder, mse for a causal LM)."),
    save_every: int = typer.Option(50, min=0, help="resumable checkpoint every N steps (0: none)."),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest checkpoint of an interrupted run with the same settings."),
    eval_data: list[str] = typer.Option([], "--eval-data", help="evaluation text(s) after training (default: the bundled held-out text)."),
    no_eval: bool = typer.Option(False, "--no-eval", help="skip the evaluation against the teacher."),
    keep_worse: bool = typer.Option(False, "--keep-worse", help="save what training reached even when its held-out KD ends above where it started (by default the starting weights are saved, with a warning)."),
    force: bool = typer.Option(False, "--force", help="replace an existing output directory."),
):
    """Distill a teacher into a student (logit KD, optional hidden-state KD) and save the student.

    Example: compress distill --teacher default --student out/pruned --data calibration/default.txt --steps 300 --output out/distilled
    Several GPUs or machines: accelerate launch -m compress distill ...
    """
    from compress import modeling
    from compress.pipeline import run_recipe

    doc = _distill_recipe(teacher, student, student_layers, output, data, generate, steps, lr, batch_size, seq_len,
                          num_samples, eval_samples, temperature, divergence, ce_weight, hidden, hidden_loss, save_every, eval_data, no_eval,
                          keep_worse)
    r = _parse_built_recipe(doc, "compress distill")
    modeling.check_context(modeling.load_config(r.model), seq_len, "--seq-len")  # named as the user typed it
    try:
        with progress_bar() as progress:
            report = run_recipe(r, force=force, device=S.device, dtype=S.dtype, seed=S.seed, progress=progress,
                                resume=resume, baseline=teacher)
    except CompressError as exc:  # the recipe was built from options: name those
        raise _in_option_terms(exc, DISTILL_OPTIONS) from exc  # --debug shows where it came from
    if report.get("skipped"):
        return  # a process other than the main one under `accelerate launch`: the main one reports
    s = report["stages"][-1]["summary"]
    details = [f"held-out KD loss {s['held_out_kd_before']:.4g} -> {s['held_out_kd_after']:.4g}"
               + (f" (training reached {s['held_out_kd_trained']:.4g}, worse: the starting weights are kept)"
                  if "held_out_kd_trained" in s else "")] if "held_out_kd_after" in s else []
    _show_run(report, output, details=details)


# The recipe keys `compress distill` sets, as its options (longest first: one key may prefix another).
DISTILL_OPTIONS = {"data.generate.num_sequences": "--generate", "data.num_samples": "--num-samples",
                   "data.eval_samples": "--eval-samples", "data.seq_len": "--seq-len", "eval_samples": "--eval-samples",
                   "keep_layers": "--student-layers"}


def _in_option_terms(exc: CompressError, options: dict[str, str]) -> CompressError:
    """An error about a recipe a command built, with its keys named as the options that set them.
    Only a whole key is replaced: not one inside a word or a path the user gave (runs/eval_samples/a.txt)."""
    import re

    message, hint = exc.message, exc.hint or ""
    for key, option in options.items():
        whole = re.compile(rf"(?<![\w./~-]){re.escape(key)}(?![\w/-])")
        message, hint = whole.sub(option, message), whole.sub(option, hint)
    return CompressError(message, hint or None)


def _parse_built_recipe(doc: str, command: str, renamed: dict[str, str] = {}) -> "Recipe":  # noqa: B006
    """A recipe a command built from its options: an invalid value is reported against the option
    the user typed (--divergence), not a line of a recipe they never saw."""
    import re

    from compress.recipe import parse_recipe

    try:
        return parse_recipe(doc, command)
    except CompressError as exc:
        found = re.match(rf"{re.escape(command)}:\d+: stages\.0\.\w+\.(?:\w+\.)*(\w+): (.*)", exc.message)
        if not found:
            raise
        key, what = found.groups()
        option = renamed.get(key, "--" + key.replace("_", "-"))
        raise CompressError(f"{command} {option}: {what}", f"see `{command} --help`") from None


def _distill_recipe(teacher, student, student_layers, output, data, generate, steps, lr, batch_size, seq_len,
                    num_samples, eval_samples, temperature, divergence, ce_weight, hidden, hidden_loss, save_every, eval_data, no_eval,
                    keep_worse=False) -> str:
    """The recipe `compress distill` runs, as YAML text, after checking the options agree."""
    import yaml

    if not teacher:
        raise CompressError("no teacher given", "pass --teacher: a local directory, a hub id, or `default`")
    if not output:
        raise CompressError("no output directory given", "pass --output")
    if student is None and student_layers is None:
        raise CompressError("no student given", "pass --student MODEL, or --student-layers 0,2 for a shallower copy of the teacher")
    if data and generate is not None:
        raise CompressError("--data and --generate both given", "train on text (--data) or on teacher samples (--generate)")
    if not data and generate is None:
        raise CompressError("no training data given", "pass --data FILE (or a hub dataset), or --generate N")
    body: dict = {"teacher": teacher, "temperature": temperature, "divergence": divergence, "ce_weight": ce_weight}
    if keep_worse:
        body["keep_start_if_worse"] = False
    if student_layers is not None:
        try:
            body["keep_layers"] = [int(x) for x in student_layers.replace(" ", "").split(",") if x != ""]
        except ValueError:
            raise CompressError(f"--student-layers {student_layers!r} is not a list of block numbers", "e.g. --student-layers 0,2,3") from None
    pairs = []
    for h in hidden:
        try:
            s_idx, t_idx = (int(x) for x in h.split(":"))
        except ValueError:
            raise CompressError(f"--hidden {h!r} is not STUDENT:TEACHER", "e.g. --hidden -1:-1 or --hidden 2:4") from None
        pairs.append({"student": s_idx, "teacher": t_idx})
    if pairs:
        body["hidden"] = pairs
        body["hidden_loss"] = hidden_loss
    elif hidden_loss != "auto":
        raise CompressError(f"--hidden-loss {hidden_loss} given without --hidden", "name the hidden states to match, e.g. --hidden -1:-1")
    body["data"] = {"seq_len": seq_len, "eval_samples": eval_samples}
    if generate is not None:
        body["data"]["generate"] = {"num_sequences": generate}
    else:
        body["data"]["dataset"] = data[0] if len(data) == 1 else list(data)
    if num_samples is not None:
        body["data"]["num_samples"] = num_samples
    body["train"] = {"steps": steps, "lr": lr, "batch_size": batch_size, "save_every": save_every}
    doc: dict = {"model": student or teacher, "stages": [{"distill": body}]}
    if not no_eval:
        # the protocol's 256-token windows, or the training length where that is shorter (within the context)
        doc["evaluation"] = {"datasets": list(eval_data) or ["calibration/heldout-tinyshakespeare.txt"], "seq_len": min(seq_len, 256)}
    doc["output"] = output
    return yaml.safe_dump(doc, sort_keys=False)


def _local_models(*refs: str | None) -> list[str]:
    """The local directories of these model arguments (`default` included; hub ids have none)."""
    from compress import modeling

    out = []
    for ref in filter(None, refs):
        try:
            out.append(modeling.resolve_model(ref))
        except CompressError:
            continue  # no directory to protect; the command reports the bad argument when it loads the model
    return out


def _threshold(name: str):
    """The typer callback that checks a gate threshold (compress.evaluate.threshold_problem)."""
    def check(value: float | None) -> float | None:
        from compress.evaluate import threshold_problem

        problem = None if value is None else threshold_problem(name, value)
        if problem:
            raise typer.BadParameter(problem)
        return value
    return check


@app.command("eval")
def eval_cmd(
    model: str = typer.Option(..., "--model", "-m", help="the model to measure (a compress output, a local dir, a hub id, `default`)."),
    baseline: Optional[str] = typer.Option(None, "--baseline", "-b", help="the uncompressed model, for KL, top-1 agreement, perplexity increase or embedding fidelity."),
    data: list[str] = typer.Option([], "--data", "-d", help="text file(s) to evaluate on; repeat for several."),
    max_ppl_increase: Optional[float] = typer.Option(None, callback=_threshold("max_ppl_increase"), help="fail if token perplexity rises by more than this many percent."),
    max_kl: Optional[float] = typer.Option(None, callback=_threshold("max_kl"), help="fail if mean KL(baseline || model) exceeds this."),
    min_top1: Optional[float] = typer.Option(None, callback=_threshold("min_top1"), help="fail if top-1 agreement with the baseline falls below this."),
    min_cosine: Optional[float] = typer.Option(None, callback=_threshold("min_cosine"), help="encoders: fail if mean embedding cosine falls below this."),
    seq_len: int = typer.Option(256, min=2, help="tokens per evaluation window."),
    max_windows: int = typer.Option(256, min=1, help="windows per file (the protocol's cap)."),
    batch_size: int = typer.Option(8, min=1, help="windows per forward pass."),
    tasks: Optional[str] = typer.Option(None, "--tasks", "-t", help="lm-eval tasks, comma-separated (arc_easy,hellaswag); needs lm-eval (the tasks extra)."),
    include_path: Optional[Path] = typer.Option(None, help="a directory of your own lm-eval task YAML files, for --tasks."),
    num_fewshot: Optional[int] = typer.Option(None, min=0, help="few-shot examples per task prompt (default: each task's own)."),
    limit: Optional[int] = typer.Option(None, min=1, help="score only the first N documents of each task (a quick look)."),
    task_metric: Optional[str] = typer.Option(None, help="the task metric to report and gate (default: acc_norm, else acc, else exact_match)."),
    chat_template: bool = typer.Option(False, "--chat-template", help="instruct models: task prompts, and few-shot examples as turns, through the tokenizer's chat template."),
    min_task_score: Optional[float] = typer.Option(None, callback=_threshold("min_task_score"), help="fail if a task's metric falls below this."),
    max_task_drop: Optional[float] = typer.Option(None, callback=_threshold("max_task_drop"), help="fail if a task scores worse than the baseline by more than this, in its metric's units (0.01: one point of accuracy)."),
    report: Optional[Path] = typer.Option(None, help="write a Markdown report here (for a pull-request comment)."),
    junit: Optional[Path] = typer.Option(None, help="write JUnit XML here (one test case per threshold)."),
):
    """Measure a model: perplexity, KL and top-1 agreement against a baseline (or embedding
    fidelity for encoders), lm-eval task scores, size; with thresholds it is a CI gate: exit 0
    pass, 1 fail, 2 bad input.

    Example: compress eval --model out/w8 --baseline default --data calibration/heldout-tinyshakespeare.txt --max-ppl-increase 2
    """
    from compress.pipeline import evaluate_model
    from compress.report import EVAL_MARKDOWN_START, JUNIT_START, check_figures, evaluation_markdown, junit_xml
    from compress.tasks import TaskRequest

    if S.dtype not in ("auto", "float32"):
        raise CompressError(f"--dtype {S.dtype}: eval always computes in float32 (the benchmark protocol's precision), "
                            "whatever dtype the checkpoint was saved in", "drop --dtype")
    against_baseline = {"max_ppl_increase": max_ppl_increase, "max_kl": max_kl, "min_top1": min_top1,
                        "min_cosine": min_cosine, "max_task_drop": max_task_drop}  # evaluate_model checks they have a baseline
    names = [t.strip() for t in (tasks or "").split(",") if t.strip()]
    task_options = {"--include-path": include_path, "--num-fewshot": num_fewshot, "--limit": limit,
                    "--task-metric": task_metric, "--chat-template": chat_template or None,
                    "--min-task-score": min_task_score, "--max-task-drop": max_task_drop}
    stray = next((k for k, v in task_options.items() if v is not None), None)
    if stray and not names:
        raise CompressError(f"{stray} applies to lm-eval tasks, and none were given", "pass --tasks NAMES")
    for option, f, start in (("--report", report, EVAL_MARKDOWN_START), ("--junit", junit, JUNIT_START)):
        if f is not None:  # a rerun replaces its own report, never another file
            check_side_output(f, option, _local_models(model, baseline), replaces=start)
    if report is not None and junit is not None and report.expanduser().resolve() == junit.expanduser().resolve():
        raise CompressError(f"--report and --junit both name {report}: the second would replace the first",
                            "give each its own path")
    request = TaskRequest(names=names, include_path=str(include_path) if include_path else None, num_fewshot=num_fewshot, limit=limit, metric=task_metric,
                          chat_template=chat_template) if names else None
    with progress_bar() as progress:
        result = evaluate_model(model, data, baseline=baseline, device=S.device, seq_len=seq_len, max_windows=max_windows,
                                batch_size=batch_size, thresholds={**against_baseline, "min_task_score": min_task_score},
                                tasks=request, progress=progress)
    md = f"{EVAL_MARKDOWN_START}`{model}`" + (f" against `{baseline}`" if baseline else "") + "\n\n"
    md += evaluation_markdown(result["results"], result["size"], result["checks"], result["tasks"])
    if report:
        write_whole(report, md)
    if junit:
        write_whole(junit, junit_xml(result["checks"]))
    if S.json:
        emit_json(result)
    elif not S.quiet:
        _print_results(result["results"], result["checks"], result["tasks"])
        size = result["size"]
        _say(f"parameters {size['parameters']:,}; weights on disk {size['bytes_on_disk']:,} bytes "
             f"({size['bits_per_parameter_on_disk']:.2f} bits/param"
             + (", packed)" if size.get("packed") else f"; {size['bits_per_parameter_packed']:.2f} once packed)"))
        if result["checks"]:
            _say("[green]PASS[/green]" if result["passed"] else "[red]FAIL[/red]")
    elif not result["passed"]:  # quiet, but a CI log must still say which threshold failed
        failed = [c for c in result["checks"] if not c["passed"]]
        shown = [(c, *check_figures(c)) for c in failed]
        console.print("FAIL: " + "; ".join(f"{c['dataset']} {c['metric']} {value} (needs {c['comparison']} {threshold})"
                                           for c, value, threshold in shown), soft_wrap=True, highlight=False)
    if not result["passed"]:
        raise typer.Exit(1)


@app.command()
def plan(
    recipe: Path = typer.Option(..., "--recipe", "-r", help="YAML recipe."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="overrides the recipe's model."),
):
    """Dry run: which layer gets which stage and scheme, warnings, and estimates of peak memory,
    output size and bits per parameter, from the model's config alone (no weights are loaded)."""
    from compress.plan import make_plan
    from compress.recipe import load_recipe

    r = load_recipe(recipe)
    model_ref = model or r.model
    if not model_ref:
        raise CompressError(f"{recipe}: no model given", "set `model:` in the recipe or pass --model")
    from compress.pipeline import pick_devices

    pick_devices(S.device)  # a device the run would refuse is refused here too
    p = make_plan(r, model_ref, S.dtype)
    refused = p["refusals"]
    if refused:  # the run would refuse the recipe before any work: so does its plan, after showing it
        p.update({"error": refused[0], "hint": "the run would refuse it: fix the recipe", "exit_code": 2})
    if S.json:
        emit_json(p)
    elif not S.quiet:  # no tables; the recipe's problems are errors, which still print
        _print_plan(p, recipe, model_ref)
    for message in refused:
        console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True, highlight=False)
    if refused:
        raise typer.Exit(2)


def _print_plan(p: dict, recipe: Path, model_ref: str) -> None:
    after = f" → {p['parameters_after']:,}" if p["parameters_after"] != p["parameters"] else ""
    t = Table(title=f"plan: {recipe} on {model_ref} ({p['architecture']}, {p['parameters']:,}{after} params, {p['dtype']})")
    for col in ("layer", "shape", "stage", "scheme"):
        t.add_column(col, **_name_column(col, [*p["assignments"], *p["unassigned"]]))
    for n, a in p["assignments"].items():
        t.add_row(n, "x".join(map(str, a["shape"])), a["stage"], escape(a["scheme"]))
    for n in p["unassigned"]:
        d = p["unassigned_detail"][n]
        cut = f", cut from {'x'.join(map(str, d['cut_from']))}" if d["cut_from"] else ""
        t.add_row(n, "x".join(map(str, d["shape"])), f"[dim]{d['stage']}[/dim]", f"[dim]kept in full precision{cut}[/dim]")
    _print_wide(t)
    for w in p["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {escape(w)}", soft_wrap=True, highlight=False)
    e = p["estimates"]
    training = f" (of which {e['training_bytes'] / 2**20:.0f} MiB training state and teacher)" if e.get("training_bytes") else ""
    packed, dense = f"{e['output_bytes_packed'] / 2**20:.1f} MiB packed", f"{e['output_bytes_dequantized'] / 2**20:.1f} MiB dense"
    if p["format"] == "packed" and any(p["format_reason"] in r for r in p["refusals"]):  # format: packed, refused
        written = f"{dense} with format: dense; the packed format is refused ({p['format_reason']})"
    elif p["format"] == "packed":
        written = f"{packed} ({p['format_reason']}; {dense} with --format dense)"
    elif any(a["weights"] for a in p["assignments"].values()):
        written = f"{dense} ({p['format_reason']}; {packed} where it could)"
    else:
        written = f"{dense} ({p['format_reason']})"
    _say(f"peak memory ≈ {e['peak_memory_bytes'] / 2**20:.0f} MiB{training} for the model, one block's work and "
         f"the activations (the Python process itself adds a few hundred MiB); output ≈ {written}; "
         f"{e['bits_per_parameter_packed']:.2f} bits/parameter packed")


@app.command()
def recipes(directory: Path = typer.Option(None, help="where to look (default: the bundled recipes/).")):
    """List the bundled recipes, one line each."""
    import yaml

    from compress.modeling import bundled_dir

    d = directory or bundled_dir("recipes")
    if not Path(d).is_dir():
        raise CompressError(f"--directory {d}: no such directory", "give a directory holding recipe .yaml files")
    rows = []
    for f in sorted(Path(d).glob("*.yaml")):
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            text = ""
        first = next((ln[1:].strip() for ln in text.splitlines() if ln.startswith("#")), "")
        try:
            doc = yaml.safe_load(text) if text else None
            listed = doc.get("stages", []) if isinstance(doc, dict) else None
            stages = ([next(iter(s)) if isinstance(s, dict) and s else str(s) for s in listed]
                      if isinstance(listed, list) else ["(not a recipe)"])
        except yaml.YAMLError:
            stages = ["(invalid YAML)"]
        name = f"recipes/{f.name}" if directory is None else str(f)  # the name load_recipe takes from any directory
        rows.append({"recipe": name, "stages": stages, "description": first})
    if S.json:
        emit_json(rows)
        return
    out = Console(soft_wrap=True, highlight=False)  # one line per recipe, as promised
    width = max((len(r["recipe"]) for r in rows), default=0)
    for r in rows:
        out.print(escape(f"{r['recipe']:<{width}} {' -> '.join(r['stages']):<20} {r['description']}"))


@app.command()
def keys(name: str = typer.Argument(None, help="a stage (gptq, awq, ...) or a recipe section (recipe, calibration, evaluation).")):
    """Every key a recipe stage or section takes: its type, default and meaning, read from the schema
    recipes are validated with. Without a name: the stages and sections there are."""
    from compress import reference

    if name is None:
        rows = reference.sections()
        if S.json:
            emit_json(rows)
            return
        table = Table("name", "kind", "what it is", box=None)
        for r in rows:
            table.add_row(r["name"], r["kind"], escape(r["summary"]))
        _print_wide(table)
        return
    rows = reference.keys(name)
    if S.json:
        emit_json(rows)
        return
    if not rows:
        Console().print(f"{name} takes no keys: `- {name}: {{}}`", highlight=False)
        return
    table = Table("key", "type", "default", "meaning", box=None)
    for r in rows:
        table.add_row(escape(r["key"]), escape(r["type"]), escape(r["default"]), escape(r["description"]))
    _print_wide(table)


@app.command()
def inspect(path: Path = typer.Argument(..., help="a directory written by compress.")):
    """What was done to a checkpoint: its format, source model (and its weights' hash), recipe and
    stages, every layer's scheme, sparsity and size on disk, the sizes before and after, and the
    evaluation."""
    from compress.modeling import describe_dtype
    from compress.pipeline import inspect_checkpoint

    data = inspect_checkpoint(path)
    if S.json:
        emit_json(data)
        return
    info, report = data["summary"], data["report"]
    src = info["source_model"]
    out = Console(soft_wrap=True, highlight=False)
    out.print(f"[bold]{escape(str(path))}[/bold]: {' -> '.join(info['stages'])} applied to {escape(str(src.get('ref')))} "
              f"({src.get('architecture')}, {src.get('parameters') or 0:,} params, {describe_dtype(src)})")
    out.print(f"source weights sha256: {src.get('weights_sha256')}")
    out.print(f"format: {info['format']}" + (f" ({escape(info['format_reason'])})" if info.get("format_reason") else ""))
    if info.get("kv_cache"):
        kv = info["kv_cache"]["ranges"]
        out.print(f"KV cache: fp8 e4m3, per-tensor static key and value scales for {len(kv)} attention layers "
                  f"({'k_scale and v_scale in the checkpoint' if info['format'] == 'packed' else 'in compress.json only'})")
    # whole blocks removed leave no layer record: the layers are gone, the others untouched
    cuts = [(s["name"], s["summary"]) for s in report.get("stages", []) if "removed_blocks" in (s.get("summary") or {})]
    for stage, summary in cuts:
        out.print(f"blocks removed: {', '.join(map(str, summary['removed_blocks']))} ({summary['removed']}, by {stage})")
    # heads and MLP channels: the layers' new shapes alone do not say they were cut, or from what
    narrowed = [(s["name"], s["summary"]) for s in report.get("stages", []) if "kept_per_block" in (s.get("summary") or {})]
    for stage, summary in narrowed:
        out.print(f"{summary['structure']} removed: {summary['removed']}; kept {summary['kept_per_block']} "
                  f"(by {stage}; which, per block: `inspect --json`)")
    if info["layers"]:
        _print_wide(_layer_table(info["layers"]))
    elif not cuts and not narrowed:  # distillation alone, say: the weights were trained, no layer quantized or pruned
        out.print("layers: none quantized or pruned")
    sz = info["sizes"]
    line = f"size: {sz['source_bytes'] or 0:,} bytes before, {sz['bytes_on_disk']:,} bytes on disk after"
    if sz.get("quantized_layers_ratio_to_float16") is not None:
        line += (f"; quantized layers {sz['quantized_layers_bytes_on_disk']:,} bytes, "
                 f"{sz['quantized_layers_ratio_to_float16']:.3f} of their float16 size")
    out.print(line)
    if info.get("recipe"):
        import yaml

        out.print("recipe:\n" + escape(yaml.safe_dump(info["recipe"], sort_keys=False).rstrip()))
    if report.get("evaluation"):
        _print_results(report["evaluation"])


def _layer_table(layers: dict) -> Table:
    """compress inspect's table of the quantized or pruned layers. No vertical rules: eight
    columns leave more room for the full layer names."""
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    pruned = any(r["sparsity"] is not None for r in layers.values())
    for col in ("layer", "shape", "weights", "activations", "rel. error") + (("sparsity",) if pruned else ()) + ("bytes on disk", "vs fp16"):
        t.add_column(col, **_name_column(col, layers))
    for n, rec in layers.items():
        w, a = rec.get("weights"), rec.get("input_activations")
        sparse = ((f"{rec['sparsity']:.4f}" + (f" ({rec['pattern']})" if rec.get("pattern") else "")) if rec["sparsity"] is not None else "-",) if pruned else ()
        ratio = f"{rec['bytes_on_disk'] / rec['float16_bytes']:.3f}" if rec.get("float16_bytes") and rec["bytes_on_disk"] else "-"
        err = rec.get("relative_error")
        t.add_row(n, "x".join(map(str, rec.get("shape", []))),
                  weights_label(w),
                  activations_label(a),
                  f"{err:.4g}" if err is not None else "-", *sparse, f"{rec['bytes_on_disk']:,}", ratio)
    return t


@app.command()
def bench(
    model: str = typer.Option(..., "--model", "-m", help="the model every recipe runs on (local directory, hub id or `default`)."),
    recipes: list[Path] = typer.Option([], "--recipes", "-r", help="recipe files; give the option once and list them, or repeat it."),
    more: Optional[list[Path]] = typer.Argument(None, help="more recipe files.", show_default=False),
    output: Path = typer.Option(..., "--output", "-o", help="directory for report.md, report.json, report.html and each row's checkpoint."),
    data: list[str] = typer.Option([], "--data", "-d", help="evaluation text(s) (default: BENCH_PROTOCOL.md's test sets, when shared/ is present)."),
    calibration: Optional[str] = typer.Option(None, help="calibration text for recipes that need one and have none (default: the protocol's)."),
    max_windows: int = typer.Option(256, min=1, help="evaluation windows of 256 tokens per file (the protocol's cap)."),
    against: Optional[str] = typer.Option(None, help="also run each recipe with this tool and compare side by side: llmcompressor."),
    against_python: Optional[str] = typer.Option(None, help="the python of the environment where that tool is installed "
                                                 "(default: $COMPRESS_LLMCOMPRESSOR_PYTHON, else this one)."),
):
    """Run several recipes on one model, each in its own process, and compare them as the project's
    benchmark does: KL, top-1 and perplexity against the baseline (embedding fidelity for
    encoders), compression time, peak memory and bytes on disk; report.md/json/html in --output.

    Example: compress bench --model default --recipes recipes/w8a16-absmax.yaml recipes/w4a16-gptq.yaml --output out/bench

    With --against llmcompressor, each recipe also runs through llm-compressor (installed in its
    own environment, --against-python) on the same calibration windows, and report.md gets a
    side-by-side table: quality, perplexity increase, time and memory, as ratios.
    """
    from compress.bench_recipes import bench_recipes

    files = list(recipes) + list(more or [])
    if max_windows <= 0:
        raise CompressError(f"--max-windows {max_windows} must be positive", "e.g. --max-windows 64")
    check_side_output(output, "--output", _local_models(model), directory=True)
    if output.is_dir() and any(output.iterdir()) and not _is_bench_output(output):
        raise CompressError(f"--output {output} exists and holds files that are not a compress bench's"
                            + (" (a compressed checkpoint)" if (output / "compress.json").is_file() else ""),
                            "choose a new or empty directory (a bench's own output may be reused)")
    created = not output.exists()
    try:
        with progress_bar() as progress:
            result = bench_recipes(model, files, output, datasets=list(data) or None, calibration=calibration,
                                   max_windows=max_windows, progress=progress, against=against, against_python=against_python)
    except BaseException:  # interrupted, or failed before any report: nothing half-written is left
        if created:
            shutil.rmtree(output, ignore_errors=True)
        raise
    failed = [r for r in result["rows"] if "error" in r]
    if failed:  # the other rows are measured and reported; the run as a whole is not a success
        message = f"{len(failed)} of {len(result['rows'])} recipes failed ({failed[0]['row']}: {failed[0]['error']})"
        hint = f"the others are in {result['paths']['md']}; each row's log is beside its checkpoint"
        result = {**result, "error": message, "hint": hint, "exit_code": 2}
    if S.json:
        emit_json(result)
    elif not S.quiet:
        _print_bench(result, model)
    if failed:
        console.print(f"[red]error:[/red] {escape(message)} [dim]({escape(hint)})[/dim]", soft_wrap=True, highlight=False)
        raise typer.Exit(2)


def _is_bench_output(path: Path) -> bool:
    """A directory an earlier compress bench wrote: its report.json lists rows. Every checkpoint
    has a report.json too, and compress.json beside it."""
    try:
        report = json.loads((path / "report.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and "rows" in report and not (path / "compress.json").exists()


def _print_bench(result: dict, model: str) -> None:
    t = Table(title=f"compress bench: {model}")
    for col in ("recipe", "scheme", "KL (per set) / 1 − cos", "compression s", "peak RSS MiB", "bytes on disk"):
        t.add_column(col, overflow="fold")
    for r in result["rows"]:
        if "error" in r:
            t.add_row(r["row"], "[red]error[/red]", escape(r["error"]), "", "", "")
            continue
        quality = " / ".join(f"{m['kl_divergence']:.3e}" if "kl_divergence" in m else f"{m.get('embedding_error', float('nan')):.3e}"
                             for m in r["evaluation"].values())
        t.add_row(r["row"], escape(r["scheme"]), quality, f"{r['stage_wall_s']:.2f}", f"{r['process_peak_rss_mib']:.0f}",
                  f"{r['output']['bytes_on_disk']:,}")
        a = r.get("against")
        if a is not None:
            if "evaluation" in a:
                theirs = " / ".join(f"{m['kl_divergence']:.3e}" if "kl_divergence" in m else f"{m.get('embedding_error', float('nan')):.3e}"
                                    for m in a["evaluation"].values())
                t.add_row("  llm-compressor", "", theirs, f"{a['wall_s']:.2f}", f"{a['peak_rss_mib']:.0f}", "")
            else:
                t.add_row("  llm-compressor", "", escape(a.get("skipped") or a.get("error", "")), "", "", "")
    _print_wide(t)
    _say(f"report: {result['paths']['md']} (and .json, .html)")


def _parse_scheme_bits(scheme: str) -> int:
    """`W3`, `w4`, `W3A16` -> the weight width."""
    import re

    m = re.fullmatch(r"[Ww](\d)(?:[Aa]16)?", scheme.strip())
    if not m or not 2 <= int(m.group(1)) <= 8:
        raise CompressError(f"--scheme {scheme!r} is not an integer weight width", "e.g. --scheme W3 or W4A16 (2 to 8 bits)")
    return int(m.group(1))


@app.command()
def analyze(
    model: str = typer.Option(..., "--model", "-m", help="a causal LM: local directory, hub id or `default`."),
    scheme: str = typer.Option("W3", help="weight width each layer is rounded to, alone: W2 ... W8."),
    group_size: int = typer.Option(64, min=0, max=2**17, help="columns per scale; 0 for one scale per output channel."),
    data: list[str] = typer.Option([], "--data", "-d", help="text the analysis windows are cut from (default: calibration/default.txt); repeat to concatenate."),
    windows: int = typer.Option(16, min=1, help="windows of --seq-len tokens (the first ones of --data, or with --shuffle drawn at random)."),
    seq_len: int = typer.Option(256, min=2, help="tokens per window."),
    shuffle: bool = typer.Option(False, "--shuffle", help="draw the windows at random (with --seed) from all of --data, "
                                 "rather than the first ones, which may all come from the first file."),
    metric: str = typer.Option("kl", help="rank by kl (KL divergence from the unquantized model) or ppl (perplexity increase)."),
    emit_recipe: Optional[Path] = typer.Option(None, "--emit-recipe", help="also measure one bit more and one less, and write a mixed-precision recipe here."),
    budget_bits: Optional[float] = typer.Option(None, help="with --emit-recipe: average weight bits to hold (default: the --scheme width), scales counted as the scheme stores them."),
    targets: list[str] = typer.Option([], "--targets", help="layers to analyze: names, class names or re: patterns (default: every Linear but lm_head)."),
    top: int = typer.Option(0, min=0, help="show only the most sensitive N layers (0: all)."),
    force: bool = typer.Option(False, "--force", help="replace an existing --emit-recipe file."),
):
    """Rank layers by what rounding each one alone costs (KL or perplexity), and optionally emit a
    mixed-precision recipe that keeps the most sensitive layers at more bits at the same average width.

    Example: compress analyze --model default --scheme W3 --group-size 64 --emit-recipe out/mixed.yaml
    """
    import yaml

    from compress import modeling
    from compress.calibration import TEXT_FIELD_HINT, build_calibration
    from compress.recipe import CalibrationConfig
    from compress.sensitivity import allocate_bits, analyze as run_analysis, metric_key, mixed_precision_recipe, ranking
    from compress.schemes import scale_bits_of

    bits = _parse_scheme_bits(scheme)
    metric_key(metric)
    if group_size < 0 or windows <= 0 or seq_len <= 0:
        raise CompressError("--group-size must be 0 or more and --windows, --seq-len positive", "e.g. --group-size 64 --windows 16")
    if budget_bits is not None and emit_recipe is None:
        raise CompressError("--budget-bits goes with --emit-recipe", "add --emit-recipe FILE")
    if emit_recipe is not None:
        check_side_output(emit_recipe, "--emit-recipe", _local_models(model))
    if emit_recipe is not None and emit_recipe.exists() and not force:
        raise CompressError(f"--emit-recipe {emit_recipe} already exists", "pass --force to replace it, or choose another path")
    budget = float(bits if budget_bits is None else budget_bits)
    widths = [bits] if emit_recipe is None else sorted({max(2, bits - 1), bits, min(8, bits + 1)})
    if emit_recipe is not None and not min(widths) <= budget <= max(widths):
        raise CompressError(f"--budget-bits {budget:g} is outside the widths measured ({min(widths)} to {max(widths)})",
                            "choose a --scheme next to the budget")
    calibration = {"dataset": list(data) or ["calibration/default.txt"], "num_samples": windows, "seq_len": seq_len,
                   "shuffle": shuffle}
    with progress_bar() as progress:
        progress("loading model", 0, 1)
        net, tokenizer, config = modeling.load_model(model, dtype="float32", device="cpu")
        if not modeling.is_causal_lm(config):
            raise CompressError(f"{model} is not a causal LM", "analyze ranks layers by next-token KL or perplexity")
        modeling.check_context(config, seq_len, "--seq-len")
        from compress.pipeline import inherited_records
        from compress.stages.distill import input_is_quantized

        warnings = []
        if input_is_quantized(inherited_records(model), model):  # its layers would be rounded from their grid values
            warnings.append(f"{model} is already quantized: each layer is measured re-quantized from its stored values, "
                            "not from float weights; analyze the float model it came from")
            if not S.quiet and not S.json:
                console.print(f"[yellow]warning:[/yellow] {escape(warnings[-1])}", soft_wrap=True, highlight=False)
        try:
            cal = build_calibration(CalibrationConfig(**calibration), tokenizer, run_seed=S.seed)
        except CompressError as exc:  # it names recipe keys; here they are options
            raise _in_option_terms(exc, {TEXT_FIELD_HINT: "a 'text' field in each record", "num_samples": "--windows",
                                         "seq_len": "--seq-len", "min_chars": "--windows"}) from exc
        import torch

        ids = torch.cat([s["input_ids"] for s in cal.samples])
        # the output stores scales in the model's own dtype (analysis runs in float32)
        scale_bits = scale_bits_of(modeling.saved_dtype(config))
        result = run_analysis(net, ids, widths, group_size or None, targets=list(targets) or ["Linear"], progress=progress,
                              scale_bits=scale_bits, fused=emit_recipe is not None)
    result.update({"model": model, "metric": metric, "scheme_bits": bits, "data": calibration["dataset"], "shuffled": shuffle,
                   "warnings": warnings})
    result["ranking"] = [{"layer": n, "cost": c} for n, c in ranking(result, bits, metric)]
    if emit_recipe is not None:
        alloc = allocate_bits(result, budget, metric)
        doc = mixed_precision_recipe(alloc, group_size or None, True, model)
        emit_recipe.parent.mkdir(parents=True, exist_ok=True)
        counts = {b: sum(1 for v in alloc["bits"].values() if v == b) for b in widths}
        header = (f"# compress analyze --model {model} --scheme W{bits} --group-size {group_size} --metric {metric}: "
                  f"mixed precision at {alloc['storage_bits_per_weight']:.3f} bits/weight (codes and scales; budget "
                  f"{alloc['budget_bits_per_weight']:.3f}); layers per width: "
                  + ", ".join(f"W{b} {n}" for b, n in sorted(counts.items(), reverse=True)) + "\n")
        emit_recipe.write_text(header + yaml.safe_dump(doc, sort_keys=False))
        result["allocation"] = {**alloc, "recipe": str(emit_recipe)}
    if S.json:
        emit_json(result)
        return
    if S.quiet:
        return
    key = metric_key(metric)
    t = Table(title=f"sensitivity of {model} to W{bits}" + (f" g{group_size}" if group_size else " per-channel")
              + f" on one layer at a time ({result['windows']} windows of {seq_len} tokens)")
    rows = result["ranking"][:top] if top else result["ranking"]
    for col in ("rank", "layer", "parameters", "KL", "top-1", "Δppl %") + (("bits chosen",) if emit_recipe else ()):
        t.add_column(col, justify="right" if col != "layer" else "left", overflow="fold",
                     **_name_column(col, [r["layer"] for r in rows]))
    for i, row in enumerate(rows, 1):
        rec = result["layers"][row["layer"]]
        c = rec["by_bits"][bits]
        extra = (f"W{result['allocation']['bits'][row['layer']]}",) if emit_recipe else ()
        t.add_row(str(i), row["layer"], f"{rec['parameters']:,}", f"{c['kl_divergence']:.3e}", f"{c['top1_agreement']:.4f}",
                  f"{c['ppl_increase_pct']:+.3f}", *extra)
    _print_wide(t)
    _say(f"ranked by {key}; {result['wall_s']:.0f} s")
    if emit_recipe is not None:
        a = result["allocation"]
        _say(f"[green]wrote[/green] {escape(str(emit_recipe))}: {a['storage_bits_per_weight']:.3f} bits/weight "
             f"(budget {a['budget_bits_per_weight']:.3f}); predicted summed cost {a['predicted_cost']:.3e}")


def _say(line: str) -> None:
    """A line of a command's result, on stdout with its tables, so `compress eval ... > log` keeps
    the verdict with the figures; progress, warnings and errors go to stderr (`console`). One
    logical line however long: a piped log is not wrapped mid-sentence."""
    Console(soft_wrap=True, highlight=False).print(line)


def _print_wide(table: Table) -> None:
    """A table on a terminal fits its width; piped to a file or a script it is printed whole
    (rich would otherwise fit it into 80 columns and cut cells to "…")."""
    out = Console()
    if not out.is_terminal:
        out = Console(width=max(out.width, out.measure(table, options=out.options.update_width(1000)).maximum))
    out.print(table)


def _name_column(col: str, names) -> dict:
    """Layer names are what a user copies into a recipe: never cut to "model.la…"; on a narrow
    terminal the other columns wrap instead."""
    return {"no_wrap": True, "min_width": min(max(map(len, names), default=5), 72)} if col == "layer" else {}


def _print_stages(report: dict) -> None:
    t = Table(title="stages")
    for col in ("stage", "wall s", "peak RSS MiB", "summary"):
        t.add_column(col)
    for s in report["stages"]:
        t.add_row(s["name"] + (" (cached)" if s.get("from_cache") else ""), f"{s.get('wall_s', 0):.2f}",
                  f"{s.get('peak_rss_mib', 0):.0f}", escape(
                  ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in s["summary"].items()
                            if not isinstance(v, dict))))  # nested details: report.json
    Console().print(t)  # its summary cells wrap: a one-line summary would run for hundreds of columns


def _print_results(results: dict, checks: list | None = None, tasks: dict | None = None) -> None:
    from compress.report import METRIC_LABELS, TASK_COLUMNS, check_figures, task_rows

    for spec, r in results.items():
        t = Table(title=str(spec))
        t.add_column("metric")
        t.add_column("value", justify="right")
        for k, v in r.items():
            t.add_row(METRIC_LABELS.get(k, k), f"{v:.6g}" if isinstance(v, float) else str(v))
        _print_wide(t)
    if tasks:
        t = Table(title="tasks")
        for i, col in enumerate(TASK_COLUMNS):
            t.add_column(col, justify="right" if i >= 2 else "left")
        for row in task_rows(tasks):
            t.add_row(*map(escape, row))
        _print_wide(t)
    if checks:
        t = Table(title="thresholds")
        for col in ("dataset", "metric", "value", "threshold", "result"):
            t.add_column(col)
        for c in checks:
            value, threshold = check_figures(c)
            t.add_row(c["dataset"], c["metric"], value, f"{c['comparison']} {threshold}",
                      "[green]pass[/green]" if c["passed"] else "[red]fail[/red]")
        _print_wide(t)


def _hoist_global_options(argv: list[str]) -> list[str]:
    """Allow `compress quantize ... --quiet` as well as `compress --quiet quantize ...`."""
    front, rest, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in GLOBAL_FLAGS:
            front.append(a)
        elif name in GLOBAL_OPTIONS:
            front.append(a)
            if "=" not in a and i + 1 < len(argv):
                front.append(argv[i + 1])
                i += 1
        else:
            rest.append(a)
        i += 1
    return front + rest


def main(argv: list[str] | None = None) -> int:
    with _terminate_as_interrupt():
        return _main(argv)


@contextmanager
def _terminate_as_interrupt():
    """`kill` (SIGTERM) is handled like Ctrl-C, so the temporary output is removed on the way out
    instead of the process vanishing mid-write (SIGKILL cannot be caught: the next run into the
    same destination removes what it left)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = _hoist_global_options(list(sys.argv[1:] if argv is None else argv))
    debug = "--debug" in argv
    try:
        _quiet_libraries()  # inside: importing transformers takes seconds, and Ctrl-C then is an interrupt too
        # Without standalone mode click returns typer.Exit's code instead of raising it.
        rc = app(args=argv, prog_name="compress", standalone_mode=False)
        if rc == 130:  # typer turns Ctrl-C into a returned 130; no command of ours exits with it
            return _interrupted(argv)
        return rc if isinstance(rc, int) else 0
    except CompressError as exc:
        if _other_process() and not debug:  # under a launcher every process refuses the same input: the main one says it
            if _outlived_the_main_process():  # refused here alone: nobody else will say it
                console.print(f"[red]error:[/red] process {process_rank()}: {escape(exc.message)}"
                              + (f" [dim]({escape(exc.hint)})[/dim]" if exc.hint else ""), soft_wrap=True, highlight=False)
            return 2
        if debug:  # the traceback, and still the exit code a script tells bad input by
            traceback.print_exc()
        console.print(f"[red]error:[/red] {escape(exc.message)}" + (f" [dim]({escape(exc.hint)})[/dim]" if exc.hint else ""),
                      soft_wrap=True, highlight=False)
        return _json_error(argv, 2, exc.message, exc.hint)
    except typer.Exit as exc:
        return exc.exit_code
    except SystemExit as exc:
        # rich (and click) answer a closed pipe (`compress inspect out | head -1`) by exiting 1;
        # 1 is a failed eval gate here, so exit as a process that SIGPIPE ended, as other Unix
        # tools do (128 + 13)
        if exc.code == 1 and isinstance(exc.__context__, BrokenPipeError):
            return 141
        raise
    except typer.Abort:
        console.print("aborted")
        return 130
    except KeyboardInterrupt:
        return _interrupted(argv)
    except Exception as exc:  # click usage errors come here too
        if _caused_by_interrupt(exc):
            return _interrupted(argv)
        refused = _refused_path(exc)
        if refused is not None:  # what the operating system refuses of a path given: bad input, not a fault
            if debug:
                traceback.print_exc()
            message, hint = refused
            console.print(f"[red]error:[/red] {escape(message)} [dim]({escape(hint)})[/dim]", soft_wrap=True, highlight=False)
            return _json_error(argv, 2, message, hint)
        if isinstance(exc, _usage_error_types()):
            message = exc.format_message()
            if message:  # empty after `compress` alone, whose help has just been shown
                console.print(f"[red]error:[/red] {escape(message)} [dim](run `compress --help`)[/dim]",
                              soft_wrap=True, highlight=False)
            return _json_error(argv, 2, message or "no command given", "run `compress --help`")
        if debug:
            traceback.print_exc()
        first = str(exc).splitlines()[0] if str(exc) else ""
        console.print(f"[red]internal error:[/red] {type(exc).__name__}: {escape(first)} "
                      "[dim](rerun with --debug for the traceback, and please report it)[/dim]", soft_wrap=True, highlight=False)
        return _json_error(argv, 3, f"internal error: {type(exc).__name__}: {first}", "rerun with --debug for the traceback")


_PATH_HINTS = {errno.ENAMETOOLONG: "use a shorter name (compress adds a prefix and suffix for its temporary directory)",
               errno.EACCES: "check the permissions of the path and of the directories above it",
               errno.EPERM: "check the permissions of the path and of the directories above it",
               errno.EROFS: "write somewhere writable", errno.ENOSPC: "free some disk space, or write elsewhere",
               errno.EDQUOT: "free some disk space, or write elsewhere",
               errno.ENOTDIR: "a part of the path is a file, not a directory"}


def _other_process() -> bool:
    """Whether this is a process other than the main one of several a launcher started
    (`accelerate launch`, torchrun): those stay silent about what the main one reports."""
    return process_rank() != 0


# How long a process other than the main one waits, after refusing its input, for the main one to
# say so. The launcher stops every process once one has ended, so a process that ended at once could
# cut the main one off before it reported (it then said only "interrupted"); seen under load with
# torchrun. Only an error of this process's own (the main one carries on) pays the wait.
OTHER_PROCESS_WAIT_S = 30.0


def _outlived_the_main_process() -> bool:
    """Wait for the launcher to stop this process, as it does once the main one has reported the
    same refusal and ended; False when it did, True when the wait ran out."""
    import time

    try:
        time.sleep(OTHER_PROCESS_WAIT_S)
    except KeyboardInterrupt:  # the launcher's SIGTERM (cli._terminate_as_interrupt)
        return False
    return True


def _caused_by_interrupt(exc: BaseException) -> bool:
    """A Ctrl-C that a library turned into its own error: transformers' lazy imports re-raise
    whatever interrupted them as "ModuleNotFoundError: Could not import module 'LlamaConfig'"."""
    seen = 0
    while exc is not None and seen < 32:  # a bound: a chain may loop back on itself
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _refused_path(exc: BaseException) -> tuple[str, str] | None:
    """(message, hint) when `exc` is the operating system refusing a named path (too long a name,
    no permission, a read-only or full disk), or a full disk anywhere, else None. A full disk
    reaches here without a file name (a failed write), or inside a library's own error
    (safetensors' SafetensorError says "No space left on device"): the environment, not a fault."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.errno in _PATH_HINTS:
        return f"{exc.filename}: {exc.strerror}", _PATH_HINTS[exc.errno]
    seen = 0
    while exc is not None and seen < 32:
        full = (isinstance(exc, OSError) and exc.errno in _DISK_FULL) or any(
            os.strerror(code) in str(exc) for code in _DISK_FULL)
        if full:
            where = f"{exc.filename}: " if isinstance(exc, OSError) and exc.filename else ""
            return f"{where}no space left on the disk while writing", _PATH_HINTS[errno.ENOSPC]
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _quiet_libraries() -> None:
    """transformers' warnings and progress bars off: a run draws its own bars, and says what matters."""
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass
    # huggingface_hub logs each failed request ("... thrown while requesting HEAD ...") before the
    # exception that compress turns into its one-line error
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)


def _json_error(argv: list[str], code: int, message: str, hint: str | None) -> int:
    """With --json a failure is JSON on stdout too, so a script reading stdout can tell it from a
    result; the one-line message stays on stderr."""
    if "--json" in argv:
        emit_json({"error": message, "hint": hint, "exit_code": code})
    return code


def _interrupted(argv: list[str]) -> int:
    """Ctrl-C (or SIGTERM): the output is written atomically, so nothing partial exists; say how
    to go on, on stderr and, with --json, on stdout as any failure is. Returns the exit code, 130.
    Under a launcher only the main process says it: the launcher stops the others once one process
    has ended (often the main one, having reported bad input), and their words would follow its."""
    if _other_process():
        return 130
    message, hint = "interrupted", None
    if WRITING_COMMANDS & set(argv):  # eval, analyze, bench: nothing to resume
        from compress.pipeline import RUNNING, kept_training_step

        resuming = "--resume" in argv or any(a.split("=", 1)[0] == "--cache-dir" for a in argv)
        message = "interrupted: no output was written"
        cache = RUNNING.get("cache")
        kept = cache is not None and bool(cache.stored or cache.restored)
        hint = ("the completed stages are in the stage cache: rerun the same command to continue" if resuming and kept
                else "no stage completed before the interruption: rerun the same command" if resuming
                else "rerun the same command (offload: disk keeps no stage cache)" if RUNNING.get("offload")
                else "rerun with --resume to keep completed stages across interruptions")
        step = kept_training_step(RUNNING["work_dir"])
        if step is not None:  # a training stage saved checkpoints (save_every), which --resume continues from
            hint = (f"training reached a checkpoint at step {step}, kept in {RUNNING['work_dir']}: rerun the same command"
                    + ("" if resuming else " with --resume") + " to continue from it")
    console.print(message + (f" [dim]({hint})[/dim]" if hint else ""), soft_wrap=True, highlight=False)
    return _json_error(argv, 130, message, hint)


def _usage_error_types() -> tuple:
    """click's usage errors; recent typer vendors its own copy of click, so check both."""
    import click

    types: tuple = (click.exceptions.ClickException,)
    try:
        from typer._click.exceptions import ClickException as VendoredClickException

        types += (VendoredClickException,)
    except ImportError:
        pass
    return types


if __name__ == "__main__":
    sys.exit(main())
