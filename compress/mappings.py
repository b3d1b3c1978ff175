"""Smoothing maps: which operation precedes which linear layers inside a block, so that a per
input channel scale s can be moved between them without changing the model's function:

    prev(x) / s  feeding  W · diag(s)        (W' x' = W diag(s) (x / s) = W x)

`prev` is a norm (its weight, and bias, divided by s; for a norm that scales by 1 + weight, as
Gemma's do, 1 + weight is what gets divided) or a linear layer (its output rows and bias divided
by s). Through an elementwise function this is exact only when it is positively
homogeneous (ReLU: OPT's fc1 -> fc2), never through GELU or SiLU. v -> o is exact because
attention mixes value vectors linearly, but only when each value channel feeds exactly one
output-projection column (no grouped-query sharing).

AWQ and SmoothQuant both use these tables; a recipe may replace them with its own `mappings`.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from compress.errors import CompressError
from compress.modeling import get_weight, set_weight, weight_shape


class Mapping(BaseModel):
    """`smooth`: the preceding op; `balance`: the layers reading its output (names inside a block).

    A `*` stands for one name component, for a block's experts: in `balance` alone it takes every
    module it matches (`mlp.experts.*.up_proj`: all experts' up projections); in `smooth` it makes
    one mapping per module matched, the same component put into `balance` and `inspect` (each
    expert's up -> down). Balance layers a stage does not quantize (a router) are scaled all the
    same, which keeps the model exact."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    smooth: str = Field(..., description="module inside the block whose output is divided by the scales")
    balance: list[str] = Field(..., min_length=1, description="layers inside the block whose input columns are multiplied")
    inspect: Optional[str] = Field(None, description="AWQ: module inside the block whose output its scale search scores (default: the whole block); both stages check that a fold leaves its output, and the block's, unchanged")
    # Made by in_block from a `*` in `smooth`: one of several parallel branches (an expert's own
    # up -> down), whose fold cannot change another branch's inspected output (see fold_branches).
    _branch: bool = PrivateAttr(False)


def _m(smooth: str, *balance: str, inspect: str, needs_mha: bool = False) -> tuple[Mapping, bool]:
    return Mapping(smooth=smooth, balance=list(balance), inspect=inspect), needs_mha


# `inspect`: the smallest module whose output carries every effect of the balance layers' error
# (attention through its softmax, the MLP through its activation), before the residual add.
_LLAMA = [
    _m("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", inspect="self_attn"),
    _m("self_attn.v_proj", "self_attn.o_proj", inspect="self_attn.o_proj", needs_mha=True),
    _m("post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", inspect="mlp"),
    _m("mlp.up_proj", "mlp.down_proj", inspect="mlp.down_proj"),
]

# Gemma 2 and 3 normalise the attention's and the MLP's outputs too, so the MLP reads its own
# pre-norm rather than post_attention_layernorm.
_GEMMA2 = [
    _m("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", inspect="self_attn"),
    _m("self_attn.v_proj", "self_attn.o_proj", inspect="self_attn.o_proj", needs_mha=True),
    _m("pre_feedforward_layernorm", "mlp.gate_proj", "mlp.up_proj", inspect="mlp"),
    _m("mlp.up_proj", "mlp.down_proj", inspect="mlp.down_proj"),
]

# Mixture-of-experts MLPs: the router reads the same normalised input as every expert and is
# scaled with them, which keeps the routing exact in float (in half precision its rounded logits
# may swap a near-tied expert for a few tokens); each expert's up -> down on its own. Blocks with a
# dense MLP instead (Qwen-MoE's `mlp_only_layers`) take Llama's MLP maps.
_MOE = _LLAMA + [
    _m("post_attention_layernorm", "mlp.gate", "mlp.experts.*.gate_proj", "mlp.experts.*.up_proj", inspect="mlp"),
    _m("mlp.experts.*.up_proj", "mlp.experts.*.down_proj", inspect="mlp.experts.*.down_proj"),
]
# Qwen2-MoE adds a shared expert beside the routed ones, and a gate that weighs it.
_QWEN2_MOE = _LLAMA + [
    _m("post_attention_layernorm", "mlp.gate", "mlp.experts.*.gate_proj", "mlp.experts.*.up_proj",
       "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert_gate", inspect="mlp"),
    _m("mlp.experts.*.up_proj", "mlp.experts.*.down_proj", inspect="mlp.experts.*.down_proj"),
    _m("mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj", inspect="mlp.shared_expert.down_proj"),
]

TABLES: dict[str, list[tuple[Mapping, bool]]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "mixtral": _MOE,
    "qwen3_moe": _MOE,
    "qwen2_moe": _QWEN2_MOE,
    "gemma": _LLAMA,
    "gemma2": _GEMMA2,
    "gemma3_text": _GEMMA2,
    # q, k, v in one layer and gate, up in another: only the norms in front of them can take the
    # scales (v -> o and up -> down would need a part of a fused layer's rows)
    "phi3": [
        _m("input_layernorm", "self_attn.qkv_proj", inspect="self_attn"),
        _m("post_attention_layernorm", "mlp.gate_up_proj", inspect="mlp"),
    ],
    "opt": [
        _m("self_attn_layer_norm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", inspect="self_attn"),
        _m("self_attn.v_proj", "self_attn.out_proj", inspect="self_attn.out_proj", needs_mha=True),
        _m("final_layer_norm", "fc1", inspect="fc2"),
        _m("fc1", "fc2", inspect="fc2"),  # through ReLU, which commutes with a positive scale
    ],
    "gpt2": [
        _m("ln_1", "attn.c_attn", inspect="attn"),
        _m("ln_2", "mlp.c_fc", inspect="mlp"),
    ],
    # BERT normalises after the residual add, so its LayerNorm outputs are the residual stream
    # itself: scaling them would change the model. Only value -> output projection is exact.
    "bert": [
        _m("attention.self.value", "attention.output.dense", inspect="attention.output.dense", needs_mha=True),
    ],
}


def mappings_for(model: torch.nn.Module, override: list[Mapping] | None = None, blocks_path: str | None = None) -> list[Mapping]:
    if override:
        from compress.engine import find_blocks

        _, blocks = find_blocks(model, blocks_path)
        for mapping in override:  # a typo would otherwise leave the stage doing nothing, silently
            if not any(in_block([mapping], block) for block in blocks):
                raise CompressError(f"mapping {mapping.smooth} -> {', '.join(mapping.balance)}"
                                    f"{f' (inspect {mapping.inspect})' if mapping.inspect else ''} names a module no block has; "
                                    f"{_describe_block(model)}", "use names inside a block, as listed")
            for block in blocks:
                for concrete in in_block([mapping], block):
                    _check_widths(concrete, block)
        return list(override)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in TABLES:
        raise CompressError(f"no smoothing map for architecture '{model_type}'; {_describe_block(model)}",
                            "give the stage `mappings: [{smooth: <norm or layer>, balance: [<layers reading it>], "
                            "inspect: <module to score>}]` with names inside a block")
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", heads) or heads
    table = TABLES[model_type]
    if model_type == "opt" and not getattr(config, "do_layer_norm_before", True):
        # post-LN OPT (opt-350m): its norms follow the residual add, so scaling one scales the
        # residual stream as well; only the maps between linear layers stay exact
        table = [(m, mha) for m, mha in table if not m.smooth.endswith("layer_norm")]
    return [m for m, needs_mha in table if not needs_mha or kv_heads == heads]


def _output_width(module: torch.nn.Module) -> int | None:
    """Channels a smoothed op gives: a norm's, or a linear layer's outputs (None: another kind)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    if is_norm(module):
        return weight.shape[0]
    return weight_shape(module)[0] if weight.dim() == 2 else None


def _check_widths(mapping: Mapping, block: torch.nn.Module) -> None:
    """A per-channel scale moves from the smoothed op's outputs to its readers' inputs only where
    they are the same channels: one width. (Under grouped-query attention v_proj gives fewer
    channels than o_proj reads, each value head serving several query heads.)"""
    smooth = block.get_submodule(mapping.smooth)
    width = _output_width(smooth)
    if width is None:
        raise CompressError(f"mapping {mapping.smooth} -> {', '.join(mapping.balance)}: {mapping.smooth} is a "
                            f"{type(smooth).__name__}, with no weight to fold scales into",
                            "smooth a norm with a weight, or the linear layer whose outputs the balance layers read")
    for name in mapping.balance:
        reader = block.get_submodule(name)
        if not isinstance(getattr(reader, "weight", None), torch.Tensor) or reader.weight.dim() != 2:
            raise CompressError(f"mapping {mapping.smooth} -> {', '.join(mapping.balance)}: {name} is a "
                                f"{type(reader).__name__}, not a linear layer", "balance the linear layers that read it")
        reads = weight_shape(reader)[1]
        if reads != width:
            gqa = " (grouped-query attention: each value head serves several query heads)" if reads % width == 0 else ""
            raise CompressError(f"mapping {mapping.smooth} -> {', '.join(mapping.balance)}: {mapping.smooth} gives {width} "
                                f"channels but {name} reads {reads}{gqa}, so scales cannot move between them exactly",
                                "drop this mapping, or name layers that read exactly what the smoothed op gives")


def in_block(mappings: list[Mapping], block: torch.nn.Module) -> list[Mapping]:
    """The mappings with every `*` made concrete against this block's module names (see Mapping);
    a mapping naming a module the block lacks is left out (a layer another block type has)."""
    names = [n for n, _ in block.named_modules() if n]
    present = set(names)

    def matches(pattern: str) -> list[tuple[str, str]]:  # (name, what * stood for)
        rx = re.compile(re.escape(pattern).replace(r"\*", r"([^.]+)") + "$")
        return [(n, m.group(1) if m.groups() else "") for n in names if (m := rx.match(n))]

    out = []
    for mapping in mappings:
        if "*" in mapping.smooth:
            for _, part in matches(mapping.smooth):
                branch = Mapping(smooth=mapping.smooth.replace("*", part),
                                 balance=[b.replace("*", part) for b in mapping.balance],
                                 inspect=mapping.inspect.replace("*", part) if mapping.inspect else None)
                branch._branch = mapping.inspect is not None and "*" in mapping.inspect  # each inspects its own
                out.append(branch)
        else:
            expanded = [matches(b) if "*" in b else [(b, "")] for b in mapping.balance]
            if all(expanded):  # an entry matching nothing (experts this block lacks): not this block's map
                out.append(Mapping(smooth=mapping.smooth, balance=[n for e in expanded for n, _ in e], inspect=mapping.inspect))
    return [m for m in out if m.smooth in present and all(b in present for b in m.balance)
            and (m.inspect is None or m.inspect in present)]



def mapped_layers(model: torch.nn.Module, mappings: list[Mapping], blocks_path: Optional[str] = None) -> list[tuple[str, list[str]]]:
    """(smoothing op, the layers reading it) for every mapping of every block, by full module name."""
    from compress.engine import find_blocks

    path, blocks = find_blocks(model, blocks_path)
    return [(f"{path}.{i}.{m.smooth}", [f"{path}.{i}.{n}" for n in m.balance])
            for i, block in enumerate(blocks) for m in in_block(mappings, block)]

def _describe_block(model: torch.nn.Module, limit: int = 16) -> str:
    """The norms and linear layers inside the model's first block, to write a mapping from."""
    try:
        from compress.engine import find_blocks

        path, blocks = find_blocks(model)
        block, where = blocks[0], f"block {path}.0"
    except Exception:  # the engine does not know the block list either: guess the first layer list
        path, blocks = next(((n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)),
                            ("", None))
        block, where = (blocks[0], f"block {path}.0") if blocks is not None else (model, "the model")
    found = [f"{name} ({type(m).__name__})" for name, m in block.named_modules()
             if name and (is_norm(m) or getattr(getattr(m, "weight", None), "dim", lambda: 0)() == 2)]
    more = f", … {len(found) - limit} more" if len(found) > limit else ""
    return f"{where} holds " + (", ".join(found[:limit]) + more if found else "no norms or linear layers")


def is_norm(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 1


def require_exact(mapping: Mapping, where: str, before: list[torch.Tensor], after: list[torch.Tensor],
                  dtype: torch.dtype) -> None:
    """Refuse a mapping whose scales moved the output of its inspected module (`before` and `after`
    the folding, [tokens, features] per calibration batch) by more than rounding in the weights'
    `dtype` can: a scale passed through a nonlinearity, a norm of an unknown kind, value heads
    shared by several query heads. The measure is the median over tokens of each token's relative
    change, so that the few tokens whose top-k experts swap places (a router's logits rounded
    after scaling, in half precision) do not count; a wrong map moves every token. Exact folds
    measure about 1e-7 in float32 and 3e-3 in bfloat16, against limits of 1e-3 and 3e-2 (four
    steps of the dtype: 8 let a post-LN fold that moved every token 5 % through in bfloat16)."""
    a = torch.cat([t.float().reshape(-1, t.shape[-1]) for t in after]) if after else torch.zeros(0, 1)
    b = torch.cat([t.float().reshape(-1, t.shape[-1]) for t in before]) if before else torch.zeros(0, 1)
    # Tokens already non-finite before the fold cannot tell (the block's output where a later layer
    # overflows: that layer's own check names it); a fold making a finite token non-finite counts.
    finite = torch.isfinite(b).all(-1)
    a, b = a[finite], b[finite]
    if b.shape[0] == 0:
        return  # nothing ran through the inspected module (an expert these batches did not reach)
    per_token = ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-12)).nan_to_num(nan=float("inf"))
    change = float(per_token.median())
    if not change <= max(1e-3, 4 * torch.finfo(dtype).eps):
        raise CompressError(f"{where}: moving scales from {mapping.smooth} into {', '.join(mapping.balance)} changes "
                            f"the float model's output by {change:.1e} (relative, median over tokens), so this mapping "
                            "is not exact here", "fix or remove it in the stage's `mappings`: every module reading the smoothed op "
                            "must be in balance, with only linear operations between (no activation other than ReLU, "
                            "no norm with an unknown kind of weight)")


def fold(mapping: Mapping, block: torch.nn.Module, scales: torch.Tensor, runner, where: str, batches: int = 1,
         before: list[torch.Tensor] | None = None) -> None:
    """Move `scales` from the mapping's smoothed op into every module of its balance list in `block`
    (quantized later or not: a router too), then require_exact on the inspected module's outputs
    over `batches` calibration batches of `runner` (an engine BlockRunner; they are spread over the
    calibration set); `before`: those outputs already taken on the unfolded block.

    The block's own output is checked too (one batch): an inspected module that is itself a balance
    layer reads the smoothed op's output unchanged whatever the map, so a reader the map leaves
    out (up_proj beside gate_proj), or a residual stream the smoothed norm's output also is, would
    pass unseen."""
    if before is None:
        before = runner.outputs(batches, mapping.inspect)
    block_before = runner.outputs(1) if mapping.inspect is not None else None
    readers = [block.get_submodule(b) for b in mapping.balance]
    apply_scales(block.get_submodule(mapping.smooth), readers, scales)
    dtype = readers[0].weight.dtype
    require_exact(mapping, where, before, runner.outputs(batches, mapping.inspect), dtype)
    if block_before is not None:
        require_exact(mapping, where, block_before, runner.outputs(1), dtype)


def fold_branches(folds: list[tuple[Mapping, torch.Tensor]], block: torch.nn.Module, runner, where: str,
                  batches: int = 1) -> None:
    """fold for mappings on parallel branches of the block (Mapping._branch: one per expert), each
    still checked on its own inspected module. A branch's fold changes nothing that another
    branch's inspected module reads, so two forwards of the block check them all, where one fold
    at a time takes two forwards each: hundreds per block in a model with many experts."""
    if not folds:
        return
    inspected = [mapping.inspect for mapping, _ in folds]
    before = runner.outputs_of(inspected, batches)
    for mapping, scales in folds:
        apply_scales(block.get_submodule(mapping.smooth), [block.get_submodule(b) for b in mapping.balance], scales)
    after = runner.outputs_of(inspected, batches)
    for mapping, _ in folds:
        require_exact(mapping, where, before[mapping.inspect], after[mapping.inspect],
                      block.get_submodule(mapping.balance[0]).weight.dtype)


@torch.no_grad()
def weight_offset(norm: torch.nn.Module) -> float:
    """1 for a norm whose output is scaled by 1 + weight (Gemma's RMSNorm), 0 for one scaled by its
    weight: found by running the norm once with its weight zeroed, which leaves only its bias (or
    nothing) in the output of the usual kind."""
    w = norm.weight
    saved = w.detach().clone()
    x = torch.linspace(-1.0, 2.0, w.shape[0], device=w.device, dtype=w.dtype).expand(2, -1)
    try:
        w.zero_()
        y = norm(x).float()
    finally:
        w.copy_(saved)
    bias = getattr(norm, "bias", None)
    rest = bias.float().expand_as(y) if isinstance(bias, torch.Tensor) else torch.zeros_like(y)
    return 0.0 if torch.allclose(y, rest) else 1.0


@torch.no_grad()
def apply_scales(prev: torch.nn.Module, layers: list[torch.nn.Module], scales: torch.Tensor) -> None:
    """Divide prev's output channels by `scales` and multiply the layers' input columns by them."""
    s = scales.float()
    if is_norm(prev):
        offset = weight_offset(prev)
        w = prev.weight.float()
        prev.weight.copy_(((w + offset) / s.to(w.device) - offset).to(prev.weight.dtype))
    else:
        set_weight(prev, get_weight(prev).to(s.device) / s.unsqueeze(1))
    bias = getattr(prev, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias.copy_((bias.float() / s.to(bias.device)).to(bias.dtype))
    scale_inputs(layers, s)


@torch.no_grad()
def scale_inputs(layers: list[torch.nn.Module], scales: torch.Tensor) -> None:
    """Multiply the layers' input columns by `scales` (apply_scales' second half)."""
    s = scales.float()
    for layer in layers:
        set_weight(layer, get_weight(layer).to(s.device) * s.unsqueeze(0))
