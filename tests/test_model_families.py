"""Round-to-nearest end to end on tiny models of every supported family, built from configs.

For each: the recipe runs, the checkpoint reloads with plain transformers, every target weight
sits exactly on its quantization grid (GPT-2's transposed Conv1D included), lm_head is untouched,
and the reloaded model computes the same outputs as the model quantized in memory.
"""

import hashlib

import pytest
import torch
from transformers import (AutoModel, AutoModelForCausalLM, AutoTokenizer, BertConfig, BertModel, GPT2Config,
                          GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, OPTConfig, OPTForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from compress import activations, modeling, parse_recipe, run_recipe
from compress.errors import CompressError
from compress.quant import fake_quantize
from compress.stages.base import StageContext
from compress.targets import select_modules

V = 2048  # the bundled tokenizer's vocabulary

FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=V)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=V)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=V)),
    "opt": lambda: OPTForCausalLM(OPTConfig(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                                            word_embed_proj_dim=64, vocab_size=V, max_position_embeddings=512)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=V, n_positions=512,
                                                bos_token_id=0, eos_token_id=1)),
    "bert": lambda: BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=96, vocab_size=V)),
}


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # a sliding window far shorter than the calibration windows, and local layers with their own
    # rotary base: a full-attention block fed a local block's mask or rotary tables computes
    # something else entirely
    return Gemma3ForCausalLM(Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, head_dim=16,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                              sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                                              pad_token_id=0, eos_token_id=1, bos_token_id=2))


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    # q, k and v in one fused layer, gate and up in another
    return Phi3ForCausalLM(Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=V, pad_token_id=0, bos_token_id=2, eos_token_id=1))


# Newer layouts, tested where the engine or the smoothing maps treat them differently: Gemma 3
# (norms that scale by 1 + weight, sliding-window layers beside global ones with their own rotary
# tables) and Phi-3 (fused projections).
NEWER_FAMILIES = {"gemma3": _gemma3, "phi3": _phi3}


def _qwen2_sliding():
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=V, use_sliding_window=True, sliding_window=8,
                                        max_window_layers=2))


@pytest.fixture(params=list(FAMILIES) + list(NEWER_FAMILIES))
def tiny_model(request, tmp_path):
    torch.manual_seed(0)
    model = {**FAMILIES, **NEWER_FAMILIES}[request.param]().eval()
    path = tmp_path / request.param
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
    return request.param, path


def digest(directory):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir())}


def recipe_for(path, scheme_yaml: str, eval_file: str):
    return parse_recipe(f"""
model: {path}
calibration: {{dataset: calibration/default.txt, num_samples: 4, seq_len: 64}}
stages:
  - rtn:
{scheme_yaml}
evaluation: {{datasets: [{eval_file}], seq_len: 64, max_windows: 4, max_sentences: 16}}
format: dense   # these tests read the dequantized weights back with plain transformers (tests/test_packed.py: packed)
""", "test")


def test_rtn_roundtrip(tiny_model, tmp_path, repo):
    family, path = tiny_model
    recipe = recipe_for(path, "      scheme: W4A16_ASYM\n      weights: {group_size: 32}", repo / "calibration/heldout-tinyshakespeare.txt")
    out = tmp_path / "out"
    before = digest(path)
    report = run_recipe(recipe, output=str(out), device="cpu")

    original, _, config = modeling.load_model(str(path), device="cpu")
    cls = AutoModelForCausalLM if family != "bert" else AutoModel
    saved = cls.from_pretrained(out).eval()  # plain transformers, no compress code
    targets = select_modules(original, ["Linear"], ["lm_head"])
    assert set(report["layers"]) == set(targets) and len(targets) > 0
    saved_modules = dict(saved.named_modules())
    for name, module in targets.items():
        w = modeling.get_weight(module)
        expected = fake_quantize(w, 4, False, "group", 32)
        assert torch.equal(modeling.get_weight(saved_modules[name]), expected), name
        assert 0 < report["layers"][name]["relative_error"] < 0.2
    if hasattr(original, "lm_head"):
        assert torch.equal(original.lm_head.weight, saved.lm_head.weight)

    # the reloaded checkpoint computes what the model quantized in memory computes
    from compress.stages.rtn import RoundToNearest

    in_memory, _, _ = modeling.load_model(str(path), device="cpu")
    RoundToNearest(scheme="W4A16_ASYM", weights={"group_size": 32}).apply(in_memory, StageContext(device=torch.device("cpu")))
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = in_memory(input_ids=ids), saved(input_ids=ids)
    key = "logits" if family != "bert" else "last_hidden_state"
    assert torch.equal(a[key], b[key])

    # evaluation ran against the untouched original and saw a small, nonzero change
    ev = report["evaluation"][str(repo / "calibration/heldout-tinyshakespeare.txt")]
    if family == "bert":
        assert 0.5 < ev["mean_cosine"] < 1.0
    else:
        assert 0 < ev["kl_divergence"] < 1.0 and 0 < ev["top1_agreement"] <= 1.0
    # the input model directory was not touched
    assert digest(path) == before


def test_static_activation_ranges_survive_reload(tmp_path, repo):
    torch.manual_seed(0)
    path = tmp_path / "llama"
    FAMILIES["llama"]().save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
    recipe = recipe_for(path, "      scheme: W8A8\n      input_activations: {strategy: tensor, dynamic: false}",
                        repo / "calibration/heldout-tinyshakespeare.txt")
    report = run_recipe(recipe, output=str(tmp_path / "out"), device="cpu")
    ranges = [r["activation_range"] for r in report["layers"].values()]
    assert all(lo < 0 < hi for lo, hi in ranges)

    reloaded, _, _ = modeling.load_model(str(tmp_path / "out"), device="cpu")  # reattaches the activation hooks
    attached = activations.attached_inputs(reloaded)
    assert set(attached) == set(report["layers"])
    assert all(tuple(attached[n]["activation_range"]) == tuple(r["activation_range"]) for n, r in report["layers"].items())
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()   # weights only
    ids = torch.randint(0, V, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        q, p = reloaded(input_ids=ids).logits, plain(input_ids=ids).logits
    assert not torch.equal(q, p)  # activation fake-quant really runs
    assert (q - p).abs().max() < 0.5 * p.abs().max()


def assert_engine_feeds_what_the_model_does(model, samples, targets, blocks_path=None, batch_size=1):
    """Every target layer's input as the engine hands it to observers, block by block, equals the
    input the model itself gives that layer on the same samples."""
    from compress.engine import Engine

    expected: dict[str, list] = {}
    handles = [m.register_forward_pre_hook(lambda mod, args, n=n: expected.setdefault(n, []).append(args[0].clone()))
               for n, m in targets.items()]
    with torch.no_grad():
        for s in samples:
            model(**s)
    for h in handles:
        h.remove()

    seen: dict[str, list] = {}

    class Record:  # a stage that only watches
        def observe(self, name, module):
            class Observer:
                def add(self, inputs, output, mask):
                    seen.setdefault(name, []).append(inputs[0].detach().clone())
            return Observer()

        def compress_block(self, *args):
            pass

    summary = Engine(torch.device("cpu"), batch_size=batch_size, blocks_path=blocks_path).run(model, samples, Record(), targets, None)
    for name in targets:
        for got, want in zip(seen[name], expected[name], strict=True):
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), name
    return summary


@pytest.mark.parametrize("build", [FAMILIES["llama"], FAMILIES["bert"], _gemma3, _qwen2_sliding],
                         ids=["llama", "bert", "gemma3-sliding", "qwen2-sliding"])
def test_engine_feeds_every_block_what_the_model_feeds_it(build):
    """The engine captures the first block's inputs once and replays every later block itself. A
    block whose keywords differ from the first's (a sliding-window layer's mask, Gemma 3's local
    and global rotary tables) must get its own, or every statistic from it on is of another model."""
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.randint(5, V, (2, 40), generator=torch.Generator().manual_seed(1))
    targets = {n: m for n, m in select_modules(model, ["Linear"], ["lm_head"]).items()
               if n.endswith(("q_proj", "attention.self.query"))}
    assert len(targets) == model.config.num_hidden_layers
    summary = assert_engine_feeds_what_the_model_does(model, [{"input_ids": ids[i : i + 1]} for i in range(2)], targets)
    assert "untraced_layer_loop" not in summary


class ToyBlock(torch.nn.Module):
    def __init__(self, returns_tuple: bool | int):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.extra = int(returns_tuple)  # Nones returned after the hidden states

    def forward(self, hidden, scale=1.0, shift=0.0):
        out = hidden + self.proj(hidden) * scale + shift
        return (out, *[None] * self.extra) if self.extra else out


class Toy(torch.nn.Module):
    """Three ToyBlocks run by `loop(index, block, hidden)`: a layer loop of one's own making."""

    def __init__(self, loop, returns_tuple=False):
        from types import SimpleNamespace

        super().__init__()
        self.config = SimpleNamespace(model_type="toy")
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(ToyBlock(returns_tuple) for _ in range(3))
        self.loop = loop

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            hidden = self.loop(i, layer, hidden)
        return hidden


def _engine_on_toy(loop, returns_tuple=False) -> dict:
    torch.manual_seed(0)
    model = Toy(loop, returns_tuple).eval()
    samples = [{"input_ids": torch.randint(0, 16, (1, 5))} for _ in range(2)]
    targets = {n: m for n, m in model.named_modules() if n.endswith("proj")}
    return assert_engine_feeds_what_the_model_does(model, samples, targets, blocks_path="layers")


def test_engine_replays_the_first_blocks_keywords_where_the_layer_loop_cannot_be_traced():
    """A layer loop that unpacks a longer tuple from each block cannot run on recorders (which
    return the hidden states, or those and None); the engine then gives every block the first
    block's keywords, says so, and still feeds each block what the model does when those are all
    the same. A loop that unpacks two (older transformers, DeBERTa-v2) is traced."""
    def unpacking(i, layer, hidden):
        hidden, _ = layer(hidden, scale=torch.tensor(0.5))
        return hidden

    assert "untraced_layer_loop" not in _engine_on_toy(unpacking, returns_tuple=True)

    def unpacking_three(i, layer, hidden):
        hidden, _, _ = layer(hidden, scale=torch.tensor(0.5))  # neither a tensor of batch 1 nor a pair unpacks
        return hidden

    summary = _engine_on_toy(unpacking_three, returns_tuple=2)
    assert "first block's keywords (ValueError" in summary["untraced_layer_loop"]
    # and the run says so (the summary alone once did): nothing checked what the later blocks got
    [warning] = summary["warnings"]
    assert warning.startswith("the model's layer loop could not be traced past its first block (ValueError") and \
        "unchecked" in warning


def test_a_layer_loop_that_changes_the_hidden_states_between_blocks_is_refused():
    """DeBERTa-v2 runs a convolution on the hidden states after its first layer: with its layers
    declared as blocks, the engine fed blocks 1 and 2 the bare block outputs (80 % off) and wrote
    a model calibrated on them without a word."""
    def changing(i, layer, hidden):
        hidden = layer(hidden)
        return hidden * 2 if i == 0 else hidden

    def unpacking_and_changing(i, layer, hidden):  # DeBERTa-v2's loop: `output_states, attn_weights = layer(...)`
        hidden, _ = layer(hidden)
        return hidden * 2 if i == 0 else hidden

    for loop, returns_tuple in ((changing, False), (unpacking_and_changing, True)):
        with pytest.raises(CompressError, match=r"changes the hidden states between layers\.0 and layers\.1"):
            _engine_on_toy(loop, returns_tuple)


def test_padding_that_would_change_the_rotary_tables_is_not_done():
    """Phi-3's LongRoPE switches to its long factors when the (padded) batch passes
    original_max_position_embeddings: a 10-token sample padded to 64 beside a longer one was
    calibrated on other positions than it has (block inputs 17 % off). Such samples run one per
    forward (`auto`), and a batch_size that would pad them is refused, as for mixture-of-experts."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from compress.engine import Engine, padding_changes_results

    torch.manual_seed(0)
    config = Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=V, max_position_embeddings=128, pad_token_id=0,
                        original_max_position_embeddings=16,
                        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8})
    model = Phi3ForCausalLM(config).eval()
    short, long = torch.randint(5, V, (1, 10)), torch.randint(5, V, (1, 40))
    padded = {"input_ids": torch.cat([torch.nn.functional.pad(short, (0, 30)), long]),
              "attention_mask": torch.cat([torch.nn.functional.pad(torch.ones_like(short), (0, 30)), torch.ones_like(long)])}
    with torch.no_grad():  # the premise: padding alone changes the short sample's logits
        assert not torch.allclose(model(input_ids=short).logits[0], model(**padded).logits[0, :10], atol=1e-4)
    assert "longrope" in padding_changes_results(model)
    assert padding_changes_results(FAMILIES["llama"]()) is None
    samples = [{"input_ids": x, "attention_mask": torch.ones_like(x)} for x in (long, short)]  # the engine's order
    targets = {n: m for n, m in model.named_modules() if n.endswith("o_proj")}
    summary = assert_engine_feeds_what_the_model_does(model, samples, targets, batch_size="auto")
    assert summary["batch_size"] == 1
    with pytest.raises(CompressError, match=r"batch_size 2 would pad .* rotary embedding \(longrope\) depends on the padded"):
        Engine(torch.device("cpu"), batch_size=2).run(model, samples, None, targets, None)


def test_engine_gives_each_block_only_the_keywords_the_model_gives_it():
    """A keyword the first block gets and a later one does not (nor the reverse) must not leak."""
    summary = _engine_on_toy(lambda i, layer, hidden: layer(hidden, **({"scale": torch.tensor(0.5)} if i == 0
                                                                         else {"shift": torch.tensor(2.0)})))
    assert "untraced_layer_loop" not in summary


def test_layers_after_an_unpacking_layer_loop_are_calibrated_there():
    """A loop that unpacks each block's tuple (`hidden, _ = layer(hidden)`) runs the layers after the
    blocks on stand-ins that return as many items as the blocks do: the head behind such a loop is
    solved by GPTQ on what the model feeds it."""
    from types import SimpleNamespace

    from compress.stages.base import StageContext
    from compress.stages.gptq import GPTQ

    class ToyWithHead(Toy):
        def __init__(self, loop):
            super().__init__(loop, returns_tuple=True)
            self.head = torch.nn.Linear(8, 8)

        def forward(self, input_ids):
            return self.head(super().forward(input_ids))

    def unpacking(i, layer, hidden):
        hidden, _ = layer(hidden)
        return hidden

    torch.manual_seed(0)
    model = ToyWithHead(unpacking).eval()
    samples = [{"input_ids": torch.randint(0, 16, (1, 32))} for _ in range(2)]
    ctx = StageContext(device=torch.device("cpu"), calibration=SimpleNamespace(samples=samples))
    ids = torch.cat([s["input_ids"] for s in samples])  # the engine runs both samples as one batch
    with torch.no_grad():
        expected = model.layers[2](model.layers[1](model.layers[0](model.embed(ids))[0])[0])[0]
    seen = []
    model.head.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    summary = GPTQ(scheme="W8A16", blocks="layers", ignore=[]).apply(model, ctx)
    assert summary["outside_blocks"] == ["head"] and summary["rtn_fallback"] == 0
    assert ctx.layers["head"]["tokens"] == 64 and ctx.layers["head"]["gptq_loss"] is not None
    # the head saw the compressed blocks' outputs (not the float ones)
    assert len(seen) == 1 and seen[0].shape == expected.shape and not torch.equal(seen[0], expected)
    assert torch.allclose(seen[0], expected, atol=0.05)


def test_an_undeclared_family_is_named_its_layer_lists_and_its_packed_output_reloads(tmp_path, capsys):
    """GPT-NeoX: not in the engine's table, so the error names the model's ModuleLists (it
    suggested `blocks: model.layers`, which this model does not have, and then refused it); with
    the suggested `blocks:` it runs, and compress reads its own packed output, whose head
    transformers saves as embed_out (it said "tensor lm_head.weight is missing")."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from compress.cli import main

    torch.manual_seed(0)
    path = tmp_path / "neox"
    GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     vocab_size=V, bos_token_id=0, eos_token_id=1)).save_pretrained(path)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("calibration: {dataset: calibration/default.txt, num_samples: 4, seq_len: 64}\n"
                      "stages:\n  - gptq: {scheme: W4A16, weights: {group_size: 32}}\n")
    assert main(["--quiet", "quantize", "--recipe", str(recipe), "--model", str(path), "--output", str(tmp_path / "out")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "its ModuleLists: gpt_neox.layers (2)" in err and "e.g. `blocks: gpt_neox.layers`" in err
    recipe.write_text(recipe.read_text().replace("group_size: 32}", "group_size: 32}, blocks: gpt_neox.layers"))
    assert main(["--quiet", "quantize", "--recipe", str(recipe), "--model", str(path), "--output", str(tmp_path / "out"),
                 "--no-eval"]) == 0
    ours, _, _ = modeling.load_model(str(tmp_path / "out"))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()  # compressed-tensors decompresses it
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)
