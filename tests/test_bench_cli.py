"""compress bench: several recipes on one model, each in its own process, scored against one
saved baseline; report.md / .json / .html with a row and a plotted point per recipe."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from compress.cli import main
from compress.evaluate import BaselineStore, causal_metrics, eval_windows
from compress import modeling

HELDOUT = "calibration/heldout-tinyshakespeare.txt"


def test_saved_baseline_gives_the_same_kl_as_running_it(ref_llama, repo, tmp_path):
    """The benchmark's shortcut must not change a figure: KL and top-1 from the saved
    log-probabilities equal those from running the baseline, and the 64-window prefix equals a
    separate evaluation of the first windows."""
    base, tok, _ = modeling.load_model(str(ref_llama), dtype="float32")
    other, _, _ = modeling.load_model(str(ref_llama), dtype="float32")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    windows = eval_windows(tok, str(repo / HELDOUT), 256, 6)
    store = BaselineStore(tmp_path)
    written = store.write(base, windows, 2, tokenizer=tok)
    assert written == causal_metrics(base, windows, tok, None, 2)  # the baseline's own perplexity, same passes
    direct = causal_metrics(other, windows, None, base, 2)
    saved = causal_metrics(other, windows, None, None, 2, baseline_logprobs=store.batches(windows, 2, 2048), prefix_windows=4)
    assert saved["kl_divergence"] == direct["kl_divergence"] > 0
    assert saved["top1_agreement"] == direct["top1_agreement"]
    first4 = causal_metrics(other, windows[:4], None, base, 2)
    assert saved["prefix"]["kl_divergence"] == pytest.approx(first4["kl_divergence"], rel=1e-12)


def test_bench_compares_recipes(ref_llama, repo, tmp_path, capsys, monkeypatch):
    # two recipes of one file name (from two directories): each row keeps its own checkpoint and log
    w8, w4 = tmp_path / "w8.yaml", tmp_path / "other" / "w8.yaml"
    w4.parent.mkdir()
    w8.write_text("stages:\n  - rtn: {scheme: W8A16}\n")
    w4.write_text("stages:\n  - rtn: {scheme: W4A16, weights: {group_size: 64}}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - rtn: {scheme: W4A16, targets: [nothing_matches]}\n")
    out = tmp_path / "bench"
    rc = main(["--json", "bench", "--model", str(ref_llama), "--recipes", str(w8), str(w4), str(bad),
               "--data", str(repo / HELDOUT), "--max-windows", "4", "--output", str(out)])
    out_text, err = capsys.readouterr()
    result = json.loads(out_text)
    # one recipe failed: the others are still measured, and the run says so (stderr, JSON, exit 2)
    assert rc == 2 and "1 of 3 recipes failed (bad:" in err and result["exit_code"] == 2 and "bad:" in result["error"]
    rows = {r["row"]: r for r in result["rows"]}
    assert "match no linear layer" in rows["bad"]["error"]
    kl8 = next(iter(rows["w8"]["evaluation"].values()))["kl_divergence"]
    kl4 = next(iter(rows["w8-2"]["evaluation"].values()))["kl_divergence"]
    assert 0 < kl8 < kl4  # measured: 8 bits disturb the model less than 4
    assert rows["w8-2"]["output"]["bytes_on_disk"] < rows["w8"]["output"]["bytes_on_disk"]
    bits = {name: json.loads((out / "rows" / name / "config.json").read_text())["quantization_config"]["config_groups"]
            ["group_0"]["weights"]["num_bits"] for name in ("w8", "w8-2")}
    assert bits == {"w8": 8, "w8-2": 4} and (out / "rows" / "w8.log").is_file() and (out / "rows" / "w8-2.log").is_file()
    assert rows["w8"]["process_peak_rss_mib"] > 0 and rows["w8"]["stage_wall_s"] > 0
    md = (out / "report.md").read_text()
    assert "| w8 |" in md and "| w8-2 |" in md and "**error**" in md and "## Run history" in md
    saved = json.loads((out / "report.json").read_text())
    assert len(saved["history"]) == 1 and len(saved["rows"]) == 3
    html = (out / "report.html").read_text()
    assert "<script" not in html and not re.search(r"(src|href)=\"https?:", html)
    plots = re.findall(r"<svg.*?</svg>", html, re.S)
    assert plots and all(p.count('<circle class="point') == 2 for p in plots)  # the two rows that ran
    # run again into the same output with one recipe: the earlier rows' checkpoints and logs go
    assert main(["-q", "bench", "--model", str(ref_llama), "--recipes", str(w8), "--data", str(repo / HELDOUT),
                 "--max-windows", "4", "--output", str(out)]) == 0
    assert sorted(p.name for p in (out / "rows").iterdir()) == ["w8", "w8.json", "w8.log"]
    # a rerun that fails on its input, or is interrupted, leaves that bench whole: its rows were
    # deleted before the baseline and data were read, beside a report that still named them
    report = (out / "report.md").read_text()
    short = tmp_path / "short.txt"
    short.write_text("too short to give a window\n")
    assert main(["-q", "bench", "--model", str(ref_llama), "--recipes", str(w4), "--data", str(short),
                 "--output", str(out)]) == 2
    import compress.bench_recipes

    def interrupted(*args):
        (out / "rows" / "w8").mkdir(parents=True)  # a row half written
        raise KeyboardInterrupt

    monkeypatch.setattr(compress.bench_recipes, "_run_rows", interrupted)
    assert main(["-q", "bench", "--model", str(ref_llama), "--recipes", str(w4), "--data", str(repo / HELDOUT),
                 "--max-windows", "4", "--output", str(out)]) == 130
    assert sorted(p.name for p in (out / "rows").iterdir()) == ["w8", "w8.json", "w8.log"]
    assert (out / "rows" / "w8" / "config.json").is_file() and (out / "report.md").read_text() == report
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".baseline"]


def test_bench_refuses_a_checkpoint_as_its_output(ref_llama, tmp_path, capsys):
    """A compress checkpoint has a report.json too: bench must not overwrite its reports."""
    checkpoint = tmp_path / "w4"
    checkpoint.mkdir()
    for name in ("compress.json", "report.json"):
        (checkpoint / name).write_text("{}")
    recipe = tmp_path / "w8.yaml"
    recipe.write_text("stages:\n  - rtn: {scheme: W8A16}\n")
    rc = main(["bench", "--model", str(ref_llama), "--recipes", str(recipe), "--output", str(checkpoint)])
    err = capsys.readouterr().err
    assert rc == 2 and "a compressed checkpoint" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in checkpoint.iterdir()) == ["compress.json", "report.json"]
    assert (checkpoint / "report.json").read_text() == "{}"


def test_bench_without_recipes_is_a_one_line_error(ref_llama, tmp_path, capsys):
    rc = main(["bench", "--model", str(ref_llama), "--output", str(tmp_path / "b")])
    assert rc == 2 and "no recipe given" in capsys.readouterr().err


def test_eval_windows_from_a_prefix_equal_the_whole_files(ref_llama, shared):
    """Evaluation tokenizes only the prefix its windows need; on the protocol's test files the
    windows are exactly those of the whole file's tokenization."""
    from transformers import AutoTokenizer

    from compress.calibration import read_texts, token_windows

    tok = AutoTokenizer.from_pretrained(str(ref_llama))
    for name in ("wikitext-2/test.txt", "tinyshakespeare/test.txt"):
        spec = str(shared / "data" / name)
        whole = token_windows(tok, "\n".join(read_texts(spec)), 256)[:256]
        assert torch.equal(eval_windows(tok, spec, 256, 256), whole)
        assert torch.equal(eval_windows(tok, spec, 256, 16), whole[:16])


def test_a_recipe_without_calibration_gets_the_benchmarks(tmp_path):
    """compress bench fills in its calibration set only where a recipe's stages need one."""
    from compress.bench_recipes import _with_calibration

    section = {"dataset": "calibration/default.txt", "num_samples": 4, "seq_len": 32}
    gptq, rtn = tmp_path / "gptq.yaml", tmp_path / "rtn.yaml"
    gptq.write_text("stages:\n  - gptq: {scheme: W4A16}\nevaluation: {datasets: [x.txt]}\n")
    rtn.write_text("stages:\n  - rtn: {scheme: W4A16}\n")
    assert _with_calibration(gptq, section)[1] == {"stages": [{"gptq": {"scheme": "W4A16"}}], "calibration": section}
    assert "calibration" not in _with_calibration(rtn, section)[1]
    from compress.errors import CompressError

    with pytest.raises(CompressError, match="needs calibration data"):
        _with_calibration(gptq, None)


class _Logits(torch.nn.Module):
    """A stand-in causal LM: fixed logits per position, whatever the ids."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids):
        return type("Out", (), {"logits": self.logits[: input_ids.shape[0], : input_ids.shape[1]]})()


def test_kl_is_finite_where_both_models_rule_a_token_out_and_broken_models_give_inf():
    """0 · log 0 was NaN: a vocabulary masked to -inf in both models failed any --max-kl gate even
    when identical; a model whose perplexity overflows gave inf, but its prefix figure raised."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    logits[..., 3] = -float("inf")
    windows = torch.randint(0, 7, (2, 5))
    windows[windows == 3] = 2
    same = causal_metrics(_Logits(logits), windows, None, _Logits(logits.clone()), 2, prefix_windows=2)
    assert same["kl_divergence"] == 0 and same["top1_agreement"] == 1
    noisy = causal_metrics(_Logits(logits + 0.1 * torch.randn(2, 5, 7)), windows, None, _Logits(logits), 2)
    assert 0 < noisy["kl_divergence"] < math.inf
    broken = logits.clone()
    broken[..., :3] = -1e6  # the text's tokens all but impossible
    worst = causal_metrics(_Logits(broken), windows.clamp(max=2), None, None, 2, prefix_windows=2)
    assert worst["token_perplexity"] == math.inf and worst["prefix"]["token_perplexity"] == math.inf


def test_word_perplexity_counts_only_the_words_it_scored(ref_llama, repo):
    """Each window's first token is context, never predicted; its words counted too made 2-token
    windows' word perplexity fall below their token perplexity (impossible: a word has at least
    one token)."""
    base, tok, _ = modeling.load_model(str(ref_llama), dtype="float32")
    windows = eval_windows(tok, str(repo / HELDOUT), 4, 64)
    out = causal_metrics(base, windows, tok, None, 16)
    assert out["words"] == sum(len(tok.decode(w[1:].tolist()).split()) for w in windows) <= out["tokens_predicted"]
    assert out["word_perplexity"] >= out["token_perplexity"]


def test_a_benchmark_row_names_the_scheme_of_each_of_its_stages():
    """The mixed-precision row runs one rtn stage per width; its table cell named only the last
    (W2), as if the whole model were 2-bit."""
    from compress.bench import MIXED_LABEL, Row, _row_scheme

    def stage(name, scheme):
        return {"name": name, "summary": {"scheme": scheme}}

    mixed = Row("ref-llama", MIXED_LABEL, {}, method="mixed")
    report = {"stages": [stage("rtn", "W4"), stage("rtn", "W3"), stage("rtn", "W3"), stage("rtn", "W2")]}
    assert _row_scheme(report, mixed) == "W4 + W3 + W2"
    smoothed = Row("ref-llama", "W8A8", {}, stage_name="rtn", before=({"smoothquant": {}},))
    assert _row_scheme({"stages": [stage("smoothquant", "alpha 0.5"), stage("rtn", "W8A8")]}, smoothed) == "W8A8"


def test_the_block_benchmark_runs_every_row_and_cleans_up(shared, tmp_path, monkeypatch, capsys):
    """compress.bench_block (README's per-block GPU figures) at toy shapes on the CPU: every row
    runs, GPTQ beats round-to-nearest on its own Hessians, the 2:4 row is pruned, and the work
    directory (GBs at 7B shapes) is gone afterwards."""
    import sys

    from compress import bench_block

    made = []
    mkdtemp = bench_block.tempfile.mkdtemp
    monkeypatch.setattr(bench_block.tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(dir=tmp_path, **kw)) or made[-1])
    monkeypatch.setattr(sys, "argv", ["bench_block", "--shared", str(shared), "--device", "cpu", "--small"])
    bench_block.main()
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["row"] for r in rows] == [label for label, _ in bench_block.ROWS]
    assert all(0 < r["loss_gptq_over_rtn"] < 1 for r in rows if r["row"].startswith("gptq"))
    assert all(r["format"] == "packed" for r in rows if not r["row"].startswith("sparsegpt"))
    assert len(made) == 1 and not Path(made[0]).exists()
