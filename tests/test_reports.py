"""report.html: self-contained (nothing fetched, no scripts), with the plots' marks counted against
the data they show; the Pareto front against brute force."""

import random
import re

import yaml

from compress.html_report import bench_html
from compress.pipeline import run_recipe
from compress.recipe import parse_recipe
from compress.svg import Point, pareto_front, scatter


def assert_self_contained(html: str) -> None:
    assert "<script" not in html.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I), "fetches something"
    assert "@import" not in html and "url(" not in html


def test_pareto_front_matches_brute_force():
    rng = random.Random(0)
    for _ in range(20):
        pts = [Point(rng.uniform(1, 10), rng.uniform(1, 10), str(i)) for i in range(rng.randint(1, 15))]
        brute = {i for i, p in enumerate(pts)
                 if not any((q.x <= p.x and q.y <= p.y) and (q.x < p.x or q.y < p.y) for q in pts)}
        assert set(pareto_front(pts)) == brute


def test_scatter_draws_every_point_and_marks_the_front():
    pts = [Point(1, 5, "a", "m1"), Point(2, 3, "b", "m1"), Point(3, 4, "c", "m2"), Point(4, 1, "d", "m2")]
    svg = scatter(pts, "bytes", "KL", log_y=True)
    assert svg.count('<circle class="point') == 4
    assert svg.count("front-point") == 3  # c is beaten by b on both axes
    assert "<polyline" in svg


def test_run_writes_html_report_with_a_bar_per_layer(ref_llama, tmp_path):
    doc = {"model": str(ref_llama), "stages": [{"rtn": {"scheme": "W4A16", "weights": {"group_size": 64}}}],
           "output": str(tmp_path / "out")}
    report = run_recipe(parse_recipe(yaml.safe_dump(doc)), device="cpu")
    html = (tmp_path / "out" / "report.html").read_text()
    assert_self_contained(html)
    assert html.count('<rect class="bar"') == len(report["layers"]) == 28
    for name, rec in report["layers"].items():  # each bar's tooltip carries its layer's measured error
        assert f"{name}: relative weight error" in html and f"{rec['relative_error']:.4g}" in html
    assert (tmp_path / "out" / "report.md").is_file() and (tmp_path / "out" / "report.json").is_file()


def test_bench_page_plots_every_row():
    rows = [{"family": "m", "method": meth, "label": f"r{i}", "scheme": "s", "bytes_on_disk": 1000 * (i + 1),
             "evaluation": {"a/test.txt": {"kl_divergence": 0.1 / (i + 1), "token_perplexity": 10 + i,
                                           "top1_agreement": 0.9, "ppl_increase_pct": 1.0}}}
            for i, meth in enumerate(["RTN", "RTN", "GPTQ", "AWQ", "SparseGPT"])]
    rows.append({"family": "m", "method": "RTN", "label": "broken", "row": "broken", "error": "boom"})
    html = bench_html(rows, {"command": "x"})
    assert_self_contained(html)
    svgs = re.findall(r"<svg.*?</svg>", html, re.S)
    assert len(svgs) == 2  # KL and perplexity against bytes on disk
    assert all(s.count('<circle class="point') == 5 for s in svgs)
    assert "error: boom" in html


def test_the_output_says_what_its_source_was_and_keeps_its_config(ref_llama, tmp_path, capsys):
    """--dtype bfloat16 on a float32 model: the report and inspect say both; the saved config keeps
    the source's use_cache (loading turns it off for calibration); inspect's bytes on disk are the
    report's (the files, headers included)."""
    import json

    from compress.cli import main

    out = tmp_path / "out"
    report = run_recipe(parse_recipe("stages:\n  - rtn: {scheme: W4A16, weights: {group_size: 64}}\n", "t"),
                        model=str(ref_llama), output=str(out), device="cpu", dtype="bfloat16")
    source_config = json.loads((ref_llama / "config.json").read_text())
    assert json.loads((out / "config.json").read_text())["use_cache"] == source_config["use_cache"] is True
    assert "bfloat16, converted from float32" in (out / "report.md").read_text()
    assert main(["--json", "inspect", str(out)]) == 0
    inspected = json.loads(capsys.readouterr().out)
    assert inspected["summary"]["sizes"]["bytes_on_disk"] == report["output"]["bytes_on_disk"]
    assert inspected["summary"]["source_model"]["dtype_on_disk"] == "float32"


def _html_tables(html: str) -> list[list[list[str]]]:
    """Every <table> of a page as rows of cell texts."""
    from html.parser import HTMLParser

    class Tables(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tables, self.cell = [], None

        def handle_starttag(self, tag, attrs):
            if tag == "table":
                self.tables.append([])
            elif tag == "tr":
                self.tables[-1].append([])
            elif tag in ("td", "th"):
                self.cell = ""

        def handle_endtag(self, tag):
            if tag in ("td", "th"):
                self.tables[-1][-1].append(self.cell)
                self.cell = None

        def handle_data(self, data):
            if self.cell is not None:
                self.cell += data

    parser = Tables()
    parser.feed(html)
    return parser.tables


def test_markdown_and_html_show_the_same_layers_warnings_and_a_pruned_layers_own_error(ref_llama, tmp_path):
    """Magnitude 50 % then RTN W8 then RTN W4: the relative error a quantization records is
    against the pruned weights, so the tables show the pruning's own error beside it (0.006 was
    read as the error of a layer half of whose weights were gone); report.html has the warning
    report.md has, and the same layer rows; a word perplexity past float range is a dash in both,
    as it is null in report.json (report.md printed inf)."""
    text = tmp_path / "zh.txt"
    text.write_text("我们今天在这里讨论模型压缩的问题，这是一个非常重要的研究方向。" * 40)
    recipe = (f"stages:\n  - magnitude: {{sparsity: 0.5}}\n  - rtn: {{scheme: W8A16}}\n  - rtn: {{scheme: W4A16}}\n"
              f"evaluation: {{datasets: [{text}], seq_len: 64, max_windows: 2}}\n")
    out = tmp_path / "out"
    report = run_recipe(parse_recipe(recipe, "t"), model=str(ref_llama), output=str(out), device="cpu")
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert report["evaluation"][str(text)]["word_perplexity"] is None or report["evaluation"][str(text)]["word_perplexity"] > 1e300
    assert "| inf |" not in md and "| nan |" not in md and "word perplexity (lm-eval: exp(NLL / words)) | - |" in md
    [warning] = report["warnings"]
    assert f"- warning: {warning}" in md and f"<strong>warning:</strong> {warning}" in html.replace("&#x27;", "'")

    down = report["layers"]["model.layers.0.mlp.down_proj"]
    md_rows = [[c.strip() for c in line.strip("|").split("|")] for line in md.split("## Layers")[1].split("## Size")[0].splitlines()
               if line.startswith("| ") and not line.startswith("| ---")]
    header, rows = md_rows[0], md_rows[1:]
    assert header == ["layer", "shape", "weights", "activations", "relative error", "pruning error", "sparsity"]
    row = next(r for r in rows if r[0] == "model.layers.0.mlp.down_proj")
    from compress.report import _fmt

    assert row[4] == _fmt(down["relative_error"]) and row[5] == _fmt(down["pruning_relative_error"])
    assert down["pruning_relative_error"] > 0.2 and row[6] == "0.5000"
    source = report["source_model"]["bytes"]
    assert f"{report['output']['bytes_on_disk'] / source:.1%} of the source's {source:,}" in md
    [html_layers] = [t for t in _html_tables(html) if t and t[0][:2] == ["layer", "shape"]]
    assert html_layers == md_rows  # the same cells, one source


def test_a_kv_cache_alone_is_described_as_such_in_the_size_line():
    """No weight quantized, the file in the compressed-tensors format for its KV scales: the size
    line read "0 quantized layers packed (dense, scales in ), the rest in bfloat16"."""
    from compress.report import _storage

    report = {"format": {"format": "packed", "packed_layers": 0, "compressed_tensors_format": "dense"},
              "source_model": {"dtype": "bfloat16"}, "output": {"quantized_parameters": 0}}
    assert _storage(report) == "no weight quantized: the compressed-tensors format for the KV cache scales, weights in bfloat16"


def test_a_task_drop_equal_to_its_threshold_passes():
    """0.40 - 0.38 is 0.020000000000000018 in floats: an exact drop of 2 documents in 100 failed
    --max-task-drop 0.02 (and, between k/100 scores, a quarter of all exact drops failed so)."""
    from compress.evaluate import task_gate
    from compress.tasks import worsening

    failed = []
    for base in range(101):
        for model in range(base + 1):
            accuracy = {"score": model / 100, "higher_is_better": True}
            drop = worsening(accuracy, {"score": base / 100})
            [gate] = task_gate({"t": {"metric": "acc", "score_drop": drop}}, max_task_drop=(base - model) / 100)
            failed += [] if gate["passed"] else [(base, model)]
    assert failed == []
    # perplexity, better when lower: a rise is the drop, at the scores' own precision
    assert worsening({"score": 123456.7, "higher_is_better": False}, {"score": 123456.6}) == 0.1


def test_a_value_just_past_its_threshold_is_printed_with_every_digit(tmp_path):
    """At six digits a failing KL read "0.00133705 <= 0.00133705 ... fail"; report.md gave KL
    between 1e-3 and 1e-2 to one or two digits (0.0013), too few to compare methods by ratio."""
    from xml.etree import ElementTree

    from compress.evaluate import check
    from compress.report import _fmt, evaluation_markdown, junit_xml

    failing = check("ts.txt", "kl_divergence", 0.001337053021, "<=", 0.001337053)
    assert not failing["passed"]
    md = evaluation_markdown({}, checks=[failing])
    assert "| 0.001337053021 | <= 0.001337053 | **fail** |" in md
    message = ElementTree.fromstring(junit_xml([failing])).find("testcase/failure").get("message")
    assert message == "kl_divergence = 0.001337053021, needs <= 0.001337053"
    passing = check("ts.txt", "kl_divergence", 0.0012, "<=", 0.001337053)
    assert "| 0.0012 | <= 0.00133705 | pass |" in evaluation_markdown({}, checks=[passing])
    assert _fmt(0.0013370530) == "0.001337" and _fmt(3.83e-4) == "3.830e-04" and _fmt(76.6) == "76.6000"
    assert _fmt(0.26) == "0.2600"  # accuracies keep their four decimals
