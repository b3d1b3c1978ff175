"""Knowledge distillation as a recipe stage and as `compress distill`: it recovers what pruning
cost, keeps pruned weights at zero, builds shallower students, matches hidden states through a
projection, and resumes exactly after a kill."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from compress import modeling
from compress.cli import main
from compress.pipeline import run_recipe
from compress.recipe import parse_recipe


def recipe(text: str):
    return parse_recipe(text, "test")


TRAIN = "{steps: %d, batch_size: 4, lr: %g, warmup: 0, eval_every: 0, save_every: 0}"


def data_keys(shared, n=48, seq=64):
    return (f"{{dataset: {shared}/data/tinyshakespeare/train.txt, seq_len: {seq}, num_samples: {n}, eval_samples: 8}}")


def test_prune_then_distill_recovers_and_keeps_the_zeros(ref_llama, shared, tmp_path):
    r = recipe(f"""
calibration: {{dataset: {shared}/data/tinyshakespeare/train.txt, num_samples: 8, seq_len: 64}}
stages:
  - magnitude: {{sparsity: 0.5}}
  - distill:
      data: {data_keys(shared)}
      train: {TRAIN % (12, 3e-4)}
""")
    report = run_recipe(r, model=str(ref_llama), output=str(tmp_path / "out"))
    s = report["stages"][1]["summary"]
    assert s["masked_layers"] == 28 and s["masks_kept"]
    assert s["held_out_kd_after"] < 0.8 * s["held_out_kd_before"], s
    assert s["teacher"] == str(ref_llama)
    weights = load_file(tmp_path / "out" / "model.safetensors")
    for name, w in weights.items():
        if name.endswith("proj.weight"):
            assert float((w == 0).float().mean()) >= 0.5, name  # the pruned half is still exactly zero
    assert not (tmp_path / ".out.work").exists()  # checkpoints of a finished run are removed


def test_shallow_student_from_chosen_blocks(ref_llama, shared, tmp_path):
    r = recipe(f"""
calibration: {{dataset: {shared}/data/tinyshakespeare/train.txt, num_samples: 8, seq_len: 64}}
stages:
  - distill:
      keep_layers: [0, 3]
      data: {data_keys(shared)}
      train: {TRAIN % (10, 5e-4)}
""")
    report = run_recipe(r, model=str(ref_llama), output=str(tmp_path / "out"))
    s = report["stages"][0]["summary"]
    assert s["held_out_kd_after"] < 0.8 * s["held_out_kd_before"], s
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert student.config.num_hidden_layers == 2 and len(student.model.layers) == 2
    teacher = AutoModelForCausalLM.from_pretrained(ref_llama)
    # initialised from the teacher's blocks 0 and 3 (then trained: close, not equal)
    drift = (student.model.layers[1].mlp.up_proj.weight - teacher.model.layers[3].mlp.up_proj.weight).norm()
    assert float(drift.detach() / teacher.model.layers[3].mlp.up_proj.weight.norm().detach()) < 0.2


def tiny_pair(tmp_path, student_width=32):
    tok = AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR)
    paths = []
    for i, width in enumerate((64, student_width)):
        torch.manual_seed(i)
        cfg = LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=128)
        path = tmp_path / f"m{i}"
        LlamaForCausalLM(cfg).save_pretrained(path)
        tok.save_pretrained(path)
        paths.append(path)
    return paths


def shuffled_tokenizer_copy(model: Path, to: Path) -> Path:
    """A copy of `model` whose tokenizer maps text to other ids at the same vocabulary size (its
    words' ids rotated by one), as two unrelated 32,000-token tokenizers differ."""
    shutil.copytree(model, to)
    spec = json.loads((to / "tokenizer.json").read_text())
    words = [w for w in spec["model"]["vocab"] if w not in {t["content"] for t in spec.get("added_tokens", [])}]
    ids = [spec["model"]["vocab"][w] for w in words]
    spec["model"]["vocab"].update(zip(words, ids[1:] + ids[:1]))
    (to / "tokenizer.json").write_text(json.dumps(spec))
    return to


def test_hidden_state_distillation_through_a_projection(tmp_path, repo):
    teacher, student = tiny_pair(tmp_path)
    r = recipe(f"""
stages:
  - distill:
      teacher: {teacher}
      kd_weight: 0.0
      hidden: [{{student: -1, teacher: -1}}]
      data: {{dataset: {repo}/calibration/default.txt, seq_len: 32, num_samples: 32, eval_samples: 8}}
      train: {TRAIN % (15, 1e-2)}
""")
    report = run_recipe(r, model=str(student), output=str(tmp_path / "out"))
    s = report["stages"][0]["summary"]
    assert s["held_out_loss_after"] < 0.7 * s["held_out_loss_before"], s
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert not any("projection" in k for k in saved)  # the projection head is training-only
    assert saved["model.embed_tokens.weight"].shape[1] == 32


def test_distill_cli_and_its_bad_input(tmp_path, repo, capsys, monkeypatch, minilm):
    import compress.training_data

    # too few sequences asked of the teacher is refused before it generates any
    monkeypatch.setattr(compress.training_data, "generated_sequences", lambda *a: pytest.fail("the teacher generated"))
    teacher, student = tiny_pair(tmp_path, student_width=64)
    data = str(repo / "calibration" / "default.txt")
    out = tmp_path / "out"
    code = main(["--json", "distill", "--teacher", str(teacher), "--student", str(student), "--data", data,
                 "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--num-samples", "16", "--temperature", "2",
                 "--divergence", "jsd", "--ce-weight", "0.5", "--hidden", "1:1", "--output", str(out),
                 "--eval-data", data])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    s = report["stages"][0]["summary"]
    assert s["steps"] == 3 and s["training"]["loss"]["divergence"] == "jsd" and s["training"]["loss"]["ce_weight"] == 0.5
    assert report["evaluation"][data]["kl_divergence"] > 0  # measured against the teacher
    assert (out / "report.md").is_file()
    assert main(["inspect", str(out)]) == 0  # no layer table of headers alone: distillation quantizes nothing
    assert "layers: none quantized or pruned" in capsys.readouterr().out

    # a quantized student would come out dense: distillation trains float weights
    quantized = tmp_path / "quantized"
    run_recipe(parse_recipe(f"model: {student}\nstages:\n  - rtn: {{scheme: W4A16, weights: {{group_size: 32}}}}\n", "q"),
               output=str(quantized), device="cpu")
    quantized_dense = tmp_path / "quantized-dense"  # no quantization_config: only compress.json says so
    run_recipe(parse_recipe(f"model: {student}\nstages:\n  - rtn: {{scheme: W4A16, weights: {{group_size: 32}}}}\n", "q"),
               output=str(quantized_dense), device="cpu", format="dense")
    for argv, words in [
        (["--student", str(student)], "no training data"),
        (["--student", str(student), "--data", data, "--generate", "4"], "both given"),
        (["--data", data], "no student"),
        (["--student-layers", "0,7", "--data", data], "--student-layers [0, 7] is not a list of distinct blocks"),
        (["--student-layers", "x", "--data", data], "not a list of block numbers"),
        # another tokenizer is named before the loss (an encoder student was told to match hidden
        # states, and only then that the vocabularies differ)
        (["--student", str(minilm), "--data", data], "has vocabulary size 2048, the student 30522"),
        (["--student", str(student), "--data", data, "--hidden", "a:b"], "STUDENT:TEACHER"),
        (["--student", str(student), "--data", data, "--hidden-loss", "cosine"], "--hidden-loss cosine given without --hidden"),
        (["--student", str(student), "--data", str(tmp_path / "missing.txt")], "missing.txt"),
        (["--student", str(student), "--data", data, "--hidden", "1:9"], "hidden teacher index 9 is out of range"),
        (["--student", str(quantized), "--data", data], "is quantized"),
        (["--student", str(quantized_dense), "--data", data], "is quantized"),
        (["--student", str(student), "--data", data, "--steps", "0"], "--steps"),
        (["--student", str(student), "--data", data, "--divergence", "kl"], "compress distill --divergence: Input should be"),
        (["--student", str(student), "--data", data, "--seq-len", "512"], "--seq-len 512 is longer than the model's context (128 positions"),
        # recipe keys the command set are named as its options
        (["--student", str(student), "--generate", "2", "--eval-samples", "4"],
         "2 sequences generated by the teacher, 5 needed (--eval-samples 4 held out) (generate more (--generate), or lower --eval-samples)"),
        (["--student", str(student), "--data", data, "--num-samples", "100000"], "lower --num-samples, --eval-samples or --seq-len"),
        # but not inside a path the user gave
        (["--student", str(student), "--data", str(tmp_path / "eval_samples" / "seq_len.txt")],
         f"{tmp_path / 'eval_samples' / 'seq_len.txt'}"),
    ]:
        code = main(["distill", "--teacher", str(teacher), "--steps", "2", "--seq-len", "32", "--output", str(tmp_path / "bad"), *argv])
        err = capsys.readouterr().err
        assert code == 2 and words in err and "Traceback" not in err, (argv, err)
        assert not (tmp_path / "bad").exists()

    # a teacher whose tokenizer has the student's vocabulary size but other ids is refused, as
    # `compress eval` refuses it
    shuffled = shuffled_tokenizer_copy(teacher, tmp_path / "shuffled-teacher")
    code = main(["distill", "--teacher", str(shuffled), "--student", str(student), "--data", data, "--steps", "2",
                 "--seq-len", "32", "--output", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert code == 2 and "has a tokenizer that maps text to different ids" in err and not (tmp_path / "bad").exists(), err


def test_an_encoder_student_trains_on_framed_windows_and_matches_hidden_states_by_direction(tmp_path, repo, capsys, minilm):
    """An encoder reads every input between [CLS] and [SEP], so its training windows carry them;
    and its hidden states are matched by cosine unless asked otherwise: mse spent MiniLM's
    training on its few very large dimensions, and a 3-block student's embeddings moved away from
    the teacher's (mean cosine 0.285 -> 0.171 in 60 steps, 0.523 with cosine)."""
    from compress.calibration import build_calibration
    from compress.recipe import CalibrationConfig
    from compress.training_data import TrainingData, training_sequences

    tokenizer = AutoTokenizer.from_pretrained(minilm)
    data = TrainingData(dataset=str(repo / "calibration" / "default.txt"), seq_len=32, num_samples=6, eval_samples=2)
    train, held_out, _ = training_sequences(data, tokenizer, encoder=True)
    for ids in (train, held_out):
        assert ids.shape[1] == 32
        assert (ids[:, 0] == tokenizer.cls_token_id).all() and (ids[:, -1] == tokenizer.sep_token_id).all()
        assert not (ids[:, 1:-1] == tokenizer.cls_token_id).any()
    causal, _, _ = training_sequences(data, AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR))
    assert causal.shape[1] == 32  # a causal LM's windows are text alone, as calibration's
    # the default data, the calibration windows, are framed alike
    calibration = build_calibration(CalibrationConfig(dataset=str(repo / "calibration" / "default.txt"), num_samples=6,
                                                      seq_len=32), tokenizer, encoder=True)
    train, held_out, _ = training_sequences(TrainingData(seq_len=32, eval_samples=2), tokenizer, calibration, encoder=True)
    for ids in (train, held_out):
        assert ids.shape[1] == 32 and (ids[:, 0] == tokenizer.cls_token_id).all() and (ids[:, -1] == tokenizer.sep_token_id).all()

    for option, expected in (([], "cosine"), (["--hidden-loss", "mse"], "mse")):
        code = main(["--json", "distill", "--teacher", str(minilm), "--student-layers", "0,2", "--hidden", "-1:-1",
                     "--data", str(repo / "calibration" / "default.txt"), "--steps", "1", "--batch-size", "2",
                     "--seq-len", "32", "--num-samples", "4", "--eval-samples", "2", "--no-eval",
                     "--output", str(tmp_path / expected), *option])
        assert code == 0
        assert json.loads(capsys.readouterr().out)["stages"][0]["summary"]["training"]["loss"]["hidden_loss"] == expected


def test_a_training_stage_after_another_is_checked_before_the_first_one_runs(ref_llama, tmp_path, capsys, monkeypatch):
    """Hidden-state indices, freeze patterns and the objective are known from the recipe and the
    configs: refused by the plan and by the run before the stage before them works, on the depth
    the student will have (keep_layers) and the teacher's."""
    from compress.stages.sparsegpt import SparseGPT

    monkeypatch.setattr(SparseGPT, "apply", lambda *a: pytest.fail("the first stage ran"))
    head = ("calibration: {dataset: calibration/default.txt, num_samples: 4, seq_len: 64}\n"
            "stages:\n  - sparsegpt: {sparsity: 0.5}\n")
    train = "data: {dataset: calibration/default.txt, seq_len: 64, num_samples: 4, eval_samples: 2}, train: {steps: 1}"
    shuffled = shuffled_tokenizer_copy(ref_llama, tmp_path / "shuffled")
    for stage, words in (
        (f"qat: {{scheme: W4A16, teacher: {shuffled}, {train}}}", "has a tokenizer that maps text to different ids"),
        (f"distill: {{hidden: [{{student: 9, teacher: 4}}], {train}}}", "hidden student index 9 is out of range: the student has hidden states 0..4"),
        (f"distill: {{keep_layers: [0, 1], hidden: [{{student: 3, teacher: 4}}], {train}}}", "hidden student index 3 is out of range: the student has hidden states 0..2"),
        (f"distill: {{hidden: [{{student: 2, teacher: -6}}], {train}}}", "hidden teacher index -6 is out of range"),
        (f"distill: {{freeze: [embed_tokenz], {train}}}", "freeze patterns ['embed_tokenz'] match no parameter"),
        (f"qat: {{scheme: W4A16, kd_weight: 0, ce_weight: 0, {train}}}", "kd_weight and ce_weight are both 0"),
        # a loss that is zero whatever the weights: backward had nothing to differentiate (an internal error)
        (f"distill: {{kd_weight: 0, ce_weight: 0, {train}}}", "the loss is zero, nothing to train on"),
        # FP8 KV scales measured before training would not be the trained model's
        (f"kv_cache: {{}}\n  - distill: {{{train}}}", "stages.1.kv_cache comes before distill"),
        (f"qat: {{scheme: W4A16, hidden: [{{student: 5, teacher: 5}}], {train}}}", "hidden student index 5 is out of range"),
    ):
        (tmp_path / "r.yaml").write_text(head + f"  - {stage}\n")
        rc = main(["--json", "plan", "--recipe", str(tmp_path / "r.yaml"), "--model", str(ref_llama)])
        assert rc == 2 and words in json.loads(capsys.readouterr().out)["error"], stage
        rc = main(["quantize", "--recipe", str(tmp_path / "r.yaml"), "--model", str(ref_llama), "--output", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert rc == 2 and words in err and not (tmp_path / "out").exists(), (stage, err)
    # and what is right passes: the student's last state against the teacher's
    (tmp_path / "r.yaml").write_text(head + f"  - distill: {{keep_layers: [0, 1], hidden: [{{student: 2, teacher: 4}}], {train}}}\n")
    assert main(["--json", "plan", "--recipe", str(tmp_path / "r.yaml"), "--model", str(ref_llama)]) == 0
    capsys.readouterr()
    # a student another tool quantized (its config says so; no compress.json) is refused up front too
    other = tmp_path / "other-tool-w4"
    run_recipe(parse_recipe("stages:\n  - rtn: {scheme: W4A16, weights: {group_size: 64}}\n", "t"), model=str(ref_llama),
               output=str(other), device="cpu")
    (other / "compress.json").unlink()
    (tmp_path / "r.yaml").write_text(head + f"  - distill: {{{train}}}\n")
    rc = main(["quantize", "--recipe", str(tmp_path / "r.yaml"), "--model", str(other), "--output", str(tmp_path / "out")])
    assert rc == 2 and f"stage distill: the input model {other} is quantized" in capsys.readouterr().err


def test_freeze_holds_for_its_own_stage_only(ref_llama, tmp_path):
    """A stage's `freeze` stops gradients for that stage: the next training stage trains those
    weights unless it freezes them too (they stayed frozen, reported as trainable)."""
    train = ("ce_weight: 1, data: {dataset: calibration/default.txt, seq_len: 32, num_samples: 6, eval_samples: 2}, "
             "train: {steps: 2, lr: 0.01, batch_size: 2}, keep_start_if_worse: false")  # the teacher itself: any step is worse
    report = run_recipe(parse_recipe(f"stages:\n  - distill: {{freeze: [embed_tokens], {train}}}\n  - distill: {{{train}}}\n", "t"),
                        model=str(ref_llama), output=str(tmp_path / "out"), device="cpu", dtype="float32")
    first, second = (s["summary"]["trainable_parameters"] for s in report["stages"])
    before, after = load_file(ref_llama / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    embed = "model.embed_tokens.weight"
    assert first == second - before[embed].numel()
    assert not torch.equal(before[embed], after[embed])  # trained by the second stage


def test_the_saved_recipe_of_a_run_on_the_calibration_windows_runs_again(ref_llama, tmp_path, capsys):
    """recipe.yaml spells every default out (data.split, data.seq_len 256...); a stage trained on
    the calibration windows saved data.seq_len 256 beside calibration.seq_len 32, and the checks
    for keys without a dataset then refused the recipe the run had written."""
    import yaml

    recipe = ("calibration: {dataset: calibration/default.txt, num_samples: 6, seq_len: 32}\n"
              "stages:\n  - distill: {ce_weight: 1, data: {eval_samples: 2}, train: {steps: 1, batch_size: 2}}\n")
    run_recipe(parse_recipe(recipe, "t"), model=str(ref_llama), output=str(tmp_path / "out"), device="cpu")
    saved = tmp_path / "out" / "recipe.yaml"
    assert yaml.safe_load(saved.read_text())["stages"][0]["distill"]["data"]["seq_len"] == 32  # what it trained on
    assert main(["--json", "plan", "--recipe", str(saved), "--model", str(ref_llama)]) == 0, capsys.readouterr().out


def test_kill_then_resume_matches_an_uninterrupted_run(tmp_path, repo):
    teacher, _ = tiny_pair(tmp_path)
    data = str(repo / "calibration" / "default.txt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])), "COMPRESS_CACHE": str(tmp_path / "cache")}

    def argv(out, *extra):
        # CPU: resuming must give the uninterrupted run bit for bit, which GPU kernels do not promise
        return [sys.executable, "-m", "compress", "--quiet", "--device", "cpu", "distill", "--teacher", str(teacher), "--student-layers", "1,0",
                "--data", data, "--steps", "60", "--batch-size", "2", "--seq-len", "32", "--num-samples", "24",
                "--save-every", "20", "--no-eval", "--output", str(out), *extra]

    subprocess.run(argv(tmp_path / "whole"), env=env, check=True, timeout=600)
    work = tmp_path / ".killed.work"
    proc = subprocess.Popen(argv(tmp_path / "killed"), env=env)
    deadline = time.time() + 300
    while time.time() < deadline and not list(work.glob("*/step-*/complete")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(work.glob("*/step-*/complete")), "no checkpoint was written before the deadline"
    assert not (tmp_path / "killed").exists()  # nothing that looks like a finished checkpoint

    subprocess.run(argv(tmp_path / "killed", "--resume"), env=env, check=True, timeout=600)
    report = json.loads((tmp_path / "killed" / "report.json").read_text())
    assert report["stages"][0]["summary"]["resumed_from_step"] >= 20
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "killed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not work.exists()


def test_two_processes_with_ddp_match_one(tmp_path, repo):
    """The same command under torchrun (what `accelerate launch` runs on GPUs), with two CPU
    processes on the gloo backend: each takes half of every batch, DDP averages the gradients, and
    the result equals the single-process run up to float summation order."""
    teacher, _ = tiny_pair(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1"}
    common = ["--json", "--device", "cpu", "distill", "--teacher", str(teacher), "--student-layers", "1,0",
              "--data", str(repo / "calibration" / "default.txt"), "--steps", "6", "--batch-size", "4", "--seq-len", "32",
              "--num-samples", "24", "--no-eval"]
    one = subprocess.run([sys.executable, "-m", "compress", *common, "--output", str(tmp_path / "one")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517"]
    two = subprocess.run([*torchrun, "-m", "compress", *common, "--output", str(tmp_path / "two")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-2000:]
    assert json.loads(two.stdout)["output_dir"]  # one document: the main process's
    report = json.loads((tmp_path / "two" / "report.json").read_text())
    training = report["stages"][0]["summary"]["training"]
    assert training["processes"] == 2 and training["distributed"] == "MULTI_CPU"
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    t = load_file(teacher / "model.safetensors")
    assert float((a["model.layers.0.mlp.up_proj.weight"] - t["model.layers.1.mlp.up_proj.weight"]).abs().max()) > 1e-5  # it trained
    # the training loss of each step is the whole batch's (it was the main process's half alone)
    single = json.loads((tmp_path / "one" / "report.json").read_text())["stages"][0]["summary"]["training"]["history"]
    assert [round(h["train_kd"], 4) for h in training["history"][1:]] == [round(h["train_kd"], 4) for h in single[1:]]
    # what the processes cannot split is refused before any work, once, in one JSON document; held
    # out fewer than the processes, the evaluation waited for ever
    for option, words in ((["--batch-size", "3"], "batch_size 3 does not split over 2 processes"),
                          (["--eval-samples", "1"], "--eval-samples 1 is fewer than the 2 processes")):
        argv = [*common, *option, "--output", str(tmp_path / "bad")]
        bad = subprocess.run([*torchrun, "-m", "compress", *argv], env=env, capture_output=True, text=True, timeout=300)
        assert bad.returncode != 0 and words in json.loads(bad.stdout)["error"] and bad.stderr.count(words) == 1, bad.stderr[-2000:]
    assert not (tmp_path / "bad").exists()


def test_the_main_process_is_known_under_an_mpi_launcher(monkeypatch, ref_llama, tmp_path):
    """`accelerate launch --cpu` runs several processes through mpirun, which sets OMPI_COMM_WORLD_*
    and not RANK: every process took itself for the main one, and two raced to write the output
    (one left it without weights, exit 0)."""
    from compress.launcher import process_count, process_rank

    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert (process_rank(), process_count()) == (1, 2)
    report = run_recipe(parse_recipe("stages:\n  - rtn: {scheme: W8A16}\n", "t"), model=str(ref_llama),
                        output=str(tmp_path / "out"), device="cpu")
    assert report == {"skipped": True, "rank": 1} and not (tmp_path / "out").exists()


def test_another_process_waits_for_the_main_one_to_report_a_refusal(monkeypatch, capsys, tmp_path):
    """Under a launcher a process other than the main one used to end at once on bad input; the
    launcher then stopped the main one before it said why (seen under load: its only word was
    "interrupted"). It now waits to be stopped; a refusal of its own is said once the wait runs out."""
    import time

    from compress import cli

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["quantize", "--recipe", str(tmp_path / "missing.yaml"), "--output", str(tmp_path / "out")]
    waits = []

    def stopped(seconds):  # the launcher's SIGTERM arrives during the wait
        waits.append(seconds)
        raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", stopped)
    assert cli.main(argv) == 2 and waits == [cli.OTHER_PROCESS_WAIT_S]
    assert "missing.yaml" not in capsys.readouterr().err  # the main process says it

    monkeypatch.setattr(time, "sleep", waits.append)  # nobody stopped it: the refusal was its own
    assert cli.main(argv) == 2 and len(waits) == 2
    err = capsys.readouterr().err
    assert "process 1:" in err and err.count("missing.yaml") == 1


def test_data_free_distillation_on_teacher_samples(tmp_path, capsys, monkeypatch):
    teacher, _ = tiny_pair(tmp_path)
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    code = main(["--json", "distill", "--teacher", str(teacher), "--student-layers", "1", "--generate", "12",
                 "--eval-samples", "4", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--no-eval", "--output", str(tmp_path / "out")])
    assert code == 0
    s = json.loads(capsys.readouterr().out)["stages"][0]["summary"]
    assert s["data"].startswith("12 sequences generated by the teacher") and s["train_samples"] == 12 - 4  # 4 held out
    assert len(list((tmp_path / "cache" / "generated").glob("*.pt"))) == 1


def test_what_an_encoder_cannot_train_or_keep_is_refused_before_the_first_stage(tmp_path, capsys, monkeypatch):
    """On an encoder, kd_weight has no logits to act on, data.generate has no next token to sample
    and kv_cache no cache to calibrate: each refused by the plan and by the run before the stage
    before it works (they were an internal error, zero loss trained with exit 0, and a refusal
    only after the earlier stages' work)."""
    from compress.stages.magnitude import Magnitude
    from tests.test_model_families import FAMILIES

    torch.manual_seed(0)
    bert = tmp_path / "bert"
    FAMILIES["bert"]().save_pretrained(bert)
    AutoTokenizer.from_pretrained(modeling.DEFAULT_MODEL_DIR).save_pretrained(bert)
    monkeypatch.setattr(Magnitude, "apply", lambda *a: pytest.fail("the first stage ran"))
    head = ("calibration: {dataset: calibration/default.txt, num_samples: 20, seq_len: 32}\n"
            "stages:\n  - magnitude: {sparsity: 0.5}\n")
    train = "train: {steps: 1}, hidden: [{student: -1, teacher: -1}]"
    for stage, words in (
        ("kv_cache: {}", "is an encoder, which keeps no KV cache"),
        (f"distill: {{data: {{generate: {{num_sequences: 8}}, seq_len: 16, eval_samples: 2}}, {train}}}",
         "data.generate samples text from a causal language model's next-token distribution; BertModel is an encoder"),
        (f"qat: {{scheme: W4A16, data: {{generate: {{num_sequences: 8}}, seq_len: 16, eval_samples: 2}}, {train}}}",
         "BertModel is an encoder"),
        ("distill: {train: {steps: 1}, hidden: [{student: -1, teacher: -1, weight: 0}]}",
         "every hidden pair weighs 0 (kd_weight acts on logits, which an encoder has none of): the loss is zero"),
    ):
        (tmp_path / "r.yaml").write_text(head + f"  - {stage}\n")
        rc = main(["--json", "plan", "--recipe", str(tmp_path / "r.yaml"), "--model", str(bert)])
        assert rc == 2 and words in json.loads(capsys.readouterr().out)["error"], stage
        rc = main(["quantize", "--recipe", str(tmp_path / "r.yaml"), "--model", str(bert), "--output", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert rc == 2 and words in err and "Traceback" not in err and not (tmp_path / "out").exists(), (stage, err)



def test_a_distillation_that_ends_worse_than_it_started_gives_the_start_back(ref_llama, tmp_path):
    """Pruned, then distilled too briefly at too high an lr: the held-out KD rose, and the worse
    model was saved without a word. Now the pruned start is saved, with a warning; with
    `keep_start_if_worse: false` the trained model is, with a warning that it got worse. A run that
    changes nothing measurable gets no warning."""
    def distilled(lr, out, keep=True):
        train = ("data: {dataset: calibration/default.txt, seq_len: 32, num_samples: 6, eval_samples: 2}, "
                 f"train: {{steps: 2, lr: {lr}, batch_size: 2}}, keep_start_if_worse: {str(keep).lower()}")
        return run_recipe(parse_recipe(f"stages:\n  - magnitude: {{sparsity: 0.5}}\n  - distill: {{{train}}}\n", "t"),
                          model=str(ref_llama), output=str(tmp_path / out), device="cpu", dtype="float32")

    pruned = run_recipe(parse_recipe("stages:\n  - magnitude: {sparsity: 0.5}\n", "t"), model=str(ref_llama),
                        output=str(tmp_path / "pruned"), device="cpu", dtype="float32")
    assert pruned["output"]
    start = load_file(tmp_path / "pruned/model.safetensors")
    for keep in (True, False):
        report = distilled(0.05, f"out-{keep}", keep)
        summary = report["stages"][1]["summary"]
        # the saved model's figure: the start's when it is given back, the trained run's kept apart
        trained = summary["held_out_kd_trained"] if keep else summary["held_out_kd_after"]
        assert trained > summary["held_out_kd_before"] > 0
        assert (summary["held_out_kd_after"] == summary["held_out_kd_before"]) == keep
        assert ("held_out_kd_trained" in summary) == keep
        [warning] = report["warnings"]
        assert warning.startswith("stage 2 (distill): the held-out kd is") and "warnings" not in summary
        saved = load_file(tmp_path / f"out-{keep}/model.safetensors")
        same = all(torch.equal(saved[k], start[k]) for k in start)
        if keep:
            assert "the starting weights are kept" in warning and "kept_start" in summary and same
        else:
            assert "the model got worse" in warning and "kept_start" not in summary and not same
    unmoved = distilled(1e-12, "out2")  # float noise in an unchanged loss is not "worse": nothing said, nothing restored
    assert "warnings" not in unmoved and "kept_start" not in unmoved["stages"][1]["summary"]
    # `compress distill` says the same, and --keep-worse keeps what training reached
    for flag in ([], ["--keep-worse"]):
        out = tmp_path / f"cli{len(flag)}"
        assert main(["--quiet", "distill", "--teacher", str(ref_llama), "--student", str(tmp_path / "pruned"), "--data",
                     "calibration/default.txt", "--seq-len", "32", "--num-samples", "6", "--eval-samples", "2", "--steps", "2",
                     "--lr", "0.05", "--batch-size", "2", "--no-eval", "--output", str(out), *flag]) == 0
        summary = json.loads((out / "report.json").read_text())["stages"][0]["summary"]
        saved = load_file(out / "model.safetensors")
        assert ("kept_start" in summary) == (not flag)
        assert all(torch.equal(saved[k], start[k]) for k in start) == (not flag)
