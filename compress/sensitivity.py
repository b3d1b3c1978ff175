"""Per-layer sensitivity: quantize one layer at a time with round-to-nearest (everything else in
full precision), measure what it costs the model's next-token distribution, and rank the layers.
`compress analyze` is the command line over `analyze()`; `mixed_precision_recipe()` turns the
measurements into a recipe that keeps the costly layers at more bits (compress/bitalloc.py
chooses the widths).

Measurement: the baseline's log-probabilities on the analysis windows are computed once; then for
each layer and bit width the layer's weight is swapped for its rounded copy, one forward pass over
the same windows gives KL(p_base ‖ p) per position (or the perplexity increase), and the weight
is put back; groups an inference engine fuses (q/k/v, gate/up) are measured again whole, since they
get one width. The windows come from calibration text, not from the evaluation sets, so that a
recipe chosen here is judged on data it did not see.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from compress.bitalloc import Option, allocate
from compress.errors import CompressError
from compress.modeling import get_weight, set_weight
from compress.schemes import QuantArgs, packed_weight_bits
from compress.stages.rtn import quantize_weight
from compress.targets import fused_groups, select_modules

METRICS = ("kl", "ppl")


def weight_args(bits: int, group_size: int | None, symmetric: bool = True) -> QuantArgs:
    """Integer weights at `bits`, grouped by `group_size` columns (per output channel when None)."""
    if group_size:
        return QuantArgs(num_bits=bits, symmetric=symmetric, strategy="group", group_size=group_size)
    return QuantArgs(num_bits=bits, symmetric=symmetric, strategy="channel")


@torch.no_grad()
def _log_probs(model, windows: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    return [F.log_softmax(model(input_ids=windows[i : i + batch_size]).logits.float(), dim=-1)
            for i in range(0, len(windows), batch_size)]


@torch.no_grad()
def distribution_cost(model, windows: torch.Tensor, base_logp: list[torch.Tensor], batch_size: int) -> dict:
    """KL(p_base ‖ p) and top-1 agreement per position, and the perplexity ratio, of `model`
    against the cached baseline log-probabilities of the same windows."""
    kl = agree = positions = 0.0
    nll = base_nll = 0.0
    predicted = 0
    for chunk, base in zip(range(0, len(windows), batch_size), base_logp):
        ids = windows[chunk : chunk + batch_size]
        logp = F.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
        kl += float((base.exp() * (base - logp)).sum())
        agree += int((base.argmax(-1) == logp.argmax(-1)).sum())
        positions += ids.numel()
        targets = ids[:, 1:].unsqueeze(-1)
        nll -= float(logp[:, :-1].gather(-1, targets).sum())
        base_nll -= float(base[:, :-1].gather(-1, targets).sum())
        predicted += targets.numel()
    return {"kl_divergence": kl / positions, "top1_agreement": agree / positions,
            "ppl_increase_pct": 100.0 * (math.exp((nll - base_nll) / predicted) - 1.0)}


def analyze(model: torch.nn.Module, windows: torch.Tensor, bits: list[int], group_size: int | None,
            symmetric: bool = True, targets: list[str] = ("Linear",), ignore: list[str] = ("lm_head",),
            batch_size: int = 8, progress: Callable[[str, int, int], None] = lambda *_: None, scale_bits: int = 16,
            fused: bool = False) -> dict:
    """Every target layer quantized alone at each width in `bits`: its KL, top-1 agreement and
    perplexity increase against the unquantized model, on `windows` ([n, seq_len] token ids).
    `scale_bits`: the width the output will store scales at (its dtype's: schemes.scale_bits_of).
    `fused`: also measure each group an engine fuses (q/k/v, gate/up: targets.fused_groups) with
    all its parts quantized together, under "groups" keyed by its first part; allocate_bits gives
    such a group one width and prices it by that joint cost."""
    model.eval()
    layers = select_modules(model, list(targets), list(ignore))
    if not layers:
        raise CompressError(f"targets {list(targets)} minus ignore {list(ignore)} match no linear layer",
                            "run `compress plan` to see the model's module names")
    start = time.perf_counter()
    base_logp = _log_probs(model, windows, batch_size)
    # Each unit is measured with all its layers rounded at once: a layer alone, then (with `fused`)
    # every fused group whole. Parts of one attention or MLP interact (their errors meet in the same
    # scores or products): on ref-llama at W2 g64 a group whole cost 1.2-1.5x its parts' sum.
    units = [[name] for name in layers]
    if fused:
        units += [group for group in fused_groups(list(layers)) if len(group) > 1]
    results: dict[str, dict] = {}
    groups: dict[str, dict] = {}
    total = len(units) * len(bits)
    done = 0
    for unit in units:
        originals = {name: get_weight(layers[name]) for name in unit}
        shapes = {name: tuple(w.shape) for name, w in originals.items()}
        params = sum(o * i for o, i in shapes.values())
        record = ({"shape": list(shapes[unit[0]])} if len(unit) == 1 else {"members": unit}) | {"parameters": params, "by_bits": {}}
        label = unit[0] if len(unit) == 1 else f"{unit[0].rpartition('.')[0]} ({'+'.join(n.rpartition('.')[2] for n in unit)})"
        for b in bits:
            progress(f"analyze {label} W{b}", done, total)
            args = weight_args(b, group_size, symmetric)
            try:
                for name in unit:
                    set_weight(layers[name], quantize_weight(originals[name], args))
                cost = distribution_cost(model, windows, base_logp, batch_size)
            finally:
                for name in unit:
                    set_weight(layers[name], originals[name])
            cost["storage_bits"] = sum(packed_weight_bits(o, i, args, scale_bits) for o, i in shapes.values())
            record["by_bits"][b] = cost
            done += 1
        (results if len(unit) == 1 else groups)[unit[0]] = record
    progress("analyze", total, total)
    return {"layers": results, "groups": groups, "windows": int(windows.shape[0]), "seq_len": int(windows.shape[1]),
            "bits": list(bits), "group_size": group_size, "symmetric": symmetric, "scale_bits": scale_bits,
            "wall_s": time.perf_counter() - start}


def metric_key(metric: str) -> str:
    if metric not in METRICS:
        raise CompressError(f"--metric {metric!r} is not a sensitivity metric", "use kl or ppl")
    return "kl_divergence" if metric == "kl" else "ppl_increase_pct"


def ranking(analysis: dict, bits: int, metric: str = "kl") -> list[tuple[str, float]]:
    """(layer, cost at `bits`), most sensitive first."""
    key = metric_key(metric)
    rows = [(name, rec["by_bits"][bits][key]) for name, rec in analysis["layers"].items()]
    return sorted(rows, key=lambda r: r[1], reverse=True)


def allocate_bits(analysis: dict, budget_bits: float, metric: str = "kl") -> dict:
    """A width per layer from the measured widths, holding the average storage (codes and scales,
    counted by parameters) at most that of every layer at `budget_bits` with the same grouping."""
    key = metric_key(metric)
    group_size, symmetric = analysis["group_size"], analysis["symmetric"]
    layers = analysis["layers"]
    options, budget, params = {}, 0.0, 0
    # Layers an inference engine fuses (q/k/v, gate/up) run as one matrix with one scheme (vLLM
    # refuses parts at different widths): each such group takes one width, priced by its cost
    # measured whole (analyze(fused=True)), or else by its parts' costs summed.
    groups = {group[0]: group for group in fused_groups(list(layers))}
    measured = analysis.get("groups", {})
    for first, group in groups.items():
        whole = measured.get(first) if measured.get(first, {}).get("members") == group else None
        widths = set.intersection(*(set(layers[n]["by_bits"]) for n in group), *([set(whole["by_bits"])] if whole else []))
        widths = sorted(widths)
        options[first] = [Option(b, sum(layers[n]["by_bits"][b]["storage_bits"] for n in group),
                                 whole["by_bits"][b][key] if whole else sum(layers[n]["by_bits"][b][key] for n in group))
                          for b in widths]
    for name, rec in layers.items():
        out_f, in_f = rec["shape"]
        # The budget at a fractional width: codes at that width, scales as the scheme stores them.
        whole = weight_args(max(2, int(budget_bits)), group_size, symmetric)
        budget += (packed_weight_bits(out_f, in_f, whole, analysis.get("scale_bits", 16))
                   + out_f * in_f * (budget_bits - whole.num_bits))
        params += out_f * in_f
    try:
        choice = allocate(options, budget)
    except ValueError as exc:
        raise CompressError(f"--budget-bits {budget_bits:g} is below the narrowest width measured: {exc}",
                            "raise --budget-bits or measure narrower widths") from None
    used = sum(o.bits for o in choice.values())
    leader = {name: first for first, group in groups.items() for name in group}
    return {"bits": {name: choice[leader[name]].label for name in layers},
            "predicted_cost": sum(o.cost for o in choice.values()),
            "storage_bits_per_weight": used / params, "budget_bits_per_weight": budget / params}


def mixed_precision_recipe(allocation: dict, group_size: int | None, symmetric: bool, model: str | None,
                           calibration: dict | None = None) -> dict:
    """The allocation as a recipe: one rtn stage per width, each naming its layers exactly."""
    by_width: dict[int, list[str]] = {}
    for name, b in allocation["bits"].items():
        by_width.setdefault(int(b), []).append(name)
    stages = []
    for b in sorted(by_width, reverse=True):
        weights = {"num_bits": b, "symmetric": symmetric}
        weights.update({"strategy": "group", "group_size": group_size} if group_size else {"strategy": "channel"})
        stages.append({"rtn": {"scheme": "W4A16", "weights": weights, "targets": by_width[b]}})
    doc: dict = {"model": model} if model else {}
    if calibration:
        doc["calibration"] = calibration
    doc["stages"] = stages
    return doc
