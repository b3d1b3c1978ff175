"""The FP8 KV cache stage: scales from the keys (after RoPE) and values the attention layers
really store, rounding simulated in the evaluated model, and checkpoints whose k_scale and
v_scale plain transformers (compressed-tensors' own KV cache quantization) computes exactly our
logits with."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache

from compress import activations, modeling, parse_recipe, run_recipe
from compress.calibration import build_calibration
from compress.cli import main
from compress.pipeline import evaluate_model, inspect_checkpoint
from compress.quant import FP8_E4M3_MAX
from compress.stages import kv_cache
from compress.stages.base import StageContext

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


def compressed_tensors_hooks_the_cache(model) -> bool:
    """Whether the installed compressed-tensors recognises these attention layers' cache argument:
    0.20 looks for `past_key_values`, which transformers 5.24 renamed `cache`, and then silently
    loads the checkpoint without rounding keys and values."""
    from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module

    return all(is_cached_attention_module(m) for m in activations.attention_modules(model).values())


def assert_plain_transformers_computes_our_logits(model, out, tmp_path):
    ours = logits(model)
    theirs = plain_transformers_logits(out, tmp_path)
    if not compressed_tensors_hooks_the_cache(model):
        # The weights still load exactly; only the KV rounding is missing on their side.
        for m in activations.attention_modules(model).values():
            activations.detach_kv(m)
        assert relative_difference(logits(model), theirs) <= 1e-6
        pytest.xfail("this compressed-tensors does not hook transformers' `cache` argument (5.24 on): it ignores k_scale/v_scale")
    assert relative_difference(ours, theirs) <= 1e-6
    return theirs


def test_plain_transformers_computes_our_logits_with_the_kv_scales(w4_kv, tmp_path):
    out, _ = w4_kv
    model, _, _ = modeling.load_model(str(out))
    theirs = assert_plain_transformers_computes_our_logits(model, out, tmp_path)
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


def test_inspect_and_the_reports_name_the_kv_cache(w4_kv, capsys):
    out, report = w4_kv
    assert main(["inspect", str(out)]) == 0
    assert "KV cache: fp8 e4m3" in capsys.readouterr().out
    assert inspect_checkpoint(out)["summary"]["kv_cache"] == report["kv_cache"]
    line = "KV cache: 4 attention layers' keys and values in float8 e4m3, one static scale each"
    assert line in (out / "report.md").read_text() and line in (out / "report.html").read_text().replace("&#x27;", "'")


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


def observe_kv(model, modules, samples):
    """The kv_cache stage's observation (through the calibration engine) on these samples."""
    ctx = StageContext(device=torch.device("cpu"), calibration=SimpleNamespace(samples=samples))
    return kv_cache.observe_kv(model, ctx, modules)[0]


def test_a_blocks_kv_hooks_are_gone_before_the_next_block_runs():
    """The observers' cache stand-ins keep keys and values for the forward that computes them; once
    a block is calibrated they are removed, before the next block runs (they would otherwise keep
    every layer's keys and values, on the device, to the end). The model is unchanged, so each block
    runs once: its calibration pass's outputs feed the next block, with no propagating pass."""
    model, tokenizer, _ = modeling.load_model("default", dtype="float32")
    modules = activations.attention_modules(model)
    hooks_at_start = {}  # block -> hooks left on each earlier block's attention when it starts
    passes = []

    def progress(description, done, total):
        passes.append(description.split(": ")[-1])
        if description.endswith(": calibrating") and done == 0:
            block = int(description.split()[1].split("/")[0]) - 1
            hooks_at_start[block] = [len(modules[f"model.layers.{b}.self_attn"]._forward_pre_hooks) for b in range(block)]

    ids = [torch.arange(n) * 53 % 2000 + 5 for n in (24, 24)]
    ctx = StageContext(device=torch.device("cpu"), calibration=SimpleNamespace(samples=[{"input_ids": i[None]} for i in ids]),
                       progress=progress)
    ranges, summary = kv_cache.observe_kv(model, ctx, modules)
    assert sorted(hooks_at_start) == list(range(summary["blocks"]))
    assert all(set(left) <= {0} for left in hooks_at_start.values())
    assert set(passes) == {"calibrating"}
    assert all(k > 0 and v > 0 for k, v in ranges.values())
    assert all(not m._forward_pre_hooks for m in modules.values())


def test_padding_is_left_out_of_the_scales(tmp_path):
    """One padded batch observes the same maxima as each sequence alone: padded positions'
    keys and values (which a cache would never serve) do not count."""
    model, tokenizer, _ = modeling.load_model("default", dtype="float32")
    modules = activations.attention_modules(model)
    lengths = (9, 20, 14)
    ids = [torch.arange(n) * 53 % 2000 + 5 for n in lengths]
    alone = {name: [0.0, 0.0] for name in modules}
    for seq in ids:
        seen = observe_kv(model, modules, [{"input_ids": seq[None]}])
        for name, (k, v) in seen.items():
            alone[name] = [max(alone[name][0], k), max(alone[name][1], v)]
    def padded_with(pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = torch.full((len(ids), max(lengths)), pad, dtype=torch.long)
        mask = torch.zeros_like(batch)
        for i, seq in enumerate(ids):
            batch[i, : len(seq)], mask[i, : len(seq)] = seq, 1
        return batch, mask

    def differs(seen: dict) -> bool:
        return any(seen[n] != pytest.approx(alone[n], rel=1e-5) for n in modules)

    # a padding token whose keys or values, if counted, would change some layer's maxima
    pad = next(t for t in range(7, 2048, 61)
               if differs(observe_kv(model, modules, [{"input_ids": padded_with(t)[0]}])))
    batch, mask = padded_with(pad)
    padded = observe_kv(model, modules, [{"input_ids": batch, "attention_mask": mask}])
    assert not differs(padded)


def test_kv_cache_alone_is_written_in_the_format(tmp_path):
    """No weight quantized: the checkpoint still carries the scales (config_groups empty,
    kv_cache_scheme set), and plain transformers computes our logits from it."""
    out = tmp_path / "kv-only"
    report = run_recipe(parse_recipe(f"model: default\n{CALIBRATION}stages:\n  - kv_cache: {{}}\n", "test"),
                        output=str(out), device="cpu", dtype="float32")
    assert report["format"]["format"] == "packed" and "k_scale" in report["format"]["reason"]
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["config_groups"] == {} and qconfig["kv_cache_scheme"]["num_bits"] == 8
    dense = run_recipe(parse_recipe(f"model: default\n{CALIBRATION}stages:\n  - kv_cache: {{}}\nformat: dense\n", "test"),
                       output=str(tmp_path / "dense"), device="cpu")
    assert "compress.json only" in dense["format"]["reason"]
    model, _, _ = modeling.load_model(str(out))
    assert_plain_transformers_computes_our_logits(model, out, tmp_path)


def test_a_later_run_on_a_kv_cache_checkpoint_keeps_it(w4_kv, tmp_path):
    """The input's KV rounding is attached when it loads, so the next run evaluates with it: it
    writes the same scales out, and its output reloads to the same numbers."""
    out, first = w4_kv
    report = run_recipe(parse_recipe(f"model: {out}\nstages:\n  - rtn: {{scheme: W8A16}}\n"
                                     f"evaluation: {{datasets: [{HELD}], seq_len: 128, max_windows: 6}}\n", "test"),
                        output=str(tmp_path / "next"), device="cpu")
    assert report["kv_cache"]["ranges"].keys() == first["kv_cache"]["ranges"].keys()
    for name, kv in first["kv_cache"]["ranges"].items():
        assert report["kv_cache"]["ranges"][name] == pytest.approx(kv)
    again = evaluate_model(str(tmp_path / "next"), [HELD], device="cpu", seq_len=128, max_windows=6)
    assert again["results"][HELD]["token_perplexity"] == pytest.approx(report["evaluation"][HELD]["token_perplexity"], rel=1e-9)


def test_removing_blocks_renumbers_the_kv_scales_with_their_layers(w4_kv, tmp_path):
    """Removing whole blocks renumbers the kept ones: each kept attention layer keeps its own key
    and value scales under its new index, and the file holds scales for those layers only (it
    held the removed layers' scales, and the old numbering, which gave block 3 block 1's)."""
    out, first = w4_kv
    report = run_recipe(parse_recipe(f"model: {out}\n{CALIBRATION}stages:\n"
                                     "  - structured: {structure: blocks, ratio: 0.5}\n", "test"),
                        output=str(tmp_path / "cut"), device="cpu")
    kept = [b for b in range(4) if b not in report["stages"][0]["summary"]["removed_blocks"]]
    assert kept != [0, 1]  # the test needs a kept block that moves
    ranges = report["kv_cache"]["ranges"]
    assert list(ranges) == [f"model.layers.{new}.self_attn" for new in range(len(kept))]
    for new, old in enumerate(kept):
        assert ranges[f"model.layers.{new}.self_attn"] == first["kv_cache"]["ranges"][f"model.layers.{old}.self_attn"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "cut" / "model.safetensors"), "pt") as f:
        scales = sorted(k for k in f.keys() if k.endswith(("k_scale", "v_scale")))
        for new, old in enumerate(kept):
            expected = first["kv_cache"]["ranges"][f"model.layers.{old}.self_attn"][0] / FP8_E4M3_MAX
            assert f.get_tensor(f"model.layers.{new}.self_attn.k_scale").item() == pytest.approx(expected, rel=1e-6)
    assert scales == [f"model.layers.{b}.self_attn.{k}" for b in range(len(kept)) for k in ("k_scale", "v_scale")]


def test_attention_that_names_its_cache_layer_past(tmp_path):
    """GPT-NeoX (like GPT-J, Falcon and Bloom) calls the cache argument `layer_past`."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    path = tmp_path / "neox"
    GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     vocab_size=2048)).save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
    recipe = kv_recipe("rtn: {scheme: W8A16}", model=str(path))
    recipe.format = "dense"  # compress's packed reader does not know GPT-NeoX's output layer name (embed_out)
    report = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    assert len(report["kv_cache"]["ranges"]) == 2
    again = evaluate_model(str(tmp_path / "out"), [HELD], device="cpu", seq_len=128, max_windows=6)
    assert again["results"][HELD]["token_perplexity"] == pytest.approx(report["evaluation"][HELD]["token_perplexity"], rel=1e-9)
