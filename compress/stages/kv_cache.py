"""FP8 KV cache: the keys and values each attention layer stores, in float8 e4m3 with one static
scale per layer for keys and one for values, as vLLM's `kv_cache_dtype=fp8` computes with them.

    k_scale = max |K| / 448,  v_scale = max |V| / 448    over the calibration set, keys after RoPE
    K_stored = cast_e4m3(K / k_scale) · k_scale          (and V alike), every forward

Halving the cache's bytes doubles the tokens a GPU's memory holds at long context. The scales
come from the model as the recipe leaves it at this point, so put this stage after the weight
quantization stages. The evaluated model rounds its keys and values the same way, so the report's
KL and perplexity include the cache's error; the packed checkpoint carries `k_scale` and
`v_scale` per attention layer and `kv_cache_scheme` in its quantization_config.

Sample recipe stage (it has no keys of its own: FP8 e4m3, per tensor, static):

    - kv_cache: {}
"""

from __future__ import annotations

import torch

from compress import activations
from compress.engine import on_device
from compress.errors import CompressError
from compress.quant import FP8_E4M3_MAX
from compress.stages.base import Stage, StageContext


class KVCache(Stage):
    """Calibrate FP8 scales for every attention layer's keys and values, and round them so."""

    @property
    def needs_calibration(self) -> bool:
        return True

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        from compress.modeling import is_causal_lm

        if not is_causal_lm(model.config):
            raise CompressError(f"kv_cache: {type(model).__name__} is an encoder, which keeps no KV cache",
                                "drop the kv_cache stage for this model")
        modules = activations.attention_modules(model)
        if not modules:
            raise CompressError(f"kv_cache: no attention layer of {type(model).__name__} takes a cache argument "
                                f"({', '.join(activations.CACHE_ARGUMENTS)}) to hand its keys and values to",
                                "drop the kv_cache stage, or upgrade transformers if this model's attention is older")
        if ctx.offload is not None:
            raise CompressError("kv_cache: calibrating the cache runs the whole model at once, which offload: disk avoids",
                                "drop offload: disk, or drop the kv_cache stage")
        ctx.progress("kv_cache: observing keys and values", 0, 1)
        with on_device(model, ctx.device):
            ranges = activations.observe_kv(model, modules, ctx.calibration.samples, ctx.device)
        for name, module in modules.items():
            activations.attach_kv(module, *ranges[name])
        ctx.kv_cache = {"scheme": dict(activations.KV_SCHEME), "ranges": {n: list(r) for n, r in ranges.items()}}
        ctx.progress("kv_cache", 1, 1)
        return {
            "attention_layers": len(modules),
            "scheme": "fp8 e4m3 per-tensor static (keys, values)",
            "max_k_scale": max(k for k, _ in ranges.values()) / FP8_E4M3_MAX,
            "max_v_scale": max(v for _, v in ranges.values()) / FP8_E4M3_MAX,
        }
