"""What every stage shares: the context it runs in, target selection, and the quantization keys
(scheme presets, overrides, targets and ignore) common to every quantization algorithm. The
pruning keys are in compress/stages/pruning.py."""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from compress.errors import CompressError
from compress.schemes import MAX_GROUP_SIZE, PRESETS, QuantScheme, resolve_scheme
from compress.targets import Pattern


INPUT_MODEL = " (input model)"  # a record's `stage` suffix: what the input model came with (inherited_records)


def from_input(record: dict) -> bool:
    """Whether a layer record describes what the input model came with, rather than this run's work."""
    return str(record.get("stage", "")).endswith(INPUT_MODEL)


def done_by(record: dict) -> str:
    """Who left a layer as its record says, for messages: the input model, or an earlier stage."""
    return "the input model" if from_input(record) else "an earlier stage"


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
    # The kv_cache stage's {"scheme": ..., "ranges": {attention layer: [max |K|, max |V|]}}.
    kv_cache: Optional[dict] = None
    # compress.offload.DiskOffload when the recipe says `offload: disk`: blocks live on disk.
    offload: Any = None
    # What training stages need besides: the input model (the default teacher) and its hash,
    # the tokenizer (training text), where to keep resumable checkpoints, and whether to resume.
    tokenizer: Any = None
    source_model: Optional[str] = None
    source_hash: Optional[str] = None
    work_dir: Optional[Any] = None  # pathlib.Path
    resume: bool = False
    stage_index: int = 0
    stop_after_steps: Optional[int] = None  # a training stage stops as if killed (resume tests)
    # Every compute device given (`--device cuda:0,cuda:1`); `device` is the first. Blocks run on
    # `device`; the per-layer solves of GPTQ and SparseGPT are spread over all of them.
    devices: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.devices:
            self.devices = [self.device]


class Stage(BaseModel):
    """Base of every stage: its pydantic fields are exactly the recipe keys."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @property
    def needs_calibration(self) -> bool:
        return False

    def preflight(self, model: torch.nn.Module) -> None:
        """Refuse (CompressError) what the stage would refuse of this architecture, from its config,
        module names and shapes alone (a model on the meta device serves): the run checks every
        stage so before the first one starts, not hours later when this one does, and
        `compress plan` says so. The model is as stages see it: mixture-of-experts unfused."""

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        """Compress `model` in place; return a summary for the report."""
        raise NotImplementedError  # every registered stage overrides this


class EngineOptions(BaseModel):
    """Keys of every stage that runs through the layer-by-layer calibration engine."""

    batch_size: Union[Literal["auto"], int] = Field(
        "auto", description="calibration samples per forward pass; auto: up to 1024 tokens per forward on CPU, "
        "4096 on a GPU (samples of different lengths padded, the padding left out of every statistic; one "
        "sample per forward in mixture-of-experts models when lengths differ)")
    activations_on: Literal["auto", "device", "cpu"] = Field("auto", description="where cached block inputs live")
    activation_budget: Optional[Union[int, str]] = Field(
        "auto", description="host bytes for cached activations before spilling to disk, e.g. 4GiB; auto: half the memory available at start")
    blocks: Optional[str] = Field(None, description="dotted path of the transformer layers, for architectures the engine does not know")

    @field_validator("batch_size", mode="before")
    @classmethod
    def _positive_batch(cls, value):
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"batch_size must be a positive number of samples, or auto (got {value!r})")
        return value

    @field_validator("activation_budget", mode="before")
    @classmethod
    def _budget_is_a_size(cls, value):  # before pydantic's coercion, which reads true as 1
        parse_bytes(value)
        return int(value) if isinstance(value, float) else value

    @property
    def needs_calibration(self) -> bool:
        return True  # the engine runs calibration samples through every block

    def preflight(self, model: torch.nn.Module) -> None:
        from compress.engine import find_blocks

        find_blocks(model, self.blocks)  # an architecture the engine does not know, or a wrong `blocks:`

    def engine(self, ctx: StageContext):
        from compress.engine import Engine

        return Engine(ctx.device, batch_size=self.batch_size, activations_on=self.activations_on,
                      activation_budget=parse_bytes(self.activation_budget), blocks_path=self.blocks,
                      progress=ctx.progress, offload=ctx.offload)


def check_weight(name: str, W: torch.Tensor) -> None:
    """Every stage refuses a damaged input weight by the layer's name, before computing with it."""
    if not torch.isfinite(W).all():
        raise CompressError(f"layer {name}: weight holds NaN or Inf", "the input model is damaged; check its source")


def parse_bytes(value: Union[int, str, None]) -> Optional[int]:
    """`4GiB`, `512MB`, `1000000` -> bytes; `auto` -> half of MemAvailable (unbounded if unknown)."""
    if isinstance(value, float) and value.is_integer() and value >= 0:  # 4e9 in YAML or Python: a whole number of bytes
        value = int(value)
    if isinstance(value, bool) or (isinstance(value, int) and value < 0):
        raise ValueError(f"activation_budget {value!r} is not a size such as 4GiB or 512MB (0: keep none in memory)")
    if value is None or isinstance(value, int):
        return value
    if not isinstance(value, str):
        raise ValueError(f"activation_budget {value!r} is not a size such as 4GiB or 512MB")
    if value.strip().lower() == "auto":
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024 // 2
        except OSError:
            pass
        return None
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}
    text = value.strip().lower().replace(" ", "")
    for unit, factor in units.items():
        if text.endswith(unit):
            try:
                number = float(text[: -len(unit)])
            except ValueError:
                break
            if not math.isfinite(number) or number < 0:  # inf overflowed int(), a negative size meant nothing
                break
            return int(number * factor)
    raise ValueError(f"activation_budget {value!r} is not a size such as 4GiB or 512MB")


def select_targets(model: torch.nn.Module, targets: list[str], ignore: list[str], stage_name: str) -> dict[str, torch.nn.Module]:
    """A stage's target layers, in model order; none at all is a recipe mistake, not a no-op."""
    from compress.targets import select_modules

    modules = select_modules(model, targets, ignore)
    if not modules:
        raise CompressError(f"stage {stage_name}: targets {targets} minus ignore {ignore} match no linear layer",
                            "run `compress plan` to see the model's module names")
    return modules


class QuantArgsOverride(BaseModel):
    """Fields of a scheme's weights or input_activations to override; unset fields keep the preset."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # strict: a YAML true or false is not a width (lax pydantic reads it as 1 or 0)
    num_bits: Optional[int] = Field(None, ge=2, le=8, strict=True,
                                    description="bits per value (int: 2 to 8; float: 8 is FP8 e4m3, 6 FP6 e2m3 (MXFP6), 4 FP4 e2m1)")
    type: Optional[Literal["int", "float"]] = Field(None, description="integer grid or floating point (FP8, FP6, FP4)")
    symmetric: Optional[bool] = Field(None, description="true: absmax, codes symmetric about zero; false: zero-point")
    strategy: Optional[Literal["tensor", "channel", "group", "tensor_group", "block", "token"]] = Field(
        None, description="one scale per tensor, output channel, group of input columns, group under a tensor-wide "
                          "scale (NVFP4), weight tile (FP8 block), or token (activations)")
    group_size: Optional[int] = Field(None, gt=0, le=MAX_GROUP_SIZE, strict=True,
                                      description="input columns per scale (strategy group or tensor_group)")
    block_structure: Optional[list[StrictInt]] = Field(None, description="strategy block: [rows, columns] of a weight tile sharing one scale")
    dynamic: Optional[bool] = Field(None, description="activations: scales computed at run time (true) or from calibration (false)")
    full_range: Optional[bool] = Field(None, description="symmetric int: use all 2^b codes ([-8, 7] at 4 bits), as compressed-tensors does")
    scale_dtype: Optional[Literal["e8m0", "float"]] = Field(
        None, description="e8m0: power-of-two scales stored as one-byte exponents (MXFP8: FP8, strategy group, group_size 32; "
                          "MXFP6 and MXFP4 have them already); float: float scales")


class QuantizationStage(Stage):
    """Keys shared by quantization stages (compressed-tensors names)."""

    scheme: Optional[str] = Field(None, description=f"preset: {', '.join(PRESETS)}")
    weights: Optional[QuantArgsOverride] = Field(None, description="the preset's weight quantization, with these fields overridden")
    input_activations: Optional[QuantArgsOverride] = Field(
        None, description="the preset's input activation quantization, with these fields overridden")
    targets: list[Pattern] = Field(default_factory=lambda: ["Linear"], description="module class names, names, or re: patterns")
    ignore: list[Pattern] = Field(default_factory=lambda: ["lm_head"], description="modules left in full precision")
    resolved: Optional[dict] = Field(None, description="written by compress into the saved recipe: the scheme as resolved; ignored on input")

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

    def select(self, model: torch.nn.Module, stage_name: str) -> dict[str, torch.nn.Module]:
        return select_targets(model, self.targets, self.ignore, stage_name)

    def resolved_scheme(self) -> QuantScheme:
        dump = lambda o: o.model_dump(exclude_none=True) if o is not None else None  # noqa: E731
        return resolve_scheme(self.scheme, dump(self.weights), dump(self.input_activations))

    @property
    def needs_calibration(self) -> bool:
        return self.resolved_scheme().needs_calibration

    def model_dump(self, **kw):  # the effective recipe shows the resolved scheme too
        out = super().model_dump(**kw)
        for part in ("weights", "input_activations"):  # unset overrides would read as explicit nulls
            if isinstance(out.get(part), dict):
                out[part] = {k: v for k, v in out[part].items() if v is not None} or None
        out["resolved"] = self.resolved_scheme().model_dump(mode="json", exclude_none=True)
        return out
