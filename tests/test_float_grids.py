"""GPTQ, AWQ and SparseGPT's joint quantization on the float grids besides FP4 (tests/test_fp4.py
has GPTQ's and AWQ's FP4): FP8 e4m3 per tensor, per channel and in tiles (FP8_DYNAMIC, FP8,
FP8_BLOCK), MXFP8 and MXFP6. The solvers and the clipping search alone on a layer, then through the
pipeline into packed checkpoints that carry the weights the run evaluated."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from compress import modeling, parse_recipe, run_recipe
from compress.quant import fp8_step, recover_mx_steps, recover_qparams
from compress.schemes import QuantArgs
from compress.stages.awq import clip_search, output_error
from compress.quant import nvfp4_global_scale, recover_fp4_steps
from compress.stages.gptq import gptq_quantize, gptq_quantize_stacked, hessian_loss, stackable
from compress.stages.magnitude import magnitude_prune
from compress.stages.pruning import LayerTarget
from compress.stages.rtn import quantize_weight
from compress.stages.sparsegpt import sparsegpt_prune

from tests.test_gptq import correlated_layer
from tests.test_packed import IDS, ct_decompress, plain_transformers_logits, relative_difference

FP8_TENSOR = QuantArgs(num_bits=8, type="float", strategy="tensor")
FP8_TILES = QuantArgs(num_bits=8, type="float", strategy="block", block_structure=[32, 32])
GRIDS = {
    "fp8 tensor": FP8_TENSOR,
    "fp8 channel": QuantArgs(num_bits=8, type="float", strategy="channel"),
    "fp8 tiles": FP8_TILES,  # 48 rows: the second row of tiles is partial
    "mxfp8": QuantArgs(num_bits=8, type="float", strategy="group", group_size=32, scale_dtype="e8m0"),
    "mxfp6": QuantArgs(num_bits=6, type="float", strategy="group", group_size=32),
}


def groups_off_the_grid(Q: torch.Tensor, args: QuantArgs) -> int:
    """How many of Q's scale groups (rows, tiles, blocks) no storable scale of the format gives
    back exactly: packing's own recovery, which verifies each group bit for bit."""
    if args.byte_block_scales:
        return recover_mx_steps(Q, args.num_bits)[1]
    return recover_qparams(Q, 8, True, args.strategy, float8=True, block_structure=args.block_structure)[2]


@pytest.mark.parametrize("name", list(GRIDS))
@pytest.mark.parametrize("actorder", [False, True])
def test_gptq_beats_round_to_nearest_on_float_grids(name, actorder):
    args = GRIDS[name]
    W, _, H = correlated_layer(in_features=128)
    # act-order with static groups: each group's (tile's, block's) scale fixed from the weight first
    Q, _ = gptq_quantize(W, H, args, block_size=32, actorder=actorder, static_groups=actorder)
    assert hessian_loss(W, Q, H) < 0.5 * hessian_loss(W, quantize_weight(W, args), H)
    # on the grid the format stores: one scale per row, tile or block of 32 reproduces every weight
    assert groups_off_the_grid(Q, args) == 0


def test_per_tensor_fp8_gptq_rounds_at_the_range_its_fused_group_shares():
    """Per-tensor FP8 layers that vLLM fuses (q/k/v) share one scale, from the group's largest
    weight (rtn.global_scales): GPTQ rounds each at that scale, and never stacks them."""
    W, _, H = correlated_layer(in_features=128)
    top = 3 * float(W.abs().max())  # another layer of the group holds the largest weight
    Q, _ = gptq_quantize(W, H, FP8_TENSOR, block_size=32, global_scale=top)
    scale = fp8_step(torch.tensor(top))
    assert torch.equal((Q / scale).to(torch.float8_e4m3fn).float() * scale, Q)
    assert float(Q.abs().max()) <= float(W.abs().max()) * 1.1  # no code near 448: the scale is the group's
    with pytest.raises(ValueError, match="per-tensor scale or an FP8 tile would span two weights"):
        gptq_quantize_stacked([W[:16], W[16:]], H, FP8_TENSOR, global_scales=[top, top])


def test_fp8_tiles_stack_only_whole_tiles():
    """Weights that share a Hessian are solved stacked only when no tile would span two of them;
    stacked, each is what it would be alone (up to float reassociation)."""
    W, _, H = correlated_layer(out_features=96, in_features=128)
    assert stackable(FP8_TILES, [64, 32]) and not stackable(FP8_TILES, [48, 48]) and not stackable(FP8_TENSOR, [64])
    parts = [W[:64], W[64:]]
    Qs, _ = gptq_quantize_stacked(parts, H, FP8_TILES, block_size=32)
    for Q, part in zip(Qs, parts):
        alone, _ = gptq_quantize(part, H, FP8_TILES, block_size=32)
        assert torch.allclose(Q, alone, rtol=0, atol=1e-6 * float(part.abs().max()))
        assert groups_off_the_grid(Q, FP8_TILES) == 0
    with pytest.raises(ValueError, match="FP8 tile would span two weights"):
        gptq_quantize_stacked([W[:48], W[48:]], H, FP8_TILES, block_size=32)


def test_fp8_scales_are_recovered_when_a_rows_extreme_stops_short_of_448():
    """GPTQ fixes a row's FP8 scale from the weight before its updates, which may leave the row's
    largest code below 448: packing still finds a scale that gives back every weight."""
    g = torch.Generator().manual_seed(0)
    codes = (torch.randn(8, 64, generator=g) * 60).clamp(-400, 400).to(torch.float8_e4m3fn).float()  # at most 384
    W = codes * (torch.rand(8, 1, generator=g) * 0.01 + 1e-3)
    scale, _, failed = recover_qparams(W, 8, True, "channel", float8=True)
    assert failed == 0
    assert torch.equal((W / scale).to(torch.float8_e4m3fn).float() * scale, W)


@pytest.mark.parametrize("name", ["fp8 channel", "mxfp8", "mxfp6"])
def test_awq_clip_search_on_float_grids_never_loses_to_round_to_nearest(name):
    from tests.test_smoothing import outlier_layer

    args = GRIDS[name]
    X, W = outlier_layer(tokens=256)
    Q, ratio = clip_search(X, W, args)
    assert output_error(X, W, Q) <= output_error(X, W, quantize_weight(W, args))
    assert groups_off_the_grid(Q, args) == 0  # still storable


NVFP4 = QuantArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16)


@pytest.mark.parametrize("name", ["fp8 tensor", "fp8 channel", "fp8 tiles", "mxfp8", "mxfp6", "nvfp4"])
def test_sparsegpt_joint_quantization_on_float_grids(name):
    """SparseGPT 2:4 with joint quantization on each float grid: every 4 consecutive weights of a
    row hold at least 2 zeros, the kept ones lie on the grid the format stores, and the loss is
    below magnitude 2:4 then round-to-nearest on the same Hessian."""
    args = NVFP4 if name == "nvfp4" else GRIDS[name]
    W, _, H = correlated_layer(in_features=128)
    g = nvfp4_global_scale(W.abs().amax()) if name == "nvfp4" else None
    target = LayerTarget(0.5, (2, 4))
    Q, _ = sparsegpt_prune(W, H, target, block_size=32, quant=args, global_scale=g)
    assert bool(((Q.reshape(Q.shape[0], -1, 4) == 0).sum(-1) >= 2).all())
    baseline = quantize_weight(magnitude_prune(W, target), args, g)
    assert hessian_loss(W, Q, H) < hessian_loss(W, baseline, H)
    if name == "nvfp4":
        assert recover_fp4_steps(Q, 16, g)[1] == 0
    else:
        assert groups_off_the_grid(Q, args) == 0


# ---------------------------------------------------------------------------------------------
# Through the pipeline


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=2048)).eval()
    path = tmp_path_factory.mktemp("tiny") / "llama"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
    return path


def gptq_float(path, out, stage: str, dtype: str, fmt: str | None = None) -> dict:
    recipe = parse_recipe(f"model: {path}\ncalibration: {{dataset: calibration/default.txt, num_samples: 8, seq_len: 64}}\n"
                          f"stages:\n  - gptq: {stage}\n", "test")
    return run_recipe(recipe, output=str(out), device="cpu", dtype=dtype, format=fmt)


@pytest.mark.parametrize("scheme,stage,dtype,fmt", [
    ("FP8_DYNAMIC", "{scheme: FP8_DYNAMIC}", "bfloat16", "float-quantized"),
    ("FP8", "{scheme: FP8}", "float32", "float-quantized"),  # per tensor, static inputs
    # 32x48 tiles: 64 and 96 columns end in partial tiles, and q (64 rows) and k/v (32) stack
    ("FP8_BLOCK", "{scheme: FP8_BLOCK, weights: {block_structure: [32, 48]}, input_activations: {group_size: 32}}",
     "bfloat16", "float-quantized"),
    ("MXFP8A16", "{scheme: MXFP8A16}", "bfloat16", "mxfp8-quantized"),
    ("MXFP6A16", "{scheme: MXFP6A16, actorder: false}", "bfloat16", "mxfp6-pack-quantized"),
])
def test_gptq_float_checkpoints_carry_the_evaluated_weights(tiny, tmp_path, scheme, stage, dtype, fmt):
    """Every layer's GPTQ loss is below round-to-nearest's on its inputs; the checkpoint is the
    library's format, compressed-tensors decompresses it to the weights the run evaluated (the
    dense output of the same run) and compress reloads them to the same logits; per-tensor FP8's
    fused parts share one scale; plain transformers runs the weight-only MX ones to our logits."""
    report = gptq_float(tiny, tmp_path / "packed", stage, dtype)
    assert report["format"]["format"] == "packed" and report["format"]["compressed_tensors_format"] == fmt
    assert len(report["layers"]) == 14
    for name, rec in report["layers"].items():
        assert rec["gptq_loss"] < rec["rtn_loss"], name
    gptq_float(tiny, tmp_path / "dense", stage, dtype, fmt="dense")
    evaluated = dict(modeling.load_model(str(tmp_path / "dense"), dtype=dtype)[0].named_parameters())
    original = dict(modeling.load_model(str(tiny), dtype=dtype)[0].named_parameters())
    reloaded = modeling.load_model(str(tmp_path / "packed"), dtype=dtype)[0]
    decompressed = ct_decompress(tmp_path / "packed")
    assert len(decompressed) == 14
    for name, weight in decompressed.items():
        W = evaluated[f"{name}.weight"]
        assert not torch.equal(W, original[f"{name}.weight"]), name
        assert torch.equal(weight.to(W.dtype), W), name
        assert torch.equal(dict(reloaded.named_parameters())[f"{name}.weight"], W), name
    with torch.no_grad():
        ours = reloaded(input_ids=IDS).logits
        assert torch.equal(modeling.load_model(str(tmp_path / "dense"), dtype=dtype)[0](input_ids=IDS).logits, ours)
    if scheme == "FP8":
        with safe_open(str(tmp_path / "packed" / "model.safetensors"), framework="pt") as f:
            for block in range(2):
                qkv = [f.get_tensor(f"model.layers.{block}.self_attn.{p}_proj.weight_scale") for p in "qkv"]
                assert all(torch.equal(s, qkv[0]) for s in qkv)
    if scheme.startswith("MX"):  # weights only, in bfloat16: what plain transformers runs
        assert relative_difference(ours, plain_transformers_logits(tmp_path / "packed", tmp_path)) <= 1e-3
    config = json.loads((tmp_path / "packed" / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["format"] == fmt


def test_fp8_tiles_with_actorder_group_are_written_dense_as_the_plan_says(tiny, tmp_path):
    """actorder: group chooses a tile's scale when act-order reaches its first column, so a tile's
    columns carry several scales, which the format cannot store: the plan says dense, and the
    run writes dense naming why, as for integer groups."""
    from compress.plan import make_plan

    stage = "{scheme: FP8_BLOCK, weights: {block_structure: [32, 48]}, input_activations: {group_size: 32}, actorder: group}"
    recipe = parse_recipe(f"model: {tiny}\ncalibration: {{dataset: calibration/default.txt, num_samples: 8, seq_len: 64}}\n"
                          f"stages:\n  - gptq: {stage}\n", "test")
    assert make_plan(recipe, str(tiny))["format"] == "dense"
    report = gptq_float(tiny, tmp_path / "o", stage, "float32")
    assert report["format"]["format"] == "dense"
    assert "GPTQ chose its group scales as act-order reached the columns (actorder: group)" in report["format"]["reason"]


@pytest.mark.parametrize("scheme,fmt", [("MXFP6A16", "mxfp6-pack-quantized"), ("MXFP8A16", "mxfp8-quantized")])
def test_awq_on_mx_grids_then_gptq(tmp_path, scheme, fmt):
    """AWQ's scale search and clipping on an MX grid, packed; and AWQ's scales then GPTQ on it."""
    from tests.test_smoothing import SMOOTHING_FAMILIES, save

    torch.manual_seed(0)
    save(SMOOTHING_FAMILIES["llama-mha"]().eval(), tmp_path / "in")
    calib = "calibration: {dataset: calibration/default.txt, num_samples: 8, seq_len: 64}\n"
    report = run_recipe(parse_recipe(f"model: {tmp_path / 'in'}\n{calib}stages:\n  - awq: {{scheme: {scheme}, grid: 5}}\n",
                                     "test"), output=str(tmp_path / "awq"), device="cpu", dtype="bfloat16")
    assert report["format"]["compressed_tensors_format"] == fmt
    searched = [r for r in report["layers"].values() if "awq_alpha" in r]
    assert searched and all(r["awq_block_error"] <= r["awq_rtn_block_error"] for r in searched)
    summary = report["stages"][0]["summary"]
    assert summary["mean_output_error"] < summary["mean_rtn_output_error"]
    chained = run_recipe(parse_recipe(f"model: {tmp_path / 'in'}\n{calib}stages:\n"
                                      f"  - awq: {{scheme: {scheme}, grid: 5, quantize: false}}\n  - gptq: {{scheme: {scheme}}}\n",
                                      "test"), output=str(tmp_path / "chain"), device="cpu", dtype="bfloat16")
    assert chained["format"]["compressed_tensors_format"] == fmt
    assert all(r["stage"] == "gptq" and r["gptq_loss"] < r["rtn_loss"] for r in chained["layers"].values())


@pytest.mark.parametrize("joint,fmt", [
    ("{scheme: MXFP6A16}", "mxfp6-pack-quantized"),
    ("{scheme: NVFP4A16}", "nvfp4-pack-quantized"),
    # FP8 tiles, weights only (joint quantization is weight-only: inputs are a later stage's)
    ("{scheme: W8A16, weights: {type: float, strategy: block, block_structure: [32, 48]}}", "naive-quantized"),
])
def test_sparsegpt_2_4_with_joint_float_quantization_packs_with_its_pattern(tiny, tmp_path, joint, fmt):
    """`sparsegpt: {pattern: "2:4", quantize: {...}}` on a float grid: every layer beats magnitude
    then round-to-nearest, the checkpoint is the library's format, and what compressed-tensors
    decompresses holds the 2:4 pattern and is what compress reloads."""
    recipe = parse_recipe(f"model: {tiny}\ncalibration: {{dataset: calibration/default.txt, num_samples: 8, seq_len: 64}}\n"
                          f"stages:\n  - sparsegpt: {{pattern: \"2:4\", quantize: {joint}}}\n", "test")
    report = run_recipe(recipe, output=str(tmp_path / "o"), device="cpu", dtype="bfloat16")
    assert report["format"]["format"] == "packed" and report["format"]["compressed_tensors_format"] == fmt
    for name, rec in report["layers"].items():
        assert rec["sparsegpt_loss"] < rec["magnitude_loss"], name
    reloaded = dict(modeling.load_model(str(tmp_path / "o"), dtype="bfloat16")[0].named_parameters())
    decompressed = ct_decompress(tmp_path / "o")
    assert len(decompressed) == 14
    for name, weight in decompressed.items():
        assert bool(((weight.reshape(weight.shape[0], -1, 4) == 0).sum(-1) >= 2).all()), name
        assert torch.equal(weight.to(torch.bfloat16), reloaded[f"{name}.weight"]), name


def test_tiles_larger_than_a_layer_cover_it_whole_and_the_checkpoint_is_dense_as_planned(tiny, tmp_path):
    """A tile taller or wider than a layer is the layer: compress rounds it as one tile without
    padding it (a [100000, 100000] tile asked 40 GB of a 64x64 layer and stopped the run with an
    internal error); compressed-tensors would pad it to pack it, so the checkpoint is dense, the
    plan says so first, and the reason names the layer and what to change."""
    from compress.plan import make_plan
    from compress.quant import fake_quantize_fp8

    W = torch.randn(64, 96)
    whole = fake_quantize_fp8(W, "block", block_structure=[100000, 100000])
    assert torch.equal(whole, fake_quantize_fp8(W, "block", block_structure=[64, 96]))
    scale, _, failed = recover_qparams(whole, 8, True, "block", float8=True, block_structure=[100000, 100000])
    assert failed == 0 and scale.shape == (1, 1)
    stage = "{scheme: FP8_BLOCK, weights: {block_structure: [100000, 100000]}, input_activations: {group_size: 32}}"
    recipe = parse_recipe(f"model: {tiny}\ncalibration: {{dataset: calibration/default.txt, num_samples: 8, seq_len: 64}}\n"
                          f"stages:\n  - gptq: {stage}\n", "test")
    why = "weight compressed-tensors would pad to whole 100000x100000 tiles (10,000,000,000 values) to pack it"
    plan = make_plan(recipe, str(tiny))
    assert plan["format"] == "dense" and why in plan["format_reason"]
    report = gptq_float(tiny, tmp_path / "o", stage, "float32")
    assert report["format"]["format"] == "dense" and why in report["format"]["reason"]
    assert all(rec["gptq_loss"] < rec["rtn_loss"] for rec in report["layers"].values())


def test_the_plans_note_on_mx_checkpoints_follows_the_dtype_asked_for(tiny):
    """Plain transformers cannot run MX layers of a float32 model: the plan says so for the tiny
    float32 model as it is, and not when --dtype bfloat16 saves it in bfloat16 (it read the dtype
    on disk)."""
    from compress.plan import make_plan

    recipe = parse_recipe(f"model: {tiny}\ncalibration: {{dataset: calibration/default.txt, num_samples: 8, seq_len: 64}}\n"
                          "stages:\n  - gptq: {scheme: MXFP6A16}\n", "test")
    note = "cannot run MXFP6 layers of a float32 model"
    assert note in make_plan(recipe, str(tiny))["format_reason"]
    assert "plain transformers" not in make_plan(recipe, str(tiny), dtype="bfloat16")["format_reason"]
