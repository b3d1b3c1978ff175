"""Property-based tests of the quantization math (hypothesis): for any finite tensor, every bit
width, both schemes and every granularity, dequantization is within half a step, codes are in
range, and quantize-dequantize is idempotent; and defined behaviour on constant, zero, tiny, huge,
NaN and Inf inputs.

Examples are kept few (the file runs in seconds); hypothesis remembers failing cases locally."""

from __future__ import annotations

import math

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from compress.quant import (  # noqa: E402
    FP8_E4M3_MAX,
    _grouped,
    compute_qparams,
    dequantize,
    fake_quantize,
    fake_quantize_fp8,
    fp4_qparams,
    int_range,
    quantize,
    quantize_dequantize,
)

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
F32 = torch.finfo(torch.float32)

bits_st = st.integers(2, 8)
sym_st = st.booleans()
layout_st = st.sampled_from([("tensor", None), ("channel", None), ("token", None), ("group", 4), ("group", 5)])


@st.composite
def matrices(draw, magnitude=None):
    """A small [rows, cols] float32 tensor; values span from zero to `magnitude` (drawn if None)."""
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 12))
    scale = magnitude if magnitude is not None else draw(st.sampled_from([1e-30, 1e-6, 1.0, 1e3, 1e30]))
    values = draw(st.lists(st.floats(-1, 1, allow_nan=False, width=32), min_size=rows * cols, max_size=rows * cols))
    return torch.tensor(values, dtype=torch.float32).reshape(rows, cols) * scale


def codes_and_steps(x, bits, sym, strategy, group):
    qp = compute_qparams(x, bits, sym, strategy, group)
    view = _grouped(x, group)[0] if strategy == "group" else x
    codes = quantize(view, qp)
    return view, codes, qp


@SETTINGS
@given(x=matrices(), bits=bits_st, sym=sym_st, layout=layout_st)
def test_dequantization_error_within_half_a_step_and_codes_in_range(x, bits, sym, layout):
    strategy, group = layout
    view, codes, qp = codes_and_steps(x, bits, sym, strategy, group)
    qmin, qmax = int_range(bits, sym)
    assert torch.isfinite(qp.scale).all() and (qp.scale > 0).all()
    assert torch.equal(codes, codes.round())
    assert codes.min() >= qmin and codes.max() <= qmax
    err = (dequantize(codes, qp) - view).abs()
    step = qp.scale.expand_as(view)
    # half a step, plus the float32 rounding of x / step and of the product
    assert (err <= step * (0.5 + 1e-5) + F32.tiny).all(), float((err / step).max())


@SETTINGS
@given(x=matrices(), bits=bits_st, sym=sym_st, layout=layout_st)
def test_quantize_dequantize_is_idempotent(x, bits, sym, layout):
    strategy, group = layout
    once = fake_quantize(x, bits, sym, strategy, group)
    twice = fake_quantize(once, bits, sym, strategy, group)
    step = compute_qparams(x, bits, sym, strategy, group).scale.max()
    # the second pass may only move values by float rounding, never by a step
    assert torch.allclose(once, twice, rtol=1e-5, atol=float(step) * 1e-4), float((once - twice).abs().max())


@SETTINGS
@given(x=matrices(), bits=bits_st, sym=sym_st, layout=layout_st, fp4=st.booleans())
def test_quantize_dequantize_in_one_is_the_two_steps_bit_for_bit(x, bits, sym, layout, fp4):
    # GPTQ rounds each column with the fused quantize_dequantize, writing into its result buffer;
    # it must give exactly what quantize then dequantize give (also on the FP4 grid, whose steps
    # here come from NVFP4 block maxima).
    strategy, group = layout
    view, _, qp = codes_and_steps(x, bits, sym, strategy, group)
    if fp4:
        qp = fp4_qparams(view.abs().amax(-1, keepdim=True), global_scale=448.0 * 6.0 / max(float(x.abs().max()), 1e-30))
    expected = dequantize(quantize(view, qp), qp)
    assert torch.equal(quantize_dequantize(view, qp), expected)
    out = torch.full_like(view, float("nan"))
    assert quantize_dequantize(view, qp, out=out) is out and torch.equal(out, expected)
    assert torch.equal(view, codes_and_steps(x, bits, sym, strategy, group)[0])  # the input is left as it was


@SETTINGS
@given(bits=bits_st, sym=sym_st, layout=layout_st, value=st.sampled_from([0.0, 1.0, -3.5, 1e-20, 7e25]),
       rows=st.integers(1, 3), cols=st.integers(1, 9))
def test_constant_and_zero_inputs(bits, sym, layout, value, rows, cols):
    strategy, group = layout
    x = torch.full((rows, cols), value)
    out = fake_quantize(x, bits, sym, strategy, group)
    assert torch.isfinite(out).all()
    if value == 0.0:
        assert torch.equal(out, x)  # zero is always on the grid
    else:
        # a constant is the extreme of its own range: it lands on the grid's end
        assert torch.allclose(out, x, rtol=1e-5 if sym else 2 / (2**bits - 1))


@SETTINGS
@given(x=matrices(magnitude=F32.max * 0.9), bits=bits_st, sym=sym_st, layout=layout_st)
def test_huge_values_stay_finite(x, bits, sym, layout):
    """Near float32's maximum, max - min overflows; the step must not."""
    strategy, group = layout
    out = fake_quantize(x, bits, sym, strategy, group)
    assert torch.isfinite(out).all()
    view, codes, qp = codes_and_steps(x, bits, sym, strategy, group)
    assert torch.isfinite(qp.scale).all()
    err = (dequantize(codes, qp) - view).abs()
    assert (err <= qp.scale.expand_as(view) * (0.5 + 1e-5)).all(), float((err / qp.scale).max())  # half a step, as anywhere


@SETTINGS
@given(x=matrices(magnitude=1e-42), bits=bits_st, sym=sym_st, layout=layout_st)
def test_tiny_values(x, bits, sym, layout):
    """Subnormal ranges: the step is floored at the smallest normal float, so values that small
    round to a few codes (or zero) without overflowing x / step."""
    strategy, group = layout
    out = fake_quantize(x, bits, sym, strategy, group)
    assert torch.isfinite(out).all()
    assert ((out - x).abs() <= F32.tiny).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("strategy,group", [("tensor", None), ("channel", None), ("group", 4)])
@pytest.mark.parametrize("sym", [True, False])
def test_non_finite_values_pass_through_and_do_not_spoil_the_rest(bad, strategy, group, sym):
    """A NaN or Inf is left where it is (the stages report it with the layer name); the finite
    values around it are quantized exactly as without it."""
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    clean = fake_quantize(x, 4, sym, strategy, group)
    x_bad = x.clone()
    x_bad[1, 2] = bad
    out = fake_quantize(x_bad, 4, sym, strategy, group)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, 2] = False
    assert math.isnan(out[1, 2]) if math.isnan(bad) else out[1, 2] == bad
    if strategy == "tensor":  # the one range is the other values' range without x[1, 2]
        expected = fake_quantize(torch.where(mask, x, 0.0), 4, sym, strategy, group)
    else:
        expected = clean.clone()
        row = x.clone()
        row[1, 2] = 0.0
        expected[1] = fake_quantize(row, 4, sym, strategy, group)[1]
    assert torch.equal(out[mask], expected[mask])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fp8_non_finite_values_pass_through(bad):
    x = torch.linspace(-2, 2, 16).reshape(2, 8)
    x_bad = x.clone()
    x_bad[0, 3] = bad
    out = fake_quantize_fp8(x_bad, "channel")
    assert torch.equal(out[1], fake_quantize_fp8(x, "channel")[1])
    assert math.isnan(out[0, 3]) if math.isnan(bad) else out[0, 3] == bad
    zeroed = x.clone()
    zeroed[0, 3] = 0.0
    keep = torch.arange(8) != 3
    assert torch.equal(out[0, keep], fake_quantize_fp8(zeroed, "channel")[0, keep])


@SETTINGS
@given(x=matrices(), strategy=st.sampled_from(["tensor", "channel"]))
@example(x=torch.tensor([[1e-36]]), strategy="tensor")  # a subnormal step: found by CI's run
def test_fp8_within_its_relative_precision(x, strategy):
    out = fake_quantize_fp8(x, strategy)
    absmax = x.abs().amax(dim=-1, keepdim=True) if strategy == "channel" else x.abs().amax()
    assert torch.isfinite(out).all()
    assert (out.abs() <= absmax * (1 + 1e-6) + F32.tiny).all()
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 above its smallest normal (2^-6 of 448)
    normal = x.abs() >= absmax / FP8_E4M3_MAX * 2**-6
    assert ((out - x).abs()[normal] <= x.abs()[normal] * 2**-4 * (1 + 1e-5)).all()
