"""Structured pruning (compress/stages/structured.py): the saved model really is smaller, loads with
plain transformers and computes what the pruned model computed in memory; importance ranks what it
should; heads keep GQA consistent; blocks go with their cache indices renumbered."""

import json
import re

import pytest
import torch
from transformers import (AutoModel, AutoModelForCausalLM, AutoTokenizer, Gemma2Config, Gemma2ForCausalLM,
                          Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig, GemmaForCausalLM, LlamaConfig,
                          LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

from compress import modeling, parse_recipe, run_recipe
from compress.calibration import build_calibration
from compress.errors import CompressError
from compress.stages.base import StageContext
from compress.stages.structured import Structured, group_importance, keep_most_important, prune_inputs, prune_outputs
from tests.test_model_families import FAMILIES, NEWER_FAMILIES, V

CAL = "{dataset: calibration/default.txt, num_samples: 4, seq_len: 32}"


def save_tiny(model, path):
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
    return path


def prune_recipe(path, structure: str, ratio: float, extra: str = ""):
    return parse_recipe(f"model: {path}\ncalibration: {CAL}\nstages:\n  - structured: {{structure: {structure}, ratio: {ratio}}}\n{extra}", "test")


def prune_in_memory(ref: str, recipe, **stage):
    """The same stage applied to a freshly loaded model, with the recipe's calibration set."""
    net, tok, _ = modeling.load_model(ref, device="cpu")
    ctx = StageContext(device=torch.device("cpu"), calibration=build_calibration(recipe.calibration, tok))
    summary = Structured(**stage).apply(net, ctx)
    return net, summary


def ids(n=2, length=20, seed=0):
    return torch.randint(0, V, (n, length), generator=torch.Generator().manual_seed(seed))


def weight_bytes(path):
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


# ---------------------------------------------------------------------------------------------
# mlp-channels on every family: smaller checkpoint, plain reload, same outputs

MLP_WIDTH = {"llama": "intermediate_size", "opt": "ffn_dim", "gpt2": "n_inner", "bert": "intermediate_size",
             "gemma3": "intermediate_size", "phi3": "intermediate_size"}


@pytest.mark.parametrize("family", list(MLP_WIDTH))
def test_mlp_channels_shrink_and_reload(family, tmp_path):
    torch.manual_seed(0)
    path = save_tiny({**FAMILIES, **NEWER_FAMILIES}[family]().eval(), tmp_path / family)
    width = 96 if family != "gpt2" else 4 * 64
    recipe = prune_recipe(path, "mlp-channels", 0.25)
    report = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    assert report["format"]["reason"] == "no layer is quantized: nothing to pack"  # and no sparsity to mention

    cls = AutoModel if family == "bert" else AutoModelForCausalLM
    saved = cls.from_pretrained(tmp_path / "out").eval()  # plain transformers
    assert getattr(saved.config, MLP_WIDTH[family]) == width * 3 // 4
    assert 0 < weight_bytes(tmp_path / "out") < weight_bytes(path)
    summary = report["stages"][0]["summary"]
    assert summary["parameters_after"] == modeling.count_parameters(saved) == report["output"]["parameters"]
    assert summary["parameters_after"] < summary["parameters_before"] == report["source_model"]["parameters"]
    assert summary["non_embedding_removed_pct"] > summary["parameters_removed_pct"] > 0
    down = next(n for n, r in report["layers"].items() if "kept_channels" in r)
    assert len(report["layers"][down]["kept_channels"]) == width * 3 // 4
    # every layer the cut reshaped is in the report with its new shape (inspect lists them)
    reshaped = {n: r["shape"] for n, r in report["layers"].items() if r.get("stage") == "structured"}
    assert len(reshaped) == {"gpt2": 2, "opt": 2, "bert": 2, "phi3": 2}.get(family, 3) * saved.config.num_hidden_layers
    assert all({width * 3 // 4, width * 3 // 2} & set(shape) for shape in reshaped.values())  # Phi-3: [gate; up] stacked

    pruned, _ = prune_in_memory(str(path), recipe, structure="mlp-channels", ratio=0.25)
    with torch.no_grad():
        a, b = pruned(input_ids=ids()), saved(input_ids=ids())
    key = "last_hidden_state" if family == "bert" else "logits"
    assert torch.equal(a[key], b[key])


def test_ref_llama_mlp25(tmp_path, repo):
    """The bar: 25 % of ref-llama's MLP channels out removes ≥ 15 % of its block parameters; the
    bf16 checkpoint reloads with plain transformers and matches the model pruned in memory."""
    recipe = prune_recipe("default", "mlp-channels", 0.25,
                          f"evaluation: {{datasets: [{repo / 'calibration/heldout-tinyshakespeare.txt'}], max_windows: 4}}\n")
    out = tmp_path / "out"
    report = run_recipe(recipe, output=str(out), device="cpu")
    s = report["stages"][0]["summary"]
    assert s["parameters_before"] == 3_803_392 and s["parameters_after"] == 3_803_392 - 4 * 3 * 256 * 160
    assert s["non_embedding_removed_pct"] > 15 and 12 < s["parameters_removed_pct"] < 14
    assert s["kept_per_block"] == "480 of 640 MLP channels"
    assert weight_bytes(out) < 0.9 * weight_bytes(modeling.DEFAULT_MODEL_DIR)
    ev = next(iter(report["evaluation"].values()))
    assert 0 < ev["kl_divergence"] < 1 and ev["top1_agreement"] > 0.5
    md = (out / "report.md").read_text()
    assert "parameters_after" in md
    # the cut layers carry no quantization error: shown as '-', not nan
    rows = [line for line in md.splitlines() if line.startswith("| model.layers.")]
    assert rows and all(line.split("|")[5].strip() == "-" for line in rows) and "nan" not in md

    saved = AutoModelForCausalLM.from_pretrained(out).eval()
    assert saved.config.intermediate_size == 480 and saved.model.layers[0].mlp.down_proj.weight.shape == (256, 480)
    reloaded, _, _ = modeling.load_model(str(out))  # and through compress
    pruned, _ = prune_in_memory("default", recipe, structure="mlp-channels", ratio=0.25)
    with torch.no_grad():
        expected = pruned(input_ids=ids()).logits
        assert torch.equal(saved(input_ids=ids()).logits, expected)
        assert torch.equal(reloaded(input_ids=ids()).logits, expected)


# ---------------------------------------------------------------------------------------------
# Importance ranks: a structure that contributes nothing goes first, and removing it changes nothing


def tiny_llama(cls=LlamaForCausalLM, config=LlamaConfig, layers=2):
    torch.manual_seed(0)
    return cls(config(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V)).eval()


def calib_ctx(n=4, length=32):
    return StageContext(device=torch.device("cpu"), calibration=type("Cal", (), {"samples": [{"input_ids": ids(1, length, s)} for s in range(n)]})())


def test_dead_channel_is_removed_first_and_changes_nothing():
    model = tiny_llama()
    for layer in model.model.layers:  # channel 7 never activates: silu(0) · 0
        layer.mlp.gate_proj.weight.data[7] = 0
        layer.mlp.up_proj.weight.data[7] = 0
    with torch.no_grad():
        before = model(input_ids=ids()).logits
    ctx = calib_ctx()
    Structured(structure="mlp-channels", ratio=1 / 96).apply(model, ctx)  # rounds to 1 channel
    for i, layer in enumerate(model.model.layers):
        assert layer.mlp.down_proj.weight.shape == (64, 95) and layer.mlp.intermediate_size == 95
        assert ctx.layers[f"model.layers.{i}.mlp.down_proj"]["kept_channels"] == [c for c in range(96) if c != 7]
    assert model.config.intermediate_size == 95
    with torch.no_grad():
        after = model(input_ids=ids()).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_heads_remove_a_silent_kv_group_and_generate(family, tmp_path):
    model = tiny_llama() if family == "llama" else tiny_llama(Qwen2ForCausalLM, Qwen2Config)
    for layer in model.model.layers:  # KV head 1 carries zero values: its query heads 2, 3 output nothing
        layer.self_attn.v_proj.weight.data[16:32] = 0
        if layer.self_attn.v_proj.bias is not None:
            layer.self_attn.v_proj.bias.data[16:32] = 0
    prompt = ids(1, 6, seed=3)
    with torch.no_grad():
        before = model(input_ids=ids()).logits
        gen_before = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    summary = Structured(structure="heads", ratio=0.5).apply(model, calib_ctx())
    c = model.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (2, 1, 16)
    assert summary["kept_per_block"].startswith("1 of 2 KV groups")
    for layer in model.model.layers:
        a = layer.self_attn
        assert a.q_proj.weight.shape == (32, 64) and a.k_proj.weight.shape == (16, 64) and a.o_proj.weight.shape == (64, 32)
        assert a.num_key_value_groups == 2
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids()).logits, before, rtol=0, atol=1e-5)
        assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0), gen_before)
    model.save_pretrained(tmp_path)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(saved(input_ids=ids()).logits, model(input_ids=ids()).logits)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_blocks_drop_the_identity_block(family, tmp_path):
    model = tiny_llama(layers=3) if family == "llama" else tiny_llama(Qwen2ForCausalLM, Qwen2Config, layers=3)
    block = model.model.layers[1]  # writes nothing to the residual stream: output = input
    block.self_attn.o_proj.weight.data.zero_()
    block.mlp.down_proj.weight.data.zero_()
    prompt = ids(1, 6, seed=3)
    with torch.no_grad():
        before = model(input_ids=ids()).logits
        gen_before = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    summary = Structured(structure="blocks", ratio=0.34).apply(model, calib_ctx())
    assert summary["removed_blocks"] == [1] and summary["block_importance"][1] == pytest.approx(0, abs=1e-6)
    assert model.config.num_hidden_layers == len(model.model.layers) == 2
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1]
    if family == "qwen2":
        assert model.config.layer_types == ["full_attention"] * 2
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids()).logits, before, rtol=0, atol=1e-5)
        assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0), gen_before)
    model.save_pretrained(tmp_path)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(saved(input_ids=ids()).logits, model(input_ids=ids()).logits)


@pytest.mark.parametrize("family", ["gpt2", "opt", "bert"])
def test_blocks_on_other_families(family, tmp_path):
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    summary = Structured(structure="blocks", ratio=0.5).apply(model, calib_ctx())
    assert len(summary["removed_blocks"]) == 1 and model.config.num_hidden_layers == 1
    model.save_pretrained(tmp_path)
    saved = (AutoModel if family == "bert" else AutoModelForCausalLM).from_pretrained(tmp_path).eval()
    key = "last_hidden_state" if family == "bert" else "logits"
    with torch.no_grad():
        assert torch.equal(saved(input_ids=ids())[key], model(input_ids=ids())[key])


# ---------------------------------------------------------------------------------------------
# Newer layouts: Qwen3 and Gemma 3 (per-head q/k norms), Gemma 2 and 3 (norms after attention and
# MLP, sliding-window layers beside global ones), Phi-3 ([gate; up] and [q; k; v] fused). In each,
# a structure that contributes nothing is the one removed, and removing it changes nothing, in
# memory, in generation and after a plain reload.

NEWER = {"qwen3": (Qwen3ForCausalLM, Qwen3Config), "gemma": (GemmaForCausalLM, GemmaConfig),
         "gemma2": (Gemma2ForCausalLM, Gemma2Config), "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig),
         "phi3": (Phi3ForCausalLM, Phi3Config)}
MOE = {"mixtral": (MixtralForCausalLM, MixtralConfig, {"num_local_experts": 4}),
       # every other layer has experts: which kept layers do must be rewritten when blocks go
       "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig, {"num_experts": 4, "moe_intermediate_size": 48,
                                                           "shared_expert_intermediate_size": 96, "decoder_sparse_step": 2}),
       "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig, {"num_experts": 4, "moe_intermediate_size": 48})}


def tiny_newer(family: str, layers: int = 3):
    cls, config, extra = (*NEWER[family], {}) if family in NEWER else MOE[family]
    extra = {**extra, "head_dim": 16} if family != "phi3" else {}
    if family in MOE:
        extra["num_experts_per_tok"] = 2
    if family in ("gemma2", "gemma3"):  # a window shorter than the inputs, so local and global layers differ
        extra.update(sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"][:layers])
    torch.manual_seed(0)
    return cls(config(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, pad_token_id=0, bos_token_id=2, eos_token_id=1, **extra)).eval()


def assert_unchanged_and_reloads(model, before, gen_before, prompt, path):
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids(length=24)).logits, before, rtol=0, atol=1e-5)
        assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0), gen_before)
    model.save_pretrained(path)
    saved = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        assert torch.equal(saved(input_ids=ids(length=24)).logits, model(input_ids=ids(length=24)).logits)
    return saved


def outputs(model, prompt):
    with torch.no_grad():
        return model(input_ids=ids(length=24)).logits, model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("family", list(NEWER))
def test_newer_layouts_mlp_channels(family, tmp_path):
    model, prompt = tiny_newer(family, layers=2), ids(1, 6, seed=3)
    for layer in model.model.layers:  # channel 7 never activates: act(0) · 0
        mlp = layer.mlp
        for w in ([mlp.gate_up_proj.weight] if family == "phi3" else [mlp.gate_proj.weight, mlp.up_proj.weight]):
            w.data[7] = 0
            if family == "phi3":
                w.data[96 + 7] = 0  # its up row, in the second half
    before, gen_before = outputs(model, prompt)
    ctx = calib_ctx()
    Structured(structure="mlp-channels", ratio=1 / 96).apply(model, ctx)
    for i, layer in enumerate(model.model.layers):
        assert ctx.layers[f"model.layers.{i}.mlp.down_proj"]["kept_channels"] == [c for c in range(96) if c != 7]
        assert layer.mlp.down_proj.weight.shape == (64, 95)
        if family == "phi3":
            assert layer.mlp.gate_up_proj.weight.shape == (190, 64)
    saved = assert_unchanged_and_reloads(model, before, gen_before, prompt, tmp_path)
    assert saved.config.intermediate_size == 95


@pytest.mark.parametrize("family", list(NEWER) + list(MOE))
def test_newer_layouts_heads(family, tmp_path):
    model, prompt = tiny_newer(family, layers=2), ids(1, 6, seed=3)
    for layer in model.model.layers:  # KV head 1 carries zero values: its query heads 2, 3 output nothing
        a = layer.self_attn
        if family == "phi3":
            a.qkv_proj.weight.data[64 + 32 + 16: 64 + 32 + 32] = 0  # [q (4·16); k (2·16); v (2·16)]
        else:
            a.v_proj.weight.data[16:32] = 0
    before, gen_before = outputs(model, prompt)
    summary = Structured(structure="heads", ratio=0.5).apply(model, calib_ctx())
    assert summary["kept_per_block"].startswith("1 of 2 KV groups")
    c = model.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (2, 1, 16)
    for layer in model.model.layers:
        a = layer.self_attn
        assert a.o_proj.weight.shape == (64, 32)
        if family == "phi3":
            assert a.qkv_proj.weight.shape == (32 + 16 + 16, 64)
        else:
            assert a.q_proj.weight.shape == (32, 64) and a.k_proj.weight.shape == a.v_proj.weight.shape == (16, 64)
    saved = assert_unchanged_and_reloads(model, before, gen_before, prompt, tmp_path)
    assert (saved.config.num_attention_heads, saved.config.num_key_value_heads) == (2, 1)


@pytest.mark.parametrize("family", list(NEWER) + list(MOE))
def test_newer_layouts_blocks(family, tmp_path):
    model, prompt = tiny_newer(family, layers=3), ids(1, 6, seed=3)
    # Qwen2-MoE here: block 0 dense, 1 with experts, 2 dense; dropping block 0 leaves experts first
    drop = 0 if family == "qwen2_moe" else 1
    block = model.model.layers[drop]  # writes nothing to the residual stream (Gemma 2/3 normalize zero to zero)
    block.self_attn.o_proj.weight.data.zero_()
    for name, p in block.mlp.named_parameters():
        if "down_proj" in name:  # the MLP's, or every expert's and the shared expert's
            p.data.zero_()
    types = getattr(model.config, "layer_types", None)
    before, gen_before = outputs(model, prompt)
    summary = Structured(structure="blocks", ratio=0.34).apply(model, calib_ctx())
    assert summary["removed_blocks"] == [drop]
    kept = [i for i in range(3) if i != drop]
    assert model.config.num_hidden_layers == len(model.model.layers) == 2
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1]
    if types is not None:  # the kept layers keep their kind (the sliding one after the cut stays sliding)
        assert model.config.layer_types == [types[i] for i in kept]
    if family == "qwen2_moe":
        assert (model.config.mlp_only_layers, model.config.decoder_sparse_step) == ([1], 1)
    saved = assert_unchanged_and_reloads(model, before, gen_before, prompt, tmp_path)
    assert saved.config.num_hidden_layers == 2


def test_distillation_into_kept_layers_rewrites_which_have_experts(tmp_path):
    """distill's keep_layers removes blocks as the structured stage does, config included: Qwen2-MoE
    with experts every other layer (0 dense, 1 experts, 2 dense), keeping 1 and 2, has experts first."""
    from compress.stages.distill import keep_blocks

    model, prompt = tiny_newer("qwen2_moe", layers=3), ids(1, 6, seed=3)
    block = model.model.layers[0]  # writes nothing to the residual stream: removing it changes nothing
    block.self_attn.o_proj.weight.data.zero_()
    block.mlp.down_proj.weight.data.zero_()
    before, gen_before = outputs(model, prompt)
    records = {"model.layers.2.mlp.down_proj": {"weights": None}, "model.layers.0.mlp.down_proj": {}}
    keep_blocks(model, [1, 2], records, "distill")
    assert list(records) == ["model.layers.1.mlp.down_proj"]  # records follow their block; the removed one's go
    assert (model.config.mlp_only_layers, model.config.decoder_sparse_step) == ([1], 1)
    saved = assert_unchanged_and_reloads(model, before, gen_before, prompt, tmp_path)
    assert saved.config.num_hidden_layers == 2


def test_stages_after_removing_blocks_that_differ_are_not_judged_on_a_guess(tmp_path, capsys):
    """Qwen2-MoE here has dense MLPs (96 wide) in blocks 0 and 2 and experts in block 1: which
    blocks calibration removes decides the widths left, so what comes after is checked when it
    starts, not refused up front on the first blocks standing in (the plan says it guesses)."""
    from compress.cli import main
    from compress.pipeline import preflight

    model = tiny_newer("qwen2_moe", layers=3)
    text = ("calibration: {dataset: calibration/default.txt, num_samples: 2, seq_len: 32}\nformat: packed\nstages:\n"
            "  - structured: {structure: blocks, ratio: 0.34}\n  - rtn: {scheme: W4A16, weights: {group_size: 64}, targets: ['re:.*mlp.*']}\n")
    assert preflight(parse_recipe(text, "t"), model, packed=True) == []
    # the same on a model whose blocks are alike is exact: the dense 96-wide MLPs cannot be packed in groups of 64
    assert "96 input features" in str(preflight(parse_recipe(text, "t"), tiny_newer("qwen3"), packed=True)[0])
    model.save_pretrained(tmp_path / "m")
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(tmp_path / "m")
    (tmp_path / "r.yaml").write_text(text)
    assert main(["--json", "plan", "--recipe", str(tmp_path / "r.yaml"), "--model", str(tmp_path / "m")]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert any("planned on a guess" in w for w in plan["warnings"]) and "decided when saving" in plan["format_reason"]
    # what is known not to pack stays known: act-order GPTQ with scales chosen as columns are reached is written dense
    (tmp_path / "r.yaml").write_text(text.replace("format: packed\n", "").replace(
        "rtn: {scheme: W4A16, weights: {group_size: 64}", "gptq: {scheme: W4A16, weights: {group_size: 16}, actorder: true"))
    assert main(["--json", "plan", "--recipe", str(tmp_path / "r.yaml"), "--model", str(tmp_path / "m")]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["format"] == "dense" and "actorder: group" in plan["format_reason"]


def test_mixture_of_experts_mlp_channels_are_refused():
    with pytest.raises(CompressError, match="mlp-channels pruning is not supported for the mixture-of-experts 'mixtral'.*heads or blocks"):
        Structured(structure="mlp-channels", ratio=0.25).apply(tiny_newer("mixtral"), calib_ctx())


# ---------------------------------------------------------------------------------------------
# The math alone, and clear errors


def test_math():
    assert keep_most_important(torch.tensor([3.0, 1.0, 1.0, 2.0]), 2).tolist() == [0, 3]  # ties: lower index goes
    # 4 query heads over 2 KV heads: heads 0, 1 read KV head 0
    assert group_importance(torch.tensor([1.0, 2.0, 3.0, 4.0]) * 10, 10, 2).tolist() == [3.0, 7.0]
    from transformers.pytorch_utils import Conv1D

    lin, conv = torch.nn.Linear(6, 5), Conv1D(5, 6)
    conv.weight.data = lin.weight.data.t().clone()
    conv.bias.data = lin.bias.data.clone()
    for f in (prune_outputs, prune_inputs):
        idx = torch.tensor([0, 2, 3])
        f(lin, idx)
        f(conv, idx)
    x = torch.randn(2, 3)
    assert lin.weight.shape == (3, 3) and (conv.nx, conv.nf) == (3, 3)
    torch.testing.assert_close(lin(x), conv(x))


@pytest.mark.parametrize("structure,ratio,words", [
    ("blocks", 0.1, "removes nothing"),          # 0.2 of 2 blocks
    ("blocks", 0.8, "removes all of them"),      # 1.6 -> 2 of 2
    ("heads", 0.2, "removes nothing"),           # 0.4 of 2 KV groups
    ("mlp-channels", 0.999, "removes all of them"),
])
def test_ratio_rounding_to_nothing_or_everything(structure, ratio, words):
    with pytest.raises(CompressError, match=words):
        Structured(structure=structure, ratio=ratio).apply(tiny_llama(), calib_ctx())


@pytest.mark.parametrize("multiple_of,ratio,kept", [(None, 0.001, ("95", "1")), (16, 0.05, ("80", "16")),
                                                    (16, 0.95, ("80", "16"))])
def test_the_ratios_a_refusal_suggests_work(multiple_of, ratio, kept):
    """With multiple_of 64 on 640 channels, ratio 0.04 was refused with 'e.g. 0.00156 to 0.998',
    two ratios that keep a multiple of 64 by removing nothing and everything: refused again."""
    with pytest.raises(CompressError) as refused:
        Structured(structure="mlp-channels", ratio=ratio, multiple_of=multiple_of).apply(tiny_llama(), calib_ctx())
    low, high = re.search(r"([0-9.]+) to ([0-9.]+)$", refused.value.hint).groups()
    for suggested, keeps in zip((low, high), kept):
        summary = Structured(structure="mlp-channels", ratio=float(suggested), multiple_of=multiple_of).apply(
            tiny_llama(), calib_ctx())
        assert summary["kept_per_block"] == f"{keeps} of 96 MLP channels", (suggested, refused.value.hint)


def test_unsupported_combinations_name_the_architecture():
    # each structure's own families: mlp-channels was said to work on the mixture-of-experts ones
    with pytest.raises(CompressError, match=r"heads pruning is not supported for 'gpt2'.*heads: llama.*mlp-channels: (?:(?!mixtral)[^;])*; blocks: .*mixtral"):
        Structured(structure="heads", ratio=0.25).apply(FAMILIES["gpt2"]().eval(), calib_ctx())
    model = tiny_llama()
    model.config.model_type = "falcon"
    with pytest.raises(CompressError, match="architecture 'falcon' is not supported"):
        Structured(structure="mlp-channels", ratio=0.25).apply(model, calib_ctx())


def test_a_config_transformers_would_refuse_is_caught_before_any_work():
    # LlamaConfig wants hidden_size a multiple of the query heads: ref-llama's 8 heads in 4 KV
    # groups can lose 2 or 3 groups (4 or 2 heads), not 1 (6 heads).
    net, _, _ = modeling.load_model("default")
    with pytest.raises(CompressError, match=r"LlamaConfig rejects: The hidden size \(256\) is not a multiple.*0\.5, 0\.75"):
        Structured(structure="heads", ratio=0.25).apply(net, calib_ctx())
    assert net.config.num_attention_heads == 8 and net.model.layers[0].self_attn.q_proj.weight.shape == (256, 256)


def test_grouped_quantization_before_a_cut_is_refused():
    model, ctx = tiny_llama(), calib_ctx()
    from compress.stages.rtn import RoundToNearest

    RoundToNearest(scheme="W4A16", weights={"group_size": 16}).apply(model, ctx)
    with pytest.raises(CompressError, match="model.layers.0.mlp.down_proj was quantized in groups of 16.*before quantization"):
        Structured(structure="mlp-channels", ratio=0.25).apply(model, ctx)
    summary = Structured(structure="heads", ratio=0.5).apply(model, ctx)  # whole heads of 16 columns: groups intact
    assert summary["kept_per_block"].startswith("1 of 2")
    # a KV group takes its two query heads, 32 side-by-side input columns of o_proj: a group of 32
    # stays whole (the grid survives the cut exactly), one of 64 would be split
    from compress.quant import recover_qparams

    for group, allowed in ((32, True), (64, False)):
        model, ctx = tiny_llama(), calib_ctx()
        RoundToNearest(scheme="W4A16", weights={"group_size": group}).apply(model, ctx)
        if not allowed:
            with pytest.raises(CompressError, match=f"o_proj was quantized in groups of {group}"):
                Structured(structure="heads", ratio=0.5).apply(model, ctx)
            continue
        Structured(structure="heads", ratio=0.5).apply(model, ctx)
        for layer in model.model.layers:
            o_proj = layer.self_attn.o_proj.weight
            assert o_proj.shape == (64, 32) and recover_qparams(o_proj.detach(), 4, True, "group", group)[2] == 0


def test_fp8_tiles_before_a_cut_are_refused():
    """An FP8 tile spans rows and columns: removing channels or heads from any layer it covers
    (gate/up rows, down columns; q/k/v rows, o columns) leaves its scale on other weights.
    Removing whole blocks keeps every remaining layer's tiles."""
    from compress.stages.rtn import RoundToNearest

    for structure, ratio, layer in (("mlp-channels", 0.25, "mlp.gate_proj"), ("heads", 0.5, "self_attn.q_proj")):
        model, ctx = tiny_llama(), calib_ctx()
        RoundToNearest(scheme="FP8_BLOCK", weights={"block_structure": [16, 16]}).apply(model, ctx)
        with pytest.raises(CompressError, match=f"model.layers.0.{layer} was quantized in FP8 tiles of 16x16.*cuts through them"):
            Structured(structure=structure, ratio=ratio).apply(model, ctx)
    assert len(Structured(structure="blocks", ratio=0.5).apply(model, ctx)["removed_blocks"]) == 1


def test_recipe_validation(tmp_path):
    with pytest.raises(CompressError, match="ratio"):
        prune_recipe("default", "mlp-channels", 1.0)
    with pytest.raises(CompressError, match="structure"):
        prune_recipe("default", "neurons", 0.25)
    with pytest.raises(CompressError, match="offload: disk"):
        run_recipe(prune_recipe("default", "blocks", 0.25, "offload: disk\n"), output=str(tmp_path / "o"), device="cpu")


@pytest.mark.parametrize("stages,structure", [
    ("  - rtn: {scheme: W8A16}\n  - structured: {structure: mlp-channels, ratio: 0.25}\n", "mlp-channels"),
    ("  - rtn: {scheme: W8A16}\n  - structured: {structure: blocks, ratio: 0.5}\n", "blocks"),
    ("  - structured: {structure: heads, ratio: 0.5}\n  - rtn: {scheme: W4A16, weights: {group_size: 16}}\n", "heads"),
], ids=["rtn-then-mlp", "rtn-then-blocks", "heads-then-rtn"])
def test_with_quantization_the_records_follow_the_cut(stages, structure, tmp_path):
    """Quantize then prune, or prune then quantize: the report's layer shapes and quantized
    parameter count are those of the saved model."""
    path = save_tiny(tiny_llama(), tmp_path / "llama")
    report = run_recipe(parse_recipe(f"model: {path}\ncalibration: {CAL}\nstages:\n{stages}", "test"),
                        output=str(tmp_path / "out"), device="cpu")
    saved, _, _ = modeling.load_model(str(tmp_path / "out"))  # dense or packed (compressed-tensors)
    modules = dict(saved.named_modules())
    linear = {n: m for n, m in modules.items() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert set(n for n, r in report["layers"].items() if "weights" in r) == set(linear)
    for name, rec in report["layers"].items():
        assert tuple(rec["shape"]) == tuple(modules[name].weight.shape), name
    assert report["output"]["quantized_parameters"] == sum(m.weight.numel() for m in linear.values())


def test_inspect_names_the_blocks_removed(tmp_path, capsys):
    """Removing blocks leaves no layer record (the layers are gone, the rest unchanged): inspect
    says which blocks went rather than that nothing was pruned."""
    from compress.cli import main

    tiny_llama(layers=3).save_pretrained(tmp_path / "m")
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(tmp_path / "m")
    (tmp_path / "r.yaml").write_text("calibration: {dataset: calibration/default.txt, num_samples: 2, seq_len: 32}\n"
                                     "evaluation: {datasets: []}\nstages:\n  - structured: {structure: blocks, ratio: 0.34}\n")
    assert main(["--json", "quantize", "--recipe", str(tmp_path / "r.yaml"), "--model", str(tmp_path / "m"),
                 "--output", str(tmp_path / "out")]) == 0
    removed = json.loads(capsys.readouterr().out)["stages"][0]["summary"]["removed_blocks"]
    assert len(removed) == 1
    assert main(["inspect", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert f"blocks removed: {removed[0]} (1 of 3 blocks, by structured)" in text and "none quantized or pruned" not in text
    # and the run's own report.md says which, as report.json does (a list it left out of the stage table)
    assert f"removed_blocks [{removed[0]}]" in (tmp_path / "out" / "report.md").read_text()


def test_an_nm_pattern_before_a_cut_is_refused_only_where_the_cut_splits_its_runs():
    """2:4 then heads: a KV group's columns of o_proj (32 here) are whole runs of 4, so the pattern
    survives the cut (this was refused like any pattern); mlp-channels cut single columns: refused."""
    from compress.sparsity import check_nm
    from compress.stages.magnitude import Magnitude

    model, ctx = tiny_llama(), calib_ctx()
    Magnitude(pattern="2:4").apply(model, ctx)
    with pytest.raises(CompressError, match="down_proj was pruned 2:4.*breaks that layout"):
        Structured(structure="mlp-channels", ratio=0.25).apply(model, ctx)
    Structured(structure="heads", ratio=0.5).apply(model, ctx)
    for layer in model.model.layers:
        assert layer.self_attn.o_proj.weight.shape == (64, 32) and check_nm(layer.self_attn.o_proj.weight.detach(), 2, 4)


def test_blocks_removed_by_a_second_stage_are_numbered_as_in_the_input_model():
    """Two blocks stages: the second one's removed_blocks were indices into what the first left,
    so inspect printed "blocks removed: 0" twice where blocks 0 and 1 of the input had gone."""
    from compress.stages.structured import INPUT_INDEX

    model, ctx = tiny_llama(layers=4), calib_ctx()
    first = Structured(structure="blocks", ratio=0.25).apply(model, ctx)["removed_blocks"]
    second = Structured(structure="blocks", ratio=0.34).apply(model, ctx)["removed_blocks"]
    kept = [getattr(block, INPUT_INDEX) for block in model.model.layers]
    assert len(first) == len(second) == 1 and sorted(first + second + kept) == [0, 1, 2, 3]


def test_inspect_says_which_heads_and_channels_were_cut(tmp_path, capsys):
    """Heads and MLP channels: inspect showed only the layers' new shapes, nothing of the cut."""
    from compress.cli import main

    tiny_llama().save_pretrained(tmp_path / "m")
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(tmp_path / "m")
    (tmp_path / "r.yaml").write_text("calibration: {dataset: calibration/default.txt, num_samples: 2, seq_len: 32}\n"
                                     "evaluation: {datasets: []}\nstages:\n  - structured: {structure: heads, ratio: 0.5}\n"
                                     "  - structured: {structure: mlp-channels, ratio: 0.25}\n")
    assert main(["--quiet", "quantize", "--recipe", str(tmp_path / "r.yaml"), "--model", str(tmp_path / "m"),
                 "--output", str(tmp_path / "out")]) == 0
    assert main(["inspect", str(tmp_path / "out")]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "heads removed: 1 of 2 KV groups of heads per block; kept 1 of 2 KV groups" in text
    assert "mlp-channels removed: 24 of 96 MLP channels per block; kept 72 of 96 MLP channels" in text
    assert main(["--json", "inspect", str(tmp_path / "out")]) == 0
    layers = json.loads(capsys.readouterr().out)["summary"]["layers"]
    o_proj, down = layers["model.layers.0.self_attn.o_proj"], layers["model.layers.0.mlp.down_proj"]
    assert len(o_proj["kept_kv_heads"]) == 1 and len(o_proj["kept_heads"]) == 2 and len(down["kept_channels"]) == 72


def test_mlp_channels_kept_can_be_a_multiple_of_a_later_group_size(tmp_path):
    """ratio 0.25 of 96 keeps 72 channels, which a later W4 g16 stage cannot group (72 = 4.5 · 16),
    so the checkpoint was written dense; multiple_of: 16 keeps 80 (the nearest multiple; ties keep
    more) and the result packs."""
    model, ctx = tiny_llama(), calib_ctx()
    summary = Structured(structure="mlp-channels", ratio=0.25, multiple_of=16).apply(model, ctx)
    assert summary["kept_per_block"] == "80 of 96 MLP channels" and model.config.intermediate_size == 80
    assert Structured(structure="mlp-channels", ratio=0.3, multiple_of=16).apply(tiny_llama(), calib_ctx())["kept_per_block"] \
        == "64 of 96 MLP channels"  # 67.2 kept: 64 is nearer
    with pytest.raises(CompressError, match="keeping a multiple of 48 removes nothing"):  # 77 kept rounds to 96
        Structured(structure="mlp-channels", ratio=0.2, multiple_of=48).apply(tiny_llama(), calib_ctx())
    with pytest.raises(CompressError, match="multiple_of 96 is not below the 96 MLP channels"):  # 72 rounds to 96
        Structured(structure="mlp-channels", ratio=0.25, multiple_of=96).apply(tiny_llama(), calib_ctx())
    with pytest.raises(ValueError, match="multiple_of rounds the MLP channels kept; it does not apply to heads"):
        Structured(structure="heads", ratio=0.5, multiple_of=16)
    tiny_llama().save_pretrained(tmp_path / "m")
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(tmp_path / "m")
    recipe = ("calibration: {dataset: calibration/default.txt, num_samples: 2, seq_len: 32}\nstages:\n"
              "  - structured: {structure: mlp-channels, ratio: 0.25, multiple_of: 16}\n"
              "  - rtn: {scheme: W4A16, weights: {group_size: 16}}\n")
    report = run_recipe(parse_recipe(recipe, "t"), model=str(tmp_path / "m"), output=str(tmp_path / "out"), device="cpu")
    assert report["format"]["format"] == "packed"
    # the same from the command line
    from compress.cli import main

    assert main(["--quiet", "prune", "--model", str(tmp_path / "m"), "--structured", "mlp-channels", "--ratio", "0.25",
                 "--multiple-of", "16", "--num-samples", "2", "--no-eval", "--output", str(tmp_path / "cli")]) == 0
    assert json.loads((tmp_path / "cli/config.json").read_text())["intermediate_size"] == 80
