"""Choosing a bit width per layer under a budget of average bits per weight: plain math on
numbers, no models. `compress analyze --emit-recipe` feeds it the measured cost of each layer at
each width (compress/sensitivity.py) and writes the result as a recipe.

The problem is a multiple-choice knapsack: every layer takes exactly one option (a bit width),
each option has a storage cost (bits, scale overhead included) and a quality cost (the KL or
perplexity increase measured with only that layer quantized); minimise the summed quality cost
with the summed storage at most the budget. Summing per-layer costs assumes their effects add,
which holds to first order for small perturbations; the emitted recipe is then measured whole.

Solved by Lagrangian relaxation: for a price λ per bit every layer independently picks the
option minimising cost + λ·bits; bisection finds the smallest λ whose choice fits the budget.
Then any budget left over is spent greedily on the upgrades with the best cost drop per bit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    """One way to store one layer: a label (e.g. the bit width), its bits and its measured cost."""

    label: object
    bits: float
    cost: float


def _pick(options: list[Option], price: float) -> Option:
    return min(options, key=lambda o: (o.cost + price * o.bits, o.bits))


def allocate(layers: dict[str, list[Option]], budget_bits: float, iterations: int = 100) -> dict[str, Option]:
    """One option per layer, total bits <= budget_bits, summed cost (approximately) minimal.

    Raises ValueError when even the cheapest option of every layer exceeds the budget."""
    if not layers:
        return {}
    floor = sum(min(o.bits for o in opts) for opts in layers.values())
    if floor > budget_bits * (1 + 1e-12):
        raise ValueError(f"the smallest option of every layer already needs {floor:.0f} bits, over the budget of {budget_bits:.0f}")

    def choose(price: float) -> dict[str, Option]:
        return {name: _pick(opts, price) for name, opts in layers.items()}

    def total(choice: dict[str, Option]) -> float:
        return sum(o.bits for o in choice.values())

    lo, hi = 0.0, 1.0
    while total(choose(hi)) > budget_bits:
        hi *= 2.0
        if hi > 1e30:
            break
    if total(choose(lo)) <= budget_bits:
        return choose(lo)  # the budget allows every layer its best option
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if total(choose(mid)) > budget_bits:
            lo = mid
        else:
            hi = mid
    choice = choose(hi)
    return _spend_rest(layers, choice, budget_bits)


def _spend_rest(layers: dict[str, list[Option]], choice: dict[str, Option], budget_bits: float) -> dict[str, Option]:
    """Greedy upgrades with what the relaxation left unspent: best cost drop per extra bit first."""
    choice = dict(choice)
    while True:
        left = budget_bits - sum(o.bits for o in choice.values())
        best, best_rate = None, 0.0
        for name, opts in layers.items():
            cur = choice[name]
            for o in opts:
                extra = o.bits - cur.bits
                gain = cur.cost - o.cost
                if 0 < extra <= left and gain > 0 and gain / extra > best_rate:
                    best, best_rate = (name, o), gain / extra
        if best is None:
            return choice
        choice[best[0]] = best[1]
