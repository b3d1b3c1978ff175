"""FP8 KV cache: the keys and values each attention layer stores, in float8 e4m3 with one static
scale per layer for keys and one for values, as vLLM's `kv_cache_dtype=fp8` computes with them.

    k_scale = max |K| / 448,  v_scale = max |V| / 448    over the calibration set, keys after RoPE
    K_stored = cast_e4m3(K / k_scale) · k_scale          (and V alike), every forward

Halving the cache's bytes doubles the tokens a GPU's memory holds at long context. The scales
come from the model as the recipe leaves it at this point, so this stage is the recipe's last
(a recipe with a stage after it is refused). They are observed through the calibration engine, one block on the device
at a time. The evaluated model rounds its keys and values the same way, so the report's
KL and perplexity include the cache's error; the packed checkpoint carries `k_scale` and
`v_scale` per attention layer and `kv_cache_scheme` in its quantization_config.

Sample recipe stage (it has no keys of its own: FP8 e4m3, per tensor, static):

    - kv_cache: {}
"""

from __future__ import annotations

import torch

from compress import activations
from compress.engine import observe_layers
from compress.errors import CompressError
from compress.quant import FP8_E4M3_MAX
from compress.stages.base import Stage, StageContext


class KVObserver:
    """max |key| and max |value| an attention layer stores over the calibration tokens, padding
    excluded. The keys and values exist only inside the layer's forward: a pre-hook puts a stand-in
    for its cache argument that keeps their largest magnitude at each position, and `add` (called
    after the forward, with the batch's mask) takes the maxima over the tokens that count.
    `done` (the block calibrated) and `close` remove the pre-hook."""

    def __init__(self, name: str, module: torch.nn.Module):
        self.name, self.key_absmax, self.value_absmax = name, 0.0, 0.0
        self._last: tuple | None = None
        self._handle = module.register_forward_pre_hook(activations.kv_pre_hook(self._keep), with_kwargs=True)

    def _keep(self, key: torch.Tensor, value: torch.Tensor):
        # [batch, heads, tokens, head_dim] -> [batch, tokens]: all `add` needs, a head_dim·heads-th of it
        self._last = tuple(x.detach().abs().amax(dim=(1, 3)).float() for x in (key, value))
        return key, value

    def add(self, inputs: tuple, output, mask: torch.Tensor | None) -> None:
        if self._last is None:
            return
        tops = []
        for x in self._last:
            if mask is not None and x.shape == mask.shape:
                x = x[mask.to(x.device).bool()]
            top = float(x.max()) if x.numel() else 0.0
            if top != top or top == float("inf"):
                raise CompressError(f"layer {self.name}: non-finite keys or values (NaN/Inf, or float16 overflow)",
                                    "check the model's weights, or load it in float32 (--dtype float32)")
            tops.append(top)
        self._last = None
        self.key_absmax, self.value_absmax = max(self.key_absmax, tops[0]), max(self.value_absmax, tops[1])

    def done(self) -> None:
        self._handle.remove()
        self._last = None

    close = done  # removing a removed hook is harmless


def observe_kv(model: torch.nn.Module, ctx: StageContext, modules: dict[str, torch.nn.Module]
               ) -> tuple[dict[str, tuple[float, float]], dict]:
    """(max |K|, max |V|) of each attention layer in `modules` over the calibration set, through the
    calibration engine (one block on the device at a time), and the engine's summary."""
    made: list[KVObserver] = []

    def observe(name: str, module: torch.nn.Module) -> KVObserver:
        made.append(KVObserver(name, module))
        return made[-1]

    try:
        observers, calibration = observe_layers(model, ctx, modules, observe)
    finally:
        for observer in made:
            observer.close()
    return {name: (obs.key_absmax, obs.value_absmax) for name, obs in observers.items()}, calibration


class KVCache(Stage):
    """Calibrate FP8 scales for every attention layer's keys and values, and round them so."""

    @property
    def needs_calibration(self) -> bool:
        return True

    def preflight(self, model: torch.nn.Module) -> None:
        self._attention(model)

    @staticmethod
    def _attention(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """The attention layers whose cache this stage calibrates, or why the model has none."""
        from compress.modeling import is_causal_lm

        if not is_causal_lm(model.config):
            raise CompressError(f"kv_cache: {type(model).__name__} is an encoder, which keeps no KV cache",
                                "drop the kv_cache stage for this model")
        modules = activations.attention_modules(model)
        if not modules:
            raise CompressError(f"kv_cache: no attention layer of {type(model).__name__} takes a cache argument "
                                f"({', '.join(activations.CACHE_ARGUMENTS)}) to hand its keys and values to",
                                "drop the kv_cache stage, or upgrade transformers if this model's attention is older")
        return modules

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        modules = self._attention(model)
        if ctx.offload is not None:
            raise CompressError("kv_cache: offload: disk runs one block-by-block stage that compresses weights, and "
                                "this stage compresses none", "drop offload: disk, or drop the kv_cache stage")
        ranges, calibration = observe_kv(model, ctx, modules)
        for name, module in modules.items():
            activations.attach_kv(module, *ranges[name])
        ctx.kv_cache = {"scheme": dict(activations.KV_SCHEME), "ranges": {n: list(r) for n, r in ranges.items()}}
        ctx.progress("kv_cache", 1, 1)
        return {
            "attention_layers": len(modules),
            "scheme": "fp8 e4m3 per-tensor static (keys, values)",
            "max_k_scale": max(k for k, _ in ranges.values()) / FP8_E4M3_MAX,
            "max_v_scale": max(v for _, v in ranges.values()) / FP8_E4M3_MAX,
            **calibration,
        }
