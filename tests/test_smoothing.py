"""AWQ and SmoothQuant: scaling is exact before quantization for every mapping table; smoothing
really helps W8A8 on outlier channels; AWQ's searches never lose to round-to-nearest on their
own objectives; AWQ then GPTQ chains in one recipe."""

import pytest
from safetensors.torch import load_file
import torch
from transformers import (AutoTokenizer, OPTConfig, OPTForCausalLM, Gemma2Config, Gemma2ForCausalLM, GemmaConfig, GemmaForCausalLM, LlamaConfig,
                          LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from compress import modeling, parse_recipe, run_recipe
from compress.quant import dequantize, fake_quantize, quantize, range_qparams
from compress.schemes import QuantArgs
from compress.stages.awq import clip_search, output_error
from compress.mappings import Mapping
from compress.stages.smoothquant import smoothing_scales

from tests.test_model_families import FAMILIES, NEWER_FAMILIES, V
from tests.test_moe import MOE, recipe_on

SMOOTHING_FAMILIES = {
    **FAMILIES,
    **NEWER_FAMILIES,
    # full multi-head attention, so that the v -> o mapping applies too
    "llama-mha": lambda: LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=V)),
    # Gemma 1 (Llama's map on norms that scale by 1 + weight) and 2 (pre- and post-norms), with MHA
    "gemma": lambda: GemmaForCausalLM(GemmaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
                                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=V,
                                                  pad_token_id=0, bos_token_id=2, eos_token_id=1)),
    # mixture-of-experts blocks: router, every expert, Qwen2-MoE's shared expert and its gate
    **MOE,
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                                            head_dim=16, vocab_size=V, num_experts=4, num_experts_per_tok=2)),
    # post-LN OPT (opt-350m): its norms follow the residual add, so only fc1 -> fc2 and v -> out
    "opt-post-ln": lambda: OPTForCausalLM(OPTConfig(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                                                    word_embed_proj_dim=64, vocab_size=V, max_position_embeddings=512,
                                                    do_layer_norm_before=False)),
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
                                                     num_attention_heads=4, num_key_value_heads=4, vocab_size=V,
                                                     sliding_window=8, pad_token_id=0, bos_token_id=2, eos_token_id=1)),
}


def save(model, path):
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)


def outputs(path, ids):
    net, _, config = modeling.load_model(str(path), dtype="float32")
    with torch.no_grad():
        out = net(input_ids=ids)
    return out.logits if modeling.is_causal_lm(config) else out.last_hidden_state


@pytest.mark.parametrize("family", list(SMOOTHING_FAMILIES))
@pytest.mark.parametrize("stage", ["smoothquant: {alpha: 0.5}", "awq: {scheme: W4A16, weights: {group_size: 32}, quantize: false, grid: 5}"])
def test_scaling_is_exact_before_quantization(family, stage, tmp_path):
    torch.manual_seed(0)
    model = SMOOTHING_FAMILIES[family]().eval()
    # Give the norms non-trivial weights so that folding scales into them is really exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name.lower() or name.endswith("ln_1.weight") or name.endswith("ln_2.weight"):
                p.mul_(torch.rand_like(p) + 0.5)
                if not p.any():  # Gemma's norms scale by 1 + weight, which starts at zero
                    p.uniform_(-0.5, 0.5)
    save(model, tmp_path / "in")
    recipe = recipe_on(tmp_path / "in", stage, samples=4)
    report = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(1))
    before, after = outputs(tmp_path / "in", ids), outputs(tmp_path / "out", ids)
    assert (after - before).norm() / before.norm() < 1e-4
    if stage.startswith("smoothquant"):
        smoothed = [n for n, r in report["layers"].items() if "smoothquant_alpha" in r]
        assert smoothed  # every table applies somewhere
        if family in ("llama-mha", "gemma", "gemma2"):
            assert any(n.endswith("o_proj") for n in smoothed)
        changed = report["stages"][0]["summary"]["mean_activation_max_ratio"]
        assert changed != 1.0
    else:  # the search must have chosen real scales somewhere, or exactness would be trivial
        assert any(r.get("awq_alpha") is not None for r in report["layers"].values())
    a, b = load_file(tmp_path / "in" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a if k in b)


def test_a_mapping_that_is_not_exact_is_refused(tmp_path):
    """Scales moved through SiLU (gate -> down in a Llama MLP) change the float model: the stage
    measures the inspected module's output before and after folding and stops with the block and
    mapping named, before anything is written."""
    from compress.errors import CompressError

    torch.manual_seed(0)
    save(SMOOTHING_FAMILIES["llama"]().eval(), tmp_path / "in")
    recipe = recipe_on(tmp_path / "in", "smoothquant: {mappings: [{smooth: mlp.gate_proj, balance: [mlp.down_proj], "
                                        "inspect: mlp.down_proj}]}", samples=4)
    with pytest.raises(CompressError, match=r"block 0: moving scales from mlp.gate_proj into mlp.down_proj changes .* not exact"):
        run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    assert not (tmp_path / "out").exists()


def test_a_mapping_leaving_a_reader_out_is_refused_whatever_it_inspects(tmp_path):
    """A map balancing gate_proj alone, inspecting gate_proj: the inspected output cannot change
    (gate_proj reads x / s with its columns times s), while up_proj, which reads the same norm and
    was left out, does. Both stages passed it and wrote a broken model (SmoothQuant: KL 0.72 to the
    original on ref-llama). The block's output is checked as well now."""
    from compress.errors import CompressError

    torch.manual_seed(0)
    save(SMOOTHING_FAMILIES["llama"]().eval(), tmp_path / "in")
    mapping = "mappings: [{smooth: post_attention_layernorm, balance: [mlp.gate_proj], inspect: mlp.gate_proj}]"
    for stage in (f"smoothquant: {{{mapping}}}", f"awq: {{scheme: W4A16, weights: {{group_size: 32}}, quantize: false, {mapping}}}"):
        with pytest.raises(CompressError, match=r"block 0: moving scales from post_attention_layernorm into mlp.gate_proj "
                                                r"changes .* not exact.*every module reading the smoothed op"):
            run_recipe(recipe_on(tmp_path / "in", stage, samples=4), output=str(tmp_path / "out"), device="cpu")
        assert not (tmp_path / "out").exists()


def test_a_fold_that_is_not_exact_is_refused_in_bfloat16_too(tmp_path):
    """Half precision allows for its rounding (exact folds measure about 3e-3 in bfloat16), but a
    limit of 8 of its steps (6e-2) let a post-LN OPT norm fold that moved every token 5 % through."""
    from compress.errors import CompressError

    torch.manual_seed(0)
    model = SMOOTHING_FAMILIES["opt-post-ln"]().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm.weight" in name:
                p.mul_(torch.rand_like(p) + 0.5)
    save(model.to(torch.bfloat16), tmp_path / "in")
    mapping = ("mappings: [{smooth: self_attn_layer_norm, balance: [self_attn.q_proj, self_attn.k_proj, self_attn.v_proj], "
               "inspect: self_attn}]")
    recipe = recipe_on(tmp_path / "in", f"awq: {{scheme: W4A16, weights: {{group_size: 32}}, quantize: false, {mapping}}}",
                       samples=4)
    with pytest.raises(CompressError, match=r"block 0: moving scales from self_attn_layer_norm .* by 5.0e-02 .* not exact"):
        run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")


def test_awq_refuses_a_map_that_is_not_exact_even_where_no_scaling_wins(tmp_path):
    """AWQ scored a map leaving a reader of the norm out (v_proj) badly for every α, kept s = 1 and
    folded nothing, so nothing checked it: the layers were silently plain round-to-nearest and counted
    as smoothed. The map is checked whatever α wins. The default map still runs, and counts only the
    layers it really scaled."""
    from compress.errors import CompressError

    torch.manual_seed(0)
    save(SMOOTHING_FAMILIES["llama"]().eval(), tmp_path / "in")
    for mapping in ("{smooth: input_layernorm, balance: [self_attn.q_proj, self_attn.k_proj], inspect: self_attn}",
                    "{smooth: mlp.gate_proj, balance: [mlp.down_proj], inspect: mlp.down_proj}"):
        recipe = recipe_on(tmp_path / "in", f"awq: {{scheme: W4A16, weights: {{group_size: 32}}, grid: 3, mappings: [{mapping}]}}",
                           samples=4)
        with pytest.raises(CompressError, match=r"block 0: moving scales from .* not exact"):
            run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
        assert not (tmp_path / "out").exists()
    report = run_recipe(recipe_on(tmp_path / "in", "awq: {scheme: W4A16, weights: {group_size: 32}, grid: 3}", samples=4),
                        output=str(tmp_path / "out"), device="cpu")
    scaled = [n for n, r in report["layers"].items() if r.get("awq_alpha") is not None]
    assert report["stages"][0]["summary"]["smoothed_layers"] == len(scaled)


def test_awq_rounds_the_layers_outside_the_blocks_and_refuses_activation_schemes(tmp_path):
    """A BERT pooler (or a targeted lm_head) lies in no smoothing map: AWQ left it in float and
    unreported, though the plan listed it. It is round-to-nearest now, with a note. And AWQ with an
    activation scheme wrote a weight-only model while its summary named the activations: refused,
    pointing to quantize: false and a stage that calibrates the activations."""
    from compress.errors import CompressError
    from compress.quant import fake_quantize

    torch.manual_seed(0)
    save(SMOOTHING_FAMILIES["bert"]().eval(), tmp_path / "in")
    recipe = recipe_on(tmp_path / "in", "awq: {scheme: W4A16, weights: {group_size: 32}, grid: 3}", samples=4)
    report = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    pooler = report["layers"]["pooler.dense"]
    assert pooler["stage"] == "awq" and "outside the transformer blocks" in pooler["note"]
    assert report["stages"][0]["summary"]["rtn_outside_blocks"] == 1
    assert report["stages"][0]["summary"]["layers"] == len(report["layers"])
    from compress import modeling

    before, _, _ = modeling.load_model(str(tmp_path / "in"))
    after, _, _ = modeling.load_model(str(tmp_path / "out"))
    W = before.pooler.dense.weight.detach()
    assert torch.equal(after.pooler.dense.weight.detach(), fake_quantize(W, 4, True, "group", 32))
    for scheme in ("NVFP4", "W8A8"):
        with pytest.raises(CompressError, match="AWQ quantizes weights only.*quantize: false"):
            recipe_on(tmp_path / "in", f"awq: {{scheme: {scheme}}}")
    recipe_on(tmp_path / "in", "awq: {scheme: W8A8, quantize: false}")  # scales only: the next stage quantizes


def test_a_mapping_naming_no_module_is_refused_before_calibration(tmp_path):
    from compress.errors import CompressError

    torch.manual_seed(0)
    save(SMOOTHING_FAMILIES["llama"]().eval(), tmp_path / "in")
    recipe = recipe_on(tmp_path / "in", "awq: {scheme: W4A16, mappings: [{smooth: post_attention_layernorm, "
                                        "balance: [mlp.gate_proj, mlp.upproj]}]}", samples=4)
    with pytest.raises(CompressError, match=r"post_attention_layernorm -> mlp.gate_proj, mlp.upproj names a module no "
                                             r"block has; block model.layers.0 holds .*mlp.up_proj \(Linear\)"):
        run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")


def test_a_mapping_between_different_widths_is_refused_before_calibration(tmp_path):
    """v_proj -> o_proj (llm-compressor's default Llama AWQ map) under grouped-query attention: v_proj
    gives fewer channels than o_proj reads. It was an internal error from inside the fold; it is a
    one-line refusal naming both widths, from the plan as from the run, before any calibration."""
    from compress.errors import CompressError

    torch.manual_seed(0)
    save(SMOOTHING_FAMILIES["llama"]().eval(), tmp_path / "in")
    for stage in ("smoothquant: {", "awq: {scheme: W4A16, "):
        recipe = recipe_on(tmp_path / "in", f"{stage}mappings: [{{smooth: self_attn.v_proj, balance: [self_attn.o_proj]}}]}}",
                           samples=4)
        with pytest.raises(CompressError, match=r"self_attn.v_proj gives 32 channels but self_attn.o_proj reads 64 "
                                                 r"\(grouped-query attention"):
            run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4A16"])
def test_a_single_layer_mapping_is_scored_without_a_forward_as_with_one(scheme):
    """AWQ scores v -> o or up -> down on the balance layer's own sampled inputs: the error must be
    what scaling prev's rows and the layer's columns, then rounding the layer, really does to the
    layer's output."""
    from compress.mappings import apply_scales
    from compress.schemes import resolve_scheme
    from compress.stages.awq import scaled_layer_error
    from compress.stages.rtn import global_scales, quantize_weight

    args = resolve_scheme(scheme, {"group_size": 16} if scheme == "W4A16" else None, None).weights
    X, W = outlier_layer(tokens=256)
    torch.manual_seed(0)
    prev, layer = torch.nn.Linear(64, 64), torch.nn.Linear(64, 48)
    with torch.no_grad():
        layer.weight.copy_(W)
    inputs = torch.randn(256, 64)
    with torch.no_grad():
        x, reference = prev(inputs), layer(prev(inputs))
        s = x.abs().mean(0).pow(0.5)
        apply_scales(prev, [layer], s)
        g = global_scales({"layer": layer}, args).get("layer")
        layer.weight.copy_(quantize_weight(layer.weight.detach().clone(), args, g))
        measured = float((layer(prev(inputs)) - reference).pow(2).sum())
    assert scaled_layer_error(x, W, s, args) == pytest.approx(measured, rel=1e-4)


def test_only_mappings_that_inspect_their_own_branch_are_folded_as_branches():
    """Experts' own folds are checked together, each on its own inspected output; a `*` map that
    inspects a shared module (the whole MLP) is not a branch and keeps its own check."""
    from compress.mappings import in_block
    from compress.moe import unfuse_experts

    model = SMOOTHING_FAMILIES["qwen2_moe"]()
    unfuse_experts(model)  # as the engine has them while stages run
    block = model.model.layers[0]
    own = in_block([Mapping(smooth="mlp.experts.*.up_proj", balance=["mlp.experts.*.down_proj"],
                            inspect="mlp.experts.*.down_proj")], block)
    shared = in_block([Mapping(smooth="mlp.experts.*.up_proj", balance=["mlp.experts.*.down_proj"], inspect="mlp")], block)
    assert len(own) == len(shared) == 4 and all(m._branch for m in own) and not any(m._branch for m in shared)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2_moe", "opt"])
def test_awq_scores_the_inspected_module_on_its_cached_input_as_on_the_folded_block(family, tmp_path, monkeypatch):
    """Where the inspected module reads the smoothed norm's output itself, AWQ calls just that module
    on the cached input divided by s, instead of running the block up to it with the norm folded.
    The two must score every candidate alike: the same α everywhere and the same errors (OPT's
    MLP, read through a reshape, takes the block path in both runs)."""
    from compress.engine import BlockRunner

    torch.manual_seed(0)
    save(SMOOTHING_FAMILIES[family]().eval(), tmp_path / "in")
    recipe = recipe_on(tmp_path / "in", "awq: {scheme: W4A16, weights: {group_size: 16}, grid: 6, clip: false}", samples=4)
    used = []
    calls = BlockRunner.calls
    monkeypatch.setattr(BlockRunner, "calls", lambda *a, **k: used.append(r := calls(*a, **k)) or r)
    fast = run_recipe(recipe, output=str(tmp_path / "fast"), device="cpu")["layers"]
    assert used and all(c is not None for c in used) == (family != "opt") and any(c is not None for c in used)
    monkeypatch.setattr(BlockRunner, "calls", lambda *a, **k: None)  # the block path for every mapping
    slow = run_recipe(recipe, output=str(tmp_path / "slow"), device="cpu")["layers"]
    searched = [n for n, r in slow.items() if "awq_alpha" in r]
    assert searched and [fast[n]["awq_alpha"] for n in searched] == [slow[n]["awq_alpha"] for n in searched]
    for n in searched:
        assert fast[n]["awq_block_error"] == pytest.approx(slow[n]["awq_block_error"], rel=1e-3)
        assert fast[n]["awq_rtn_block_error"] == pytest.approx(slow[n]["awq_rtn_block_error"], rel=1e-3)


def outlier_layer(seed=0, tokens=512, width=64, outliers=(3, 17, 40)):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(tokens, width, generator=g)
    X[:, list(outliers)] *= 50  # a few channels 50x larger, in every token, as in LLM activations
    W = torch.randn(48, width, generator=g) / width**0.5
    return X, W


def w8a8_error(X, W, act_strategy):
    Wq = fake_quantize(W, 8, True, "channel")
    Xq = fake_quantize(X, 8, True, act_strategy)
    return float((X @ W.t() - Xq @ Wq.t()).pow(2).sum())


@pytest.mark.parametrize("act_strategy", ["tensor", "token"])
def test_smoothquant_cuts_w8a8_error_on_outlier_channels(act_strategy):
    X, W = outlier_layer()
    s = smoothing_scales(X.abs().amax(0), [W], alpha=0.5)
    plain = w8a8_error(X, W, act_strategy)
    smoothed = w8a8_error(X / s, W * s, act_strategy)
    assert smoothed * 5 <= plain


@pytest.mark.parametrize("args", [QuantArgs(num_bits=4, strategy="group", group_size=16),
                                  QuantArgs(num_bits=3, strategy="channel", symmetric=False)])
def test_clip_search_never_loses_to_round_to_nearest(args):
    X, W = outlier_layer(tokens=256)
    Q, ratio = clip_search(X, W, args)
    rtn = fake_quantize(W, args.num_bits, args.symmetric, args.strategy, args.group_size)
    # on outlier inputs a shrunk range wins clearly (0.07 and 0.27 of RTN's error, ratios 0.85, 0.68)
    assert output_error(X, W, Q) <= 0.5 * output_error(X, W, rtn)
    assert 0.5 <= ratio < 0.95


@pytest.mark.parametrize("args,tokens", [(QuantArgs(num_bits=4, strategy="group", group_size=16), 300),
                                         (QuantArgs(num_bits=4, strategy="group", group_size=32, symmetric=False), 300),
                                         (QuantArgs(num_bits=4, strategy="channel"), 300),  # one group of 96 < 300 tokens
                                         (QuantArgs(num_bits=4, strategy="channel"), 64)])  # fewer tokens than inputs
def test_clip_search_picks_each_groups_best_ratio_by_its_output_error(args, tokens):
    """The search scores ratios by δᵀ G δ per (row, group), or by the outputs themselves when a
    group is wider than the tokens are many; either way it must choose what the error itself,
    Σ_t (δ · x_t)² over the tokens, ranks best among the candidates (up to float ties)."""
    X, W = outlier_layer(tokens=tokens, width=96)
    Q, _ = clip_search(X, W, args, grid=20, max_shrink=0.5)
    g = args.group_size or 96
    Wg, Qg, Xg = W.reshape(48, -1, g), Q.reshape(48, -1, g), X.reshape(tokens, -1, g).double()

    def group_errors(A):  # [rows, groups]: Σ_t (Σ_k (w - a)_k x_tk)²
        return torch.einsum("ogk,tgk->ogt", (Wg - A).double(), Xg).pow(2).sum(-1)

    lo, hi = (-Wg.abs().amax(-1, keepdim=True), Wg.abs().amax(-1, keepdim=True)) if args.symmetric else \
        (Wg.amin(-1, keepdim=True), Wg.amax(-1, keepdim=True))
    best = torch.full((48, W.shape[1] // g), float("inf"), dtype=torch.float64)
    for i in range(11):  # ratios 1, 0.95, ..., 0.5
        r = 1 - i / 20
        qp = range_qparams(lo * r, hi * r, args)
        best = torch.minimum(best, group_errors(dequantize(quantize(Wg, qp), qp)))
    chosen = group_errors(Qg)
    assert torch.all(chosen <= best * (1 + 1e-4) + 1e-9)
    full = range_qparams(lo, hi, args)
    assert (chosen < 0.999 * group_errors(dequantize(quantize(Wg, full), full))).any()  # not all kept at ratio 1


def test_awq_then_gptq_in_one_recipe(tmp_path):
    torch.manual_seed(0)
    save(SMOOTHING_FAMILIES["llama-mha"]().eval(), tmp_path / "in")
    recipe = recipe_on(tmp_path / "in", "awq: {scheme: W4A16, weights: {group_size: 32}, quantize: false, grid: 5}",
                       "gptq: {scheme: W4A16, weights: {group_size: 32}}")
    report = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    assert [s["name"] for s in report["stages"]] == ["awq", "gptq"]
    layers = report["layers"]
    assert all(r["stage"] == "gptq" and r["gptq_loss"] < r["rtn_loss"] for r in layers.values())
    assert any("awq_alpha" in r for r in layers.values())


def test_awq_quantizes_and_reports(tmp_path):
    torch.manual_seed(0)
    save(SMOOTHING_FAMILIES["llama"]().eval(), tmp_path / "in")
    recipe = recipe_on(tmp_path / "in", "awq: {scheme: W4A16_ASYM, weights: {group_size: 32}, grid: 5}")
    report = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    layers = report["layers"]
    assert len(layers) == 14 and all(r["stage"] == "awq" and r["output_error"] > 0 for r in layers.values())
    # layers AWQ did not rescale (o_proj under grouped-query attention) only gain from clipping
    for name, r in layers.items():
        if "awq_alpha" not in r:
            assert r["output_error"] <= r["rtn_output_error"] * (1 + 1e-6), name
    # the scale search: no candidate worse than none (s = 1), and real scales win somewhere
    searched = [r for r in layers.values() if "awq_alpha" in r]
    assert all(r["awq_block_error"] <= r["awq_rtn_block_error"] for r in searched)
    assert any(r["awq_alpha"] is not None and r["awq_block_error"] < 0.97 * r["awq_rtn_block_error"] for r in searched)
    summary = report["stages"][0]["summary"]
    assert summary["mean_output_error"] < 0.95 * summary["mean_rtn_output_error"]
    assert all(r["clip_ratio"] < 1 for r in layers.values())


def test_awq_reports_each_layers_error_in_the_input_models_coordinates(tmp_path, monkeypatch):
    """A layer's input columns are scaled by s and, where it is a mapping's smoothed op (up -> down,
    v -> o), its rows by 1/s: its errors are measured with both undone, on the weights the input
    model had, as the round-to-nearest errors beside them are (row-scaled errors read 1/s² off)."""
    import compress.stages.awq as awq

    torch.manual_seed(0)
    model = SMOOTHING_FAMILIES["llama-mha"]().eval()
    save(model, tmp_path / "in")
    original = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    measured = []
    real = awq.relative_error
    monkeypatch.setattr(awq, "relative_error", lambda W, Q: measured.append(W) or real(W, Q))
    report = run_recipe(recipe_on(tmp_path / "in", "awq: {scheme: W4A16, weights: {group_size: 32}, grid: 5}"),
                        output=str(tmp_path / "out"), device="cpu")
    layers = [n for n in report["layers"] if n in original]
    assert len(measured) == len(layers) == 14
    scaled = {n for n, r in report["layers"].items() if r.get("awq_alpha") is not None}
    assert any(n.endswith(("v_proj", "up_proj")) for n in scaled)  # rows scaled somewhere
    for W in measured:  # each is some layer's input weight
        assert any(W.shape == o.shape and torch.allclose(W, o, rtol=1e-4, atol=1e-6) for o in original.values())


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_awq_search_set_does_not_shrink_with_the_batch_size(family, tmp_path):
    """Each calibration forward keeps its share of `max_tokens` for the searches: a share per batch,
    not per sample, so batching does not shrink the search set; BERT's padded lines count only
    their real tokens."""
    torch.manual_seed(0)
    save(SMOOTHING_FAMILIES[family]().eval(), tmp_path / "in")
    kept = {}
    for bs in (1, 4):
        recipe = parse_recipe(f"""
model: {tmp_path / 'in'}
calibration: {{dataset: calibration/default.txt, num_samples: 8, seq_len: 64, packing: {str(family != "bert").lower()}, min_chars: 20}}
stages:
  - awq: {{scheme: W4A16, weights: {{group_size: 32}}, grid: 3, clip_grid: 4, max_tokens: 64, batch_size: {bs}}}
""", "test")
        report = run_recipe(recipe, output=str(tmp_path / f"b{bs}"), device="cpu")
        assert report["stages"][0]["summary"]["batch_size"] == bs
        kept[bs] = {n: (r["search_tokens"], r["tokens"]) for n, r in report["layers"].items() if "search_tokens" in r}
    assert kept[1] and kept[1] == kept[4]
    assert all(search == 64 < seen for search, seen in kept[1].values())


@pytest.fixture
def gpt_neo(tmp_path):
    """A tiny GPT-Neo, an architecture without a smoothing map, saved to tmp_path/in."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    torch.manual_seed(0)
    save(GPTNeoForCausalLM(GPTNeoConfig(hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global"], 2]],
                                          intermediate_size=96, vocab_size=V, max_position_embeddings=128)).eval(), tmp_path / "in")
    return tmp_path / "in"


def test_architecture_without_a_map_names_its_modules(gpt_neo, tmp_path):
    from compress.errors import CompressError

    recipe = parse_recipe(f"""
model: {tmp_path / 'in'}
calibration: {{dataset: calibration/default.txt, num_samples: 4, seq_len: 32}}
stages:
  - awq: {{scheme: W4A16, weights: {{group_size: 32}}}}
""", "test")
    with pytest.raises(CompressError) as err:
        run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    message = str(err.value)
    assert "gpt_neo" in message and "transformer.h.0 holds ln_1 (LayerNorm)" in message
    assert "attn.attention.q_proj (Linear)" in message
    assert "mappings" in err.value.hint


def test_declared_mapping_supports_a_new_architecture(gpt_neo, tmp_path):
    """The same architecture with the mapping a user would write from that error: exact scaling."""
    recipe = parse_recipe(f"""
model: {tmp_path / 'in'}
calibration: {{dataset: calibration/default.txt, num_samples: 4, seq_len: 32}}
stages:
  - awq:
      scheme: W4A16
      weights: {{group_size: 32}}
      quantize: false
      grid: 5
      blocks: transformer.h
      mappings:
        - {{smooth: ln_1, balance: [attn.attention.q_proj, attn.attention.k_proj, attn.attention.v_proj], inspect: attn}}
        - {{smooth: ln_2, balance: [mlp.c_fc], inspect: mlp}}
""", "test")
    report = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    assert sum("awq_alpha" in r for r in report["layers"].values()) == 8
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    before, after = outputs(tmp_path / "in", ids), outputs(tmp_path / "out", ids)
    assert (after - before).norm() / before.norm() < 1e-4


def test_an_architecture_a_later_stage_refuses_is_refused_before_the_first_stage(gpt_neo, tmp_path, monkeypatch):
    """Stage.preflight: the engine does not know gpt_neo's blocks, so gptq would refuse it; the
    run says so before round-to-nearest, the stage before it, does any work."""
    from compress.errors import CompressError
    from compress.stages.rtn import RoundToNearest

    monkeypatch.setattr(RoundToNearest, "apply", lambda *a: pytest.fail("the first stage ran"))
    recipe = parse_recipe(f"""
model: {tmp_path / 'in'}
calibration: {{dataset: calibration/default.txt, num_samples: 4, seq_len: 32}}
stages:
  - rtn: {{scheme: W8A16}}
  - gptq: {{scheme: W4A16, weights: {{group_size: 32}}}}
""", "test")
    with pytest.raises(CompressError, match="architecture 'gpt_neo' is not known to the calibration engine"):
        run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
