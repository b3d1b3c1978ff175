"""The `compress` command line: a thin layer over the Python API in compress.pipeline.

Global options (--device, --dtype, --seed, --quiet, --json, --debug) may be given before or after
the command name. Exit codes: 0 success (or gate passed), 1 gate failed, 2 bad input, 3 internal
error.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from compress.errors import CompressError

app = typer.Typer(
    name="compress",
    help="Compress Hugging Face transformers models with YAML recipes: quantize, evaluate, inspect.",
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
    device: str = typer.Option("auto", help="auto (CUDA when present), cpu or cuda."),
    dtype: str = typer.Option("auto", help="dtype to load the model in: auto (as saved), float32, bfloat16, float16."),
    seed: int = typer.Option(0, help="random seed for calibration sampling and any stochastic step."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bars or tables."),
    json_out: bool = typer.Option(False, "--json", help="print a machine-readable JSON result on stdout."),
    debug: bool = typer.Option(False, "--debug", help="show full tracebacks on errors."),
):
    S.device, S.dtype, S.seed, S.quiet, S.json, S.debug = device, dtype, seed, quiet or json_out, json_out, debug


@contextmanager
def progress_bar():
    """Yields progress(description, completed, total); silent with --quiet or --json."""
    if S.quiet:
        yield lambda *_: None
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("starting", total=1)

        def update(description: str, completed: int, total: int) -> None:
            bar.update(task, description=description, completed=completed, total=max(total, 1))

        yield update


def emit_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@app.command()
def quantize(
    recipe: Path = typer.Option(..., "--recipe", "-r", help="YAML recipe (see `compress recipes`)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="hub id, local directory or `default`; overrides the recipe's model."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="output directory; overrides the recipe's output."),
    force: bool = typer.Option(False, "--force", help="replace an existing output directory."),
):
    """Run a recipe's stages on a model and save the compressed checkpoint with its report.

    Example: compress quantize --recipe recipes/w8a16-absmax.yaml --model default --output out/w8
    """
    from compress.pipeline import run_recipe
    from compress.recipe import load_recipe

    r = load_recipe(recipe)
    with progress_bar() as progress:
        report = run_recipe(r, model=model, output=output, force=force, device=S.device, dtype=S.dtype,
                            seed=S.seed, progress=progress)
    out = output or r.output
    if S.json:
        emit_json({"output": str(out), **report})
        return
    if not S.quiet:
        console.print(f"[green]wrote[/green] {out}")
        _print_stages(report)
        if report.get("evaluation"):
            _print_results(report["evaluation"])
        console.print(f"report: {Path(out) / 'report.md'}")


@app.command("eval")
def eval_cmd(
    model: str = typer.Option(..., "--model", "-m", help="the model to measure (a compress output, a local dir, a hub id, `default`)."),
    baseline: Optional[str] = typer.Option(None, "--baseline", "-b", help="the uncompressed model, for KL, top-1 agreement, perplexity increase or embedding fidelity."),
    data: list[str] = typer.Option([], "--data", "-d", help="text file(s) to evaluate on; repeat for several."),
    max_ppl_increase: Optional[float] = typer.Option(None, help="fail if token perplexity rises by more than this many percent."),
    max_kl: Optional[float] = typer.Option(None, help="fail if mean KL(baseline || model) exceeds this."),
    min_top1: Optional[float] = typer.Option(None, help="fail if top-1 agreement with the baseline falls below this."),
    min_cosine: Optional[float] = typer.Option(None, help="encoders: fail if mean embedding cosine falls below this."),
    seq_len: int = typer.Option(256, help="tokens per evaluation window."),
    max_windows: int = typer.Option(256, help="windows per file (the protocol's cap)."),
    batch_size: int = typer.Option(8, help="windows per forward pass."),
    report: Optional[Path] = typer.Option(None, help="write a Markdown report here (for a pull-request comment)."),
    junit: Optional[Path] = typer.Option(None, help="write JUnit XML here (one test case per threshold)."),
):
    """Measure a model: perplexity, KL and top-1 agreement against a baseline (or embedding
    fidelity for encoders), size; with thresholds it is a CI gate: exit 0 pass, 1 fail, 2 bad input.

    Example: compress eval --model out/w8 --baseline default --data calibration/heldout-tinyshakespeare.txt --max-ppl-increase 2
    """
    from compress.pipeline import evaluate_model
    from compress.report import evaluation_markdown, junit_xml

    thresholds = {"max_ppl_increase": max_ppl_increase, "max_kl": max_kl, "min_top1": min_top1, "min_cosine": min_cosine}
    given = [k for k, v in thresholds.items() if v is not None]
    if given and baseline is None:
        raise CompressError(f"--{given[0].replace('_', '-')} compares against the uncompressed model", "pass --baseline")
    for f in (report, junit):
        if f is not None and f.is_dir():
            raise CompressError(f"report path {f} is a directory", "give a file path")
    with progress_bar() as progress:
        result = evaluate_model(model, data, baseline=baseline, device=S.device, seq_len=seq_len, max_windows=max_windows,
                                batch_size=batch_size, thresholds=thresholds, progress=progress)
    md = f"## compress eval: `{model}`" + (f" against `{baseline}`" if baseline else "") + "\n\n"
    md += evaluation_markdown(result["results"], result["size"], result["checks"])
    if report:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(md)
    if junit:
        junit.parent.mkdir(parents=True, exist_ok=True)
        junit.write_text(junit_xml(result["checks"]))
    if S.json:
        emit_json(result)
    elif not S.quiet:
        _print_results(result["results"], result["checks"])
        size = result["size"]
        console.print(f"parameters {size['parameters']:,}; weights on disk {size['bytes_on_disk']:,} bytes "
                      f"({size['bits_per_parameter_on_disk']:.2f} bits/param; {size['bits_per_parameter_packed']:.2f} once packed)")
        if result["checks"]:
            console.print("[green]PASS[/green]" if result["passed"] else "[red]FAIL[/red]")
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
    p = make_plan(r, model_ref)
    if S.json:
        emit_json(p)
        return
    t = Table(title=f"plan: {recipe} on {model_ref} ({p['architecture']}, {p['parameters']:,} params, {p['dtype']})")
    for col in ("layer", "shape", "stage", "scheme"):
        t.add_column(col)
    for n, a in p["assignments"].items():
        t.add_row(n, "x".join(map(str, a["shape"])), a["stage"], escape(a["scheme"]))
    for n in p["unassigned"]:
        t.add_row(n, "", "[dim]-[/dim]", "[dim]kept in full precision[/dim]")
    Console().print(t)
    for w in p["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {w}")
    e = p["estimates"]
    Console().print(f"peak memory ≈ {e['peak_memory_bytes'] / 2**20:.0f} MiB; output ≈ {e['output_bytes_dequantized'] / 2**20:.1f} MiB "
                    f"as saved now (dequantized), ≈ {e['output_bytes_packed'] / 2**20:.1f} MiB packed; "
                    f"{e['bits_per_parameter_packed']:.2f} bits/parameter packed")


@app.command()
def recipes(directory: Path = typer.Option(None, help="where to look (default: the bundled recipes/).")):
    """List the bundled recipes, one line each."""
    import yaml

    from compress.modeling import REPO_DIR

    d = directory or (REPO_DIR / "recipes")
    rows = []
    for f in sorted(Path(d).glob("*.yaml")):
        text = f.read_text()
        first = next((ln[1:].strip() for ln in text.splitlines() if ln.startswith("#")), "")
        try:
            stages = [next(iter(s)) if isinstance(s, dict) else s for s in (yaml.safe_load(text) or {}).get("stages", [])]
        except yaml.YAMLError:
            stages = ["(invalid YAML)"]
        rows.append({"recipe": str(f.relative_to(REPO_DIR)) if f.is_relative_to(REPO_DIR) else str(f), "stages": stages, "description": first})
    if S.json:
        emit_json(rows)
        return
    out = Console(soft_wrap=True, highlight=False)  # one line per recipe, as promised
    for r in rows:
        out.print(escape(f"{r['recipe']:<34} {' -> '.join(r['stages']):<20} {r['description']}"))


@app.command()
def inspect(path: Path = typer.Argument(..., help="a directory written by compress.")):
    """What was done to a checkpoint: its stages, layer schemes, errors, size and evaluation."""
    meta_file, report_file = path / "compress.json", path / "report.json"
    if not path.is_dir():
        raise CompressError(f"{path} is not a directory", "pass a directory written by `compress quantize`")
    if not meta_file.is_file():
        raise CompressError(f"{path} has no compress.json: it was not written by compress", "inspect a compress output directory")
    meta = json.loads(meta_file.read_text())
    report = json.loads(report_file.read_text()) if report_file.is_file() else {}
    if S.json:
        emit_json({"compress": meta, "report": report})
        return
    src = meta.get("source_model", {})
    Console().print(f"[bold]{path}[/bold]: {' -> '.join(meta.get('stages', []))} applied to {src.get('ref')} "
                    f"({src.get('architecture')}, {src.get('parameters', 0):,} params)")
    t = Table()
    for col in ("layer", "shape", "weights", "activations", "rel. error"):
        t.add_column(col)
    for n, rec in meta.get("layers", {}).items():
        w, a = rec.get("weights"), rec.get("input_activations")
        t.add_row(n, "x".join(map(str, rec.get("shape", []))),
                  f"{w['type']}{w['num_bits']} {w['strategy']}{' g' + str(w['group_size']) if w.get('group_size') else ''} {'sym' if w['symmetric'] else 'asym'}" if w else "-",
                  f"{a['type']}{a['num_bits']} {a['strategy']} {'dynamic' if a['dynamic'] else 'static'}" if a else "-",
                  f"{rec.get('relative_error', float('nan')):.4g}")
    Console().print(t)
    if report.get("output"):
        o = report["output"]
        Console().print(f"size: {o['bytes_on_disk']:,} bytes on disk, {o['bits_per_parameter_packed']:.2f} bits/parameter once packed")
    if report.get("evaluation"):
        _print_results(report["evaluation"])


def _print_stages(report: dict) -> None:
    t = Table(title="stages")
    for col in ("stage", "wall s", "peak RSS MiB", "summary"):
        t.add_column(col)
    for s in report["stages"]:
        t.add_row(s["name"], f"{s['wall_s']:.2f}", f"{s['peak_rss_mib']:.0f}", escape(
                  ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in s["summary"].items())))
    Console().print(t)


def _print_results(results: dict, checks: list | None = None) -> None:
    from compress.report import METRIC_LABELS

    for spec, r in results.items():
        t = Table(title=str(spec))
        t.add_column("metric")
        t.add_column("value", justify="right")
        for k, v in r.items():
            t.add_row(METRIC_LABELS.get(k, k), f"{v:.6g}" if isinstance(v, float) else str(v))
        Console().print(t)
    if checks:
        t = Table(title="thresholds")
        for col in ("dataset", "metric", "value", "threshold", "result"):
            t.add_column(col)
        for c in checks:
            t.add_row(c["dataset"], c["metric"], f"{c['value']:.6g}", f"{c['threshold']:.6g}",
                      "[green]pass[/green]" if c["passed"] else "[red]fail[/red]")
        Console().print(t)


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
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = _hoist_global_options(list(sys.argv[1:] if argv is None else argv))
    debug = "--debug" in argv
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        # Without standalone mode click returns typer.Exit's code instead of raising it.
        rc = app(args=argv, prog_name="compress", standalone_mode=False)
        return rc if isinstance(rc, int) else 0
    except CompressError as exc:
        if debug:
            raise
        console.print(f"[red]error:[/red] {escape(exc.message)}" + (f" [dim]({escape(exc.hint)})[/dim]" if exc.hint else ""),
                      soft_wrap=True, highlight=False)
        return 2
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        console.print("aborted")
        return 130
    except KeyboardInterrupt:
        console.print("interrupted: no output was written")
        return 130
    except Exception as exc:  # click usage errors come here too
        if isinstance(exc, _usage_error_types()):
            console.print(f"[red]error:[/red] {escape(exc.format_message())} [dim](run `compress --help`)[/dim]",
                          soft_wrap=True, highlight=False)
            return 2
        if debug:
            raise
        console.print(f"[red]internal error:[/red] {type(exc).__name__}: {escape(str(exc).splitlines()[0]) if str(exc) else ''} "
                      "[dim](rerun with --debug for the traceback, and please report it)[/dim]", soft_wrap=True, highlight=False)
        return 3


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
