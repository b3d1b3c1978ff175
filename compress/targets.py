"""Which modules a stage applies to: `targets` and `ignore` lists as compressed-tensors writes them.

An entry matches a module when it equals the module's class name (`Linear`, which also covers
GPT-2's Conv1D), equals its full name
(`model.layers.0.mlp.down_proj`), is a suffix of it at a dot boundary (`lm_head`, `mlp.down_proj`),
or, with the `re:` prefix, is a regular expression matched from the start of the full name
(`re:.*q_proj$`).
"""

from __future__ import annotations

import re

import torch

# Linear-like classes whose weights we quantize. GPT-2's Conv1D stores the weight transposed.
LINEAR_TYPES = ("Linear", "Conv1D")


def matches(pattern: str, name: str, module: torch.nn.Module) -> bool:
    if pattern.startswith("re:"):
        # Anchored at the start, open at the end, as compressed-tensors applies `re.match`.
        return re.match(pattern[3:], name) is not None
    if pattern == type(module).__name__:
        return True
    if pattern == "Linear" and type(module).__name__ in LINEAR_TYPES:
        return True  # GPT-2's Conv1D is a linear layer stored transposed: `Linear` covers it
    return name == pattern or name.endswith("." + pattern)


def select_modules(
    model: torch.nn.Module, targets: list[str], ignore: list[str]
) -> dict[str, torch.nn.Module]:
    """Linear-like modules matched by any target and by no ignore entry, in model order."""
    chosen = {}
    for name, module in model.named_modules():
        if type(module).__name__ not in LINEAR_TYPES:
            continue
        if any(matches(p, name, module) for p in targets) and not any(matches(p, name, module) for p in ignore):
            chosen[name] = module
    return chosen


def unused_patterns(model: torch.nn.Module, patterns: list[str]) -> list[str]:
    """Patterns that match no linear-like module: almost always a typo in the recipe."""
    linear = [(n, m) for n, m in model.named_modules() if type(m).__name__ in LINEAR_TYPES]
    return [p for p in patterns if not any(matches(p, n, m) for n, m in linear)]
