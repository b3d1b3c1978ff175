"""Benchmark tasks (ARC, HellaSwag, GSM8K, MMLU, or a task of your own written as lm-eval YAML),
scored by lm-eval, EleutherAI's evaluation harness, on the model as compress loaded it: packed
checkpoints decompressed, activation quantization simulated.

compress does not write its own tasks. lm-eval's prompts, few-shot sampling and metrics are the
ones papers and leaderboards report, so its numbers can be compared with theirs. lm-eval is an
optional dependency (`pip install 'compress[tasks]'`) and is imported only when tasks are asked
for.

Each task is reduced to one number for the gate, its primary metric: `acc_norm` where the task
reports it (the length-normalised accuracy that HellaSwag and ARC-Challenge are quoted by), else
`acc`, else `exact_match`, else the first metric the task reports. `--task-metric` picks another.
Against a baseline, the gate looks at how much worse the model scores, in the metric's units and
in lm-eval's direction for it (accuracy falling, perplexity rising). A tag (ai2_arc) or a group
without an aggregate score is reported, and gated, task by task.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import io
import logging
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from compress.errors import CompressError, first_line

PREFERRED_METRICS = ("acc_norm", "acc", "exact_match")
FILE_LOADERS = ("json", "csv", "parquet", "text", "arrow")  # datasets' builders over files named by data_files
INSTALL_HINT = "install lm-eval: pip install 'compress[tasks]'"
TASK_HINT = ("list lm-eval's tasks with `lm-eval ls tasks`, or give the directory holding the task's YAML: "
             "--include-path DIR (include_path in a recipe)")


class TaskRequest(BaseModel):
    """What `compress eval --tasks`, or a recipe's `evaluation.tasks`, asks of lm-eval. In a
    recipe a plain list is the task names alone."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    names: list[str] = Field(..., min_length=1, description="lm-eval tasks, groups or tags (arc_easy, mmlu, ai2_arc)")
    include_path: Optional[str] = Field(None, description="a directory of your own lm-eval task YAML files")
    num_fewshot: Optional[int] = Field(None, ge=0, description="few-shot examples per prompt (default: each task's own)")
    limit: Optional[int] = Field(None, gt=0, description="only the first N documents of each task: a quick look, not a published number")
    metric: Optional[str] = Field(None, description="the metric each task is judged by (default: acc_norm, else acc, else exact_match)")
    chat_template: bool = Field(False, description="prompts, and few-shot examples as turns, through the tokenizer's chat template")

    @model_validator(mode="before")
    @classmethod
    def _names_alone(cls, value):
        return {"names": value} if isinstance(value, list) else value


def _lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise CompressError("--tasks needs lm-eval, which is not installed", INSTALL_HINT) from None
    for name in ("lm-eval", "lm_eval"):  # its per-task notices would bury the results
        logging.getLogger(name).setLevel(logging.ERROR)
    return lm_eval, HFLM, TaskManager


@contextlib.contextmanager
def _stderr_silenced():
    """Hide what lm-eval writes to stderr: its progress bars, which would fight compress's on the
    terminal and fill CI logs, and git's "not a git repository" (fd 2 of the subprocess lm-eval
    runs to record the current directory's commit). Failures still come back as exceptions."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as sink, contextlib.redirect_stderr(io.StringIO()):
            os.dup2(sink.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def task_manager(include_path: str | Path | None = None):
    """lm-eval's task index (its own tasks, plus the YAML files under `include_path`)."""
    _lm_eval()
    if include_path is not None and not Path(include_path).is_dir():
        raise CompressError(f"--include-path {include_path} is not a directory", "give the directory holding the task YAML files")
    if not include_path:
        return _indexed(None, ())
    root = Path(include_path).resolve()
    yamls = tuple(sorted((str(f), f.stat().st_mtime_ns) for f in root.rglob("*.y*ml")))
    return _indexed(str(root), yamls)


@functools.lru_cache(maxsize=8)
def _indexed(include_path: str | None, yamls: tuple):
    """Indexing lm-eval's 14,000 task files takes seconds, so a process that scores several models
    (a recipe's output and its baseline, a library caller's loop) builds the index once. `yamls`,
    the files under `include_path` with their modification times, is part of the key: a task
    written or edited since is indexed afresh."""
    _, _, TaskManager = _lm_eval()
    return TaskManager(include_path=include_path)


def check_tasks(tasks: list[str], manager) -> None:
    """Unknown task names are refused before any model is loaded."""
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise CompressError(f"unknown lm-eval task{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}", TASK_HINT)


def primary_metric(metrics: dict, metric: str | None = None) -> str:
    """The metric a task is judged by (see the module note), from lm-eval's 'name,filter' keys."""
    names = [k.split(",")[0] for k in metrics if "," in k and not k.split(",")[0].endswith("_stderr")]
    if metric is not None:
        if metric not in names:
            raise CompressError(f"--task-metric {metric}: the task reports {', '.join(names) or 'no metrics'}",
                                "pick one of those")
        return metric
    return next((m for m in PREFERRED_METRICS if m in names), names[0] if names else None)


def check_local_data(tasks: list[str], manager) -> None:
    """A task of one's own names its data in its YAML (data_files, or a dataset_path that is a
    directory); lm-eval reads them only when the task runs, which in a recipe is after every stage.
    Files named there that do not exist are refused now. Hub datasets are not looked up."""
    seen: set[str] = set()

    def local_paths(cfg: dict) -> list[str]:
        """Paths a task reads from this machine. data_files are read from the current directory
        under a loader (json, csv, ...), from inside dataset_path when that is a local directory,
        and from the hub repository otherwise (not looked up here)."""
        path = cfg.get("dataset_path")
        if not isinstance(path, str):
            return []
        local_dir = path.startswith(("/", "./", "../", "~"))
        if not local_dir and path not in FILE_LOADERS:
            return []
        files = (cfg.get("dataset_kwargs") or {}).get("data_files") or []  # a path, a list, or split -> either
        paths = []
        for item in files.values() if isinstance(files, dict) else [files]:
            paths += [item] if isinstance(item, str) else list(item)
        base = Path(path).expanduser() if local_dir else Path()
        return ([str(base)] if local_dir else []) + [str(base / p) for p in paths if "://" not in p]

    def walk(name: str) -> None:
        entry = manager.task_index.get(name)
        if entry is None or name in seen:
            return
        seen.add(name)
        cfg = entry.cfg or {}
        if entry.kind.name in ("GROUP", "TAG"):  # a group lists its tasks in `task`, a tag's entry in `tags`
            members = cfg.get("task") if entry.kind.name == "GROUP" else sorted(getattr(entry, "tags", None) or [])
            for member in members or []:
                if isinstance(member, str):
                    walk(member)
            return
        for path in local_paths(cfg):
            where = str(Path(path).expanduser())
            if not (glob.glob(where, recursive=True) if glob.has_magic(where) else Path(where).exists()):
                raise CompressError(f"lm-eval task {name} ({entry.yaml_path}): its data {path} does not exist",
                                    "correct the path in the task's YAML (data_files are read from the current directory, "
                                    "or from within dataset_path when that is a directory), or create the file")

    for name in tasks:
        walk(name)


def prepare(request: TaskRequest, causal: bool, model: str):
    """lm-eval's index, with the request checked where it costs nothing: a missing lm-eval,
    unknown names, a local task's missing data and an encoder are refused before any model is
    loaded or compressed."""
    manager = task_manager(request.include_path)
    check_tasks(request.names, manager)
    check_local_data(request.names, manager)
    if not causal:
        raise CompressError(f"lm-eval tasks: {model} is an encoder, and lm-eval's tasks score causal language models",
                            "measure encoders with evaluation data and a baseline (embedding fidelity)")
    return manager


def check_tokenizer(chat_template: bool, tokenizer) -> None:
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise CompressError("--chat-template (chat_template in a recipe): the model's tokenizer has no chat template",
                            "evaluate an instruct model (its tokenizer_config.json has chat_template), or drop the option")


def score(net, tokenizer, request: TaskRequest, manager, batch_size: int = 8, baseline: tuple | None = None,
          thresholds: dict | None = None, progress=lambda *_: None) -> dict[str, dict]:
    """run_tasks on the model, then (with `baseline`, a (model, tokenizer) pair) on the baseline,
    adding its score and how much worse the model scores. `thresholds` (min_task_score,
    max_task_drop) are checked in between, so a pointless one costs one run, not two."""
    run = dict(num_fewshot=request.num_fewshot, limit=request.limit, batch_size=batch_size, metric=request.metric,
               chat_template=request.chat_template)
    names = ", ".join(request.names)
    progress(f"lm-eval: {names}", 0, 2 if baseline is not None else 1)
    results = run_tasks(net, tokenizer, request.names, manager, **run)
    check_thresholds(results, **(thresholds or {"min_task_score": None, "max_task_drop": None}))
    if baseline is not None:
        progress(f"lm-eval on the baseline: {names}", 1, 2)
        for task, r in run_tasks(*baseline, request.names, manager, **run).items():
            results[task].update(baseline_score=r["score"], score_drop=worsening(results[task], r))
    return results


def run_tasks(net, tokenizer, tasks: list[str], manager, *, num_fewshot: int | None = None, limit: int | None = None,
              batch_size: int = 8, metric: str | None = None, chat_template: bool = False) -> dict[str, dict]:
    """{task: {metric, score, higher_is_better, stderr, samples}} for one model: each task asked
    for, or, for a tag or a group without an aggregate score, each of its tasks."""
    lm_eval, HFLM, _ = _lm_eval()
    check_tokenizer(chat_template, tokenizer)
    lm = HFLM(pretrained=net, tokenizer=tokenizer, batch_size=batch_size)
    try:
        with _stderr_silenced():
            out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, num_fewshot=num_fewshot,
                                          limit=limit, log_samples=False, apply_chat_template=chat_template,
                                          fewshot_as_multiturn=chat_template)
    except CompressError:
        raise
    except Exception as exc:
        message = first_line(exc)
        data = isinstance(exc, (OSError, ConnectionError)) or any(w in message.lower() for w in ("hub", "offline", "unable to find", "connect"))
        hint = ("built-in tasks download their datasets from the hub (offline, write the task as local YAML and pass "
                "--include-path); a local task's data files must exist") if data else "check the task names and their YAML"
        raise CompressError(f"lm-eval could not run {', '.join(tasks)}: {message}", hint) from None
    return {task: _row(out, task, metric) for name in tasks for task in _scored(out, name, manager)}


def _scored(out: dict, name: str, manager) -> list[str]:
    """The entries that answer for `name`: itself where lm-eval scored it (a task, or a group with
    aggregate_metric_list), else its tasks (a tag, or a group without an aggregate)."""
    if any("," in k for k in out["results"].get(name, {})):
        return [name]
    members = out.get("group_subtasks", {}).get(name) or []
    if not members and name in getattr(manager, "all_tags", []):
        members = sorted(getattr(manager.task_index.get(name), "tags", None) or [])  # a tag's entry lists its tasks
    members = [m for m in members if m in out["results"]]
    if not members:
        raise CompressError(f"lm-eval task {name} reported no metric", "check the task's metric_list")
    return [task for m in members for task in _scored(out, m, manager)]


def _row(out: dict, task: str, metric: str | None) -> dict:
    metrics = out["results"][task]
    name = primary_metric(metrics, metric)
    key = next(k for k in metrics if k.split(",")[0] == name)
    stderr = metrics.get(key.replace(name, f"{name}_stderr", 1))
    return {"metric": name, "score": float(metrics[key]),
            "higher_is_better": bool(out.get("higher_is_better", {}).get(task, {}).get(name, True)),
            "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
            "samples": out.get("n-samples", {}).get(task, {}).get("effective")}


def worsening(model: dict, baseline: dict) -> float:
    """How much worse the model scores than the baseline, in the metric's own units (a fall in
    accuracy, a rise in perplexity); negative where it scores better."""
    gap = baseline["score"] - model["score"]
    # Rounded below the scores' own float precision: 0.40 - 0.38 is 0.020000000000000018, which
    # failed --max-task-drop 0.02 on a drop of exactly 2 documents in 100.
    scale = max(abs(baseline["score"]), abs(model["score"]), 1e-300)
    gap = round(gap, 12 - math.ceil(math.log10(scale)))
    return gap if model["higher_is_better"] else -gap


def check_thresholds(results: dict, min_task_score: float | None, max_task_drop: float | None) -> None:
    """Thresholds that could never fail, or mean nothing for a task's metric, refused after the
    model's run and before the baseline's."""
    for task, r in results.items():
        if min_task_score is not None and not r["higher_is_better"]:
            raise CompressError(f"--min-task-score: {task}'s {r['metric']} is better when lower, so a floor on it means nothing",
                                "gate it against the baseline with --max-task-drop, or pick --task-metric")
        if max_task_drop is not None and max_task_drop >= 1 and r["higher_is_better"] and 0 <= r["score"] <= 1:
            raise CompressError(f"--max-task-drop {max_task_drop:g} can never fail: {task}'s {r['metric']} lies in [0, 1]",
                                "give the drop as a fraction: 0.01 is one point")
