"""Pruning: the mask math alone, the three algorithms on one layer, then the stages through the
pipeline on tiny models of each family and the bundled ref-llama, and `compress prune` end to end."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from compress import modeling, parse_recipe, run_recipe
from compress.cli import main
from compress.errors import CompressError
from compress.quant import compute_qparams
from compress.schemes import QuantArgs
from compress.sparsity import (check_nm, magnitude_scores, nm_mask, parse_pattern, sparsity, unstructured_mask,
                               wanda_scores)
from compress.stages.gptq import hessian_loss
from compress.stages.magnitude import magnitude_prune
from compress.stages.pruning import LayerTarget
from compress.stages.sparsegpt import sparsegpt_prune
from compress.stages.wanda import wanda_prune

from tests.test_gptq import correlated_layer
from tests.test_model_families import FAMILIES

# ---------------------------------------------------------------------------------------------
# masks


@pytest.mark.parametrize("s", [0.0, 0.25, 0.5, 0.7])
def test_unstructured_mask_exact_per_row_and_per_layer(s):
    scores = torch.rand(12, 40, generator=torch.Generator().manual_seed(0))
    row = unstructured_mask(scores, s, per_row=True)
    assert ((~row).sum(1) == round(s * 40)).all()
    layer = unstructured_mask(scores, s, per_row=False)
    assert int((~layer).sum()) == round(s * 12 * 40)
    # the pruned scores are the lowest ones
    if s:
        assert scores[~layer].max() <= scores[layer].min()
        assert ((scores * ~row).amax(1) <= torch.where(row, scores, torch.inf).amin(1)).all()


def test_ties_still_give_the_exact_count():
    scores = torch.ones(4, 16)
    assert ((~unstructured_mask(scores, 0.5)).sum(1) == 8).all()
    assert ((~nm_mask(scores, 2, 4)).reshape(4, 4, 4).sum(2) == 2).all()


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 4)])
def test_nm_mask_prunes_n_lowest_of_every_m(n, m):
    scores = torch.rand(6, 32, generator=torch.Generator().manual_seed(1))
    keep = nm_mask(scores, n, m)
    groups, kept = scores.reshape(6, -1, m), keep.reshape(6, -1, m)
    assert ((~kept).sum(2) == n).all()
    assert (torch.where(kept, -torch.inf, groups).amax(2) <= torch.where(kept, groups, torch.inf).amin(2)).all()
    W = torch.randn(6, 32) * keep
    assert check_nm(W, n, m) and sparsity(W) == pytest.approx(n / m)
    W[0, 0:m] = 1.0  # one group left dense breaks the pattern
    assert not check_nm(W, n, m)


def test_nm_needs_a_width_multiple_of_m():
    with pytest.raises(ValueError, match="30 input features are not a multiple of M = 4"):
        nm_mask(torch.rand(2, 30), 2, 4)
    assert not check_nm(torch.zeros(2, 30), 2, 4)


@pytest.mark.parametrize("text", ["5:4", "4:4", "0:4", "x", "2-4", "", "2:4:8"])
def test_bad_patterns(text):
    with pytest.raises(ValueError, match="pattern"):
        parse_pattern(text)
    assert parse_pattern(" 2 : 4 ") == (2, 4)


def test_wanda_scores_by_weight_times_input_norm():
    """Row [1.0, 0.5] on inputs with norms [0.1, 10]: magnitude drops the 0.5, Wanda the 1.0,
    whose contribution to the output (0.1) is fifty times smaller."""
    W = torch.tensor([[1.0, 0.5], [-0.5, -1.0]])
    norm = torch.tensor([0.1, 10.0])
    half = LayerTarget(0.5, None)
    assert torch.equal(magnitude_prune(W, half, per_row=True), torch.tensor([[1.0, 0.0], [0.0, -1.0]]))
    assert torch.equal(wanda_prune(W, norm, half), torch.tensor([[0.0, 0.5], [0.0, -1.0]]))
    assert torch.equal(wanda_scores(W, norm), magnitude_scores(W) * norm)


def test_wanda_compares_within_each_row():
    """One row of large weights and one of small: per-layer magnitude empties the small row,
    Wanda (per row) prunes half of each."""
    W = torch.cat([torch.rand(1, 8) + 10, torch.rand(1, 8)])
    out = wanda_prune(W, torch.ones(8), LayerTarget(0.5, None))
    assert ((out == 0).sum(1) == 4).all()
    assert (magnitude_prune(W, LayerTarget(0.5, None))[1] == 0).all()


# ---------------------------------------------------------------------------------------------
# the algorithms on one layer


@pytest.mark.parametrize("target", [LayerTarget(0.5, None), LayerTarget(0.5, (2, 4)), LayerTarget(0.5, (4, 8)),
                                    LayerTarget(0.3, None)], ids=lambda t: t.describe())
def test_sparsegpt_reconstructs_better_than_magnitude_and_wanda(target):
    W, X, H = correlated_layer()
    Q, info = sparsegpt_prune(W, H, target)
    M = magnitude_prune(W, target)
    A = wanda_prune(W, X.pow(2).sum(0).sqrt(), target)
    err = lambda P: float(((W - P) @ X.t()).pow(2).sum())  # noqa: E731  ||WX - ŴX||²
    assert err(Q) < err(A) < err(M)
    for P in (Q, A) if target.nm else (A,):  # exactly the sparsity asked, in every row
        assert ((P == 0).sum(1) == round(target.sparsity * W.shape[1])).all()
    # SparseGPT's unstructured mask is chosen over each block's rows together: exact per layer
    assert int((Q == 0).sum()) == round(target.sparsity * W.numel())
    assert int((M == 0).sum()) == round(target.sparsity * W.numel())  # magnitude: per layer by default
    if target.nm:
        assert all(check_nm(P, *target.nm) for P in (Q, M, A))
    assert hessian_loss(W, Q, H) == pytest.approx(err(Q) / X.shape[0], rel=1e-3)
    assert info["damp_retries"] == 0


def test_sparsegpt_block_size_keeps_exact_counts():
    """Per-block prune counts are differences of rounded running totals: 0.3 of 96 columns in
    blocks of 40 still prunes round(28.8) = 29 per row with `mask_selection: row`, and
    round(0.3 · rows · 96) in the layer with the default (block)."""
    W, _, H = correlated_layer()
    Q, _ = sparsegpt_prune(W, H, LayerTarget(0.3, None), block_size=40, mask_selection="row")
    assert ((Q == 0).sum(1) == 29).all()
    Q, _ = sparsegpt_prune(W, H, LayerTarget(0.3, None), block_size=40)
    assert int((Q == 0).sum()) == round(0.3 * W.numel())
    Q, _ = sparsegpt_prune(W, H, LayerTarget(0.5, (2, 4)), block_size=30)  # rounded up to a multiple of 4
    assert check_nm(Q, 2, 4)


def test_sparsegpt_block_mask_selection_lets_rows_differ():
    """The reference implementation's choice: one threshold per block over all rows, so rows
    whose weights matter less give up more. Both choices beat magnitude on the same layer."""
    W, X, H = correlated_layer()
    err = lambda P: float(((W - P) @ X.t()).pow(2).sum())  # noqa: E731
    block, _ = sparsegpt_prune(W, H, LayerTarget(0.5, None))
    row, _ = sparsegpt_prune(W, H, LayerTarget(0.5, None), mask_selection="row")
    per_row = (block == 0).sum(1)
    assert per_row.min() < per_row.max() and int(per_row.sum()) == W.numel() // 2
    assert ((row == 0).sum(1) == W.shape[1] // 2).all()
    magnitude = err(magnitude_prune(W, LayerTarget(0.5, None)))
    assert err(block) < magnitude and err(row) < magnitude


@pytest.mark.parametrize("symmetric", [True, False])
def test_joint_quantization_gives_grid_values_and_zeros(symmetric):
    W, X, H = correlated_layer()
    args = QuantArgs(num_bits=4, strategy="channel", symmetric=symmetric)
    Q, _ = sparsegpt_prune(W, H, LayerTarget(0.5, (2, 4)), quant=args)
    assert check_nm(Q, 2, 4)
    qp = compute_qparams(W, 4, symmetric, "channel")  # channel scales come from the weight as given
    codes = Q / qp.scale + qp.zero_point
    assert torch.allclose(codes, codes.round(), atol=1e-3)
    assert codes.round().min() >= qp.qmin and codes.round().max() <= qp.qmax
    # and it beats pruning alone followed by rounding
    from compress.quant import fake_quantize

    assert hessian_loss(W, Q, H) < hessian_loss(W, fake_quantize(magnitude_prune(W, LayerTarget(0.5, (2, 4))), 4, symmetric, "channel"), H)


def test_joint_group_quantization_uses_at_most_2_to_the_bits_values_per_group():
    W, _, H = correlated_layer()
    Q, _ = sparsegpt_prune(W, H, LayerTarget(0.5, None), quant=QuantArgs(num_bits=3, strategy="group", group_size=32))
    assert int((Q == 0).sum()) >= W.numel() // 2  # pruned, and some kept weights may round to 0 too
    for r in range(Q.shape[0]):
        for g in range(0, Q.shape[1], 32):
            assert len(torch.unique(Q[r, g : g + 32])) <= 2**3


# ---------------------------------------------------------------------------------------------
# through the pipeline


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = {}
    for family in ("llama", "gpt2", "bert"):
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(family)
        FAMILIES[family]().save_pretrained(path)
        AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
        out[family] = path
    return out


def recipe(path, stages: str, samples=8, packing=True):
    return parse_recipe(f"""
model: {path}
calibration: {{dataset: calibration/default.txt, num_samples: {samples}, seq_len: 64, packing: {str(packing).lower()}, min_chars: 20}}
stages:
{stages}
""", "test")


def saved_weights(out, family):
    """[out, in] weights of every linear layer in the saved file (GPT-2's Conv1D transposed back).
    A quantized checkpoint saved packed (compressed-tensors) is read back through compress's loader."""
    if json.loads((out / "compress.json").read_text())["format"].startswith("compressed-tensors"):
        net, _, _ = modeling.load_model(str(out), dtype="float32", device="cpu")
        return {n: modeling.get_weight(m) for n, m in net.named_modules() if type(m).__name__ in ("Linear", "Conv1D")}
    tensors = load_file(out / "model.safetensors")
    conv1d = family == "gpt2"
    return {k.removesuffix(".weight"): (v.t() if conv1d and (".attn." in k or ".mlp." in k) else v).float()
            for k, v in tensors.items() if k.endswith(".weight") and v.dim() == 2}


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("method,target", [("sparsegpt", 'pattern: "2:4"'), ("wanda", "sparsity: 0.5")])
def test_every_family_exact_sparsity_on_disk(tiny, family, method, target, tmp_path):
    report = run_recipe(recipe(tiny[family], f"  - {method}: {{{target}}}", packing=family != "bert"),
                        output=str(tmp_path / "o"), device="cpu")
    layers = report["layers"]
    weights = saved_weights(tmp_path / "o", family)
    assert len(layers) >= 8
    for name, rec in layers.items():
        key = next(k for k in weights if k.endswith(name))  # BertModel saves without a prefix
        w = weights[key]
        assert rec["sparsity"] == 0.5 and sparsity(w) == 0.5, name
        assert ((w == 0).sum(1) == w.shape[1] // 2).all(), name  # every output row too
        if method == "sparsegpt":
            assert check_nm(w, 2, 4), name
            if rec["sparsegpt_loss"] is not None:
                assert rec["sparsegpt_loss"] < rec["magnitude_loss"], name
    summary = report["stages"][0]["summary"]
    assert summary["sparsity"] == 0.5
    assert summary["nonzero_parameters_after"] == report["output"]["nonzero_parameters"]
    assert summary["parameters"] - summary["nonzero_parameters_after"] >= summary["target_parameters"] // 2
    if family == "bert":
        # the pooler sits outside the blocks and is calibrated there, on one token per sample: 8 here,
        # enough for Wanda's norms but under SparseGPT's min_tokens (16), which then prunes by magnitude
        pooler = layers["pooler.dense"]
        assert summary["outside_blocks"] == ["pooler.dense"] and pooler["tokens"] == 8
        assert summary["magnitude_fallback"] == (method == "sparsegpt")
        if method == "sparsegpt":
            assert "8 calibration tokens (< min_tokens 16)" in pooler["note"]
    else:
        assert summary["magnitude_fallback"] == 0
        assert sparsity(next(v for k, v in weights.items() if "lm_head" in k or "wte" in k)) < 0.01  # lm_head untouched


def test_overrides_per_layer(tiny, tmp_path):
    report = run_recipe(parse_recipe(f"""
model: {tiny['llama']}
stages:
  - magnitude:
      sparsity: 0.5
      sparsity_overrides: {{mlp.down_proj: 0.25, "re:.*q_proj$": "4:8", "layers.1.self_attn.v_proj": 0}}
""", "test"), output=str(tmp_path / "o"), device="cpu")
    layers = report["layers"]
    for name, rec in layers.items():
        expected = (0.25 if name.endswith("down_proj") else 0.5 if name.endswith("q_proj")
                    else 0.0 if name == "model.layers.1.self_attn.v_proj" else 0.5)
        assert rec["sparsity"] == expected, name
        assert rec["pattern"] == ("4:8" if name.endswith("q_proj") else None)
    w = saved_weights(tmp_path / "o", "llama")["model.layers.0.self_attn.q_proj"]
    assert check_nm(w, 4, 8) and not check_nm(w, 2, 4)  # 4:8 is looser than 2:4
    assert report["stages"][0]["summary"]["scheme"] == "sparsity 0.5 unstructured, 3 override(s)"
    with pytest.raises(CompressError, match="sparsity_overrides key 'mlp.nothing' matches no target layer"):
        run_recipe(parse_recipe(f"model: {tiny['llama']}\nstages:\n  - magnitude: {{sparsity_overrides: {{mlp.nothing: 0.1}}}}\n",
                                "test"), output=str(tmp_path / "x"), device="cpu")


@pytest.mark.parametrize("quant", [
    "rtn: {scheme: W4A16, weights: {group_size: 32}}",
    "rtn: {scheme: W4A16_ASYM, weights: {group_size: 32}}",
    "rtn: {scheme: W8A16, weights: {symmetric: false}}",
    "rtn: {scheme: FP8_DYNAMIC}",
    "awq: {scheme: W4A16_ASYM, weights: {group_size: 32}, grid: 4, clip: false}",
    "gptq: {scheme: W4A16, weights: {group_size: 32}}",
])
def test_quantization_after_pruning_keeps_the_mask(tiny, quant, tmp_path):
    original, _, _ = modeling.load_model(str(tiny["llama"]), device="cpu")
    run_recipe(recipe(tiny["llama"], f'  - magnitude: {{pattern: "2:4"}}\n  - {quant}'), output=str(tmp_path / "o"), device="cpu")
    saved = saved_weights(tmp_path / "o", "llama")
    for name, module in original.named_modules():
        if type(module).__name__ == "Linear" and name != "lm_head":
            pruned = magnitude_prune(modeling.get_weight(module), LayerTarget(0.5, (2, 4)))
            assert (saved[name][pruned == 0] == 0).all(), name
            assert check_nm(saved[name], 2, 4), name


@pytest.mark.parametrize("first,second", [("magnitude: {sparsity: 0.5}", "sparsegpt: {sparsity: 0.5}"),
                                          ("magnitude: {sparsity: 0.3}", "sparsegpt: {pattern: '2:4'}"),
                                          ("wanda: {pattern: '2:4'}", "sparsegpt: {sparsity: 0.6}")])
def test_sparsegpt_after_pruning_keeps_the_earlier_zeros(tiny, first, second, tmp_path):
    """SparseGPT updates the weights it keeps; before the earlier mask was kept, those updates
    brought back about 0.1 % of magnitude's zeros. Now its mask contains the earlier one."""
    second = second.replace("}", ", block_size: 16}")  # several column blocks: later blocks' masks follow updates
    run_recipe(recipe(tiny["llama"], f"  - {first}"), output=str(tmp_path / "a"), device="cpu")
    before = saved_weights(tmp_path / "a", "llama")
    report = run_recipe(recipe(tiny["llama"], f"  - {first}\n  - {second}"), output=str(tmp_path / "b"), device="cpu")
    after = saved_weights(tmp_path / "b", "llama")
    pruned = [n for n in before if n in report["layers"]]
    assert len(pruned) == 2 * 7
    for name in pruned:
        W = before[name]
        assert (after[name][W == 0] == 0).all(), name
        assert not torch.equal(after[name], W), name  # the kept weights were updated
        if "2:4" in second:
            assert check_nm(after[name], 2, 4), name
        else:  # at least as many as asked (more where a block of columns held more earlier zeros than its share)
            target = 0.6 if "0.6" in second else 0.5
            assert int((after[name] == 0).sum()) >= round(target * W.numel()), name


def test_sparsegpt_prune_with_an_earlier_mask_contains_it():
    W, X, H = correlated_layer()
    earlier = magnitude_prune(W, LayerTarget(0.4, None)) == 0
    for target in (LayerTarget(0.5, None), LayerTarget(0.5, (2, 4)), LayerTarget(0.3, None)):
        Q, _ = sparsegpt_prune(W.masked_fill(earlier, 0), H, target, block_size=16, keep_zero=earlier)
        assert (Q[earlier] == 0).all(), target.describe()
        # at least as many as asked, and the earlier mask where it is larger (0.4 > 0.3)
        assert int((Q == 0).sum()) >= max(round(target.sparsity * W.numel()), int(earlier.sum())) or target.nm


def test_a_stage_on_a_tied_output_layer_says_the_embeddings_change_too(tmp_path, capsys):
    """With tie_word_embeddings, pruning lm_head (`ignore: []`) prunes the input embeddings too:
    the run and the plan say so, since nothing in the layer table would."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path / "tied"
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True)).save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
    stage = "  - magnitude: {sparsity: 0.5, ignore: []}"
    report = run_recipe(recipe(path, stage), output=str(tmp_path / "o"), device="cpu")
    saved = load_file(tmp_path / "o" / "model.safetensors")
    assert float((saved["model.embed_tokens.weight"] == 0).float().mean()) == pytest.approx(0.5, abs=0.01)
    assert any("changed lm_head, whose weight is tied to model.embed_tokens.weight" in w for w in report["warnings"])
    (tmp_path / "r.yaml").write_text(f"model: {path}\nstages:\n{stage}\n")
    capsys.readouterr()
    assert main(["plan", "--recipe", str(tmp_path / "r.yaml")]) == 0
    shown = capsys.readouterr()
    assert "tied to model.embed_tokens.weight" in " ".join((shown.out + shown.err).split()), shown  # (wrapped)
    report = run_recipe(recipe(path, "  - magnitude: {sparsity: 0.5}"), output=str(tmp_path / "d"), device="cpu")
    assert not report.get("warnings")  # lm_head ignored (the default): nothing to say
    report = run_recipe(recipe(path, "  - awq: {scheme: W4A16, weights: {group_size: 32}, quantize: false, ignore: []}"),
                        output=str(tmp_path / "s"), device="cpu")
    assert not report.get("warnings")  # targeted, but AWQ's scales never reach lm_head: it did not change


def test_bundled_recipes_parse_and_describe_what_they_do(repo):
    from compress.recipe import load_recipe

    r50 = load_recipe(repo / "recipes/sparse50-sparsegpt.yaml")
    assert [n for n, _ in r50.stages] == ["sparsegpt"] and r50.stages[0][1].sparsity == 0.5
    r24 = load_recipe(repo / "recipes/sparse24-sparsegpt-w4a16.yaml")
    assert [n for n, _ in r24.stages] == ["sparsegpt", "gptq"]
    assert r24.stages[0][1].pattern == "2:4" and r24.stages[1][1].resolved_scheme().weights.group_size == 128
    assert r24.calibration.num_samples == 128 and r24.calibration.seq_len == 256


def test_sparse24_then_gptq_recipe_keeps_2_4(tiny, repo, tmp_path):
    from compress.recipe import load_recipe

    r = load_recipe(repo / "recipes/sparse24-sparsegpt-w4a16.yaml")
    r.calibration.num_samples, r.calibration.seq_len, r.evaluation = 8, 64, None
    run_recipe(r, model=str(tiny["llama"]), output=str(tmp_path / "o"), device="cpu")
    for name, w in saved_weights(tmp_path / "o", "llama").items():
        if name != "lm_head" and "embed" not in name:
            assert check_nm(w, 2, 4), name


def test_joint_quantization_stage_records_weights(tiny, tmp_path):
    report = run_recipe(recipe(tiny["llama"], '  - sparsegpt: {pattern: "2:4", quantize: {scheme: W4A16, weights: {group_size: 32}}}'),
                        output=str(tmp_path / "o"), device="cpu")
    assert "int4 g32 sym" in report["stages"][0]["summary"]["scheme"]
    assert report["output"]["quantized_parameters"] > 0  # counted as quantized in the size summary
    for name, w in saved_weights(tmp_path / "o", "llama").items():
        if name in report["layers"]:
            assert check_nm(w, 2, 4) and report["layers"][name]["weights"]["num_bits"] == 4


def test_recipe_validation():
    def stage(body):
        return parse_recipe(f"calibration: {{}}\nstages:\n  - sparsegpt: {body}\n", "r.yaml").stages[0][1]

    assert stage('{pattern: "4:8"}').sparsity == 0.5
    assert stage("{sparsity: 0.5, pattern: '2:4'}").pattern == "2:4"
    assert stage("{}").sparsity == 0.5
    with pytest.raises(CompressError, match="contradicts pattern 2:4"):
        stage("{sparsity: 0.6, pattern: '2:4'}")
    with pytest.raises(CompressError, match="quote it"):
        stage("{pattern: 2:4}")  # YAML 1.1 reads 2:4 as 124
    with pytest.raises(CompressError, match="less than 1"):
        stage("{sparsity: 1.0}")
    with pytest.raises(CompressError, match="quantizes weights only"):
        stage("{quantize: {scheme: W8A8}}")
    with pytest.raises(CompressError, match="sparsity_overrides"):
        stage("{sparsity_overrides: {q_proj: 1.5}}")


# ---------------------------------------------------------------------------------------------
# the command line on the bundled ref-llama


def test_cli_prune_end_to_end(tmp_path, repo, capsys):
    """`compress prune` writes a 2:4 checkpoint (checked in the safetensors file) whose reload
    computes what the pruned model computed in the run: `compress eval` on it reproduces the
    run's own evaluation."""
    data = tmp_path / "small.txt"
    data.write_text((repo / "calibration/heldout-tinyshakespeare.txt").read_text()[:6000])
    out = tmp_path / "out"
    rc = main(["--json", "prune", "--model", "default", "--method", "sparsegpt", "--pattern", "2:4",
               "--num-samples", "4", "--data", str(data), "--output", str(out)])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    original = load_file(modeling.DEFAULT_MODEL_DIR / "model.safetensors")
    saved = load_file(out / "model.safetensors")
    pruned = [k for k in saved if k.endswith("_proj.weight")]
    assert len(pruned) == 28 == len(report["layers"])
    for k in pruned:
        assert check_nm(saved[k].float(), 2, 4), k
        assert sparsity(saved[k]) == 0.5
    assert torch.equal(saved["lm_head.weight"], original["lm_head.weight"])
    assert report["output"]["nonzero_parameters"] == sum(int(torch.count_nonzero(t)) for t in saved.values())
    again = parse_recipe((out / "recipe.yaml").read_text(), "saved")  # the saved recipe re-runs as it is
    assert again.stages[0][0] == "sparsegpt" and again.stages[0][1].pattern == "2:4"
    assert "sparsity" in (out / "report.md").read_text()

    rc = main(["--json", "eval", "--model", str(out), "--baseline", "default", "--data", str(data)])
    again = json.loads(capsys.readouterr().out)["results"][str(data)]
    first = report["evaluation"][str(data)]
    assert rc == 0 and first["kl_divergence"] > 0
    for key in ("kl_divergence", "token_perplexity", "top1_agreement"):
        assert again[key] == pytest.approx(first[key], rel=1e-5), key


@pytest.mark.parametrize("target", ["sparsity: 0.5", 'pattern: "2:4"'])
def test_wanda_masks_follow_the_activations_the_engine_feeds(tiny, target, tmp_path):
    """Recomputed from the checkpoint alone: every layer of the second block, hooked in a model whose
    first block is the saved (pruned) one, gets the mask Wanda's score gives on those inputs
    (|W| times the input norm, which is √diag(H) up to a constant). That is not the per-row
    magnitude mask, and not the one from the float first block's outputs."""
    from tests.test_gptq import _block_inputs_hessians, _run_and_rebuild

    _, dense, saved_model, hybrid, samples = _run_and_rebuild(tiny["llama"], f"wanda: {{{target}}}", tmp_path)
    saved = {"model.layers.1." + n + ".weight": m.weight.detach() for n, m in saved_model.model.layers[1].named_modules()
             if isinstance(m, torch.nn.Linear)}
    carried = _block_inputs_hessians(hybrid.eval(), hybrid.model.layers[1], samples)
    clean = _block_inputs_hessians(dense.eval(), dense.model.layers[1], samples)
    layer_target = LayerTarget(0.5, (2, 4) if "2:4" in target else None)
    differs_from_magnitude = differs_from_float_inputs = 0
    for short, H in carried.items():
        W = dict(dense.model.layers[1].named_modules())[short].weight.detach()
        kept = saved["model.layers.1." + short + ".weight"] != 0
        assert torch.equal(kept, wanda_prune(W, H.diagonal().sqrt(), layer_target) != 0), short
        differs_from_magnitude += not torch.equal(kept, magnitude_prune(W, layer_target, per_row=True) != 0)
        differs_from_float_inputs += not torch.equal(kept, wanda_prune(W, clean[short].diagonal().sqrt(), layer_target) != 0)
    assert differs_from_magnitude == len(carried)
    assert differs_from_float_inputs > 0


# ---------------------------------------------------------------------------------------------
# A run on a compress output starts from what its compress.json says its layers came with (its
# grid, its zeros), as a stage starts from an earlier stage's records.

CALIBRATION = "calibration: {dataset: calibration/default.txt, num_samples: 4, seq_len: 64}\n"


def test_a_run_on_a_compress_output_keeps_its_grid_and_its_zeros(ref_llama, tmp_path, capsys, monkeypatch):
    w4 = tmp_path / "w4"
    run_recipe(parse_recipe("stages:\n  - rtn: {scheme: W4A16, weights: {group_size: 64}}\n", "t"), model=str(ref_llama),
               output=str(w4), device="cpu")
    # magnitude pruning only sets weights to zero, which is on the grid: written packed, sparse
    pruned = tmp_path / "w4-magnitude"
    report = run_recipe(parse_recipe("stages:\n  - magnitude: {sparsity: 0.5}\n", "t"), model=str(w4), output=str(pruned), device="cpu")
    assert report["format"]["format"] == "packed"
    before, after = modeling.load_model(str(w4))[0].state_dict(), modeling.load_model(str(pruned))[0].state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    kept = after[q] != 0
    assert 0.49 < 1 - kept.float().mean() < 0.51 and torch.equal(after[q][kept], before[q][kept])
    assert (pruned / "model.safetensors").stat().st_size <= (w4 / "model.safetensors").stat().st_size
    assert report["source_model"]["bytes"] == (w4 / "model.safetensors").stat().st_size  # on disk, not dequantized
    # removing blocks leaves the other layers untouched: they stay on their grid, and are counted
    shallow = run_recipe(parse_recipe(CALIBRATION + "stages:\n  - structured: {structure: blocks, ratio: 0.5}\n", "t"),
                         model=str(w4), output=str(tmp_path / "w4-blocks"), device="cpu")
    assert shallow["format"]["format"] == "packed" and shallow["output"]["quantized_parameters"] > 0

    # refused before any stage works, by the plan and the run: SparseGPT's updates would leave
    # the grid; an mlp-channels cut would break the groups (and, below, a 2:4 pattern)
    from compress.stages.magnitude import Magnitude

    two_four = tmp_path / "2-4"
    run_recipe(parse_recipe("stages:\n  - magnitude: {pattern: \"2:4\"}\n", "t"), model=str(ref_llama), output=str(two_four), device="cpu")
    monkeypatch.setattr(Magnitude, "apply", lambda *a: pytest.fail("the first stage ran"))
    for model, stages, words in (
        (w4, "  - magnitude: {sparsity: 0.1}\n  - sparsegpt: {sparsity: 0.5}\n",
         "layer model.layers.0.self_attn.q_proj was quantized (int4 g64 sym) by the input model; SparseGPT's updates"),
        (w4, "  - magnitude: {sparsity: 0.1}\n  - structured: {structure: mlp-channels, ratio: 0.25}\n",
         "model.layers.0.mlp.down_proj was quantized in groups of 64 input columns by the input model"),
        (two_four, "  - magnitude: {sparsity: 0.1}\n  - structured: {structure: mlp-channels, ratio: 0.25}\n",
         "model.layers.0.mlp.down_proj was pruned 2:4 by the input model"),
    ):
        (tmp_path / "r.yaml").write_text(CALIBRATION + "stages:\n" + stages)
        rc = main(["--json", "plan", "--recipe", str(tmp_path / "r.yaml"), "--model", str(model)])
        assert rc == 2 and words in json.loads(capsys.readouterr().out)["error"], stages
        rc = main(["quantize", "--recipe", str(tmp_path / "r.yaml"), "--model", str(model), "--output", str(tmp_path / "out")])
        assert rc == 2 and words in capsys.readouterr().err and not (tmp_path / "out").exists(), stages


def test_sparsegpt_after_quantization_is_refused_unless_it_quantizes_again(ref_llama, tmp_path, capsys):
    """[rtn W4, sparsegpt] was planned packed and written dense, its compress.json still claiming W4."""
    for joint, refused in (("", True), (", quantize: {scheme: W4A16, weights: {group_size: 64}}", False)):
        (tmp_path / "r.yaml").write_text(CALIBRATION + "stages:\n  - rtn: {scheme: W4A16, weights: {group_size: 64}}\n"
                                         f"  - sparsegpt: {{sparsity: 0.5{joint}}}\n")
        rc = main(["--json", "plan", "--recipe", str(tmp_path / "r.yaml"), "--model", str(ref_llama)])
        out = json.loads(capsys.readouterr().out)
        assert (rc == 2) == refused and ("SparseGPT's updates to the weights it keeps" in out.get("error", "")) == refused
        assert out["format"] == "packed"


def test_distillation_keeps_the_zeros_of_an_input_pruned_below_ten_percent(ref_llama, shared, tmp_path):
    """Without the input's records only layers at least 10 % zero were masked: 8 % came back dense."""
    pruned, student = tmp_path / "pruned", tmp_path / "student"
    first = run_recipe(parse_recipe("stages:\n  - magnitude: {sparsity: 0.08}\n", "t"), model=str(ref_llama), output=str(pruned), device="cpu")
    assert first["format"]["reason"] == "no layer is quantized: nothing to pack (sparsity is stored densely)"
    data = shared / "data/tinyshakespeare/train.txt"
    report = run_recipe(parse_recipe(f"stages:\n  - distill: {{data: {{dataset: {data}, seq_len: 64, num_samples: 8, eval_samples: 2}}, "
                                     "train: {steps: 2, batch_size: 2}}\n", "t"), model=str(pruned), output=str(student), device="cpu")
    assert report["stages"][0]["summary"]["masked_layers"] == 28
    # and its compress.json still says what the layers came with (inspect shows it)
    layers = json.loads((student / "compress.json").read_text())["layers"]
    assert layers["model.layers.0.mlp.down_proj"]["stage"] == "magnitude (input model)"
    assert layers["model.layers.0.mlp.down_proj"]["sparsity"] == pytest.approx(0.08, abs=1e-3)
    zeros = lambda d: {k: int((v == 0).sum()) for k, v in load_file(d / "model.safetensors").items() if k.endswith("proj.weight")}  # noqa: E731
    assert zeros(student) == zeros(pruned) and sum(zeros(pruned).values()) > 0


def test_prune_recipe_with_no_eval_skips_the_recipes_evaluation(tmp_path, capsys):
    """--no-eval with --recipe does what it does for compress quantize (it was refused as ignored)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("evaluation: {datasets: [calibration/heldout-tinyshakespeare.txt], max_windows: 2}\n"
                      "stages:\n  - magnitude: {sparsity: 0.5}\n")
    rc = main(["--json", "prune", "--recipe", str(recipe), "--no-eval", "--model", "default", "--output", str(tmp_path / "out")])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and not report.get("evaluation") and report["output"]["nonzero_parameters"] < report["output"]["parameters"]
