"""Reports: report.json (everything, machine-readable), report.md (for people and pull-request
comments), and JUnit XML for CI systems."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

import torch

from compress.modeling import describe_dtype
from compress.schemes import activations_label, weights_label


def versions() -> dict:
    import transformers

    from compress import __version__

    return {"compress": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def _fmt(v) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):  # report.json has null there (strict_json)
            return "-"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        if abs(v) < 0.01:  # four significant digits, as above (four decimals gave a KL of 0.00134 as 0.0013)
            return f"{v:.4g}"
        return f"{v:.4f}"
    return str(v)


def check_figures(check: dict) -> tuple[str, str]:
    """A threshold check's value and threshold as printed: six significant digits, or, where those
    would print the same for different numbers (a value just past its threshold), every digit,
    so that a failing line never reads "0.00133705 <= 0.00133705"."""
    value, threshold = check["value"], check["threshold"]
    if not math.isfinite(value):
        return "-", f"{threshold:.6g}"
    shown = f"{value:.6g}", f"{threshold:.6g}"
    return (repr(float(value)), repr(float(threshold))) if shown[0] == shown[1] and value != threshold else shown


METRIC_LABELS = {
    "token_perplexity": "token perplexity",
    "baseline_token_perplexity": "baseline token perplexity",
    "ppl_increase_pct": "token perplexity increase (%)",
    "word_perplexity": "word perplexity (lm-eval: exp(NLL / words))",
    "baseline_word_perplexity": "baseline word perplexity",
    "kl_divergence": "KL(base ‖ model), mean per position",
    "top1_agreement": "top-1 agreement",
    "mean_cosine": "mean embedding cosine",
    "embedding_error": "embedding error (1 - cosine)",
    "min_cosine": "min embedding cosine",
    "nn_agreement": "nearest-neighbour agreement",
    "windows": "windows",
    "tokens_predicted": "tokens predicted",
    "words": "words",
    "sentences": "sentences",
}


def task_rows(tasks: dict) -> list[list[str]]:
    """One row per lm-eval task: task, metric, score ± stderr, documents, baseline, and how much
    worse than the baseline it scores (compress.tasks.worsening)."""
    rows = []
    for name, r in tasks.items():
        score = _fmt(r["score"]) + (f" ± {_fmt(r['stderr'])}" if r.get("stderr") is not None else "")
        rows.append([name, r["metric"], score, str(r.get("samples") or "-"),
                     _fmt(r["baseline_score"]) if "baseline_score" in r else "-",
                     _fmt(r["score_drop"]) if "score_drop" in r else "-"])
    return rows


TASK_COLUMNS = ["task (lm-eval)", "metric", "score ± stderr", "documents", "baseline", "worse by"]


def evaluation_markdown(results: dict, size: dict | None = None, checks: list[dict] | None = None,
                        tasks: dict | None = None) -> str:
    lines = []
    if checks:
        failed = [c for c in checks if not c["passed"]]
        lines += [f"**{'FAIL' if failed else 'PASS'}**: {len(checks) - len(failed)}/{len(checks)} thresholds met", ""]
        lines += ["| dataset | metric | value | threshold | result |", "| --- | --- | ---: | ---: | --- |"]
        for c in checks:
            value, threshold = check_figures(c)  # as the JUnit message and the terminal give them
            lines.append(f"| {c['dataset']} | {c['metric']} | {value} | {c['comparison']} {threshold} "
                         f"| {'pass' if c['passed'] else '**fail**'} |")
        lines.append("")
    for spec, r in results.items():
        lines += [f"### {spec}", "", "| metric | value |", "| --- | ---: |"]
        for k, v in r.items():
            lines.append(f"| {METRIC_LABELS.get(k, k)} | {_fmt(v)} |")
        lines.append("")
    if tasks:
        lines += ["### tasks", "", "| " + " | ".join(TASK_COLUMNS) + " |", "| --- | --- | ---: | ---: | ---: | ---: |"]
        lines += ["| " + " | ".join(row) + " |" for row in task_rows(tasks)]
        lines.append("")
    if size:
        lines += ["### size", "", "| | value |", "| --- | ---: |"]
        for k, v in size.items():
            lines.append(f"| {k.replace('_', ' ')} | {_fmt(v)} |")
        lines.append("")
    return "\n".join(lines)


EVAL_MARKDOWN_START = "## compress eval: "
JUNIT_START = '<?xml version="1.0" encoding="UTF-8"?>\n<testsuite name="compress-eval"'


def junit_xml(checks: list[dict], name: str = "compress-eval") -> str:
    failures = sum(not c["passed"] for c in checks)
    cases = []
    for c in checks:
        # the dataset goes in the case's name: CI servers split a classname at its dots into
        # packages, and a file name (heldout.txt) would become one
        value, threshold = check_figures(c)
        measured = f"{c['metric']} = {value}, needs {c['comparison']} {threshold}"
        case = f'  <testcase classname={quoteattr(name)} name={quoteattr(c["dataset"] + ": " + c["metric"])}>'
        if not c["passed"]:
            case += f"\n    <failure message={quoteattr(measured)}>{escape(measured)}</failure>"
        case += f"\n    <system-out>{escape(measured)}</system-out>"  # the value, passed or not (after failure: JUnit's order)
        cases.append(case + "\n  </testcase>")
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<testsuite name={quoteattr(name)} tests="{len(checks)}" '
            f'failures="{failures}">\n' + "\n".join(cases) + "\n</testsuite>\n")


def provenance(report: dict) -> list[str]:
    """Where a run came from, one line each (report.md's list, report.html's too): the source
    model and its weights' hash, recipe, seed and device, calibration, versions."""
    src = report["source_model"]
    lines = [f"source model: {src['ref']} (sha256 of weights {(src.get('weights_sha256') or 'unknown')[:16]}…, "
             f"{src['parameters']:,} parameters, {describe_dtype(src)})",
             f"recipe: {report['recipe_source']}; seed {report['seed']}; device {report['device']}"]
    cal = report.get("calibration")
    if cal:
        lines.append(f"calibration: {cal['source']}, {cal['num_samples']} samples, {cal['tokens']:,} tokens, "
                     f"fingerprint {cal['fingerprint'][:16]}…")
    v = report["versions"]
    lines.append(f"versions: compress {v['compress']}, torch {v['torch']}, transformers {v['transformers']}, python {v['python']}")
    return lines


def stage_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """The stage table of report.md and report.html, header and rows: stage (marked when the stage
    cache restored it), wall s, peak RSS MiB, peak GPU memory when a stage used a GPU, and the
    summary's flat values (nested details are in report.json)."""
    gpu = any(s.get("peak_cuda_mib") for s in report["stages"])
    header = ["stage", "wall s", "peak RSS MiB"] + (["peak GPU MiB"] if gpu else []) + ["summary"]
    return header, [[s["name"] + (" (from the stage cache)" if s.get("from_cache") else ""), f"{s.get('wall_s', 0):.2f}",
                     f"{s.get('peak_rss_mib', 0):.0f}"] + ([f"{s.get('peak_cuda_mib') or 0:.0f}"] if gpu else [])
                    + [", ".join(f"{k} {_summary_value(v)}" for k, v in s["summary"].items() if _summary_value(v) is not None)]
                    for s in report["stages"]]


def _summary_value(value) -> str | None:
    """A stage summary's value as the stage table shows it: plain values, and short lists of
    names or indices (the blocks a structured stage removed); None for what only report.json holds."""
    if isinstance(value, list) and 0 < len(value) <= 16 and all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in value):
        return "[" + ", ".join(map(str, value)) + "]"
    return None if isinstance(value, (dict, list)) else _fmt(value)


LAYER_NOTE = ("relative error: ‖W − Ŵ‖ / ‖W‖ of the last stage that changed the layer, W being the weights that stage "
              "received (a quantization after pruning: the pruned weights; QAT: the input model's weights where it had "
              "them, report.json's relative_error_against says)")
PRUNING_NOTE = "; pruning error: the pruning stage's, against the weights it received"


def layer_rows(report: dict) -> tuple[list[str], list[list[str]], str]:
    """The per-layer table of report.md and report.html: header, rows, and what its errors are
    measured against. A layer pruned then quantized shows both stages' errors: the quantization's
    alone, next to a sparsity, once read as the layer's whole error."""
    layers = report["layers"]
    pruned = any("sparsity" in rec for rec in layers.values())
    both = any("pruning_relative_error" in rec and rec.get("weights") for rec in layers.values())
    header = (["layer", "shape", "weights", "activations", "relative error"] + (["pruning error"] if both else [])
              + (["sparsity"] if pruned else []))
    rows = []
    for name, rec in layers.items():
        a = rec.get("input_activations")
        row = [name, "x".join(map(str, rec.get("shape", []))), weights_label(rec.get("weights") or {}),
               activations_label(a),
               _fmt(rec["relative_error"]) if "relative_error" in rec else "-"]
        if both:
            row.append(_fmt(rec["pruning_relative_error"]) if "pruning_relative_error" in rec else "-")
        if pruned:
            row.append(f"{rec['sparsity']:.4f}{' (' + rec['pattern'] + ')' if rec.get('pattern') else ''}" if "sparsity" in rec else "-")
        rows.append(row)
    return header, rows, LAYER_NOTE + (PRUNING_NOTE if both else "")


def size_lines(report: dict) -> list[str]:
    out = report["output"]
    nonzero = out.get("nonzero_parameters")
    pruned = any("sparsity" in rec for rec in report["layers"].values())
    zeros = (f" ({nonzero:,} nonzero, {1 - nonzero / out['parameters']:.2%} zeros; stored densely)"
             if pruned and nonzero is not None and nonzero < out["parameters"] else "")  # not a 4-bit grid's rounded zeros
    source = report["source_model"].get("bytes")
    smaller = f", {out['bytes_on_disk'] / source:.1%} of the source's {source:,}" if source else ""
    kv = report.get("kv_cache")
    return [f"parameters: {out['parameters']:,}{zeros}",
            f"weights on disk: {out['bytes_on_disk']:,} bytes{smaller} ({out['bits_per_parameter_on_disk']:.2f} bits/parameter; "
            f"{_storage(report)})",
            *([f"KV cache: {len(kv['ranges'])} attention layers' keys and values in float8 e4m3, one static scale each"] if kv else []),
            f"bits/parameter packed, ideally (codes at their width, scales in the model's dtype or the 8-bit block "
            f"scales of FP4, MXFP6 and MXFP8, zero-points at the code width): {out['bits_per_parameter_packed']:.2f}"]


def run_markdown(report: dict) -> str:
    lines = ["# compress report", ""] + [f"- {line}" for line in provenance(report)]
    lines += [f"- warning: {w}" for w in report.get("warnings", [])]
    header, rows = stage_rows(report)
    lines += ["", "## Stages", "", "| " + " | ".join(header) + " |",
              "| --- | " + "---: | " * (len(header) - 2) + "--- |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    header, rows, note = layer_rows(report)
    lines += ["", "## Layers", ""]
    if rows:
        lines += [note + ".", "", "| " + " | ".join(header) + " |",
                  "| " + " | ".join("---" if i < 4 else "---:" for i in range(len(header))) + " |"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    else:
        lines.append("No per-layer record: these stages changed no layer's weights.")
    lines += ["", "## Size", ""] + [f"- {line}" for line in size_lines(report)]
    if report.get("evaluation") or report.get("tasks"):
        lines += ["", "## Evaluation", "", evaluation_markdown(report.get("evaluation") or {}, tasks=report.get("tasks"))]
    elif report.get("evaluation_note"):  # asked for, not run (offload: disk)
        lines += ["", "## Evaluation", "", f"Evaluation {report['evaluation_note']}"]
    return "\n".join(lines) + "\n"


def _storage(report: dict) -> str:
    """How the checkpoint holds its weights, from the format the run wrote (report.json `format`)."""
    fmt, dtype = report.get("format") or {}, report["source_model"]["dtype"]
    quantized = report["output"].get("quantized_parameters", 0) > 0
    if fmt.get("format") == "packed" and fmt.get("packed_layers") == 0:  # a KV cache alone
        return f"no weight quantized: the compressed-tensors format for the KV cache scales, weights in {dtype}"
    if fmt.get("format") == "packed":
        name = fmt.get("compressed_tensors_format", "compressed-tensors")
        # FP4 and the MX formats keep one 8-bit scale per block (e4m3 or e8m0) whatever the model's dtype
        scales = "8-bit block scales" if name.startswith(("mxfp", "nvfp4")) else f"scales in {fmt.get('scale_dtype', dtype)}"
        reason = fmt.get("reason", "")
        notes = reason.split("; ", 1)[1] if "; " in reason else ""  # what a reader should know (decide's notes)
        return f"{fmt.get('packed_layers', 'the')} quantized layers packed ({name}, {scales}), the rest in {dtype}" + \
            (f"; {notes}" if notes else "")
    if quantized:
        return f"weights stored dequantized in {dtype}: {fmt.get('reason', 'dense format')}"
    return f"stored in {dtype}"


def strict_json(data, **kwargs) -> str:
    """JSON that every parser reads: a NaN or infinite number (a word perplexity that overflows,
    say) becomes null, where json.dumps would write NaN or Infinity, which are not JSON."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x
    return json.dumps(clean(data), allow_nan=False, default=str, **kwargs)


def write_json(path: Path, data) -> None:
    path.write_text(strict_json(data, indent=2, sort_keys=False) + "\n")


def write_reports(directory: Path, report: dict) -> dict[str, Path]:
    """report.json, report.md and report.html for one run, side by side in `directory`: the one
    call every command that compresses a model (quantize, prune, distill) ends with."""
    from compress.html_report import run_html

    directory = Path(directory)
    paths = {"json": directory / "report.json", "md": directory / "report.md", "html": directory / "report.html"}
    write_json(paths["json"], report)
    paths["md"].write_text(run_markdown(report))
    paths["html"].write_text(run_html(report))
    return paths
