"""Bad input gives a clear one-line error on stderr, exit code 2, and no traceback.

Each case builds its input under tmp_path, calls the CLI in-process and checks:
  * the exit code is 2;
  * there is no Python traceback;
  * stderr is one logical line (rich is told soft_wrap=True, so no wrapping);
  * the message names the offending thing (file, key, line, layer), and a hint where asked;
  * nothing was written: no output directory and no `.out.tmp-*` leftovers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from compress.cli import main
from compress.modeling import DEFAULT_MODEL_DIR
from compress.stages import STAGES

CALIB_TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
GOOD_STAGE = "stages:\n  - rtn:\n      scheme: W8A16\n"


# ------------------------------------------------------------------------------------------------
# helpers


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def copy_model(tmp: Path, name: str = "model") -> Path:
    dst = tmp / name
    shutil.copytree(DEFAULT_MODEL_DIR, dst)
    return dst


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def quantize(tmp: Path, recipe_text: str, *extra: str, model: str | None = "default") -> list[str]:
    """argv for `compress quantize` of a recipe written to tmp/r.yaml, output tmp/out."""
    r = write(tmp / "r.yaml", recipe_text)
    argv = ["--quiet", "quantize", "--recipe", str(r), "--output", str(tmp / "out")]
    if model is not None:
        argv += ["--model", model]
    return argv + list(extra)


def calib_recipe(dataset: str, num_samples: int = 2, seq_len: int = 16, extra: str = "") -> str:
    return (f"calibration:\n  dataset: {dataset}\n  num_samples: {num_samples}\n  seq_len: {seq_len}\n{extra}"
            + GOOD_STAGE)


@dataclass
class Case:
    id: str
    # (tmp_path) -> argv; may create files. Strings in `expect` may use {tmp} for tmp_path.
    setup: Callable[[Path], list[str]]
    expect: list[str]
    hint: bool = True  # the message carries a hint in parentheses or a "did you mean"
    marks: list = field(default_factory=list)


# ------------------------------------------------------------------------------------------------
# recipe cases


def _yaml_syntax(tmp):
    return quantize(tmp, "model: default\nstages:\n  - rtn:\n      scheme: [W8A16\n      ignore: x\n")


def _yaml_list(tmp):
    return quantize(tmp, "- rtn:\n    scheme: W8A16\n")


def _empty_recipe(tmp):
    return quantize(tmp, "# nothing here\n")


def _unknown_stage(tmp):
    return quantize(tmp, "stages:\n  - gptqq:\n      scheme: W8A16\n")


def _stage_name_upper_case(tmp):
    return quantize(tmp, "stages:\n  - RTN:\n      scheme: W8A16\n")


def _stage_key_unknown(tmp):  # the hint lists the keys a user may write (not `resolved`, which compress writes)
    return quantize(tmp, "stages:\n  - rtn:\n      scheme: W8A16\n      bogus: 1\n")


def _stage_typo(tmp):
    return quantize(tmp, "stages:\n  - rtnn:\n      scheme: W8A16\n")


def _top_key_typo(tmp):
    return quantize(tmp, "model: default\ncalibraton:\n  dataset: calibration/default.txt\n" + GOOD_STAGE)


def _stages_key_typo(tmp):  # the only stage list misspelt: it was "missing required key 'stages'"
    return quantize(tmp, "model: default\nstagez:\n  - rtn: {scheme: W8A16}\n")


def _dataset_of_wrong_type(tmp):  # was reported as key calibration.dataset.str
    return quantize(tmp, "calibration: {dataset: 5}\n" + GOOD_STAGE)


def _dataset_list_item_of_wrong_type(tmp):  # was "calibration.dataset: Input should be a valid string"
    return quantize(tmp, "calibration: {dataset: [calibration/default.txt, 5]}\n" + GOOD_STAGE)


def _stage_key_typo(tmp):
    return quantize(tmp, "stages:\n  - rtn:\n      shceme: W8A16\n")


def _weights_key_typo(tmp):
    return quantize(tmp, "stages:\n  - rtn:\n      scheme: W8A16\n      weights:\n        num_bit: 4\n")


def _calibration_key_typo(tmp):
    return quantize(tmp, "calibration:\n  dataset: calibration/default.txt\n  num_sample: 4\n" + GOOD_STAGE)


def _num_bits(n):
    def setup(tmp):
        return quantize(tmp, f"stages:\n  - rtn:\n      scheme: W8A16\n      weights:\n        num_bits: {n}\n")
    return setup


def _negative_group(tmp):
    return quantize(tmp, "stages:\n  - rtn:\n      weights:\n        strategy: group\n        group_size: -64\n")


def _weights_per_token(tmp):  # an internal error (compressed-tensors' validation) before
    return quantize(tmp, "stages:\n  - rtn:\n      scheme: W8A16\n      weights: {strategy: token}\n")


def _weights_dynamic(tmp):
    return quantize(tmp, "stages:\n  - rtn:\n      scheme: W8A16\n      weights: {dynamic: true}\n")


SMALL_CALIB = "calibration: {dataset: calibration/default.txt, num_samples: 4, seq_len: 32}\n"


def _stages(text: str):  # the fuzzing review's finds: each was an internal error, a hang, or silent
    return lambda tmp: quantize(tmp, SMALL_CALIB + "stages:\n" + text)


def _cache_dir_is_a_file(tmp):
    write(tmp / "a-file", "not a directory\n")
    return quantize(tmp, SMALL_CALIB + "stages:\n  - distill: {data: {generate: {num_sequences: 6, cache_dir: "
                    + str(tmp / "a-file") + "}, seq_len: 16, eval_samples: 2}, train: {steps: 1}}\n")


def _group_with_channel(tmp):
    return quantize(tmp, "stages:\n  - rtn:\n      scheme: W8A16\n      weights:\n        strategy: channel\n"
                         "        group_size: 64\n")


def _unknown_preset(tmp):
    return quantize(tmp, "stages:\n  - rtn:\n      scheme: W3A77\n")


def _missing_stages(tmp):
    return quantize(tmp, "model: default\noutput: out\n")


def _empty_stages(tmp):
    return quantize(tmp, "model: default\nstages: []\n")


def _two_key_stage(tmp):
    return quantize(tmp, "stages:\n  - rtn:\n      scheme: W8A16\n    gptq:\n      scheme: W4A16\n")


def _stage_body_not_mapping(tmp):
    return quantize(tmp, "stages:\n  - rtn: W8A16\n")


def _bad_type(tmp):
    return quantize(tmp, "calibration:\n  dataset: calibration/default.txt\n  num_samples: many\n" + GOOD_STAGE)


def _static_no_calibration(tmp):
    return quantize(tmp, "stages:\n  - rtn:\n      scheme: W8A8\n      input_activations: {strategy: tensor, dynamic: false}\n")


def _gptq_without_calibration(tmp):
    return quantize(tmp, "stages:\n  - gptq:\n      scheme: W4A16\n")


def _qat_without_data(tmp):  # it was told it needed "static activation ranges", for W4A16
    return quantize(tmp, "stages:\n  - qat:\n      scheme: W4A16\n")


def _static_without_calibration(tmp):
    return quantize(tmp, "stages:\n  - rtn:\n      scheme: W8A8\n      input_activations: {strategy: tensor, dynamic: false}\n")


def _recipe_not_found(tmp):
    return ["quantize", "--recipe", str(tmp / "nope.yaml"), "--model", "default", "--output", str(tmp / "out")]


def _recipe_is_dir(tmp):
    (tmp / "recipes.yaml").mkdir()
    return ["quantize", "--recipe", str(tmp / "recipes.yaml"), "--model", "default", "--output", str(tmp / "out")]


def _recipe_not_utf8(tmp):
    write(tmp / "r.yaml", "model: caf\xe9\n".encode("latin-1") + GOOD_STAGE.encode())
    return ["quantize", "--recipe", str(tmp / "r.yaml"), "--model", "default", "--output", str(tmp / "out")]


# ------------------------------------------------------------------------------------------------
# model cases


def _no_model(tmp):
    return quantize(tmp, GOOD_STAGE, model=None)


def _no_output(tmp):
    r = write(tmp / "r.yaml", GOOD_STAGE)
    return ["quantize", "--recipe", str(r), "--model", "default"]


def _model_missing(tmp):
    return quantize(tmp, GOOD_STAGE, model=str(tmp / "no-such-model"))


def _model_no_config(tmp):
    (tmp / "empty-model").mkdir()
    return quantize(tmp, GOOD_STAGE, model=str(tmp / "empty-model"))


def _model_hub_offline(tmp):
    return quantize(tmp, GOOD_STAGE, model="no-such-org/no-such-model")


def _model_is_file(tmp):
    write(tmp / "model.bin", b"\x00" * 16)
    return quantize(tmp, GOOD_STAGE, model=str(tmp / "model.bin"))


def _model_no_weights(tmp):
    d = tmp / "cfg-only"
    d.mkdir()
    shutil.copy(DEFAULT_MODEL_DIR / "config.json", d / "config.json")
    return quantize(tmp, GOOD_STAGE, model=str(d))


def _model_bad_config(tmp):
    d = tmp / "bad-config"
    d.mkdir()
    write(d / "config.json", "{not json")
    return quantize(tmp, GOOD_STAGE, model=str(d))


def _model_truncated(tmp):
    d = copy_model(tmp)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return quantize(tmp, GOOD_STAGE, model=str(d))


def _model_garbage(tmp):
    d = copy_model(tmp)
    (d / "model.safetensors").write_bytes(b"this is not a safetensors file at all" * 10)
    return quantize(tmp, GOOD_STAGE, model=str(d))


def _model_nan_layer(tmp):
    from safetensors.torch import load_file, save_file

    d = copy_model(tmp)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return quantize(tmp, GOOD_STAGE, model=str(d))


def _targets_match_nothing(tmp):
    return quantize(tmp, "stages:\n  - rtn:\n      scheme: W8A16\n      targets: [Conv2d]\n")


# ------------------------------------------------------------------------------------------------
# calibration cases (the model loads first: about a second each)


def _calib_empty(tmp):
    write(tmp / "empty.txt", "")
    return quantize(tmp, calib_recipe(str(tmp / "empty.txt")))


def _calib_short(tmp):
    write(tmp / "short.txt", CALIB_TEXT)
    return quantize(tmp, calib_recipe(str(tmp / "short.txt"), num_samples=128, seq_len=256))


def _calib_missing(tmp):
    return quantize(tmp, calib_recipe(str(tmp / "missing.txt")))


def _calib_binary(tmp):
    write(tmp / "blob.txt", bytes(range(256)) * 8)
    return quantize(tmp, calib_recipe(str(tmp / "blob.txt")))


def _calib_latin1(tmp):
    write(tmp / "latin.txt", ("caf\xe9 " * 100).encode("latin-1"))
    return quantize(tmp, calib_recipe(str(tmp / "latin.txt")))


def _calib_jsonl_field(tmp):
    write(tmp / "c.jsonl", json.dumps({"text": CALIB_TEXT}) + "\n" + json.dumps({"content": CALIB_TEXT}) + "\n")
    return quantize(tmp, calib_recipe(str(tmp / "c.jsonl")))


def _calib_jsonl_bad_json(tmp):
    write(tmp / "c.jsonl", json.dumps({"text": CALIB_TEXT}) + "\n{oops\n")
    return quantize(tmp, calib_recipe(str(tmp / "c.jsonl")))


def _calib_is_dir(tmp):
    (tmp / "corpus.txt").mkdir()
    return quantize(tmp, calib_recipe(str(tmp / "corpus.txt")))


def _calib_parquet_bad(tmp):
    write(tmp / "c.parquet", b"PAR1 definitely not parquet")
    return quantize(tmp, calib_recipe(str(tmp / "c.parquet")))


def _calib_hub_offline(tmp):
    return quantize(tmp, calib_recipe("no-such-org/no-such-dataset"))


# ------------------------------------------------------------------------------------------------
# output cases


def _output_is_file(tmp):
    write(tmp / "out", "x")
    return quantize(tmp, GOOD_STAGE)


def _output_under_a_file(tmp):
    write(tmp / "out", "x")
    return quantize(tmp, GOOD_STAGE)[:-4] + ["--output", str(tmp / "out" / "w8"), "--model", "default"]


def _output_name_near_the_limit(tmp):
    # 250 bytes is a valid name, but not as `.<name>.tmp-<pid>`: this was "File name too long"
    # (of a name the user never gave) when the checkpoint was written, after the stages ran
    argv = quantize(tmp, GOOD_STAGE)
    argv[argv.index("--output") + 1] = str(tmp / ("o" * 250))
    return argv


def _output_inside_model(tmp):
    d = copy_model(tmp)
    r = write(tmp / "r.yaml", GOOD_STAGE)
    return ["quantize", "--recipe", str(r), "--model", str(d), "--output", str(d / "q")]


def _model_inside_output_forced(tmp):
    # --force would replace the whole output directory, and the model with it
    d = copy_model(tmp)
    r = write(tmp / "r.yaml", GOOD_STAGE)
    return ["quantize", "--recipe", str(r), "--model", str(d), "--output", str(tmp), "--force"]


def _output_not_ours_forced(tmp):
    (tmp / "out").mkdir()
    write(tmp / "out" / "keep.txt", "mine")
    return quantize(tmp, GOOD_STAGE, "--force")


def _output_exists(tmp):
    (tmp / "out").mkdir()
    write(tmp / "out" / "keep.txt", "mine")
    return quantize(tmp, GOOD_STAGE)


# ------------------------------------------------------------------------------------------------
# global options


def _device_cuda(tmp):
    return quantize(tmp, GOOD_STAGE, "--device", "cuda")


def _device_unknown(tmp):
    return quantize(tmp, GOOD_STAGE, "--device", "tpu")


def _device_list_unknown(tmp):
    return quantize(tmp, GOOD_STAGE, "--device", "cpu,tpu:1")


def _dtype_unknown(tmp):
    return quantize(tmp, GOOD_STAGE, "--dtype", "float8")


# ------------------------------------------------------------------------------------------------
# eval and inspect


def _eval_threshold_no_baseline(tmp):
    return ["eval", "--model", "default", "--data", "calibration/heldout-tinyshakespeare.txt", "--max-kl", "0.1"]


def _eval_dtype(tmp):  # eval computes in float32; a --dtype (even one that does not exist) was silently ignored
    return ["--dtype", "bogus", "eval", "--model", "default", "--data", "calibration/heldout-tinyshakespeare.txt"]


def _eval_data_missing(tmp):
    return ["eval", "--model", "default", "--data", str(tmp / "heldout.txt")]


def _eval_no_data(tmp):
    return ["eval", "--model", "default"]


def _eval_data_too_short(tmp):
    write(tmp / "tiny.txt", "hello")
    return ["eval", "--model", "default", "--data", str(tmp / "tiny.txt")]


def _calib_longer_than_context(tmp):
    return quantize(tmp, calib_recipe("calibration/default.txt", seq_len=4096))


def _eval_longer_than_context(tmp):
    return ["eval", "--model", "default", "--data", "calibration/heldout-tinyshakespeare.txt", "--seq-len", "1024"]


def _packed_group_size_not_dividing(tmp):
    # refused before calibration: 256 input features are no whole number of groups of 100
    stage = "stages:\n  - gptq:\n      scheme: W4A16\n      weights: {group_size: 100}\n"
    return quantize(tmp, calib_recipe("calibration/default.txt").replace(GOOD_STAGE, stage), "--format", "packed")


def _packed_with_disk_offload(tmp):
    return quantize(tmp, "offload: disk\n" + GOOD_STAGE, "--format", "packed")


def _eval_baseline_missing(tmp):
    return ["eval", "--model", "default", "--baseline", str(tmp / "gone"), "--data", "calibration/heldout-tinyshakespeare.txt"]


def _eval_baseline_hub_id_unknown(tmp):  # offline, not cached: it was not named as the baseline
    return ["eval", "--model", "default", "--baseline", "no-such-org/no-such-model", "--data", "calibration/heldout-tinyshakespeare.txt"]


def _eval_no_windows(tmp):
    return ["eval", "--model", "default", "--data", "calibration/heldout-tinyshakespeare.txt", "--max-windows", "0"]


def _eval_threshold_as_percent(tmp):
    # top-1 agreement is a fraction: 99 could never pass, a red gate forever
    return ["eval", "--model", "default", "--baseline", "default", "--data", "calibration/heldout-tinyshakespeare.txt",
            "--min-top1", "99"]


def _eval_report_is_dir(tmp):
    (tmp / "report.md").mkdir()
    return ["eval", "--model", "default", "--data", "x.txt", "--report", str(tmp / "report.md")]


def _eval_task_option_without_tasks(tmp):
    return ["eval", "--model", "default", "--data", "calibration/heldout-tinyshakespeare.txt", "--limit", "5"]


def _eval_task_drop_no_baseline(tmp):
    return ["eval", "--model", "default", "--tasks", "arc_easy", "--max-task-drop", "0.01"]


def _eval_task_unknown(tmp):
    return ["eval", "--model", "default", "--tasks", "arc_easy,no_such_task"]


def _eval_task_include_path_missing(tmp):
    return ["eval", "--model", "default", "--tasks", "mine", "--include-path", str(tmp / "tasks")]


def _eval_task_data_missing(tmp):
    write(tmp / "tasks/mine.yaml", f"task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp / 'gone.jsonl'}\n"
          "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{c}}'\ndoc_to_target: 0\n")
    return ["eval", "--model", "default", "--tasks", "mine", "--include-path", str(tmp / "tasks")]


def _eval_model_missing(tmp):
    return ["eval", "--model", str(tmp / "gone"), "--data", "calibration/heldout-tinyshakespeare.txt"]


def _side_output_in_model(command):
    """eval --report, analyze --emit-recipe, bench --output aimed into the input model's directory."""
    def setup(tmp):
        model = copy_model(tmp)
        data = write(tmp / "d.txt", CALIB_TEXT * 20)
        return {"eval": ["eval", "--model", str(model), "--data", str(data), "--max-windows", "1", "--report", str(model / "config.json")],
                "analyze": ["analyze", "--model", str(model), "--data", str(data), "--windows", "1", "--emit-recipe", str(model / "r.yaml")],
                "bench": ["bench", "--model", str(model), "--recipes", "recipes/w8a16-absmax.yaml", "--output", str(model)]}[command]
    return setup


def _bench_output_holds_model(tmp):
    copy_model(tmp / "work")
    return ["bench", "--model", str(tmp / "work" / "model"), "--recipes", "recipes/w8a16-absmax.yaml", "--output", str(tmp / "work")]


def _eval_other_tokenizer(tmp):
    """Same weights, a tokenizer that maps words to other ids: scoring both models on one set of
    ids would compare nothing (KL 0, a passed gate)."""
    model = copy_model(tmp)
    spec = json.loads((model / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    ids = sorted(i for i in vocab.values() if i >= 100)
    swapped = dict(zip(ids, reversed(ids)))
    spec["model"]["vocab"] = {k: swapped.get(i, i) for k, i in vocab.items()}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    return ["eval", "--model", str(model), "--baseline", "default", "--data", "calibration/heldout-tinyshakespeare.txt",
            "--max-windows", "1", "--max-kl", "0.01"]


def _eval_other_merges(tmp):
    """Same vocabulary, a tokenizer that splits text otherwise (a quarter of its merges): both
    models read the broken tokenizer's ids, so KL was 0 and the gate passed."""
    model = copy_model(tmp)
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][: len(spec["model"]["merges"]) // 4]
    (model / "tokenizer.json").write_text(json.dumps(spec))
    return ["eval", "--model", str(model), "--baseline", "default", "--data", "calibration/heldout-tinyshakespeare.txt",
            "--max-windows", "1", "--max-kl", "0.01"]


def _damaged_meta(text):
    def setup(tmp):
        model = copy_model(tmp)
        write(model / "compress.json", text)
        return ["eval", "--model", str(model), "--data", "calibration/heldout-tinyshakespeare.txt", "--max-windows", "1"]
    return setup


def _config_other_sizes(tmp):
    model = copy_model(tmp)
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] = 512  # the weights hold 640
    write(model / "config.json", json.dumps(config))
    return ["eval", "--model", str(model), "--data", "calibration/heldout-tinyshakespeare.txt", "--max-windows", "1"]


def _inspect_foreign(tmp):
    d = copy_model(tmp, "plain")
    return ["inspect", str(d)]


def _inspect_empty_meta(tmp):
    model = copy_model(tmp)
    write(model / "compress.json", "{}")  # exited 0 with a summary of None
    return ["inspect", str(model)]


def _inspect_missing(tmp):
    return ["inspect", str(tmp / "nothing")]


def _plan_no_model(tmp):
    r = write(tmp / "r.yaml", GOOD_STAGE)
    return ["plan", "--recipe", str(r)]


# ------------------------------------------------------------------------------------------------
# prune


def _prune(*extra):
    def setup(tmp):
        return ["--quiet", "prune", "--model", "default", "--output", str(tmp / "out"), *extra]
    return setup


def _prune_recipe_with_method(tmp):
    r = write(tmp / "r.yaml", "stages:\n  - magnitude: {sparsity: 0.5}\n")
    return ["prune", "--recipe", str(r), "--method", "wanda", "--model", "default", "--output", str(tmp / "out")]


def _prune_recipe_with_eval_options(tmp):
    r = write(tmp / "r.yaml", "stages:\n  - magnitude: {sparsity: 0.5}\n")
    return ["prune", "--recipe", str(r), "--no-eval", "--num-samples", "4", "--model", "default", "--output", str(tmp / "out")]


def _pattern_unquoted(tmp):
    return quantize(tmp, "stages:\n  - magnitude:\n      pattern: 2:4\n")


def _pattern_does_not_tile(tmp):
    return quantize(tmp, "stages:\n  - magnitude:\n      pattern: \"3:7\"\n")


def _overrides_match_nothing(tmp):
    return quantize(tmp, "stages:\n  - magnitude:\n      sparsity_overrides: {mlp.nothing: 0.3}\n")


def _joint_quant_activations(tmp):
    return quantize(tmp, "calibration: {}\nstages:\n  - sparsegpt:\n      quantize: {scheme: W8A8}\n")


# ------------------------------------------------------------------------------------------------
# issue 9: architecture, tokenizer, contradictions and ranges in the recipe, the stage cache, and
# numerical faults in the calibration activations (each names the layer)


def _edit_tensor(model_dir: Path, name: str, value: float) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    tensors[name][0] = value
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


def _model_unknown_to_transformers(tmp):
    d = copy_model(tmp)
    config = json.loads((d / "config.json").read_text())
    config["model_type"], config["architectures"] = "brandnewformer", ["BrandNewFormerForCausalLM"]
    write(d / "config.json", json.dumps(config))
    return quantize(tmp, GOOD_STAGE, model=str(d))


def _model_unknown_to_engine(tmp):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    d = tmp / "neox"
    torch.manual_seed(0)
    GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     vocab_size=2048, max_position_embeddings=64)).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / f, d / f)
    return quantize(tmp, calib_recipe("calibration/default.txt").replace(GOOD_STAGE, "stages:\n  - gptq:\n      scheme: W8A16\n"),
                    model=str(d))


def _tokenizer_missing(tmp):
    d = copy_model(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink()
    return quantize(tmp, GOOD_STAGE, model=str(d))


def _group_not_whole_for_packed(tmp):
    return quantize(tmp, "stages:\n  - rtn:\n      weights: {num_bits: 4, strategy: group, group_size: 48}\n", "--format", "packed")


def _recipe_pattern_contradicts_sparsity(tmp):
    return quantize(tmp, "stages:\n  - magnitude:\n      pattern: \"2:4\"\n      sparsity: 0.3\n")


def _recipe_sparsity_out_of_range(tmp):
    return quantize(tmp, "stages:\n  - magnitude:\n      sparsity: 1.5\n")


def _smoothquant_alpha_out_of_range(tmp):
    return quantize(tmp, calib_recipe("calibration/default.txt").replace(GOOD_STAGE, "stages:\n  - smoothquant:\n      alpha: 2\n"))


def _smoothquant_alpha_override_out_of_range(tmp):
    return quantize(tmp, calib_recipe("calibration/default.txt").replace(
        GOOD_STAGE, "stages:\n  - smoothquant:\n      alpha_overrides: {mlp.up_proj: -2}\n"))


def _batch_size(value):
    def setup(tmp):
        return quantize(tmp, calib_recipe("calibration/default.txt").replace(
            GOOD_STAGE, f"stages:\n  - gptq:\n      scheme: W8A16\n      batch_size: {value}\n"))
    return setup


def _gptq_damping_zero(tmp):
    return quantize(tmp, calib_recipe("calibration/default.txt").replace(
        GOOD_STAGE, "stages:\n  - gptq:\n      scheme: W8A16\n      dampening_frac: 0\n"))


def _gptq_actorder(setting):
    def setup(tmp):
        return quantize(tmp, calib_recipe("calibration/default.txt").replace(
            GOOD_STAGE, f"stages:\n  - gptq:\n      scheme: W4A16\n      {setting}\n"))
    return setup


def _targets_not_a_list(tmp):
    return quantize(tmp, "stages:\n  - rtn:\n      scheme: W8A16\n      targets: {Linear: yes}\n")


def _calib_zero_samples(tmp):
    return quantize(tmp, calib_recipe("calibration/default.txt", num_samples=0))


def _cache_dir_is_file(tmp):
    write(tmp / "cache", "not a directory")
    return quantize(tmp, GOOD_STAGE, "--resume", "--cache-dir", str(tmp / "cache"))


def _resume_with_offload(tmp):
    return quantize(tmp, "offload: disk\n" + calib_recipe("calibration/default.txt").replace(
        GOOD_STAGE, "stages:\n  - gptq:\n      scheme: W8A16\n"), "--resume", "--cache-dir", str(tmp / "cache"))


def _activations_fault(stage: str, value: float, *extra: str):
    """A norm weight set to NaN/Inf (or, in float16, to a value that overflows) makes the
    activations entering block 1's MLP non-finite while every quantized weight stays finite."""
    def setup(tmp):
        d = copy_model(tmp)
        _edit_tensor(d, "model.layers.1.post_attention_layernorm.weight", value)
        return quantize(tmp, calib_recipe("calibration/default.txt").replace(GOOD_STAGE, f"stages:\n  - {stage}\n"),
                        *extra, model=str(d))
    return setup


CASES_ISSUE9 = [
    Case("model-unknown-to-transformers", _model_unknown_to_transformers, ["{tmp}/model", "brandnewformer", "not supported"]),
    Case("architecture-unknown-to-engine", _model_unknown_to_engine, ["gpt_neox", "blocks:"]),
    Case("tokenizer-missing", _tokenizer_missing, ["{tmp}/model", "has no tokenizer", "tokenizer.json"]),
    Case("group-size-not-whole-groups-packed", _group_not_whole_for_packed,
         ["model.layers.0.self_attn.q_proj", "groups of 48", "--format dense"]),
    Case("recipe-pattern-contradicts-sparsity", _recipe_pattern_contradicts_sparsity, ["r.yaml:3", "0.3", "2:4"]),
    Case("recipe-sparsity-out-of-range", _recipe_sparsity_out_of_range, ["r.yaml:3", "sparsity"]),
    Case("smoothquant-alpha-out-of-range", _smoothquant_alpha_out_of_range, ["r.yaml:7", "alpha"]),
    Case("smoothquant-alpha-override-out-of-range", _smoothquant_alpha_override_out_of_range,
         ["r.yaml:7", "alpha_overrides.mlp.up_proj", "greater than or equal to 0"]),
    Case("gptq-damping-zero", _gptq_damping_zero, ["r.yaml:8", "dampening_frac"]),
    Case("gptq-actorder-static-without-static-groups", _gptq_actorder("actorder: static\n      static_groups: false"),
         ["r.yaml", "actorder: static", "actorder: group"]),
    Case("gptq-actorder-group-with-static-groups", _gptq_actorder("actorder: group\n      static_groups: true"),
         ["r.yaml", "actorder: group", "actorder: static"]),
    Case("gptq-actorder-unknown", _gptq_actorder("actorder: weights"), ["r.yaml", "actorder"]),
    Case("batch-size-zero", _batch_size(0), ["r.yaml:8", "batch_size", "or auto (got 0)"]),
    Case("batch-size-word", _batch_size("many"), ["r.yaml:8", "batch_size", "or auto (got 'many')"]),
    Case("targets-not-a-list", _targets_not_a_list, ["r.yaml:4", "targets", "list"]),
    Case("calib-zero-samples", _calib_zero_samples, ["r.yaml:3", "num_samples"]),
    Case("cache-dir-is-a-file", _cache_dir_is_file, ["{tmp}/cache", "is a file", "--cache-dir"]),
    Case("resume-with-offload-disk", _resume_with_offload, ["r.yaml", "--resume", "offload: disk"]),
    Case("activations-nan-gptq", _activations_fault("gptq: {scheme: W8A16}", float("nan")),
         ["layer model.layers.1.mlp.", "non-finite calibration activations"]),
    Case("activations-inf-smoothquant", _activations_fault("smoothquant: {}", float("inf")),
         ["layer model.layers.1.mlp.", "non-finite calibration activations"]),
    Case("activations-nan-static-ranges", _activations_fault(
        "rtn: {scheme: W8A8, input_activations: {strategy: tensor, dynamic: false}}", float("nan")),
         ["layer model.layers.1.mlp.", "non-finite calibration activations"]),
    Case("activations-nan-wanda", _activations_fault("wanda: {sparsity: 0.5}", float("nan")),
         ["layer model.layers.1.mlp.", "non-finite calibration activations"]),
    Case("float16-overflow-in-calibration", _activations_fault("gptq: {scheme: W8A16}", 60000.0, "--dtype", "float16"),
         ["layer model.layers.1.mlp.", "float16 overflow", "--dtype float32"]),
]


# ------------------------------------------------------------------------------------------------
# usage errors (click): should also be one line


def _unknown_option(tmp):
    return ["quantize", "--recipee", "r.yaml"]


def _missing_option(tmp):
    return ["quantize", "--model", "default"]


def _bad_int_option(tmp):
    return ["--seed", "many", "quantize", "--recipe", "r.yaml"]



NEEDS_LM_EVAL = [pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval not installed")]

CASES = [
    # recipe: YAML and shape
    Case("yaml-syntax", _yaml_syntax, ["r.yaml:", "invalid YAML", ":5"]),
    Case("yaml-list", _yaml_list, ["r.yaml", "mapping"]),
    Case("yaml-empty", _empty_recipe, ["r.yaml", "mapping"]),
    Case("recipe-not-found", _recipe_not_found, ["nope.yaml", "not found"]),
    Case("gptq-without-calibration", _gptq_without_calibration, ["r.yaml", "'gptq' needs calibration", "layer by layer"]),
    Case("qat-without-data", _qat_without_data, ["r.yaml", "'qat' has no text to train on", "data: {{dataset: FILE}}"]),
    Case("static-without-calibration", _static_without_calibration, ["r.yaml", "static activation ranges", "dynamic"]),
    Case("recipe-is-dir", _recipe_is_dir, ["recipes.yaml"]),
    Case("recipe-not-utf8", _recipe_not_utf8, ["r.yaml", "UTF-8"]),
    # recipe: keys and values
    Case("unknown-stage", _unknown_stage,
         ["r.yaml:2", "gptqq", "did you mean 'gptq'" if "gptq" in STAGES else "known stages: rtn"]),
    Case("stage-name-typo", _stage_typo, ["r.yaml:2", "rtnn", "did you mean 'rtn'"]),
    Case("stage-name-upper-case", _stage_name_upper_case, ["r.yaml:2", "'RTN'", "did you mean 'rtn'"]),
    Case("stage-key-unknown", _stage_key_unknown, ["r.yaml:4", "bogus", "valid keys here: scheme, weights, input_activations, targets, ignore"]),
    Case("top-key-typo", _top_key_typo, ["r.yaml:2", "calibraton", "did you mean 'calibration'"]),
    Case("stages-key-typo", _stages_key_typo, ["r.yaml:2", "unknown key 'stagez'; did you mean 'stages'"]),
    Case("dataset-of-wrong-type", _dataset_of_wrong_type,
         ["r.yaml:1", "calibration.dataset: Input should be a valid string or a valid list, got 5"]),
    Case("dataset-list-item-of-wrong-type", _dataset_list_item_of_wrong_type,
         ["r.yaml:1", "calibration.dataset.1: Input should be a valid string, got 5"]),
    Case("stage-key-typo", _stage_key_typo, ["r.yaml:3", "shceme", "did you mean 'scheme'"]),
    Case("weights-key-typo", _weights_key_typo, ["r.yaml:5", "num_bit", "did you mean 'num_bits'"]),
    Case("calibration-key-typo", _calibration_key_typo, ["r.yaml:3", "num_sample", "did you mean 'num_samples'"]),
    Case("num-bits-0", _num_bits(0), ["r.yaml:5", "num_bits", "2"]),
    Case("num-bits-9", _num_bits(9), ["r.yaml:5", "num_bits", "8"]),
    Case("negative-group-size", _negative_group, ["r.yaml:5", "group_size"]),
    Case("group-size-with-channel", _group_with_channel, ["r.yaml", "group_size", "channel", "strategy: group"]),
    Case("calibration-dataset-empty-list", lambda tmp: quantize(tmp, "calibration: {dataset: []}\n" + GOOD_STAGE),
         ["r.yaml:1", "calibration.dataset", "an empty name or list"]),
    Case("kv-cache-twice", _stages("  - kv_cache: {}\n  - kv_cache: {}\n"), ["r.yaml", "stages.0.kv_cache is repeated"]),
    Case("activation-budget-inf", _stages("  - gptq: {scheme: W4A16, activation_budget: infGiB}\n"),
         ["r.yaml:3", "activation_budget", "infGiB", "4GiB"]),
    Case("activation-budget-negative", _stages("  - gptq: {scheme: W4A16, activation_budget: -1}\n"), ["r.yaml:3", "activation_budget -1"]),
    Case("group-size-huge", _stages("  - rtn: {scheme: W4A16, weights: {group_size: 100000000000000000000000}}\n"),
         ["r.yaml:3", "group_size", "131072"]),
    Case("shrink-grid-huge", _stages("  - gptq: {scheme: W4A16, shrink_grid: 1000000000}\n"), ["r.yaml:3", "shrink_grid", "1000"]),
    Case("awq-grid-huge", _stages("  - awq: {scheme: W4A16, grid: 1000000000}\n"), ["r.yaml:3", "grid", "1000"]),
    Case("dampening-inf", _stages("  - gptq: {scheme: W4A16, dampening_frac: .inf}\n"), ["r.yaml:3", "dampening_frac", "finite"]),
    Case("evaluation-seq-len-1", _stages("  - rtn: {scheme: W8A16}\nevaluation: {datasets: [calibration/heldout-tinyshakespeare.txt], "
                                         "seq_len: 1}\n"), ["r.yaml", "evaluation.seq_len", "2"]),
    Case("mapping-smooths-a-module-without-weight", _stages("  - awq: {scheme: W4A16, mappings: [{smooth: mlp, balance: [mlp.down_proj]}]}\n"),
         ["mapping mlp -> mlp.down_proj", "LlamaMLP, with no weight to fold scales into"]),
    Case("generate-cache-dir-is-a-file", _cache_dir_is_a_file, ["data.generate.cache_dir", "a-file", "cannot keep generated sequences"]),
    Case("training-seq-len-unlike-the-calibration-windows", _stages("  - distill: {data: {seq_len: 1024}, train: {steps: 1}}\n"),
         ["stages.0.distill.data.seq_len is 1024", "calibration.seq_len 32"]),
    # refused by plan and by the parse, as by the run after the stages before it (a reviewer's qat)
    Case("training-more-windows-than-the-calibration-gives",
         _stages("  - qat: {scheme: W8A16, data: {num_samples: 12, eval_samples: 4}, train: {steps: 1}}\n"),
         ["stages.0.qat trains on the calibration windows, calibration.num_samples 4", "12 + data.eval_samples 4 need 16"]),
    Case("training-on-calibration-windows-all-held-out", _stages("  - distill: {train: {steps: 1}}\n"),
         ["stages.0.distill trains on the calibration windows", "eval_samples 16 held out and one to train on need 17"]),
    Case("weights-per-token", _weights_per_token, ["r.yaml:3", "stages.0.rtn", "weights have no tokens", "channel, group or tensor"]),
    Case("weights-dynamic", _weights_dynamic, ["r.yaml:3", "stages.0.rtn", "dynamic is for input_activations"]),
    Case("unknown-preset", _unknown_preset, ["r.yaml:3", "W3A77", "W8A16"]),
    Case("missing-stages", _missing_stages, ["r.yaml", "stages"]),
    Case("empty-stages", _empty_stages, ["r.yaml:2", "stages"]),
    Case("two-key-stage", _two_key_stage, ["r.yaml:2", "one key"]),
    Case("stage-body-not-mapping", _stage_body_not_mapping, ["r.yaml:2", "rtn", "mapping"]),
    Case("bad-value-type", _bad_type, ["r.yaml:3", "num_samples", "integer"]),
    Case("static-without-calibration", _static_no_calibration, ["r.yaml", "rtn", "calibration"]),
    # model
    Case("no-model", _no_model, ["r.yaml", "no model", "--model"]),
    Case("no-output", _no_output, ["r.yaml", "no output", "--output"]),
    Case("model-missing", _model_missing, ["no-such-model", "does not exist"]),
    Case("model-hub-id-offline", _model_hub_offline, ["no-such-org/no-such-model", "local cache"]),
    Case("model-is-file", _model_is_file, ["model.bin", "file"]),
    Case("model-no-config", _model_no_config, ["empty-model", "config.json"]),
    Case("model-bad-config", _model_bad_config, ["bad-config", "config.json"]),
    Case("model-no-weights", _model_no_weights, ["cfg-only", "no weights"]),
    Case("model-truncated", _model_truncated, ["{tmp}/model", "weights"]),
    Case("model-garbage", _model_garbage, ["{tmp}/model", "weights"]),
    Case("model-nan-layer", _model_nan_layer, ["model.layers.0.mlp.down_proj", "NaN"]),
    Case("targets-match-nothing", _targets_match_nothing, ["Conv2d", "match no"]),
    # calibration
    Case("calib-empty", _calib_empty, ["empty.txt", "empty"]),
    Case("calib-too-short", _calib_short, ["short.txt", "128", "256"]),
    Case("calib-missing", _calib_missing, ["missing.txt", "not found"]),
    Case("calib-binary", _calib_binary, ["blob.txt", "binary"]),
    Case("calib-not-utf8", _calib_latin1, ["latin.txt", "UTF-8"]),
    Case("calib-jsonl-missing-field", _calib_jsonl_field, ["c.jsonl:2", "'text'"]),
    Case("calib-jsonl-bad-json", _calib_jsonl_bad_json, ["c.jsonl:2", "JSON"]),
    Case("calib-is-dir", _calib_is_dir, ["corpus.txt", "directory"]),
    Case("calib-parquet-damaged", _calib_parquet_bad, ["c.parquet"]),
    Case("calib-hub-dataset-offline", _calib_hub_offline, ["no-such-org/no-such-dataset", "local"],
         marks=[pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="datasets not installed")]),
    # output
    Case("output-is-file", _output_is_file, ["{tmp}/out", "is a file"]),
    Case("output-inside-model", _output_inside_model, ["{tmp}/model/q", "inside the input model"]),
    Case("output-exists", _output_exists, ["{tmp}/out", "already exists", "--force"]),
    Case("output-holds-model-forced", _model_inside_output_forced, ["{tmp}/model", "inside the output directory"]),
    Case("output-not-ours-forced", _output_not_ours_forced, ["{tmp}/out", "not written by compress", "compress.json"]),
    # global options
    Case("device-cuda", _device_cuda, ["--device cuda", "CUDA"],
         marks=[pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")]),
    Case("device-unknown", _device_unknown, ["tpu"]),
    Case("device-list-unknown", _device_list_unknown, ["tpu:1", "cuda:0,cuda:1"]),
    Case("dtype-unknown", _dtype_unknown, ["float8", "float32"]),
    # eval, inspect, plan
    Case("eval-threshold-no-baseline", _eval_threshold_no_baseline, ["--baseline"]),
    Case("eval-dtype", _eval_dtype, ["--dtype bogus", "float32"]),
    Case("eval-data-missing", _eval_data_missing, ["heldout.txt", "not found"]),
    Case("eval-no-data", _eval_no_data, ["--data"]),
    Case("eval-data-too-short", _eval_data_too_short, ["tiny.txt", "window"]),
    Case("eval-report-is-dir", _eval_report_is_dir, ["report.md", "directory"]),
    Case("calib-longer-than-context", _calib_longer_than_context, ["calibration.seq_len 4096", "512"]),
    Case("eval-longer-than-context", _eval_longer_than_context, ["--seq-len 1024", "512"]),
    Case("packed-group-size-not-dividing", _packed_group_size_not_dividing, ["packed format", "groups of 100"]),
    Case("packed-with-disk-offload", _packed_with_disk_offload, ["packed format", "offload: disk"]),
    Case("eval-no-windows", _eval_no_windows, ["--max-windows", "Invalid value"]),  # click words the rest by version
    Case("eval-threshold-as-percent", _eval_threshold_as_percent, ["--min-top1", "99 is outside [0, 1]"]),
    Case("eval-model-missing", _eval_model_missing, ["gone", "does not exist"]),
    Case("eval-task-option-without-tasks", _eval_task_option_without_tasks, ["--limit", "--tasks"]),
    Case("eval-task-drop-no-baseline", _eval_task_drop_no_baseline, ["--max-task-drop", "--baseline"]),
    # these three reach lm-eval itself (where it is missing, the one-line error says to install it)
    Case("eval-task-unknown", _eval_task_unknown, ["unknown lm-eval task: no_such_task", "--include-path"], marks=NEEDS_LM_EVAL),
    Case("eval-task-include-path-missing", _eval_task_include_path_missing, ["--include-path {tmp}/tasks", "not a directory"],
         marks=NEEDS_LM_EVAL),
    # found before the model loads (it was "lm-eval could not run mine: ..." once lm-eval ran)
    Case("eval-task-data-missing", _eval_task_data_missing, ["lm-eval task mine", "gone.jsonl does not exist"], marks=NEEDS_LM_EVAL),
    Case("eval-baseline-missing", _eval_baseline_missing, ["--baseline", "gone", "does not exist"]),
    Case("eval-baseline-hub-id-unknown", _eval_baseline_hub_id_unknown, ["--baseline: ", "no-such-org/no-such-model"]),
    Case("inspect-foreign-dir", _inspect_foreign, ["plain", "compress.json"]),
    Case("inspect-missing", _inspect_missing, ["nothing", "does not exist"]),
    Case("inspect-empty-meta", _inspect_empty_meta, ["compress.json: damaged (no format, source_model, stages, layers)"]),
    Case("plan-no-model", _plan_no_model, ["r.yaml", "no model"]),
    # prune
    Case("prune-sparsity-above-1", _prune("--sparsity", "1.5"), ["--sparsity 1.5", "[0, 1)"]),
    Case("prune-sparsity-1", _prune("--sparsity", "1"), ["--sparsity 1", "[0, 1)"]),
    Case("prune-sparsity-negative", _prune("--sparsity", "-0.1"), ["--sparsity -0.1", "[0, 1)"]),
    Case("prune-pattern-5-4", _prune("--pattern", "5:4"), ["--pattern", "5:4", "0 < N < M"]),
    Case("prune-pattern-x", _prune("--pattern", "x"), ["--pattern", "'x'", "N:M"]),
    Case("prune-pattern-contradicts-sparsity", _prune("--pattern", "2:4", "--sparsity", "0.3"),
         ["--sparsity 0.3", "--pattern 2:4", "0.5"]),
    Case("prune-unknown-method", _prune("--method", "random"), ["--method 'random'", "sparsegpt"]),
    Case("prune-magnitude-with-calibration", _prune("--method", "magnitude", "--calibration", "calibration/default.txt"),
         ["--method magnitude", "--calibration", "wanda"]),
    Case("prune-magnitude-with-num-samples", _prune("--method", "magnitude", "--num-samples", "8"),
         ["--method magnitude", "--num-samples"]),
    Case("prune-structured-and-method", _prune("--structured", "mlp-channels", "--ratio", "0.25", "--method", "wanda"),
         ["--structured", "--method"]),
    Case("prune-structured-no-ratio", _prune("--structured", "mlp-channels"), ["--structured", "--ratio"]),
    Case("prune-ratio-out-of-range", _prune("--structured", "mlp-channels", "--ratio", "1.5"), ["--ratio 1.5", "(0, 1)"]),
    Case("prune-ratio-without-structured", _prune("--ratio", "0.25"), ["--ratio", "--structured"]),
    Case("prune-multiple-of-heads", _prune("--structured", "heads", "--ratio", "0.5", "--multiple-of", "16"),
         ["--multiple-of", "--structured heads", "mlp-channels"]),
    Case("prune-multiple-of-without-structured", _prune("--multiple-of", "64"), ["--multiple-of goes with --structured"]),
    Case("prune-multiple-of-above-the-width", _prune("--structured", "mlp-channels", "--ratio", "0.25", "--multiple-of", "1024"),
         ["--multiple-of 1024 is not below the 640 MLP channels", "lower --multiple-of"]),
    Case("prune-multiple-of-zero", _prune("--structured", "mlp-channels", "--ratio", "0.25", "--multiple-of", "0"),
         ["compress prune --multiple-of", "greater than or equal to 1"]),
    Case("prune-unknown-structure", _prune("--structured", "mlp", "--ratio", "0.25"), ["compress prune --structured", "mlp-channels"]),
    Case("prune-recipe-and-method", _prune_recipe_with_method, ["--recipe", "--method"]),
    Case("prune-recipe-and-eval-options", _prune_recipe_with_eval_options, ["--num-samples would be ignored (drop it"]),
    # what the operating system refuses of a path given (was an internal error, exit 3)
    Case("output-name-too-long", lambda tmp: ["--quiet", "quantize", "--recipe", str(write(tmp / "r.yaml", "stages:\n  - rtn: {scheme: W8A16}\n")),
                                              "--model", "default", "--output", str(tmp / ("o" * 300))],
         ["File name too long", "shorter name"]),
    Case("output-under-a-file", _output_under_a_file, ["{tmp}/out is a file, not a directory"]),  # was "File exists"
    Case("output-name-near-the-limit", _output_name_near_the_limit, ["the name is 250 bytes", "choose a name of at most"]),
    Case("output-unwritable", lambda tmp: quantize(tmp, GOOD_STAGE)[:-4] + ["--output", "/proc/compress/out", "--model", "default"],
         ["/proc/compress/out", "/proc is not a writable directory"]),
    Case("recipe-dev-null", lambda tmp: ["--quiet", "quantize", "--recipe", "/dev/null", "--output", str(tmp / "out")],
         ["/dev/null", "found an empty file"]),  # was "recipe file not found"
    Case("inspect-name-too-long", lambda tmp: ["inspect", str(tmp / ("o" * 300))], ["File name too long"]),
    # a temporary output an interrupted run left, its compress.json already written
    Case("inspect-unfinished", lambda tmp: ["inspect", str(write(tmp / "o" / "COMPRESS_INCOMPLETE", "x").parent)]
         if write(tmp / "o" / "compress.json", "{}") else [], ["is an unfinished compress output"]),
    Case("prune-no-model", lambda tmp: ["prune", "--output", str(tmp / "out")], ["no model", "--model"]),
    Case("recipe-duplicate-key", lambda tmp: quantize(tmp, "stages:\n  - rtn:\n      scheme: W4A16\n      scheme: W8A16\n"),
         ["r.yaml:4", "'scheme' appears twice"]),
    Case("recipe-bool-as-bit-width", lambda tmp: quantize(tmp, "stages:\n  - rtn:\n      scheme: W4A16\n"
                                                           "      weights: {num_bits: true}\n"),
         ["r.yaml:4", "num_bits", "got true"]),
    # pydantic reads true as 1 for any other number: `steps: true` trained one step
    Case("recipe-bool-as-steps", lambda tmp: quantize(tmp, "stages:\n  - qat:\n      scheme: W4A16\n"
                                                      "      data: {dataset: calibration/default.txt}\n      train: {steps: true}\n"),
         ["r.yaml:5", "stages.0.qat.train.steps: expected a number, got true"]),
    Case("recipe-bool-as-num-samples", lambda tmp: quantize(tmp, "calibration: {dataset: calibration/default.txt, num_samples: true}\n"
                                                            "stages:\n  - gptq: {scheme: W4A16, block_size: false}\n"),
         ["r.yaml:1", "calibration.num_samples: expected a number, got true", "(and 1 more problem)"]),
    # and in a per-pattern dict: `alpha_overrides: {down_proj: true}` smoothed with alpha 1.0
    Case("recipe-bool-in-overrides", lambda tmp: quantize(tmp, "calibration: {dataset: calibration/default.txt}\n"
                                                          "stages:\n  - smoothquant: {alpha_overrides: {down_proj: true}}\n"
                                                          "  - rtn: {scheme: W8A8}\n"),
         ["r.yaml:3", "alpha_overrides.down_proj: expected a number, got true", "alpha per layer pattern"]),
    Case("recipe-stage-settings-a-list", lambda tmp: quantize(tmp, "stages:\n  - rtn: {scheme: W8A16}\n  - kv_cache: []\n"),
         ["r.yaml:3", "stages.1.kv_cache", "must be a mapping", "write `- kv_cache` alone"]),
    Case("full-range-dynamic-activations", lambda tmp: quantize(tmp, "stages:\n  - rtn:\n      scheme: W8A8\n"
                                                                "      input_activations: {full_range: true}\n"),
         ["r.yaml", "full_range applies to static activation scales", "drop input_activations.full_range"]),
    Case("recipe-self-referencing-alias", lambda tmp: quantize(tmp, "stages: &s [ {rtn: {scheme: W8A16}}, *s ]\n"),
         ["r.yaml:1", "stages"]),
    Case("pattern-unquoted-in-recipe", _pattern_unquoted, ["r.yaml:3", "pattern", "124", "quote"]),
    Case("pattern-does-not-tile-layer", _pattern_does_not_tile, ["model.layers.0.self_attn.q_proj", "multiple of M = 7"]),
    Case("sparsity-overrides-match-nothing", _overrides_match_nothing, ["sparsity_overrides", "mlp.nothing", "match"]),
    Case("joint-quantization-with-activations", _joint_quant_activations, ["r.yaml", "quantize", "weights only"]),
    Case("nvfp4-group-size-not-16", lambda tmp: quantize(tmp, "stages:\n  - rtn:\n      scheme: NVFP4A16\n"
                                                          "      weights: {group_size: 32}\n"),
         ["r.yaml:4", "NVFP4", "blocks of 16", "group_size: 16"]),
    Case("kv-cache-given-keys", lambda tmp: quantize(tmp, calib_recipe("calibration/default.txt").replace(
        GOOD_STAGE, "stages:\n  - kv_cache:\n      bits: 4\n")), ["r.yaml:7", "kv_cache.bits", "valid keys here: none"]),
    Case("bad-regular-expression-in-recipe", lambda tmp: quantize(tmp, "stages:\n  - rtn:\n      scheme: W8A16\n"
                                                                  "      targets: ['re:[unclosed']\n"),
         ["r.yaml:4", "targets.0", "'re:[unclosed' is not a valid regular expression"]),
    Case("bad-regular-expression-in-option", lambda tmp: ["analyze", "--model", "default", "--data", "calibration/default.txt",
                                                           "--windows", "1", "--targets", "re:("],
         ["'re:(' is not a valid regular expression"]),
    Case("eval-report-into-the-model", _side_output_in_model("eval"), ["--report", "lies inside the input model"]),
    Case("analyze-recipe-into-the-model", _side_output_in_model("analyze"), ["--emit-recipe", "lies inside the input model"]),
    Case("bench-output-is-the-model", _side_output_in_model("bench"), ["--output", "lies inside the input model"]),
    Case("bench-output-holds-the-model", _bench_output_holds_model, ["--output", "holds the input model"]),
    Case("eval-report-unwritable", lambda tmp: ["eval", "--model", "default", "--data", "x.txt", "--report", "/proc/compress/r.md"],
         ["--report", "not a writable directory"]),
    Case("eval-threshold-nan", lambda tmp: ["eval", "--model", "default", "--baseline", "default", "--data", "x.txt",
                                            "--max-ppl-increase", "nan"], ["--max-ppl-increase", "finite number"]),
    Case("eval-other-tokenizer", _eval_other_tokenizer, ["tokenizers that map text to different ids"]),
    Case("eval-tokenizer-other-merges", _eval_other_merges, ["tokenizers that split", "heldout-tinyshakespeare.txt",
                                                             "differently (from token"]),
    # was "You set `ignore_mismatched_sizes` to `False` ... look at the above report!" (a report
    # transformers logs, silenced here), with the hint that the checkpoint may be truncated
    Case("config-other-sizes", _config_other_sizes, ["model.layers.0.mlp.down_proj.weight is [256, 640] in model.safetensors, "
                                                     "but config.json makes it [256, 512]", "config.json they were saved with"]),
    Case("compress-json-not-json", _damaged_meta("{oops"), ["compress.json: damaged"]),
    Case("compress-json-a-list", _damaged_meta("[]"), ["compress.json: damaged", "not the object"]),
    # a layer's record edited by hand (was an internal error in eval, inspect and quantize)
    Case("compress-json-record-damaged", _damaged_meta('{"layers": {"model.layers.0.mlp.up_proj": {"weights": "garbage"}}}'),
         ["compress.json: damaged (layer model.layers.0.mlp.up_proj: `weights` is not a quantization scheme)"]),
    Case("compress-json-record-shape", _damaged_meta('{"layers": {"lm_head": {"shape": "wide"}}}'),
         ["layer lm_head: `shape` is not [out_features, in_features]"]),
    Case("model-is-an-unfinished-output", lambda tmp: ["eval", "--model", str(write(copy_model(tmp, "half-written") /
                                                                                    "COMPRESS_INCOMPLETE", "").parent),
                                                        "--data", "calibration/heldout-tinyshakespeare.txt"],
         ["unfinished compress output"]),
    # click usage errors
    Case("unknown-option", _unknown_option, ["--recipee", "--recipe"]),
    Case("missing-required-option", _missing_option, ["--recipe"]),
    Case("bad-int-option", _bad_int_option, ["--seed", "Invalid value"]),
] + CASES_ISSUE9


@pytest.fixture(autouse=True)
def _offline(monkeypatch, repo):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(repo)  # relative data paths resolve from the project, as documented


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.err


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_bad_input_is_one_clean_line(case: Case, tmp_path: Path, capsys):
    argv = case.setup(tmp_path)
    before = set(tmp_path.iterdir())
    rc, err = run_cli(argv, capsys)
    msg = err.strip()
    print(msg)  # shown with -rA: the whole catalogue of messages

    assert "Traceback" not in err, err
    assert rc == 2, f"exit {rc}: {err}"
    assert msg, "no message on stderr"
    assert "\n" not in msg, f"not one line:\n{err}"
    assert msg.startswith("error:"), msg
    for needle in case.expect:
        assert needle.format(tmp=tmp_path) in msg, f"{needle!r} not in: {msg}"
    if case.hint:
        assert msg.endswith(")") or "did you mean" in msg or "valid keys here" in msg, f"no hint: {msg}"

    # a failed run writes nothing: no new output directory, no temporary leftovers
    after = set(tmp_path.iterdir())
    assert after == before, f"new paths after a failed run: {sorted(map(str, after - before))}"
    assert not list(tmp_path.rglob(".*.tmp-*")), "temporary output left behind"


# ------------------------------------------------------------------------------------------------
# failures late in the run leave the input untouched and write nothing


@pytest.mark.parametrize("setup", [_calib_short, _model_nan_layer, _output_inside_model],
                         ids=["late-calibration-error", "late-layer-error", "output-inside-model"])
def test_failed_run_leaves_input_model_unchanged(setup, tmp_path: Path, capsys):
    argv = setup(tmp_path)
    model_dir = Path(argv[argv.index("--model") + 1]) if argv[argv.index("--model") + 1] != "default" \
        else DEFAULT_MODEL_DIR
    before = tree_digest(model_dir)
    listing = sorted(p.name for p in tmp_path.iterdir())
    rc, err = run_cli(argv, capsys)
    assert rc == 2, err
    assert tree_digest(model_dir) == before, "the input model directory changed"
    assert sorted(p.name for p in tmp_path.iterdir()) == listing
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.rglob(".*.tmp-*"))
    assert not list(model_dir.parent.glob(".*.tmp-*"))


def test_a_whole_float_activation_budget_is_a_number_of_bytes():
    """4e9 in YAML (or a Python float) was taken, then refused by the stricter budget check."""
    from compress.recipe import parse_recipe

    [(_, stage)] = parse_recipe("calibration: {dataset: calibration/default.txt}\nstages:\n"
                                "  - gptq: {scheme: W4A16, activation_budget: 4000000000.0}\n", "t").stages
    assert stage.activation_budget == 4_000_000_000 and isinstance(stage.activation_budget, int)


def test_existing_output_kept_without_force(tmp_path: Path, capsys):
    argv = _output_exists(tmp_path)
    before = tree_digest(tmp_path / "out")
    rc, err = run_cli(argv, capsys)
    assert rc == 2, err
    assert tree_digest(tmp_path / "out") == before


def test_evaluation_dataset_missing_writes_nothing(tmp_path: Path, capsys):
    """An evaluation file that does not exist fails the run (exit 2) without leaving any output."""
    recipe = GOOD_STAGE + f"evaluation:\n  datasets: [{tmp_path / 'eval-missing.txt'}]\n"
    rc, err = run_cli(quantize(tmp_path, recipe), capsys)
    msg = err.strip()
    assert rc == 2, err
    assert "Traceback" not in err and "\n" not in msg
    assert "eval-missing.txt" in msg
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_the_valid_keys_hint_leaves_out_what_compress_writes_itself(tmp_path, capsys):
    rc, err = run_cli(_stage_key_unknown(tmp_path), capsys)
    assert rc == 2 and err.strip().endswith("valid keys here: scheme, weights, input_activations, targets, ignore"), err
