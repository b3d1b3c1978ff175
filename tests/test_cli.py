"""The command line end to end on the real reference models: quantize, eval as a CI gate,
inspect, plan, recipes, --json."""

import json
import re
import shutil
import xml.etree.ElementTree as ET

import pytest
import torch
import yaml

from compress import evaluate_model, parse_recipe, run_recipe
from compress.cli import main
from compress.errors import CompressError

HELDOUT = "calibration/heldout-tinyshakespeare.txt"


def run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def w8_output(tmp_path_factory, ref_llama, repo):
    """ref-llama (float32, from shared/) quantized with the bundled W8A16 recipe."""
    out = tmp_path_factory.mktemp("w8") / "out"
    rc = main(["--quiet", "quantize", "--recipe", str(repo / "recipes/w8a16-absmax.yaml"),
               "--model", str(ref_llama), "--output", str(out)])
    assert rc == 0
    return out


def test_quantize_writes_complete_checkpoint(w8_output, ref_llama):
    names = {p.name for p in w8_output.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "recipe.yaml", "report.json", "report.md", "compress.json"} <= names
    assert not list(w8_output.parent.glob(".*tmp*"))
    report = json.loads((w8_output / "report.json").read_text())
    # provenance
    assert report["source_model"]["ref"] == str(ref_llama)
    assert len(report["source_model"]["weights_sha256"]) == 64
    assert len(report["calibration"]["fingerprint"]) == 64 and report["calibration"]["num_samples"] == 128
    assert {"compress", "torch", "transformers"} <= set(report["versions"])
    # per-stage time and memory, per-layer error
    stage = report["stages"][0]
    assert stage["name"] == "rtn" and stage["wall_s"] > 0 and stage["peak_rss_mib"] > 0
    assert len(report["layers"]) == 28 and all(0 < r["relative_error"] < 0.02 for r in report["layers"].values())
    # W8 per-channel barely moves ref-llama (the bar: < 1 % perplexity, KL < 1e-4)
    ev = report["evaluation"][HELDOUT]
    assert abs(ev["ppl_increase_pct"]) < 1.0 and ev["kl_divergence"] < 1e-4 and ev["top1_agreement"] > 0.99
    # effective recipe: defaults filled in
    eff = yaml.safe_load((w8_output / "recipe.yaml").read_text())
    rtn = eff["stages"][0]["rtn"]
    assert rtn["ignore"] == ["lm_head"] and rtn["resolved"]["weights"]["num_bits"] == 8
    assert eff["calibration"]["seq_len"] == 256
    # packed bits: 8-bit codes + per-channel scales on 2.75 M of 3.8 M params, the rest float32
    assert 14 < report["output"]["bits_per_parameter_packed"] < 16
    # report.md says how the file holds them: packed, as report.json's format says (it once said
    # "stored dequantized" whatever was written)
    assert report["format"]["format"] == "packed"
    size = (w8_output / "report.md").read_text().split("## Size")[1]
    assert "28 quantized layers packed (pack-quantized, scales in float32), the rest in float32" in size, size
    assert "dequantized" not in size
    assert "zeros" not in size  # nothing was pruned: a grid's rounded zeros are not sparsity


def test_output_files_have_the_usual_modes(w8_output):
    # safetensors creates its file 0600; the rest of the checkpoint is readable as written
    modes = {f.name: f.stat().st_mode & 0o777 for f in w8_output.iterdir() if f.is_file()}
    assert modes["model.safetensors"] == modes["config.json"] == modes["compress.json"], modes


def test_existing_output_refused_without_force(w8_output, ref_llama, repo, capsys):
    before = (w8_output / "model.safetensors").stat().st_mtime_ns
    rc, _, err = run(capsys, "quantize", "--recipe", repo / "recipes/w8a16-absmax.yaml", "--model", ref_llama, "--output", w8_output)
    assert rc == 2 and "already exists" in err and "--force" in err
    assert (w8_output / "model.safetensors").stat().st_mtime_ns == before


def test_eval_gate_pass_and_fail(w8_output, ref_llama, tmp_path, capsys):
    md, junit = tmp_path / "eval.md", tmp_path / "eval.xml"
    rc, _, _ = run(capsys, "--quiet", "eval", "--model", w8_output, "--baseline", ref_llama, "--data", HELDOUT,
                   "--max-ppl-increase", 2, "--max-kl", 1e-3, "--report", md, "--junit", junit, "--max-windows", 16)
    assert rc == 0
    assert "PASS" in md.read_text() and "token perplexity" in md.read_text() and "word perplexity" in md.read_text()
    assert "| <= 0.001 | pass |" in md.read_text()  # the threshold says which side passes
    suite = ET.parse(junit).getroot()
    assert suite.get("tests") == "2" and suite.get("failures") == "0"
    # each case names its dataset and metric, and carries the measured value even when it passed
    assert [tc.get("name") for tc in suite] == [f"{HELDOUT}: ppl_increase_pct", f"{HELDOUT}: kl_divergence"]
    assert suite[1].find("system-out").text.endswith(", needs <= 0.001") and "." not in suite[1].get("classname")

    # the verdict is printed on stdout with the tables it sums up (`eval ... > log` keeps both);
    # stderr is for progress, warnings and errors
    rc, out, err = run(capsys, "eval", "--model", w8_output, "--baseline", ref_llama, "--data", HELDOUT,
                       "--min-top1", 0.9, "--max-windows", 16)
    assert rc == 0 and "PASS" in out and ">= 0.9" in out and "thresholds" in out
    assert "PASS" not in err and "parameters" not in err

    rc, out, _ = run(capsys, "--json", "eval", "--model", w8_output, "--baseline", ref_llama, "--data", HELDOUT,
                     "--max-kl", 1e-9, "--junit", junit, "--max-windows", 16)
    assert rc == 1
    result = json.loads(out)
    assert result["passed"] is False and result["checks"][0]["metric"] == "kl_divergence"
    assert result["checks"][0]["comparison"] == "<=" and result["checks"][0]["threshold"] == 1e-9
    failure = ET.parse(junit).getroot().find("testcase/failure")
    assert ET.parse(junit).getroot().get("failures") == "1" and failure.get("message").endswith("needs <= 1e-09")

    # quiet: no tables, but one line saying which threshold failed
    rc, out, err = run(capsys, "--quiet", "eval", "--model", w8_output, "--baseline", ref_llama, "--data", HELDOUT,
                       "--max-kl", 1e-9, "--max-windows", 16)
    assert rc == 1 and not out and err.count("\n") == 1 and err.startswith("FAIL: ") and "kl_divergence" in err
    assert "(needs <= 1e-09)" in err


def test_eval_refuses_a_threshold_the_model_has_no_metric_for_before_loading(ref_llama, minilm, capsys, monkeypatch):
    from compress import modeling

    monkeypatch.setattr(modeling, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    for model, flag, words in ((ref_llama, "--min-cosine", "it is a causal language model (use --max-kl"),
                               (minilm, "--max-kl", "it is an encoder (use --min-cosine)")):
        rc, _, err = run(capsys, "eval", "--model", model, "--baseline", model, "--data", HELDOUT, flag, 0.5)
        assert rc == 2 and f"{flag} cannot be checked on {model}: {words}" in err


def test_eval_of_a_model_with_nan_outputs_fails_every_gate(ref_llama, tmp_path, capsys):
    """A NaN weight: perplexity and KL are NaN (not an infinite perplexity beside a NaN KL), and
    thresholds fail; one that could never fail (top-1 at least 0) is refused."""
    import math
    import shutil

    from safetensors.torch import load_file, save_file

    from compress import evaluate_model

    broken = tmp_path / "nan"
    shutil.copytree(ref_llama, broken)
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.3.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    result = evaluate_model(str(broken), [HELDOUT], baseline=str(ref_llama), max_windows=4,
                            thresholds={"max_ppl_increase": 50.0, "max_kl": 10.0, "min_top1": 0.01})
    r = result["results"][HELDOUT]
    assert math.isnan(r["token_perplexity"]) and math.isnan(r["kl_divergence"])
    assert not result["passed"] and [c["passed"] for c in result["checks"]] == [False, False, False]
    rc, _, err = run(capsys, "eval", "--model", broken, "--baseline", ref_llama, "--data", HELDOUT, "--min-top1", 0)
    assert rc == 2 and "can never fail" in err
    # the Python API names a misspelled threshold up front (it was a TypeError after both
    # models had been evaluated); a missing model shows that it ran before any loading
    with pytest.raises(CompressError, match=r"unknown threshold 'max_kll'.*max_kl"):
        evaluate_model(str(tmp_path / "no-such-model"), [HELDOUT], baseline=str(ref_llama), thresholds={"max_kll": 1e-3})


def test_python_api_takes_paths_and_dicts_and_refuses_bad_input_before_loading(ref_llama, tmp_path, monkeypatch):
    """What a library caller passes: Paths for models and outputs (a Path model failed in
    yaml.safe_dump after every stage had run), a dict recipe, one dataset as a string (it was
    read character by character, each a hub dataset); and what the CLI refuses up front, the API
    refuses too, before any model loads."""
    from pathlib import Path

    out = tmp_path / "w8"
    report = run_recipe(parse_recipe({"stages": [{"rtn": {"scheme": "W8A16"}}]}), model=Path(ref_llama), output=out, device="cpu")
    assert report["source_model"]["ref"] == str(ref_llama) and (out / "model.safetensors").is_file()
    result = evaluate_model(out, HELDOUT, baseline=Path(ref_llama), max_windows=2, thresholds={"max_kl": 1e-3})
    assert list(result["results"]) == [HELDOUT] and result["passed"]

    from compress import modeling

    monkeypatch.setattr(modeling, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    for kwargs, words in (
        ({"thresholds": {"min_task_score": 0.5}}, "--min-task-score applies to lm-eval tasks, and none were given"),
        ({"thresholds": {"max_kl": -1.0}, "baseline": str(ref_llama)}, "--max-kl: -1 is outside [0, inf]"),
        ({"thresholds": {"max_kl": "0.1"}, "baseline": str(ref_llama)}, "--max-kl: must be a number, not '0.1'"),
        ({"thresholds": {"min_top1": 0.0}, "baseline": str(ref_llama)}, "can never fail"),
        ({"thresholds": {"max_kl": 1e-3}}, "--max-kl compares against the uncompressed model"),
        ({"max_windows": 0}, "max_windows=0: must be a whole number of at least 1"),
        ({"seq_len": 1}, "seq_len=1: must be a whole number of at least 2"),
    ):
        with pytest.raises(CompressError, match=re.escape(words)):
            evaluate_model(str(out), [HELDOUT], **kwargs)
    with pytest.raises(CompressError, match="a recipe is YAML text or a dict, not a NoneType"):
        parse_recipe(None)
    with pytest.raises(CompressError, match="got a Linear") as err:
        run_recipe(parse_recipe("stages: [{rtn: {scheme: W8A16}}]"), model=torch.nn.Linear(2, 2), output=tmp_path / "x")
    assert "save_pretrained" in err.value.hint and not (tmp_path / "x").exists()


def test_eval_identical_model_has_zero_kl(ref_llama, capsys):
    rc, out, _ = run(capsys, "--json", "eval", "--model", ref_llama, "--baseline", ref_llama, "--data", HELDOUT, "--max-windows", 8)
    r = json.loads(out)["results"][HELDOUT]
    assert rc == 0 and abs(r["kl_divergence"]) < 1e-7 and r["top1_agreement"] == 1.0 and r["ppl_increase_pct"] == 0


def test_text_without_spaces_gives_a_null_word_perplexity_not_a_crash(ref_llama, capsys, tmp_path):
    """Chinese text has almost no whitespace-separated words, so exp(NLL / words) is past float
    range: the figure is null in strict JSON (no NaN or Infinity), the token figures stand."""
    text = tmp_path / "zh.txt"
    text.write_text("我们今天在这里讨论模型压缩的问题，这是一个非常重要的研究方向。" * 80)
    rc, out, _ = run(capsys, "--json", "eval", "--model", ref_llama, "--baseline", ref_llama, "--data", text, "--max-windows", 2)
    r = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in JSON output"))["results"][str(text)]
    assert rc == 0 and r["word_perplexity"] is None and r["words"] <= 2 and r["token_perplexity"] > 1 and r["kl_divergence"] < 1e-7


def test_debug_shows_the_traceback_and_keeps_the_exit_code(capsys):
    """--debug must not turn bad input (2) into Python's 1, which the eval gate means as "failed"."""
    rc, _, err = run(capsys, "--debug", "eval", "--model", "default", "--data", "nothing-here.txt")
    assert rc == 2 and "Traceback" in err and "nothing-here.txt" in err.strip().splitlines()[-1]


def test_inspect(w8_output, capsys):
    rc, out, _ = run(capsys, "--json", "inspect", w8_output)
    data = json.loads(out)
    assert rc == 0 and data["compress"]["stages"] == ["rtn"] and len(data["compress"]["layers"]) == 28
    rc, text, _ = run(capsys, "inspect", w8_output)
    assert rc == 0 and "rtn" in text and "model.layers.0.self_attn.q_proj" in text


def test_plan_loads_no_weights(repo, capsys, tmp_path, ref_llama):
    # a model directory with only its config: plan needs nothing else
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg/config.json").write_text((ref_llama / "config.json").read_text())
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", repo / "recipes/w4a16-zeropoint-g64.yaml", "--model", tmp_path / "cfg")
    p = json.loads(out)
    assert rc == 0 and len(p["assignments"]) == 28 and p["unassigned"] == ["lm_head"]
    assert p["assignments"]["model.layers.0.mlp.down_proj"]["shape"] == [256, 640]
    # 4-bit codes + 16-bit scale and 4-bit zero-point per 64 weights, on 2.75 M of 3.8 M float32 params
    assert 11 < p["estimates"]["bits_per_parameter_packed"] < 12.5
    # --dtype as the run would load it: the other parameters at 16 bits then
    rc, out, _ = run(capsys, "--json", "--dtype", "float16", "plan", "--recipe", repo / "recipes/w4a16-zeropoint-g64.yaml",
                     "--model", tmp_path / "cfg")
    half = json.loads(out)
    assert rc == 0 and half["dtype"] == "float16" and half["estimates"]["bits_per_parameter_packed"] < p["estimates"]["bits_per_parameter_packed"]
    for option, value in (("--dtype", "float64"), ("--device", "gpu")):
        rc, _, err = run(capsys, option, value, "plan", "--recipe", repo / "recipes/w4a16-zeropoint-g64.yaml", "--model", tmp_path / "cfg")
        assert rc == 2 and value in err


def test_plan_shows_every_stage_of_a_layer(repo, capsys, ref_llama):
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", repo / "recipes/sparse24-sparsegpt-w4a16.yaml", "--model", ref_llama)
    a = json.loads(out)["assignments"]["model.layers.0.mlp.down_proj"]
    assert rc == 0 and a["stage"] == "sparsegpt → gptq"
    assert a["scheme"].startswith("sparsegpt 2:4 → W[int4 g128 sym]")
    assert "int4" in a["weights"]


def test_plan_shows_each_layers_own_sparsity_and_smoothing_as_the_run_does_it(tmp_path, capsys, ref_llama):
    """Per-pattern overrides: the table showed the stage's default sparsity on every layer, and no
    SmoothQuant at all (a stage without targets); each layer now shows its own, as the run applies."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "calibration: {dataset: calibration/default.txt, num_samples: 4, seq_len: 64}\nstages:\n"
        "  - sparsegpt: {sparsity: 0.5, sparsity_overrides: {mlp.down_proj: 0.25, 're:.*self_attn.*': '2:4'}}\n"
        "  - smoothquant: {alpha: 0.5, alpha_overrides: {'re:.*layers\\.1\\..*': 0.9}}\n"
        "  - rtn: {scheme: W8A8, targets: ['re:.*mlp.*']}\n")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
    planned = json.loads(out)["assignments"]
    assert rc == 0
    assert planned["model.layers.0.mlp.down_proj"]["scheme"].startswith("sparsegpt sparsity 0.25 → smoothquant alpha 0.5 → W[int8")
    assert planned["model.layers.1.self_attn.q_proj"]["scheme"] == "sparsegpt 2:4 → smoothquant alpha 0.9"
    assert planned["model.layers.1.self_attn.o_proj"]["scheme"] == "sparsegpt 2:4"  # no map reaches o_proj under GQA
    assert main(["--quiet", "quantize", "--recipe", str(recipe), "--model", str(ref_llama), "--output", str(tmp_path / "out"),
                 "--no-eval"]) == 0
    done = json.loads((tmp_path / "out" / "compress.json").read_text())["layers"]
    for name, plan in planned.items():
        if name == "lm_head":
            continue
        ran = done[name]
        assert (plan.get("smoothquant_alpha"), plan["pattern"]) == (ran.get("smoothquant_alpha"), ran.get("pattern")), name
        assert plan["sparsity"] == ran["target_sparsity"], name


def test_plan_shows_what_structured_cuts_and_distillation_trains(repo, capsys, tmp_path):
    """Stages that select no layers by target (a structured cut, distillation) showed every layer as
    untouched, with no shape."""
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", repo / "recipes/prune-mlp25-distill.yaml")
    detail = json.loads(out)["unassigned_detail"]
    assert rc == 0 and detail["model.layers.0.mlp.gate_proj"] == {"shape": [480, 256], "stage": "structured → distill",
                                                                  "cut_from": [640, 256]}
    assert detail["model.layers.0.self_attn.q_proj"] == {"shape": [256, 256], "stage": "distill", "cut_from": None}
    recipe = tmp_path / "r.yaml"
    recipe.write_text("calibration: {dataset: calibration/default.txt}\nstages:\n  - structured: {structure: mlp-channels, ratio: 0.25}\n"
                      "  - distill: {freeze: ['re:.*self_attn.*']}\n  - rtn: {scheme: W8A16, targets: ['re:.*down_proj']}\n")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", "default")
    plan = json.loads(out)
    assert rc == 0 and plan["unassigned_detail"]["model.layers.0.self_attn.q_proj"]["stage"] == "-"  # frozen
    assert "model.layers.0.mlp.down_proj" in plan["assignments"] and "model.layers.0.mlp.down_proj" not in plan["unassigned_detail"]
    rc, out, err = run(capsys, "plan", "--recipe", recipe, "--model", "default")  # and the table says so
    assert rc == 0 and "cut from 640x256" in out + err


def test_plan_counts_training_state_and_teacher(repo, capsys, ref_llama):
    """A QAT recipe holds gradients and two AdamW moments per parameter and the float teacher."""
    _, out, _ = run(capsys, "--json", "plan", "--recipe", repo / "recipes/w3a16-qat.yaml", "--model", ref_llama)
    qat = json.loads(out)
    _, out, _ = run(capsys, "--json", "plan", "--recipe", repo / "recipes/w4a16-zeropoint-g64.yaml", "--model", ref_llama)
    rtn = json.loads(out)
    params = qat["parameters"]
    assert qat["estimates"]["training_bytes"] == 3 * params * 4 + params * 4  # float32 ref-llama: teacher = 4 bytes/param
    assert rtn["estimates"]["training_bytes"] == 0
    assert qat["estimates"]["peak_memory_bytes"] > rtn["estimates"]["peak_memory_bytes"] + 3 * params * 4


def test_plan_warns_on_patterns_matching_nothing(tmp_path, capsys, ref_llama):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - rtn: {scheme: W8A16, targets: ['re:.*qproj'], ignore: [lm_head]}\n")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
    warnings = json.loads(out)["warnings"]
    assert any("re:.*qproj" in w for w in warnings)
    # a stage that quantizes nothing is refused by the run before any stage works, and so by the plan
    assert rc == 2 and "targets ['re:.*qproj'] minus ignore ['lm_head'] match no linear layer" in json.loads(out)["error"]
    recipe.write_text("calibration: {dataset: calibration/default.txt, seq_len: 4096}\n"
                      "stages:\n  - wanda: {sparsity: 0.5, sparsity_overrides: {mlp.down_porj: 0.3}}\n")
    rc, out, err = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
    plan = json.loads(out)
    assert any("sparsity_overrides key 'mlp.down_porj' matches no target layer" in r for r in plan["refusals"])
    # what the run refuses before any work, the plan refuses: exit 2, the plan shown all the same
    assert rc == 2 and plan["assignments"] and "calibration.seq_len 4096 is longer than the model's context (512" in plan["error"]
    assert "error: calibration.seq_len 4096" in err
    # an alpha_overrides key smoothing no layer would leave them all at alpha, silently: refused
    for key, refused in (("re:.*down_porj", True), ("re:.*down_proj", False)):
        recipe.write_text("calibration: {dataset: calibration/default.txt, num_samples: 2, seq_len: 64}\n"
                          f"stages:\n  - smoothquant: {{alpha: 0.5, alpha_overrides: {{'{key}': 0.8}}}}\n  - rtn: {{scheme: W8A8}}\n")
        rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
        assert (rc == 2) == refused and (f"alpha_overrides key '{key}' matches none of the layers it smooths" in out) == refused


def test_plan_follows_what_each_stage_leaves_and_what_the_run_refuses(tmp_path, capsys, ref_llama):
    """Cases an adversarial pass found where the plan and the run disagreed."""
    calibration = "calibration: {dataset: calibration/default.txt, num_samples: 4, seq_len: 64}\n"

    def plan_of(text):
        (tmp_path / "r.yaml").write_text(calibration + text)
        rc, out, _ = run(capsys, "--json", "plan", "--recipe", tmp_path / "r.yaml", "--model", ref_llama)
        return rc, json.loads(out)

    def dense_in_both(text, why, out):
        rc, p = plan_of(text)
        assert rc == 0 and p["format"] == "dense" and why in p["format_reason"]
        report = run_recipe(parse_recipe(calibration + text, "test"), model=str(ref_llama), output=str(tmp_path / out),
                            device="cpu")
        assert report["format"]["format"] == "dense"
        return report

    # SparseGPT's joint quantization quantizes its layers
    rc, p = plan_of("stages:\n  - sparsegpt: {sparsity: 0.5, quantize: {scheme: W4A16, weights: {group_size: 64}}}\n")
    assert rc == 0 and p["format"] == "packed" and all(a["weights"] for a in p["assignments"].values())
    # GPTQ's act-order with group scales chosen as columns are reached (actorder: group, or true
    # without static groups) leaves groups of mixed scales: written dense; the default packs
    actorder = "stages:\n  - gptq: {scheme: W4A16, weights: {group_size: 64}, actorder: group}\n"
    report = dense_in_both(actorder, "actorder: group", "out")
    assert "GPTQ chose its group scales as act-order reached the columns (actorder: group)" in report["format"]["reason"]
    rc, p = plan_of(actorder.replace("actorder: group", "actorder: true"))
    assert rc == 0 and p["format"] == "dense" and "actorder: group" in p["format_reason"]
    for packs in ("actorder: true, static_groups: true", "actorder: static", "actorder: false", "block_size: 128"):
        rc, p = plan_of(actorder.replace("actorder: group", packs))
        assert rc == 0 and p["format"] == "packed", packs
    # smoothing after quantization rescales the quantized layers off their grid
    smoothed = "stages:\n  - rtn: {scheme: W4A16, weights: {group_size: 64}}\n  - smoothquant: {alpha: 0.5}\n"
    dense_in_both(smoothed, "rescaled by smoothquant after it was quantized", "out2")
    rc, p = plan_of("stages:\n  - smoothquant: {alpha: 0.5}\n  - rtn: {scheme: W8A8}\n")  # the usual order
    assert rc == 0 and p["format"] == "packed"
    # what the run refuses before loading the model
    rc, p = plan_of("offload: disk\nstages:\n  - rtn: {scheme: W8A16}\n")
    assert rc == 2 and "offload: disk runs one block-by-block stage" in p["error"]
    (tmp_path / "r.yaml").write_text("calibration: {dataset: calibration/nosuch.txt}\nstages:\n  - gptq: {scheme: W4A16}\n")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", tmp_path / "r.yaml", "--model", ref_llama)
    assert rc == 2 and "data file not found: calibration/nosuch.txt" in json.loads(out)["error"]


def test_a_structured_ratio_the_config_rules_out_is_refused_before_the_first_stage(tmp_path, capsys, ref_llama, monkeypatch):
    """What a structured stage's ratio removes follows from the config: a ratio that removes
    nothing, or a head count the config rejects, is refused by the plan and by the run before
    the stages before it work."""
    from compress.stages.rtn import RoundToNearest

    monkeypatch.setattr(RoundToNearest, "apply", lambda *a: pytest.fail("the first stage ran"))
    recipe = tmp_path / "r.yaml"
    for structured, words in (("{structure: heads, ratio: 0.25}", "gives a config that LlamaConfig rejects"),
                              ("{structure: blocks, ratio: 0.1}", "ratio 0.1 of 4 blocks removes nothing")):
        recipe.write_text("calibration: {dataset: calibration/default.txt, num_samples: 2, seq_len: 64}\n"
                          f"stages:\n  - rtn: {{scheme: W8A16}}\n  - structured: {structured}\n")
        rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
        assert rc == 2 and words in json.loads(out)["error"], structured
        rc, _, err = run(capsys, "quantize", "--recipe", recipe, "--model", ref_llama, "--output", tmp_path / "out")
        assert rc == 2 and words in err and not (tmp_path / "out").exists()
    # after a stage that reshapes the model, on the shapes it leaves: 4 blocks, then 2
    recipe.write_text("calibration: {dataset: calibration/default.txt, num_samples: 2, seq_len: 64}\nstages:\n"
                      "  - structured: {structure: blocks, ratio: 0.5}\n  - structured: {structure: blocks, ratio: 0.5}\n")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
    assert rc == 0, json.loads(out).get("error")
    recipe.write_text(recipe.read_text()[:-len("ratio: 0.5}\n")] + "ratio: 0.75}\n")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
    assert rc == 2 and "ratio 0.75 of 2 blocks removes all of them" in json.loads(out)["error"]
    recipe.write_text(recipe.read_text().replace("ratio: 0.5}", "ratio: 0.75}"))  # 4 blocks, 1 left, then none
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
    assert rc == 2 and "stage structured: the model has only 1 block: there is nothing to remove" in json.loads(out)["error"]


def test_stages_after_a_structured_one_are_planned_and_checked_on_the_shapes_it_leaves(tmp_path, capsys, ref_llama, monkeypatch):
    """Structured pruning changes the widths and the blocks later stages quantize: the plan, and
    the checks the run makes before the first stage, use the shapes it leaves (ref-llama's MLP is
    640 wide: a quarter removed leaves 480, not a multiple of 64)."""
    from compress.stages.rtn import RoundToNearest
    from compress.stages.structured import Structured

    calibration = "calibration: {dataset: calibration/default.txt, num_samples: 2, seq_len: 64}\n"
    recipe = tmp_path / "r.yaml"
    mlp_then_g64 = "stages:\n  - structured: {structure: mlp-channels, ratio: 0.25}\n  - rtn: {scheme: W4A16, weights: {group_size: 64}}\n"
    recipe.write_text(calibration + mlp_then_g64)
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
    plan = json.loads(out)
    assert rc == 0 and plan["format"] == "dense" and "480 input features are not a whole number of groups of 64" in plan["format_reason"]
    assert plan["assignments"]["model.layers.0.mlp.down_proj"]["shape"] == [256, 480]
    report = run_recipe(parse_recipe(calibration + mlp_then_g64, "test"), model=str(ref_llama), output=str(tmp_path / "a"), device="cpu")
    assert report["format"]["format"] == "dense"
    assert plan["parameters_after"] == report["stages"][0]["summary"]["parameters_after"]

    # blocks: the later stage quantizes the two blocks left, under their new names
    recipe.write_text(calibration + "stages:\n  - structured: {structure: blocks, ratio: 0.5}\n  - rtn: {scheme: W4A16, weights: {group_size: 32}}\n")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
    plan = json.loads(out)
    assert rc == 0 and plan["format"] == "packed" and len(plan["assignments"]) == 14
    assert {n.split(".")[2] for n in plan["assignments"]} == {"0", "1"} and plan["linear_layers"] == 15
    report = run_recipe(parse_recipe(recipe.read_text(), "test"), model=str(ref_llama), output=str(tmp_path / "b"), device="cpu")
    assert report["format"]["format"] == "packed" and plan["parameters_after"] == report["stages"][0]["summary"]["parameters_after"]

    # AWQ with quantize: false only scales: the cut after it is not refused, and neither layer is quantized by it
    recipe.write_text(calibration + "stages:\n  - awq: {scheme: W4A16, weights: {group_size: 64}, quantize: false}\n"
                      "  - structured: {structure: mlp-channels, ratio: 0.25}\n  - rtn: {scheme: W4A16, weights: {group_size: 32}}\n")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
    plan = json.loads(out)
    assert rc == 0 and plan["format"] == "packed", plan.get("error")
    assert plan["assignments"]["model.layers.0.mlp.down_proj"] == {
        "stage": "awq → rtn", "shape": [256, 480], "weights": "int4 g32 sym", "activations": None,
        "scheme": "awq scales for W[int4 g64 sym] A[none] (quantize: false) → W[int4 g32 sym] A[none]"}

    # refused before any stage works: --format packed that the cut makes impossible, group
    # quantization that the cut would break, distillation of a student an earlier stage quantized
    monkeypatch.setattr(Structured, "_collect", lambda *a: pytest.fail("the structured stage ran"))
    monkeypatch.setattr(RoundToNearest, "apply", lambda *a: pytest.fail("the first stage ran"))
    for text, words in (("format: packed\n" + mlp_then_g64, "cannot write the packed format: model.layers.0.mlp.down_proj, "
                                                             "whose 480 input features"),
                        ("stages:\n  - rtn: {scheme: W4A16, weights: {group_size: 64}}\n  - structured: {structure: mlp-channels, ratio: 0.25}\n",
                         "layer model.layers.0.mlp.down_proj was quantized in groups of 64 input columns by an earlier stage"),
                        ("stages:\n  - rtn: {scheme: W8A16}\n  - distill: {data: {eval_samples: 1}, train: {steps: 1}}\n",
                         "stage distill: an earlier stage quantized (28 layers)")):
        recipe.write_text(calibration + text)
        rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
        assert rc == 2 and words in json.loads(out)["error"], text
        rc, _, err = run(capsys, "quantize", "--recipe", recipe, "--model", ref_llama, "--output", tmp_path / "out")
        assert rc == 2 and words in err and not (tmp_path / "out").exists(), text


def test_a_later_stage_matching_no_layer_is_refused_before_the_first_stage(tmp_path, capsys, ref_llama, monkeypatch):
    from compress.stages.rtn import RoundToNearest

    monkeypatch.setattr(RoundToNearest, "apply", lambda *a: pytest.fail("the first stage ran"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("calibration: {dataset: calibration/default.txt, num_samples: 2, seq_len: 64}\n"
                      "stages:\n  - rtn: {scheme: W8A16}\n  - gptq: {scheme: W4A16, targets: ['re:.*q_porj']}\n")
    rc, _, err = run(capsys, "quantize", "--recipe", recipe, "--model", ref_llama, "--output", tmp_path / "out")
    assert rc == 2 and "stage gptq: targets ['re:.*q_porj']" in err and "match no linear layer" in err
    assert not (tmp_path / "out").exists()


def test_plan_tells_which_format_auto_writes(tmp_path, capsys, ref_llama):
    """A group size that does not divide the layers: the run writes dense, and the plan says so,
    with one warning for the stage rather than one per layer."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - rtn: {scheme: W4A16, weights: {group_size: 7}}\n")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
    plan = json.loads(out)
    assert rc == 0 and plan["format"] == "dense" and "not a whole number of groups of 7" in plan["format_reason"]
    [warning] = plan["warnings"]
    assert "28 layers" in warning and "group_size 7" in warning
    rc, out, _ = run(capsys, "plan", "--recipe", recipe, "--model", ref_llama)
    assert rc == 0 and "MiB dense (the packed format cannot express" in " ".join(out.split())
    report = run_recipe(parse_recipe(recipe.read_text(), "test"), model=str(ref_llama), output=str(tmp_path / "out"), device="cpu")
    assert report["format"]["format"] == "dense"
    # the recipe's format: packed is refused as the run refuses it, dense is what was asked for
    recipe.write_text("format: packed\nstages:\n  - rtn: {scheme: W4A16, weights: {group_size: 7}}\n")
    rc, out, err = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
    assert rc == 2 and "cannot write the packed format" in json.loads(out)["error"] and "cannot write the packed format" in err
    rc, out, _ = run(capsys, "plan", "--recipe", recipe, "--model", ref_llama)  # the estimate does not promise it either
    assert rc == 2 and "MiB dense with format: dense; the packed format is refused" in " ".join(out.split())
    recipe.write_text("format: dense\nstages:\n  - rtn: {scheme: W4A16, weights: {group_size: 64}}\n")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
    assert rc == 0 and json.loads(out)["format"] == "dense" and "asked for" in json.loads(out)["format_reason"]
    # a KV cache alone is written in the format (its scales need it)
    recipe.write_text("calibration: {dataset: calibration/default.txt, num_samples: 2, seq_len: 64}\nstages:\n  - kv_cache: {}\n")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", ref_llama)
    assert rc == 0 and json.loads(out)["format"] == "packed"


def test_recipes_lists_bundled(capsys, tmp_path, monkeypatch):
    rc, out, _ = run(capsys, "--json", "recipes")
    names = [r["recipe"] for r in json.loads(out)]
    assert rc == 0 and "recipes/w8a16-absmax.yaml" in names
    # the names it lists work from any directory
    monkeypatch.chdir(tmp_path)
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", "recipes/w8a16-absmax.yaml", "--model", "default")
    assert rc == 0 and len(json.loads(out)["assignments"]) == 28


STAGE_BODIES = {"structured": "{structure: blocks, ratio: 0.25}", "magnitude": "{}", "distill": "{}", "kv_cache": "{}",
                "smoothquant": "{}", "wanda": "{}", "sparsegpt": "{}"}


def test_keys_gives_every_key_of_every_stage_a_meaning_and_the_default_a_recipe_gets(capsys):
    rc, out, _ = run(capsys, "--json", "keys")
    names = [r["name"] for r in json.loads(out)]
    assert rc == 0 and {"recipe", "calibration", "evaluation", "gptq", "qat", "kv_cache"} <= set(names)
    for name in names:
        rc, out, _ = run(capsys, "--json", "keys", name)
        rows = json.loads(out)
        assert rc == 0
        assert [r["key"] for r in rows if not r["description"]] == [], name
        if name in ("recipe", "calibration", "evaluation"):
            continue
        # each listed default is what parsing a recipe fills in, at the listed (dotted) key
        body = STAGE_BODIES.get(name, "{scheme: W4A16}")
        stage = parse_recipe(f"calibration: {{dataset: calibration/default.txt}}\nstages:\n  - {name}: {body}\n", "t").stages[0][1]
        dumped = stage.model_dump(mode="json")
        checked = 0
        for r in rows:
            if r["default"] in ("required", "(its keys' defaults)") or "section" in r["type"] or "[]" in r["key"]:
                continue
            value = dumped
            for part in r["key"].split("."):
                value = value[part] if value is not None else None  # a key of an unset optional section
            if r["key"] in ("scheme", "resolved") or value is None and "." in r["key"]:
                continue  # filled in from the preset, or by compress itself
            listed = ("null" if value is None else str(value).lower() if isinstance(value, bool)
                      else "[" + ", ".join(map(str, value)) + "]" if isinstance(value, list) else str(value))
            if r["default"] == "null" and value is not None:  # filled in from other keys: the meaning says how
                assert "default" in r["description"], (name, r["key"], value)
            else:
                assert r["default"] == listed, (name, r["key"], r["default"], value)
            checked += 1
        assert checked >= 2 or name in ("kv_cache", "structured"), name  # (those two have no optional key)


def test_keys_lists_for_weights_and_activations_only_what_their_side_accepts(capsys):
    """weights.strategy offered `token` and a weights.dynamic key, which the scheme refuses."""
    rc, out, _ = run(capsys, "--json", "keys", "rtn")
    rows = {r["key"]: r for r in json.loads(out)}
    assert rc == 0 and "weights.dynamic" not in rows and "input_activations.dynamic" in rows
    weights, activations = (rows[f"{side}.strategy"]["type"].split(" | ") for side in ("weights", "input_activations"))
    assert "token" not in weights and {"channel", "group", "tensor"} <= set(weights)
    assert "channel" not in activations and {"token", "tensor"} <= set(activations)
    for side, choice in (("weights", "token"), ("input_activations", "channel")):  # what keys leaves out is refused
        with pytest.raises(CompressError, match="strategy"):
            parse_recipe(f"stages:\n  - rtn: {{scheme: W8A8, {side}: {{strategy: {choice}}}}}\n", "t")


def test_keys_of_an_unknown_stage_is_refused_naming_the_known_ones(capsys):
    rc, out, err = run(capsys, "keys", "gptqq")
    assert rc == 2 and "gptqq" in err and "gptq," in err and "Traceback" not in err


def test_json_names_the_output_directory_and_quiet_keeps_warnings(tmp_path, capsys):
    """--json gave the report's size record as "output" (it overwrote the path): a CI script had
    no directory to go on with. --quiet silenced the run's warnings with its bars."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - rtn: {scheme: W4A16}\n  - rtn: {scheme: W8A16, targets: ['re:.*mlp.*']}\n")
    rc, out, _ = run(capsys, "--json", "quantize", "--recipe", recipe, "--model", "default", "--output", tmp_path / "a")
    result = json.loads(out)
    assert rc == 0 and result["output_dir"] == str(tmp_path / "a") and result["output"]["bytes_on_disk"] > 0
    assert len(result["warnings"]) == 1
    rc, out, err = run(capsys, "-q", "quantize", "--recipe", recipe, "--model", "default", "--output", tmp_path / "b")
    assert rc == 0 and out == "" and "warning: stage 2 (rtn) quantizes 12 layers" in " ".join(err.split())
    rc, out, _ = run(capsys, "--json", "prune", "--model", "default", "--method", "magnitude", "--no-eval",
                     "--output", tmp_path / "c")
    assert rc == 0 and json.loads(out)["output_dir"] == str(tmp_path / "c") and json.loads(out)["warnings"] == []


def test_recipes_in_a_directory_that_is_not_there_is_refused(tmp_path, capsys):
    rc, out, err = run(capsys, "--json", "recipes", "--directory", tmp_path / "nope")
    assert rc == 2 and "nope" in json.loads(out)["error"]


def test_recipes_lists_files_that_are_not_recipes_as_such(tmp_path, capsys):
    """A list, a scalar or non-UTF-8 bytes in a .yaml file were internal errors of the listing."""
    (tmp_path / "a-list.yaml").write_text("- rtn: {scheme: W8A16}\n")
    (tmp_path / "b-word.yaml").write_text("hello\n")
    (tmp_path / "c-bytes.yaml").write_bytes(b"\xff\xfe\x00stages")
    (tmp_path / "d-good.yaml").write_text("# fine\nstages: [{rtn: {scheme: W8A16}}, {gptq: {scheme: W4A16}}]\n")
    rc, out, _ = run(capsys, "--json", "recipes", "--directory", tmp_path)
    assert rc == 0 and [r["stages"] for r in json.loads(out)] == [["(not a recipe)"]] * 3 + [["rtn", "gptq"]]


def test_eval_replaces_its_own_report_but_no_other_file(ref_llama, tmp_path, capsys, monkeypatch):
    """--report and --junit overwrote whatever the path held (a reviewer's typo clobbered a system
    file); an earlier report of the same kind is replaced, anything else refused before loading."""
    from compress import modeling

    monkeypatch.setattr(modeling, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    for option in ("--report", "--junit"):
        other = tmp_path / f"notes{option}"
        other.write_text("my own notes\n")
        rc, _, err = run(capsys, "eval", "--model", ref_llama, "--data", HELDOUT, option, other)
        assert rc == 2 and "exists and is not a report of this kind" in err and other.read_text() == "my own notes\n"
    # an earlier report of the kind, and an empty file, may be replaced
    from compress.checkpoint import check_side_output
    from compress.report import EVAL_MARKDOWN_START, JUNIT_START, junit_xml

    for start, text in ((EVAL_MARKDOWN_START, EVAL_MARKDOWN_START + "`old`\n"), (JUNIT_START, junit_xml([])), (JUNIT_START, "")):
        (tmp_path / "earlier").write_text(text)
        assert check_side_output(tmp_path / "earlier", "--report", replaces=start) == (tmp_path / "earlier").resolve()
    # one path for both: the XML replaced the report without a word
    rc, _, err = run(capsys, "eval", "--model", ref_llama, "--data", HELDOUT, "--report", tmp_path / "r", "--junit",
                     tmp_path / "r")
    assert rc == 2 and "--report and --junit both name" in err and not (tmp_path / "r").exists()


def test_a_full_disk_is_the_environment_not_an_internal_error(ref_llama, tmp_path, capsys, monkeypatch):
    """A full disk gave exit 3, "internal error ... please report it", whether the write failed
    without a file name (OSError 28), inside safetensors (its own error, saying so in words) or in
    torch.save while spilling activations ("unexpected pos 576 vs 534"); and --report was left
    truncated. Each is exit 2 with what to do, and a report is written whole or not at all."""
    import errno
    import os
    from pathlib import Path

    from compress import cli, engine

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert "no space left" in cli._refused_path(full)[0]
    assert "no space left" in cli._refused_path(RuntimeError("Error while serializing: IoError(Os { code: 28, kind: "
                                                              "StorageFull, message: \"No space left on device\" })"))[0]
    assert cli._refused_path(RuntimeError("some other failure")) is None

    report = tmp_path / "eval.md"
    real = Path.write_text

    def half_then_full(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", half_then_full)
    rc, _, err = run(capsys, "eval", "--model", ref_llama, "--data", HELDOUT, "--max-windows", 2, "--report", report)
    monkeypatch.undo()
    assert rc == 2 and "no space left on the disk" in err and "free some disk space" in err
    assert list(tmp_path.iterdir()) == []  # neither the report cut in half nor its temporary file
    # written whole, and through a link as a plain write is (the link once became a file)
    from compress.checkpoint import write_whole

    (tmp_path / "reports").mkdir()
    (tmp_path / "latest.md").symlink_to(tmp_path / "reports" / "eval.md")
    write_whole(tmp_path / "latest.md", "# report\n")
    assert (tmp_path / "latest.md").is_symlink() and (tmp_path / "reports" / "eval.md").read_text() == "# report\n"
    (tmp_path / "latest.md").unlink()
    shutil.rmtree(tmp_path / "reports")

    def spill_fails(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 576 vs 534")

    monkeypatch.setattr(engine.torch, "save", spill_fails)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("calibration: {dataset: calibration/default.txt, num_samples: 2, seq_len: 32}\n"
                      "stages:\n  - gptq: {scheme: W4A16, activation_budget: 0}\n")
    rc, _, err = run(capsys, "quantize", "--recipe", recipe, "--model", ref_llama, "--output", tmp_path / "out", "--no-eval")
    assert rc == 2 and "spilling calibration activations to" in err and "activation_budget" in err, err


def test_ctrl_c_while_libraries_load_is_an_interruption(capsys, monkeypatch):
    """Importing transformers takes seconds at start: Ctrl-C then gave a traceback and no JSON."""
    from compress import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_quiet_libraries", interrupted)
    rc, out, err = run(capsys, "--json", "recipes")
    assert rc == 130 and json.loads(out)["exit_code"] == 130 and "Traceback" not in err


def test_prune_errors_name_its_options(tmp_path, capsys):
    data = tmp_path / "tiny.txt"
    data.write_text("a few words of text, far too few for the calibration windows asked for\n")
    rc, out, _ = run(capsys, "--json", "prune", "--model", "default", "--method", "wanda", "--calibration", data,
                     "--num-samples", "2", "--output", tmp_path / "o")
    error = json.loads(out)
    assert rc == 2 and "--num-samples" in error["hint"] and "in a recipe" in error["hint"]


def test_every_bundled_recipe_validates(repo):
    from compress import load_recipe

    for f in sorted((repo / "recipes").glob("*.yaml")):
        assert load_recipe(f).stages, f


def test_global_options_after_command(w8_output, capsys):
    rc, out, _ = run(capsys, "inspect", w8_output, "--json")
    assert rc == 0 and json.loads(out)["compress"]["stages"] == ["rtn"]


def test_minilm_w8_per_channel_keeps_embeddings(minilm, shared, tmp_path, capsys):
    recipe = tmp_path / "minilm.yaml"
    recipe.write_text(f"""
model: {minilm}
stages:
  - rtn: {{scheme: W8A16}}
evaluation: {{datasets: [{shared / 'data/wikitext-2/test.txt'}]}}
""")
    rc, out, _ = run(capsys, "--json", "quantize", "--recipe", recipe, "--output", tmp_path / "out")
    assert rc == 0
    ev = next(iter(json.loads(out)["evaluation"].values()))
    assert ev["mean_cosine"] > 0.999 and ev["sentences"] == 200
    # compress eval on the saved encoder gives the same fidelity, and gates on cosine
    rc, out, _ = run(capsys, "--json", "eval", "--model", tmp_path / "out", "--baseline", minilm,
                     "--data", shared / "data/wikitext-2/test.txt", "--min-cosine", 0.999)
    again = next(iter(json.loads(out)["results"].values()))
    assert rc == 0 and again["mean_cosine"] == pytest.approx(ev["mean_cosine"], abs=1e-6)


def test_saved_recipe_reruns_to_the_same_weights(w8_output, tmp_path, capsys):
    """The effective recipe saved with an output is itself a valid recipe giving the same result."""
    from safetensors.torch import load_file

    rc, _, err = run(capsys, "--quiet", "quantize", "--recipe", w8_output / "recipe.yaml", "--output", tmp_path / "again")
    assert rc == 0, err
    a, b = load_file(w8_output / "model.safetensors"), load_file(tmp_path / "again/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_json_failures_are_json_on_stdout(tmp_path, capsys):
    """A script reading --json output can tell a failure from a result; stderr keeps the one line."""
    rc, out, err = run(capsys, "--json", "eval", "--model", "default", "--data", tmp_path / "missing.txt")
    data = json.loads(out)
    assert rc == 2 and data["exit_code"] == 2 and "missing.txt" in data["error"] and data["hint"]
    assert err.strip().startswith("error:") and "missing.txt" in err
    rc, out, _ = run(capsys, "--json", "eval", "--model", "default", "--data", HELDOUT, "--max-windows", 0)
    assert rc == 2 and "--max-windows" in json.loads(out)["error"]


def test_progress_bars_on_a_terminal_only_and_not_when_quiet(monkeypatch, tmp_path, capsys):
    import io

    from rich.console import Console

    import compress.cli as cli

    recipe = tmp_path / "r.yaml"
    recipe.write_text("calibration: {dataset: calibration/default.txt, num_samples: 4, seq_len: 64}\n"
                      "stages:\n  - gptq: {scheme: W8A16}\n")
    seen = {}
    for name, terminal, quiet in (("terminal", True, False), ("quiet", True, True), ("pipe", False, False)):
        screen = io.StringIO()
        monkeypatch.setattr(cli, "console", Console(file=screen, force_terminal=terminal, width=100))
        argv = ["--quiet"] * quiet + ["quantize", "--recipe", str(recipe), "--model", "default", "--output", str(tmp_path / name)]
        assert main(argv) == 0
        seen[name] = screen.getvalue()
    # rich redraws a few times a second, so which descriptions show depends on timing: a bar is drawn
    assert "━" in seen["terminal"]
    assert "━" not in seen["quiet"] and "━" not in seen["pipe"] and not seen["pipe"].startswith("\n")


def test_encoder_with_a_short_context_evaluates(tmp_path, capsys):
    """Encoders are scored on sentences: --seq-len (default 256) is not theirs to exceed, so a BERT
    with 128 positions is evaluated, not refused as a causal LM would be."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    from compress import modeling

    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         vocab_size=2048, max_position_embeddings=128)).save_pretrained(tmp_path / "bert")
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(tmp_path / "bert")
    rc, out, err = run(capsys, "--json", "eval", "--model", tmp_path / "bert", "--baseline", tmp_path / "bert", "--data", HELDOUT)
    assert rc == 0, err
    assert next(iter(json.loads(out)["results"].values()))["mean_cosine"] == pytest.approx(1.0, abs=1e-6)


def test_the_readme_quickstart_runs_as_written(repo, tmp_path, monkeypatch, capsys):
    """Every `compress` command of the README's Quickstart block, as printed there, from a fresh
    directory (relative recipe and data paths fall back to the project's own): each exits 0. (Its
    eval wrote its report inside the model it measured, which the input guard rightly refuses.)"""
    import re
    import shlex

    readme = (repo / "README.md").read_text()
    block = readme[readme.index("## Quickstart"):]
    block = block[block.index("Then:"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    commands = [shlex.split(re.sub(r"\s+#.*$", "", line, flags=re.M))
                for line in block.replace("\\\n", " ").splitlines() if line.strip().startswith(".venv/bin/compress")]
    assert [c[1] for c in commands] == ["recipes", "keys", "plan", "quantize", "eval", "inspect"]
    monkeypatch.chdir(tmp_path)
    for command in commands:
        assert main(["--quiet", *command[1:]]) == 0, " ".join(command)
        capsys.readouterr()
    assert (tmp_path / "out/w8/model.safetensors").is_file() and (tmp_path / "out/w8-eval.md").is_file()


def test_quantize_no_eval_skips_the_recipes_evaluation(tmp_path, capsys):
    """prune and distill had --no-eval, quantize had not: a recipe with an evaluation section
    always evaluated."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"stages:\n  - rtn: {{scheme: W8A16}}\nevaluation: {{datasets: [{HELDOUT}], max_windows: 2}}\n")
    for extra, evaluated in ((["--no-eval"], False), ([], True)):
        out = tmp_path / f"out{len(extra)}"
        rc, stdout, _ = run(capsys, "--json", "quantize", "--recipe", recipe, "--model", "default", "--output", out, *extra)
        assert rc == 0
        assert bool(json.loads(stdout).get("evaluation")) == evaluated
        assert bool(json.loads((out / "report.json").read_text()).get("evaluation")) == evaluated


def test_plan_warns_when_a_stage_quantizes_what_an_earlier_one_quantized(tmp_path, capsys, repo):
    """rtn W8A16 then rtn W4A16 ran without a word: the second rounds the first's values. GPTQ
    then QAT at the same scheme (the bundled w4a16-qat recipe) is meant, and not warned about."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - rtn: {scheme: W8A16}\n  - rtn: {scheme: W4A16, targets: ['re:.*mlp.*']}\n")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", "default")
    [warning] = [w for w in json.loads(out)["warnings"] if "already quantized" in w]
    assert rc == 0 and warning.startswith("stage 2 (rtn) quantizes 12 layers that are already quantized (rtn: W[int8 per-channel sym]")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", repo / "recipes/w4a16-qat.yaml", "--model", "default")
    assert rc == 0 and not [w for w in json.loads(out)["warnings"] if "already quantized" in w]


def test_a_run_that_quantizes_what_an_earlier_stage_quantized_says_so_and_forgets_its_losses(tmp_path, capsys):
    """GPTQ W4 then rtn W8 stores W4's values on the W8 grid: the run warns as the plan does, and
    the layers' records drop GPTQ's losses, which no longer describe them."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("calibration: {dataset: calibration/default.txt, num_samples: 4, seq_len: 64}\nstages:\n"
                      "  - gptq: {scheme: W4A16, weights: {group_size: 32}, targets: ['re:.*mlp.*']}\n"
                      "  - rtn: {scheme: W8A16}\n")
    cache = ("--cache-dir", tmp_path / "cache")
    rc, out, err = run(capsys, "quantize", "--recipe", recipe, "--model", "default", "--output", tmp_path / "o", *cache)
    assert rc == 0 and "quantizes 12 layers that are already quantized (gptq: int4 g32 sym)" in " ".join((out + err).split())
    report = json.loads((tmp_path / "o/report.json").read_text())
    [warning] = report["warnings"]
    rc, _, _ = run(capsys, "quantize", "--recipe", recipe, "--model", "default", "--output", tmp_path / "again", *cache)
    again = json.loads((tmp_path / "again/report.json").read_text())
    assert rc == 0 and again["cache"]["restored_stages"] == 2 and again["warnings"] == [warning]  # kept with the stage
    assert warning.startswith("stage 2 (rtn) quantizes 12 layers")
    mlp = {n: r for n, r in report["layers"].items() if ".mlp." in n}
    assert len(mlp) == 12 and all(r["stage"] == "rtn" and "gptq_loss" not in r and r["requantized_from"] == "gptq: int4 g32 sym"
                                  for r in mlp.values())
    assert all("requantized_from" not in r for n, r in report["layers"].items() if n not in mlp)
    assert "- warning: stage 2 (rtn)" in (tmp_path / "o/report.md").read_text()


def test_a_qat_run_onto_another_grid_is_warned_about_as_the_plan_does(tmp_path):
    """QAT trains from an earlier stage's values: at the same scheme that is the point (no word),
    onto another grid the run now warns as `compress plan` did, and keeps QAT's records."""
    from compress import parse_recipe, run_recipe

    head = ("model: default\ncalibration: {dataset: calibration/default.txt, num_samples: 4, seq_len: 32}\nstages:\n"
            "  - rtn: {scheme: W4A16, targets: ['re:.*mlp.*']}\n")
    qat = ", targets: ['re:.*mlp.*'], data: {seq_len: 32, eval_samples: 1}, train: {steps: 1, batch_size: 2}}\n"
    warned = {}
    for scheme in ("W4A16", "W8A16"):
        report = run_recipe(parse_recipe(head + "  - qat: {scheme: " + scheme + qat, "t"), output=str(tmp_path / scheme), device="cpu")
        warned[scheme] = report.get("warnings", [])
        assert all(r["stage"] == "qat" and "qat_init" in r and "requantized_from" not in r
                   for n, r in report["layers"].items() if ".mlp." in n)
    assert warned["W4A16"] == []
    [warning] = warned["W8A16"]
    assert warning.startswith("stage 2 (qat) quantizes 12 layers that are already quantized (rtn: int4 g128 sym)"), warning
    assert "QAT trains from those values, and measures its errors against the input model's weights" in warning


def test_a_layer_quantized_again_keeps_its_activation_quantization_and_its_zeros_stay_grid_values(tmp_path):
    """rtn W8A8 with static activations, then GPTQ W4A16: the activations stay quantized (their
    fake-quant is still attached, and the checkpoint says so), and the zeros of an earlier grid
    are not taken for a pruning mask (a 4-bit grid rounds far more than 10 % of weights to zero)."""
    from compress import parse_recipe, run_recipe

    calibration = "model: default\ncalibration: {dataset: calibration/default.txt, num_samples: 4, seq_len: 64}\n"
    recipe = parse_recipe(calibration + "stages:\n  - rtn: {scheme: W8A8, input_activations: {strategy: tensor, dynamic: false}, "
                          "targets: ['re:.*mlp.*']}\n  - gptq: {scheme: W4A16, weights: {group_size: 32}, targets: ['re:.*mlp.*']}\n", "t")
    report = run_recipe(recipe, output=str(tmp_path / "o"), device="cpu")
    mlp = [r for n, r in report["layers"].items() if ".mlp." in n]
    assert len(mlp) == 12
    for r in mlp:
        assert r["stage"] == "gptq" and r["requantized_from"] == "rtn: int8 per-channel sym" and r["gptq_loss"] is not None
        assert r["input_activations"]["num_bits"] == 8 and len(r["activation_range"]) == 2
    saved = json.loads((tmp_path / "o/config.json").read_text())["quantization_config"]
    assert any(g.get("input_activations") for g in saved["config_groups"].values())
    recipe = parse_recipe(calibration + "stages:\n  - rtn: {scheme: W4A16}\n  - gptq: {scheme: W8A16}\n", "t")
    report = run_recipe(recipe, output=str(tmp_path / "o2"), device="cpu")
    assert not [n for n, r in report["layers"].items() if "sparsity_preserved" in r]


def test_plan_warns_when_a_pruning_stage_would_change_nothing(tmp_path, capsys, repo):
    """magnitude 0.5 then magnitude 0.3 ran without a word, and the second removed nothing: the
    weights it would remove are zeros already. Pruning further, to a pattern the earlier stage did
    not leave, within groups a layer-wide pruning does not fill (rows, column blocks), or
    quantizing as well, is not warned about; nor is the bundled 2:4 SparseGPT then GPTQ recipe."""
    recipe = tmp_path / "r.yaml"
    cases = [("magnitude: {sparsity: 0.5}", "magnitude: {sparsity: 0.3, targets: ['re:.*mlp.*']}",
              "stage 2 (magnitude) prunes 12 layers to 0.3 unstructured that an earlier stage already pruned as far"),
             ("wanda: {pattern: '2:4'}", "sparsegpt: {sparsity: 0.5}", "stage 2 (sparsegpt) prunes 28 layers to 0.5"),
             ("magnitude: {sparsity: 0.5}", "magnitude: {sparsity: 0.6}", None),
             # Wanda compares within rows and SparseGPT within column blocks, which a layer-wide
             # pruning leaves short of their share: both change the layers (a reviewer's run of
             # Wanda took q_proj from 50.00 % to 51.85 %), so no warning
             ("magnitude: {sparsity: 0.5}", "wanda: {sparsity: 0.5}", None),
             ("magnitude: {sparsity: 0.5}", "sparsegpt: {sparsity: 0.5}", None),
             # rows pruned to their share each round it per row: 79 of 256 at 0.31, where the layer's
             # count (20,316 of 65,536) is more than 256 rows of 79; the reviewer's k_proj lost 46 more
             ("magnitude: {sparsity: 0.31, per_row: true}", "magnitude: {sparsity: 0.31}", None),
             # a structured cut in between removes zeros with the channels it removes
             ("magnitude: {sparsity: 0.5}\n  - structured: {structure: mlp-channels, ratio: 0.25}",
              "magnitude: {sparsity: 0.5}", None),
             ("wanda: {pattern: '2:4'}\n  - structured: {structure: blocks, ratio: 0.25}", "sparsegpt: {sparsity: 0.5}", None),
             ("magnitude: {sparsity: 0.5}", "magnitude: {sparsity: 0.5}", "stage 2 (magnitude) prunes 28"),
             ("magnitude: {sparsity: 0.5}", "magnitude: {sparsity: 0.5, per_row: true}", None),
             # quantizing as it prunes, it changes the layers whatever it prunes
             ("wanda: {pattern: '2:4'}", "sparsegpt: {pattern: '2:4', quantize: {scheme: W4A16}}", None),
             ("magnitude: {sparsity: 0.5}", "magnitude: {pattern: '2:4'}", None)]
    for first, second, expected in cases:
        recipe.write_text(f"calibration: {{dataset: calibration/default.txt, num_samples: 4, seq_len: 32}}\n"
                          f"stages:\n  - {first}\n  - {second}\n")
        rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", "default")
        found = [w for w in json.loads(out)["warnings"] if "changes nothing" in w]
        assert rc == 0 and (found[0].startswith(expected) if expected else not found), (first, second, found)
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", repo / "recipes/sparse24-sparsegpt-w4a16.yaml", "--model", "default")
    assert rc == 0 and not [w for w in json.loads(out)["warnings"] if "changes nothing" in w]


def test_force_keeps_files_the_user_added_to_an_output(tmp_path, capsys):
    """--force replaces a compress output whole: notes a user saved into it went with it, without
    a word. Each finished output lists the files it was written with (.compress-files), and --force
    refuses while others are there; an output written before that list existed is replaced as before."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - rtn: {scheme: W8A16}\n")
    out = tmp_path / "out"
    argv = ["--quiet", "quantize", "--recipe", recipe, "--model", "default", "--output", out, "--force"]
    assert run(capsys, *argv)[0] == 0
    written = (out / ".compress-files").read_text().splitlines()
    assert {"compress.json", "model.safetensors", "report.json"} <= set(written) and ".compress-files" not in written
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "plot.png").write_bytes(b"\x89PNG")
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and "holds files compress did not write (notes.txt, sub/plot.png); --force would delete them" in err
    assert (out / "notes.txt").read_text() == "mine" and (out / "sub" / "plot.png").is_file()
    (out / ".compress-files").unlink()  # as an output written before the list existed
    assert run(capsys, *argv)[0] == 0 and not (out / "notes.txt").exists()


def test_a_closed_pipe_is_not_a_failed_gate(repo):
    """`compress recipes | head -1`: the reader goes away before compress writes. rich exits 1 on
    the broken pipe, and 1 is the eval gate's failure; compress exits 141 (128 + SIGPIPE) instead,
    as a Unix tool that SIGPIPE ended does, and writes nothing to stderr."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "compress", "recipes"], cwd=repo, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # before the interpreter has even imported compress
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 141 and err == b"", err


def test_plan_asks_about_the_output_layer_only_where_there_is_one(tmp_path, capsys, minilm):
    """On an encoder (no lm_head) the plan said both that the default ignore entry 'lm_head'
    matches nothing and that the stage selects 'every linear layer, lm_head included'. The default
    ignore entry is not warned about, and the question is asked only where the output layer is
    selected."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - rtn: {scheme: W8A16}\n")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", minilm)
    assert rc == 0 and json.loads(out)["warnings"] == []
    recipe.write_text("stages:\n  - rtn: {scheme: W8A16, ignore: []}\n")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", "default")
    assert rc == 0 and json.loads(out)["warnings"] == ["stage 1 (rtn): selects the output layer lm_head too; is that meant?"]


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16, input_activations: {num_bits: 8, type: int, strategy: token, dynamic: true}"])
def test_plan_estimates_the_bytes_the_run_writes(tmp_path, capsys, scheme):
    """W4A8 is written int-quantized (compressed-tensors packs int4 only for weight-only schemes:
    with activation quantization the codes sit in int8); the plan estimated int4 packing, half the
    file's quantized bytes. Its estimate now follows the format's code width."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"stages:\n  - rtn: {{scheme: {scheme}}}\n")
    rc, out, _ = run(capsys, "--json", "plan", "--recipe", recipe, "--model", "default")
    estimate = json.loads(out)["estimates"]["output_bytes_packed"]
    assert rc == 0 and main(["-q", "quantize", "--recipe", str(recipe), "--model", "default", "--no-eval",
                             "--output", str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "report.json").read_text())["output"]["bytes_on_disk"]
    assert abs(estimate - written) < 0.01 * written, (estimate, written)


def test_an_evaluation_text_too_short_to_score_is_refused_before_the_first_stage(tmp_path, capsys, ref_llama, minilm,
                                                                                  monkeypatch):
    """A one-line evaluation file was found only after every stage had run (a GPTQ run's work
    thrown away at the end, exit 2). The windows (or sentences) it must give are checked first."""
    from compress.stages.rtn import RoundToNearest

    monkeypatch.setattr(RoundToNearest, "apply", lambda *a: pytest.fail("the first stage ran"))
    short = tmp_path / "short.txt"
    short.write_text("One line of text, shorter than a window and the only sentence.\n")
    recipe = tmp_path / "r.yaml"
    for model, words in ((ref_llama, "shorter than one 256-token window"),
                         (minilm, "fewer than 2 lines longer than 40 characters")):
        recipe.write_text(f"stages:\n  - rtn: {{scheme: W8A16}}\nevaluation: {{datasets: [{short}]}}\n")
        rc, _, err = run(capsys, "quantize", "--recipe", recipe, "--model", model, "--output", tmp_path / "out")
        assert rc == 2 and f"evaluation text {short} " in err and words in err, err
        assert not (tmp_path / "out").exists()
