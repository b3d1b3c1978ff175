"""report.html: one self-contained page (inline CSS and inline SVG, no scripts, nothing fetched)
for a single run (its stages, size, evaluation and a bar per layer of its error) and for a
benchmark (every row's quality against its bytes on disk, with the Pareto front).

The plots come from compress/svg.py; this module only decides what goes on the page.
"""

from __future__ import annotations

import math
from html import escape

from compress.svg import Point, bars, scatter

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; margin: 24px auto; max-width: 1100px; padding: 0 16px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ddd; } h3 { font-size: 15px; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; } th { background: #f4f4f4; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { background: #f4f4f4; padding: 0 3px; border-radius: 3px; }
ul.meta { padding-left: 18px; } .note { color: #555; }
svg.plot { display: block; margin: 8px 0 18px; background: #fff; }
svg .frame { fill: none; stroke: #999; } svg .grid { stroke: #eee; } svg .axisline { stroke: #999; }
svg .tick { font-size: 11px; fill: #444; } svg .axis { font-size: 12px; fill: #222; } svg .legend { font-size: 11px; fill: #222; }
svg .ptitle { font-size: 13px; font-weight: 600; fill: #222; } svg .plabel { font-size: 10px; fill: #333; }
div.scroll { overflow-x: auto; }
svg .point { stroke: #fff; stroke-width: 1; opacity: 0.85; } svg .front-point { stroke: #000; stroke-width: 1.5; opacity: 1; }
svg .front { fill: none; stroke: #000; stroke-width: 1.5; stroke-dasharray: 5 3; }
svg .bar { fill: #4c78a8; }
"""


def page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>\n"
            f"<h1>{escape(title)}</h1>\n" + "\n".join(body) + "\n</body></html>\n")


def _num(v, fmt: str = ".4g") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if isinstance(v, int):
        return f"{v:,}"
    return format(v, fmt)


def table(header: list[str], rows: list[list], numeric: set[int] | None = None) -> str:
    """An HTML table; cells are escaped; columns in `numeric` are right-aligned."""
    numeric = numeric or set()
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f'<td{" class=num" if i in numeric else ""}>{escape(str(c))}</td>'
                                     for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<div class=scroll><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"




def run_html(report: dict) -> str:
    """The page for one quantize / prune (or distill) run, from report.json's content: what
    report.md says (report.py builds both from the same rows), with the per-layer plots."""
    from compress.report import METRIC_LABELS, TASK_COLUMNS, layer_rows, provenance, size_lines, stage_rows, task_rows

    body = ["<ul class=meta>"] + [f"<li>{escape(line)}</li>" for line in provenance(report)]
    body += [f"<li><strong>warning:</strong> {escape(w)}</li>" for w in report.get("warnings", [])]
    body.append("</ul>")
    header, rows = stage_rows(report)
    body += ["<h2>Stages</h2>", table(header, rows, set(range(1, len(header) - 1)))]
    body += ["<h2>Size</h2>", "<ul class=meta>"] + [f"<li>{escape(line)}</li>" for line in size_lines(report)] + ["</ul>"]
    layers = report.get("layers") or {}
    errors = [(n, r["relative_error"]) for n, r in layers.items() if isinstance(r.get("relative_error"), (int, float))]
    sparsity = [(n, r["sparsity"]) for n, r in layers.items() if isinstance(r.get("sparsity"), (int, float))]
    header, rows, note = layer_rows(report)
    body.append("<h2>Layers</h2>")
    if errors:
        body.append(bars(errors, "relative weight error ‖W − Ŵ‖ / ‖W‖ (last stage)", title="per-layer relative error"))
    if sparsity:
        body.append(bars(sparsity, "share of zero weights", title="per-layer sparsity"))
    if rows:
        body += [f"<p class=note>{escape(note)}.</p>", table(header, rows, set(range(4, len(header))))]
    else:
        body.append("<p class=note>No per-layer record: these stages changed no layer's weights.</p>")
    ev, tasks = report.get("evaluation"), report.get("tasks")
    if ev or tasks:
        body.append("<h2>Evaluation</h2>")
        for spec, r in (ev or {}).items():
            body += [f"<h3>{escape(str(spec))}</h3>",
                     table(["metric", "value"], [[METRIC_LABELS.get(k, k), _num(val, ".6g")] for k, val in r.items()], {1})]
        if tasks:
            body += ["<h3>tasks</h3>", table(TASK_COLUMNS, task_rows(tasks), set(range(2, len(TASK_COLUMNS))))]
    elif report.get("evaluation_note"):
        body += ["<h2>Evaluation</h2>", f"<p class=note>Evaluation {escape(report['evaluation_note'])}</p>"]
    return page(f"compress report: {report.get('source_model', {}).get('ref', '')}", body)


# ---------------------------------------------------------------------------------------------
# Benchmarks: rows as compress.bench.flat_row writes them


def _short(spec: str) -> str:
    parts = str(spec).replace("\\", "/").split("/")
    return "/".join(parts[-2:])


def bench_plots(rows: list[dict], family: str) -> list[str]:
    """Quality against bytes on disk for the rows of one model: KL and perplexity per evaluation
    set for a causal LM, embedding error for an encoder; the Pareto front over each."""
    ok = [r for r in rows if r.get("family") == family and not r.get("error") and r.get("evaluation")]
    if not ok:
        return []
    out = []
    specs = list(ok[0]["evaluation"])
    for spec in specs:
        for key, label, log in (("kl_divergence", "KL(base ‖ compressed), nats per position", True),
                                ("token_perplexity", "perplexity", False),
                                ("embedding_error", "embedding error (1 − cosine)", True)):
            pts = [Point(float(r["bytes_on_disk"]), float(r["evaluation"][spec][key]), f"{r['method']} {r['label']}", r["method"])
                   for r in ok if spec in r["evaluation"] and r["evaluation"][spec].get(key) is not None
                   and r.get("bytes_on_disk")]
            if pts:
                out.append(scatter(pts, "bytes on disk", label, log_y=log,
                                   title=f"{family}: {label.split(',')[0]} on {_short(spec)} against bytes on disk ({len(pts)} rows)"))
    return out


def bench_html(rows: list[dict], meta: dict, title: str = "compress benchmark") -> str:
    """The benchmark page: how it was run, the plots per model, and the table of every row."""
    body = ["<ul class=meta>"]
    for k in ("command", "date", "machine", "versions", "total"):
        if meta.get(k):
            body.append(f"<li>{escape(k)}: {escape(str(meta[k]))}</li>")
    body.append("</ul><p class=note>Each point is one row; hover for its name and values. The dashed line joins the "
                "Pareto front: the rows no other row beats on both quality and bytes on disk.</p>")
    for family in dict.fromkeys(r.get("family") for r in rows):
        fam_rows = [r for r in rows if r.get("family") == family]
        body.append(f"<h2>{escape(str(family))}</h2>")
        body += bench_plots(rows, family)
        specs = list(next((r["evaluation"] for r in fam_rows if r.get("evaluation")), {}) or {})
        metrics = ["kl_divergence", "top1_agreement", "ppl_increase_pct"] if any(
            "kl_divergence" in (r.get("evaluation") or {}).get(s, {}) for r in fam_rows for s in specs) else ["embedding_error", "mean_cosine", "nn_agreement"]
        header = ["method", "row", "scheme"] + [f"{m.replace('_', ' ')} {_short(s)}" for s in specs for m in metrics] + [
            "compression s", "peak RSS MiB", "bytes on disk"]
        lines = []
        for r in fam_rows:
            if r.get("error"):
                lines.append([r.get("method", "?"), r.get("label", r.get("row")), "error: " + str(r["error"])] + [""] * (len(header) - 3))
                continue
            ev = r.get("evaluation") or {}
            lines.append([r["method"], r["label"], r.get("scheme", "")] + [_num(ev.get(s, {}).get(m)) for s in specs for m in metrics]
                         + [_num(r.get("compression_wall_s"), ".2f"), _num(r.get("stage_peak_rss_mib"), ".0f"), _num(r.get("bytes_on_disk"))])
        body.append(table(header, lines, set(range(3, len(header)))))
    return page(title, body)
