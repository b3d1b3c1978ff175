"""Keys and bookkeeping shared by the pruning stages (magnitude, wanda, sparsegpt).

    sparsity: 0.5                  # share of each target layer's weights set to zero, in [0, 1)
    pattern: "2:4"                 # or N:M semi-structured: N zeros in every M consecutive inputs
    sparsity_overrides:            # per layer, by the same matching as targets (first match wins):
      mlp.down_proj: 0.3           #   a sparsity ...
      re:.*self_attn.*: "4:8"      #   ... or a pattern; 0 leaves the layer dense
    targets: [Linear]
    ignore: [lm_head]

With a pattern, the sparsity is N/M; giving both is allowed only when they agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from pydantic import Field, PrivateAttr, field_validator, model_validator

from compress.errors import CompressError
from compress.modeling import weight_shape
from compress.sparsity import parse_pattern, sparsity as zero_share
from compress.stages.base import Stage, StageContext, check_weight, select_targets  # noqa: F401 (check_weight: for the pruning stages)
from compress.targets import Pattern, matches


@dataclass(frozen=True)
class LayerTarget:
    """What one layer is pruned to: a sparsity, and an N:M pattern or None (unstructured)."""

    sparsity: float
    nm: Optional[tuple[int, int]] = None

    @property
    def pattern(self) -> str | None:
        return f"{self.nm[0]}:{self.nm[1]}" if self.nm else None

    def describe(self) -> str:
        return self.pattern or f"{self.sparsity:g} unstructured"


UNQUOTED = "YAML reads an unquoted N:M as a base-60 number (2:4 is 124): quote it, \"2:4\""


def _target_of(value: Union[float, str]) -> LayerTarget:
    """0.3 -> 30 % unstructured; '2:4' -> that pattern."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 60 and float(value).is_integer():
        raise ValueError(f"got the number {value:g}; {UNQUOTED}")
    if isinstance(value, str) and ":" in value:
        n, m = parse_pattern(value)
        return LayerTarget(n / m, (n, m))
    s = float(value)
    if not 0 <= s < 1:
        raise ValueError(f"sparsity must be in [0, 1), got {value}")
    return LayerTarget(s, None)


class PruningStage(Stage):
    """Keys every pruning stage shares."""

    sparsity: Optional[float] = Field(None, ge=0, lt=1, description="share of each target layer's weights pruned, in [0, 1); default 0.5, or N/M with a pattern")
    pattern: Optional[str] = Field(None, description="N:M semi-structured sparsity, e.g. 2:4: N zeros in every M consecutive input weights")
    sparsity_overrides: dict[Pattern, Union[float, str]] = Field(
        default_factory=dict, description="per layer (target matching, first match wins): a sparsity, or an N:M pattern; 0 leaves it dense")
    targets: list[Pattern] = Field(default_factory=lambda: ["Linear"], description="module class names, names, or re: patterns")
    ignore: list[Pattern] = Field(default_factory=lambda: ["lm_head"], description="modules left dense")
    # While apply runs: each selected layer's target, and the layers done through the engine.
    _targets: dict = PrivateAttr(default_factory=dict)
    _done: set = PrivateAttr(default_factory=set)

    @field_validator("pattern", mode="before")
    @classmethod
    def _pattern_is_nm(cls, value):
        if isinstance(value, int) and not isinstance(value, bool):
            raise ValueError(f"got the number {value}; {UNQUOTED}")
        if value is not None:
            n, m = parse_pattern(value)
            value = f"{n}:{m}"
        return value

    @field_validator("sparsity_overrides")
    @classmethod
    def _overrides_are_targets(cls, value):
        for key, v in value.items():
            try:
                _target_of(v)
            except ValueError as exc:
                raise ValueError(f"sparsity_overrides[{key!r}]: {exc}") from None
        return value

    @model_validator(mode="after")
    def _sparsity_agrees_with_pattern(self):
        if self.pattern is not None:
            n, m = parse_pattern(self.pattern)
            if self.sparsity is not None and abs(self.sparsity - n / m) > 1e-9:
                raise ValueError(f"sparsity {self.sparsity:g} contradicts pattern {self.pattern} (which prunes {n / m:g}): drop one")
            self.sparsity = n / m
        elif self.sparsity is None:
            self.sparsity = 0.5
        return self

    def describe_target(self) -> str:
        """The stage's default target, as the `scheme` of its summary: '2:4 (sparsity 0.5)', 'sparsity 0.5 unstructured'."""
        base = f"{self.pattern} (sparsity {self.sparsity:g})" if self.pattern else f"sparsity {self.sparsity:g} unstructured"
        return base + (f", {len(self.sparsity_overrides)} override(s)" if self.sparsity_overrides else "")

    def layer_targets(self, modules: dict[str, torch.nn.Module], stage_name: str) -> dict[str, LayerTarget]:
        """Each selected layer's target; an override key that matches none of them is a typo."""
        default = LayerTarget(self.sparsity, parse_pattern(self.pattern) if self.pattern else None)
        overrides = {k: _target_of(v) for k, v in self.sparsity_overrides.items()}
        self.check_overrides(modules, stage_name)
        out = {}
        for name, module in modules.items():
            out[name] = next((t for k, t in overrides.items() if matches(k, name, module)), default)
            if out[name].nm and weight_shape(module)[1] % out[name].nm[1]:
                raise CompressError(f"layer {name}: its {weight_shape(module)[1]} input features are not a multiple of "
                                    f"M = {out[name].nm[1]} (pattern {out[name].pattern})",
                                    "ignore that layer, or give it a sparsity_overrides entry")
        return out

    def check_overrides(self, modules: dict[str, torch.nn.Module], stage_name: str) -> None:
        for key in self.sparsity_overrides:
            if not any(matches(key, n, m) for n, m in modules.items()):
                raise CompressError(f"stage {stage_name}: sparsity_overrides key '{key}' matches no target layer",
                                    "run `compress plan` to see the model's module names")

    def select(self, model: torch.nn.Module, stage_name: str) -> dict[str, torch.nn.Module]:
        return select_targets(model, self.targets, self.ignore, stage_name)


def count_nonzero(model: torch.nn.Module) -> int | None:
    """Nonzero parameters; None while some are on disk (`offload: disk`: the meta device)."""
    params = list(model.parameters())
    if any(p.is_meta for p in params):
        return None
    return sum(int(torch.count_nonzero(p)) for p in params)


def record_layer(ctx: StageContext, name: str, stage: str, target: LayerTarget, before: torch.Tensor,
                 after: torch.Tensor, **extra) -> None:
    """A pruned layer's row in report.json: the sparsity reached (exact zeros), the target and pattern.

    `sparsity`, `target_sparsity`, `pattern` and `pruning_relative_error` are the pruning stages'
    own keys and survive a later quantization stage, which replaces `stage`, `shape` and
    `relative_error` with its own."""
    from compress.quant import relative_error

    err = relative_error(before, after)  # relative_error is replaced by a later quantization stage's
    ctx.layers.setdefault(name, {}).update({
        "stage": stage, "shape": list(before.shape), "sparsity": zero_share(after), "target_sparsity": target.sparsity,
        "pattern": target.pattern, "relative_error": err, "pruning_relative_error": err, **extra})


def prune_summary(model: torch.nn.Module, modules: dict[str, torch.nn.Module], nonzero_before: int | None,
                  layers: dict[str, dict]) -> dict:
    """The stage's summary: overall sparsity of the target layers (from their records, as the
    weights may be on disk by now), parameters and nonzeros before/after."""
    zeros = total = 0
    for name in modules:
        out_f, in_f = layers[name]["shape"]
        zeros += round(layers[name]["sparsity"] * out_f * in_f)
        total += out_f * in_f
    return {
        "layers": len(modules),
        "sparsity": zeros / max(total, 1),
        "target_parameters": total,
        "parameters": sum(p.numel() for p in model.parameters()),
        "nonzero_parameters_before": nonzero_before,
        "nonzero_parameters_after": count_nonzero(model),
    }



