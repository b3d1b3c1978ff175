"""Mixture-of-experts plumbing: transformers stores a block's experts fused, as 3-D parameters
(`gate_up_proj` [experts, 2·intermediate, hidden], `down_proj` [experts, hidden, intermediate];
Mixtral, Qwen2-MoE, ...). For compression each expert is unfused into three ordinary Linear
layers (`experts.3.gate_proj`, `.up_proj`, `.down_proj`), views of the fused parameters, run by
the same routing loop, so that target matching, observers and per-expert token counts work as for
any layer; afterwards any weight that stopped being a view is written back into the fused
parameters and the original module returns.
A packed checkpoint stores each expert layer on its own, under the key transformers saves it as
(expert_keys_on_disk).
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterable

import torch
from torch import nn


def is_fused_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3 and down.dim() == 3


def routes_tokens(model: nn.Module) -> bool:
    """Whether the model sends each token to some of its experts (fused, unfused here, or a
    module list named `experts` as older transformers and custom models keep them)."""
    return any(is_fused_experts(m) or isinstance(m, UnfusedExperts) or (name.rsplit(".", 1)[-1] == "experts"
                                                                       and isinstance(m, nn.ModuleList))
               for name, m in model.named_modules())


_EXPERT_LAYER = re.compile(r"^(.*\.experts)\.(\d+)\.(.+)$")


def sibling_experts(name: str, names: Iterable[str]) -> list[str]:
    """The same layer of the other experts in `name`'s expert list (`...experts.5.down_proj` ->
    every `...experts.N.down_proj` in `names` but itself); [] for a layer that is not an expert's."""
    match = _EXPERT_LAYER.match(name)
    if match is None:
        return []
    head, _, tail = match.groups()
    return [n for n in names if n != name and (m := _EXPERT_LAYER.match(n)) is not None and m.group(1) == head
            and m.group(3) == tail]


def static_input_range(name: str, ranges: dict[str, tuple[float, float]]) -> tuple[tuple[float, float] | None, str | None]:
    """The static input range to freeze for layer `name`, from the observed `ranges` (layers that
    saw calibration tokens), and a note when it is not its own: an expert layer no token reached
    takes the union of its sibling experts' ranges (their gate and up projections read the very
    hidden states it would, routed differently); with none observed there is no range (None), and
    its inputs stay unquantized."""
    if name in ranges:
        return ranges[name], None
    seen = [ranges[n] for n in sibling_experts(name, ranges)]
    if not seen:
        return None, "no calibration token reached it, so there is no static input range: inputs not quantized"
    return ((min(lo for lo, _ in seen), max(hi for _, hi in seen)),
            "no calibration token reached it: its static input range is the union of its sibling experts'")


class Expert(nn.Module):
    """One expert as three Linear layers whose weights are views of the fused parameters' rows
    (`gate_up` [2·intermediate, hidden] and `down` [hidden, intermediate] of one expert): unfusing
    copies nothing, and a stage that writes a weight in place writes the fused parameter. A Mixtral's
    experts are nearly all of its weights, so a copy would double the memory a run needs."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        inter = gate_up.shape[0] // 2
        self.gate_proj = _linear_on(gate_up[:inter])  # the fused layout: gate rows first, then up
        self.up_proj = _linear_on(gate_up[inter:])
        self.down_proj = _linear_on(down)

    def weights_in(self, gate_up: torch.Tensor, down: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(this expert's weight, where it lives in the fused parameters), for each layer."""
        inter = gate_up.shape[0] // 2
        return [(self.gate_proj.weight, gate_up[:inter]), (self.up_proj.weight, gate_up[inter:]),
                (self.down_proj.weight, down)]


def _linear_on(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")  # meta: nothing allocated
    layer.weight = nn.Parameter(weight)  # trainable, as any Linear's (QAT, distillation)
    return layer


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())


class UnfusedExperts(nn.ModuleList):
    """Same routing as the fused module's eager loop: each token goes to its top-k experts. A list
    of the experts itself, so that expert e's layers are `<experts>.e.gate_proj`, as in models that
    keep experts unfused."""

    def __init__(self, fused: nn.Module):
        gate_up, down = fused.gate_up_proj.detach(), fused.down_proj.detach()
        super().__init__(Expert(gate_up[e], down[e]) for e in range(gate_up.shape[0]))
        self.fused = [fused]  # lists, so that neither is registered as a submodule (nor listed as an expert)
        self.act = [fused.act_fn]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        act_fn = self.act[0]
        for e, expert in enumerate(self):
            token_idx, slot = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            x = hidden_states[token_idx]
            h = expert.down_proj(act_fn(expert.gate_proj(x)) * expert.up_proj(x))
            out.index_add_(0, token_idx, (h * top_k_weights[token_idx, slot, None]).to(out.dtype))
        return out

    @torch.no_grad()
    def sync(self, into_fused: bool = True) -> None:
        """Copy between the experts and the fused parameters wherever an expert's weight is no
        longer a view of its rows: a stage replaced it, or it went to another device and back."""
        fused = self.fused[0]
        for e, expert in enumerate(self):
            for weight, rows in expert.weights_in(fused.gate_up_proj[e], fused.down_proj[e]):
                if not _same_memory(weight, rows):
                    (rows if into_fused else weight).copy_(weight if into_fused else rows)

    def fuse_back(self) -> nn.Module:
        self.sync()
        return self.fused[0]


def unfuse_experts(model: nn.Module) -> list[tuple[nn.Module, str, UnfusedExperts]]:
    """Replace every fused experts module by an UnfusedExperts; returns what to restore."""
    swaps = []
    for name, module in list(model.named_modules()):
        if is_fused_experts(module) and hasattr(module, "act_fn"):
            parent_name, attr = name.rsplit(".", 1)
            parent = model.get_submodule(parent_name)
            unfused = UnfusedExperts(module)
            setattr(parent, attr, unfused)
            swaps.append((parent, attr, unfused))
    return swaps


def fuse_experts(swaps: list[tuple[nn.Module, str, UnfusedExperts]]) -> None:
    for parent, attr, unfused in swaps:
        setattr(parent, attr, unfused.fuse_back())


@contextlib.contextmanager
def fused_layout(model: nn.Module):
    """The fused experts back in place of the unfused ones for a while, holding the experts'
    current weights, so that the model is saved, or loaded into, in its own layout and keys (the
    stage cache). The experts see what was loaded."""
    swaps = [(model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], module)
             for name, module in model.named_modules() if isinstance(module, UnfusedExperts)]
    for parent, attr, unfused in swaps:
        setattr(parent, attr, unfused.fuse_back())
    try:
        yield
    finally:
        for parent, attr, unfused in swaps:
            setattr(parent, attr, unfused)
            unfused.sync(into_fused=False)


def expert_keys_on_disk(model: nn.Module) -> dict[str, str]:
    """Each unfused expert layer (`<experts>.3.gate_proj`, as UnfusedExperts names them) -> the
    checkpoint key its weight is saved under, without `.weight` (`...experts.3.w1` for Mixtral,
    `...experts.3.gate_proj` for Qwen-MoE). transformers saves fused experts in each family's
    original per-expert layout through its own conversion mapping; reverting probe tensors with
    that mapping, each row holding a code for its expert and row, shows which key every expert's
    gate, up and down rows land in, with no table of our own. Empty without fused experts;
    ValueError when a fused weight is not saved as one [out, in] matrix per expert layer."""
    from transformers.core_model_loading import revert_weight_conversion

    probes, origin, base = {}, [], 0
    for name, module in model.named_modules():
        if not (is_fused_experts(module) and hasattr(module, "act_fn")):
            continue
        for part in ("gate_up_proj", "down_proj"):
            experts, rows = getattr(module, part).shape[:2]
            codes = torch.arange(base, base + experts * rows, dtype=torch.float64).reshape(experts, rows, 1)
            probes[f"{name}.{part}"] = torch.cat([codes, torch.zeros_like(codes)], dim=-1)  # [experts, rows, 2]
            origin.append((base, name, part, experts, rows))
            base += experts * rows
    if not probes:
        return {}
    out = {}
    for key, t in revert_weight_conversion(model, probes).items():
        code = int(t.reshape(-1)[0]) if t.numel() else -1
        found = next((o for o in origin if o[0] <= code < o[0] + o[3] * o[4]), None)
        if found is None or not key.endswith(".weight") or t.dim() != 2 or t.shape[1] != 2:
            raise ValueError(f"fused experts saved as {key} {tuple(t.shape)}, not one matrix per expert layer")
        start, name, part, _, rows = found
        e, first = divmod(code - start, rows)
        if not torch.equal(t[:, 0], torch.arange(code, code + t.shape[0], dtype=t.dtype)):
            raise ValueError(f"fused experts saved as {key}, whose rows are not one expert layer's")
        if part == "down_proj" and first == 0 and t.shape[0] == rows:
            layer = "down_proj"
        elif part == "gate_up_proj" and t.shape[0] == rows // 2 and first in (0, rows // 2):
            layer = "gate_proj" if first == 0 else "up_proj"  # the fused layout: gate rows first, then up
        else:
            raise ValueError(f"fused experts saved as {key}, rows {first}..{first + t.shape[0]} of {name}.{part}[{e}]")
        out[f"{name}.{e}.{layer}"] = key[: -len(".weight")]
    return out


def fused_experts_of(net: nn.Module, name: str) -> nn.Module | None:
    """The fused experts module holding the unfused expert layer `name` (`<experts>.e.up_proj`), or None."""
    experts = name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""
    try:
        module = net.get_submodule(experts)
    except AttributeError:
        return None
    return module if is_fused_experts(module) else None


def expert_weight_shape(model: nn.Module, name: str) -> tuple[int, int]:
    """[out, in] of the unfused expert layer `name` (`<experts>.e.gate_proj`) of a fused model."""
    experts, _, layer = name.rsplit(".", 2)
    fused = model.get_submodule(experts)
    if layer == "down_proj":
        return tuple(fused.down_proj.shape[1:])
    rows, cols = fused.gate_up_proj.shape[1:]
    return rows // 2, cols
