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
    {"type": "float", "strategy": "group", "group_size": 64},
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
