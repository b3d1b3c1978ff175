"""compress analyze: per-layer sensitivity, bit allocation under a budget, and the emitted
mixed-precision recipe run end to end."""

import itertools
import json
import random

import pytest
import torch
import yaml

from compress.bitalloc import Option, allocate
from compress.cli import main
from compress.recipe import load_recipe


def _brute_force(layers, budget):
    names = list(layers)
    best = None
    for combo in itertools.product(*(layers[n] for n in names)):
        if sum(o.bits for o in combo) <= budget:
            cost = sum(o.cost for o in combo)
            if best is None or cost < best:
                best = cost
    return best


@pytest.mark.parametrize("seed", range(6))
def test_allocation_fits_budget_and_is_near_optimal(seed):
    """Against exhaustive search on small random instances: within budget, and no worse than the
    best uniform choice; on these convex-ish costs, close to the true optimum."""
    rng = random.Random(seed)
    layers = {}
    for i in range(6):
        size = rng.choice([1, 2, 5])
        base = rng.uniform(0.1, 3.0)
        layers[f"l{i}"] = [Option(b, size * (b + 0.25), base * 4.0 ** (3 - b) * rng.uniform(0.8, 1.2)) for b in (2, 3, 4)]
    budget = sum(opts[1].bits for opts in layers.values())  # every layer at the middle width
    choice = allocate(layers, budget)
    assert sum(o.bits for o in choice.values()) <= budget + 1e-9
    cost = sum(o.cost for o in choice.values())
    uniform = sum(opts[1].cost for opts in layers.values())
    assert cost <= uniform + 1e-12
    assert cost <= 1.15 * _brute_force(layers, budget)


def test_allocation_refuses_an_impossible_budget():
    with pytest.raises(ValueError):
        allocate({"a": [Option(2, 10, 1.0)]}, 5)


def test_analyze_ranks_layers_and_emits_a_recipe_that_runs(ref_llama, repo, tmp_path, capsys):
    recipe = tmp_path / "mixed.yaml"
    rc = main(["--json", "analyze", "--model", str(ref_llama), "--scheme", "W3", "--group-size", "64", "--windows", "2",
               "--targets", r"re:model\.layers\.0\.", "--data", str(repo / "calibration/default.txt"),
               "--emit-recipe", str(recipe)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    layers = out["layers"]
    assert len(layers) == 7 and all(n.startswith("model.layers.0.") for n in layers)
    for rec in layers.values():  # one bit fewer costs more, one bit more costs less, measured
        kl = {int(b): c["kl_divergence"] for b, c in rec["by_bits"].items()}
        assert kl[2] > kl[3] > kl[4] > 0
    ranked = [r["cost"] for r in out["ranking"]]
    assert ranked == sorted(ranked, reverse=True)
    alloc = out["allocation"]
    assert alloc["storage_bits_per_weight"] <= alloc["budget_bits_per_weight"] + 1e-9
    # W3 codes and one scale per 64, stored as the float32 model stores them (32 bits)
    assert abs(alloc["budget_bits_per_weight"] - (3 + 32 / 64)) < 1e-9
    # the emitted file is a valid recipe whose stages name every analysed layer exactly once
    r = load_recipe(recipe)
    named = [t for _, st in r.stages for t in st.targets]
    assert sorted(named) == sorted(layers)
    widths = {st.weights.num_bits for _, st in r.stages}
    assert widths <= {2, 3, 4}
    # q/k/v and gate/up were also measured whole, each group with its parts rounded together
    groups = out["groups"]
    assert sorted(g["members"] for g in groups.values()) == [
        [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up")], [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]]
    fused = {n for g in groups.values() for n in g["members"]}
    uniform = (sum(rec["by_bits"]["3"]["kl_divergence"] for n, rec in layers.items() if n not in fused)
               + sum(g["by_bits"]["3"]["kl_divergence"] for g in groups.values()))
    assert alloc["predicted_cost"] <= uniform + 1e-15
    # and it runs: the packed checkpoint holds each layer at its chosen width
    rc = main(["--quiet", "quantize", "--recipe", str(recipe), "--output", str(tmp_path / "out")])
    assert rc == 0
    saved = json.loads((tmp_path / "out" / "compress.json").read_text())["layers"]
    assert {n: saved[n]["weights"]["num_bits"] for n in layers} == {n: int(b) for n, b in alloc["bits"].items()}
    # the storage the allocation counted is what the file holds (codes and scales; a shape tensor besides)
    from compress.packing import tensor_bytes

    stored = tensor_bytes(tmp_path / "out")
    bits_on_disk = sum(v for k, v in stored.items() if k.rsplit(".", 1)[0] in layers and not k.endswith("weight_shape")) * 8
    assert bits_on_disk / sum(rec["parameters"] for rec in layers.values()) == pytest.approx(alloc["storage_bits_per_weight"], abs=1e-9)
    # ... and reloads to each layer at its own width
    from compress import modeling
    from compress.quant import fake_quantize

    dense, _, _ = modeling.load_model(str(ref_llama))
    packed, _, _ = modeling.load_model(str(tmp_path / "out"))
    for name, bits in alloc["bits"].items():
        W = modeling.get_weight(dense.get_submodule(name))
        expected = fake_quantize(W, int(bits), True, "group", 64)
        assert torch.allclose(modeling.get_weight(packed.get_submodule(name)), expected, rtol=0, atol=1e-6), name
    header = recipe.read_text().splitlines()[0]
    assert header.startswith("# compress analyze") and yaml.safe_load(recipe.read_text())["model"] == str(ref_llama)
    # the mixed checkpoint analysed in turn: its layers would be measured from their grid values, and it says so
    assert out["warnings"] == []
    rc = main(["analyze", "--model", str(tmp_path / "out"), "--scheme", "W3", "--group-size", "64", "--windows", "1",
               "--targets", r"re:model\.layers\.0\.self_attn\.q_proj", "--data", str(repo / "calibration/default.txt")])
    assert rc == 0 and "is already quantized" in " ".join(capsys.readouterr().err.split())


def test_analyze_can_draw_its_windows_from_all_of_its_data(ref_llama, shared, monkeypatch, capsys):
    """With two --data files the first windows all came from the first one (Tiny Shakespeare holds
    1,400 windows of 256 tokens before WikiText-2 starts); --shuffle draws them from both."""
    import compress.sensitivity
    from compress.modeling import load_tokenizer

    seen = {}

    def fake_analysis(net, ids, *args, **kwargs):
        seen["ids"] = ids
        return {"layers": {}, "windows": len(ids), "wall_s": 0.0}

    monkeypatch.setattr(compress.sensitivity, "analyze", fake_analysis)
    monkeypatch.setattr(compress.sensitivity, "ranking", lambda *a: [])
    files = [shared / "data/tinyshakespeare/train.txt", shared / "data/wikitext-2/train.txt"]
    assert not any(c in "@=" for c in files[0].read_text())  # WikiText's @-@ and = headings mark its windows
    tok = load_tokenizer(str(ref_llama))
    from_wikitext = {}
    for shuffle in (False, True):
        rc = main(["--json", "analyze", "--model", str(ref_llama), "--windows", "64", "--seq-len", "64",
                   *["--shuffle"] * shuffle, "--data", str(files[0]), "--data", str(files[1])])
        assert rc == 0 and json.loads(capsys.readouterr().out)["shuffled"] == shuffle
        texts = tok.batch_decode(seen["ids"])
        from_wikitext[shuffle] = sum(any(c in "@=" for c in t) for t in texts)
    assert from_wikitext[False] == 0 and from_wikitext[True] >= 8


@pytest.mark.parametrize("args, message", [
    (["--scheme", "W9"], "is not an integer weight width"),
    (["--metric", "mse"], "is not a sensitivity metric"),
    (["--budget-bits", "3"], "--budget-bits goes with --emit-recipe"),
    (["--emit-recipe", __file__], "already exists"),  # an existing file is replaced only with --force
])
def test_analyze_bad_input_is_one_line(ref_llama, capsys, args, message):
    rc = main(["analyze", "--model", str(ref_llama), *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err


def test_layers_an_engine_fuses_get_one_width():
    """q/k/v (and gate/up) run as one matrix with one scheme in vLLM, which refuses parts at
    different widths: the allocation prices them together and gives them one width, where alone
    the sensitive q_proj would take 4 bits and k/v 2."""
    from compress.sensitivity import allocate_bits

    def layer(costs):
        return {"shape": [64, 64], "by_bits": {b: {"kl_divergence": c, "storage_bits": 64 * 64 * b} for b, c in costs.items()}}

    prefix = "model.layers.0."
    analysis = {"group_size": None, "symmetric": True, "scale_bits": 0, "layers": {
        prefix + "self_attn.q_proj": layer({2: 9.0, 3: 3.0, 4: 0.1}),
        prefix + "self_attn.k_proj": layer({2: 0.02, 3: 0.01, 4: 0.0}),
        prefix + "self_attn.v_proj": layer({2: 0.02, 3: 0.01, 4: 0.0}),
        prefix + "self_attn.o_proj": layer({2: 0.5, 3: 0.2, 4: 0.1}),
    }}
    bits = allocate_bits(analysis, 3.0)["bits"]
    assert len({bits[prefix + f"self_attn.{p}_proj"] for p in "qkv"}) == 1, bits
    # the same costs on layers no engine fuses are allocated one by one
    alone = {"group_size": None, "symmetric": True, "scale_bits": 0,
             "layers": {f"l{i}": rec for i, rec in enumerate(analysis["layers"].values())}}
    assert len({allocate_bits(alone, 3.0)["bits"][f"l{i}"] for i in range(3)}) > 1


def test_a_fused_group_is_priced_by_its_cost_measured_whole(ref_llama, repo):
    """Rounding q, k and v together can cost more than their costs alone summed (their errors meet
    in the same attention scores): analyze(fused=True) measures each group whole, and the
    allocation prices the group by that measurement rather than by the sum."""
    from compress import modeling
    from compress.calibration import build_calibration
    from compress.recipe import CalibrationConfig
    from compress.sensitivity import _log_probs, allocate_bits, analyze, distribution_cost, weight_args
    from compress.stages.rtn import quantize_weight

    net, tokenizer, _ = modeling.load_model(str(ref_llama), dtype="float32")
    cal = build_calibration(CalibrationConfig(dataset=[str(repo / "calibration/default.txt")], num_samples=2, seq_len=64), tokenizer)
    ids = torch.cat([s["input_ids"] for s in cal.samples])
    qkv = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    out = analyze(net, ids, [2, 3], None, targets=[f"re:{n}$" for n in qkv], fused=True)
    group = out["groups"][qkv[0]]
    assert group["members"] == qkv
    # the joint figure is the model's with all three rounded at once, measured here independently
    originals = {n: modeling.get_weight(net.get_submodule(n)) for n in qkv}
    base = _log_probs(net, ids, 8)
    for n in qkv:
        modeling.set_weight(net.get_submodule(n), quantize_weight(originals[n], weight_args(2, None)))
    joint = distribution_cost(net, ids, base, 8)
    assert group["by_bits"][2]["kl_divergence"] == pytest.approx(joint["kl_divergence"], rel=1e-4)
    assert group["by_bits"][2]["storage_bits"] == sum(out["layers"][n]["by_bits"][2]["storage_bits"] for n in qkv)

    # priced by the joint cost: made dear at 2 bits, the group no longer takes 2 bits
    def analysis(joint_w2):
        rec = lambda c2, c3: {"shape": [64, 64], "by_bits": {2: {"kl_divergence": c2, "storage_bits": 2 * 64 * 64},
                                                             3: {"kl_divergence": c3, "storage_bits": 3 * 64 * 64}}}
        layers = {n: rec(0.01, 0.005) for n in qkv} | {"other": rec(0.2, 0.01)}
        groups = {qkv[0]: {"members": qkv, "by_bits": {2: {"kl_divergence": joint_w2}, 3: {"kl_divergence": 0.015}}}}
        return {"group_size": None, "symmetric": True, "scale_bits": 0, "layers": layers, "groups": groups}

    # 2.75 bits a weight: room for the group, or `other`, at 3 bits, not both
    cheap, dear = (allocate_bits(analysis(w2), 2.75)["bits"] for w2 in (0.03, 1.0))
    assert cheap[qkv[0]] == 2 and cheap["other"] == 3
    assert dear[qkv[0]] == 3 and dear["other"] == 2
