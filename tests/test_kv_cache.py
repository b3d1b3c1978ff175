"""The FP8 KV cache stage: scales from the keys (after RoPE) and values the attention layers
really store, rounding simulated in the evaluated model, and checkpoints whose k_scale and
v_scale plain transformers (compressed-tensors' own KV cache quantization) computes exactly our
logits with."""

import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache

from compress import activations, modeling, parse_recipe, run_recipe
from compress.calibration import build_calibration
from compress.cli import main
from compress.pipeline import evaluate_model, inspect_checkpoint
from compress.quant import FP8_E4M3_MAX

from tests.test_packed import IDS, plain_transformers_logits, relative_difference

CALIBRATION = "calibration: {dataset: calibration/default.txt, num_samples: 6, seq_len: 64}\n"
HELD = "calibration/heldout-tinyshakespeare.txt"


def kv_recipe(weights_stage: str = "rtn: {scheme: W4A16}", model: str = "default"):
    return parse_recipe(f"model: {model}\n{CALIBRATION}stages:\n  - {weights_stage}\n  - kv_cache: {{}}\n"
                        f"evaluation: {{datasets: [{HELD}], seq_len: 128, max_windows: 6}}\n", "test")


@pytest.fixture(scope="module")
def w4_kv(tmp_path_factory):
    """W4A16 then the FP8 KV cache, on the bundled model in float32."""
    out = tmp_path_factory.mktemp("kv") / "w4kv"
    report = run_recipe(kv_recipe(), output=str(out), device="cpu", dtype="float32")
    return out, report


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def test_scales_are_the_largest_stored_key_and_value_over_calibration(w4_kv):
    """Recomputed independently: the calibration windows through the saved model (KV rounding off)
    with a real DynamicCache, whose stored keys and values give the maxima."""
    out, report = w4_kv
    model, tokenizer, _ = modeling.load_model(str(out))
    modules = activations.attention_modules(model)
    assert len(modules) == 4
    for m in modules.values():
        activations.detach_kv(m)
    samples = build_calibration(kv_recipe().calibration, tokenizer).samples
    top = {i: [0.0, 0.0] for i in range(4)}
    with torch.no_grad():
        for sample in samples:
            cache = DynamicCache(config=model.config)
            model(**sample, past_key_values=cache, use_cache=True)
            for i in range(4):
                top[i][0] = max(top[i][0], float(cache.layers[i].keys.abs().max()))
                top[i][1] = max(top[i][1], float(cache.layers[i].values.abs().max()))
    ranges = report["kv_cache"]["ranges"]
    for i in range(4):
        assert ranges[f"model.layers.{i}.self_attn"] == pytest.approx(top[i], rel=1e-6)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        k_scale = f.get_tensor("model.layers.2.self_attn.k_scale")
        v_scale = f.get_tensor("model.layers.2.self_attn.v_scale")
    assert float(k_scale) == pytest.approx(top[2][0] / FP8_E4M3_MAX, rel=1e-6)
    assert float(v_scale) == pytest.approx(top[2][1] / FP8_E4M3_MAX, rel=1e-6)
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["kv_cache_scheme"]["type"] == "float" and qconfig["kv_cache_scheme"]["strategy"] == "tensor"


def test_plain_transformers_computes_our_logits_with_the_kv_scales(w4_kv, tmp_path):
    out, _ = w4_kv
    model, _, _ = modeling.load_model(str(out))
    ours = logits(model)
    theirs = plain_transformers_logits(out, tmp_path)
    assert relative_difference(ours, theirs) <= 1e-6
    for m in activations.attention_modules(model).values():  # and the rounding is there on both sides
        activations.detach_kv(m)
    assert relative_difference(logits(model), theirs) > 1e-3


def test_reloads_evaluate_as_the_run_did(w4_kv, tmp_path):
    """compress eval on the output, and on the same files as another tool's checkpoint (no
    compress.json: kv_cache_scheme and the scales come from config.json and the tensors)."""
    out, report = w4_kv
    other = tmp_path / "other"
    shutil.copytree(out, other)
    (other / "compress.json").unlink()
    for path in (out, other):
        again = evaluate_model(str(path), [HELD], device="cpu", seq_len=128, max_windows=6)
        assert again["results"][HELD]["token_perplexity"] == pytest.approx(report["evaluation"][HELD]["token_perplexity"], rel=1e-9)


def test_inspect_names_the_kv_cache(w4_kv, capsys):
    out, report = w4_kv
    assert main(["inspect", str(out)]) == 0
    assert "KV cache: fp8 e4m3" in capsys.readouterr().out
    assert inspect_checkpoint(out)["summary"]["kv_cache"] == report["kv_cache"]


def test_generation_with_a_real_cache_stores_rounded_keys(w4_kv):
    out, report = w4_kv
    model, _, _ = modeling.load_model(str(out))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        generated = model.generate(input_ids=IDS[:1], max_new_tokens=4, do_sample=False, past_key_values=cache)
    assert generated.shape[1] == IDS.shape[1] + 4
    key_max = report["kv_cache"]["ranges"]["model.layers.1.self_attn"][0]
    keys = cache.layers[1].keys.float() / (key_max / FP8_E4M3_MAX)
    assert torch.equal(keys.clamp(-448, 448).to(torch.float8_e4m3fn).float(), keys)  # on the e4m3 grid


def test_stage_cache_restores_the_kv_scales(tmp_path):
    recipe = kv_recipe()
    first = run_recipe(recipe, output=str(tmp_path / "a"), device="cpu", cache_dir=str(tmp_path / "cache"))
    again = run_recipe(recipe, output=str(tmp_path / "b"), device="cpu", cache_dir=str(tmp_path / "cache"))
    assert all(s.get("from_cache") for s in again["stages"])
    assert again["kv_cache"] == first["kv_cache"]
    assert again["evaluation"][HELD]["token_perplexity"] == first["evaluation"][HELD]["token_perplexity"]


def test_encoder_is_refused_in_one_line(tmp_path, capsys):
    from tests.test_model_families import FAMILIES

    torch.manual_seed(0)
    path = tmp_path / "bert"
    FAMILIES["bert"]().save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {path}\n{CALIBRATION}stages:\n  - kv_cache: {{}}\n")
    rc = main(["--quiet", "quantize", "--recipe", str(recipe), "--output", str(tmp_path / "out")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "kv_cache" in err and "encoder" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["opt", "gpt2", "mixtral"])
def test_every_decoder_family_calibrates_and_reloads(family, tmp_path):
    """OPT, GPT-2 (its Conv1D model is written dense: the scales live in compress.json) and a
    mixture-of-experts model: one scale pair per attention layer, reloaded as evaluated."""
    from tests.test_model_families import FAMILIES
    from tests.test_moe import MOE

    torch.manual_seed(0)
    path = tmp_path / family
    {**FAMILIES, **MOE}[family]().save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
    report = run_recipe(kv_recipe("rtn: {scheme: W8A16}", model=str(path)), output=str(tmp_path / "out"), device="cpu")
    ranges = report["kv_cache"]["ranges"]
    assert len(ranges) == 2 and all(k > 0 and v > 0 for k, v in ranges.values())
    again = evaluate_model(str(tmp_path / "out"), [HELD], device="cpu", seq_len=128, max_windows=6)
    assert again["results"][HELD]["token_perplexity"] == pytest.approx(report["evaluation"][HELD]["token_perplexity"], rel=1e-9)
