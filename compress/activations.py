"""Activation fake-quantization: the inputs of quantized layers rounded at run time, so that the
evaluated model really computes with A8 (or FP8, FP4) inputs; and the KV cache, keys and values
rounded to FP8 as an attention layer stores them.

Dynamic (per-token) ranges come from each input; static (per-tensor) ranges are observed on the
calibration set first and then frozen. The hooks are plain forward pre-hooks; the ranges are saved
with the checkpoint so that `compress eval` reattaches them when it loads the model.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from compress.quant import (FP8_E4M3_MAX, QParams, absmax_qparams, fake_quantize, fake_quantize_fp4,
                            fake_quantize_fp8, nvfp4_input_global_scale, scales_stored_as, zeropoint_qparams)
from compress.schemes import QuantArgs

HOOK_ATTR = "_compress_activation_hook"


def tensor_version(t: torch.Tensor) -> int | None:
    """t's in-place modification counter; None for a tensor made under torch.inference_mode, which
    has none (so nothing that needs it may be reused: we cannot tell whether it changed)."""
    return None if t.is_inference() else t._version


class LastInput:
    """What a hook made of the last tensor it was given, to be reused when the next call gets the
    same tensor unchanged: the same object (held weakly; the entry goes with it) at the same
    version, under an equal `key`. Tensors without a version counter are never remembered."""

    def __init__(self):
        self._entry: tuple | None = None  # (weak reference, version, key, value)

    def get(self, x: torch.Tensor, key):
        version, entry = tensor_version(x), self._entry
        if version is None or entry is None or entry[0]() is not x or entry[1] != version or entry[2] != key:
            return None
        return entry[3]

    def put(self, x: torch.Tensor, key, value) -> None:
        version = tensor_version(x)
        if version is not None:
            self._entry = (weakref.ref(x, self._forget), version, key, value)

    def _forget(self, reference: weakref.ref) -> None:
        if self._entry is not None and self._entry[0] is reference:
            self._entry = None


class ActivationFakeQuant:
    """Forward pre-hook that fake-quantizes a linear layer's input."""

    def __init__(self, args: QuantArgs, static_range: tuple[float, float] | None = None,
                 static_qparams: QParams | None = None):
        self.args = args
        self.static_range = static_range
        # A checkpoint written by another tool gives its scale (and zero point) rather than a range;
        # they are used as given, since tools differ in how they derive them (compressed-tensors
        # divides an absmax by 127.5 and keeps code -128).
        self.static_qparams = static_qparams
        if not args.dynamic and static_range is None and static_qparams is None:
            raise ValueError("static activation quantization needs a range observed on calibration data")
        # What makes two hooks round alike; another tool's scales count by identity (the entry
        # holds the object, so its id is not reused while it could match).
        self._key = (args.model_dump_json(), static_range, id(static_qparams))

    # Layers fed the same tensor (q/k/v, gate/up) under the same scheme and range round it to the
    # same values: the last rounding is kept, so the fed tensor is rounded once, as an engine that
    # fuses those layers into one matrix product does. Not while gradients flow to the input: a
    # graph is not shared across calls.
    _last = LastInput()  # value: (static_qparams, rounded input, its version)

    def __call__(self, module: torch.nn.Module, inputs: tuple) -> tuple:
        x = inputs[0]
        reuse = not (x.requires_grad and torch.is_grad_enabled())
        kept = self._last.get(x, self._key) if reuse else None
        if kept is not None and kept[2] == tensor_version(kept[1]):
            return (kept[1], *inputs[1:])
        # activation scales stay float32 (as saved, and as evaluated), also when a stage's
        # calibration forward runs under a half-precision model's weight-scale rounding
        with scales_stored_as(torch.float32):
            out = self._fake_quantize(inputs)
        if reuse:
            self._last.put(x, self._key, (self.static_qparams, out[0], tensor_version(out[0])))
        return out

    def rounded(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as this hook rounds it, without the reuse of __call__ (QAT's straight-through input)."""
        with scales_stored_as(torch.float32):
            return self._fake_quantize((x,))[0]

    def _fake_quantize(self, inputs: tuple) -> tuple:
        x = inputs[0]
        flat = x.reshape(-1, x.shape[-1])
        a = self.args
        if a.fp4_format:
            # blocks of consecutive features along each token; NVFP4's global scale from the range
            g = None
            if a.fp4_format == "nvfp4":
                g = nvfp4_input_global_scale(max(abs(self.static_range[0]), abs(self.static_range[1])))
            out = fake_quantize_fp4(flat, a.group_size, g, activations=True)
        elif a.type == "float":
            absmax = None
            if not a.dynamic and self.static_qparams is not None:
                absmax = self.static_qparams.scale.to(x.device) * FP8_E4M3_MAX
            elif not a.dynamic:
                absmax = torch.tensor(max(abs(self.static_range[0]), abs(self.static_range[1])), device=x.device)
            out = fake_quantize_fp8(flat, a.strategy, absmax, group_size=a.group_size, power_of_two=a.mxfp8)
        else:
            qparams = self.static_qparams
            if qparams is not None:
                qparams = QParams(qparams.scale.to(x.device), qparams.zero_point.to(x.device), qparams.qmin, qparams.qmax)
            if not a.dynamic and qparams is None:
                lo, hi = self.static_range
                if a.symmetric:
                    qparams = absmax_qparams(torch.tensor(max(abs(lo), abs(hi)), device=x.device), a.num_bits, a.full_range)
                    # step max|x| / 127, but inputs beyond the calibrated range clamp to the whole
                    # integer range, -128 included, as compressed-tensors and vLLM's int8 kernels do
                    # with the stored input_scale (and as a reloaded checkpoint does: packing.py)
                    qparams = QParams(qparams.scale, qparams.zero_point, -(2 ** (a.num_bits - 1)), qparams.qmax)
                else:
                    qparams = zeropoint_qparams(torch.tensor(lo, device=x.device), torch.tensor(hi, device=x.device), a.num_bits)
            out = fake_quantize(flat, a.num_bits, a.symmetric, a.strategy, qparams=qparams, full_range=a.full_range)
        if x.dtype in (torch.float16, torch.bfloat16):
            # an MXFP8 block's extreme can round up past float16's largest value (64000 -> 65536):
            # saturate there, as a half-precision tensor holds it, rather than turn it into Inf
            largest = torch.finfo(x.dtype).max
            out = out.clamp(-largest, largest)
        return (out.to(x.dtype).reshape(x.shape), *inputs[1:])


def attach(module: torch.nn.Module, args: QuantArgs, static_range: tuple[float, float] | None = None,
           static_qparams: QParams | None = None) -> None:
    detach(module)
    hook = ActivationFakeQuant(args, static_range, static_qparams)
    handle = module.register_forward_pre_hook(hook)
    handle.fake_quant = hook
    setattr(module, HOOK_ATTR, handle)


def detach(module: torch.nn.Module) -> None:
    _remove_hook(module, HOOK_ATTR)


def _remove_hook(module: torch.nn.Module, attr: str) -> None:
    handle = getattr(module, attr, None)
    if handle is not None:
        handle.remove()
        delattr(module, attr)


def attached_inputs(model: torch.nn.Module) -> dict[str, dict]:
    """The input quantization attached to `model`'s layers by compress (a compress checkpoint
    loaded with it), as the stages record it: a later run on such a model evaluates with it, so it
    records it too. (Hooks holding another tool's scales rather than a range are left out: compress
    would write them back differently.)"""
    records = {}
    for name, module in model.named_modules():
        handle = getattr(module, HOOK_ATTR, None)
        hook = getattr(handle, "fake_quant", None)
        if hook is None or hook.static_qparams is not None:
            continue
        records[name] = {"input_activations": hook.args.model_dump(mode="json")}
        if hook.static_range is not None:
            records[name]["activation_range"] = list(hook.static_range)
    return records


def reattach(model: torch.nn.Module, layers: dict, kv_cache: dict | None = None) -> None:
    """Attach again what a run's records say (compress.json, the stage cache): each layer's input
    quantization with its static range, and the KV cache's."""
    modules = dict(model.named_modules())
    for name, rec in layers.items():
        if "input_activations" in rec and name in modules:
            rng = rec.get("activation_range")
            attach(modules[name], QuantArgs(**rec["input_activations"]), tuple(rng) if rng else None)
    for name, (key_max, value_max) in (kv_cache or {}).get("ranges", {}).items():
        if name in modules:
            attach_kv(modules[name], key_max, value_max)



# ---------------------------------------------------------------------------------------------
# The KV cache: keys (after RoPE) and values as an attention layer stores them


KV_HOOK_ATTR = "_compress_kv_hook"
KV_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}  # FP8 e4m3


# What transformers' attention layers call the cache they hand their keys and values to (update()):
# transformers 5.24 on, 4.56 to 5.23, older releases, and GPT-NeoX, GPT-J, Falcon and Bloom.
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _cache_argument(module: torch.nn.Module) -> str | None:
    parameters = inspect.signature(module.forward).parameters
    return next((name for name in CACHE_ARGUMENTS if name in parameters), None)


def attention_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The attention layers whose keys and values a KV cache holds: the `...Attention` modules
    that take a cache argument (CACHE_ARGUMENTS) and hand it their keys and values."""
    return {name: m for name, m in model.named_modules()
            if type(m).__name__.endswith("Attention") and _cache_argument(m) is not None}


class _CacheStandIn:
    """Takes the place of an attention layer's cache argument (`cache`, `past_key_values`) for one forward: its update()
    receives exactly the keys and values a cache would store, passes them through `process`
    (observe, or round to FP8), then on to the real cache if there is one."""

    def __init__(self, process, cache):
        self.process, self.cache = process, cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        key_states, value_states = self.process(key_states, value_states)
        if self.cache is not None:
            return self.cache.update(key_states, value_states, *args, **kwargs)
        return key_states, value_states

    def __getattr__(self, name: str):
        cache = self.__dict__.get("cache")
        if cache is None:
            raise AttributeError(name)
        return getattr(cache, name)


def kv_pre_hook(process):
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict):
        name = _cache_argument(module)
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        bound.arguments[name] = _CacheStandIn(process, bound.arguments.get(name))
        return bound.args, bound.kwargs
    return hook


def _fp8_static(x: torch.Tensor, absmax: float) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    return fake_quantize_fp8(flat, "tensor", torch.tensor(absmax, device=x.device)).to(x.dtype).reshape(x.shape)


def attach_kv(module: torch.nn.Module, key_absmax: float, value_absmax: float) -> None:
    """Round the layer's keys and values to FP8 e4m3 with per-tensor static scales absmax / 448
    (what vLLM's fp8 KV cache computes with, from `k_scale` and `v_scale`)."""
    detach_kv(module)
    handle = module.register_forward_pre_hook(
        kv_pre_hook(lambda k, v: (_fp8_static(k, key_absmax), _fp8_static(v, value_absmax))), with_kwargs=True)
    handle.kv_ranges = (key_absmax, value_absmax)
    setattr(module, KV_HOOK_ATTR, handle)


def detach_kv(module: torch.nn.Module) -> None:
    _remove_hook(module, KV_HOOK_ATTR)


def attached_kv(model: torch.nn.Module) -> dict | None:
    """The KV cache rounding attached to `model` (a compress or other tool's checkpoint loaded with
    it), as the kv_cache stage records it; None when there is none. A later run on such a model
    evaluates with it, so it writes it out too."""
    ranges = {name: list(getattr(m, KV_HOOK_ATTR).kv_ranges) for name, m in model.named_modules() if hasattr(m, KV_HOOK_ATTR)}
    return {"scheme": dict(KV_SCHEME), "ranges": ranges} if ranges else None
