"""Per-layer sensitivity: quantize one layer at a time with round-to-nearest (everything else in
full precision), measure what it costs the model's next-token distribution, and rank the layers.
`compress analyze` is the command line over `analyze()`; `mixed_precision_recipe()` turns the
measurements into a recipe that keeps the costly layers at more bits (compress/bitalloc.py
chooses the widths).

Measurement: the baseline's log-probabilities on the analysis windows are computed once; then for
each layer and bit width the layer's weight is swapped for its rounded copy, one forward pass over
the same windows gives KL(p_base ‖ p) per position (or the perplexity increase), and the weight
is put back. The windows come from calibration text, not from the evaluation sets, so that a
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
            batch_size: int = 8, progress: Callable[[str, int, int], None] = lambda *_: None, scale_bits: int = 16) -> dict:
    """Every target layer quantized alone at each width in `bits`: its KL, top-1 agreement and
    perplexity increase against the unquantized model, on `windows` ([n, seq_len] token ids).
    `scale_bits`: the width the output will store scales at (its dtype's: schemes.scale_bits_of)."""
    model.eval()
    layers = select_modules(model, list(targets), list(ignore))
    if not layers:
        raise CompressError(f"targets {list(targets)} minus ignore {list(ignore)} match no linear layer",
                            "run `compress plan` to see the model's module names")
    start = time.perf_counter()
    base_logp = _log_probs(model, windows, batch_size)
    results: dict[str, dict] = {}
    total = len(layers) * len(bits)
    done = 0
    for name, module in layers.items():
        original = get_weight(module)
        out_f, in_f = original.shape
        results[name] = {"shape": [out_f, in_f], "parameters": out_f * in_f, "by_bits": {}}
        for b in bits:
            progress(f"analyze {name} W{b}", done, total)
            args = weight_args(b, group_size, symmetric)
            set_weight(module, quantize_weight(original, args))
            try:
                cost = distribution_cost(model, windows, base_logp, batch_size)
            finally:
                set_weight(module, original)
            cost["storage_bits"] = packed_weight_bits(out_f, in_f, args, scale_bits)
            results[name]["by_bits"][b] = cost
            done += 1
    progress("analyze", total, total)
    return {"layers": results, "windows": int(windows.shape[0]), "seq_len": int(windows.shape[1]),
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
    # refuses parts at different widths): each such group takes one width, its costs and bits summed.
    groups = {group[0]: group for group in fused_groups(list(layers))}
    for first, group in groups.items():
        widths = sorted(set.intersection(*(set(layers[n]["by_bits"]) for n in group)))
        options[first] = [Option(b, sum(layers[n]["by_bits"][b]["storage_bits"] for n in group),
                                 sum(layers[n]["by_bits"][b][key] for n in group)) for b in widths]
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
