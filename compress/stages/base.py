"""What every stage shares: the context it runs in, and the quantization keys (scheme presets,
overrides, targets and ignore) common to every quantization algorithm."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from compress.schemes import PRESETS, QuantScheme, resolve_scheme


@dataclass
class StageContext:
    """Everything a stage may use besides the model itself."""

    device: torch.device
    calibration: Any = None  # compress.calibration.CalibrationSet, when the recipe has one
    seed: int = 0
    # progress(description, completed, total): the CLI draws it as a Rich bar; no-op when quiet.
    progress: Callable[[str, int, int], None] = lambda *_: None
    # Per-layer records (scheme, error, activation range...) for report.json and compress.json.
    layers: dict[str, dict] = field(default_factory=dict)
    # compress.offload.DiskOffload when the recipe says `offload: disk`: blocks live on disk.
    offload: Any = None


class Stage(BaseModel):
    """Base of every stage: its pydantic fields are exactly the recipe keys."""

    model_config = ConfigDict(extra="forbid")

    @property
    def needs_calibration(self) -> bool:
        return False

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        """Compress `model` in place; return a summary for the report."""
        raise NotImplementedError  # every registered stage overrides this


class QuantArgsOverride(BaseModel):
    """Fields of a scheme's weights or input_activations to override; unset fields keep the preset."""

    model_config = ConfigDict(extra="forbid")

    num_bits: Optional[int] = Field(None, ge=2, le=8)
    type: Optional[Literal["int", "float"]] = None
    symmetric: Optional[bool] = None
    strategy: Optional[Literal["tensor", "channel", "group", "token"]] = None
    group_size: Optional[int] = Field(None, gt=0)
    dynamic: Optional[bool] = None


class QuantizationStage(Stage):
    """Keys shared by quantization stages (compressed-tensors names)."""

    scheme: Optional[str] = Field(None, description=f"preset: {', '.join(PRESETS)}")
    weights: Optional[QuantArgsOverride] = None
    input_activations: Optional[QuantArgsOverride] = None
    targets: list[str] = Field(default_factory=lambda: ["Linear"], description="module class names, names, or re: patterns")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="modules left in full precision")

    @model_validator(mode="after")
    def _scheme_resolves(self) -> "QuantizationStage":
        if self.scheme is not None and self.scheme.upper() not in PRESETS:
            raise ValueError(f"unknown scheme '{self.scheme}'; presets are {', '.join(PRESETS)}")
        if self.scheme is None and self.weights is None and self.input_activations is None:
            raise ValueError("set a scheme preset (e.g. W8A16) or weights settings")
        resolved = self.resolved_scheme()
        if resolved.weights is None:
            raise ValueError("the scheme quantizes no weights; add weights settings")
        return self

    def resolved_scheme(self) -> QuantScheme:
        dump = lambda o: o.model_dump(exclude_none=True) if o is not None else None  # noqa: E731
        return resolve_scheme(self.scheme, dump(self.weights), dump(self.input_activations))

    @property
    def needs_calibration(self) -> bool:
        return self.resolved_scheme().needs_calibration

    def model_dump(self, **kw):  # the effective recipe shows the resolved scheme too
        out = super().model_dump(**kw)
        out["resolved"] = self.resolved_scheme().model_dump(mode="json", exclude_none=True)
        return out
