"""Quantization schemes: what a layer's weights and input activations are rounded to.

Field names and preset names follow compressed-tensors, so a recipe reads the same as one written
for llm-compressor and vLLM:

    scheme: W4A16            # a preset ...
    weights:                 # ... with any field overridden
      group_size: 64
      symmetric: false
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_serializer, model_validator

from compress.quant import MXFP4_GROUP, MXFP8_GROUP, NVFP4_GROUP


MAX_GROUP_SIZE = 2**17


class QuantArgs(BaseModel):
    """How one tensor (a weight, or a layer's input activations) is quantized."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_bits: int = Field(8, strict=True, description="bit width: 2..8 for int; for float 8 (FP8 e4m3), 6 (FP6 e2m3: MXFP6) "
                          "or 4 (FP4 e2m1: NVFP4, MXFP4)")
    type: Literal["int", "float"] = "int"
    symmetric: bool = Field(True, description="true: absmax; false: zero-point (asymmetric)")
    strategy: Literal["tensor", "channel", "group", "tensor_group", "block", "token"] = Field(
        "channel", description="tensor_group: NVFP4's blocks of 16 with e4m3 scales under one per-tensor scale; "
                               "block: FP8 weights with one scale per tile of block_structure (rows, columns); "
                               "group with type float: FP4 in blocks of 32 is MXFP4, FP8 in groups of 32 with "
                               "scale_dtype e8m0 MXFP8")
    # A group wider than any layer is one group per row (strategy channel); the bound keeps an
    # absurd value from padding every row to it (1e9 columns) or overflowing torch's pad.
    group_size: Optional[int] = Field(None, strict=True, le=MAX_GROUP_SIZE, description="columns per scale when strategy is group")
    block_structure: Optional[list[StrictInt]] = Field(None, description="strategy block: [rows, columns] of a weight tile "
                                                 "sharing one scale ([128, 128] in FP8_BLOCK)")
    scale_dtype: Optional[Literal["e8m0"]] = Field(
        None, description="e8m0: power-of-two scales stored as one-byte exponents, as the MX formats store them (FP8 "
                          "with strategy group and group_size 32 is then MXFP8; MXFP4's are e8m0 already); default: "
                          "float scales")
    dynamic: bool = Field(False, description="activations: ranges from each input (true) or from calibration (false)")
    full_range: bool = Field(False, description="symmetric int: all 2^b codes, [-2^(b-1), 2^(b-1)-1], step max|x|/(2^(b-1)-0.5) "
                             "(compressed-tensors' grid); false: absmax, codes symmetric about 0")

    @model_validator(mode="after")
    def _consistent(self) -> "QuantArgs":
        if self.type == "int" and not 2 <= self.num_bits <= 8:
            raise ValueError(f"num_bits must be between 2 and 8 for int quantization, got {self.num_bits}")
        if self.type == "float":
            if self.num_bits not in (4, 6, 8):
                raise ValueError("float quantization is FP8 (e4m3, num_bits 8), FP6 (e2m3, num_bits 6: MXFP6) or FP4 "
                                 "(e2m1, num_bits 4)")
            if self.num_bits == 6 and (self.strategy != "group" or self.group_size != MXFP8_GROUP):
                raise ValueError(f"FP6 comes in MXFP6's blocks: strategy group, group_size {MXFP8_GROUP} (power-of-two scales)")
            if not self.symmetric:
                raise ValueError(f"FP{self.num_bits} quantization is symmetric: set symmetric: true")
            if self.num_bits == 8 and self.strategy == "tensor_group":
                raise ValueError("FP8 supports tensor, channel, block and token strategies, and group (MXFP8, or dynamic "
                                 "activations), not tensor_group")
            if self.num_bits == 4 and self.strategy == "tensor_group" and self.group_size != NVFP4_GROUP:
                raise ValueError(f"NVFP4 (strategy tensor_group) has blocks of {NVFP4_GROUP}: set group_size: {NVFP4_GROUP}")
            if self.num_bits == 4 and self.strategy == "group" and self.group_size != MXFP4_GROUP:
                raise ValueError(f"MXFP4 (float 4-bit, strategy group) has blocks of {MXFP4_GROUP}: set group_size: {MXFP4_GROUP}, "
                                 f"or strategy tensor_group with group_size {NVFP4_GROUP} for NVFP4")
            if self.num_bits == 4 and self.strategy not in ("group", "tensor_group"):
                raise ValueError("FP4 quantizes in blocks: strategy tensor_group (NVFP4, group_size 16) or group (MXFP4, group_size 32)")
        elif self.strategy == "tensor_group":
            raise ValueError("strategy tensor_group is NVFP4's: set type: float and num_bits: 4 (or use strategy group)")
        if self.strategy == "block":
            if self.type != "float" or self.num_bits != 8:
                raise ValueError("strategy block (tiles of block_structure) is for FP8 weights: type float, num_bits 8")
            if self.block_structure is None:
                raise ValueError("strategy block needs block_structure: [rows, columns] of a tile, e.g. [128, 128]")
        if self.block_structure is not None:
            if self.strategy != "block":
                raise ValueError(f"block_structure is set but strategy is {self.strategy!r}: set strategy: block")
            if len(self.block_structure) != 2 or any(not 0 < n <= MAX_GROUP_SIZE for n in self.block_structure):
                raise ValueError(f"block_structure must be two positive integers [rows, columns] of at most "
                                 f"{MAX_GROUP_SIZE}, got {self.block_structure}")
        if self.scale_dtype == "e8m0":
            if self.type != "float" or self.strategy != "group" or self.num_bits != 8 and self.group_size != MXFP4_GROUP:
                raise ValueError("scale_dtype e8m0 (power-of-two scales) is the MX formats': type float, strategy group, "
                                 f"group_size {MXFP8_GROUP} (MXFP8, MXFP6, MXFP4)")
            if self.group_size != MXFP8_GROUP:
                raise ValueError(f"MXFP8 (FP8 with scale_dtype e8m0) has blocks of {MXFP8_GROUP}: set group_size: {MXFP8_GROUP}")
        if self.full_range and (self.type != "int" or not self.symmetric):
            raise ValueError("full_range is for symmetric int quantization (zero-point already uses all 2^b codes)")
        if self.strategy in ("group", "tensor_group"):
            if self.group_size is None:
                raise ValueError("strategy group needs group_size (e.g. 64 or 128)")
            if self.group_size <= 0:
                raise ValueError(f"group_size must be positive, got {self.group_size}")
        elif self.group_size is not None:
            # A group size implies grouping; accept it as the user's intent only when unambiguous.
            if self.group_size <= 0:
                raise ValueError(f"group_size must be positive, got {self.group_size}")
            raise ValueError(f"group_size is set but strategy is {self.strategy!r}: set strategy: group")
        return self

    @model_serializer(mode="wrap")
    def _tiles_only_when_set(self, handler):
        # Records (compress.json, report.json) of every other scheme stay as they were, which
        # compress before block_structure and scale_dtype existed can still read.
        out = handler(self)
        for key in ("block_structure", "scale_dtype"):
            if isinstance(out, dict) and out.get(key) is None:
                out.pop(key, None)
        return out

    @property
    def fp4_format(self) -> str | None:
        """"nvfp4" or "mxfp4" for FP4 weights or activations, else None."""
        return fp4_format(self.model_dump())

    @property
    def column_groups(self) -> int | None:
        """Input columns per scale: group_size (groups, FP4 blocks), a tile's width (FP8 tiles), or
        None where one scale spans every column (channel, tensor, token)."""
        if self.strategy in ("group", "tensor_group"):
            return self.group_size
        return self.block_structure[1] if self.strategy == "block" else None

    @property
    def mxfp8(self) -> bool:
        """FP8 in groups of 32 with power-of-two (e8m0) scales: MXFP8."""
        return is_mxfp8(self.model_dump())

    @property
    def byte_block_scales(self) -> bool:
        """One 8-bit scale per block (e4m3 or e8m0): FP4, MXFP6 and MXFP8."""
        return bool(self.fp4_format or mx_format(self.model_dump()))

    def describe(self) -> str:
        if self.fp4_format:
            return f"{self.fp4_format} g{self.group_size}" + (" dynamic" if self.dynamic else "")
        if mx_format(self.model_dump()):
            return f"{mx_format(self.model_dump())} g{self.group_size}" + (" dynamic" if self.dynamic else "")
        kind = f"{'fp' if self.type == 'float' else 'int'}{self.num_bits}"
        gran = f"g{self.group_size}" if self.strategy == "group" else f"per-{self.strategy}"
        if self.strategy == "block":
            gran = "block {}x{}".format(*self.block_structure)
        sym = symmetry_label(self.symmetric, self.full_range)
        dyn = "" if not self.dynamic else " dynamic"
        return f"{kind} {gran} {sym}{dyn}"


def symmetry_label(symmetric: bool, full_range: bool = False) -> str:
    """How reports name a grid: sym (absmax), sym full (all 2^b codes) or asym (zero-point)."""
    return ("sym full" if full_range else "sym") if symmetric else "asym"


def fp4_format(args: dict) -> str | None:
    """"nvfp4" or "mxfp4" for QuantArgs fields (as a layer record holds them) of an FP4 grid, else
    None: the strategy tells the block formats apart (tensor_group is NVFP4's)."""
    if args.get("type") != "float" or args.get("num_bits") != 4:
        return None
    return "nvfp4" if args.get("strategy") == "tensor_group" else "mxfp4"


def mx_format(args: dict) -> str | None:
    """"mxfp8" or "mxfp6" for QuantArgs fields (as a layer record holds them) of those MX formats,
    else None (MXFP4 is fp4_format's)."""
    if is_mxfp8(args):
        return "mxfp8"
    return "mxfp6" if args.get("type") == "float" and args.get("num_bits") == 6 else None


def is_mxfp8(args: dict) -> bool:
    """QuantArgs fields (as a layer record holds them) of MXFP8: FP8 in groups of 32 whose scales
    are powers of two, stored as e8m0 exponents. Other FP8 groups (FP8_BLOCK's activations) have
    float scales."""
    return args.get("type") == "float" and args.get("num_bits") == 8 and args.get("scale_dtype") == "e8m0"


def weights_label(w: dict | None) -> str:
    """A layer record's weights (QuantArgs as dumped) for report tables: `int4 group g64 sym`,
    `float8 channel sym`, `nvfp4 g16`; `-` for none."""
    if not w:
        return "-"
    if fp4_format(w):
        return f"{fp4_format(w)} g{w.get('group_size')}"
    if mx_format(w):
        return f"{mx_format(w)} g{w.get('group_size')}"
    group = f" g{w['group_size']}" if w.get("group_size") else ""
    if w.get("block_structure"):
        group = " {}x{}".format(*w["block_structure"])
    return f"{w.get('type', 'int')}{w.get('num_bits')} {w.get('strategy')}{group} {symmetry_label(w.get('symmetric'), w.get('full_range', False))}"


def activations_label(a: dict | None) -> str:
    """A layer record's input activations for report tables: `int8 token dynamic`,
    `float8 group g128 dynamic`, `int4 token full dynamic` (all 2^b codes), `int8 tensor static`;
    `-` for none."""
    if not a:
        return "-"
    if is_mxfp8(a):
        return f"mxfp8 g{a['group_size']} {'dynamic' if a.get('dynamic') else 'static'}"
    group = f" g{a['group_size']}" if a.get("group_size") else ""
    full = " full" if a.get("full_range") else ""
    return f"{a['type']}{a['num_bits']} {a['strategy']}{group}{full} {'dynamic' if a.get('dynamic') else 'static'}"


def _w(bits: int, strategy: str = "channel", group_size: int | None = None, symmetric: bool = True, type: str = "int"):
    return dict(num_bits=bits, type=type, symmetric=symmetric, strategy=strategy, group_size=group_size)


def _a(bits: int = 8, strategy: str = "token", dynamic: bool = True, type: str = "int", group_size: int | None = None):
    return dict(num_bits=bits, type=type, symmetric=True, strategy=strategy, dynamic=dynamic, group_size=group_size)


# The compressed-tensors preset names. Each maps to weights and (optionally) input activations.
PRESETS: dict[str, dict] = {
    "W8A16": {"weights": _w(8)},
    "W4A16": {"weights": _w(4, "group", 128)},
    "W4A16_ASYM": {"weights": _w(4, "group", 128, symmetric=False)},
    "W8A8": {"weights": _w(8), "input_activations": _a()},
    "INT8": {"weights": _w(8), "input_activations": _a()},
    "W4A8": {"weights": _w(4, "group", 128), "input_activations": _a()},
    # the other integer widths, as compressed-tensors names them: weights in groups of 128, and
    # int8 (A8) or int4 (A4) activations per token, or FP8 ones (W4AFP8)
    **{f"W{b}A16": {"weights": _w(b, "group", 128)} for b in (2, 3, 5, 6, 7)},
    **{f"W{b}A8": {"weights": _w(b, "group", 128), "input_activations": _a()} for b in (2, 3, 5, 6, 7)},
    # int4 inputs: the reader compress can check is compressed-tensors' own emulation, which
    # rounds each token on all 16 codes (step max|x| / 7.5); int8 ones follow vLLM's /127
    **{f"W{b}A4": {"weights": _w(b, "group", 128), "input_activations": _a(4)} for b in (2, 3, 4)},  # full range: resolve_scheme
    "W4AFP8": {"weights": _w(4, "group", 128), "input_activations": _a(8, "token", True, "float")},
    "FP8": {"weights": _w(8, "tensor", type="float"), "input_activations": _a(8, "tensor", False, "float")},
    "FP8_DYNAMIC": {"weights": _w(8, "channel", type="float"), "input_activations": _a(8, "token", True, "float")},
    # DeepSeek-V3's FP8: a scale per 128x128 weight tile, and per token per 128 input channels
    "FP8_BLOCK": {"weights": {**_w(8, "block", type="float"), "block_structure": [128, 128]},
                  "input_activations": _a(8, "group", True, "float", 128)},
    "NVFP4A16": {"weights": _w(4, "tensor_group", NVFP4_GROUP, type="float")},
    "MXFP4A16": {"weights": _w(4, "group", MXFP4_GROUP, type="float")},
    # W4A4: activations in the same blocks, along each token; NVFP4's block scales are computed
    # from each input and its global scale is calibrated, MXFP4's scales are all dynamic
    "NVFP4": {"weights": _w(4, "tensor_group", NVFP4_GROUP, type="float"),
              "input_activations": _a(4, "tensor_group", False, "float", NVFP4_GROUP)},
    "MXFP4": {"weights": _w(4, "group", MXFP4_GROUP, type="float"),
              "input_activations": _a(4, "group", True, "float", MXFP4_GROUP)},
    # MXFP4 weights under FP8 activations per token per 128 features (float scales, as FP8_BLOCK's)
    "MXFP4XFP8": {"weights": _w(4, "group", MXFP4_GROUP, type="float"),
                  "input_activations": _a(8, "group", True, "float", 128)},
    # MXFP8: FP8 in blocks of 32 with power-of-two (e8m0) scales, the activations' per token
    "MXFP8A16": {"weights": {**_w(8, "group", MXFP8_GROUP, type="float"), "scale_dtype": "e8m0"}},
    # MXFP6: FP6 e2m3 weights in the same blocks; MXFP6A8 rounds the inputs as MXFP8 does
    "MXFP6A16": {"weights": _w(6, "group", MXFP8_GROUP, type="float")},
    "MXFP6A8": {"weights": _w(6, "group", MXFP8_GROUP, type="float"),
                "input_activations": {**_a(8, "group", True, "float", MXFP8_GROUP), "scale_dtype": "e8m0"}},
    "MXFP8": {"weights": {**_w(8, "group", MXFP8_GROUP, type="float"), "scale_dtype": "e8m0"},
              "input_activations": {**_a(8, "group", True, "float", MXFP8_GROUP), "scale_dtype": "e8m0"}},
}


class QuantScheme(BaseModel):
    """A preset plus overrides, resolved into the weights and activations arguments."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    weights: Optional[QuantArgs] = None
    input_activations: Optional[QuantArgs] = None

    @model_validator(mode="after")
    def _activations_are_per_token_or_tensor(self) -> "QuantScheme":
        w, a = self.weights, self.input_activations
        # weights are rounded once, from themselves: no tokens and no per-input ranges
        if w is not None and w.strategy == "token":
            raise ValueError("weights have no tokens: strategy token is for input_activations; use channel, group or tensor")
        if a is not None and a.type == "float" and a.num_bits == 6:
            raise ValueError("FP6 is for weights (MXFP6); MXFP6A8 rounds the inputs to MXFP8 (num_bits 8, scale_dtype e8m0)")
        if w is not None and w.type == "float" and w.num_bits == 8 and w.strategy == "group" and not w.mxfp8:
            raise ValueError(f"FP8 weights take one scale per tensor, channel, block (strategy block with block_structure, "
                             f"e.g. [128, 128]) or power-of-two one per group of {MXFP8_GROUP} (MXFP8: scale_dtype e8m0), "
                             f"not a float one per group")
        if w is not None and w.dynamic:
            raise ValueError("weights are quantized once, from the weights themselves: dynamic is for input_activations; "
                             "drop weights.dynamic")
        if a is not None and a.fp4_format == "nvfp4" and a.dynamic:
            raise ValueError("NVFP4 activations have block scales from each input under a global scale calibrated once: "
                             "set dynamic: false")
        if a is not None and a.fp4_format == "mxfp4" and not a.dynamic:
            raise ValueError("MXFP4 activations take their block scales from each input: set dynamic: true")
        if a is not None and a.strategy == "block":
            raise ValueError("input_activations have no weight tiles: strategy block is for weights; FP8 activations "
                             "take strategy group (dynamic, per token per group_size channels), token or tensor")
        if a is not None and a.strategy == "group" and not a.fp4_format and not (a.type == "float" and a.dynamic):
            raise ValueError("input_activations strategy group is for dynamic FP8 (type float, num_bits 8, dynamic: true) "
                             "or FP4 blocks; integer activations are per token (dynamic) or per tensor")
        if a is not None and not a.fp4_format and a.strategy not in ("token", "tensor", "group"):
            raise ValueError("input_activations strategy must be token (dynamic) or tensor, group (dynamic FP8), "
                             "or FP4 blocks (type float, num_bits 4)")
        if a is not None and a.strategy == "token" and not a.dynamic:
            raise ValueError("per-token activation quantization is dynamic: set dynamic: true")
        if a is not None and a.dynamic and a.full_range and a.type == "int" and a.num_bits == 8:
            # nothing in the checkpoint carries it: vLLM's dynamic int8 kernels divide by 127
            raise ValueError("full_range applies to static activation scales (stored as input_scale); dynamic int8 "
                             "scales are absmax / 127 in vLLM: drop input_activations.full_range")
        return self

    @property
    def needs_calibration(self) -> bool:
        return self.input_activations is not None and not self.input_activations.dynamic

    def describe(self) -> str:
        w = self.weights.describe() if self.weights else "none"
        a = self.input_activations.describe() if self.input_activations else "none"
        return f"W[{w}] A[{a}]"


def inputs_on_the_librarys_grid(kind: str, dynamic: bool, num_bits: int, symmetric: bool) -> bool:
    """Dynamic symmetric int inputs narrower than 8 bits: compressed-tensors' emulation, the reader
    compress can check, rounds them on all 2^b codes (full_range), so compress does too unless a
    recipe says otherwise (and then the output is dense); int8 ones follow vLLM's /127."""
    return bool(kind == "int" and dynamic is True and symmetric and num_bits < 8)


def resolve_scheme(preset: str | None, weights: dict | None, input_activations: dict | None) -> QuantScheme:
    """Merge a preset's fields with per-field overrides from the recipe."""
    base: dict = {}
    if preset is not None:
        key = preset.upper()
        if key not in PRESETS:
            raise ValueError(f"unknown scheme {preset!r}; presets are {', '.join(PRESETS)}")
        base = {k: dict(v) for k, v in PRESETS[key].items()}
    merged = {}
    for part, override in (("weights", weights), ("input_activations", input_activations)):
        fields = dict(base.get(part) or {})
        if override:
            # Switching strategy away from group must drop the preset's group size.
            if override.get("strategy", "group") not in ("group", "tensor_group") and "group_size" not in override:
                fields.pop("group_size", None)
            # ... and away from block, its tiles; tiles alone name the strategy
            if override.get("strategy", "block") != "block" and "block_structure" not in override:
                fields.pop("block_structure", None)
            if "block_structure" in override and "strategy" not in override and override["block_structure"] is not None:
                fields["strategy"] = "block"
                fields.pop("group_size", None)
            if ("group_size" in override and "strategy" not in override and override["group_size"] is not None
                    and fields.get("strategy") != "tensor_group"):  # NVFP4's blocks stay NVFP4's
                fields["strategy"] = "group"
                if "block_structure" not in override:
                    fields.pop("block_structure", None)
            mx = bool(fields.get("scale_dtype") == "e8m0" or fp4_format(fields) == "mxfp4" or mx_format(fields))
            fields.update(override)
            if "scale_dtype" not in override:
                # The MX formats' power-of-two scales stay with their float groups, whatever the
                # element width (as the library's presets carry their uint8 scale dtype: MXFP4 with
                # num_bits 8 is MXFP8); another strategy or type leaves them behind.
                fields.pop("scale_dtype", None)
                if mx and fields.get("type") == "float" and fields.get("strategy") == "group" and fields.get("num_bits") == 8:
                    fields["scale_dtype"] = "e8m0"
            elif fields.get("scale_dtype") == "float":  # said outright: float scales, QuantArgs' default
                fields.pop("scale_dtype")
                if fields.get("type") == "float" and fields.get("num_bits") in (4, 6) and fields.get("strategy") == "group":
                    raise ValueError("MXFP4 and MXFP6 blocks have power-of-two (e8m0) scales: drop scale_dtype: float "
                                     "(NVFP4 has e4m3 block scales: strategy tensor_group, group_size 16)")
        if fields:
            if fields.get("strategy") not in ("group", "tensor_group") and fields.get("group_size") is None:
                fields.pop("group_size", None)
            if part == "input_activations" and "full_range" not in (override or {}) and inputs_on_the_librarys_grid(
                    fields.get("type", "int"), bool(fields.get("dynamic")), fields.get("num_bits", 8), fields.get("symmetric", True)):
                fields["full_range"] = True
            merged[part] = fields
    return QuantScheme.model_validate(merged)


def packed_weight_bits(out_features: int, in_features: int, args: QuantArgs, scale_bits: int = 16) -> int:
    """Storage of one quantized weight once packed: codes at num_bits, scales in the model's dtype
    (`scale_bits`: 16 for float16/bfloat16 models, 32 for float32 ones), and zero-points at
    num_bits when asymmetric (the compressed-tensors layout); FP4, MXFP6 and MXFP8 have 8-bit block scales
    (e4m3 or e8m0), and NVFP4 one float32 global scale."""
    if args.byte_block_scales:
        blocks = out_features * -(-in_features // args.group_size)
        return out_features * in_features * args.num_bits + blocks * 8 + (32 if args.fp4_format == "nvfp4" else 0)
    if args.strategy == "group":
        n_scales = out_features * -(-in_features // args.group_size)
    elif args.strategy == "channel":
        n_scales = out_features
    elif args.strategy == "block":
        n_scales = -(-out_features // args.block_structure[0]) * -(-in_features // args.block_structure[1])
    else:
        n_scales = 1
    zp_bits = 0 if args.symmetric else args.num_bits
    return out_features * in_features * args.num_bits + n_scales * (scale_bits + zp_bits)


def scale_bits_of(dtype) -> int:
    """The width scales are stored at for a model of `dtype` (a torch dtype or its name)."""
    return 16 if str(dtype).removeprefix("torch.") in ("float16", "bfloat16") else 32
