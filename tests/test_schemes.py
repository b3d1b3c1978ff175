"""Scheme presets (compressed-tensors names) and their overrides."""

import pytest
from pydantic import ValidationError

from compress.schemes import PRESETS, QuantArgs, packed_weight_bits, resolve_scheme


def test_presets_match_compressed_tensors_names():
    assert {"W4A16", "W8A16", "W8A8", "FP8_DYNAMIC", "W4A16_ASYM", "FP8", "W4A8"} <= set(PRESETS)
    s = resolve_scheme("W4A16", None, None)
    assert (s.weights.num_bits, s.weights.strategy, s.weights.group_size, s.weights.symmetric) == (4, "group", 128, True)
    assert s.input_activations is None
    s = resolve_scheme("W8A8", None, None)
    assert s.input_activations.dynamic and s.input_activations.strategy == "token"
    assert not s.needs_calibration


def test_every_preset_is_the_one_compressed_tensors_names_so():
    """A recipe written for llm-compressor names compressed-tensors' presets: each one compress
    has resolves to the library's own fields, but W8A16, per output channel here (README:
    Recipes) where compressed-tensors 0.20 has groups of 128; the one it lacks is UNQUANTIZED
    (nothing quantized)."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    def fields(args):
        if args is None:
            return None
        value = lambda v: str(getattr(v, "value", v))  # noqa: E731 (the library's enums)
        return (args.num_bits, value(args.type), args.symmetric, value(args.strategy), args.group_size,
                args.block_structure, args.dynamic)

    assert set(PRESET_SCHEMES) - set(PRESETS) == {"UNQUANTIZED"}
    for name in PRESETS:
        ours, theirs = resolve_scheme(name, None, None), PRESET_SCHEMES[name]
        if name == "W8A16":
            ours = resolve_scheme(name, {"group_size": 128}, None)
        assert fields(ours.weights) == fields(theirs.get("weights")), name
        # NVFP4's activations are dynamic 'local' in the library: block scales per input under a calibrated global scale
        expected = fields(theirs.get("input_activations"))
        if name == "NVFP4":
            expected = (*expected[:-1], False)
        assert fields(ours.input_activations) == expected, name


def test_every_field_overridable():
    s = resolve_scheme("W4A16", {"group_size": 64, "symmetric": False}, None)
    assert (s.weights.group_size, s.weights.symmetric) == (64, False)
    s = resolve_scheme("W4A16", {"strategy": "channel"}, None)
    assert s.weights.strategy == "channel" and s.weights.group_size is None
    s = resolve_scheme("W8A16", {"group_size": 32}, None)
    assert s.weights.strategy == "group" and s.weights.group_size == 32
    s = resolve_scheme("W8A8", None, {"strategy": "tensor", "dynamic": False})
    assert s.needs_calibration
    s = resolve_scheme(None, {"num_bits": 3, "strategy": "group", "group_size": 64}, None)
    assert s.weights.num_bits == 3


@pytest.mark.parametrize("fields", [
    {"num_bits": 9}, {"num_bits": 0}, {"num_bits": 1},
    {"strategy": "group"},  # no group size
    {"strategy": "group", "group_size": -4},
    {"strategy": "channel", "group_size": 64},
    {"type": "float", "num_bits": 4},
    {"type": "float", "strategy": "tensor_group", "group_size": 16, "num_bits": 8},
    {"type": "float", "strategy": "block"},  # no tiles
    {"strategy": "block", "block_structure": [128, 128]},  # int: groups, not tiles
    {"type": "float", "strategy": "block", "block_structure": [128]},
    {"type": "float", "strategy": "block", "block_structure": [0, 128]},
    {"type": "float", "strategy": "block", "block_structure": [128.0, 128]},
    {"type": "float", "strategy": "channel", "block_structure": [128, 128]},
])
def test_invalid_args_refused(fields):
    with pytest.raises(ValidationError):
        QuantArgs(**fields)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown scheme"):
        resolve_scheme("W5A5", None, None)


def test_packed_bits():
    # 4-bit codes, one 16-bit scale per 64 weights: 4.25 bits per weight
    assert packed_weight_bits(128, 256, QuantArgs(num_bits=4, strategy="group", group_size=64)) / (128 * 256) == pytest.approx(4.25)
    # asymmetric adds a 4-bit zero-point per group
    assert packed_weight_bits(128, 256, QuantArgs(num_bits=4, strategy="group", group_size=64, symmetric=False)) / (128 * 256) == pytest.approx(4 + 20 / 64)
    # MXFP8: float8 codes and one byte (an e8m0 exponent) per block of 32, whatever the model's dtype
    mx = resolve_scheme("MXFP8A16", None, None).weights
    assert packed_weight_bits(128, 256, mx, scale_bits=32) == 128 * 256 * 8 + 128 * 8 * 8


def test_fp8_block_preset_and_its_overrides():
    """FP8_BLOCK as compressed-tensors defines it: FP8 weights in 128x128 tiles, dynamic FP8
    activations per token per 128 features; tiles alone select the strategy, and leaving it drops them."""
    from compressed_tensors.quantization import preset_name_to_scheme

    s = resolve_scheme("FP8_BLOCK", None, None)
    theirs = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    for ours, ref in ((s.weights, theirs.weights), (s.input_activations, theirs.input_activations)):
        assert (ours.num_bits, ours.type, ours.strategy, ours.group_size, ours.block_structure, ours.dynamic) == \
            (ref.num_bits, str(getattr(ref.type, "value", ref.type)), str(getattr(ref.strategy, "value", ref.strategy)),
             ref.group_size, ref.block_structure, ref.dynamic)
    assert not s.needs_calibration and s.describe() == "W[fp8 block 128x128 sym] A[fp8 g128 sym dynamic]"
    assert resolve_scheme("FP8_DYNAMIC", {"block_structure": [64, 32]}, None).weights.strategy == "block"
    assert resolve_scheme("FP8_BLOCK", {"strategy": "channel"}, None).weights.block_structure is None
    assert packed_weight_bits(300, 256, s.weights, scale_bits=16) == 300 * 256 * 8 + 3 * 2 * 16  # a partial row of tiles


def test_records_name_tiles_only_where_there_are_some():
    """A record of any other scheme is what compress wrote before tiles existed (which that
    compress still reads); FP8 tiles are recorded with their shape."""
    assert "block_structure" not in resolve_scheme("W4A16", None, None).weights.model_dump(mode="json")
    assert resolve_scheme("FP8_BLOCK", None, None).weights.model_dump(mode="json")["block_structure"] == [128, 128]


def test_int4_inputs_take_the_librarys_full_grid():
    """compressed-tensors' emulation, the reader of int4 activations compress can check, rounds
    them on all 16 codes, so the A4 presets do, and full_range is allowed there; int8 ones stay
    on vLLM's /127."""
    for name in ("W2A4", "W3A4", "W4A4"):
        assert resolve_scheme(name, None, None).input_activations.full_range
    assert resolve_scheme("W4A8", None, {"num_bits": 4}).input_activations.full_range
    assert not resolve_scheme("W4A8", None, None).input_activations.full_range
    assert not resolve_scheme("W4A4", None, {"full_range": False}).input_activations.full_range
    with pytest.raises(ValueError, match="dynamic int8 scales are absmax / 127 in vLLM"):
        resolve_scheme("W8A8", None, {"full_range": True})


def test_mxfp8_is_fp8_groups_of_32_with_e8m0_scales():
    """MXFP8 is named by its scales, as compressed-tensors names it (scale_dtype): FP8 groups of 32
    with float scales stay FP8_BLOCK's kind of activation groups, and power-of-two scales come
    only in the MX formats' blocks."""
    mx = resolve_scheme("MXFP8", None, None)
    assert mx.weights.mxfp8 and mx.input_activations.mxfp8
    assert (mx.weights.describe(), mx.input_activations.describe()) == ("mxfp8 g32", "mxfp8 g32 dynamic")
    floats = resolve_scheme("FP8_BLOCK", None, {"group_size": 32}).input_activations
    assert not floats.mxfp8 and floats.describe() == "fp8 g32 sym dynamic"
    assert "scale_dtype" not in floats.model_dump()  # records of other schemes stay as they were
    with pytest.raises(ValueError, match="FP8 weights take one scale per tensor"):
        resolve_scheme("MXFP8A16", {"scale_dtype": "float"}, None)
    assert resolve_scheme("MXFP8", {"strategy": "channel"}, {"strategy": "token"}).describe() == \
        resolve_scheme("FP8_DYNAMIC", None, None).describe()  # another strategy leaves the MX scales behind
    assert not resolve_scheme("MXFP8", None, {"scale_dtype": "float"}).input_activations.mxfp8
    with pytest.raises(ValueError, match="MXFP8 .* has blocks of 32"):
        resolve_scheme("MXFP8A16", {"group_size": 64}, None)
    assert resolve_scheme("MXFP6A8", None, None).describe() == "W[mxfp6 g32] A[mxfp8 g32 dynamic]"
    with pytest.raises(ValueError, match="FP6 is for weights"):
        resolve_scheme("MXFP8", None, {"num_bits": 6})
    with pytest.raises(ValueError, match="FP6 comes in MXFP6's blocks"):
        resolve_scheme("MXFP6A16", {"group_size": 64}, None)
    for fields in ({"scale_dtype": "e8m0"}, {"type": "float", "strategy": "channel", "scale_dtype": "e8m0"},
                   {"type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16, "scale_dtype": "e8m0"}):
        with pytest.raises(ValidationError, match="scale_dtype e8m0"):
            QuantArgs(**fields)
    # the MX scales follow the element width as the library's presets carry their scale dtype,
    # and leave with the groups (tiles alone name strategy block)
    assert resolve_scheme("MXFP4", None, {"num_bits": 8}).input_activations.mxfp8
    assert resolve_scheme("MXFP6A16", {"num_bits": 8}, None).weights.mxfp8
    assert resolve_scheme("MXFP8A16", {"block_structure": [32, 32]}, None).describe() == "W[fp8 block 32x32 sym] A[none]"
    assert resolve_scheme("MXFP8A16", {"num_bits": 4}, None).weights.fp4_format == "mxfp4"
    with pytest.raises(ValueError, match="MXFP4 and MXFP6 blocks have power-of-two"):
        resolve_scheme("MXFP4A16", {"scale_dtype": "float"}, None)


@pytest.mark.parametrize("weights, activations, says", [
    ({"strategy": "group", "group_size": 128}, None, "FP8 weights take one scale per tensor, channel, block .* or power-of-two "
                                                     r"one per group of 32 \(MXFP8: scale_dtype e8m0\)"),
    ({"group_size": 64}, None, "FP8 weights take one scale per tensor, channel, block"),  # the preset's tiles go
    (None, {"strategy": "block", "block_structure": [1, 128]}, "input_activations have no weight tiles"),
    (None, {"dynamic": False}, "strategy group is for dynamic FP8"),
])
def test_fp8_block_misuse_refused(weights, activations, says):
    with pytest.raises(ValueError, match=says):
        resolve_scheme("FP8_BLOCK", weights, activations)
    with pytest.raises(ValueError, match="strategy group is for dynamic FP8"):
        resolve_scheme("W8A8", None, {"strategy": "group", "group_size": 128})
