"""Packed checkpoints in the compressed-tensors format: bytes on disk, exact decompression by the
library, plain transformers loading, round trips, tied embeddings, damaged files, inspect."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from compress import activations, modeling, packing, parse_recipe, run_recipe
from compress.schemes import QuantArgs
from compress.cli import main
from compress.pipeline import evaluate_model
from compress.quant import (compute_qparams, fake_quantize, fake_quantize_fp8, recover_qparams, scales_as,
                            scales_stored_as, storable_scale)
from compress.stages.base import StageContext
from compress.stages.rtn import RoundToNearest
from tests.test_quant import tile_absmax

pytest.importorskip("compressed_tensors")

HELDOUT = "calibration/heldout-tinyshakespeare.txt"
IDS = torch.arange(40).reshape(2, 20) * 37 % 2048


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small tensors: one thread avoids the cost of synchronising threads on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def quantize(tmp, name, stage_yaml, model="default", extra="", fmt=None, dtype="auto"):
    recipe = parse_recipe(f"model: {model}\nstages:\n  - rtn: {stage_yaml}\n{extra}", "test")
    out = tmp / name
    report = run_recipe(recipe, output=str(out), device="cpu", dtype=dtype, format=fmt)
    return out, report


def in_memory(stage_kwargs, model="default", dtype="auto"):
    """The stage run in memory as the pipeline runs it (scales held as the model's dtype holds them)."""
    net, _, _ = modeling.load_model(model, dtype=dtype)
    with scales_stored_as(next(net.parameters()).dtype):
        RoundToNearest(**stage_kwargs).apply(net, StageContext(device=torch.device("cpu")))
    return net


def ct_decompress(path) -> dict[str, torch.Tensor]:
    """Every quantized layer's weight as compressed-tensors itself decompresses it."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate({k: v for k, v in raw.items() if k in QuantizationConfig.model_fields})
    (scheme,) = qc.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    names = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")}
    return {n: compressor.decompress({k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == n}, scheme)["weight"]
            for n in names}


@pytest.fixture(scope="module")
def w4g64(tmp_path_factory):
    """The bundled model in float32, W4A16 (symmetric) group 64, evaluated after packing."""
    tmp = tmp_path_factory.mktemp("packed")
    out, report = quantize(tmp, "w4g64", "{scheme: W4A16, weights: {group_size: 64}}", dtype="float32",
                           extra=f"evaluation: {{datasets: [{HELDOUT}], seq_len: 128, max_windows: 6}}\n")
    return out, report


# ---------------------------------------------------------------------------------------------
# Recovering scales from dequantized weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_recovered_scales_reproduce_weights_exactly(dtype):
    torch.manual_seed(0)
    W = torch.randn(64, 256)
    cases = [(4, True, "group", 64), (4, False, "group", 128), (8, True, "channel", None), (8, False, "channel", None),
             (3, False, "group", 32), (8, True, "tensor", None)]
    for bits, sym, strategy, group in cases:
        q = fake_quantize(W, bits, sym, strategy, group).to(dtype)
        scale, zp, failed = recover_qparams(q, bits, sym, strategy, group)
        assert failed == 0, (dtype, bits, sym, strategy)
        assert (zp is None) == sym
    q = fake_quantize_fp8(W, "channel").to(dtype)
    assert recover_qparams(q, 8, True, "channel", float8=True)[2] == 0
    # codes that never reach the grid's ends (as after GPTQ), and a zero group (pruned)
    codes = torch.randint(-3, 4, (64, 256)).float()
    codes[:, :64] = 0
    scale = torch.rand(64, 4, 1) * 0.01 + 1e-3
    w = (codes.reshape(64, 4, 64) * scale).reshape(64, 256).to(dtype)
    assert recover_qparams(w, 4, True, "group", 64)[2] == 0
    # a weight of one group whose extreme stops short of the grid's end (SparseGPT pruned or moved
    # it: Qwen2-MoE's [1, 64] shared_expert_gate), found although the only group misses the ends
    # (its codes as SparseGPT left them: half pruned, none small, the largest 126)
    kept = [-86, -76, -68, -64, 70, -65, -68, -100, 100, 45, -106, 85, 72, 67, 90, 112, 67, 62, -64, 126, 93, 88, 59,
            -105, 109, 57, -111, 46, -97, 47, -107, 75]
    codes = torch.zeros(1, 64)
    codes[0, ::2] = torch.tensor(kept, dtype=torch.float32)
    one = codes * torch.tensor(0.00039408524753525853)
    assert recover_qparams(one, 8, True, "channel")[2] == 0
    # learned scales (QAT's AdamW moved them up ~10 %): every group's extreme stops short of the
    # grid's end, in a 8-bit channel weight in bfloat16 and a 4-bit grouped one
    for bits, strategy, group, grow in ((8, "channel", None, 1.1), (4, "group", 64, 1.3)):
        qp = compute_qparams(W, bits, True, strategy, group)
        qp.scale = (qp.scale * grow).to(dtype).float()
        short = fake_quantize(W, bits, True, strategy, group, qparams=qp).to(dtype)
        assert recover_qparams(short, bits, True, strategy, group)[2] == 0, (bits, dtype)
    # a weight off the grid is refused, not approximated
    assert recover_qparams(W.to(dtype), 4, True, "group", 64)[2] > 0
    assert recover_qparams(W[:1].to(dtype), 8, True, "channel")[2] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_learned_scales_are_recovered_without_searching_every_code(dtype, monkeypatch):
    """After QAT or AutoRound every group's scale has moved, each by its own amount, so no extreme
    sits at the grid's end. The extreme's code is read off the group (its extent over its
    smallest nonzero magnitude) rather than searched for from the end down, which took 44 s to
    pack a 20-step QAT W8 ref-llama: here the search is not allowed to run at all."""
    import compress.quant

    def no_search(*args, **kwargs):
        raise AssertionError("recover_qparams searched code by code")

    monkeypatch.setattr(compress.quant, "_search_groups", no_search)
    torch.manual_seed(0)
    W = torch.randn(64, 256)
    for bits, sym, strategy, group in [(8, True, "channel", None), (8, False, "channel", None), (4, True, "group", 64),
                                       (4, False, "group", 64), (3, True, "group", 32), (2, False, "group", 64),
                                       (8, True, "tensor", None)]:
        qp = compute_qparams(W, bits, sym, strategy, group)
        qp.scale = (qp.scale * (1 + 0.4 * torch.rand_like(qp.scale))).to(dtype).float()
        learned = fake_quantize(W, bits, sym, strategy, group, qparams=qp).to(dtype)
        scale, zp, failed = recover_qparams(learned, bits, sym, strategy, group)
        assert failed == 0, (bits, sym, strategy)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_fp8_scales_are_recovered_without_the_interval_search(dtype, monkeypatch):
    """A half-precision model's FP8 scales are values of its dtype (fp8_step rounds them so), as
    its integer scales are: the quick path tries them, where FP8 groups all went to the interval
    search (1 s for a 2048x2048 layer, 7-10 s at 4096x4096 in bfloat16)."""
    import compress.quant
    from compress.stages.rtn import quantize_weight

    def no_search(*args, **kwargs):
        raise AssertionError("recover_qparams searched")

    monkeypatch.setattr(compress.quant, "_solve_groups", no_search)
    torch.manual_seed(0)
    W = (torch.randn(256, 384) * 0.02).to(dtype)
    for strategy, tiles in (("channel", None), ("tensor", None), ("block", [128, 128])):
        args = QuantArgs(num_bits=8, type="float", strategy=strategy, block_structure=tiles)
        with scales_stored_as(dtype):
            rounded = quantize_weight(W, args).to(dtype)
        assert recover_qparams(rounded, 8, True, strategy, float8=True, block_structure=tiles)[2] == 0, strategy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scales_in_the_model_dtype(dtype):
    """Under scales_stored_as(dtype) every scale is a value of dtype, never smaller than the plain
    one (no code range shrinks), the rounding error stays within half a step, and the packer
    finds those very scales again from the weights alone."""
    torch.manual_seed(0)
    W = torch.randn(64, 256) * 0.02
    for bits, sym, strategy, group in [(4, True, "group", 64), (4, False, "group", 64), (8, True, "channel", None),
                                       (8, False, "channel", None), (3, True, "group", 32)]:
        plain = compute_qparams(W, bits, sym, strategy, group)
        with scales_stored_as(dtype):
            held = compute_qparams(W, bits, sym, strategy, group)
            q = fake_quantize(W, bits, sym, strategy, group)
        assert torch.equal(held.scale.to(dtype).float(), held.scale)
        assert (held.scale >= plain.scale).all() and (held.scale <= plain.scale * (1 + 2**-7)).all()
        step = held.scale.expand(-1, -1, group).reshape(64, 256) if group else held.scale
        assert ((q - W).abs() <= step / 2 + 1e-9).all()
        stored = q.to(dtype)
        scale, zp, failed = recover_qparams(stored, bits, sym, strategy, group)
        assert failed == 0
        in_dtype = scales_as(stored, scale, zp, bits, strategy, group, dtype)
        assert in_dtype is not None and in_dtype.dtype == dtype, (bits, sym, strategy)
    with scales_stored_as(dtype):  # FP8 weights too
        q = fake_quantize_fp8(W, "channel", storable=True).to(dtype)
    scale, _, failed = recover_qparams(q, 8, True, "channel", None, float8=True)
    in_dtype = scales_as(q, scale, None, 8, "channel", None, dtype, float8=True)
    assert failed == 0 and in_dtype is not None and in_dtype.dtype == dtype
    codes = (q.float() / in_dtype.float()).to(torch.float8_e4m3fn)
    assert torch.equal(codes.to(dtype) * in_dtype, q)  # as a reader computes it, in the model's dtype
    with scales_stored_as(torch.float32):  # float32 models keep float32 scales as computed
        assert torch.equal(compute_qparams(W, 8, True, "channel").scale, W.abs().amax(1, keepdim=True) / 127)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_learned_scale_passes_straight_through_its_storable_rounding(dtype):
    """AutoRound and QAT learn scales under scales_stored_as(dtype): the rounded value is the one a
    plain call gives, bit for bit, its gradient passes unchanged, and no nextafter sits in the graph
    (torch before 2.13 has no derivative for it: AutoRound's backward failed there)."""
    torch.manual_seed(0)
    learned = (torch.rand(64) * 0.1 + 1e-3).requires_grad_()
    with scales_stored_as(dtype):
        out = storable_scale(learned)
        plain = storable_scale(learned.detach())
    assert torch.equal(out.detach(), plain) and torch.equal(plain.to(dtype).float(), plain)
    assert not torch.equal(plain, learned.detach())  # the rounding did something
    (out * torch.arange(64.0)).sum().backward()
    assert torch.equal(learned.grad, torch.arange(64.0))
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo += [nxt for nxt, _ in node.next_functions]
    assert not any("Nextafter" in type(node).__name__ for node in seen)


# ---------------------------------------------------------------------------------------------
# The bundled model: bytes, exactness, transformers, round trip


def test_w4_group64_bytes_and_exact_decompression(w4g64):
    out, report = w4g64
    assert report["format"]["format"] == "packed" and "compressed-tensors" in report["format"]["reason"]
    size = report["output"]
    assert size["quantized_layers_ratio_to_float16"] <= 0.3
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "pack-quantized"
    assert cfg["ignore"] == ["lm_head"] and cfg["config_groups"]["group_0"]["weights"]["group_size"] == 64
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.layers.0.mlp.down_proj.weight_packed").get_dtype() == "I32"
        assert "model.layers.0.mlp.down_proj.weight" not in f.keys() and "lm_head.weight" in f.keys()
    # compressed-tensors decompresses the checkpoint to exactly the weights quantized in memory
    net = in_memory({"scheme": "W4A16", "weights": {"group_size": 64}}, dtype="float32")
    modules = dict(net.named_modules())
    decompressed = ct_decompress(out)
    assert len(decompressed) == 28
    for name, weight in decompressed.items():
        assert torch.equal(weight.to(modules[name].weight.dtype), modules[name].weight), name


def plain_transformers_logits(path, tmp_path, dequantize=False) -> torch.Tensor:
    """Logits of the checkpoint as plain transformers computes them, in a process that never
    imports compress; `dequantize`: CompressedTensorsConfig(dequantize=True), which transformers
    needs for asymmetric pack-quantized checkpoints (see README)."""
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, CompressedTensorsConfig\n"
        "kw = {'quantization_config': CompressedTensorsConfig(dequantize=True)} if sys.argv[3] == '1' else {}\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], **kw).eval()\n"
        "ids = torch.arange(40).reshape(2, 20) * 37 % 2048\n"
        "with torch.no_grad():\n"
        "    torch.save(m(input_ids=ids).logits, sys.argv[2])\n"
        "assert not any(k == 'compress' or k.startswith('compress.') for k in sys.modules)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script, str(path), str(tmp_path / "logits.pt"), "1" if dequantize else "0"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return torch.load(tmp_path / "logits.pt")


def relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours.float(), theirs.float()
    return float((ours - theirs).abs().max() / ours.abs().max())


def test_plain_transformers_loads_packed_logits_match(w4g64, tmp_path):
    out, _ = w4g64
    theirs = plain_transformers_logits(out, tmp_path)
    net = in_memory({"scheme": "W4A16", "weights": {"group_size": 64}}, dtype="float32")
    with torch.no_grad():
        ours = net(input_ids=IDS).logits
    assert relative_difference(ours, theirs) <= 1e-4


def test_bfloat16_scales_and_asymmetric_in_plain_transformers(tmp_path):
    """A bfloat16 model's checkpoint holds bfloat16 scales (the stage rounded them so), so that
    transformers, which computes with scales in the model's dtype, gets our weights exactly;
    an asymmetric one loads through CompressedTensorsConfig(dequantize=True), also exactly."""
    out, report = quantize(tmp_path, "bf16", "{scheme: W4A16, weights: {group_size: 64}}")
    assert report["format"]["scale_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.layers.0.mlp.down_proj.weight_scale").get_dtype() == "BF16"
    net = in_memory({"scheme": "W4A16", "weights": {"group_size": 64}})
    assert next(net.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        ours = net(input_ids=IDS).logits
    assert relative_difference(ours, plain_transformers_logits(out, tmp_path)) <= 1e-4
    asym, report = quantize(tmp_path, "asym", "{scheme: W4A16_ASYM, weights: {group_size: 64}}")
    assert report["format"]["scale_dtype"] == "bfloat16"
    net = in_memory({"scheme": "W4A16_ASYM", "weights": {"group_size": 64}})
    with torch.no_grad():
        ours = net(input_ids=IDS).logits
    assert relative_difference(ours, plain_transformers_logits(asym, tmp_path, dequantize=True)) <= 1e-4
    # GPTQ too (its group scales are computed as the columns are reached), at 8 bits, where
    # bfloat16 products round most coarsely: what compress evaluates is what transformers runs
    recipe = parse_recipe("model: default\ncalibration: {dataset: calibration/default.txt, num_samples: 4, seq_len: 64}\n"
                          "stages:\n  - gptq: {scheme: W8A16}\n", "test")
    report = run_recipe(recipe, output=str(tmp_path / "gptq"), device="cpu")
    assert report["format"]["format"] == "packed" and report["format"]["scale_dtype"] == "bfloat16"
    loaded, _, _ = modeling.load_model(str(tmp_path / "gptq"))
    with torch.no_grad():
        ours = loaded(input_ids=IDS).logits
    assert relative_difference(ours, plain_transformers_logits(tmp_path / "gptq", tmp_path)) <= 1e-4
    # FP8 weights likewise: their float32 scales, cast to bfloat16 on load, changed a quarter of the
    # weights transformers ran (up to 0.8 %), while compress evaluated the unchanged ones
    fp8 = "{scheme: W8A16, weights: {type: float}}"
    out, report = quantize(tmp_path, "fp8", fp8)
    assert report["format"]["format"] == "packed" and report["format"]["scale_dtype"] == "bfloat16"
    net = in_memory({"scheme": "W8A16", "weights": {"type": "float"}})
    with torch.no_grad():
        ours = net(input_ids=IDS).logits
    assert relative_difference(ours, plain_transformers_logits(out, tmp_path)) <= 1e-4


def test_full_range_grid_packs_exactly(tmp_path):
    """The full symmetric grid (code -8 at 4 bits) is the format's own: packed, decompressed by
    compressed-tensors to exactly the evaluated weights, and the extra code is really stored."""
    stage = {"scheme": "W4A16", "weights": {"group_size": 64, "full_range": True}}
    out, report = quantize(tmp_path, "full", "{scheme: W4A16, weights: {group_size: 64, full_range: true}}", dtype="float32")
    assert report["format"]["format"] == "packed"
    modules = dict(in_memory(stage, dtype="float32").named_modules())
    decompressed = ct_decompress(out)
    lowest = []
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for name, weight in decompressed.items():
            assert torch.equal(weight.to(modules[name].weight.dtype), modules[name].weight), name
            scale = f.get_tensor(f"{name}.weight_scale").float()
            codes = (weight.float().reshape(weight.shape[0], -1, 64) / scale.unsqueeze(-1)).round()
            lowest.append(int(codes.min()))
    assert min(lowest) == -8


def test_round_trip_perplexity(w4g64):
    out, report = w4g64
    in_memory_ppl = report["evaluation"][HELDOUT]["token_perplexity"]
    again = evaluate_model(str(out), [HELDOUT], device="cpu", seq_len=128, max_windows=6)
    assert again["results"][HELDOUT]["token_perplexity"] == pytest.approx(in_memory_ppl, rel=1e-9)


def test_w4_group128_and_w8_bytes(tmp_path):
    out, g128 = quantize(tmp_path, "g128", "{scheme: W4A16_ASYM}")  # group 128: 256 and 640 divide
    assert g128["format"]["format"] == "packed" and g128["output"]["quantized_layers_ratio_to_float16"] <= 0.3
    # zero-points too come back exactly (bfloat16 model, float32 scales), read by compress
    loaded, _, _ = modeling.load_model(str(out))
    expected = in_memory({"scheme": "W4A16_ASYM"})
    got, want = loaded.state_dict(), expected.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    out, w8 = quantize(tmp_path, "w8", "{scheme: W8A8}")  # int8 weights as int8, dynamic per-token activations
    assert w8["output"]["quantized_layers_ratio_to_float16"] <= 0.55
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "int-quantized"
    acts = cfg["config_groups"]["group_0"]["input_activations"]
    assert acts["num_bits"] == 8 and acts["strategy"] == "token" and acts["dynamic"] is True
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.layers.0.mlp.up_proj.weight").get_dtype() == "I8"


# ---------------------------------------------------------------------------------------------
# Tiny models: tied embeddings, static activations, FP8, dense, fallbacks


@pytest.fixture
def tiny(tmp_path):
    def make(tied=False, intermediate=128):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                                             tie_word_embeddings=tied)).eval()
        path = tmp_path / f"tiny-{tied}-{intermediate}"
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
        return path
    return make


def test_tied_embeddings_stay_tied(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    path = tiny(tied=True)
    out, report = quantize(tmp_path, "tied", "{scheme: W4A16, weights: {group_size: 32}}", model=path)
    assert report["format"]["format"] == "packed"
    net, _, _ = modeling.load_model(str(out))
    assert net.lm_head.weight.data_ptr() == net.model.embed_tokens.weight.data_ptr()
    expected = in_memory({"scheme": "W4A16", "weights": {"group_size": 32}}, model=str(path))
    with torch.no_grad():
        assert torch.equal(net(input_ids=IDS).logits, expected(input_ids=IDS).logits)
    plain = AutoModelForCausalLM.from_pretrained(out).eval()  # loads without errors, still tied
    assert plain.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()
    # a packed checkpoint is the input of a following stage
    _, again = quantize(tmp_path, "again", "{scheme: W8A16}", model=out)
    assert again["format"]["format"] == "packed"


def test_static_activations_and_fp8(tiny, tmp_path):
    path = tiny()
    cal = "calibration: {dataset: calibration/default.txt, num_samples: 4, seq_len: 64}\n"
    out, report = quantize(tmp_path, "static", "{scheme: W8A8, input_activations: {strategy: tensor, dynamic: false}}",
                           model=path, extra=cal)
    assert "activation quantization is in compress.json only" not in report["format"]["reason"]
    # dense: config.json cannot say the inputs are quantized, so the reason does
    _, dense = quantize(tmp_path, "static-dense", "{scheme: W8A8, input_activations: {strategy: tensor, dynamic: false}}",
                        model=path, extra=cal, fmt="dense")
    assert dense["format"]["reason"].endswith("(activation quantization is in compress.json only: compress reattaches it, "
                                              "plain loaders run those layers on unquantized inputs)")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.input_scale").numel() == 1
    acts = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["input_activations"]
    assert acts["strategy"] == "tensor" and acts["dynamic"] is False
    # full_range activations: compressed-tensors' input_scale convention (absmax / 127.5), code -128 in use
    out, _ = quantize(tmp_path, "static-full", "{scheme: W8A8, input_activations: {strategy: tensor, dynamic: false, "
                      "full_range: true}}", model=path, extra=cal)
    lo, hi = json.loads((out / "compress.json").read_text())["layers"]["model.layers.0.self_attn.q_proj"]["activation_range"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        scale = f.get_tensor("model.layers.0.self_attn.q_proj.input_scale")
    assert float(scale) == pytest.approx(max(-lo, hi) / 127.5, rel=1e-6)
    hook = activations.ActivationFakeQuant(QuantArgs(num_bits=8, strategy="tensor", full_range=True), static_range=(-2.55, 1.0))
    x = torch.tensor([[-2.55, -1.0, 0.3, 1.0]])
    assert hook(None, (x,))[0].min().item() == pytest.approx(-128 * 2.55 / 127.5)  # the extra code
    with scales_stored_as(torch.bfloat16):  # a stage's calibration forward: activation scales stay float32
        assert hook(None, (x,))[0].min().item() == pytest.approx(-128 * 2.55 / 127.5, rel=1e-7)
    plain = activations.ActivationFakeQuant(QuantArgs(num_bits=8, strategy="tensor"), static_range=(-2.55, 1.0))
    assert plain(None, (x,))[0].min().item() == pytest.approx(-2.55)  # absmax: -127 steps of 2.55 / 127
    out, _ = quantize(tmp_path, "fp8", "{scheme: FP8_DYNAMIC}", model=path)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.layers.0.mlp.up_proj.weight").get_dtype() == "F8_E4M3"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "float-quantized"
    # and the values: compress and compressed-tensors read back the weights the stage rounded in memory
    original = dict(modeling.load_model(path)[0].named_parameters())
    expected = dict(in_memory({"scheme": "FP8_DYNAMIC"}, model=path).named_parameters())
    reloaded = dict(modeling.load_model(str(out), dtype="float32")[0].named_parameters())
    decompressed = ct_decompress(out)
    assert len(decompressed) == 7 * 2  # every linear layer of the two blocks
    for name, weight in decompressed.items():
        assert not torch.equal(expected[f"{name}.weight"], original[f"{name}.weight"])  # it was rounded
        assert torch.equal(reloaded[f"{name}.weight"], expected[f"{name}.weight"])
        assert torch.equal(weight.float(), expected[f"{name}.weight"])


def test_mixed_widths_pack_and_reload_layer_by_layer(tiny, tmp_path):
    """Layers at different widths and strategies (what `compress analyze --emit-recipe` writes)
    become one compressed-tensors config group each, and every layer reloads to its own width:
    through compress, and through plain transformers."""
    path = tiny()
    widths = {"self_attn": (4, True, "group", 32), "mlp.gate_proj": (2, True, "group", 32),
              "mlp.up_proj": (8, True, "channel", None), "mlp.down_proj": (3, True, "group", 64)}
    stages = "".join(
        f"  - rtn: {{scheme: W4A16, weights: {{num_bits: {b}, symmetric: {str(sym).lower()}, strategy: {st}"
        + (f", group_size: {g}" if g else "") + f"}}, targets: ['re:.*{k}.*']}}\n"
        for k, (b, sym, st, g) in widths.items())
    recipe = parse_recipe(f"model: {path}\nstages:\n{stages}", "test")
    report = run_recipe(recipe, output=str(tmp_path / "mixed"), device="cpu")
    assert report["format"]["format"] == "packed"
    groups = json.loads((tmp_path / "mixed" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert sorted((g["weights"]["num_bits"], g["weights"]["strategy"]) for g in groups.values()) == \
        [(2, "group"), (3, "group"), (4, "group"), (8, "channel")]
    dense, _, _ = modeling.load_model(str(path))
    loaded, _, _ = modeling.load_model(str(tmp_path / "mixed"))
    layers = [n for n, m in dense.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert len(layers) == 14
    with torch.no_grad():
        for name in layers:
            bits, sym, strategy, group = next(v for k, v in widths.items() if k in name)
            expected = fake_quantize(dense.get_submodule(name).weight, bits, sym, strategy, group)
            assert torch.equal(loaded.get_submodule(name).weight, expected), name
            dense.get_submodule(name).weight.copy_(expected)
        ours = dense(input_ids=IDS).logits
        assert torch.equal(loaded(input_ids=IDS).logits, ours)
    assert relative_difference(ours, plain_transformers_logits(tmp_path / "mixed", tmp_path)) <= 1e-4


def test_dense_format_and_fallback(tiny, tmp_path):
    path = tiny()
    out, report = quantize(tmp_path, "dense", "{scheme: W4A16, weights: {group_size: 32}}", model=path, fmt="dense")
    assert report["format"]["format"] == "dense" and "quantization_config" not in json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.layers.0.mlp.up_proj.weight").get_dtype() == "F32"
    # group 48 does not divide 64 input features: auto falls back to dense and says why
    _, report = quantize(tmp_path, "auto", "{scheme: W4A16, weights: {group_size: 48}}", model=path)
    assert report["format"]["format"] == "dense" and "not a whole number of groups of 48" in report["format"]["reason"]


def test_a_layer_compressed_tensors_cannot_read_back_is_written_dense(tmp_path):
    """compressed-tensors 0.20 packs the int4 zero points of a layer with 8 rows or fewer (here
    k_proj and v_proj: one KV head of 8) into a tensor it then fails to unpack. `auto` writes dense
    and names the layer; `--format packed` refuses it with the same words, not a traceback."""
    from compress.errors import CompressError

    torch.manual_seed(0)
    path = tmp_path / "narrow-kv"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=1, vocab_size=2048)).save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
    stage = "{scheme: W4A16_ASYM, weights: {group_size: 16}}"
    _, report = quantize(tmp_path, "auto", stage, model=path)
    assert report["format"]["format"] == "dense"
    assert "layer model.layers.0.self_attn.k_proj: compressed-tensors cannot pack it and read it back" in report["format"]["reason"]
    with pytest.raises(CompressError, match="k_proj: compressed-tensors cannot pack it and read it back"):
        quantize(tmp_path, "packed", stage, model=path, fmt="packed")
    _, report = quantize(tmp_path, "sym", "{scheme: W4A16, weights: {group_size: 16}}", model=path)
    assert report["format"]["format"] == "packed"  # no zero points: nothing to unpack


# ---------------------------------------------------------------------------------------------
# The command line: inspect, damaged checkpoints


def run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_inspect(w4g64, capsys):
    out, report = w4g64
    rc, text, _ = run(capsys, "--json", "inspect", out)
    data = json.loads(text)
    s = data["summary"]
    assert rc == 0 and s["format"] == "packed" and s["stages"] == ["rtn"]
    assert s["source_model"]["weights_sha256"] == report["source_model"]["weights_sha256"]
    assert s["recipe"]["stages"][0]["rtn"]["scheme"] == "W4A16"
    row = s["layers"]["model.layers.0.mlp.down_proj"]
    assert row["weights"]["group_size"] == 64 and "weight_packed" in row["tensors"] and row["bytes_on_disk"] < 0.3 * row["float16_bytes"]
    assert s["sizes"]["bytes_on_disk"] < s["sizes"]["source_bytes"] and s["sizes"]["quantized_layers_ratio_to_float16"] <= 0.3
    rc, text, _ = run(capsys, "inspect", out)
    assert rc == 0 and s["source_model"]["weights_sha256"] in text and "format: packed" in text and "of their float16 size" in text


def test_damaged_checkpoint_is_named(w4g64, tmp_path, capsys):
    import shutil

    out, _ = w4g64
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    rc, _, err = run(capsys, "eval", "--model", bad, "--data", HELDOUT, "--max-windows", 2)
    assert rc == 2 and "model.safetensors" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    rc, _, err = run(capsys, "inspect", bad)
    assert rc == 2 and "model.safetensors" in err and "truncated" in err
    # a tensor missing from an otherwise valid file is named
    from safetensors.torch import load_file, save_file

    tensors = load_file(out / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, f, metadata={"format": "pt"})
    rc, _, err = run(capsys, "eval", "--model", bad, "--data", HELDOUT, "--max-windows", 2)
    assert rc == 2 and "model.layers.1.mlp.up_proj.weight_scale" in err and "model.safetensors" in err


def test_an_edited_bit_width_in_config_json_is_refused(w4g64, tmp_path, capsys):
    """config.json's quantization_config decides how the stored codes are decoded: a width edited
    there would turn them into other weights without a word; compress.json says what was written."""
    import json
    import shutil

    out, _ = w4g64
    edited = tmp_path / "edited"
    shutil.copytree(out, edited)
    config = json.loads((edited / "config.json").read_text())
    group = next(iter(config["quantization_config"]["config_groups"].values()))
    group["weights"]["num_bits"] = 3
    (edited / "config.json").write_text(json.dumps(config))
    rc, _, err = run(capsys, "eval", "--model", edited, "--data", HELDOUT, "--max-windows", 2)
    assert rc == 2 and "num_bits 3" in err and "compress.json records 4" in err and len(err.strip().splitlines()) == 1


def test_a_later_run_keeps_the_inputs_static_activation_quantization(tmp_path):
    """A run on a checkpoint whose layers quantize their inputs evaluates with that quantization
    (load attaches it), so it records and writes it too: the output reloads to the numbers the run
    reported, and its config still says A8. Its report counts the packed layers as in any run."""
    first = quantize(tmp_path, "a8", "{scheme: W8A8, input_activations: {strategy: tensor, dynamic: false}}",
                     extra="calibration: {dataset: calibration/default.txt, num_samples: 4, seq_len: 64}\n")[1]
    out, report = quantize(tmp_path, "then-w4", "{scheme: W4A16}", model=str(tmp_path / "a8"),
                           extra=f"evaluation: {{datasets: [{HELDOUT}], seq_len: 128, max_windows: 6}}\n")
    assert report["format"]["packed_layers"] == 28
    for name, rec in report["layers"].items():
        assert rec["weights"]["num_bits"] == 4
        assert rec["activation_range"] == first["layers"][name]["activation_range"]
    (group,) = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"].values()
    assert group["input_activations"]["num_bits"] == 8 and group["input_activations"]["dynamic"] is False
    again = evaluate_model(str(out), [HELDOUT], device="cpu", seq_len=128, max_windows=6)
    assert again["results"][HELDOUT]["token_perplexity"] == pytest.approx(report["evaluation"][HELDOUT]["token_perplexity"], rel=1e-9)


def test_static_int8_inputs_beyond_the_calibrated_range_clamp_as_compressed_tensors_does():
    """Static per-tensor int8: step max|x| / 127 (the stored input_scale), and an input beyond the
    calibrated range clamps to the whole int8 range, -128 included, as compressed-tensors' forward
    (and vLLM's int8 kernels) do; so does compress's own evaluation, during the run and reloaded."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize

    from compress.quant import QParams

    args = QuantArgs(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)
    x = torch.linspace(-6, 6, 97).reshape(1, -1)  # calibrated range ±4: both ends go past it
    scale = torch.tensor([4.0 / 127])
    theirs = ct_fake_quantize(x=x, scale=scale, zero_point=torch.zeros(1, dtype=torch.int8),
                              args=ct.QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor"))
    during, reloaded = torch.nn.Linear(97, 1), torch.nn.Linear(97, 1)
    activations.attach(during, args, static_range=(-4.0, 4.0))
    activations.attach(reloaded, args, static_qparams=QParams(scale.reshape(()), torch.zeros(()), -128, 127))
    seen = {}
    for name, m in (("during", during), ("reloaded", reloaded)):
        m.register_forward_pre_hook(lambda mod, inp, name=name: seen.__setitem__(name, inp[0]))
        m(x)
    assert theirs.min() == -128 * scale and torch.equal(seen["during"], theirs) and torch.equal(seen["reloaded"], theirs)


def test_every_unquantized_linear_layer_is_ignored_whatever_the_number_of_schemes(tiny, tmp_path):
    """With two schemes each group targets its layers by name, and a linear layer neither targets
    nor lists as ignored is one some readers (vLLM) fail to place: every unquantized one is in
    `ignore`, and plain transformers still reads the checkpoint as compress does."""
    path = tiny()
    recipe = parse_recipe(f"model: {path}\nstages:\n"
                          "  - rtn: {scheme: W4A16, weights: {group_size: 32}, targets: ['re:.*self_attn.[qkv]_proj']}\n"
                          "  - rtn: {scheme: W8A16, targets: ['re:.*mlp.*']}\n", "test")
    run_recipe(recipe, output=str(tmp_path / "two"), device="cpu")
    qconfig = json.loads((tmp_path / "two" / "config.json").read_text())["quantization_config"]
    assert len(qconfig["config_groups"]) == 2
    assert sorted(qconfig["ignore"]) == sorted(["lm_head", "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"])
    loaded, _, _ = modeling.load_model(str(tmp_path / "two"))
    with torch.no_grad():
        ours = loaded(input_ids=IDS).logits
    assert relative_difference(ours, plain_transformers_logits(tmp_path / "two", tmp_path)) <= 1e-4


def test_fused_layers_on_different_schemes_are_warned_of(tiny, tmp_path, capsys):
    """vLLM runs q/k/v and gate/up as one matrix with one scheme and refuses a checkpoint whose
    parts differ: the plan and the run say which groups do (the checkpoint is still written:
    transformers and compress read it); one scheme per group draws no warning."""
    from compress.cli import main

    path = tiny()
    mixed = ("  - rtn: {scheme: W4A16, weights: {group_size: 32}, ignore: [lm_head, 're:.*v_proj']}\n"
             "  - rtn: {scheme: W8A16, targets: ['re:.*v_proj']}\n")
    uniform = "  - rtn: {scheme: W4A16, weights: {group_size: 32}}\n"
    for stages, warned in ((mixed, True), (uniform, False)):
        (tmp_path / "r.yaml").write_text(f"model: {path}\nstages:\n{stages}")
        assert main(["--json", "plan", "--recipe", str(tmp_path / "r.yaml")]) == 0
        plan = json.loads(capsys.readouterr().out)
        out = tmp_path / ("mixed" if warned else "uniform")
        assert main(["--json", "quantize", "--recipe", str(tmp_path / "r.yaml"), "--output", str(out)]) == 0
        report = json.loads(capsys.readouterr().out)
        for said in (plan["warnings"], report.get("warnings", [])):
            hits = [w for w in said if "vLLM runs as one fused matrix" in w]
            assert bool(hits) == warned, said
            if warned:
                assert hits[0].startswith("2 groups") and "model.layers.0.self_attn (q_proj: W[int4 g32 sym] A[none]" in hits[0]
                assert "v_proj: W[int8 per-channel sym] A[none])" in hits[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_per_tensor_fp8_weights_share_one_scale_across_layers_vllm_fuses(tiny, tmp_path, dtype):
    """vLLM runs q/k/v and gate/up as one matrix and re-rounds every part of a per-tensor FP8
    group to the group's largest weight scale when it loads it: each part is rounded at that
    scale here already, so what vLLM runs is what compress evaluated (re-rounding changes no
    weight), and the checkpoint reloads to the weights rounded in memory."""
    path = tiny()
    w8 = "{scheme: W8A16, weights: {type: float, num_bits: 8, strategy: tensor}}"
    out, _ = quantize(tmp_path, f"fp8-{dtype}", w8, model=path, dtype=dtype)
    state = load_file(out / "model.safetensors")
    original = modeling.load_model(path, dtype=dtype)[0]
    expected = dict(in_memory({"scheme": "W8A16", "weights": {"type": "float", "num_bits": 8, "strategy": "tensor"}},
                              model=path, dtype=dtype).named_parameters())
    reloaded = dict(modeling.load_model(str(out), dtype=dtype)[0].named_parameters())
    for block in ("model.layers.0", "model.layers.1"):
        for parts in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            names = [f"{block}.{p}" for p in parts]
            scales = [state[f"{n}.weight_scale"].float() for n in names]
            assert all(torch.equal(s, scales[0]) for s in scales), names
            top = max(float(original.get_submodule(n).weight.float().abs().amax()) for n in names)
            assert float(scales[0]) == pytest.approx(top / 448, rel=2**-7)
            for n in names:
                codes = state[f"{n}.weight"].float()
                weight = (codes * scales[0]).to(reloaded[f"{n}.weight"].dtype)
                assert torch.equal(weight, reloaded[f"{n}.weight"]) and torch.equal(weight, expected[f"{n}.weight"]), n
                # vLLM's load: every part to the largest scale of its group, here the one they share
                again = (weight.float() / scales[0]).to(torch.float8_e4m3fn).float() * scales[0]
                assert torch.equal(again.to(weight.dtype), weight), n


def three_views(stage: dict, path, out, dtype: str) -> tuple:
    """A tiny model's layers three ways: as the stage left them in memory, as compress reloads the
    checkpoint, and as compressed-tensors decompresses each of its 14 linear layers; with the
    original parameters and the in-memory model."""
    original = dict(modeling.load_model(path, dtype=dtype)[0].named_parameters())
    net = in_memory(stage, model=path, dtype=dtype)
    reloaded = modeling.load_model(str(out), dtype=dtype)[0]
    decompressed = ct_decompress(out)
    assert len(decompressed) == 7 * 2
    return original, net, dict(net.named_parameters()), reloaded, decompressed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_block_tiles_pack_exactly_and_reload(tiny, tmp_path, dtype):
    """FP8_BLOCK (DeepSeek-V3's FP8): one weight scale per tile, partial tiles at the edges
    included, stored as compressed-tensors lays them out ([row tiles, column tiles]) with the
    preset's config; what the library decompresses and what compress reloads are the weights
    evaluated in memory, and plain transformers computes its logits (float32: bfloat16's
    activation emulation differs, see README)."""
    path = tiny(intermediate=96)  # 32x48 tiles: 64 and 96 columns end in partial tiles
    stage = {"scheme": "FP8_BLOCK", "weights": {"block_structure": [32, 48]}, "input_activations": {"group_size": 32}}
    out, report = quantize(tmp_path, f"fp8-block-{dtype}", json.dumps(stage), model=path, dtype=dtype)
    assert report["format"]["format"] == "packed"
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert (group["format"], group["weights"]["strategy"], group["weights"]["block_structure"]) == ("float-quantized", "block", [32, 48])
    assert {k: group["input_activations"][k] for k in ("type", "strategy", "group_size", "dynamic")} == \
        {"type": "float", "strategy": "group", "group_size": 32, "dynamic": True}
    assert "| float8 block 32x48 sym | float8 group g32 dynamic |" in (out / "report.md").read_text()
    original, net, expected, reloaded, decompressed = three_views(stage, path, out, dtype)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for name, weight in decompressed.items():
            W = expected[f"{name}.weight"]
            scale = f.get_tensor(f"{name}.weight_scale").float()
            assert scale.shape == (-(-W.shape[0] // 32), -(-W.shape[1] // 48)), name
            # each tile's scale is its own largest weight over 448 (rounded up to the stored dtype)
            top = tile_absmax(original[f"{name}.weight"].float(), 32, 48)  # tests/test_quant.py's loop
            assert torch.allclose(scale, top / 448, rtol=2**-7 if dtype == "bfloat16" else 1e-6), name
            assert not torch.equal(W, original[f"{name}.weight"])
            assert torch.equal(weight.to(W.dtype), W), name
            assert torch.equal(dict(reloaded.named_parameters())[f"{name}.weight"], W), name
    for model in (net, reloaded):  # inputs rounded per token per 32 features, in memory and reloaded
        assert activations.attached_inputs(model)["model.layers.1.mlp.down_proj"]["input_activations"]["group_size"] == 32
    with torch.no_grad():
        ours = net(input_ids=IDS).logits
        assert torch.equal(reloaded(input_ids=IDS).logits, ours)
    if dtype == "float32":
        assert relative_difference(ours, plain_transformers_logits(out, tmp_path)) <= 1e-4
        # as another tool's checkpoint (no compress.json): the activation scheme comes from config.json
        (out / "compress.json").unlink()
        theirs = modeling.load_model(str(out), dtype=dtype)[0]
        assert activations.attached_inputs(theirs)["model.layers.1.mlp.down_proj"]["input_activations"]["group_size"] == 32
        with torch.no_grad():
            assert torch.equal(theirs(input_ids=IDS).logits, ours)


def check_mx_blocks(stage: dict, path, out, dtype: str, bits: int) -> tuple:
    """An MX checkpoint's layers: codes stored at `bits` (float8, or FP6 four to three bytes), one
    e8m0 exponent per block of 32 (uint8 [rows, cols / 32]), each the one compressed-tensors' rule
    gives the block's weights as evaluated; the library decompresses and compress reloads those
    weights, and the reloaded model computes the same logits. Returns (in-memory model, reloaded
    model, its logits)."""
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    original, net, expected, reloaded, decompressed = three_views(stage, path, out, dtype)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for name, weight in decompressed.items():
            W = expected[f"{name}.weight"]
            codes = f.get_tensor(f"{name}.weight" if bits == 8 else f"{name}.weight_packed")
            assert codes.dtype == (torch.float8_e4m3fn if bits == 8 else torch.uint8), name
            assert codes.shape == (W.shape[0], W.shape[1] * bits // 8), name
            exponents = f.get_tensor(f"{name}.weight_scale")
            assert exponents.dtype == torch.uint8 and exponents.shape == (W.shape[0], W.shape[1] // 32), name
            top = W.float().reshape(W.shape[0], -1, 32).abs().amax(-1)
            assert torch.equal(exponents.float(), generate_mx_scales(top, bits)), name
            assert not torch.equal(W, original[f"{name}.weight"])
            assert torch.equal(weight.to(W.dtype), W), name
            assert torch.equal(dict(reloaded.named_parameters())[f"{name}.weight"], W), name
    with torch.no_grad():
        ours = net(input_ids=IDS).logits
        assert torch.equal(reloaded(input_ids=IDS).logits, ours)
    return net, reloaded, ours


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", ["MXFP8A16", "MXFP8"])
def test_mxfp8_packs_exactly_and_reloads(tiny, tmp_path, scheme, dtype):
    """MXFP8 (OCP microscaling): FP8 weights in blocks of 32 with power-of-two scales, written in
    the library's mxfp8-quantized format with e8m0 exponents, each the one compressed-tensors'
    own rule (generate_mx_scales) gives the block; what the library decompresses and what
    compress reloads are the weights evaluated in memory, plain transformers computes the same
    logits, and another tool's checkpoint gets its MXFP8 activations back from config.json.
    (The library's rule is applied to the weights as evaluated: a block whose largest weight
    rounded up to 448 steps is stored at twice its step, with the same values.)"""
    path = tiny(intermediate=96)
    stage = {"scheme": scheme}
    out, report = quantize(tmp_path, f"{scheme}-{dtype}", json.dumps(stage), model=path, dtype=dtype)
    assert report["format"]["format"] == "packed"
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert (group["format"], group["weights"]["group_size"], group["weights"]["scale_dtype"]) == ("mxfp8-quantized", 32, "torch.uint8")
    assert (group["input_activations"] or {}).get("group_size") == (32 if scheme == "MXFP8" else None)
    assert ("| mxfp8 g32 | mxfp8 g32 dynamic |" if scheme == "MXFP8" else "| mxfp8 g32 | - |") in (out / "report.md").read_text()
    # the size the report gives (one byte per block scale) is the file's
    assert abs(report["output"]["bits_per_parameter_packed"] / report["output"]["bits_per_parameter_on_disk"] - 1) < 0.02
    net, reloaded, ours = check_mx_blocks(stage, path, out, dtype, 8)
    if dtype == "bfloat16":  # the library decompresses MXFP8 to bfloat16, what plain transformers runs
        assert relative_difference(ours, plain_transformers_logits(out, tmp_path)) <= 1e-3  # 0.0 when measured
        assert "plain transformers" not in report["format"]["reason"]
    else:
        assert "cannot run MXFP8 layers of a float32 model" in report["format"]["reason"]
        (out / "compress.json").unlink()  # as another tool's: the scheme read from config.json alone
        theirs = modeling.load_model(str(out), dtype=dtype)[0]
        attached = activations.attached_inputs(theirs).get("model.layers.1.mlp.down_proj")
        assert (attached or {}).get("input_activations", {}).get("group_size") == (32 if scheme == "MXFP8" else None)
        with torch.no_grad():
            assert torch.equal(theirs(input_ids=IDS).logits, ours)


@pytest.mark.parametrize("scheme", ["MXFP6A16", "MXFP6A8"])
def test_mxfp6_packs_exactly_and_reloads(tiny, tmp_path, scheme):
    """MXFP6: FP6 e2m3 weights in blocks of 32 with e8m0 scales, written in the library's
    mxfp6-pack-quantized format (four codes in three bytes); the library decompresses and compress
    reloads the weights evaluated, and plain transformers computes the same logits in bfloat16
    (MXFP6A8's inputs rounded to MXFP8 there too). In float32 the report says plain transformers
    cannot run it."""
    path = tiny(intermediate=96)
    stage = {"scheme": scheme}
    out, report = quantize(tmp_path, scheme, json.dumps(stage), model=path, dtype="bfloat16")
    assert report["format"]["format"] == "packed" and "plain transformers" not in report["format"]["reason"]
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert (group["format"], group["weights"]["num_bits"], group["weights"]["group_size"]) == ("mxfp6-pack-quantized", 6, 32)
    assert (group["input_activations"] or {}).get("scale_dtype") == ("torch.uint8" if scheme == "MXFP6A8" else None)
    assert ("| mxfp6 g32 | mxfp8 g32 dynamic |" if scheme == "MXFP6A8" else "| mxfp6 g32 | - |") in (out / "report.md").read_text()
    assert abs(report["output"]["bits_per_parameter_packed"] / report["output"]["bits_per_parameter_on_disk"] - 1) < 0.02
    _, _, ours = check_mx_blocks(stage, path, out, "bfloat16", 6)
    assert relative_difference(ours, plain_transformers_logits(out, tmp_path)) <= 1e-3
    out32, report = quantize(tmp_path, f"{scheme}-32", json.dumps(stage), model=path, dtype="float32")
    assert "cannot run MXFP6 layers of a float32 model" in report["format"]["reason"]
    size = (out32 / "report.md").read_text()  # the report a reader opens says so too
    assert "14 quantized layers packed (mxfp6-pack-quantized, 8-bit block scales), the rest in float32; plain " \
           "transformers (compressed-tensors 0.20) cannot run MXFP6 layers of a float32 model" in size


def test_mx_rounding_past_a_half_precision_range_is_refused_or_saturated(tiny, tmp_path):
    """A power-of-two step can round a block's extreme up past float16's largest value (64000 at
    step 256 is 250 steps, which e4m3 rounds to 256: 65536): a float16 model's layer would hold
    Inf, so the run refuses it naming the layer; inputs rounded so saturate at float16's largest,
    as a float16 tensor holds them, rather than becoming Inf."""
    from compress.errors import CompressError

    path = tiny()
    net = LlamaForCausalLM.from_pretrained(path, dtype=torch.float16)
    with torch.no_grad():
        net.model.layers[1].mlp.down_proj.weight[0, 0] = 64000.0
    big = tmp_path / "fp16-big"
    net.save_pretrained(big)
    AutoTokenizer.from_pretrained(path).save_pretrained(big)
    with pytest.raises(CompressError, match="layer model.layers.1.mlp.down_proj: mxfp8 g32 rounds its largest weights to "
                                            "65536, past float16's largest value"):
        quantize(tmp_path, "mx-fp16", "{scheme: MXFP8A16}", model=str(big))
    assert not (tmp_path / "mx-fp16").exists()
    hook = activations.ActivationFakeQuant(QuantArgs(type="float", num_bits=8, strategy="group", group_size=32, dynamic=True,
                                                     scale_dtype="e8m0"))
    x = torch.full((2, 64), 0.5, dtype=torch.float16)
    x[0, 0] = 64000.0
    out = hook(torch.nn.Identity(), (x,))[0]
    assert out.dtype == torch.float16 and float(out[0, 0]) == torch.finfo(torch.float16).max
    assert torch.equal(out[1], x[1])


def test_another_tools_mx_input_scheme_compress_cannot_run_is_one_line(tmp_path):
    """FP8 input groups of 64 with e8m0 scales (no preset has them) in another tool's config: a
    one-line error naming the file and the scheme, not an internal error."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    from compress.errors import CompressError

    odd = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group", group_size=64, dynamic=True,
                           scale_dtype=torch.uint8, zp_dtype=torch.uint8)
    weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
    qconfig = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights,
                                                                             input_activations=odd)})
    with pytest.raises(CompressError, match="input_activations float8 group .group_size 64, scale dtype torch.uint8. is not a "
                                            "scheme compress simulates: .*blocks of 32"):
        packing.attach_activation_quant(torch.nn.Sequential(torch.nn.Linear(64, 64)), qconfig, {}, tmp_path)


def test_mxfp4_weights_under_fp8_activation_groups_pack_and_reload(tiny, tmp_path):
    """MXFP4XFP8: MXFP4 weights, inputs rounded to FP8 per token per group of features with float
    scales (here 64 wide, the tiny model's width, for the preset's 128), written packed: the
    library decompresses the weights evaluated, compress reloads the logits evaluated, and plain
    transformers runs it in bfloat16. (Its logits there are not compress's: the library computes
    FP8 input scales in bfloat16 where compress takes float32 ones, as for FP8_BLOCK; in float32
    the library's bfloat16 decompression fails its forward, which the report says.)"""
    path = tiny()
    stage = {"scheme": "MXFP4XFP8", "input_activations": {"group_size": 64}}
    out, report = quantize(tmp_path, "mxfp4xfp8", json.dumps(stage), model=path, dtype="bfloat16")
    assert report["format"]["format"] == "packed" and "plain transformers" not in report["format"]["reason"]
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert (group["format"], group["weights"]["num_bits"], group["weights"]["group_size"]) == ("mxfp4-pack-quantized", 4, 32)
    assert {k: group["input_activations"][k] for k in ("type", "num_bits", "strategy", "group_size", "dynamic")} == \
        {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 64, "dynamic": True}
    assert "| mxfp4 g32 | float8 group g64 dynamic |" in (out / "report.md").read_text()
    net = in_memory(stage, model=path, dtype="bfloat16")
    expected = dict(net.named_parameters())
    for name, weight in ct_decompress(out).items():
        assert torch.equal(weight.to(torch.bfloat16), expected[f"{name}.weight"]), name
    with torch.no_grad():
        ours = net(input_ids=IDS).logits
        assert torch.equal(modeling.load_model(str(out), dtype="bfloat16")[0](input_ids=IDS).logits, ours)
    theirs = plain_transformers_logits(out, tmp_path)
    assert theirs.shape == ours.shape and bool(torch.isfinite(theirs).all())
    _, report = quantize(tmp_path, "mxfp4xfp8-32", json.dumps(stage), model=path, dtype="float32")
    assert "cannot run FP4 layers of a float32 model" in report["format"]["reason"]


@pytest.mark.parametrize("scheme", ["W3A16", "W4A4", "W4AFP8"])
def test_more_of_the_librarys_presets_pack_and_reload(tiny, tmp_path, scheme):
    """Presets named after compressed-tensors' (3-bit weights, int4 or FP8 activations per token)
    are written packed in the format the library infers for them and reload to the logits
    evaluated, in compress, as another tool's checkpoint, and in plain transformers. int4 inputs
    are rounded on all 16 codes as the library's emulation rounds them; on absmax's 15 a file
    could not say so, and the output is dense."""
    path = tiny()
    stage = {"scheme": scheme, "weights": {"group_size": 32}}
    out, report = quantize(tmp_path, scheme, json.dumps(stage), model=path, dtype="float32")
    assert report["format"]["format"] == "packed"
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"]["num_bits"] == int(scheme[1])
    net = in_memory(stage, model=path, dtype="float32")
    with torch.no_grad():
        ours = net(input_ids=IDS).logits
        assert torch.equal(modeling.load_model(str(out), dtype="float32")[0](input_ids=IDS).logits, ours)
    assert relative_difference(ours, plain_transformers_logits(out, tmp_path)) <= 1e-4
    (out / "compress.json").unlink()  # as another tool's: the scheme read from config.json alone
    with torch.no_grad():
        assert torch.equal(modeling.load_model(str(out), dtype="float32")[0](input_ids=IDS).logits, ours)
    if scheme == "W4A4":
        assert "| int4 group g32 sym | int4 token full dynamic |" in (out / "report.md").read_text()
        stage["input_activations"] = {"full_range": False}
        _, report = quantize(tmp_path, "W4A4-15", json.dumps(stage), model=path, dtype="float32")
        assert report["format"]["format"] == "dense"
        assert "int4 inputs are rounded on 15 codes where compressed-tensors rounds them on 16" in report["format"]["reason"]


def test_activation_groups_that_do_not_divide_a_layers_inputs_are_not_packed(tiny, tmp_path):
    """compressed-tensors (like vLLM's kernels) rounds activations in whole groups: a layer whose
    input width leaves a partial group would load and then fail at its first forward, so auto
    writes dense saying why, and `--format packed` is refused before anything is written."""
    from compress.errors import CompressError

    path = tiny()  # hidden 64: FP8_BLOCK's activation groups of 128 do not fit
    out, report = quantize(tmp_path, "fp8-block-64", "{scheme: FP8_BLOCK}", model=path)
    assert report["format"]["format"] == "dense"
    assert "whose 64 input features are not a whole number of activation groups of 128" in report["format"]["reason"]
    with pytest.raises(CompressError, match="not a whole number of activation groups of 128"):
        quantize(tmp_path, "fp8-block-64-packed", "{scheme: FP8_BLOCK}", model=path, fmt="packed")
    assert not (tmp_path / "fp8-block-64-packed").exists()
