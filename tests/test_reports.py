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
