"""The CUDA path, where a GPU is present (skipped otherwise): every calibrating algorithm runs on
the device with at most one block's parameters there, and gives the result the CPU gives, up to
the rounding decisions that float differences between the two devices may flip."""

from __future__ import annotations

import pytest
import torch

from compress import modeling, parse_recipe, run_recipe
from compress.evaluate import causal_metrics, eval_windows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STAGES = {
    "gptq": "gptq: {scheme: W4A16, weights: {group_size: 64}}",
    "gptq-actorder": "gptq: {scheme: W4A16, weights: {group_size: 64, symmetric: false}, actorder: true}",
    "awq": "awq: {scheme: W4A16, weights: {group_size: 64}}",
    "smoothquant": "smoothquant: {alpha: 0.5}\n  - rtn: {scheme: W8A8, input_activations: {strategy: tensor, dynamic: false}}",
    "sparsegpt": "sparsegpt: {sparsity: 0.5}",
    "wanda-2:4": "wanda: {pattern: '2:4'}",
    "structured": "structured: {structure: mlp-channels, ratio: 0.25}",
    "autoround": "autoround: {scheme: W4A16, weights: {group_size: 64}, iters: 40}",
    "autoround-nvfp4": "autoround: {scheme: NVFP4A16, iters: 40}",
    "gptq-nvfp4-w4a4": "gptq: {scheme: NVFP4}",
    # the float grids: FP8 tiles (rows of a tile share a scale), MX blocks with power-of-two scales
    "gptq-fp8-block": "gptq: {scheme: FP8_BLOCK, weights: {block_structure: [64, 64]}}",
    "gptq-mxfp6": "gptq: {scheme: MXFP6A16}",
    "awq-mxfp8": "awq: {scheme: MXFP8A16}",
    "sparsegpt-2:4-joint-mxfp6": "sparsegpt: {pattern: '2:4', quantize: {scheme: MXFP6A16}}",
    "fp8-kv-cache": "rtn: {scheme: FP8_DYNAMIC}\n  - kv_cache: {}",
}
# AutoRound's signed-gradient steps move by a fixed amount whatever the gradient's size, so a float
# difference between the devices that flips one step's sign changes its path more than GPTQ's
KL_REL = {"autoround": 0.2, "autoround-nvfp4": 0.2}


def recipe(shared, stage: str):
    return parse_recipe(f"""
calibration: {{dataset: {shared}/data/tinyshakespeare/train.txt, num_samples: 16, seq_len: 128}}
stages:
  - {stage}
""", "test")


def kl_to(ref_llama, path, shared, device):
    """Mean KL of a checkpoint to the float model on 8 held-out windows, evaluated on `device`."""
    base, tok, _ = modeling.load_model(str(ref_llama), dtype="float32", device=device)
    net, _, _ = modeling.load_model(str(path), dtype="float32", device=device)
    windows = eval_windows(tok, f"{shared}/data/tinyshakespeare/test.txt", 128, 8)
    return causal_metrics(net, windows, tok, base, 4, device)["kl_divergence"]


@pytest.mark.parametrize("method", list(STAGES))
def test_stage_on_cuda_matches_cpu(method, ref_llama, shared, tmp_path):
    cuda = run_recipe(recipe(shared, STAGES[method]), model=str(ref_llama), output=str(tmp_path / "cuda"), device="cuda")
    cpu = run_recipe(recipe(shared, STAGES[method]), model=str(ref_llama), output=str(tmp_path / "cpu"), device="cpu")
    assert cuda["device"].startswith("cuda") and cpu["device"] == "cpu"
    assert cuda["stages"][-1]["peak_cuda_mib"] > 0  # the work really ran on the GPU

    summary = cuda["stages"][-1]["summary"]
    if "max_parameters_on_device" in summary:  # engine stages: one block on the GPU at a time
        net = modeling.load_model(str(ref_llama), dtype="float32")[0]
        block = max(sum(p.numel() for p in b.parameters()) for b in net.model.layers)
        assert 0 < summary["max_parameters_on_device"] <= block
    for name, rec in cpu["layers"].items():  # same layers, same shapes and sparsity
        assert cuda["layers"][name].get("shape") == rec.get("shape"), name
        if "sparsity" in rec:
            assert cuda["layers"][name]["sparsity"] == pytest.approx(rec["sparsity"], abs=2e-3), name
    kl_cuda = kl_to(ref_llama, tmp_path / "cuda", shared, "cuda")
    kl_cpu = kl_to(ref_llama, tmp_path / "cpu", shared, "cuda")
    assert kl_cuda == pytest.approx(kl_cpu, rel=KL_REL.get(method, 0.1)), (kl_cuda, kl_cpu)


def test_evaluation_on_cuda_matches_cpu(ref_llama, shared):
    out = {dev: kl_to(ref_llama, ref_llama, shared, dev) for dev in ("cpu", "cuda")}
    assert out["cpu"] == pytest.approx(0, abs=1e-6) and out["cuda"] == pytest.approx(0, abs=1e-6)
    base, tok, _ = modeling.load_model(str(ref_llama), dtype="float32")
    windows = eval_windows(tok, f"{shared}/data/tinyshakespeare/test.txt", 128, 8)
    ppl = {dev: causal_metrics(base.to(dev), windows, tok, None, 4, dev)["token_perplexity"] for dev in ("cpu", "cuda")}
    assert ppl["cuda"] == pytest.approx(ppl["cpu"], rel=1e-4)


def test_bfloat16_gptq_on_cuda(ref_llama, shared, tmp_path):
    """A half-precision model calibrates on the GPU with float32 Hessians and saves exact bf16 scales."""
    report = run_recipe(recipe(shared, STAGES["gptq"]), model=str(ref_llama), output=str(tmp_path / "bf16"),
                        device="cuda", dtype="bfloat16")
    assert report["source_model"]["dtype"] == "bfloat16"
    assert report["format"]["format"] == "packed" and report["format"]["scale_dtype"] == "bfloat16"
    assert all(r["gptq_loss"] < r["rtn_loss"] for r in report["layers"].values())
    assert kl_to(ref_llama, tmp_path / "bf16", shared, "cuda") < 5e-3


def test_training_stages_on_cuda(ref_llama, shared, tmp_path):
    """QAT trains on the GPU (accelerate's CUDA path, bf16 autocast by default) and still learns."""
    data = f"{{dataset: {shared}/data/tinyshakespeare/train.txt, seq_len: 64, num_samples: 48, eval_samples: 8}}"
    train = "{steps: 24, batch_size: 4, lr: 2e-4, warmup: 0, eval_every: 0, save_every: 0}"
    r = parse_recipe(f"""
stages:
  - qat: {{weights: {{num_bits: 3, strategy: channel, symmetric: true}}, data: {data}, train: {train}}}
""", "test")
    report = run_recipe(r, model=str(ref_llama), output=str(tmp_path / "qat"), device="cuda")
    s = report["stages"][0]["summary"]
    assert report["stages"][0]["peak_cuda_mib"] > 0
    print("held-out KD before / after:", s["held_out_kd_before"], s["held_out_kd_after"])
    assert s["held_out_kd_after"] < 0.8 * s["held_out_kd_before"], s


def test_layer_solves_across_the_gpu_and_the_cpu_match_one_device(ref_llama, shared, tmp_path):
    """Several devices (here the GPU and the CPU, the only pair one GPU allows): each block's layers
    are solved half on each, concurrently, and the result matches the one-device run up to the
    float differences between the devices."""
    stage = STAGES["gptq"]
    one = run_recipe(recipe(shared, stage), model=str(ref_llama), output=str(tmp_path / "one"), device="cuda")
    two = run_recipe(recipe(shared, stage), model=str(ref_llama), output=str(tmp_path / "two"), device="cuda:0,cpu")
    assert two["devices"] == ["cuda:0", "cpu"]
    for name, rec in one["layers"].items():
        assert two["layers"][name]["gptq_loss"] == pytest.approx(rec["gptq_loss"], rel=0.05), name
    kl_one = kl_to(ref_llama, tmp_path / "one", shared, "cuda")
    kl_two = kl_to(ref_llama, tmp_path / "two", shared, "cuda")
    assert kl_two == pytest.approx(kl_one, rel=0.1), (kl_one, kl_two)


def test_a_block_comes_back_from_the_gpu_into_its_own_memory():
    """engine.on_device copies results back into the tensors a module had on the CPU: unfused
    experts stay views of the fused parameters through a GPU run, and a tied weight stays tied."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from compress.engine import on_device
    from compress.moe import fuse_experts, unfuse_experts

    model = MixtralForCausalLM(MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                                             num_key_value_heads=2, vocab_size=128, num_local_experts=4,
                                             tie_word_embeddings=True))
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj
    swaps = unfuse_experts(model)
    block = model.model.layers[0]
    expert = block.mlp.experts[2]
    where = expert.up_proj.weight.data_ptr()
    with on_device(block, torch.device("cuda")):
        assert expert.up_proj.weight.is_cuda
        with torch.no_grad():
            expert.up_proj.weight.add_(1.0)
            expected = expert.up_proj.weight.cpu()
    assert expert.up_proj.weight.data_ptr() == where and torch.equal(expert.up_proj.weight, expected)
    fuse_experts(swaps)
    inter = gate_up.shape[1] // 2
    assert torch.equal(gate_up[2, inter:], expected)
    with on_device(model, torch.device("cuda")):
        assert model.lm_head.weight.is_cuda
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.is_cuda
