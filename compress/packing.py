"""Packed checkpoints in the compressed-tensors format (what llm-compressor writes and vLLM and
transformers read), written and read through the `compressed-tensors` library.

    in-memory model (dequantized weights) + per-layer records (ctx.layers)
      -> per layer: scales recovered and verified exactly (compress.quant.recover_qparams)
      -> the library's compressor for the layer's scheme: int4 packed into int32, int8 as int8,
         FP8 as float8_e4m3fn, scales (in the model's dtype where exact, else float32) and zero points per tensor, channel or group
      -> the library decompresses each layer again, which must give back our weights bit for bit
      -> save_pretrained with that state dict, and `quantization_config` in config.json

Loading (`load_packed`) builds the model on the meta device, reads the safetensors files
(each file and tensor checked, an error names both), decompresses each quantized layer with the
library, and ties the embeddings again where the config says so. Nothing here does tensor math
of its own beyond choosing scales.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compress import moe
from compress.errors import CompressError, first_line
from compress.schemes import fp4_format, inputs_on_the_librarys_grid, mx_format

FORMAT_PACKED = "compressed-tensors"
FORMAT_DENSE = "dense"


class NotPackable(CompressError):
    """A layer the format cannot reproduce exactly: `auto` then writes dense, `packed` fails."""


@dataclass
class Decision:
    """Which format a run writes, and why (one line for the report)."""

    format: str  # "packed" or "dense"
    reason: str
    problems: list[str] = field(default_factory=list)


def _ct():
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise CompressError("the packed format needs the compressed-tensors package", "pip install 'compressed-tensors>=0.20,<0.21', or pass --format dense") from None
    import compressed_tensors

    return compressed_tensors


def ct_args(args: dict, activations: bool = False):
    """Our QuantArgs fields (as recorded in ctx.layers) as compressed-tensors QuantizationArgs."""
    from compressed_tensors.quantization import QuantizationArgs

    extra = {}
    dynamic = bool(args.get("dynamic", False))
    if fp4_format(args):  # the block scales' storage type names the format
        nv = fp4_format(args) == "nvfp4"
        dtype = torch.float8_e4m3fn if nv else torch.uint8  # NVFP4 e4m3; MXFP4 e8m0
        extra = {"scale_dtype": dtype, "zp_dtype": dtype}
        if activations and nv:
            dynamic = "local"  # block scales from each input, the global scale calibrated (input_global_scale)
    elif mx_format(args):  # e8m0 scales, as the library's MXFP8 and MXFP6 presets store them
        extra = {"scale_dtype": torch.uint8, "zp_dtype": torch.uint8}
    if args.get("block_structure"):
        extra["block_structure"] = list(args["block_structure"])
    return QuantizationArgs(num_bits=args["num_bits"], type=args["type"], symmetric=args["symmetric"],
                            strategy=args["strategy"], group_size=args.get("group_size"), dynamic=dynamic, **extra)


def ct_scheme(rec: dict, targets: list[str]):
    from compressed_tensors.quantization import QuantizationScheme

    acts = rec.get("input_activations")
    return QuantizationScheme(targets=targets, weights=ct_args(rec["weights"]),
                              input_activations=ct_args(acts, activations=True) if acts else None)


def expressible(net: torch.nn.Module, layers: dict) -> list[str]:
    """Why some quantized layers cannot be written in the format (empty when all can)."""
    modules = dict(net.named_modules())
    shared = _shared_weights(net)
    problems = _expert_problems(net, layers)
    for name, rec in layers.items():
        if "weights" not in rec:
            continue
        module = modules.get(name)
        w = rec["weights"]
        if module is None and moe.fused_experts_of(net, name) is not None:
            in_features = moe.expert_weight_shape(net, name)[1]
        elif module is None:
            problems.append(f"{name}, which is not a module of the saved model")
            continue
        elif type(module) is not torch.nn.Linear:
            problems.append(f"{name}, a {type(module).__name__} layer rather than a Linear one")
            continue
        else:
            in_features = module.in_features
        # compressed-tensors rounds activations in whole groups: a partial last group, which
        # compress simulates, would load and then fail at the first forward
        a_group = (rec.get("input_activations") or {}).get("group_size")
        if w["strategy"] in ("group", "tensor_group") and in_features % w["group_size"]:
            problems.append(f"{name}, whose {in_features} input features are not a whole number of groups of {w['group_size']}")
        elif a_group and in_features % a_group:
            problems.append(f"{name}, whose {in_features} input features are not a whole number of activation groups of {a_group}")
        elif _narrow_inputs_off_the_librarys_grid(rec.get("input_activations")):
            bits = rec["input_activations"]["num_bits"]
            problems.append(f"{name}, whose int{bits} inputs are rounded on {2 ** bits - 1} codes where compressed-tensors "
                            f"rounds them on {2 ** bits} (full_range: true)")
        elif module is None:  # the experts: the checks below are of Linear layers
            continue
        elif w["strategy"] not in ("tensor", "channel", "group", "tensor_group", "block"):
            problems.append(f"{name}, with weight strategy {w['strategy']}")
        elif w["strategy"] == "block" and (padded := _padded_tile_values(module.weight.shape, w["block_structure"])) > \
                max(4 * module.weight.numel(), TILE_PADDING_LIMIT):
            (rows, cols), (br, bc) = module.weight.shape, w["block_structure"]
            problems.append(f"{name}, whose {rows}x{cols} weight compressed-tensors would pad to whole {br}x{bc} tiles "
                            f"({padded:,} values) to pack it: choose a block_structure no larger than the layers")
        elif id(module.weight) in shared:
            problems.append(f"{name}, whose weight is tied to another parameter")
    return problems


# compressed-tensors pads a weight to whole tiles when it packs it; past this many values (and
# four times the weight; 256 MiB as float32) a tile far larger than the layer would take gigabytes
TILE_PADDING_LIMIT = 1 << 26


def _padded_tile_values(shape, block_structure: list[int]) -> int:
    (rows, cols), (br, bc) = shape, block_structure
    return -(-rows // br) * br * -(-cols // bc) * bc


def _narrow_inputs_off_the_librarys_grid(a: dict | None) -> bool:
    """Inputs that compressed-tensors rounds on all 2^b codes (schemes.inputs_on_the_librarys_grid)
    rounded here on absmax's 2^b - 1: a file could not say how they were rounded."""
    return bool(a) and inputs_on_the_librarys_grid(a.get("type"), a.get("dynamic"), a["num_bits"], a.get("symmetric")) \
        and not a.get("full_range")


def _expert_problems(net: torch.nn.Module, layers: dict) -> list[str]:
    """Fused experts are written one matrix per expert layer, under the keys transformers saves
    them as: every expert of a block quantized, under one scheme for the whole model (the config's
    targets then name no layer, which neither transformers nor vLLM could match in fused form)."""
    quantized = {n for n, r in layers.items() if "weights" in r}
    modules = dict(net.named_modules())
    expert_layers = sorted(n for n in quantized if n not in modules and moe.fused_experts_of(net, n) is not None)
    if not expert_layers:
        return []
    try:
        on_disk = moe.expert_keys_on_disk(net)
    except ValueError as exc:
        return [f"the experts' weights: {exc}"]
    missing = [n for n in on_disk if n not in quantized]
    if missing:
        return [f"{missing[0]}, an expert left unquantized beside quantized ones (the format writes a block's experts alike)"]
    schemes = {json.dumps({"w": layers[n]["weights"], "a": layers[n].get("input_activations")}, sort_keys=True) for n in quantized}
    if len(schemes) > 1:
        return [f"{expert_layers[0]}, an expert layer in a model quantized under {len(schemes)} schemes (one scheme is needed)"]
    return []


def _shared_weights(net: torch.nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, p in net.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


OFFLOADED_NOT_PACKABLE = CompressError("cannot write the packed format with offload: disk, which writes the checkpoint "
                                       "block by block", "drop offload: disk, or pass --format dense")


def _first_of(problems: list[str]) -> str:
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")


def not_packable(problems: list[str]) -> CompressError:
    """What --format packed gets when some quantized layer cannot be written."""
    return CompressError(f"cannot write the packed format: {_first_of(problems)}",
                         "pass --format dense, or change the recipe so that every quantized layer can be packed")


KV_IN_META_ONLY = " (the KV cache's scales are in compress.json only)"  # a dense output's reason says so
ACTIVATIONS_IN_META_ONLY = (" (activation quantization is in compress.json only: compress reattaches it, "
                            "plain loaders run those layers on unquantized inputs)")


def dense_notes(layers: dict, kv_cache) -> str:
    """What a dense output's config.json cannot say, its reason does: KV cache scales and
    activation quantization are recorded in compress.json only."""
    return ((KV_IN_META_ONLY if kv_cache else "")
            + (ACTIVATIONS_IN_META_ONLY if any(r.get("input_activations") for r in layers.values()) else ""))


def decide(net: torch.nn.Module, layers: dict, requested: str = "auto", offloaded: bool = False,
           kv_cache: dict | None = None, known: list[str] = (), dtype: torch.dtype | None = None) -> Decision:
    """`auto`: packed when every quantized layer can be expressed, else dense; `packed` insists.
    A KV cache alone (no quantized layer) is written in the format too: its scales need it.
    `known`: layers the caller already knows the format cannot hold (compress plan: a grid the
    stages will leave, which the weights before them cannot show). `dtype`: the dtype the model
    is saved in, where `net` does not hold it (compress plan's meta model, before --dtype)."""
    quantized = [n for n, r in layers.items() if "weights" in r]
    notes = dense_notes(layers, kv_cache)
    if requested == "dense":
        return Decision("dense", "asked for (--format dense or format: dense): dequantized weights in the model's dtype" + notes)
    if not quantized and kv_cache and not offloaded:
        _ct()
        return Decision("packed", "compressed-tensors: no layer is quantized; the KV cache's k_scale and v_scale, "
                                  "and kv_cache_scheme in quantization_config")
    if not quantized:
        sparse = any(r.get("sparsity") for r in layers.values())
        return Decision("dense", "no layer is quantized: nothing to pack" + (" (sparsity is stored densely)" if sparse else "") + notes)
    if offloaded:
        if requested == "packed":
            raise OFFLOADED_NOT_PACKABLE
        return Decision("dense", "offload: disk writes the dense checkpoint block by block" + notes)
    problems = [*known, *expressible(net, layers)]
    if not problems:
        try:
            _ct()
        except CompressError as exc:
            problems = [exc.message]
    if problems:
        if requested == "packed":
            raise not_packable(problems)
        return Decision("dense", f"the packed format cannot express {_first_of(problems)}", problems)
    return Decision("packed", f"compressed-tensors: each of the {len(quantized)} quantized layers has a scheme the format expresses"
                              + _experts_plain_transformers_cannot_load(net, layers) + _decompressed_to_bfloat16(net, layers, dtype))


def _decompressed_to_bfloat16(net: torch.nn.Module, layers: dict, dtype: torch.dtype | None = None) -> str:
    """A note for FP4, MXFP6 or MXFP8 layers in a model not held in bfloat16: compressed-tensors 0.20
    decompresses those weights to bfloat16 whatever the model's dtype, and plain transformers'
    forward then fails on the mixed dtypes (tests/test_packed.py, README: FP4); compress reads
    them in any dtype."""
    dtype = dtype or next((p.dtype for p in net.parameters() if p.is_floating_point()), torch.bfloat16)
    kinds = sorted({(mx_format(r["weights"]) or "FP4").upper() for r in layers.values()
                    if "weights" in r and (mx_format(r["weights"]) or fp4_format(r["weights"]))})
    if dtype == torch.bfloat16 or not kinds:
        return ""
    return (f"; plain transformers (compressed-tensors 0.20) cannot run {' and '.join(kinds)} layers of a "
            f"{str(dtype).removeprefix('torch.')} model (it decompresses them to bfloat16; compress reads them): save in "
            "bfloat16 (--dtype bfloat16), or pass --format dense for a checkpoint it runs")


def _experts_plain_transformers_cannot_load(net: torch.nn.Module, layers: dict) -> str:
    """A note for a packed mixture-of-experts checkpoint that plain transformers cannot open.
    transformers fuses the per-expert matrices as it loads them, and with compressed-tensors
    0.20 that works for symmetric integer weights (W4A16, W8A16) and FP8 only: zero points,
    int8 activations, FP4 blocks and FP8 tiles fail (tests/test_moe.py), as do unquantized experts beside
    quantized layers. compress reads all of them; the note says so where the run ends."""
    if not any(moe.is_fused_experts(m) for m in net.modules()):
        return ""
    experts = [n for n, r in layers.items() if "weights" in r and moe.fused_experts_of(net, n) is not None]
    if experts:  # one scheme for every expert (_expert_problems)
        rec = layers[experts[0]]
        _, fmt = _compressor(ct_scheme(rec, [experts[0]]))
        tiles = rec["weights"]["strategy"] == "block"
        if rec["weights"]["symmetric"] and fmt in ("pack-quantized", "float-quantized") and not tiles:
            return ""
        what = f"experts quantized as {fmt}" + (" in tiles" if tiles else "" if rec["weights"]["symmetric"] else " with zero points")
    else:
        what = "unquantized experts beside quantized layers"
    return (f"; plain transformers (compressed-tensors 0.20) cannot load {what} (compress "
            "reads them); pass --format dense for a checkpoint it loads")


# ---------------------------------------------------------------------------------------------
# Writing


def _compressor(scheme):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format

    fmt = infer_module_format(torch.nn.Linear, scheme)
    scheme.format = fmt
    return BaseCompressor.get_value_from_registry(fmt.value), fmt.value


def stored_code_bits(weights: dict, activations: dict | None) -> int:
    """The width each weight code takes in the file: the format compressed-tensors chooses for the
    scheme packs integer codes to their width only for weight-only schemes (pack-quantized); with
    activation quantization (W4A8) it stores them in int8 (int-quantized)."""
    _, fmt = _compressor(ct_scheme({"weights": weights, "input_activations": activations}, ["Linear"]))
    return 8 if fmt in ("int-quantized", "float-quantized", "mxfp8-quantized") else int(weights["num_bits"])


def _activation_qparams(rec: dict) -> dict[str, torch.Tensor]:
    """Static input activation scale (and zero point) from the observed range, as
    compress.activations computes them."""
    a = rec.get("input_activations")
    rng = rec.get("activation_range")
    if not a or a.get("dynamic") or not rng:
        return {}
    from compress.quant import FP8_E4M3_MAX, absmax_qparams, zeropoint_qparams

    lo, hi = float(rng[0]), float(rng[1])
    if fp4_format(a) == "nvfp4":  # MXFP4's are all dynamic
        from compress.quant import nvfp4_input_global_scale

        return {"input_global_scale": torch.tensor([nvfp4_input_global_scale(max(abs(lo), abs(hi)))], dtype=torch.float32)}
    if a["type"] == "float":
        scale = torch.tensor([max(abs(lo), abs(hi)) / FP8_E4M3_MAX])
        return {"input_scale": torch.where(scale > 0, scale, torch.ones_like(scale)).float()}
    if a["symmetric"]:
        qp = absmax_qparams(torch.tensor([max(abs(lo), abs(hi))]), a["num_bits"], bool(a.get("full_range")))
        return {"input_scale": qp.scale.float()}
    qp = zeropoint_qparams(torch.tensor([lo]), torch.tensor([hi]), a["num_bits"])
    return {"input_scale": qp.scale.float(), "input_zero_point": qp.zero_point.to(torch.int8)}


def _fp4_scales(name: str, weight: torch.Tensor, rec: dict) -> dict[str, torch.Tensor]:
    """An FP4 layer's block scales, as the compressor takes them: NVFP4's e4m3 values (step times
    the global scale the stage recorded) and its global scale; MXFP4's power-of-two steps."""
    from compress.quant import nvfp4_global_scale, recover_fp4_steps

    w = rec["weights"]
    nv = fp4_format(w) == "nvfp4"
    g = rec.get("global_scale") if nv else None
    if nv and g is None:  # a stage that did not record one: the weight's own, as quantize_weight takes it
        g = nvfp4_global_scale(weight.float().abs().amax())
    steps, failed = recover_fp4_steps(weight, w["group_size"], g)
    if failed:
        raise NotPackable(f"layer {name}: {failed} weight block(s) are not on an FP4 grid the format can store exactly",
                          "pass --format dense; the layer's weights were changed after quantization, or GPTQ ran with "
                          "actorder: group (blocks then mix scales)")
    if not nv:
        return {"weight_scale": steps}
    return {"weight_scale": steps * g, "weight_global_scale": torch.tensor([g], dtype=torch.float32)}


def pack_layer(name: str, module: torch.nn.Linear, rec: dict) -> tuple[dict[str, torch.Tensor], str]:
    """The layer's tensors in the format (local names: weight_packed, weight_scale, ...), and the
    format's name. Raises CompressError when the packed layer would not give back its weights."""
    from compress.quant import recover_mx_steps, recover_qparams, scales_as

    w = rec["weights"]
    weight = module.weight.detach().cpu()
    if rec.get("mixed_group_scales") and rec.get("stage") == "gptq":
        raise NotPackable(f"layer {name}: GPTQ chose its group scales as act-order reached the columns (actorder: group), "
                          "so its groups mix scales, which the format cannot store", "use actorder: static (the default) to pack")
    if fp4_format(w):
        return _pack(name, module, rec, weight, _fp4_scales(name, weight, rec))
    if mx_format(w):
        steps, failed = recover_mx_steps(weight, w["num_bits"])
        if failed:
            raise NotPackable(f"layer {name}: {failed} weight block(s) are not on an {mx_format(w).upper()} grid the format "
                              "can store exactly",
                              "pass --format dense; the layer's weights were changed after quantization")
        return _pack(name, module, rec, weight, {"weight_scale": steps})  # the compressor stores their exponents
    if rec.get("fp8_absmax") is not None and w["type"] == "float" and w["strategy"] == "tensor":
        # per-tensor FP8 at the scale its fused group shares (rtn.global_scales): a part whose own
        # largest weight is smaller does not reach 448, which recovery from the weight assumes
        scale, zero_point, failed = _shared_fp8_scale(weight, rec["fp8_absmax"]), None, 0
    else:
        scale, zero_point, failed = recover_qparams(weight, w["num_bits"], w["symmetric"], w["strategy"],
                                                    w.get("group_size"), float8=w["type"] == "float",
                                                    block_structure=w.get("block_structure"))
    if failed:
        raise NotPackable(f"layer {name}: {failed} weight group(s) are not on a {w['num_bits']}-bit grid the format can store exactly",
                            "pass --format dense; the layer's weights were changed after quantization, or GPTQ ran with "
                          "actorder: group (blocks then mix scales)")
    if weight.dtype in (torch.bfloat16, torch.float16):
        # readers hold scales in the model's dtype: store them so wherever they are exact there
        # (stages round them so: compress.quant.scales_stored_as), so nothing is cast on load
        in_dtype = scales_as(weight, scale, zero_point, w["num_bits"], w["strategy"], w.get("group_size"), weight.dtype,
                             float8=w["type"] == "float", block_structure=w.get("block_structure"))
        scale = scale if in_dtype is None else in_dtype
    scales = {"weight_scale": scale}
    if zero_point is not None:
        scales["weight_zero_point"] = zero_point
    return _pack(name, module, rec, weight, scales)


def _shared_fp8_scale(weight: torch.Tensor, absmax: float) -> torch.Tensor:
    """The per-tensor FP8 scale the stage rounded `weight` at, from the largest |w| of its group,
    as it computed it (held as the weight's dtype holds it); the layer's packing checks it."""
    from compress.quant import fp8_step, scales_stored_as

    with scales_stored_as(weight.dtype):
        return fp8_step(torch.tensor([absmax]), storable=True)


def _pack(name: str, module: torch.nn.Linear, rec: dict, weight: torch.Tensor,
          scales: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """Compress with the library, and check that it decompresses to the same weights."""
    scheme = ct_scheme(rec, [name])
    compressor, fmt = _compressor(scheme)
    # float32 in: the library divides by the scale in the weight's dtype, and in bfloat16 that
    # division can round an 8-bit code to its neighbour
    state = {"weight": weight.float(), **scales}
    state.update(_activation_qparams(rec))
    try:
        packed = compressor.compress(state, scheme)
        again = compressor.decompress(dict(packed), scheme)["weight"]
    except (RuntimeError, ValueError) as exc:
        # compressed-tensors 0.20 cannot unpack the int4 zero points of a layer with 8 rows or
        # fewer (a classifier head, an MoE gate): a file it wrote, nobody could read
        raise NotPackable(f"layer {name}: compressed-tensors cannot pack it and read it back ({first_line(exc)})",
                          "pass --format dense, or leave the layer out of the stage (ignore)") from None
    if again.shape != weight.shape or not torch.equal(again.to(weight.dtype), weight):
        raise NotPackable(f"layer {name}: compressed-tensors does not decompress it to the same weights",
                            "pass --format dense, and please report it")
    if module.bias is not None:
        packed["bias"] = module.bias.detach().cpu()
    return packed, fmt


def quantization_config(layers: dict, formats: dict[str, str], ignore: list[str]):
    """config_groups (one per distinct scheme; targets: the layer names, or `Linear` when a single
    scheme covers every quantized layer), the ignore list and the format."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    groups: dict[str, tuple[dict, list[str]]] = {}
    for name, rec in layers.items():
        if name not in formats:
            continue
        key = json.dumps({"w": rec["weights"], "a": rec.get("input_activations")}, sort_keys=True)
        groups.setdefault(key, (rec, []))[1].append(name)
    config_groups = {}
    single = len(groups) == 1
    for i, (rec, names) in enumerate(groups.values()):
        scheme = ct_scheme(rec, ["Linear"] if single else names)
        scheme.format = formats[names[0]]
        config_groups[f"group_{i}"] = scheme
    distinct = set(formats.values())
    fmt = distinct.pop() if len(distinct) == 1 else ("mixed-precision" if distinct else "dense")  # dense: a KV cache alone
    # every linear layer left unquantized, however the groups target: a reader matches each layer
    # to a group or to `ignore`, and some (vLLM) refuse a layer that is in neither
    return QuantizationConfig(config_groups=config_groups, format=fmt, ignore=ignore,
                              quantization_status=QuantizationStatus.COMPRESSED)


@dataclass
class Packed:
    """What pack_model makes: the state dict to save, its QuantizationConfig, and whether the
    state is already in the layout transformers saves (fused experts written one matrix each)."""

    state: dict
    qconfig: object
    saved_layout: bool = False


def pack_model(net: torch.nn.Module, layers: dict, kv_cache: dict | None = None) -> Packed:
    """The state dict in the format and its QuantizationConfig; nothing is written. Raises
    NotPackable when a layer cannot be reproduced exactly. `kv_cache` (the kv_cache stage's
    scheme and ranges) adds each attention layer's k_scale and v_scale, and kv_cache_scheme."""
    _ct()
    # Fused experts (Mixtral, Qwen-MoE), which transformers saves one matrix per expert layer:
    # each quantized expert layer is packed on its own (unfused, as the stages saw it) and put
    # under its saved key, in a state converted here to the saved layout as a whole.
    on_disk = expert_keys(net)
    swaps = moe.unfuse_experts(net) if on_disk else []
    try:
        modules = dict(net.named_modules())
        packed = {name: pack_layer(name, modules[name], rec) for name, rec in layers.items() if "weights" in rec}
    finally:
        moe.fuse_experts(swaps)
    state = dict(net.state_dict())
    formats: dict[str, str] = {}
    for name, (tensors, fmt) in packed.items():
        formats[name] = fmt
        if name in on_disk:
            continue
        for key in [k for k in state if k.startswith(name + ".") and k[len(name) + 1:] in ("weight", "bias")]:
            del state[key]
        state.update({f"{name}.{k}": v for k, v in tensors.items()})
    if kv_cache:
        from compress.quant import FP8_E4M3_MAX

        for name, (key_max, value_max) in kv_cache["ranges"].items():
            for part, top in (("k_scale", key_max), ("v_scale", value_max)):
                state[f"{name}.{part}"] = torch.tensor([top / FP8_E4M3_MAX if top > 0 else 1.0], dtype=torch.float32)
    if on_disk:
        from transformers.core_model_loading import revert_weight_conversion

        # A fused parameter all of whose expert layers are packed is left out before the
        # conversion, which would otherwise copy every expert's dense matrix only to drop it.
        for experts in {name.rsplit(".", 2)[0] for name in on_disk}:
            for part, unfused in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
                mine = [n for n in on_disk if n.rsplit(".", 2)[0] == experts and n.rsplit(".", 1)[1] in unfused]
                if all(n in packed for n in mine):
                    state.pop(f"{experts}.{part}", None)
        state = revert_weight_conversion(net, state)  # every key as saved; the experts one matrix each
        for name, key in on_disk.items():
            if name in packed:  # an expert left unquantized stays as saved, dense
                state.pop(f"{key}.weight", None)
                state.update({f"{key}.{k}": v for k, v in packed[name][0].items()})
    linear = [n for n, m in net.named_modules() if isinstance(m, torch.nn.Linear)]
    ignore = [n for n in linear if n not in formats]
    qconfig = quantization_config(layers, formats, ignore)
    if kv_cache:
        qconfig.kv_cache_scheme = ct_args(kv_cache["scheme"], activations=True)
    return Packed(state, qconfig, saved_layout=bool(on_disk))


def expert_keys(model: torch.nn.Module) -> dict[str, str]:
    """moe.expert_keys_on_disk, or {} where the saved layout is not one matrix per expert layer
    (the experts are then saved and read fused, as transformers leaves them)."""
    try:
        return moe.expert_keys_on_disk(model)
    except ValueError:
        return {}


def save_packed(net: torch.nn.Module, layers: dict, directory: Path, packed: Packed | None = None) -> dict:
    """Write `net` to `directory` in the packed format; returns a summary for the report."""
    from compressed_tensors.compressors import ModelCompressor

    packed = packed or pack_model(net, layers)
    state, qconfig = packed.state, packed.qconfig
    # counted first: save_pretrained may consume the dict (it does for a model read from a packed checkpoint)
    scales = [v for k, v in state.items() if k.endswith(".weight_scale")]
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in scales})
    net.save_pretrained(directory, state_dict=state, save_original_format=not packed.saved_layout)  # not converted twice
    ModelCompressor(quantization_config=qconfig).update_config(str(directory))
    return {"compressed_tensors_format": qconfig.format, "packed_layers": len(scales), "scale_dtype": "/".join(dtypes)}


def quantized_size(directory: Path, net: torch.nn.Module, layers: dict) -> dict:
    """The quantized layers' bytes on disk against the same layers in float16 (the issue's bar)."""
    names = [n for n, r in layers.items() if "weights" in r]
    if not names:
        return {}
    modules = dict(net.named_modules())
    experts = expert_keys(net) if any(n not in modules for n in names) else {}
    on_disk = sum(layer_bytes(directory, [experts.get(n, n) for n in names]).values())
    fp16 = sum(sum(p.numel() for p in modules[n].parameters(recurse=False)) * 2 for n in names if n in modules)
    fp16 += sum(2 * math.prod(moe.expert_weight_shape(net, n)) for n in names if n in experts)
    return {"quantized_layers_bytes_on_disk": on_disk, "quantized_layers_float16_bytes": fp16,
            "quantized_layers_ratio_to_float16": on_disk / fp16 if fp16 else None}


# ---------------------------------------------------------------------------------------------
# Reading


def is_packed(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        q = json.loads(cfg.read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    return q.get("quant_method") == "compressed-tensors"


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as exc:
            raise CompressError(f"{index}: damaged index ({exc})", "the checkpoint may be truncated or corrupted: write it again") from None
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CompressError(f"model directory {path} holds no *.safetensors files", "point --model at a complete checkpoint")
    return files


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint; a truncated or damaged file is named, with its tensor."""
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        if not f.is_file():
            raise CompressError(f"{f}: weight file missing", "the checkpoint is incomplete: write it again")
        try:
            handle = safe_open(str(f), framework="pt")
        except (SafetensorError, OSError, ValueError) as exc:
            raise CompressError(f"{f}: not a readable safetensors file ({first_line(exc)})",
                                "the checkpoint may be truncated or corrupted: write it again") from None
        with handle:
            for key in handle.keys():
                try:
                    tensors[key] = handle.get_tensor(key)
                except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                    raise CompressError(f"{f}: tensor {key} cannot be read ({first_line(exc)})",
                                        "the checkpoint may be truncated or corrupted: write it again") from None
    return tensors


def load_packed(path: str | Path, config, model_cls, dtype: torch.dtype | None) -> torch.nn.Module:
    """The model of a packed directory with every quantized layer decompressed (dequantized) by
    compressed-tensors, in `dtype` (the saved dtype when None)."""
    _ct()
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_named_modules

    from compress.offload import parameters_on_meta

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    try:
        qconfig = QuantizationConfig.model_validate({k: v for k, v in raw.items()
                                                     if k in QuantizationConfig.model_fields})
    except Exception as exc:
        raise CompressError(f"{path / 'config.json'}: quantization_config is not valid ({first_line(exc)})",
                            "the checkpoint's config.json is damaged: write it again") from None
    from compress.modeling import saved_dtype as saved_dtype_of

    saved_dtype = saved_dtype_of(config)
    dtype = dtype or saved_dtype
    config = type(config).from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    with parameters_on_meta():
        model = model_cls.from_config(config, dtype=dtype)
    tensors = read_tensors(path)
    files = ", ".join(f.name for f in _weight_files(path))
    swaps = []
    on_disk = expert_keys(model)
    # every key renamed from its saved form (transformers saves GPT-NeoX's lm_head as embed_out)
    tensors = _as_in_memory(model, tensors, on_disk)
    if on_disk:
        # experts saved one matrix each (pack_model): unfused here, so that each expert layer is a
        # module its tensors decompress into
        swaps = moe.unfuse_experts(model)
    by_module: dict[str, dict[str, torch.Tensor]] = {}  # module name -> its tensors, by last name component
    for key, value in tensors.items():
        prefix, _, leaf = key.rpartition(".")
        by_module.setdefault(prefix, {})[leaf] = value
    state: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    from compress.modeling import read_meta

    recorded = read_meta(path).get("layers", {})  # what compress wrote, to hold the config to
    for scheme in qconfig.config_groups.values():
        compressor = BaseCompressor.get_value_from_registry(scheme.format or qconfig.format)
        for name, module in match_named_modules(model, scheme.targets, qconfig.ignore):
            if name in done:
                continue
            _check_against_record(path, name, scheme.weights, (recorded.get(name) or {}).get("weights"))
            local = by_module.get(name, {})
            if "weight" in local and not any(k.startswith("weight_") for k in local):
                continue  # stored dense (an expert left unquantized): read as the plain tensor it is
            expected = compressor.compression_param_names(scheme)
            missing = [p for p in expected if p not in local]
            if missing:
                raise CompressError(f"{path} ({files}): tensor {name}.{missing[0]} is missing",
                                    "the checkpoint may be truncated or corrupted: write it again")
            try:
                weight = compressor.decompress(local, scheme)["weight"]
            except Exception as exc:
                raise CompressError(f"{path} ({files}): tensor {name}.{expected[0]} cannot be decompressed ({first_line(exc)})",
                                    "the checkpoint may be truncated or corrupted: write it again") from None
            if tuple(weight.shape) != tuple(module.weight.shape):
                raise CompressError(f"{path} ({files}): tensor {name}.{expected[0]} gives a {tuple(weight.shape)} weight, "
                                    f"the model expects {tuple(module.weight.shape)}", "the checkpoint may be corrupted: write it again")
            state[f"{name}.weight"] = weight.to(saved_dtype).to(dtype)  # the values as saved, then as asked
            if f"{name}.bias" in tensors:
                state[f"{name}.bias"] = tensors[f"{name}.bias"].to(dtype)
            done.add(name)
    kv_scales = {k: v for k, v in tensors.items() if k.endswith((".k_scale", ".v_scale"))}  # the KV cache's, not weights
    for key, value in tensors.items():
        prefix = key.rsplit(".", 1)[0]
        if prefix not in done and key not in kv_scales:
            state[key] = value
    expected_keys = model.state_dict().keys()
    for key, value in list(state.items()):
        if key in expected_keys and value.is_floating_point():
            state[key] = value.to(dtype)
    result = model.load_state_dict(state, strict=False, assign=True)
    del state  # the modules hold the weights now: each expert's goes once its block is fused
    while swaps:
        parent, attr, unfused = swaps.pop(0)
        fused = unfused.fused[0]
        for part in ("gate_up_proj", "down_proj"):  # the fused parameters, still on meta, take the experts' values
            setattr(fused, part, torch.nn.Parameter(torch.empty_like(getattr(fused, part), device="cpu"), requires_grad=False))
        setattr(parent, attr, unfused.fuse_back())
        del unfused  # so that the block's expert weights are freed before the next block is fused
    if getattr(config, "tie_word_embeddings", False) or getattr(getattr(config, "get_text_config", lambda: config)(), "tie_word_embeddings", False):
        model.tie_weights()
    still_meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if still_meta:
        raise CompressError(f"{path} ({files}): tensor {still_meta[0]} is missing", "the checkpoint may be truncated or corrupted: write it again")
    if result.unexpected_keys:
        raise CompressError(f"{path} ({files}): unexpected tensor {result.unexpected_keys[0]}", "the checkpoint does not match its config.json")
    if not (path / "compress.json").is_file():  # another tool's checkpoint: its activation scheme is in the config
        attach_activation_quant(model, qconfig, tensors, path)
        attach_kv_cache(model, qconfig, kv_scales, path)
    return model


def _check_against_record(path: Path, name: str, weights, record: dict | None) -> None:
    """A compress checkpoint's config.json must describe each layer as compress.json records it:
    an edited bit width would otherwise decode the stored codes into other weights, silently."""
    if record is None or weights is None:
        return
    said = {"num_bits": weights.num_bits, "type": getattr(weights.type, "value", weights.type),
            "strategy": getattr(weights.strategy, "value", weights.strategy), "symmetric": weights.symmetric}
    if said["strategy"] in ("group", "tensor_group"):
        said["group_size"] = weights.group_size
    if said["strategy"] == "block":
        said["block_structure"] = list(weights.block_structure or [])
    differ = next((k for k, v in said.items() if k in record and record[k] != v), None)
    if differ is not None:
        raise CompressError(f"{path / 'config.json'}: quantization_config gives layer {name} {differ} {said[differ]}, "
                            f"compress.json records {record[differ]}", "the checkpoint was edited: write it again")


def _as_in_memory(model: torch.nn.Module, tensors: dict[str, torch.Tensor], on_disk: dict[str, str]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors keyed as in `model` with its experts unfused: each saved per-expert
    layer under `<experts>.e.gate_proj`, and every other layer under its module's name (Mixtral
    saves the MLP as `block_sparse_moe`): the saved names come from transformers' own mapping."""
    from transformers.core_model_loading import revert_weight_conversion

    renamed = {saved: name for name, saved in on_disk.items()}
    fused = {f"{n}.{p}" for n, m in model.named_modules() if moe.is_fused_experts(m) for p in ("gate_up_proj", "down_proj")}
    keys = [k for k in model.state_dict() if k not in fused]
    placeholders = {k: torch.tensor([float(i)], dtype=torch.float64) for i, k in enumerate(keys)}  # value: which key
    for saved, value in revert_weight_conversion(model, placeholders).items():
        renamed.setdefault(saved.rsplit(".", 1)[0], keys[int(value[0])].rsplit(".", 1)[0])  # module to module
    out = {}
    for key, value in tensors.items():
        prefix, leaf = key.rsplit(".", 1) if "." in key else ("", key)
        out[f"{renamed.get(prefix, prefix)}.{leaf}" if prefix else key] = value
    return out


def attach_kv_cache(model: torch.nn.Module, qconfig, kv_scales: dict[str, torch.Tensor], path: Path) -> None:
    """Round keys and values as another tool's checkpoint says (kv_cache_scheme, and each attention
    layer's k_scale and v_scale): FP8 per-tensor static is what compress simulates."""
    a = qconfig.kv_cache_scheme
    if a is None:
        return
    from compress import activations
    from compress.quant import FP8_E4M3_MAX

    kind, strategy = getattr(a.type, "value", a.type), getattr(a.strategy, "value", a.strategy)
    if kind != "float" or a.num_bits != 8 or strategy != "tensor" or a.dynamic is not False:
        raise CompressError(f"{path}: kv_cache_scheme {kind}{a.num_bits} {strategy} (dynamic {a.dynamic}) is not one compress simulates",
                            "compress evaluates FP8 KV caches with per-tensor static scales")
    for name, module in activations.attention_modules(model).items():
        k, v = kv_scales.get(f"{name}.k_scale"), kv_scales.get(f"{name}.v_scale")
        if k is None or v is None:
            raise CompressError(f"{path}: tensor {name}.{'k_scale' if k is None else 'v_scale'} is missing (kv_cache_scheme needs it)",
                                "the checkpoint may be truncated or corrupted: write it again")
        activations.attach_kv(module, float(k.float().reshape(-1)[0]) * FP8_E4M3_MAX, float(v.float().reshape(-1)[0]) * FP8_E4M3_MAX)


def attach_activation_quant(model: torch.nn.Module, qconfig, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Fake-quantize the inputs of every layer whose scheme quantizes activations, with the
    checkpoint's own static scales (input_scale, input_zero_point) where it has them, so that a
    W8A8 checkpoint from another tool is evaluated as it will run."""
    from compressed_tensors.utils.match import match_named_modules

    from compress import activations
    from compress.quant import QParams
    from compress.schemes import QuantArgs

    done: set[str] = set()
    for scheme in qconfig.config_groups.values():
        a = scheme.input_activations
        if a is None:
            continue
        strategy = getattr(a.strategy, "value", a.strategy)
        kind = getattr(a.type, "value", a.type)
        dynamic = getattr(a.dynamic, "value", a.dynamic)
        fp4 = kind == "float" and a.num_bits == 4
        nvfp4 = fp4 and strategy == "tensor_group" and dynamic == "local"
        grouped = kind == "float" and strategy == "group" and dynamic is True  # MXFP4's blocks, FP8_BLOCK's groups
        if not (strategy in ("tensor", "token") and dynamic in (True, False)) and not nvfp4 and not grouped:
            raise CompressError(f"{path}: activation strategy {strategy} (dynamic {dynamic}) is not one compress simulates",
                                "compress evaluates per-tensor static and per-token dynamic activations, FP8 groups per "
                                "token (MXFP8 among them), and NVFP4 and MXFP4 blocks")
        full = inputs_on_the_librarys_grid(kind, dynamic, a.num_bits, a.symmetric)
        mx8 = grouped and a.num_bits == 8 and a.scale_dtype == torch.uint8  # MXFP8's e8m0 scales
        try:
            args = QuantArgs(num_bits=a.num_bits, type=kind, symmetric=a.symmetric, strategy=strategy,
                             dynamic=not nvfp4 and dynamic, group_size=a.group_size if fp4 or grouped else None,
                             full_range=full, scale_dtype="e8m0" if mx8 else None)
        except ValueError as exc:  # pydantic's ValidationError is one: its first error says what
            raise CompressError(f"{path}: input_activations {kind}{a.num_bits} {strategy} (group_size {a.group_size}, "
                                f"scale dtype {a.scale_dtype}) is not a scheme compress simulates: "
                                f"{exc.errors()[0]['msg'] if hasattr(exc, 'errors') else exc}",
                                "compress evaluates the input schemes of compressed-tensors' presets") from None
        for name, module in match_named_modules(model, scheme.targets, qconfig.ignore):
            if name in done:
                continue
            qparams = None
            if nvfp4:  # the calibrated global scale g = 448 · 6 / max|x| gives back the range
                g = tensors.get(f"{name}.input_global_scale")
                if g is None:
                    raise CompressError(f"{path}: tensor {name}.input_global_scale is missing (NVFP4 activations need it)",
                                        "the checkpoint may be truncated or corrupted: write it again")
                from compress.quant import FP4_E2M1_MAX, FP8_E4M3_MAX

                absmax = FP8_E4M3_MAX * FP4_E2M1_MAX / float(g.float().reshape(()))
                activations.attach(module, args, (-absmax, absmax))
                done.add(name)
                continue
            if not a.dynamic:
                scale = tensors.get(f"{name}.input_scale")
                if scale is None:
                    raise CompressError(f"{path}: tensor {name}.input_scale is missing (static activations need it)",
                                        "the checkpoint may be truncated or corrupted: write it again")
                zero = tensors.get(f"{name}.input_zero_point")
                scale = scale.float().reshape(())
                zero = torch.zeros_like(scale) if zero is None else zero.float().reshape(())
                qmax = 2 ** (a.num_bits - 1) - 1  # compressed-tensors' integer range: [-2^(b-1), 2^(b-1) - 1]
                qparams = QParams(scale, zero, -qmax - 1, qmax)
            activations.attach(module, args, static_qparams=qparams)
            done.add(name)


# ---------------------------------------------------------------------------------------------
# Sizes on disk, per layer


def tensor_bytes(path: str | Path) -> dict[str, int]:
    """Bytes of every stored tensor, read from the safetensors headers (no data is loaded)."""
    import struct

    sizes: dict[str, int] = {}
    for f in _weight_files(Path(path)):
        try:
            with open(f, "rb") as fh:
                header = fh.read(8)
                (n,) = struct.unpack("<Q", header)
                meta = json.loads(fh.read(n))
                size = fh.seek(0, 2)
            if max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0) + 8 + n > size:
                raise ValueError("the file is shorter than its header says")
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            raise CompressError(f"{f}: not a readable safetensors file ({first_line(exc)})",
                                "the checkpoint may be truncated or corrupted: write it again") from None
        for key, info in meta.items():
            if key != "__metadata__":
                start, end = info["data_offsets"]
                sizes[key] = end - start
    return sizes


def layer_bytes(path: str | Path, layer_names: list[str]) -> dict[str, int]:
    """Bytes on disk of each named layer (all its tensors: weight or weight_packed, scales, ...)."""
    sizes = tensor_bytes(path)
    out = {}
    for name in layer_names:
        out[name] = sum(v for k, v in sizes.items() if k.startswith(name + ".") and "." not in k[len(name) + 1:])
    return out
