"""Quantization-aware training: it improves on round-to-nearest at the same scheme, starts
exactly from an earlier PTQ stage's grid, keeps pruned weights at zero, and saves the same packed
format as PTQ."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from compress import modeling
from compress.cli import main
from compress.errors import CompressError
from compress.pipeline import run_recipe
from compress.quant import compute_qparams, fake_quantize, fake_quantize_ste, recover_qparams
from compress.recipe import parse_recipe
from compress.schemes import QuantArgs
from compress.stages.base import StageContext
from compress.stages.qat import QAT

TRAIN = "{steps: %d, batch_size: 4, lr: %g, warmup: 0, eval_every: 0, save_every: 0}"


def data_keys(shared, n=48, seq=64):
    return f"{{dataset: {shared}/data/tinyshakespeare/train.txt, seq_len: {seq}, num_samples: {n}, eval_samples: 8}}"


def test_qat_w3_beats_its_round_to_nearest_start_and_packs(ref_llama, shared, tmp_path):
    r = parse_recipe(f"""
stages:
  - qat:
      weights: {{num_bits: 3, strategy: channel, symmetric: true}}
      data: {data_keys(shared)}
      train: {TRAIN % (16, 2e-4)}
evaluation: {{datasets: [{shared}/data/tinyshakespeare/test.txt], max_windows: 8, seq_len: 64}}
""", "test")
    report = run_recipe(r, model=str(ref_llama), output=str(tmp_path / "out"))
    s = report["stages"][0]["summary"]
    # held-out KL to the float model: round-to-nearest at step 0 (the starting grid), then trained
    assert s["held_out_kd_after"] < 0.8 * s["held_out_kd_before"], s
    assert report["format"]["format"] == "packed"
    layers = json.loads((tmp_path / "out" / "compress.json").read_text())["layers"]
    assert len(layers) == 28 and all(rec["stage"] == "qat" and rec["qat_init"] == "round-to-nearest" for rec in layers.values())
    # the packed file holds 3-bit codes that decompress to exactly the trained weights
    loaded, _, _ = modeling.load_model(str(tmp_path / "out"), dtype="float32")
    ids = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    for name, module in loaded.named_modules():
        if name in layers:  # every row on a 3-bit symmetric grid of its own step
            assert recover_qparams(module.weight.detach(), 3, True, "channel")[2] == 0, name
    assert loaded(input_ids=ids).logits.isfinite().all()


def test_qat_starts_from_an_earlier_stage_grid_exactly():
    """GPTQ (or any PTQ stage) leaves weights on its grid: QAT recovers that grid, so its first
    forward pass computes with exactly the PTQ weights."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 8, bias=False)
    for args in (QuantArgs(num_bits=4, strategy="group", group_size=16, symmetric=False),
                 QuantArgs(num_bits=3, strategy="channel", symmetric=True)):
        with torch.no_grad():
            # a grid that round-to-nearest from these weights would not give: scales shrunk by 10 %
            qp = compute_qparams(layer.weight, args.num_bits, args.symmetric, args.strategy, args.group_size)
            qp.scale *= 0.9
            on_grid = fake_quantize(layer.weight, args.num_bits, args.symmetric, args.strategy, args.group_size, qparams=qp)
        module = torch.nn.Linear(64, 8, bias=False)
        module.weight.data.copy_(on_grid)
        ctx = StageContext(device=torch.device("cpu"), layers={"l": {"stage": "gptq", "weights": args.model_dump()}})
        got, origin = QAT._initial_qparams("l", module, on_grid.clone(), args, ctx)
        assert origin == "gptq grid"
        again = fake_quantize_ste(on_grid, got.scale, got.zero_point, got.qmin, got.qmax,
                                  args.group_size if args.strategy == "group" else None)
        assert torch.equal(again, on_grid)
        # without an earlier stage: round-to-nearest's grid
        _, origin = QAT._initial_qparams("l", module, on_grid.clone(), args, StageContext(device=torch.device("cpu")))
        assert origin == "round-to-nearest"


@pytest.fixture
def tiny(tmp_path):
    tok = AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=128)
    path = tmp_path / "tiny"
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_qat_after_pruning_and_with_activations(tiny, repo, tmp_path):
    r = parse_recipe(f"""
stages:
  - magnitude: {{sparsity: 0.5}}
  - qat:
      scheme: W8A8
      scales: fixed
      data: {{dataset: {repo}/calibration/default.txt, seq_len: 32, num_samples: 16, eval_samples: 4}}
      train: {TRAIN % (4, 1e-3)}
""", "test")
    report = run_recipe(r, model=str(tiny), output=str(tmp_path / "out"))
    s = report["stages"][1]["summary"]
    assert s["masked_layers"] == 14 and s["masks_kept"]
    meta = json.loads((tmp_path / "out" / "compress.json").read_text())
    for name, rec in meta["layers"].items():
        assert rec["stage"] == "qat" and rec["input_activations"]["dynamic"] and rec["sparsity"] >= 0.5, name
    loaded, _, _ = modeling.load_model(str(tmp_path / "out"), dtype="float32")
    w = loaded.model.layers[0].self_attn.q_proj.weight
    assert float((w == 0).float().mean()) >= 0.5
    assert hasattr(loaded.model.layers[0].self_attn.q_proj, "_compress_activation_hook")  # A8 reattached on load


def test_learned_scales_move_by_a_share_of_themselves_and_stay_positive(ref_llama, tmp_path):
    """AdamW steps every parameter by about lr, whatever LSQ's gradient scale: learned directly,
    8-bit step sizes of ~5e-4 moved 15-20 % a step at lr 1e-4 and some went through zero,
    clipping their whole row (a reviewer's run: 14 rows with errors up to 0.95). The logarithm is
    learned instead: after n steps each scale is within about exp(±n·lr) of its start."""
    from safetensors.torch import load_file

    steps, lr = 6, 1e-4
    stage = (f"  - qat: {{scheme: W8A16, keep_start_if_worse: false, data: {{dataset: calibration/default.txt, seq_len: 64, "
             f"num_samples: 16, eval_samples: 2}}, train: {{steps: {steps}, batch_size: 4, lr: {lr}}}}}\n")
    run_recipe(parse_recipe("stages:\n" + stage, "t"), model=str(ref_llama), output=str(tmp_path / "o"), device="cpu",
               dtype="float32")
    saved = load_file(tmp_path / "o" / "model.safetensors")
    start = dict(modeling.load_model(str(ref_llama), dtype="float32")[0].named_modules())
    ratios = []
    for key, scale in saved.items():
        if key.endswith(".weight_scale"):
            name = key.removesuffix(".weight_scale")
            ratios.append(scale.float().flatten() / (start[name].weight.detach().abs().amax(1) / 127))
    ratios = torch.cat(ratios)
    assert len(ratios) > 9000 and (ratios > 0).all()
    assert float((ratios.log().abs()).max()) <= 1.5 * steps * lr
    assert float((ratios.log().abs()).max()) > 0.1 * steps * lr  # and they did learn


def fixed_w4_qat(repo, extra: str):
    """QAT at W4 per-channel with fixed scales for 3 steps on the default text, `extra` keys added
    (one YAML line each, indented as the stage's keys)."""
    return parse_recipe(f"""
stages:
  - qat:
      weights: {{num_bits: 4, strategy: channel, symmetric: true}}
      scales: fixed
      keep_start_if_worse: false
{extra}
      data: {{dataset: {repo}/calibration/default.txt, seq_len: 32, num_samples: 16, eval_samples: 4}}
      train: {TRAIN % (3, 1e-3)}
""", "test")


def test_fixed_scales_do_not_move(tiny, repo, tmp_path):
    r = fixed_w4_qat(repo, "      kd_weight: 0.0\n      ce_weight: 1.0")
    report = run_recipe(r, model=str(tiny), output=str(tmp_path / "out"), format="dense")
    assert report["stages"][0]["summary"]["teacher"] is None  # task loss: no teacher loaded
    before = LlamaForCausalLM.from_pretrained(tiny).model.layers[0].mlp.up_proj.weight.detach()
    after = load_file(tmp_path / "out" / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    step = before.abs().amax(1, keepdim=True) / 7
    codes = after / step
    assert torch.allclose(codes, codes.round(), atol=1e-3)  # still on round-to-nearest's grid
    assert not torch.equal(after, fake_quantize(before, 4, True, "channel"))  # but the weights trained


@pytest.mark.parametrize("stage, words", [
    ("{scheme: FP8, scales: learned}", "use scales: rtn"),
    ("{scheme: MXFP4A16, scales: fixed}", "use scales: rtn"),
    ("{scheme: W8A8, input_activations: {dynamic: false, strategy: tensor}}", "dynamic activations only"),
    ("{scheme: NVFP4}", "dynamic activations only"),  # NVFP4's input global scale is calibrated
    ("{scheme: W4A16, kd_weight: 0}", "nothing to train on"),
    ("{scheme: W4A16, freeze: [nothing_like_this]}", "match no parameter"),
    ("{scheme: W4A16, train: {steps: 0}}", "train.steps"),
    ("{scheme: W4A16, train: {steps: 10, warmup: 20}}", "a warm-up of 20 steps is longer than the run's 10"),
])
def test_bad_qat_stages(stage, words, tiny, repo, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tiny}\nstages:\n  - qat: {stage}\n"
                      f"calibration: {{dataset: {repo}/calibration/default.txt, num_samples: 20, seq_len: 32}}\n")
    code = main(["quantize", "--recipe", str(recipe), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_bundled_gptq_then_qat_recipe_starts_from_the_gptq_grid(tiny, repo, tmp_path):
    from compress.recipe import load_recipe

    r = load_recipe(repo / "recipes/w4a16-qat.yaml")
    r.calibration.num_samples, r.calibration.seq_len, r.evaluation = 4, 32, None
    qat = r.stages[1][1]
    qat.data.seq_len, qat.data.num_samples, qat.data.eval_samples = 32, 8, 4
    qat.train.steps, qat.train.batch_size = 2, 2
    report = run_recipe(r, model=str(tiny), output=str(tmp_path / "o"))
    meta = json.loads((tmp_path / "o" / "compress.json").read_text())
    assert meta["stages"] == ["gptq", "qat"] and report["format"]["format"] == "packed"
    assert all(rec["qat_init"] == "gptq grid" and rec["weights"]["group_size"] == 64 for rec in meta["layers"].values())
    # QAT started where GPTQ ended: its step-0 held-out loss is the GPTQ model's
    assert report["stages"][1]["summary"]["training"]["history"][0]["step"] == 0
    # GPTQ rounded many weights to zero, but pruned none: QAT keeps no mask, those weights train too
    # (they were frozen as if pruned: about one weight in seven at 4 bits)
    assert report["stages"][1]["summary"]["masked_layers"] == 0
    # each layer's error is its final weights' against the input model's float ones, not QAT's
    # small change to GPTQ's grid (which once stood in the report as the layer's error)
    source, _, _ = modeling.load_model(str(tiny), dtype="float32")
    saved, _, _ = modeling.load_model(str(tmp_path / "o"), dtype="float32")
    for name, rec in meta["layers"].items():
        w0, w1 = modeling.get_weight(source.get_submodule(name)), modeling.get_weight(saved.get_submodule(name))
        assert rec["relative_error_against"] == "the input model's weights"
        assert rec["relative_error"] == pytest.approx(float((w1 - w0).norm() / w0.norm()), rel=1e-4), name
        assert rec["qat_relative_change"] < rec["relative_error"], name


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_models_train_in_float32_and_come_back_in_their_dtype(ref_llama, tmp_path, dtype):
    """AdamW on float16 weights turned every weight into NaN in one step (eps and g² underflow),
    and the run saved them with exit 0. Training runs in float32 and saves in the model's dtype.
    QAT's 8-bit weights pack: its learned scales grew (AdamW moves a step of ~5e-4 by up to lr
    per step), leaving most rows' extremes short of code 127, which the packer once gave up on."""
    from safetensors.torch import load_file

    data = "{dataset: calibration/default.txt, seq_len: 64, num_samples: 8, eval_samples: 2}"
    for stages, fmt in ((f"  - qat: {{scheme: W8A16, data: {data}, train: {{steps: 2, batch_size: 4}}}}\n", "packed"),
                        (f"  - magnitude: {{sparsity: 0.3}}\n  - distill: {{data: {data}, train: {{steps: 2, batch_size: 4}}}}\n",
                         "dense")):
        out = tmp_path / f"out-{len(stages)}"
        report = run_recipe(parse_recipe("stages:\n" + stages, "t"), model=str(ref_llama), output=str(out), device="cpu",
                            dtype=dtype, format=fmt)
        summary = report["stages"][-1]["summary"]
        assert math.isfinite(summary["held_out_kd_after"]) and summary["masks_kept"], stages
        assert report["format"]["format"] == fmt
        tensors = load_file(out / "model.safetensors")
        assert all(torch.isfinite(t.float()).all() for t in tensors.values())
        floats = {t.dtype for n, t in tensors.items() if t.is_floating_point() and not n.endswith("weight_scale")}
        assert floats == {getattr(torch, dtype)}, floats


def test_a_training_loss_that_stops_being_finite_is_an_error_not_a_nan_checkpoint(ref_llama, tmp_path):
    recipe = parse_recipe("stages:\n  - distill: {data: {dataset: calibration/default.txt, seq_len: 64, num_samples: 8, "
                          "eval_samples: 2}, train: {steps: 3, batch_size: 4, lr: 1.0e+30, max_grad_norm: null}}\n", "t")
    with pytest.raises(CompressError, match=r"stage distill: the training loss is (nan|inf) at step [23]"):
        run_recipe(recipe, model=str(ref_llama), output=str(tmp_path / "out"), device="cpu")
    assert not (tmp_path / "out").exists()


def test_zeros_an_input_was_pruned_with_stay_a_mask_after_quantization_here(tiny, repo, tmp_path):
    """A model pruned by another tool (half of every block weight zero, no compress.json): its zeros
    stay a mask through GPTQ then QAT in one run, and through RTN in one run then QAT in the next,
    although the stages here record only the grid they quantized to (the input's zeros are recorded
    as `input_zeros`). Without that, QAT trained the pruned weights off zero (share 0.05 left)."""
    from safetensors.torch import load_file

    model = LlamaForCausalLM.from_pretrained(tiny)
    with torch.no_grad():
        for name, module in model.model.layers.named_modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight
                w[w.abs() <= w.abs().flatten().kthvalue(w.numel() // 2).values] = 0
    pruned = tmp_path / "pruned"
    model.save_pretrained(pruned)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(pruned)
    data = f"{{dataset: {repo}/calibration/default.txt, seq_len: 32, num_samples: 8, eval_samples: 4}}"
    # the trained weights are what is checked, whether or not training improved on the start
    qat = f"  - qat: {{scheme: W4A16, keep_start_if_worse: false, data: {data}, train: {TRAIN % (2, 1e-2)}}}\n"
    cal = f"calibration: {{dataset: {repo}/calibration/default.txt, num_samples: 4, seq_len: 32}}\n"

    def zero_share(out):
        weights = load_file(out / "model.safetensors")
        return min(float((w == 0).float().mean()) for k, w in weights.items() if ".layers." in k and k.endswith("proj.weight"))

    report = run_recipe(parse_recipe(cal + "stages:\n  - gptq: {scheme: W4A16, weights: {group_size: 64}}\n" + qat, "t"),
                        model=str(pruned), output=str(tmp_path / "one"), format="dense")
    assert report["stages"][1]["summary"]["masked_layers"] == 14 and zero_share(tmp_path / "one") >= 0.5
    run_recipe(parse_recipe("stages:\n  - rtn: {scheme: W8A16}\n", "t"), model=str(pruned), output=str(tmp_path / "rtn"))
    teacher = qat.replace("keep_start_if_worse: false,", f"keep_start_if_worse: false, teacher: {pruned},")  # the input is W8
    report = run_recipe(parse_recipe("stages:\n" + teacher, "t"), model=str(tmp_path / "rtn"), output=str(tmp_path / "two"),
                        format="dense")
    assert report["stages"][0]["summary"]["masked_layers"] == 14 and zero_share(tmp_path / "two") >= 0.5


def test_qat_on_a_quantized_input_needs_a_float_teacher(tiny, tmp_path):
    """The default teacher is the input model: a quantized one would teach its own rounding (the
    run reported its KL against the W4 model as if it were the float one). Refused before any
    work, unless a teacher is named or the stage trains on the text alone."""
    w4 = tmp_path / "w4"
    run_recipe(parse_recipe("stages:\n  - rtn: {scheme: W4A16}\n", "t"), model=str(tiny), output=str(w4))
    data = "{dataset: calibration/default.txt, seq_len: 32, num_samples: 4, eval_samples: 2}"
    qat = f"stages:\n  - qat: {{scheme: W4A16, data: {data}, train: {{steps: 1, batch_size: 2}}%s}}\n"
    with pytest.raises(CompressError, match="is quantized, and with no teacher set it would distill from itself"):
        run_recipe(parse_recipe(qat % "", "t"), model=str(w4), output=str(tmp_path / "o1"))
    assert not (tmp_path / "o1").exists()
    report = run_recipe(parse_recipe(qat % f", teacher: {tiny}", "t"), model=str(w4), output=str(tmp_path / "o2"))
    assert report["stages"][0]["summary"]["teacher"] == str(tiny)
    # its error: the W4 input's own against the float model it came from, beside QAT's small change
    # (that change was reported as the layer's error)
    w4_layers = json.loads((w4 / "compress.json").read_text())["layers"]
    for name, rec in report["layers"].items():
        assert rec["relative_error"] == w4_layers[name]["relative_error"] > 0.05
        assert rec["qat_relative_change"] < rec["relative_error"]


def test_qat_error_after_removing_blocks_compares_each_layer_with_its_own_input_layer(tmp_path):
    """Removing block 1 of 3 moves old block 2 to index 1. QAT (a tiny step) after rtn measures
    each layer against its float weights in the input model: old block 2's for the new block 1,
    not old block 1's, so its error is rtn's, not that of two unrelated matrices (~1.4)."""
    tok = AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR)
    torch.manual_seed(0)
    path = tmp_path / "three"
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=128)).save_pretrained(path)
    tok.save_pretrained(path)
    data = "{dataset: calibration/default.txt, seq_len: 32, num_samples: 8, eval_samples: 2}"
    recipe = parse_recipe(f"""
calibration: {{dataset: calibration/default.txt, num_samples: 4, seq_len: 32}}
stages:
  - structured: {{structure: blocks, ratio: 0.34}}
  - rtn: {{scheme: W4A16, weights: {{group_size: 32}}}}
  - qat: {{scheme: W4A16, weights: {{group_size: 32}}, data: {data}, train: {TRAIN % (1, 1e-7)}, keep_start_if_worse: false}}
""", "t")
    report = run_recipe(recipe, model=str(path), output=str(tmp_path / "out"))
    assert report["stages"][0]["summary"]["kept_blocks"] == "2 of 3"
    layers = report["layers"]
    for name, rec in layers.items():
        assert rec["relative_error_against"] == "the input model's weights"
        assert rec["relative_error"] < 0.2 and rec["qat_relative_change"] < 1e-3, name


def test_qat_onto_another_grid_reports_its_own_change_not_the_earlier_grids_error(tiny, tmp_path):
    """rtn W8 then QAT W4 on the text alone (no float model at hand): the layers arrive on W8's grid
    and leave on W4's, so W8's small error no longer describes them; the error reported is QAT's
    change, about W4's error, and says what it is measured against."""
    data = "{dataset: calibration/default.txt, seq_len: 32, num_samples: 8, eval_samples: 2}"
    recipe = parse_recipe(f"""
stages:
  - rtn: {{scheme: W8A16}}
  - qat: {{scheme: W4A16, weights: {{group_size: 32}}, kd_weight: 0, ce_weight: 1, data: {data}, train: {TRAIN % (1, 1e-7)},
          keep_start_if_worse: false}}
""", "t")
    report = run_recipe(recipe, model=str(tiny), output=str(tmp_path / "out"))
    assert report["stages"][0]["summary"]["max_relative_error"] < 0.02  # W8's
    for name, rec in report["layers"].items():
        assert rec["relative_error"] == rec["qat_relative_change"] > 0.05, name
        assert rec["relative_error_against"].startswith("the weights qat received (rtn's, on another grid"), name


def test_training_that_ends_worse_than_it_started_keeps_the_start(tiny, repo, tmp_path):
    """On an 8-bit grid the start loses almost nothing, and AdamW's steps of about lr move weights
    farther than a step of the grid: ref-llama's held-out KD went from 5.5e-6 to 5.2e-4 in 20
    steps at the default lr. Such a run gives back its starting weights and grid, and says so;
    `keep_start_if_worse: false` keeps what training reached, and warns (it once said nothing)."""
    data = f"{{dataset: {repo}/calibration/default.txt, seq_len: 32, num_samples: 16, eval_samples: 4}}"
    source = LlamaForCausalLM.from_pretrained(tiny)
    errors = {}
    for keep in (True, False):
        r = parse_recipe(f"stages:\n  - qat: {{scheme: W8A16, keep_start_if_worse: {str(keep).lower()}, data: {data}, "
                         f"train: {TRAIN % (3, 1e-2)}}}\n", "test")
        out = tmp_path / f"out-{keep}"
        report = run_recipe(r, model=str(tiny), output=str(out), format="dense")
        summary = report["stages"][0]["summary"]
        trained = summary["held_out_kd_trained"] if keep else summary["held_out_kd_after"]
        assert trained > summary["held_out_kd_before"]  # lr 1e-2: training made it worse
        assert (summary["held_out_kd_after"] == summary["held_out_kd_before"]) == keep  # the saved model's
        assert ("kept_start" in summary) == keep
        [warning] = report["warnings"]  # said either way, as distill says it
        assert warning.startswith("stage 1 (qat): the held-out kd is") and warning.endswith(
            "the starting weights and grid are kept; train longer or with a lower lr" if keep else
            "the model got worse; train longer or with a lower lr"), warning
        saved = load_file(out / "model.safetensors")
        name = "model.layers.0.mlp.up_proj"
        w0 = getattr(source.get_submodule(name), "weight").detach()
        errors[keep] = float((saved[name + ".weight"] - w0).norm() / w0.norm())
        if keep:  # round-to-nearest's 8-bit grid, the start, up to float rounding of the same codes
            assert torch.allclose(saved[name + ".weight"], fake_quantize(w0, 8, True, "channel"), rtol=0, atol=1e-6)
        # the embeddings trained too, and came back with the rest
        assert torch.equal(saved["model.embed_tokens.weight"], source.model.embed_tokens.weight.detach()) == keep
    assert errors[True] < 0.2 * errors[False], errors


def test_freeze_names_a_quantized_layer_as_plan_shows_it(tiny, repo, tmp_path):
    """QAT reparametrizes each target's weight (…q_proj.parametrizations.weight.original): a
    freeze pattern names the layer or its weight as before, and that layer's float weights stay
    put (with fixed scales it saves round-to-nearest's grid) while the others train."""
    r = fixed_w4_qat(repo, "      freeze: [layers.0.self_attn.q_proj, layers.1.mlp.up_proj.weight]")
    run_recipe(r, model=str(tiny), output=str(tmp_path / "out"), format="dense")
    source = LlamaForCausalLM.from_pretrained(tiny)
    saved = load_file(tmp_path / "out" / "model.safetensors")
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"):
        before = source.get_submodule(name).weight.detach()
        assert torch.equal(saved[name + ".weight"], fake_quantize(before, 4, True, "channel")), name
    before = source.model.layers[0].self_attn.k_proj.weight.detach()
    assert not torch.equal(saved["model.layers.0.self_attn.k_proj.weight"], fake_quantize(before, 4, True, "channel"))


@pytest.mark.parametrize("stage,scheme", [("qat", "W4A16"), ("qat", "W8A8"), ("distill", None)])
def test_held_out_figure_is_the_saved_models_in_half_precision(stage, scheme, ref_llama, shared, tmp_path):
    """Training runs on float32 copies of a bfloat16 model's weights; the held-out figure after
    training was measured on those, but the checkpoint holds them rounded to bfloat16 (and QAT's
    learned scales rounded up to bfloat16, its codes taken from the rounded weights): 10 steps of
    QAT reported KD 1.650e-3 -> 1.447e-3 and kept the trained weights, while the saved model
    measured 1.779e-3, worse than its start. The figure keep_start_if_worse compares must be the
    saved model's. (W8A8: the training forward rounded each token's activation scale to bfloat16,
    the saved model's quantizer keeps it in float32: 6 % apart at lr 3e-6.)"""
    from compress.training_data import training_sequences

    data = data_keys(shared, n=16, seq=64)
    keys = f"scheme: {scheme}, " if scheme else ""
    recipe = parse_recipe(f"stages:\n  - {stage}: {{{keys}keep_start_if_worse: false, data: {data}, "
                          f"train: {TRAIN % (10, 3e-6 if scheme == 'W8A8' else 1e-4)}}}\n", "t")
    out = tmp_path / "out"
    summary = run_recipe(recipe, model=str(ref_llama), output=str(out), device="cpu", dtype="bfloat16",
                         format="dense")["stages"][0]["summary"]
    teacher, tokenizer, _ = modeling.load_model(str(ref_llama), dtype="float32")
    saved, _, _ = modeling.load_model(str(out), dtype="bfloat16")
    _, held_out, _ = training_sequences(recipe.stages[0][1].data, tokenizer)
    with torch.no_grad():
        p = torch.log_softmax(teacher(input_ids=held_out).logits.double(), -1)
        q = torch.log_softmax(saved.float()(input_ids=held_out).logits.double(), -1)
    kd = float((p.exp() * (p - q)).sum(-1).mean())
    assert kd == pytest.approx(summary["held_out_kd_after"], rel=1e-3), (kd, summary["held_out_kd_before"])


@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16", "FP8_DYNAMIC"])
def test_qat_on_float_grids_trains_through_round_to_nearest_and_packs(scheme, ref_llama, shared, tmp_path):
    """Float grids train with the rtn stage's rounding of the current weights (scales: rtn): the
    held-out KL falls, and the packed checkpoint holds weights that rtn's rounding gives back
    unchanged, at the recorded value a fused group shares (NVFP4's global scale), with FP8
    activations trained through and attached."""
    from compress.stages.rtn import quantize_weight, recorded_shared_scale

    train = "{steps: 16, batch_size: 4, lr: 2e-5, warmup: 0, eval_every: 0, save_every: 0}"
    r = parse_recipe(f"stages:\n  - qat: {{scheme: {scheme}, data: {data_keys(shared)}, train: {train}}}\n", "test")
    report = run_recipe(r, model=str(ref_llama), output=str(tmp_path / "out"))
    s = report["stages"][0]["summary"]
    # FP8_DYNAMIC's error is mostly its rounded inputs', which 16 steps of the weights offset less
    assert s["held_out_kd_after"] < (0.95 if scheme == "FP8_DYNAMIC" else 0.8) * s["held_out_kd_before"], s
    assert report["format"]["format"] == "packed" and s["scheme"].endswith("QAT (rtn scales)")
    layers = json.loads((tmp_path / "out" / "compress.json").read_text())["layers"]
    assert len(layers) == 28 and all(rec["scales"] == "rtn" and rec["qat_init"] == "round-to-nearest" for rec in layers.values())
    loaded, _, _ = modeling.load_model(str(tmp_path / "out"), dtype="float32")
    source, _, _ = modeling.load_model(str(ref_llama), dtype="float32")
    moved = 0
    for name, rec in layers.items():
        args = QuantArgs(**rec["weights"])
        w = modeling.get_weight(loaded.get_submodule(name))
        assert torch.equal(quantize_weight(w, args, recorded_shared_scale(args, rec)), w), name
        moved += not torch.equal(w, quantize_weight(modeling.get_weight(source.get_submodule(name)), args,
                                                    recorded_shared_scale(args, rec)))
        assert ("input_activations" in rec) == (scheme == "FP8_DYNAMIC"), name
    assert moved == len(layers)  # every layer trained off round-to-nearest's rounding of the float model
    if scheme == "NVFP4A16":  # q, k and v share one global scale, as a fused matrix has one
        assert len({layers[f"model.layers.0.self_attn.{p}_proj"]["global_scale"] for p in "qkv"}) == 1


@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP6A16"])
def test_qat_on_a_float_grid_starts_from_gptqs_weights(scheme, ref_llama, shared, tmp_path):
    """After GPTQ at the same float scheme QAT's first forward computes with GPTQ's weights: rtn's
    rounding gives them back, at the global scale GPTQ recorded (from GPTQ's rounded weights it
    would be another, and every NVFP4 layer would start from a re-rounding)."""
    train = "{steps: 1, batch_size: 4, lr: 1e-6, warmup: 0, eval_every: 0, save_every: 0}"
    r = parse_recipe(f"""
calibration: {{dataset: {shared}/data/tinyshakespeare/train.txt, num_samples: 8, seq_len: 64}}
stages:
  - gptq: {{scheme: {scheme}}}
  - qat: {{scheme: {scheme}, data: {data_keys(shared, n=16)}, train: {train}}}
""", "test")
    report = run_recipe(r, model=str(ref_llama), output=str(tmp_path / "out"))
    layers = json.loads((tmp_path / "out" / "compress.json").read_text())["layers"]
    starts = {n: rec["qat_init"] for n, rec in layers.items()}
    moved = sum(int(re.search(r"\((\d+) of", s).group(1)) for s in starts.values() if s != "gptq grid")
    assert all(s == "gptq grid" or s.startswith("round-to-nearest of gptq's weights (") for s in starts.values()), starts
    if scheme == "MXFP6A16":  # an MX block's power-of-two step is the same from GPTQ's rounded weights
        assert moved == 0, starts
    else:  # NVFP4's FP8 group scales: a few groups whose largest code fell below 6 are re-rounded
        assert moved < 5e-3 * sum(math.prod(rec["shape"]) for rec in layers.values()), starts
    assert report["format"]["format"] == "packed"


@pytest.mark.parametrize("scheme", ["MXFP6A16", "MXFP8A16", "MXFP4A16", "NVFP4A16"])
def test_half_precision_ties_are_broken_on_the_side_rtn_chose(scheme):
    """A bfloat16 weight often sits exactly halfway between two MX or FP4 grid points; QAT moves
    its float32 training copy a little towards the point rtn chose, so the start rounds as before
    and no first update, however small, carries the ties across at once."""
    from compress.schemes import resolve_scheme
    from compress.stages.qat import RoundToNearestWeight, break_half_precision_ties

    args = resolve_scheme(scheme, None, None).weights
    weight = (torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    fq = RoundToNearestWeight(weight, args, None, transposed=False)
    latent = weight.float()
    start = fq(latent)
    nudge = torch.full_like(latent, 1e-7)
    ties = (fq(latent + nudge) != fq(latent - nudge)).sum()
    assert ties > 0.01 * latent.numel()  # 1.7 % (MXFP4) to 7.8 % (NVFP4) of these weights sit on a tie
    break_half_precision_ties(latent, fq, torch.Generator().manual_seed(0))
    assert torch.equal(fq(latent), start)
    assert (fq(latent + nudge) != fq(latent - nudge)).sum() < 0.05 * ties
    assert torch.equal(latent.to(torch.bfloat16), weight)  # still within what the bfloat16 value stands for


def test_qat_on_a_bfloat16_model_on_mxfp6_does_not_jump_at_the_first_step(ref_llama, shared, tmp_path):
    """Without the ties broken, the first update raised the training KD 27-fold (1.0e-4 to 2.9e-3)."""
    train = "{steps: 4, batch_size: 4, lr: 2e-5, warmup: 0, eval_every: 1, save_every: 0}"  # a history point per step
    r = parse_recipe(f"stages:\n  - qat: {{scheme: MXFP6A16, keep_start_if_worse: false, data: {data_keys(shared, n=24)}, "
                     f"train: {train}}}\n", "test")
    report = run_recipe(r, model=str(ref_llama), output=str(tmp_path / "out"), dtype="bfloat16")
    history = [h["train_kd"] for h in report["stages"][0]["summary"]["training"]["history"] if "train_kd" in h]
    assert len(history) == 4 and max(history) < 3 * history[0], history
    assert report["format"]["format"] == "packed"
