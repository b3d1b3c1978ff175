"""Mixture-of-experts blocks (Mixtral, Qwen2-MoE; tiny configs): calibration routes tokens as the
model does, rarely routed experts fall back to round-to-nearest, the report counts tokens per
expert, and the fused checkpoint reloads with plain transformers; AWQ and SmoothQuant reach every
expert and keep the routing exact."""

import pytest
import torch
from safetensors import safe_open
from transformers import (AutoModelForCausalLM, AutoTokenizer, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM)

from compress import modeling, parse_recipe, run_recipe
from compress.moe import fuse_experts, unfuse_experts

V = 2048
MOE = {
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                                        num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                                                            shared_expert_intermediate_size=96, num_hidden_layers=2,
                                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                                            num_experts=4, num_experts_per_tok=2)),
}


def recipe_on(path, *stages: str, samples: int = 8):
    """A recipe on `path`: the bundled calibration text in `samples` windows of 64 tokens, then `stages`."""
    listed = "".join(f"  - {stage}\n" for stage in stages)
    return parse_recipe(f"model: {path}\ncalibration: {{dataset: calibration/default.txt, num_samples: {samples}, "
                        f"seq_len: 64}}\nstages:\n{listed}", "test")


@pytest.fixture(params=list(MOE))
def moe_model(request, tmp_path):
    torch.manual_seed(0)
    model = MOE[request.param]().eval()
    path = tmp_path / request.param
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
    return request.param, path, model


def test_unfused_experts_compute_the_same(moe_model):
    _, _, model = moe_model
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        swaps = unfuse_experts(model)
        assert swaps and any(".experts.3.down_proj" in n for n, _ in model.named_modules())
        during = model(input_ids=ids).logits
        fuse_experts(swaps)
        after = model(input_ids=ids).logits
    assert torch.allclose(before, during, atol=1e-5) and torch.equal(before, after)


def test_unfused_experts_are_views_of_the_fused_parameters(moe_model):
    """Unfusing copies no expert weight (a Mixtral's experts are nearly all of its weights: a copy
    doubled the memory a run needed). A weight written in place is in the fused parameter at once;
    one a stage replaced is written back when the experts are fused again."""
    _, _, model = moe_model
    fused = model.model.layers[0].mlp.experts
    gate_up, down = fused.gate_up_proj, fused.down_proj
    inter = gate_up.shape[1] // 2
    swaps = unfuse_experts(model)
    expert = model.model.layers[0].mlp.experts[3]
    assert expert.gate_proj.weight.data_ptr() == gate_up[3].data_ptr()
    assert expert.up_proj.weight.data_ptr() == gate_up[3, inter:].data_ptr()
    assert expert.down_proj.weight.data_ptr() == down[3].data_ptr()
    with torch.no_grad():
        doubled = gate_up[3, :inter] * 2
        expert.gate_proj.weight.mul_(2)
        assert torch.equal(gate_up[3, :inter], doubled)
        replaced = torch.randn(down.shape[1:])
        expert.down_proj.weight.data = replaced.clone()
        assert not torch.equal(down[3], replaced)
    fuse_experts(swaps)
    assert model.model.layers[0].mlp.experts is fused and fused.down_proj is down
    assert torch.equal(down[3], replaced) and torch.equal(gate_up[3, :inter], doubled)


def test_stage_cache_stores_experts_in_the_model_layout_and_restores_them(moe_model, tmp_path):
    """--resume on a mixture-of-experts model: the cache holds the fused parameters (the unfused
    experts share their memory, which safetensors will not save as separate tensors), and a stage
    restored from it hands the experts its weights: a later stage computes what an uncached run does."""
    from safetensors import safe_open

    family, path, _ = moe_model
    first, second = "magnitude: {sparsity: 0.5}", "rtn: {scheme: W8A16}"
    cache = tmp_path / "cache"
    run_recipe(recipe_on(path, first, samples=2), output=str(tmp_path / "a"), device="cpu", cache_dir=str(cache))
    [entry] = list((cache / "stages").iterdir())
    with safe_open(entry / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    resumed = run_recipe(recipe_on(path, first, second, samples=2), output=str(tmp_path / "b"), device="cpu",
                         cache_dir=str(cache))
    assert resumed["cache"]["restored_stages"] == 1
    fresh = run_recipe(recipe_on(path, first, second, samples=2), output=str(tmp_path / "c"), device="cpu")
    a, _, _ = modeling.load_model(str(tmp_path / "b"), dtype="float32")
    b, _, _ = modeling.load_model(str(tmp_path / "c"), dtype="float32")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert fresh["layers"] == resumed["layers"]


def test_gptq_on_moe(moe_model, tmp_path):
    family, path, _ = moe_model
    recipe = recipe_on(path, "gptq: {scheme: W4A16, weights: {group_size: 16}, min_tokens: 260}")
    report = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    summary = report["stages"][0]["summary"]
    tokens = summary["expert_tokens"]
    assert len(tokens) == 2 * 4  # 2 blocks x 4 experts
    for block in range(2):
        routed = [t for n, t in tokens.items() if f"layers.{block}." in n]
        assert sum(routed) == 8 * 64 * 2  # every token goes to its top-2 experts
    layers = report["layers"]
    # 1,024 routed tokens over 4 experts: at least one expert per block sees fewer than 256, so
    # min_tokens 260 sends some to round-to-nearest whatever the routing
    fallback = [n for n, r in layers.items() if r["gptq_loss"] is None]
    assert fallback and all(layers[n]["tokens"] < 260 and "round-to-nearest" in layers[n]["note"] for n in fallback)
    solved = [r for r in layers.values() if r["gptq_loss"] is not None]
    assert solved and all(r["gptq_loss"] < r["rtn_loss"] and r["tokens"] >= 260 for r in solved)

    # the fused checkpoint reloads with plain transformers; every expert weight was quantized
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    original = AutoModelForCausalLM.from_pretrained(path)
    s, o = saved.model.layers[0].mlp.experts, original.model.layers[0].mlp.experts
    assert s.gate_up_proj.shape == o.gate_up_proj.shape
    for e in range(4):
        assert not torch.equal(s.down_proj[e], o.down_proj[e])
        # int4 groups of 16: at most 16 distinct magnitudes per group row
        assert s.down_proj[e][0, :16].abs().unique().numel() <= 8


def test_expert_sparsity_is_reported_as_the_final_weights_have_it(moe_model, tmp_path):
    """Sparsity is re-read from the final weights (a later stage may round more of them to zero):
    experts too, while they are still their own layers."""
    _, path, _ = moe_model
    report = run_recipe(recipe_on(path, "magnitude: {sparsity: 0.5}", "rtn: {scheme: W4A16, weights: {num_bits: 2, group_size: 16}}"),
                        output=str(tmp_path / "out"), device="cpu", format="dense")
    experts = {n: r for n, r in report["layers"].items() if ".experts." in n}
    assert len(experts) == 2 * 4 * 3
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for layer in range(2):
        fused = saved.model.layers[layer].mlp.experts
        for e in range(4):
            inter = fused.gate_up_proj.shape[1] // 2
            # transformers 5 keeps experts fused, [experts, 2·intermediate, hidden]: gate rows, then up
            for short, w in (("gate_proj", fused.gate_up_proj[e][:inter]), ("up_proj", fused.gate_up_proj[e][inter:]),
                             ("down_proj", fused.down_proj[e])):
                name = next(n for n in experts if f"layers.{layer}." in n and n.endswith(f".experts.{e}.{short}"))
                assert experts[name]["sparsity"] == 1 - int(torch.count_nonzero(w)) / w.numel(), name
    assert any(r["sparsity"] > 0.5 for r in experts.values())  # int2 rounding zeroed some kept weights


def test_quantized_experts_are_packed_one_matrix_each_and_reload_alike(moe_model, tmp_path):
    """Fused experts are written packed, one matrix per expert layer under the key transformers
    itself saves it as (Mixtral: `block_sparse_moe.experts.e.w1`, w3, w2), so the checkpoint is
    small; plain transformers and compress both load it to the model the dense output holds."""
    from safetensors import safe_open

    family, path, _ = moe_model
    recipe = recipe_on(path, "rtn: {scheme: W4A16, weights: {group_size: 16}}", samples=2)
    packed = run_recipe(recipe, output=str(tmp_path / "packed"), device="cpu")
    run_recipe(recipe, output=str(tmp_path / "dense"), device="cpu", format="dense")
    assert packed["format"]["format"] == "packed" and "plain transformers" not in packed["format"]["reason"]
    with safe_open(tmp_path / "packed" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    experts = "block_sparse_moe.experts" if family == "mixtral" else "mlp.experts"
    for block in range(2):
        for e in range(4):
            for layer in (("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")):
                key = f"model.layers.{block}.{experts}.{e}.{layer}"
                assert {f"{key}.weight_packed", f"{key}.weight_scale"} <= keys and f"{key}.weight" not in keys
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in keys)  # no fused tensor left
    size = {d: sum(f.stat().st_size for f in (tmp_path / d).glob("*.safetensors")) for d in ("packed", "dense")}
    assert size["packed"] < size["dense"]  # the embeddings, float32 in both, are most of a model this small
    assert 0.25 < packed["output"]["quantized_layers_ratio_to_float16"] < 0.4  # int4 + a scale per 16 weights
    # the size summary counts the experts as quantized (it counted only the attention layers, and
    # gave 30 bits/parameter packed for a 15-bit file)
    out = packed["output"]
    assert out["quantized_parameters"] == sum(r["shape"][0] * r["shape"][1] for r in packed["layers"].values() if "weights" in r)
    assert abs(out["bits_per_parameter_packed"] / out["bits_per_parameter_on_disk"] - 1) < 0.02, out

    ids = torch.randint(5, V, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "packed").eval()(input_ids=ids).logits
        ours = modeling.load_model(str(tmp_path / "packed"), dtype="float32")[0](input_ids=ids).logits
    assert torch.equal(plain, expected) and torch.equal(ours, expected)


@pytest.mark.parametrize("scheme", ["W4A16_ASYM, weights: {group_size: 16}", "W8A8, weights: {group_size: 16}",
                                    "FP8_BLOCK, weights: {block_structure: [16, 32]}, input_activations: {group_size: 16}"])
def test_the_run_says_when_plain_transformers_cannot_load_its_experts(moe_model, tmp_path, scheme):
    """Zero points, int8 activations or FP8 tiles on the experts: written packed, and compress reads them to
    the model the dense output holds; the format's reason, which the run prints last, says plain
    transformers cannot load them, as it indeed cannot (its fusing of per-expert matrices does not
    handle them: it refuses the file rather than reading it wrong)."""
    family, path, _ = moe_model
    out = tmp_path / "packed"
    recipe = recipe_on(path, f"rtn: {{scheme: {scheme}}}", samples=2)
    written = run_recipe(recipe, output=str(out), device="cpu")["format"]
    run_recipe(recipe, output=str(tmp_path / "dense"), device="cpu", format="dense")
    assert written["format"] == "packed" and "plain transformers (compressed-tensors 0.20) cannot load experts" in written["reason"]
    from compress.plan import make_plan

    planned = make_plan(recipe, str(path))  # says the same before the run (it left out int8 activations' reason)
    assert (planned["format"], planned["format_reason"]) == (written["format"], written["reason"])
    with pytest.raises(RuntimeError, match="automatic conversion of the weights"):  # transformers 5.24's fusing
        AutoModelForCausalLM.from_pretrained(out)
    packed, dense = (modeling.load_model(str(tmp_path / d), dtype="float32")[0] for d in ("packed", "dense"))
    experts = [n for n, _ in dense.named_parameters() if ".experts." in n]
    assert experts and all(torch.equal(packed.get_parameter(n), dense.get_parameter(n)) for n in experts)
    ids = torch.randint(5, V, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(packed(input_ids=ids).logits, dense(input_ids=ids).logits)


def test_moe_gates_are_left_in_float_unless_named(tmp_path):
    """Qwen2-MoE's shared_expert_gate (a Linear with one output, beside the experts) is not taken
    by `Linear`: vLLM builds it unquantized and could not load it quantized. Named, it is taken."""
    torch.manual_seed(0)
    path = tmp_path / "qwen2_moe"
    MOE["qwen2_moe"]().save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
    layers = run_recipe(recipe_on(path, "rtn: {scheme: W4A16, weights: {group_size: 16}}", samples=2), output=str(tmp_path / "a"),
                        device="cpu")["layers"]
    assert "model.layers.0.mlp.shared_expert.down_proj" in layers and not any("shared_expert_gate" in n for n in layers)
    layers = run_recipe(recipe_on(path, "rtn: {scheme: W8A16, targets: [Linear, shared_expert_gate]}", samples=2),
                        output=str(tmp_path / "b"), device="cpu")["layers"]
    assert {"model.layers.0.mlp.shared_expert_gate", "model.layers.1.mlp.shared_expert_gate"} <= set(layers)


def test_unquantized_experts_are_saved_in_the_hub_layout_beside_packed_layers(moe_model, tmp_path):
    """Attention quantized, experts left in float: the file is packed, the experts written dense
    under their saved per-expert keys (as transformers saves them), and compress reloads it.
    (Plain transformers 5.24 with compressed-tensors 0.20 fails to fuse such dense experts in a
    quantized checkpoint: an upstream limit, README "Packed checkpoints".)"""
    from safetensors import safe_open

    family, path, _ = moe_model
    recipe = recipe_on(path, "rtn: {scheme: W4A16, weights: {group_size: 16}, targets: ['re:.*self_attn.*']}", samples=2)
    written = run_recipe(recipe, output=str(tmp_path / "packed"), device="cpu")["format"]
    assert written["format"] == "packed"
    assert "plain transformers (compressed-tensors 0.20) cannot load unquantized experts beside quantized layers" in written["reason"]
    run_recipe(recipe, output=str(tmp_path / "dense"), device="cpu", format="dense")
    with safe_open(tmp_path / "packed" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    expert = "model.layers.0." + ("block_sparse_moe.experts.0.w1" if family == "mixtral" else "mlp.experts.0.gate_proj")
    assert f"{expert}.weight" in keys and "model.layers.0.self_attn.q_proj.weight_packed" in keys
    ids = torch.randint(5, V, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()(input_ids=ids).logits
        ours = modeling.load_model(str(tmp_path / "packed"), dtype="float32")[0](input_ids=ids).logits
    assert torch.equal(ours, expected)


def test_experts_saved_other_than_one_matrix_each_stay_dense(moe_model, tmp_path, monkeypatch):
    """A family whose saved experts are not one matrix per expert layer (moe.expert_keys_on_disk
    raises): quantized experts cannot be packed, so the run writes dense and says why, and the
    report's sizes are still computed."""
    from compress import moe

    def not_per_expert(model):
        raise ValueError("fused experts saved as model.layers.0.mlp.experts.gate_up_proj.weight, not one matrix per expert layer")

    monkeypatch.setattr(moe, "expert_keys_on_disk", not_per_expert)
    family, path, _ = moe_model
    report = run_recipe(recipe_on(path, "rtn: {scheme: W4A16, weights: {group_size: 16}}", samples=2),
                        output=str(tmp_path / "out"), device="cpu")
    assert report["format"]["format"] == "dense" and "not one matrix per expert layer" in report["format"]["reason"]
    assert report["output"]["quantized_layers_bytes_on_disk"] > 0


def test_inspect_counts_experts_saved_in_their_familys_layout(moe_model, tmp_path):
    """Mixtral saves its experts as block_sparse_moe.experts.E.w1/w2/w3: `compress inspect` looked
    them up by their names in memory, showed 0 bytes for each and a quantized-layer total of a
    fifth of what report.json (and the files) say."""
    from compress.pipeline import inspect_checkpoint

    family, path, _ = moe_model
    for fmt in ("packed", "dense"):
        out = tmp_path / fmt
        report = run_recipe(recipe_on(path, "rtn: {scheme: W4A16, weights: {group_size: 16}}", samples=2),
                            output=str(out), device="cpu", format=fmt)
        summary = inspect_checkpoint(out)["summary"]
        experts = {n: r for n, r in summary["layers"].items() if ".experts." in n}
        assert experts and all(r["bytes_on_disk"] > 0 and r["tensors"] for r in experts.values()), family
        assert summary["sizes"]["quantized_layers_bytes_on_disk"] == report["output"]["quantized_layers_bytes_on_disk"]


def test_experts_quantized_unevenly_are_written_dense_saying_why(moe_model, tmp_path):
    family, path, _ = moe_model
    recipe = recipe_on(path, "rtn: {scheme: W4A16, weights: {group_size: 16}, ignore: [lm_head, 're:.*experts\\.3\\..*']}", samples=2)
    report = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    assert report["format"]["format"] == "dense"
    assert "experts.3." in report["format"]["reason"] and "an expert left unquantized" in report["format"]["reason"]


def test_padding_never_reaches_the_experts(moe_model, tmp_path):
    """An expert sees a gathered subset of tokens, which no padding mask lines up with: `auto` runs
    lines of different lengths one per forward, and an explicit batch that would pad them is refused."""
    from compress.errors import CompressError

    _, path, _ = moe_model
    recipe = """
model: {path}
calibration: {{dataset: calibration/default.txt, num_samples: 6, seq_len: 64, packing: false, min_chars: 20}}
stages:
  - gptq: {{scheme: W4A16, weights: {{group_size: 16}}, batch_size: {bs}}}
"""
    report = run_recipe(parse_recipe(recipe.format(path=path, bs="auto"), "test"), output=str(tmp_path / "a"), device="cpu")
    summary = report["stages"][0]["summary"]
    assert summary["batch_size"] == 1 and summary["batches"] == 6
    with pytest.raises(CompressError, match="padding would reach the experts"):
        run_recipe(parse_recipe(recipe.format(path=path, bs=3), "test"), output=str(tmp_path / "b"), device="cpu")
    assert not (tmp_path / "b").exists()


def test_smoothing_reaches_every_expert_and_keeps_the_router_exact(moe_model, tmp_path):
    """The MoE maps scale the router with the experts it feeds (unquantized, so routing stays the
    same), every expert's gate/up from the norm, and each expert's down from its own up."""
    family, path, model = moe_model
    recipe = recipe_on(path, "smoothquant: {alpha: 0.5}")
    report = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    layers = report["layers"]
    for block in range(2):
        p = f"model.layers.{block}.mlp."
        for e in range(4):
            assert layers[f"{p}experts.{e}.gate_proj"]["smoothquant_smooth"] == f"model.layers.{block}.post_attention_layernorm"
            assert layers[f"{p}experts.{e}.down_proj"]["smoothquant_smooth"] == f"{p}experts.{e}.up_proj"
        if family == "qwen2_moe":
            assert layers[f"{p}shared_expert.down_proj"]["smoothquant_smooth"] == f"{p}shared_expert.up_proj"
            assert f"{p}shared_expert_gate" not in layers  # a gate, like the router: scaled, never quantized
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    for block in range(2):  # the routers (and Qwen's shared-expert gate) are scaled with the experts they feed
        assert not torch.equal(model.model.layers[block].mlp.gate.weight, saved.model.layers[block].mlp.gate.weight)
        if family == "qwen2_moe":
            assert not torch.equal(model.model.layers[block].mlp.shared_expert_gate.weight,
                                   saved.model.layers[block].mlp.shared_expert_gate.weight)
    ids = torch.randint(5, V, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, saved(input_ids=ids).logits
    assert (a - b).norm() / a.norm() < 1e-4


@pytest.mark.parametrize("stage", ["smoothquant: {alpha: 0.5, ", "awq: {scheme: W4A16, weights: {group_size: 16}, grid: 3, "])
def test_experts_folds_are_checked_each_on_its_own_output(moe_model, stage, tmp_path):
    """The experts' own folds are checked together (two forwards of the block, not two per expert),
    but each on its own inspected output: one through SiLU (gate -> down) is still refused, named."""
    from compress.errors import CompressError

    family, path, _ = moe_model
    wrong = "mappings: [{smooth: mlp.experts.*.gate_proj, balance: [mlp.experts.*.down_proj], inspect: mlp.experts.*.down_proj}]}"
    with pytest.raises(CompressError, match=r"block 0: moving scales from mlp\.experts\.\d\.gate_proj into "
                                            r"mlp\.experts\.\d\.down_proj changes .* not exact"):
        run_recipe(recipe_on(path, stage + wrong, samples=4), output=str(tmp_path / "out"), device="cpu")
    assert not (tmp_path / "out").exists()


def test_awq_searches_scales_for_the_experts(moe_model, tmp_path):
    family, path, _ = moe_model
    recipe = recipe_on(path, "awq: {scheme: W4A16, weights: {group_size: 16}, grid: 5, clip_grid: 4}")
    layers = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")["layers"]
    experts = {n: r for n, r in layers.items() if ".experts." in n}
    assert len(experts) == 2 * 4 * 3
    for name, r in experts.items():  # every expert layer was searched, from the norm or its own up_proj
        assert r["awq_smooth"].endswith("post_attention_layernorm" if not name.endswith("down_proj") else name[:-9] + "up_proj")
        assert r["awq_block_error"] <= r["awq_rtn_block_error"]
    assert any(r["awq_alpha"] is not None for r in experts.values())


def _never_expert_3(self, hidden_states):
    """A router's forward that routes as the model's does but never picks expert 3 (as a rarely
    used expert is never picked by a small calibration set)."""
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top, idx = logits.float().masked_fill(torch.arange(logits.shape[-1]) == 3, float("-inf")).softmax(-1).topk(self.top_k, -1)
    return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), idx


def test_an_expert_no_token_reaches_is_rounded_to_nearest(moe_model, tmp_path, monkeypatch):
    """A router that never picks expert 3 (as a rarely used expert is never picked by a small
    calibration set): AWQ searches the others and rounds that one to nearest, saying why, and
    SmoothQuant scales it with the rest, which keeps it exact."""
    family, path, model = moe_model

    monkeypatch.setattr(type(model.model.layers[0].mlp.gate), "forward", _never_expert_3)
    recipe = recipe_on(path, "smoothquant: {alpha: 0.5}", "awq: {scheme: W4A16, weights: {group_size: 16}, grid: 3, clip_grid: 2}",
                       samples=4)
    report = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    layers = report["layers"]
    for block in range(2):
        for part in ("gate_proj", "up_proj", "down_proj"):
            starved = layers[f"model.layers.{block}.mlp.experts.3.{part}"]
            assert starved["tokens"] == 0 and "round-to-nearest" in starved["note"]
            assert layers[f"model.layers.{block}.mlp.experts.0.{part}"]["tokens"] > 0
    # the summary counts every layer quantized, the ones rounded to nearest for want of tokens too
    summary = report["stages"][1]["summary"]
    assert summary["rtn_no_tokens"] == 2 * 3
    assert summary["layers"] == sum(1 for r in layers.values() if r.get("stage") == "awq")


@pytest.mark.parametrize("stage", ["wanda: {sparsity: 0.5}", "sparsegpt: {sparsity: 0.5}"])
def test_an_expert_no_token_reaches_is_pruned_by_magnitude_and_counted(moe_model, stage, tmp_path, monkeypatch):
    family, path, model = moe_model
    monkeypatch.setattr(type(model.model.layers[0].mlp.gate), "forward", _never_expert_3)
    report = run_recipe(recipe_on(path, stage, samples=4), output=str(tmp_path / "out"), device="cpu")
    starved = [r for n, r in report["layers"].items() if ".experts.3." in n]
    assert len(starved) == 2 * 3 and all(r["tokens"] == 0 and "magnitude pruning" in r["note"] for r in starved)
    assert report["stages"][0]["summary"]["magnitude_fallback"] == 2 * 3


def test_an_unreached_experts_nvfp4_gate_and_up_share_one_global_scale(moe_model, tmp_path, monkeypatch):
    """NVFP4 with AWQ, a router that never picks expert 3, whose gate weights are 8x its up
    weights (two binades apart): its round-to-nearest fallback uses one global scale for gate and
    up, as every searched expert does, and the checkpoint stores that one for both (vLLM fuses them
    into one w13 and expects one scale)."""
    family, path, model = moe_model
    swaps = unfuse_experts(model)
    with torch.no_grad():
        for block in model.model.layers:
            block.mlp.experts[3].gate_proj.weight.mul_(8)
    fuse_experts(swaps)
    model.save_pretrained(path)
    monkeypatch.setattr(type(model.model.layers[0].mlp.gate), "forward", _never_expert_3)
    out = tmp_path / "out"
    layers = run_recipe(recipe_on(path, "awq: {scheme: NVFP4A16, grid: 3, clip_grid: 2}", samples=4), output=str(out),
                        device="cpu")["layers"]
    stored = {}
    for file in out.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            stored.update({k: float(f.get_tensor(k)) for k in f.keys() if k.endswith("weight_global_scale")})
    for block in range(2):
        expert = f"model.layers.{block}.mlp.experts.3"
        gate, up = layers[f"{expert}.gate_proj"], layers[f"{expert}.up_proj"]
        assert gate["tokens"] == 0 and gate["global_scale"] == up["global_scale"]
        # Mixtral's checkpoint keeps its original names (w1 gate, w3 up)
        gate_key, up_key = ((f"model.layers.{block}.block_sparse_moe.experts.3.w1", f"model.layers.{block}.block_sparse_moe.experts.3.w3")
                            if family == "mixtral" else (f"{expert}.gate_proj", f"{expert}.up_proj"))
        assert stored[f"{gate_key}.weight_global_scale"] == stored[f"{up_key}.weight_global_scale"] == gate["global_scale"]


@pytest.mark.parametrize("stage", ["rtn", "gptq"])
def test_an_expert_no_token_reaches_takes_its_siblings_static_input_range(moe_model, tmp_path, monkeypatch, stage):
    """W8A8 with static per-tensor input ranges, a router that never picks expert 3: that expert's
    layers get the union of the other experts' observed ranges (they read the same hidden states,
    routed elsewhere), so every expert is W8A8 alike and the note says where the range came from."""
    family, path, model = moe_model

    monkeypatch.setattr(type(model.model.layers[0].mlp.gate), "forward", _never_expert_3)
    recipe = recipe_on(path, f"{stage}: {{scheme: W8A8, input_activations: {{strategy: tensor, dynamic: false}}}}", samples=4)
    layers = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")["layers"]
    for block in range(2):
        for part in ("gate_proj", "up_proj", "down_proj"):
            starved = layers[f"model.layers.{block}.mlp.experts.3.{part}"]
            others = [layers[f"model.layers.{block}.mlp.experts.{e}.{part}"]["activation_range"] for e in range(3)]
            assert starved["activation_range"] == [min(lo for lo, _ in others), max(hi for _, hi in others)]
            assert starved["input_activations"]["dynamic"] is False and "sibling experts" in starved["note"]


def test_a_block_moved_away_and_back_keeps_its_memory(moe_model):
    """engine.returned_home, the way back from the GPU (test_cuda runs it there): the values a
    block ends with are copied into the memory its tensors had, so unfused experts stay views of
    the fused parameters, and RAM is not allocated again block after block. Here the move is a copy
    into new memory on the CPU."""
    from compress.engine import returned_home

    _, _, model = moe_model
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj
    inter = gate_up.shape[1] // 2
    swaps = unfuse_experts(model)
    block = model.model.layers[0]
    before = {n: t.data_ptr() for n, t in list(block.named_parameters()) + list(block.named_buffers())}

    def move():
        for module in block.modules():
            for p in module._parameters.values():
                if p is not None:
                    p.data = p.data.clone()
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.clone()

    expert = block.mlp.experts[2]
    with returned_home(block, move):
        assert expert.up_proj.weight.data_ptr() != gate_up[2, inter:].data_ptr()
        with torch.no_grad():
            expert.up_proj.weight.add_(1.0)
            expected = expert.up_proj.weight.clone()
    after = {n: t.data_ptr() for n, t in list(block.named_parameters()) + list(block.named_buffers())}
    assert after == before and torch.equal(gate_up[2, inter:], expected)
    fuse_experts(swaps)


def test_plan_shows_every_expert_layer_and_refuses_what_the_run_refuses(moe_model, tmp_path, capsys, monkeypatch):
    """`compress plan` sees the layers the stages see (each expert's), so its size estimate is
    the checkpoint's; and a recipe the run would refuse (mlp-channels pruning of experts) is
    refused by the plan and by the run before any stage works, not after the stages before it."""
    import json

    from compress.cli import main
    from compress.stages.gptq import GPTQ

    family, path, _ = moe_model
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {path}\ncalibration: {{dataset: calibration/default.txt, num_samples: 2, seq_len: 64}}\n"
                      "stages:\n  - rtn: {scheme: W4A16, weights: {group_size: 16}}\n")
    assert main(["--json", "plan", "--recipe", str(recipe)]) == 0
    plan = json.loads(capsys.readouterr().out)
    experts = [n for n in plan["assignments"] if ".experts." in n]
    assert len(experts) == 2 * 4 * 3 and plan["format"] == "packed" and not plan["refusals"]
    report = run_recipe(parse_recipe(recipe.read_text(), "test"), output=str(tmp_path / "out"), device="cpu")
    written = report["output"]["bytes_on_disk"]
    assert abs(plan["estimates"]["output_bytes_packed"] - written) < 0.05 * written

    recipe.write_text(f"model: {path}\ncalibration: {{dataset: calibration/default.txt, num_samples: 2, seq_len: 64}}\n"
                      "stages:\n  - gptq: {scheme: W4A16}\n  - structured: {structure: mlp-channels, ratio: 0.25}\n")
    assert main(["--json", "plan", "--recipe", str(recipe)]) == 2
    refused = json.loads(capsys.readouterr().out)
    assert refused["exit_code"] == 2 and "mlp-channels pruning is not supported" in refused["error"]
    monkeypatch.setattr(GPTQ, "apply", lambda *a: pytest.fail("a stage ran"))
    assert main(["quantize", "--recipe", str(recipe), "--output", str(tmp_path / "refused")]) == 2
    assert "mlp-channels pruning is not supported" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    # offload: disk, which cannot stream fused experts, is refused by the plan as by the run (the plan passed it)
    recipe.write_text(f"model: {path}\ncalibration: {{dataset: calibration/default.txt, num_samples: 2, seq_len: 64}}\n"
                      "offload: disk\nstages:\n  - gptq: {scheme: W4A16}\n")
    assert main(["--json", "plan", "--recipe", str(recipe)]) == 2
    assert "offload: disk does not support mixture-of-experts models" in json.loads(capsys.readouterr().out)["error"]
    assert main(["quantize", "--recipe", str(recipe), "--output", str(tmp_path / "refused")]) == 2
    assert "offload: disk does not support mixture-of-experts models" in capsys.readouterr().err


def test_training_stopped_and_resumed_on_experts_equals_the_run_never_stopped(moe_model, tmp_path, monkeypatch):
    """Training checkpoints hold the experts fused: unfused they are views sharing the fused
    parameters' memory, of which accelerate's safetensors writer keeps one tensor and drops the
    rest. Distillation stopped after step 3 (a checkpoint at step 2) and resumed gives the weights
    of the run that never stopped, bit for bit on the CPU."""
    from safetensors.torch import load_file

    import compress.stages.distill as distill
    from compress.training import TrainingStopped

    family, path, _ = moe_model
    text = (f"model: {path}\ncalibration: {{dataset: calibration/default.txt, num_samples: 24, seq_len: 32}}\n"
            "stages:\n  - distill:\n      data: {seq_len: 32, num_samples: 16, eval_samples: 4}\n"
            "      train: {steps: 4, batch_size: 4, lr: 1e-3, warmup: 0, eval_every: 0, save_every: 2}\n")
    run_recipe(parse_recipe(text, "t"), output=str(tmp_path / "whole"), device="cpu")
    train = distill.train
    monkeypatch.setattr(distill, "train", lambda *a, **k: train(*a, **{**k, "stop_after": 3}))
    with pytest.raises(TrainingStopped):
        run_recipe(parse_recipe(text, "t"), output=str(tmp_path / "resumed"), device="cpu")
    monkeypatch.setattr(distill, "train", train)
    report = run_recipe(parse_recipe(text, "t"), output=str(tmp_path / "resumed"), device="cpu", resume=True)
    assert report["stages"][0]["summary"]["resumed_from_step"] == 2
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_targeted_lm_head_on_a_model_that_reports_router_logits(moe_model, tmp_path):
    """A MoE config with output_router_logits (common in fine-tuned checkpoints): the run of the
    layers outside the blocks does not run the routers, so it must not ask for their loss either
    (it failed with an IndexError in transformers' load-balancing loss)."""
    family, path, model = moe_model
    model.config.output_router_logits = True
    model.save_pretrained(path)
    report = run_recipe(recipe_on(path, "gptq: {scheme: W4A16, weights: {group_size: 16}, ignore: []}", samples=4),
                        output=str(tmp_path / "out"), device="cpu")
    assert report["stages"][0]["summary"]["outside_blocks"] == ["lm_head"]
    assert report["layers"]["lm_head"]["gptq_loss"] < report["layers"]["lm_head"]["rtn_loss"]
