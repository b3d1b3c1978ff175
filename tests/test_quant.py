"""The quantization math alone: the course's worked examples, error bounds, code ranges."""

import pytest
import torch

from compress.schemes import QuantArgs

from compress.quant import (
    absmax_qparams,
    compute_qparams,
    dequantize,
    fake_quantize,
    fake_quantize_fp8,
    int_range,
    quantize,
    relative_error,
    zeropoint_qparams,
)


def test_absmax_worked_example():
    # max |X| = 3.2: 0.1 -> round(0.1 * 127 / 3.2) = 4 -> 4 * 3.2 / 127 = 0.1008
    qp = absmax_qparams(torch.tensor(3.2), bits=8)
    q = quantize(torch.tensor(0.1), qp)
    assert q.item() == 4
    assert dequantize(q, qp).item() == pytest.approx(0.1008, abs=5e-5)


def test_zeropoint_worked_example():
    # max 3.2, min -3.0: scale 255 / 6.2 = 41.13, zero-point -round(41.13 * -3.0) - 128 = -5, 0.1 -> -1
    qp = zeropoint_qparams(torch.tensor(-3.0), torch.tensor(3.2), bits=8)
    assert (1 / qp.scale).item() == pytest.approx(41.13, abs=5e-3)
    assert qp.zero_point.item() == -5
    assert quantize(torch.tensor(0.1), qp).item() == -1


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("strategy,group_size", [("tensor", None), ("channel", None), ("group", 16), ("group", 24)])
def test_error_within_half_step_and_codes_in_range(bits, symmetric, strategy, group_size):
    torch.manual_seed(bits)
    w = torch.randn(12, 64) * torch.rand(12, 1) * 3
    qp = compute_qparams(w, bits, symmetric, strategy, group_size)
    qmin, qmax = int_range(bits, symmetric)
    if strategy == "group":
        from compress.quant import _grouped

        grouped, _ = _grouped(w, group_size)
        codes = quantize(grouped, qp)
        err = (dequantize(codes, qp) - grouped).abs()
        step = qp.scale.expand_as(grouped)
    else:
        codes = quantize(w, qp)
        err = (dequantize(codes, qp) - w).abs()
        step = qp.scale.expand_as(w)
    assert codes.min() >= qmin and codes.max() <= qmax
    assert torch.equal(codes, codes.round())
    assert (err <= step / 2 + 1e-6).all()
    # quantize-dequantize is idempotent: values on the grid stay where they are
    once = fake_quantize(w, bits, symmetric, strategy, group_size)
    twice = fake_quantize(once, bits, symmetric, strategy, group_size)
    assert torch.allclose(once, twice, atol=1e-6)


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("strategy,group_size", [("tensor", None), ("channel", None), ("group", 16)])
def test_full_range_grid(bits, strategy, group_size):
    """full_range: all 2^b codes, [-2^(b-1), 2^(b-1)-1], step max|x| / (2^(b-1) - 0.5), error still
    within half a step (the positive extreme lands half a step short, the negative one on the end)."""
    torch.manual_seed(bits)
    w = torch.randn(12, 64) * torch.rand(12, 1) * 3
    qp = compute_qparams(w, bits, True, strategy, group_size, full_range=True)
    plain = compute_qparams(w, bits, True, strategy, group_size)
    assert (qp.qmin, qp.qmax) == (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    assert torch.allclose(qp.scale * (2 ** (bits - 1) - 0.5), plain.scale * (2 ** (bits - 1) - 1))
    q = fake_quantize(w, bits, True, strategy, group_size, full_range=True)
    step = qp.scale.expand(-1, -1, group_size).reshape(w.shape) if group_size else qp.scale.expand_as(w)
    codes = (q / step).round()
    assert codes.min() >= qp.qmin and codes.max() <= qp.qmax and torch.allclose(codes * step, q, atol=1e-6)
    assert (q - w).abs().le(step / 2 + 1e-6).all()
    if bits == 3 and strategy == "group":  # one level more is a finer step: clearly less error at 3 bits
        assert (q - w).pow(2).mean() < 0.85 * (fake_quantize(w, bits, True, strategy, group_size) - w).pow(2).mean()
    # a slice whose extreme is negative uses the extra code; a positive one ends at qmax
    assert bool((codes == qp.qmin).any()) if strategy != "tensor" else codes.min() == qp.qmin or codes.max() == qp.qmax
    with pytest.raises(ValueError, match="full_range"):
        QuantArgs(num_bits=bits, symmetric=False, full_range=True)


def test_finer_granularity_and_more_bits_lower_error():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.logspace(-1, 1, 64).unsqueeze(1)
    e = lambda **kw: relative_error(w, fake_quantize(w, **kw))  # noqa: E731
    assert e(bits=4, symmetric=True, strategy="group", group_size=32) < e(bits=4, symmetric=True, strategy="channel") < e(bits=4, symmetric=True, strategy="tensor")
    assert e(bits=8, symmetric=True, strategy="channel") < e(bits=4, symmetric=True, strategy="channel") / 10
    # zero-point uses the range better than absmax on a one-sided distribution
    pos = w.abs()
    assert relative_error(pos, fake_quantize(pos, 4, False, "channel")) < relative_error(pos, fake_quantize(pos, 4, True, "channel"))


def test_partial_last_group_matches_separate_quantization():
    torch.manual_seed(1)
    w = torch.randn(4, 70)  # 64 + a partial group of 6
    out = fake_quantize(w, 4, False, "group", 64)
    assert out.shape == w.shape
    assert torch.allclose(out[:, :64], fake_quantize(w[:, :64], 4, False, "channel"))
    assert torch.allclose(out[:, 64:], fake_quantize(w[:, 64:], 4, False, "channel"))


def test_zero_and_constant_inputs():
    z = torch.zeros(3, 8)
    for sym in (True, False):
        assert torch.equal(fake_quantize(z, 4, sym, "channel"), z)
    c = torch.full((2, 8), 0.37)
    assert torch.allclose(fake_quantize(c, 8, True, "channel"), c, atol=1e-6)
    assert torch.allclose(fake_quantize(c, 8, False, "channel"), c, atol=0.37 / 255)


def test_zero_stays_exactly_zero():
    w = torch.tensor([[0.0, 0.3, 1.7, 2.1, 0.0]])
    for sym in (True, False):
        out = fake_quantize(w, 3, sym, "tensor")
        assert out[0, 0] == 0 and out[0, 4] == 0


def test_fp8_rounds_to_e4m3():
    torch.manual_seed(2)
    w = torch.randn(16, 32)
    out = fake_quantize_fp8(w, "channel")
    rel = relative_error(w, out)
    assert 0 < rel < 0.05  # e4m3 has 3 mantissa bits: ~2^-4 relative spacing
    scale = w.abs().amax(-1, keepdim=True) / 448
    assert torch.equal((out / scale).to(torch.float8_e4m3fn).float() * scale, out)


def tile_absmax(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """max |x| of each rows x cols tile, edge tiles partial: [ceil(R/rows), ceil(C/cols)]."""
    return torch.stack([torch.stack([x[i:i + rows, j:j + cols].abs().max() for j in range(0, x.shape[1], cols)])
                        for i in range(0, x.shape[0], rows)])


def _e4m3_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Half of e4m3's spacing at each x: 3 mantissa bits give |x|/16 for normal values (|x| at
    least 2^-6 steps), and a subnormal step of 2^-9 below, both in units of the scale."""
    return torch.maximum(x.abs() / 16, scale * 2.0**-10) * (1 + 1e-6)


@pytest.mark.parametrize("rows, cols, tile", [(256, 384, (128, 128)), (100, 70, (32, 48)), (7, 9, (1, 4))])
def test_fp8_tiles_each_have_their_own_scale(rows, cols, tile):
    """FP8 block weights: within each tile (a partial one at the edges too) the largest |w| maps
    to 448 and every element is within half an e4m3 step at that tile's scale; a tile whose
    weights are 10^6 times smaller keeps its own resolution, where one scale per row puts them below
    e4m3's subnormals (a float format is scale-free only within its exponent range)."""
    torch.manual_seed(0)
    w = torch.randn(rows, cols)
    w[: tile[0], : tile[1]] *= 1e-6
    out = fake_quantize_fp8(w, "block", block_structure=list(tile))
    top = tile_absmax(w, *tile)
    scale = (top / 448).repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:rows, :cols]
    assert torch.allclose(tile_absmax(out, *tile), top, rtol=1e-6)
    assert ((out - w).abs() <= _e4m3_error_bound(w, scale)).all()
    assert torch.equal((out / scale).to(torch.float8_e4m3fn).float() * scale, out)  # on the tile's grid
    small = (slice(0, tile[0]), slice(0, tile[1]))
    per_channel = fake_quantize_fp8(w, "channel")
    assert relative_error(w[small], out[small]) < 0.05
    if cols > tile[1]:  # the row's other tiles set a per-channel scale 10^6 times too coarse for it
        assert relative_error(w[small], out[small]) < relative_error(w[small], per_channel[small]) / 2


def test_fp8_activation_groups_along_each_token():
    """Dynamic FP8 groups (FP8_BLOCK's activations): one scale per token per group_size features,
    so an outlier feature coarsens only its own group; the same rounding for any leading shape."""
    torch.manual_seed(1)
    x = torch.randn(3, 5, 256)
    x[..., 3] = 1e6  # an outlier in each token's first group, beyond e4m3's exponent range of the rest
    out = fake_quantize_fp8(x, "group", group_size=128)
    for g in range(2):
        part, expect = x[..., g * 128:(g + 1) * 128], out[..., g * 128:(g + 1) * 128]
        assert torch.equal(fake_quantize_fp8(part.reshape(-1, 128), "token").reshape(part.shape), expect)
    per_token = fake_quantize_fp8(x, "token")
    second = (..., slice(128, 256))
    assert relative_error(x[second], out[second]) < relative_error(x[second], per_token[second]) / 4
    assert torch.equal(fake_quantize_fp8(x.reshape(15, 256), "group", group_size=128), out.reshape(15, 256))
    assert torch.equal(fake_quantize_fp8(x[..., :200], "group", group_size=128)[..., 128:],  # a partial last group
                       fake_quantize_fp8(x[..., 128:200].reshape(-1, 72), "token").reshape(3, 5, 72))
    # a batch without tokens (an expert no token reaches) comes back empty, as per token does
    assert fake_quantize_fp8(torch.zeros(2, 0, 256), "group", group_size=128).shape == (2, 0, 256)
    assert fake_quantize(torch.zeros(0, 256), 4, True, "group", 64).shape == (0, 256)


def test_mxfp8_rounds_as_compressed_tensors():
    """MXFP8: blocks of 32 along each row, each at the power-of-two step compressed-tensors' own
    quantized forward takes (block maximum over 448 rounded up to a power of two, the next power
    from 1.75 times one): the same values bit for bit, edge blocks included; NaN stays, a batch
    without tokens comes back empty, and any leading shape rounds alike."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    from compress.quant import mx_steps

    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.logspace(-4, 3, 256)
    x[0, :32] = torch.tensor([448.0 * 2**-3] + [0.3] * 31)  # largest exactly 448 steps of 2^-3: the next power up
    x[0, 32:64] = torch.tensor([447.0 * 2**-3] + [0.3] * 31)  # just below: 2^-3, and 447 rounds to e4m3's 448
    x[1, 32:64] = 0.0
    x[2, 64:96] = torch.randn(32) * 1e-30  # steps far below float32's normal range
    args = ct.QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group", group_size=32, dynamic=True,
                               scale_dtype=torch.uint8, zp_dtype=torch.uint8)
    scale, zero = compute_dynamic_scales_and_zp(x, args, module=None)
    theirs = ct_fake_quantize(x=x, scale=scale, zero_point=zero, args=args)
    ours = fake_quantize_fp8(x, "group", group_size=32, power_of_two=True)
    assert torch.equal(ours, theirs)
    assert torch.equal(mx_steps(torch.tensor([448.0 * 2**-3, 447.0 * 2**-3]), 448.0), torch.tensor([2.0**-2, 2.0**-3]))
    # e4m3 keeps 3 mantissa bits (half an ulp: 1/16 of the value) down to its subnormals, spaced 2^-9 steps
    step = mx_steps(x.reshape(64, 8, 32).abs().amax(-1, keepdim=True), 448.0).expand(64, 8, 32).reshape(64, 256)
    assert ((ours - x).abs() <= torch.maximum(x.abs() / 16, step * 2**-10)).all()
    assert torch.equal(fake_quantize_fp8(x.reshape(4, 16, 256), "group", group_size=32, power_of_two=True).reshape(64, 256), ours)
    y = x.clone()
    y[3, 5] = float("nan")
    out = fake_quantize_fp8(y, "group", group_size=32, power_of_two=True)
    assert out[3, 5].isnan() and torch.equal(out[3, 32:], ours[3, 32:])
    assert fake_quantize_fp8(torch.zeros(2, 0, 256), "group", group_size=32, power_of_two=True).shape == (2, 0, 256)
    # float scales in groups of 32 (FP8_BLOCK's kind of groups) are another grid
    assert not torch.equal(fake_quantize_fp8(x, "group", group_size=32), ours)
    with pytest.raises(ValueError, match="MXFP8's, in groups of 32"):
        fake_quantize_fp8(x, "group", group_size=64, power_of_two=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp8_steps_recovered_exactly(dtype):
    """Packing recovers each MXFP8 block's power-of-two step from the weights alone and verifies
    the block bit for bit, in the model's dtype; weights off the grid fail, and an all-zero block
    takes step 1."""
    from compress.quant import recover_mx_steps

    torch.manual_seed(0)
    W = (torch.randn(16, 128) * torch.logspace(-3, 1, 128)).to(dtype)
    W[0, :32] = torch.tensor([447.0 * 2**-3] + [0.3] * 31).to(dtype)  # its extreme rounds up to 448 steps
    W[1, 32:64] = 0
    Q = fake_quantize_fp8(W.float(), "group", group_size=32, power_of_two=True).to(dtype)
    steps, failed = recover_mx_steps(Q, 8)
    assert failed == 0 and steps.shape == (16, 4)
    assert float(steps[1, 1]) == 1.0
    assert torch.equal(torch.frexp(steps)[0], torch.full_like(steps, 0.5))  # powers of two
    codes = Q.float().reshape(16, 4, 32) / steps[..., None]
    assert codes.abs().max() <= 448
    assert torch.equal((codes.to(torch.float8_e4m3fn).float() * steps[..., None]).reshape(16, 128).to(dtype), Q)
    off = W.clone()
    off[2, :32] = torch.linspace(0.1, 0.2, 32).to(dtype)  # 32 values no single step holds on e4m3
    assert recover_mx_steps(off, 8)[1] >= 1


def test_mxfp6_rounds_as_compressed_tensors():
    """MXFP6: FP6 e2m3 elements (ties to even, saturating at 7.5) in blocks of 32 at the step
    compressed-tensors' rule gives e2m3 (block maximum rounded to a power of two from 1.9375 times
    one, over 4): the library's own values bit for bit; packing recovers every block's step."""
    pytest.importorskip("compressed_tensors.quantization")
    import compressed_tensors.quantization as ct
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
    from compressed_tensors.quantization.utils.fp6_utils import cast_to_fp6
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    from compress.quant import MXFP6_LIMIT, fake_quantize_mx, mx_steps, recover_mx_steps, round_to_fp6

    torch.manual_seed(0)
    x = torch.cat([torch.randn(100000) * 3, torch.tensor([7.49, 7.5, 7.6, 7.74, 7.76, 100.0, -7.8, 1.9375, 3.875,
                                                           0.0625, 0.1875, -0.0625, 0.0, 1e-30])])
    assert torch.equal(round_to_fp6(x), cast_to_fp6(x))  # ties to even (0.0625 -> 0, 0.1875 -> 0.25, 3.875 -> 4)
    assert set(round_to_fp6(torch.linspace(0, 8, 10001)).unique().tolist()) == \
        {m / 8 for m in range(8)} | {(1 + m / 8) * 2**e for e in range(3) for m in range(8)}  # e2m3's 32 magnitudes
    m = torch.rand(10000) * 10.0 ** torch.randint(-6, 6, (10000,)).float()
    assert torch.equal(torch.log2(mx_steps(m, MXFP6_LIMIT)) + 127, generate_mx_scales(m, 6))
    W = torch.randn(64, 256) * torch.logspace(-3, 1, 256)
    W[0, :32] = torch.tensor([7.7 * 2**-3] + [0.1] * 31)  # its extreme between 7.5 and 7.75 steps: saturates
    args = ct.QuantizationArgs(num_bits=6, type="float", symmetric=True, strategy="group", group_size=32,
                               scale_dtype=torch.uint8, zp_dtype=torch.uint8)
    scale = torch.exp2(generate_mx_scales(W.reshape(64, 8, 32).abs().amax(-1), 6) - 127)
    Q = fake_quantize_mx(W, 6)
    assert torch.equal(Q, ct_fake_quantize(x=W, scale=scale, zero_point=torch.zeros_like(scale), args=args))
    assert float(Q[0, 0]) == 7.5 * 2**-3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        steps, failed = recover_mx_steps(Q.to(dtype), 6)
        assert failed == 0 and torch.equal(steps, scale), dtype
    assert recover_mx_steps(W, 6)[1] > 0  # weights off the grid


def test_bits_out_of_range_refused():
    with pytest.raises(ValueError):
        int_range(1, True)
    with pytest.raises(ValueError):
        int_range(9, False)
