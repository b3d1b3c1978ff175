"""Which modules a stage applies to: `targets` and `ignore` lists as compressed-tensors writes them.

An entry matches a module when it equals the module's class name (`Linear`, which also covers
GPT-2's Conv1D), equals its full name
(`model.layers.0.mlp.down_proj`), is a suffix of it at a dot boundary (`lm_head`, `mlp.down_proj`),
or, with the `re:` prefix, is a regular expression matched from the start of the full name
(`re:.*q_proj$`).
"""

from __future__ import annotations

import re
from typing import Annotated

import torch
from pydantic import AfterValidator

from compress.errors import CompressError

# Linear-like classes whose weights we quantize. GPT-2's Conv1D stores the weight transposed.
LINEAR_TYPES = ("Linear", "Conv1D")


def check_pattern(pattern: str) -> str:
    """`pattern` itself; ValueError when a `re:` pattern is not a regular expression."""
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as exc:
            raise ValueError(f"{pattern!r} is not a valid regular expression ({exc})") from None
    return pattern


# A recipe field holding a pattern: a bad regular expression is a recipe error, with its place.
Pattern = Annotated[str, AfterValidator(check_pattern)]


def matches(pattern: str, name: str, module: torch.nn.Module) -> bool:
    if pattern.startswith("re:"):
        # Anchored at the start, open at the end, as compressed-tensors applies `re.match`.
        try:
            return re.match(pattern[3:], name) is not None
        except re.error as exc:  # from a command-line option; recipe fields are checked on parsing
            raise CompressError(f"{pattern!r} is not a valid regular expression ({exc})",
                                "fix the pattern after `re:` (a Python regular expression)") from None
    if pattern == type(module).__name__:
        return True
    if pattern == "Linear" and type(module).__name__ in LINEAR_TYPES:
        return True  # GPT-2's Conv1D is a linear layer stored transposed: `Linear` covers it
    return name == pattern or name.endswith("." + pattern)


def select_modules(
    model: torch.nn.Module, targets: list[str], ignore: list[str]
) -> dict[str, torch.nn.Module]:
    """Linear-like modules matched by any target and by no ignore entry, in model order. A
    mixture-of-experts gate (moe_gates) is selected only by a target that names it, not by a
    class name such as `Linear`."""
    gates = moe_gates(model)
    chosen = {}
    for name, module in model.named_modules():
        if type(module).__name__ not in LINEAR_TYPES:
            continue
        named_by = [p for p in targets if matches(p, name, module)]
        if name in gates:
            named_by = [p for p in named_by if p not in ("Linear", type(module).__name__)]
        if named_by and not any(matches(p, name, module) for p in ignore):
            chosen[name] = module
    return chosen


def moe_gates(model: torch.nn.Module) -> set[str]:
    """The linear layers that sit directly in a mixture-of-experts block, beside its `experts`: a
    router kept as a Linear, or Qwen-MoE's shared_expert_gate (one output through a sigmoid).
    vLLM and SGLang build these as plain unquantized layers, so a quantized one makes a checkpoint
    they cannot load; they are a sliver of the weights, and the routing is worth keeping exact."""
    blocks = [name for name, module in model.named_modules() if isinstance(getattr(module, "experts", None), torch.nn.Module)]
    return {f"{block}.{child}" if block else child for block in blocks
            for child, module in model.get_submodule(block).named_children() if type(module).__name__ in LINEAR_TYPES}


def unused_patterns(model: torch.nn.Module, patterns: list[str]) -> list[str]:
    """Patterns that match no linear-like module: almost always a typo in the recipe."""
    linear = [(n, m) for n, m in model.named_modules() if type(m).__name__ in LINEAR_TYPES]
    return [p for p in patterns if not any(matches(p, n, m) for n, m in linear)]


# Layers that read one input and that inference engines (vLLM) run as one fused matrix: Llama-style
# q/k/v and gate/up, BERT's query/key/value, Mixtral's expert w1/w3. A per-tensor scale (NVFP4's
# global scale) must be the same across such a group, since the fused matrix has only one.
FUSED_INPUTS = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}, {"query", "key", "value"}, {"w1", "w3"})


def fused_groups(names: list[str]) -> list[list[str]]:
    """`names` in groups of siblings that an engine fuses (FUSED_INPUTS), every other name alone;
    in order of each group's first member."""
    groups: dict[tuple, list[str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        fused = next((i for i, leaves in enumerate(FUSED_INPUTS) if leaf in leaves), None)
        key = (parent, fused) if fused is not None else (name,)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def mixed_fused_groups(names: list[str], schemes: dict[str, str]) -> list[str]:
    """The groups of `names` an engine fuses (fused_groups) whose parts are not all on one scheme
    (`schemes`: layer -> its scheme described; a layer missing is unquantized), each named by its
    parent module and parts. vLLM runs such a group as one matrix with one scheme and refuses
    a checkpoint where they differ."""
    mixed = []
    for group in fused_groups(names):
        if len(group) > 1 and len({schemes.get(n) for n in group}) > 1:
            parent = group[0].rpartition(".")[0]
            mixed.append(f"{parent} ({', '.join(n.rpartition('.')[2] + ': ' + schemes.get(n, 'unquantized') for n in group)})")
    return mixed


def mixed_fused_warning(mixed: list[str]) -> str:
    return (f"{len(mixed)} group{'s' if len(mixed) > 1 else ''} of layers that vLLM runs as one fused matrix (q/k/v, "
            f"gate/up) mix schemes, which vLLM refuses to load (transformers and compress read it): "
            f"{'; '.join(mixed[:3])}{' ...' if len(mixed) > 3 else ''}; give each group one scheme")
