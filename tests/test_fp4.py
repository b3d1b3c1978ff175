"""FP4 (NVFP4 and MXFP4): the E2M1 grid, block scales, GPTQ on the FP4 grid, packed checkpoints
that compressed-tensors and plain transformers read back to the evaluated weights, and W4A4
activations as compressed-tensors' own quantized forward computes them."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from compress import modeling, parse_recipe, run_recipe
from compress.errors import CompressError
from compress.packing import pack_layer
from compress.pipeline import evaluate_model
from compress.quant import (FP4_E2M1_VALUES, FP8_E4M3_MAX, fake_quantize, fake_quantize_fp4, fp4_steps, nvfp4_global_scale,
                            recover_fp4_steps, round_to_fp4)
from compress.schemes import QuantArgs, resolve_scheme
from compress.stages.awq import clip_search, output_error
from compress.stages.gptq import gptq_quantize, gptq_quantize_stacked, hessian_loss
from compress.stages.rtn import quantize_weight
from compress.targets import fused_groups

from tests.test_gptq import correlated_layer
from tests.test_packed import IDS, ct_decompress, plain_transformers_logits, relative_difference

NV = QuantArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16)
MX = QuantArgs(num_bits=4, type="float", strategy="group", group_size=32)
GRID = torch.tensor(FP4_E2M1_VALUES)
HELD = "calibration/heldout-tinyshakespeare.txt"


# ---------------------------------------------------------------------------------------------
# The E2M1 grid and the block scales


def test_round_to_fp4_nearest_value_ties_to_even_saturating():
    values = torch.cat([GRID, -GRID])
    assert torch.equal(round_to_fp4(values), values)  # every grid value is its own rounding
    # midpoints go to the neighbour whose mantissa bit is 0: 0, 1, 1, 2, 2, 4, 4
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert round_to_fp4(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert round_to_fp4(-ties).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    assert round_to_fp4(torch.tensor([5.01, 6.9, 1e6, -50.0])).tolist() == [6.0, 6.0, 6.0, -6.0]
    assert round_to_fp4(torch.tensor([float("inf"), -float("inf"), float("nan")])).tolist() == [6.0, -6.0, 0.0]
    # off the midpoints, the nearest value, by brute force over the grid
    x = torch.randn(10_000) * 3
    x = x[(x.abs().unsqueeze(1) - ties).abs().min(1).values > 1e-4]
    nearest = GRID[(x.abs().clamp(max=6).unsqueeze(1) - GRID).abs().argmin(1)] * x.sign()
    assert torch.equal(round_to_fp4(x), nearest)


def test_round_to_fp4_is_nearest_ties_to_even_across_float32():
    """Against brute force over the grid in float64, on every 997th float32 bit pattern (subnormals
    to the largest finite) and each midpoint with its two float32 neighbours: the rounding reads
    the binade off the exponent bits, so this covers every exponent."""
    bits = torch.arange(0, 0x7F800000, 997, dtype=torch.int64).to(torch.int32)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([bits.view(torch.float32), ties, torch.nextafter(ties, torch.zeros(7)), torch.nextafter(ties, torch.full((7,), 9.0))])
    distance = (x.double().clamp(max=7).unsqueeze(1) - GRID.double()).abs()  # beyond 6: saturates
    nearest = distance == distance.min(1, keepdim=True).values
    # of two equidistant values, the one with mantissa bit 0: 0, 1, 2, 4 (even positions in GRID)
    even = torch.arange(len(GRID)) % 2 == 0
    index = torch.where((nearest & even).any(1), (nearest & even).int().argmax(1), nearest.int().argmax(1))
    assert torch.equal(round_to_fp4(x), GRID[index])
    assert torch.equal(round_to_fp4(-x), -GRID[index])


def test_round_to_fp4_agrees_with_compressed_tensors():
    cast = pytest.importorskip("compressed_tensors.quantization.utils.fp4_utils").cast_to_fp4
    x = torch.cat([torch.linspace(-7, 7, 56 * 8 + 1), torch.randn(5000) * 2])  # every midpoint, exactly
    assert torch.equal(round_to_fp4(x), cast(x.clone()))


def test_layers_fed_one_tensor_round_it_once_to_what_each_would_alone(monkeypatch):
    """q/k/v (gate/up) read one tensor: an equal hook reuses the rounding the first one made; a
    hook with another range, or an input changed in place, rounds anew."""
    from compress import activations
    from compress.schemes import PRESETS, QuantArgs
    from compress.quant import nvfp4_input_global_scale

    args = QuantArgs(**PRESETS["NVFP4"]["input_activations"])
    torch.manual_seed(0)
    q, k, v = (torch.nn.Linear(64, 32) for _ in range(3))
    x = torch.randn(8, 64) * 3
    for layer, rng in ((q, (-9.0, 9.0)), (k, (-9.0, 9.0)), (v, (-4.0, 4.0))):
        activations.attach(layer, args, rng)
    rounded = []
    real = activations.ActivationFakeQuant._fake_quantize

    def counting(self, inputs):
        rounded.append(self.static_range)
        return real(self, inputs)

    monkeypatch.setattr(activations.ActivationFakeQuant, "_fake_quantize", counting)
    with torch.no_grad():
        outs = [layer(x) for layer in (q, k, v)]
        assert rounded == [(-9.0, 9.0), (-4.0, 4.0)]  # k reused q's rounding; v's range differs
        for layer, out, g in ((q, outs[0], 9.0), (k, outs[1], 9.0), (v, outs[2], 4.0)):
            alone = fake_quantize_fp4(x, 16, nvfp4_input_global_scale(g), activations=True)
            assert torch.equal(out, torch.nn.functional.linear(alone, layer.weight, layer.bias))
        x.mul_(2)  # same tensor, new values
        assert torch.equal(k(x), torch.nn.functional.linear(
            fake_quantize_fp4(x, 16, nvfp4_input_global_scale(9.0), activations=True), k.weight, k.bias))
        assert len(rounded) == 3
    with torch.inference_mode():  # tensors without a version counter: each layer rounds for itself
        y = torch.randn(8, 64) * 3
        for layer, g in ((q, 9.0), (k, 9.0), (v, 4.0)):
            alone = fake_quantize_fp4(y, 16, nvfp4_input_global_scale(g), activations=True)
            assert torch.equal(layer(y), torch.nn.functional.linear(alone, layer.weight, layer.bias))
        assert len(rounded) == 6


def test_shared_rounding_is_not_reused_with_gradients_or_across_other_scales():
    """A graph is not shared between calls (a second backward would find it freed), and hooks
    holding another tool's scales reuse a rounding only with the very same scales."""
    from compress import activations
    from compress.quant import QParams
    from compress.schemes import PRESETS, QuantArgs

    torch.manual_seed(0)
    a8 = QuantArgs(**PRESETS["W8A8"]["input_activations"])
    q, k = torch.nn.Linear(64, 8), torch.nn.Linear(64, 8)
    for layer in (q, k):
        activations.attach(layer, a8)
    x = torch.randn(4, 64, requires_grad=True)
    for _ in range(2):
        (q(x).sum() + k(x).sum()).backward()
    static = QuantArgs(**{**PRESETS["W8A8"]["input_activations"], "strategy": "tensor", "dynamic": False})
    coarse = QParams(torch.tensor([[0.5]]), torch.zeros(1, 1), -127, 127)
    fine = QParams(torch.tensor([[0.01]]), torch.zeros(1, 1), -127, 127)
    activations.attach(q, static, static_qparams=coarse)
    activations.attach(k, static, static_qparams=fine)
    with torch.no_grad():
        y = torch.randn(4, 64)
        q(y)
        expect = torch.nn.functional.linear(fake_quantize(y, 8, True, "tensor", qparams=fine), k.weight, k.bias)
        assert torch.equal(k(y), expect)


def test_nvfp4_global_scale_is_the_largest_power_of_two_that_fits_e4m3():
    for absmax in (1e-4, 0.0371, 0.5, 1.0, 3.0, 448 * 6.0, 1e5):
        g = nvfp4_global_scale(torch.tensor(absmax))
        assert torch.frexp(torch.tensor(g))[0] == 0.5  # a power of two
        assert absmax * g / 6 <= FP8_E4M3_MAX < 2 * absmax * g / 6
    assert nvfp4_global_scale(torch.tensor(0.0)) == 1.0


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_fake_quantization_error_bounds_and_storable_steps(fmt):
    torch.manual_seed(0)
    W = torch.randn(64, 256) * torch.logspace(-3, 1, 256)  # blocks of very different ranges
    group = 16 if fmt == "nvfp4" else 32
    g = nvfp4_global_scale(W.abs().amax()) if fmt == "nvfp4" else None
    Q = fake_quantize_fp4(W, group, g)
    blocks, qblocks = W.reshape(64, -1, group), Q.reshape(64, -1, group)
    top = blocks.abs().amax(-1, keepdim=True)
    step = fp4_steps(top, g)
    codes = qblocks / step
    assert torch.isin(codes.abs(), GRID).all()  # every element is an E2M1 value times its block's step
    if fmt == "nvfp4":
        s8 = step * g
        assert torch.equal(s8.to(torch.float8_e4m3fn).float(), s8)  # the block scale is an e4m3 value
        assert (top / step <= 6 * (1 + 2**-4)).all()  # the extreme saturates by at most e4m3's half step
    else:
        assert (torch.frexp(step)[0] == 0.5).all()  # a power of two (e8m0)
        assert ((top / step < 7) & (top / step >= 3.5)).all()  # neither saturated by a step, nor coarser than needed
    # no element is off by more than its step (half of the widest gap, 4 -> 6), saturation included
    assert ((blocks - qblocks).abs() <= step).all()
    # the products are exact in bfloat16: a bfloat16 model holds the evaluated weights exactly
    assert torch.equal(Q.to(torch.bfloat16).float(), Q)
    steps, failed = recover_fp4_steps(Q, group, g)
    assert failed == 0 and torch.equal(steps, step.squeeze(-1))
    # error against int4 with the same block size: same order (FP4 spends codes on small values)
    int4 = fake_quantize(W, 4, True, "group", group)
    assert 0.5 < float((W - Q).norm() / (W - int4).norm()) < 2.0


def test_recovery_refuses_weights_off_the_grid():
    torch.manual_seed(0)
    W = torch.randn(8, 32)
    g = nvfp4_global_scale(W.abs().amax())
    Q = fake_quantize_fp4(W, 16, g)
    Q[3, 5] += 1e-3
    assert recover_fp4_steps(Q, 16, g)[1] == 1
    assert recover_fp4_steps(W, 32, None)[1] == 8


def test_scheme_validation_names_the_fix():
    assert resolve_scheme("NVFP4A16", None, None).weights == NV
    assert resolve_scheme("MXFP4A16", None, None).weights == MX
    for fields, words in [({"strategy": "tensor_group", "group_size": 32}, "set group_size: 16"),
                          ({"strategy": "group", "group_size": 16}, "set group_size: 32"),
                          ({"strategy": "tensor_group", "group_size": 16, "symmetric": False}, "symmetric: true"),
                          ({"strategy": "channel"}, "FP4 quantizes in blocks")]:
        with pytest.raises(ValueError, match=words):
            QuantArgs(num_bits=4, type="float", **fields)
    with pytest.raises(ValueError, match="tensor_group is NVFP4's"):
        QuantArgs(num_bits=4, strategy="tensor_group", group_size=16)


# ---------------------------------------------------------------------------------------------
# GPTQ on the FP4 grid


@pytest.mark.parametrize("args", [NV, MX])
@pytest.mark.parametrize("actorder", [False, True])
def test_gptq_beats_round_to_nearest_on_fp4(args, actorder):
    W, X, H = correlated_layer(in_features=128)
    g = nvfp4_global_scale(W.abs().amax()) if args.fp4_format == "nvfp4" else None
    # act-order with static groups: blocks stay contiguous, which the format (no g_idx) needs
    Q, _ = gptq_quantize(W, H, args, block_size=32, actorder=actorder, static_groups=actorder, global_scale=g)
    rtn = quantize_weight(W, args, g)
    assert hessian_loss(W, Q, H) < 0.5 * hessian_loss(W, rtn, H)
    # still on the grid the format stores: every block recovers exactly, at the same global scale
    assert recover_fp4_steps(Q, args.group_size, g)[1] == 0


def test_stacked_fp4_gptq_keeps_each_weights_global_scale():
    W, _, H = correlated_layer(in_features=128)
    parts = [W[:16], W[16:] * 40]  # two layers with ranges 40x apart, solved as one
    scales = [nvfp4_global_scale(p.abs().amax()) for p in parts]
    assert scales[0] != scales[1]
    Qs, _ = gptq_quantize_stacked(parts, H, NV, None, scales, block_size=32)
    for Q, single, g in zip(Qs, parts, scales):
        alone, _ = gptq_quantize(single, H, NV, block_size=32, global_scale=g)
        assert torch.allclose(Q, alone, rtol=0, atol=1e-6 * float(single.abs().max()))
        assert recover_fp4_steps(Q, 16, g)[1] == 0


def test_fused_groups_are_the_layers_engines_fuse():
    names = ["m.0.attn.q_proj", "m.0.attn.k_proj", "m.0.attn.v_proj", "m.0.attn.o_proj", "m.0.mlp.gate_proj",
             "m.0.mlp.up_proj", "m.0.mlp.down_proj", "m.1.attn.q_proj", "e.0.w1", "e.0.w2", "e.0.w3",
             "b.self.query", "b.self.key", "b.self.value"]
    assert fused_groups(names) == [names[0:3], [names[3]], names[4:6], [names[6]], [names[7]], ["e.0.w1", "e.0.w3"],
                                   ["e.0.w2"], names[11:14]]


# ---------------------------------------------------------------------------------------------
# Through the pipeline: packed checkpoints


def fp4_recipe(stage: str, scheme: str, dtype_extra: str = "") -> object:
    calib = "calibration: {dataset: calibration/default.txt, num_samples: 8, seq_len: 64}\n" if stage == "gptq" else ""
    return parse_recipe(f"model: default\n{calib}stages:\n  - {stage}: {{scheme: {scheme}}}\n{dtype_extra}", "test")


@pytest.fixture(scope="module")
def nvfp4_gptq(tmp_path_factory):
    out = tmp_path_factory.mktemp("nvfp4") / "gptq"
    report = run_recipe(fp4_recipe("gptq", "NVFP4A16"), output=str(out), device="cpu")
    return out, report


def test_nvfp4_gptq_checkpoint_layout_and_fused_global_scales(nvfp4_gptq):
    out, report = nvfp4_gptq
    assert report["format"]["compressed_tensors_format"] == "nvfp4-pack-quantized"
    layers = report["layers"]
    assert len(layers) == 28
    for name, rec in layers.items():
        assert rec["gptq_loss"] < rec["rtn_loss"], name
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        q = "model.layers.0.self_attn.q_proj"
        assert f.get_slice(f"{q}.weight_packed").get_dtype() == "U8"
        assert f.get_slice(f"{q}.weight_packed").get_shape() == [256, 128]  # two codes a byte
        assert f.get_slice(f"{q}.weight_scale").get_dtype() == "F8_E4M3"
        assert f.get_slice(f"{q}.weight_scale").get_shape() == [256, 16]
        assert f"{q}.weight" not in keys
        g = {n: float(f.get_tensor(f"{n}.weight_global_scale")) for n in layers}
    for block in range(4):
        p = f"model.layers.{block}."
        qkv = {g[p + f"self_attn.{x}_proj"] for x in "qkv"}
        gate_up = {g[p + "mlp.gate_proj"], g[p + "mlp.up_proj"]}
        assert len(qkv) == 1 and len(gate_up) == 1  # one per fused matrix, as vLLM needs
        assert qkv.pop() == layers[p + "self_attn.q_proj"]["global_scale"]


def test_nvfp4_checkpoint_decompresses_and_loads_to_the_evaluated_weights(nvfp4_gptq, tmp_path):
    out, report = nvfp4_gptq
    loaded, _, _ = modeling.load_model(str(out))
    modules = dict(loaded.named_modules())
    decompressed = ct_decompress(out)
    assert len(decompressed) == 28
    for name, weight in decompressed.items():
        assert torch.equal(weight.to(modules[name].weight.dtype), modules[name].weight), name
    with torch.no_grad():
        ours = loaded(input_ids=IDS).logits
    assert relative_difference(ours, plain_transformers_logits(out, tmp_path)) <= 1e-4


def test_mxfp4_rtn_packs_e8m0_scales_exactly(tmp_path):
    out = tmp_path / "mx"
    report = run_recipe(fp4_recipe("rtn", "MXFP4A16"), output=str(out), device="cpu", dtype="float32")
    assert report["format"]["compressed_tensors_format"] == "mxfp4-pack-quantized"
    loaded, _, _ = modeling.load_model(str(out))
    modules = dict(loaded.named_modules())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        scale = f.get_tensor("model.layers.1.mlp.down_proj.weight_scale")
        assert scale.dtype == torch.uint8 and list(scale.shape) == [256, 640 // 32]
        assert not any(k.endswith("weight_global_scale") for k in f.keys())
    weight = modules["model.layers.1.mlp.down_proj"].weight
    step = torch.exp2(scale.float() - 127)  # e8m0: a biased exponent
    codes = weight.reshape(256, -1, 32) / step.unsqueeze(-1)
    assert torch.isin(codes.abs(), GRID).all()
    for name, w in ct_decompress(out).items():
        assert torch.equal(w.to(modules[name].weight.dtype), modules[name].weight), name


def test_fp4_layer_changed_after_quantization_is_not_packed():
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 8, bias=False)
    with torch.no_grad():
        layer.weight.copy_(quantize_weight(layer.weight, NV))
        layer.weight[0, 0] += 1e-3
    rec = {"weights": NV.model_dump(mode="json")}
    with pytest.raises(CompressError, match="not on an FP4 grid"):
        pack_layer("proj", layer, rec)


def test_qat_takes_fp4_weights_with_round_to_nearest_scales_only():
    """FP4's block scales follow the weights (tests/test_qat.py trains through them); LSQ's learned
    or fixed step sizes are for integer grids."""
    head = "model: default\ncalibration: {dataset: calibration/default.txt}\nstages:\n  - qat: "
    recipe = parse_recipe(head + "{scheme: NVFP4A16}\n", "test")
    assert recipe.stages[0][1].scale_mode == "rtn"
    with pytest.raises(Exception, match="use scales: rtn"):
        parse_recipe(head + "{scheme: NVFP4A16, scales: learned}\n", "test")


# ---------------------------------------------------------------------------------------------
# W4A4: FP4 activations (NVFP4, MXFP4)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_activations_match_compressed_tensors_fake_quantization(fmt):
    """The inputs compress evaluates with are the ones compressed-tensors' own quantized forward
    computes (block scales from each token's values; NVFP4 under the calibrated global scale)."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    from compress.quant import nvfp4_input_global_scale

    torch.manual_seed(0)
    x = (torch.randn(64, 256) * torch.logspace(-2, 1, 256)).to(torch.bfloat16).float()  # as a bf16 model's inputs
    x[0, :32] = torch.tensor([1.75] + [0.3] * 31)  # a block whose largest is 7 · 2^-2: MXFP4's step edge
    x[1, 0], x[1, 16:32] = 1000.0, 0.002  # beside an outlier, a block whose NVFP4 scale underflows e4m3
    nv = fmt == "nvfp4"
    dtype = torch.float8_e4m3fn if nv else torch.uint8
    args = ct.QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group" if nv else "group",
                               group_size=16 if nv else 32, dynamic="local" if nv else True, scale_dtype=dtype, zp_dtype=dtype)
    g = nvfp4_input_global_scale(float(x.abs().max())) if nv else None
    g_tensor = torch.tensor([g]) if nv else None
    scale, zero = compute_dynamic_scales_and_zp(x, args, module=None, global_scale=g_tensor)
    theirs = ct_fake_quantize(x=x, scale=scale, zero_point=zero, args=args, global_scale=g_tensor)
    assert torch.equal(fake_quantize_fp4(x, args.group_size, g, activations=True), theirs)


def w4a4_recipe(scheme: str) -> object:
    return parse_recipe("model: default\ncalibration: {dataset: calibration/default.txt, num_samples: 8, seq_len: 64}\n"
                        f"stages:\n  - rtn: {{scheme: {scheme}}}\n"
                        "evaluation: {datasets: [calibration/heldout-tinyshakespeare.txt], max_windows: 8, seq_len: 128}\n", "test")


def test_nvfp4_w4a4_checkpoint_records_input_global_scales_and_reloads_as_evaluated(tmp_path):
    out = tmp_path / "w4a4"
    report = run_recipe(w4a4_recipe("NVFP4"), output=str(out), device="cpu")
    raw = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = raw["config_groups"].values()
    assert group["input_activations"]["dynamic"] == "local" and group["input_activations"]["strategy"] == "tensor_group"
    layers = report["layers"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        g = {n: float(f.get_tensor(f"{n}.input_global_scale")) for n in layers}
    for name, rec in layers.items():
        lo, hi = rec["activation_range"]
        assert g[name] == pytest.approx(448 * 6 / max(-lo, hi), rel=1e-6)
    p = "model.layers.2."
    assert len({g[p + f"self_attn.{x}_proj"] for x in "qkv"}) == 1  # one input, one scale
    in_run = report["evaluation"][HELD]["token_perplexity"]
    # weights alone (the same weights, W4A16) evaluate differently: the activations are simulated
    a16 = run_recipe(w4a4_recipe("NVFP4A16"), output=str(tmp_path / "a16"), device="cpu")
    assert a16["evaluation"][HELD]["token_perplexity"] != pytest.approx(in_run, rel=1e-6)
    # compress's own checkpoint, and the same files as another tool's (no compress.json: the
    # activation scheme and input_global_scale come from config.json and the tensors)
    for path in (out, _without_compress_json(out, tmp_path / "other")):
        again = evaluate_model(str(path), [HELD], device="cpu", seq_len=128, max_windows=8)
        assert again["results"][HELD]["token_perplexity"] == pytest.approx(in_run, rel=1e-9)


def _without_compress_json(out, copy):
    shutil.copytree(out, copy)
    (copy / "compress.json").unlink()
    return copy


def test_mxfp4_w4a4_is_dynamic_and_needs_no_calibrated_scale(tmp_path):
    out = tmp_path / "mx"
    report = run_recipe(parse_recipe("model: default\nstages:\n  - rtn: {scheme: MXFP4}\n", "test"), output=str(out), device="cpu")
    assert report["format"]["compressed_tensors_format"] == "mxfp4-pack-quantized"
    raw = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = raw["config_groups"].values()
    assert group["input_activations"]["dynamic"] is True and group["input_activations"]["group_size"] == 32
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert not any(k.rsplit(".", 1)[1].startswith("input_") for k in f.keys())


def test_fp4_activation_schemes_refuse_the_wrong_dynamics():
    with pytest.raises(ValueError, match="set dynamic: false"):
        resolve_scheme("NVFP4", None, {"dynamic": True})
    with pytest.raises(ValueError, match="set dynamic: true"):
        resolve_scheme("MXFP4", None, {"dynamic": False})


# ---------------------------------------------------------------------------------------------
# Every supported family, and mixture-of-experts blocks


def _tiny(make, path):
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    make().save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
    return path


def _fused_scales_agree(layers: dict) -> None:
    for group in fused_groups(list(layers)):
        assert len({layers[n]["global_scale"] for n in group}) == 1, group


@pytest.mark.parametrize("family", ["llama", "opt", "gpt2", "bert"])
def test_nvfp4_w4a4_gptq_on_every_family(family, tmp_path):
    from tests.test_model_families import FAMILIES

    path = _tiny(FAMILIES[family], tmp_path / family)
    packing = "false" if family == "bert" else "true"  # BERT calibrates on padded single lines
    recipe = parse_recipe(f"model: {path}\ncalibration: {{dataset: calibration/default.txt, num_samples: 4, seq_len: 64, "
                          f"packing: {packing}, min_chars: 20}}\nstages:\n  - gptq: {{scheme: NVFP4}}\n", "test")
    report = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    layers = report["layers"]
    solved = {n: r for n, r in layers.items() if r["gptq_loss"] is not None}
    assert len(solved) >= 8 and all(r["gptq_loss"] < r["rtn_loss"] for r in solved.values())
    assert all("activation_range" in r for r in solved.values())
    _fused_scales_agree(layers)
    if family == "gpt2":  # Conv1D: the format has no transposed layer, so dense, and said why
        assert report["format"]["format"] == "dense" and "Conv1D" in report["format"]["reason"]
    else:
        assert report["format"]["compressed_tensors_format"] == "nvfp4-pack-quantized"


def test_nvfp4_gptq_on_mixture_of_experts(tmp_path):
    """Experts that see too few tokens fall back to round-to-nearest at their fused group's
    global scale; each expert's gate and up (one w13 matrix in vLLM) share it."""
    from tests.test_moe import MOE

    path = _tiny(MOE["mixtral"], tmp_path / "mixtral")
    recipe = parse_recipe(f"model: {path}\ncalibration: {{dataset: calibration/default.txt, num_samples: 8, seq_len: 64}}\n"
                          "stages:\n  - gptq: {scheme: NVFP4A16, min_tokens: 260}\n", "test")
    layers = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")["layers"]
    experts = {n: r for n, r in layers.items() if ".experts." in n}
    assert any(r["gptq_loss"] is None for r in experts.values()) and any(r["gptq_loss"] is not None for r in experts.values())
    _fused_scales_agree(layers)
    assert any(len(g) == 2 and g[0].endswith("gate_proj") for g in fused_groups(list(experts)))


def test_actorder_packs_with_static_groups_and_falls_back_to_dense_without(tmp_path):
    """The FP4 formats have no column index: act-order GPTQ packs only when its blocks keep one
    scale (static_groups); otherwise `auto` writes dense and says which layer."""
    formats = {}
    for static in (True, False):
        recipe = parse_recipe("model: default\ncalibration: {dataset: calibration/default.txt, num_samples: 4, seq_len: 64}\n"
                              f"stages:\n  - gptq: {{scheme: NVFP4A16, actorder: true, static_groups: {str(static).lower()}}}\n", "test")
        formats[static] = run_recipe(recipe, output=str(tmp_path / str(static)), device="cpu")["format"]
    assert formats[True]["compressed_tensors_format"] == "nvfp4-pack-quantized"
    assert formats[False]["format"] == "dense" and "act-order reached the columns (actorder: group)" in formats[False]["reason"]


# ---------------------------------------------------------------------------------------------
# AWQ on the FP4 grid


@pytest.mark.parametrize("args", [NV, MX])
def test_awq_clip_search_on_fp4_never_loses_to_round_to_nearest(args):
    from tests.test_smoothing import outlier_layer

    X, W = outlier_layer(tokens=256)
    g = nvfp4_global_scale(W.abs().amax()) if args.fp4_format == "nvfp4" else None
    Q, ratio = clip_search(X, W, args, global_scale=g)
    rtn = quantize_weight(W, args, g)
    assert output_error(X, W, Q) < output_error(X, W, rtn) and ratio < 1
    assert recover_fp4_steps(Q, args.group_size, g)[1] == 0  # still storable, at the same global scale


def test_awq_nvfp4_then_gptq_nvfp4(tmp_path):
    """AWQ's scale search and clipping on NVFP4, packed; and AWQ's scales then GPTQ on NVFP4,
    the combination llm-compressor users run."""
    from tests.test_smoothing import SMOOTHING_FAMILIES, save

    torch.manual_seed(0)
    save(SMOOTHING_FAMILIES["llama-mha"]().eval(), tmp_path / "in")
    calib = "calibration: {dataset: calibration/default.txt, num_samples: 8, seq_len: 64}\n"
    report = run_recipe(parse_recipe(f"model: {tmp_path / 'in'}\n{calib}stages:\n  - awq: {{scheme: NVFP4A16, grid: 5}}\n", "test"),
                        output=str(tmp_path / "awq"), device="cpu")
    layers = report["layers"]
    assert report["format"]["compressed_tensors_format"] == "nvfp4-pack-quantized"
    _fused_scales_agree(layers)
    searched = [r for r in layers.values() if "awq_alpha" in r]
    assert searched and all(r["awq_block_error"] <= r["awq_rtn_block_error"] for r in searched)
    assert report["stages"][0]["summary"]["mean_output_error"] < report["stages"][0]["summary"]["mean_rtn_output_error"]
    chained = run_recipe(parse_recipe(f"model: {tmp_path / 'in'}\n{calib}stages:\n  - awq: {{scheme: NVFP4A16, grid: 5, quantize: false}}\n"
                                      "  - gptq: {scheme: NVFP4A16}\n", "test"), output=str(tmp_path / "chain"), device="cpu")
    assert chained["format"]["compressed_tensors_format"] == "nvfp4-pack-quantized"
    assert all(r["stage"] == "gptq" and r["gptq_loss"] < r["rtn_loss"] for r in chained["layers"].values())



def test_fp4_edge_blocks_nan_and_packed_size():
    # MXFP4: a block whose largest is exactly 7 steps takes the next power up (strictly below 7)
    assert float(fp4_steps(torch.tensor([1.75]), None)) == 0.5
    assert float(fp4_steps(torch.tensor([1.74]), None)) == 0.25
    # NVFP4 weights: a block far below the tensor's largest keeps nonzero codes (e4m3's smallest
    # scale stores them), still exactly recoverable; as activations it rounds to zero
    W = torch.zeros(2, 32)
    W[0, 0], W[1, 16:] = 1000.0, torch.linspace(0.001, 0.002, 16)
    g = nvfp4_global_scale(W.abs().amax())
    Q = fake_quantize_fp4(W, 16, g)
    assert (Q[1, 16:] != 0).sum() >= 8 and recover_fp4_steps(Q, 16, g)[1] == 0
    assert (fake_quantize_fp4(W, 16, g, activations=True)[1, 16:] == 0).all()
    # NaN and Inf stay where they are; the rest of their block is rounded from the finite values
    x = torch.randn(2, 32)
    x[0, 3], x[1, 7] = float("nan"), float("inf")
    out = fake_quantize_fp4(x, 16, 1.0)
    assert torch.isnan(out[0, 3]) and torch.isinf(out[1, 7]) and torch.isfinite(out[0, :3]).all()
    finite = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    assert torch.equal(out[0, 16:], fake_quantize_fp4(finite, 16, 1.0)[0, 16:])
    # packed size: 4-bit codes, an 8-bit scale per block, NVFP4's 32-bit global scale
    from compress.schemes import packed_weight_bits

    assert packed_weight_bits(64, 256, NV) == 64 * 256 * 4 + 64 * 16 * 8 + 32
    assert packed_weight_bits(64, 256, MX) == 64 * 256 * 4 + 64 * 8 * 8


def test_fused_global_scale_comes_from_the_groups_largest_weight():
    from compress.stages.rtn import global_scales

    torch.manual_seed(0)
    attn = torch.nn.ModuleDict({n: torch.nn.Linear(32, 32, bias=False) for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
    with torch.no_grad():
        attn["k_proj"].weight[3, 4] = 50.0  # the group's largest sits in k
    layers = {f"self_attn.{n}": m for n, m in attn.items()}
    scales = global_scales(layers, NV)
    assert scales["self_attn.q_proj"] == scales["self_attn.k_proj"] == scales["self_attn.v_proj"] == nvfp4_global_scale(50.0)
    assert scales["self_attn.o_proj"] == nvfp4_global_scale(attn["o_proj"].weight.detach().abs().amax())
    assert global_scales(layers, MX) == {}


@pytest.mark.parametrize("stage", ["gptq", "awq"])
def test_mxfp4_past_float16s_range_is_refused_by_calibrating_stages(tmp_path, stage):
    """As rtn does: MXFP4's power-of-two step puts a float16 weight of 64000 at 3.9 steps of
    16384, which round to 4, 65536, past float16's range. GPTQ and AWQ refuse the layer in one
    line rather than write Inf (the weight sits in the last block's down_proj, whose outputs no
    calibrated layer reads, so calibration itself stays finite)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    net = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=2048)).to(torch.float16)
    with torch.no_grad():
        net.model.layers[1].mlp.down_proj.weight[0, 0] = 64000.0
    path = tmp_path / "fp16-big"
    net.save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
    recipe = parse_recipe(f"model: {path}\ncalibration: {{dataset: calibration/default.txt, num_samples: 4, seq_len: 32}}\n"
                          f"stages:\n  - {stage}: {{scheme: MXFP4A16}}\n", "test")
    with pytest.raises(CompressError, match="layer model.layers.1.mlp.down_proj: mxfp4 g32 rounds its largest weights to "
                                            "65536, past float16's largest value"):
        run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    assert not (tmp_path / "out").exists()
