"""Interruption, resume, the stage cache and determinism.

A run is killed (SIGKILL; SIGINT as Ctrl-C; SIGTERM as `kill`) at named points through the testing hook
COMPRESS_TEST_KILL_AT (compress.checkpoint.kill_point); afterwards the output directory either does
not exist or is complete, nothing left behind looks like a checkpoint, the input model is byte for
byte what it was, and `--resume` gives the same checkpoint as an uninterrupted run.

The recipe has two stages whose results depend on each other beyond the weights: the first
attaches static activation fake-quantization to the MLP layers (its ranges live in the layer
records, not in the weights), and the second, GPTQ on the attention layers, runs calibration data
through those MLPs; a resume that lost the records would give different attention weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from compress.checkpoint import INCOMPLETE_MARKER, KILL_AT_ENV, KILL_SIGNAL_ENV
from compress.cli import main
from compress.modeling import DEFAULT_MODEL_DIR

RECIPE = {
    "calibration": {"dataset": "calibration/default.txt", "num_samples": 4, "seq_len": 32, "shuffle": True},
    "stages": [
        {"rtn": {"scheme": "W8A8", "input_activations": {"strategy": "tensor", "dynamic": False},
                 "targets": [r"re:.*mlp\..*"]}},
        {"gptq": {"scheme": "W4A16", "targets": [r"re:.*self_attn\..*"]}},
    ],
}


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def checkpoint_digest(out: Path) -> dict[str, str]:
    """Every file of a checkpoint except the reports (wall times) with the output path
    taken out of compress.json and recipe.yaml (the runs write to different directories)."""
    digest = {}
    for p in sorted(out.iterdir()):
        if p.name in ("report.json", "report.md", "report.html"):
            continue
        data = p.read_bytes()
        if p.name == "compress.json":
            meta = json.loads(data)
            meta["recipe"].pop("output")
            data = json.dumps(meta, sort_keys=True).encode()
        elif p.name == "recipe.yaml":
            doc = yaml.safe_load(data)
            doc.pop("output")
            data = yaml.safe_dump(doc).encode()
        digest[p.name] = hashlib.sha256(data).hexdigest()
    return digest


def argv_for(recipe: Path, out: Path, *extra: str) -> list[str]:
    # dense: packing recovers every group's scale (70 % of this run's time) from the same weights
    # and records that are compared here, and adds nothing to what resume has to restore
    return ["--quiet", "--device", "cpu", "quantize", "--recipe", str(recipe), "--model", "default",
            "--output", str(out), "--format", "dense", *extra]


def run_killed(argv: list[str], repo: Path, point: str, sig: str) -> subprocess.CompletedProcess:
    """The CLI in a subprocess that kills itself at `point`. SIGINT is reset to its default in the
    child: a shell that starts the suite in the background ignores it, and Python then installs
    no KeyboardInterrupt handler."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])), "HF_HUB_OFFLINE": "1", KILL_AT_ENV: point, KILL_SIGNAL_ENV: sig}
    return subprocess.run([sys.executable, "-m", "compress", *argv], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, repo):
    """An uninterrupted run without the cache (the reference) and one with it (fills the cache)."""
    root = tmp_path_factory.mktemp("interrupt")
    recipe = write_recipe(root / "r.yaml", RECIPE)
    assert main(argv_for(recipe, root / "reference")) == 0
    assert main(argv_for(recipe, root / "cached", "--cache-dir", str(root / "cache"))) == 0
    return {"root": root, "recipe": recipe, "reference": checkpoint_digest(root / "reference"),
            "cache": root / "cache", "cached_out": root / "cached"}


def report_of(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_same_inputs_give_bitwise_identical_checkpoints(runs):
    """Determinism on CPU: the same recipe, seed and inputs twice (once through the stage cache's
    store path) give byte-identical weights, records and configs."""
    assert checkpoint_digest(runs["cached_out"]) == runs["reference"]
    assert "model.safetensors" in runs["reference"]
    cache = report_of(runs["cached_out"])["cache"]
    assert cache["restored_stages"] == 0 and cache["stored_stages"] == [0, 1]


def test_a_changed_later_stage_recomputes_only_from_that_stage(runs, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(runs["cache"], cache)
    changed = json.loads(json.dumps(RECIPE))
    changed["stages"][1]["gptq"]["dampening_frac"] = 0.05
    recipe = write_recipe(tmp_path / "changed.yaml", changed)
    assert main(argv_for(recipe, tmp_path / "out", "--resume", "--cache-dir", str(cache))) == 0
    report = report_of(tmp_path / "out")
    assert [s.get("from_cache", False) for s in report["stages"]] == [True, False]
    assert report["cache"]["restored_stages"] == 1 and report["cache"]["stored_stages"] == [1]

    # a changed first stage invalidates everything after it
    changed["stages"][0]["rtn"]["input_activations"]["strategy"] = "token"
    changed["stages"][0]["rtn"]["input_activations"]["dynamic"] = True
    recipe = write_recipe(tmp_path / "changed-first.yaml", changed)
    assert main(argv_for(recipe, tmp_path / "out2", "--resume", "--cache-dir", str(cache))) == 0
    assert [s.get("from_cache", False) for s in report_of(tmp_path / "out2")["stages"]] == [False, False]

    # the same recipe with other calibration data is another key too
    changed = json.loads(json.dumps(RECIPE))
    changed["calibration"]["num_samples"] = 3
    recipe = write_recipe(tmp_path / "other-data.yaml", changed)
    assert main(argv_for(recipe, tmp_path / "out3", "--resume", "--cache-dir", str(cache))) == 0
    assert report_of(tmp_path / "out3")["cache"]["restored_stages"] == 0


def test_resume_with_everything_cached_matches_and_runs_nothing(runs, tmp_path):
    assert main(argv_for(runs["recipe"], tmp_path / "out", "--resume", "--cache-dir", str(runs["cache"]))) == 0
    report = report_of(tmp_path / "out")
    assert report["cache"]["restored_stages"] == 2 and report["cache"]["stored_stages"] == []
    assert checkpoint_digest(tmp_path / "out") == runs["reference"]


def test_a_cache_inside_the_output_or_an_input_model_is_refused_before_any_work(runs, tmp_path, capsys):
    """--cache-dir inside the output made the output directory appear during the run (which then
    refused to replace it, and every rerun after); inside the input model it wrote a 15 MB entry
    there. Both are refused first, and nothing is created."""
    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    before = tree_digest(model)
    for cache, words in ((tmp_path / "out" / "cache", "lies inside the output directory"),
                         (model / "cache", "lies inside the input model")):
        argv = argv_for(runs["recipe"], tmp_path / "out", "--cache-dir", str(cache))
        argv[argv.index("default")] = str(model)
        assert main(argv) == 2
        assert words in capsys.readouterr().err
        assert not (tmp_path / "out").exists() and not cache.exists()
    assert tree_digest(model) == before


def test_damaged_cache_entry_is_a_miss_not_a_failure(runs, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(runs["cache"], cache)
    last = cache / "stages" / report_of(runs["cached_out"])["cache"]["keys"][1] / "model.safetensors"
    last.write_bytes(last.read_bytes()[:-4096])  # the tail lost, as on a full disk; the header still reads
    assert main(argv_for(runs["recipe"], tmp_path / "out", "--resume", "--cache-dir", str(cache))) == 0
    report = report_of(tmp_path / "out")
    assert report["cache"]["restored_stages"] == 1  # fell back to the first stage's entry
    assert checkpoint_digest(tmp_path / "out") == runs["reference"]


# (point, signal, stages the resumed run finds in the cache)
KILL_POINTS = [
    ("loaded", "KILL", 0),                      # model loaded, nothing computed
    ("progress:rtn model.layers.1.*", "KILL", 0),  # inside the first stage, second block
    ("cache-storing", "KILL", 0),               # first stage done, its cache entry half written
    ("stage-done:0", "INT", 1),                 # between the stages
    ("progress:block 2: *loss*", "TERM", 1),    # inside GPTQ, second block (`kill`)
    ("saving", "KILL", 2),                      # weights written into the temporary directory
    ("before-move", "INT", 2),                  # complete, not yet moved into place
]


@pytest.mark.parametrize("point,sig,cached", KILL_POINTS, ids=[f"{p}-{s}" for p, s, _ in KILL_POINTS])
def test_killed_run_leaves_nothing_partial_and_resumes_to_the_same_checkpoint(runs, tmp_path, repo, point, sig, cached):
    model_before = tree_digest(DEFAULT_MODEL_DIR)
    out, cache = tmp_path / "out", tmp_path / "cache"
    proc = run_killed(argv_for(runs["recipe"], out, "--resume", "--cache-dir", str(cache)), repo, point, sig)
    if sig == "KILL":
        assert proc.returncode == -signal.SIGKILL, proc.stderr
    else:  # Ctrl-C and `kill` unwind: exit 130, a one-line message, the temporary output removed
        assert proc.returncode == 130, proc.stderr
        assert "Traceback" not in proc.stderr and "interrupted" in proc.stderr

    assert not out.exists(), "a killed run left an output directory"
    leftovers = list(tmp_path.glob(".out.*"))
    if sig != "KILL":
        assert leftovers == [], f"SIG{sig} left a temporary directory"
    for d in leftovers:  # SIGKILL gives no chance to clean up: what stays is hidden and says so
        assert (d / INCOMPLETE_MARKER).is_file() and not (d / "report.json").exists(), sorted(os.listdir(d))
    entries = sorted((cache / "stages").iterdir()) if (cache / "stages").is_dir() else []
    complete = [e for e in entries if not e.name.startswith(".")]
    assert len(complete) == cached
    assert all((e / "state.json").is_file() for e in complete)
    assert all(not (e / "state.json").exists() for e in entries if e.name.startswith("."))
    assert tree_digest(DEFAULT_MODEL_DIR) == model_before, "the input model changed"

    assert main(argv_for(runs["recipe"], out, "--resume", "--cache-dir", str(cache))) == 0
    assert report_of(out)["cache"]["restored_stages"] == cached
    assert checkpoint_digest(out) == runs["reference"]
    assert list(tmp_path.glob(".out.*")) == [], "the resumed run did not clear the killed run's temporary directory"
    # nor the half-written cache entry (a whole model each, left by every kill at cache-storing)
    assert [e.name for e in (cache / "stages").iterdir() if e.name.startswith(".")] == []
    assert tree_digest(DEFAULT_MODEL_DIR) == model_before


def test_interrupted_replace_keeps_the_existing_output(runs, tmp_path, repo):
    """--force over an existing checkpoint, interrupted just before the move: the old one stays."""
    out = tmp_path / "out"
    shutil.copytree(runs["cached_out"], out)
    before = tree_digest(out)
    proc = run_killed(["--json", *argv_for(runs["recipe"], out, "--force", "--resume", "--cache-dir", str(runs["cache"]))], repo,
                      "before-move", "INT")
    assert proc.returncode == 130, proc.stderr
    assert tree_digest(out) == before
    # with --json the failure is JSON on stdout too, as any other
    assert json.loads(proc.stdout) == {"error": "interrupted: no output was written", "exit_code": 130,
                                       "hint": "the completed stages are in the stage cache: rerun the same command to continue"}
    assert list(tmp_path.glob(".out.*")) == []


def test_prune_resume_reuses_its_stage(tmp_path):
    """`compress prune --resume` goes through the same cache: the second run restores the stage."""
    argv = ["--quiet", "--device", "cpu", "prune", "--model", "default", "--method", "magnitude", "--sparsity", "0.5",
            "--no-eval", "--cache-dir", str(tmp_path / "cache")]
    assert main([*argv, "--output", str(tmp_path / "a")]) == 0
    assert main([*argv, "--output", str(tmp_path / "b"), "--resume"]) == 0
    assert report_of(tmp_path / "a")["cache"]["stored_stages"] == [0]
    assert report_of(tmp_path / "b")["cache"]["restored_stages"] == 1
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_kill_between_the_two_renames_of_a_replace_rolls_back(runs, tmp_path, repo, capsys):
    """--force moves the old output aside, then the new one in; killed in between, the next run
    puts the old, complete checkpoint back before doing anything else."""
    out = tmp_path / "out"
    shutil.copytree(runs["cached_out"], out)
    before = tree_digest(out)
    proc = run_killed(argv_for(runs["recipe"], out, "--force", "--resume", "--cache-dir", str(runs["cache"])), repo,
                      "replacing", "KILL")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not out.exists() and len(list(tmp_path.glob(".out.old-*"))) == 1  # no partial output, old one aside
    capsys.readouterr()
    assert main(argv_for(runs["recipe"], out)) == 2  # without --force: refused, because the old one is back
    assert "already exists" in capsys.readouterr().err
    assert tree_digest(out) == before
    assert list(tmp_path.glob(".out.*")) == []


def _small(recipe: dict) -> dict:
    recipe = {k: v for k, v in recipe.items() if k not in ("evaluation", "output", "model")}
    recipe["calibration"] = {**recipe.get("calibration", {}), "num_samples": 4, "seq_len": 32}
    for stage in recipe["stages"]:
        for keys in stage.values():
            if "train" in keys:  # training stages: a few short steps
                keys["data"] = {**keys.get("data", {}), "seq_len": 32, "num_samples": 8, "eval_samples": 4}
                keys["train"] = {**keys["train"], "steps": 2, "batch_size": 2, "save_every": 0}
    return recipe


@pytest.mark.parametrize("name,restorable", [
    ("w8a8-smoothquant", 1),           # smoothed norms (not Linear weights) carry over
    ("prune-mlp25+rtn", 0),            # structured pruning changes shapes: not stored, recomputed, still equal
    ("w4a16-qat", 1),                  # GPTQ restored; QAT starts from its grid and trains the same
])
def test_resume_from_the_middle_of_bundled_recipes(tmp_path, repo, name, restorable):
    if name == "prune-mlp25+rtn":
        recipe = _small(yaml.safe_load((repo / "recipes/prune-mlp25.yaml").read_text()))
        recipe["stages"].append({"rtn": {"scheme": "W8A16"}})
    else:
        recipe = _small(yaml.safe_load((repo / f"recipes/{name}.yaml").read_text()))
    path = write_recipe(tmp_path / "r.yaml", recipe)
    cache = tmp_path / "cache"
    assert main(argv_for(path, tmp_path / "full", "--cache-dir", str(cache))) == 0
    stored = report_of(tmp_path / "full")["cache"]
    if name == "prune-mlp25+rtn":  # no entry would fit a rerun's freshly loaded model: none is written
        assert stored["stored_stages"] == [] and sorted(stored["not_stored"]) == ["0", "1"]
        assert not (cache / "stages").is_dir() or not any((cache / "stages").iterdir())
    else:
        shutil.rmtree(cache / "stages" / stored["keys"][-1])  # as if killed during the last stage
    assert main(argv_for(path, tmp_path / "resumed", "--resume", "--cache-dir", str(cache))) == 0
    assert report_of(tmp_path / "resumed")["cache"]["restored_stages"] == restorable
    assert checkpoint_digest(tmp_path / "resumed") == checkpoint_digest(tmp_path / "full")


def test_an_interrupted_training_run_says_where_its_checkpoint_is(tmp_path, capsys, monkeypatch):
    """distill (or a qat stage) saves checkpoints every save_every steps beside the output, and
    --resume continues from them; the interruption message said no output was written and to use
    --resume "to keep completed stages", as if nothing of the run were kept."""
    from compress import cli, pipeline

    work = tmp_path / ".out.work"
    for step, complete in ((20, True), (100, True), (120, False)):  # step 120 was still being written
        (work / "0-distill" / f"step-{step}").mkdir(parents=True)
        if complete:
            (work / "0-distill" / f"step-{step}" / "complete").touch()
    monkeypatch.setitem(pipeline.RUNNING, "work_dir", work)
    assert cli._interrupted(["distill", "--output", str(tmp_path / "out")]) == 130
    err = capsys.readouterr().err + capsys.readouterr().out
    assert f"training reached a checkpoint at step 100, kept in {work}" in " ".join(err.split()), err
    assert "with --resume to continue from it" in " ".join(err.split())
    monkeypatch.setitem(pipeline.RUNNING, "work_dir", None)  # no training checkpoint: the stage cache hint
    cli._interrupted(["quantize", "--recipe", "r.yaml"])
    assert "rerun with --resume to keep completed stages" in " ".join(capsys.readouterr().err.split())
    monkeypatch.setitem(pipeline.RUNNING, "offload", True)  # which refuses --resume: not suggested
    cli._interrupted(["quantize", "--recipe", "r.yaml"])
    assert "--resume" not in capsys.readouterr().err
    monkeypatch.setitem(pipeline.RUNNING, "offload", False)
    # with --resume: the stage cache is named only when it holds a stage of this run
    from types import SimpleNamespace

    for stored, restored, expected in (([], 0, "no stage completed before the interruption: rerun the same command"),
                                       ([0], 0, "the completed stages are in the stage cache"),
                                       ([], 1, "the completed stages are in the stage cache")):
        monkeypatch.setitem(pipeline.RUNNING, "cache", SimpleNamespace(stored=stored, restored=restored))
        cli._interrupted(["quantize", "--recipe", "r.yaml", "--resume"])
        assert expected in " ".join(capsys.readouterr().err.split()), (stored, restored)


@pytest.mark.parametrize("sig", ["INT", "TERM"])
def test_interrupted_between_the_two_renames_of_a_replace_keeps_the_old_output(runs, tmp_path, repo, sig):
    """Ctrl-C or SIGTERM after the old output was moved aside and before the new one moved in:
    the old one is put back on the way out (it was left aside as `.out.old-<pid>` until a next run)."""
    out = tmp_path / "out"
    shutil.copytree(runs["cached_out"], out)
    before = tree_digest(out)
    proc = run_killed(argv_for(runs["recipe"], out, "--force", "--resume", "--cache-dir", str(runs["cache"])), repo,
                      "replacing", sig)
    assert proc.returncode == 130, proc.stderr
    assert tree_digest(out) == before and list(tmp_path.glob(".out.*")) == []


def test_an_empty_output_directory_is_written_without_force(tmp_path):
    """`mktemp -d` gives an empty directory: nothing in it to lose, so it needs no --force; but
    files that arrive in it during the run are never replaced."""
    from compress.checkpoint import AtomicOutput
    from compress.errors import CompressError

    out = tmp_path / "out"
    out.mkdir(mode=0o700)  # as mktemp -d makes it: the output keeps that
    with AtomicOutput(out) as tmp:
        (tmp / "model.safetensors").write_text("weights")
    assert (out / "model.safetensors").read_text() == "weights" and out.stat().st_mode & 0o777 == 0o700

    out2 = tmp_path / "out2"
    out2.mkdir()
    with pytest.raises(CompressError, match="was empty when the run started and now holds files"):
        with AtomicOutput(out2) as tmp:
            (tmp / "model.safetensors").write_text("weights")
            (out2 / "notes.txt").write_text("mine")
    assert [p.name for p in out2.iterdir()] == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out2")] == []
    # nor is a directory that another run made meanwhile where there was none
    out3 = tmp_path / "out3"
    with pytest.raises(CompressError, match="appeared during the run"):
        with AtomicOutput(out3) as tmp:
            (tmp / "model.safetensors").write_text("weights")
            out3.mkdir()
            (out3 / "model.safetensors").write_text("theirs")
    assert (out3 / "model.safetensors").read_text() == "theirs"


def test_a_failed_run_removes_the_parent_directories_it_made(tmp_path):
    from compress.checkpoint import AtomicOutput

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "kept.txt").write_text("mine")
    with pytest.raises(RuntimeError):
        with AtomicOutput(tmp_path / "a" / "b" / "c" / "out") as tmp:
            assert tmp.parent == tmp_path / "a" / "b" / "c"
            raise RuntimeError("a stage failed")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["kept.txt"]  # b/ and b/c/ gone, a/ as it was


def test_ctrl_c_while_the_command_is_still_importing_is_one_line(repo):
    """Importing torch and transformers takes seconds; a Ctrl-C then printed a traceback of the
    import (the package imported them itself, before the command's handler existed). The package
    now imports nothing heavy, so the command's guard (compress/__main__.py) is in place first."""
    light = subprocess.run([sys.executable, "-c", "import sys, compress; print(sorted({'torch', 'transformers'} & set(sys.modules)))"],
                           cwd=repo, capture_output=True, text=True, timeout=120)
    assert light.stdout.strip() == "[]", light.stdout + light.stderr
    for sig in ("INT", "TERM"):  # Ctrl-C, `kill`
        proc = run_killed(["--json", "eval", "--model", "default", "--data", "x.txt"], repo, "importing", sig)
        assert proc.returncode == 130, proc.stderr
        assert proc.stderr == "interrupted\n" and json.loads(proc.stdout) == {"error": "interrupted", "hint": None, "exit_code": 130}
    proc = run_killed(["--json", "quantize", "--recipe", "r.yaml"], repo, "importing", "INT")
    assert proc.returncode == 130 and json.loads(proc.stdout)["error"] == "interrupted: no output was written", proc.stderr


def test_under_a_launcher_only_the_main_process_says_it_was_interrupted(repo, tmp_path, monkeypatch):
    """A launcher stops every process once one has ended: when the main one had just refused bad
    input, another process stopped while importing or loading printed "interrupted" after it, a
    second JSON document on stdout (seen under torchrun on a loaded 16-core machine)."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    recipe = write_recipe(tmp_path / "r.yaml", RECIPE)
    for point in ("importing", "loaded"):
        proc = run_killed(["--json", *argv_for(recipe, tmp_path / "out")], repo, point, "TERM")
        assert proc.returncode == 130 and proc.stdout == "" and "interrupted" not in proc.stderr, (point, proc.stdout, proc.stderr)
    monkeypatch.setenv("RANK", "0")  # the main process says it, as ever
    proc = run_killed(["--json", *argv_for(recipe, tmp_path / "out")], repo, "loaded", "TERM")
    assert proc.returncode == 130 and json.loads(proc.stdout)["error"] == "interrupted: no output was written", proc.stderr


def test_an_interrupt_a_library_wrapped_in_its_own_error_is_still_an_interrupt(monkeypatch, capsys):
    """transformers' lazy import turns a Ctrl-C during it into ModuleNotFoundError("Could not
    import module 'LlamaConfig'"), which was reported as an internal error, exit 3."""
    from compress import modeling

    def interrupted_import(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise ModuleNotFoundError("Could not import module 'LlamaConfig'") from exc

    monkeypatch.setattr(modeling, "load_model", interrupted_import)
    rc = main(["eval", "--model", "default", "--data", "calibration/heldout-tinyshakespeare.txt"])
    assert rc == 130 and "interrupted" in capsys.readouterr().err
