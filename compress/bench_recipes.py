"""`compress bench`: a user's own recipes on a user's own model, measured the way the project's
benchmark (compress/bench.py, ../shared/BENCH_PROTOCOL.md) measures its rows, and written as
report.md, report.json and report.html in one directory.

    baseline (in this process): the model's perplexity and its log-probabilities (or sentence
        embeddings) on the evaluation data, saved once (compress.evaluate.BaselineStore)
    each recipe, in its own process (forked from a server with torch and compress imported, so
        that its peak memory is its own): run_recipe -> load the checkpoint back -> evaluate
        against the saved baseline

Evaluation data: --data files, or by default the protocol's test sets when shared/ is present
(Tiny Shakespeare and WikiText-2 test for a causal LM, WikiText-2 test sentences for an encoder).
A recipe without a calibration section gets the protocol's calibration set (or --calibration)
when one of its stages needs one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from compress.errors import CompressError

REPO = Path(__file__).resolve().parent.parent


def shared_dir() -> Path:
    return Path(os.environ.get("COMPRESS_SHARED", REPO.parent / "shared")).resolve()


def protocol_data(causal: bool) -> tuple[list[str], dict] | None:
    """(evaluation files, calibration section) of BENCH_PROTOCOL.md, or None without shared/."""
    data = shared_dir() / "data"
    ts, wt = data / "tinyshakespeare", data / "wikitext-2"
    if not (wt / "test.txt").is_file() or not (ts / "test.txt").is_file():
        return None
    if causal:
        return ([str(ts / "test.txt"), str(wt / "test.txt")],
                {"dataset": [str(ts / "train.txt"), str(wt / "train.txt")], "num_samples": 128, "seq_len": 256})
    return [str(wt / "test.txt")], {"dataset": str(wt / "train.txt"), "num_samples": 128, "seq_len": 128,
                                    "packing": False, "min_chars": 40}


def _row_job(recipe_text: str, source: str, model: str | None, out: str, eval_kwargs: dict, datasets: list[str],
             store_dir: str, cache: dict, result_path: str, log_path: str) -> None:
    """In a forked process: run one recipe (or, with `model` None, only score the checkpoint
    already at `out`: another tool's), score its checkpoint, write the result as JSON."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        import transformers

        # no progress bars in a log; and tqdm's bars take a multiprocessing lock that this
        # process, ending with os._exit, would leave to the resource tracker to report as leaked
        transformers.utils.logging.disable_progress_bar()
        from compress import modeling
        from compress.bench import _peak_rss_mib, _rss_now_mib
        from compress.evaluate import BaselineStore, evaluate
        from compress.pipeline import run_recipe
        from compress.recipe import parse_recipe

        t0 = time.perf_counter()
        rss_before_load = _rss_now_mib()
        report = None
        if model is not None:
            report = run_recipe(parse_recipe(recipe_text, source), model=model, output=out, force=True, device="cpu", seed=0)
        net, tok, _ = modeling.load_model(out, dtype="float32", device="cpu")
        cache_keys = {tuple(json.loads(k)): v for k, v in cache.items()}
        results = evaluate(net, tok, datasets, baseline=None, device="cpu", baseline_cache=cache_keys,
                           baseline_store=BaselineStore(store_dir), **eval_kwargs)
        if report is None:
            Path(result_path).write_text(json.dumps({"evaluation": results}, default=str))
            code = 0
            return
        errors = [r["relative_error"] for r in report["layers"].values() if "relative_error" in r]
        # every stage's scheme, in order: a mixed-precision recipe is several rtn stages, not its last
        schemes = list(dict.fromkeys(s["summary"].get("scheme", s["name"]) for s in report["stages"]))
        Path(result_path).write_text(json.dumps({
            "scheme": " + ".join(schemes), "stages": [s["name"] for s in report["stages"]],
            "stage_wall_s": sum(s["wall_s"] for s in report["stages"]),
            "stage_peak_rss_mib": max(s["peak_rss_mib"] for s in report["stages"]),
            "rss_before_load_mib": rss_before_load,
            "process_peak_rss_mib": _peak_rss_mib(), "output": report["output"], "format": report.get("format"),
            "mean_relative_error": sum(errors) / len(errors) if errors else None,
            "evaluation": results, "job_wall_s": time.perf_counter() - t0}, default=str))
        code = 0
    except BaseException as exc:  # noqa: BLE001 - the driver reports the last line of the log
        import traceback

        traceback.print_exc()
        print(f"error: {getattr(exc, 'message', None) or exc}", flush=True)
    finally:
        os._exit(code)


def _forked(fork, args: tuple, result: Path, log: Path) -> dict:
    """Run _row_job in a fresh process from the fork server; its result, or {"error": last log line}."""
    from compress.bench import join_job

    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    proc = fork.Process(target=_row_job, args=(*args, str(result), str(log)))
    proc.start()
    join_job(proc)
    if proc.exitcode != 0 or not result.is_file():
        lines = log.read_text().strip().splitlines() if log.is_file() else []
        return {"error": lines[-1].removeprefix("error: ") if lines else f"exit code {proc.exitcode}"}
    return json.loads(result.read_text())


def bench_recipes(model: str, recipes: list[Path], output: Path, datasets: list[str] | None = None,
                  calibration: str | None = None, max_windows: int = 256, seq_len: int = 256,
                  progress: Callable[[str, int, int], None] = lambda *_: None,
                  against: str | None = None, against_python: str | None = None, command: str | None = None) -> dict:
    """Every recipe on `model`, each in its own process; returns what report.json holds. With
    `against` (llmcompressor), each recipe is also run by that tool (compress/against.py)."""
    import shlex
    import sys

    from compress import modeling
    from compress.bench import _fork_context, _machine, write_outputs
    from compress.evaluate import BaselineStore, eval_sentences, eval_windows

    if not recipes:
        raise CompressError("no recipe given", "pass one or more recipe files: --recipes a.yaml b.yaml")
    config = modeling.load_config(model)
    causal = modeling.is_causal_lm(config)
    seq_len = modeling.fit_context(config, seq_len)
    protocol = protocol_data(causal)
    cal_section = ({"dataset": calibration, "num_samples": 128, "seq_len": seq_len} if calibration
                   else (protocol[1] if protocol else None))
    parsed = [_with_calibration(Path(r), cal_section) for r in recipes]  # every file checked before any work
    if against:
        from compress import against as side

        against_python = side.find_python(against, against_python)
    t_start = time.perf_counter()
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    progress("loading the baseline", 0, 1)
    base, tok, config = modeling.load_model(model, dtype="float32", device="cpu")
    if not datasets:
        if protocol is None:
            raise CompressError("no evaluation data given and the protocol's data (shared/) is not here",
                                "pass --data FILE, or set COMPRESS_SHARED to the shared/ directory")
        datasets = protocol[0]
    eval_kwargs = ({"causal": True, "seq_len": seq_len, "max_windows": max_windows, "batch_size": 8} if causal
                   else {"causal": False, "max_sentences": 200})
    store = BaselineStore(output / ".baseline")
    cache = {}
    if causal:
        base_eval = {spec: store.write(base, eval_windows(tok, spec, seq_len, max_windows), 8, tokenizer=tok)
                     for spec in datasets}
        cache = {json.dumps([spec, seq_len, max_windows]): r for spec, r in base_eval.items()}
    else:
        for spec in datasets:
            store.write_embeddings(base, tok, eval_sentences(spec, 200))
        base_eval = {}
    baseline = {"family": "user", "row": "user baseline", "parameters": modeling.count_parameters(base),
                "bytes_on_disk": _bytes(model), "evaluation": base_eval}
    del base

    fork = _fork_context()
    if fork is None:
        raise CompressError("compress bench needs multiprocessing's forkserver (Linux or macOS)", "run each recipe with compress quantize")
    earlier = _set_aside(output)
    try:
        rows = _run_rows(parsed, model, output, eval_kwargs, datasets, store, cache, fork, against, against_python,
                         causal, tok, progress)
        progress("writing the report", len(parsed), len(parsed))
        total = time.perf_counter() - t_start
        from compress import __version__

        meta = {"command": command or ("compress " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "compress bench (Python API)"),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": _machine(), "compress": __version__,
                "total_wall_s": total, "model": model, "datasets": datasets, "loadavg_before": None,
                "output": str(output / "report.md")}
        results = [baseline] + rows
        write_outputs(results, meta, output / "report.md", title=f"compress bench: {model}", render_fn=render_markdown)
    except BaseException:  # failed or interrupted: the earlier bench's rows go back beside its report
        for name, kept in earlier:
            shutil.rmtree(output / name, ignore_errors=True)
            kept.rename(output / name)
        raise
    for _, kept in earlier:
        shutil.rmtree(kept, ignore_errors=True)
    return {"meta": meta, "baseline": baseline, "rows": rows, "paths": {k: str(output / f"report.{k}") for k in ("md", "json", "html")}}


def _set_aside(output: Path) -> list[tuple[str, Path]]:
    """An earlier bench's rows/ and against/ (which the new report would not list) moved aside
    until this one has written its report: a bench that fails or is interrupted leaves the earlier
    one whole. Those a killed bench left aside are dropped (their report was being replaced)."""
    import os

    from compress.checkpoint import left_by_dead_runs

    for stale in left_by_dead_runs(output, ".*.earlier-*"):
        shutil.rmtree(stale, ignore_errors=True)
    earlier = []
    for name in ("rows", "against"):
        if (output / name).exists():
            kept = output / f".{name}.earlier-{os.getpid()}"
            (output / name).rename(kept)
            earlier.append((name, kept))
    return earlier


def _run_rows(parsed, model, output, eval_kwargs, datasets, store, cache, fork, against, against_python, causal, tok,
              progress) -> list[dict]:
    """Each recipe in its own process (and by `against`, when given): the rows of the report."""
    import yaml

    from compress.modeling import local_dir

    if against:
        from compress import against as side
    rows = []
    for i, ((path, doc), name) in enumerate(zip(parsed, row_names([path for path, _ in parsed]))):
        progress(f"{path.name} ({i + 1}/{len(parsed)})", i, len(parsed))
        out = output / "rows" / name
        recipe_text = yaml.safe_dump(doc, sort_keys=False)
        t0 = time.perf_counter()
        job = (recipe_text, str(path), model, str(out), eval_kwargs, datasets, str(store.directory), cache)
        row = {"row": name, "family": "user", "method": name, "label": name, "recipe": path.read_text()}
        row.update(_forked(fork, job, output / "rows" / f"{name}.json", output / "rows" / f"{name}.log"))
        row["child_wall_s"] = time.perf_counter() - t0
        if against:
            progress(f"{path.name} with {against} ({i + 1}/{len(parsed)})", i, len(parsed))
            row["against"] = _run_against(side, against_python, fork, str(local_dir(model).resolve()), causal, recipe_text, str(path), tok,
                                          output / "against" / name, job)
        rows.append(row)
    return rows


def _with_calibration(path: Path, cal_section: dict | None) -> tuple[Path, dict]:
    """(path, recipe document) checked by the recipe schema; a recipe whose stages need calibration
    data and that has none gets the benchmark's (the protocol's, or --calibration). The benchmark
    evaluates every row the same way, so a recipe's own evaluation section is dropped."""
    import yaml

    from compress.recipe import load_recipe

    recipe = load_recipe(path, default_calibration=cal_section)
    doc = yaml.safe_load(path.read_text())
    if doc.get("calibration") is None and recipe.calibration is not None:
        doc["calibration"] = cal_section
    doc.pop("evaluation", None)
    return path, doc


def row_names(paths: list[Path]) -> list[str]:
    """Each recipe's row name, its file's stem; recipes of one stem (from different directories, or
    one given twice) get -2, -3, ... in order, so no row's checkpoint, log or result overwrites another's."""
    names: list[str] = []
    for path in paths:
        name, k = path.stem, 2
        while name in names:  # also where a suffixed name meets a recipe that has it as its stem
            name, k = f"{path.stem}-{k}", k + 1
        names.append(name)
    return names


def _run_against(side, python: str, fork, model: str, causal: bool, recipe_text: str, source: str, tok,
                 workdir: Path, job: tuple) -> dict:
    """The same recipe through llm-compressor, then its checkpoint scored like compress's."""
    from compress.calibration import build_calibration
    from compress.recipe import parse_recipe

    recipe = parse_recipe(recipe_text, source)
    try:
        modifiers, notes = side.llmcompressor_modifiers(recipe)
    except side.Untranslatable as exc:
        return {"skipped": str(exc)}
    calibration = build_calibration(recipe.calibration, tok, encoder=not causal) if recipe.calibration is not None else None
    result = side.run_llmcompressor(python, model, causal, calibration, modifiers, workdir)
    result["notes"], result["modifiers_spec"] = notes, modifiers
    if "error" in result:
        return result
    scored = _forked(fork, (job[0], job[1], None, result["checkpoint"], *job[4:]), workdir / "score.json", workdir / "score.log")
    if "error" in scored:
        return {**result, "error": f"scoring its checkpoint: {scored['error']}"}
    return {**result, "evaluation": scored["evaluation"]}


def _bytes(model: str) -> int | None:
    from compress.checkpoint import dir_weight_bytes
    from compress.modeling import resolve_model

    path = Path(resolve_model(model))
    return dir_weight_bytes(path) if path.is_dir() else None


def render_markdown(results: list[dict], meta: dict) -> str:
    """report.md of `compress bench`: one table row per recipe, every evaluation set."""
    base = next(r for r in results if r["row"] == "user baseline")
    rows = [r for r in results if r is not base]
    specs = meta["datasets"]
    short = [Path(s).parent.name + "/" + Path(s).name for s in specs]
    causal = bool(base["evaluation"])
    lines = [f"# compress bench: `{meta['model']}`", "",
             f"- command: `{meta['command']}`", f"- date: {meta['date']}; total {meta['total_wall_s']:.0f} s",
             f"- machine: {meta['machine']['nproc']} cores, {meta['machine']['cpu']}; torch {meta['machine']['torch']}, "
             f"transformers {meta['machine']['transformers']}, compress {meta['compress']}", ""]
    if causal:
        lines.append("Baseline perplexity: " + ", ".join(f"{s} {base['evaluation'][spec]['token_perplexity']:.3f}"
                                                          for s, spec in zip(short, specs)) + ".")
        metrics = [("kl_divergence", "KL", ".3e"), ("top1_agreement", "top-1", ".4f"), ("token_perplexity", "ppl", ".3f"),
                   ("ppl_increase_pct", "Δppl %", "+.2f")]
    else:
        metrics = [("embedding_error", "1 − cos", ".3e"), ("mean_cosine", "mean cos", ".5f"), ("nn_agreement", "NN agreement", ".3f")]
    lines.append(f"Baseline: {base['parameters']:,} parameters, {_num(base['bytes_on_disk'])} bytes on disk.")
    lines.append("")
    header = ["recipe", "scheme"] + [f"{m[1]} {s}" for s in short for m in metrics] + [
        "compression s", "peak RSS MiB (stage / process)", "bytes on disk", "bits/param packed"]
    lines += ["| " + " | ".join(header) + " |", "| --- | --- |" + " ---: |" * (len(header) - 2)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | **error**: {r['error']} |" + " |" * (len(header) - 2))
            continue
        cells = [r["row"], f"`{r['scheme']}`"]
        for spec in specs:
            m = r["evaluation"][spec]
            cells += [format(m[k], f) if k in m else "–" for k, _, f in metrics]
        o = r["output"]
        cells += [f"{r['stage_wall_s']:.2f}", f"{r['stage_peak_rss_mib']:.0f} / {r['process_peak_rss_mib']:.0f}",
                  f"{o['bytes_on_disk']:,}", f"{o['bits_per_parameter_packed']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Each recipe ran in its own process (peak RSS is that process's); KL, top-1 and perplexity are "
              "measured as in BENCH_PROTOCOL.md against the unquantized model on the same windows. report.json holds "
              "every field; report.html plots quality against bytes on disk.", ""]
    if any("against" in r for r in rows):
        from compress.against import render_side_by_side

        lines += render_side_by_side(rows, specs, causal)
    return "\n".join(lines)


def _num(v) -> str:
    return "–" if v is None else f"{v:,}"
