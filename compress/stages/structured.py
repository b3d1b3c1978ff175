"""Structured pruning (Minitron: Muralidharan et al. 2024, "Compact Language Models via Pruning
and Knowledge Distillation"): remove whole MLP channels, attention heads (whole GQA groups) or
transformer blocks, ranked by activation-based importance on the calibration set. The pruned
structures are cut out of the weights, so the saved checkpoint has smaller shapes and an updated
config that plain `from_pretrained` loads.

Importance, from one forward pass of the unpruned model over the calibration set (padding excluded):

    MLP channel i      F_i = sqrt( Σ_tokens a_i² / N )
                       a = the activation entering the down projection: act(gate(x)) · up(x) for
                       SwiGLU (Llama, Mistral, Qwen2), act(fc1(x)) for GPT-2, OPT and BERT
    attention head h   F_h = Σ_tokens ||o_h||₂ / N,  o_h = head h's attention output, the slice
                       [h·d, (h+1)·d) of o_proj's input;
                       a KV group's importance is the sum over the query heads that share its KV head
    block b            BI_b = 1 - mean_tokens cos(x_b, y_b)   (Block Importance, ShortGPT / Minitron
                       depth ranking; x_b, y_b the block's input and output hidden states)

The `ratio` of channels / KV groups / blocks with the lowest importance is removed: round(ratio ·
count), which must be at least one and not all. Channels and heads are removed in the same number
from every block (a transformers config holds one width for all layers), each block choosing its
own least important ones; GQA removes whole KV groups (a KV head together with every query head
reading it), so num_key_value_groups is unchanged and head_dim is written into the config
explicitly. Removing blocks renumbers the kept blocks' `layer_idx` (the key of the generation
cache) and `config.layer_types`. The new config is first checked by transformers' own validation
(LlamaConfig, for one, wants hidden_size to be a multiple of the query heads), so a ratio that
would give an unloadable checkpoint is refused, with the ratios that work, before any work.

Supported: mlp-channels and blocks on Llama, Mistral, Qwen2, Qwen3, Gemma 1-3, Phi-3, GPT-2, OPT
and BERT; heads on all but the last three (GPT-2, OPT and BERT derive the head size from the
hidden size, so a config with fewer heads cannot say what remains). Phi-3 stacks gate and up in
one layer, and q, k and v in another: the kept channels and heads are cut from each part. The
mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE take heads and blocks (their experts' MLPs
stay whole); removing blocks rewrites which of the kept layers have a dense MLP.

The statistics are gathered through the calibration engine with the model unchanged (one block
on the device at a time, each seeing the unpruned model's hidden states, as Minitron ranks every
structure on the unpruned model), and the cut is made once every block has been scored: depth
ranking needs every block's score before any block can be chosen. `offload: disk` is refused
(it runs one stage that compresses weights block by block, and this one changes shapes).

Sample recipe stage:

    - structured:
        structure: mlp-channels     # mlp-channels, heads (KV groups) or blocks
        ratio: 0.25                 # share of channels / KV groups / blocks removed
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch
from pydantic import Field, model_validator

from compress import activations
from compress.engine import find_blocks, observe_layers, token_rows
from compress.errors import CompressError
from compress.modeling import weight_shape
from compress.sparsity import parse_pattern
from compress.stages.base import Stage, StageContext, done_by, from_input

# ---------------------------------------------------------------------------------------------
# The math: plain functions on tensors


def channel_importance(sum_sq: torch.Tensor, tokens: int) -> torch.Tensor:
    """RMS over tokens of each channel's activation: sqrt(Σ a_i² / N)."""
    return (sum_sq / max(tokens, 1)).sqrt()


def group_importance(head_norm_sum: torch.Tensor, tokens: int, num_kv_heads: int) -> torch.Tensor:
    """Mean per-token L2 norm of each query head's output, summed over the heads of each KV group
    (query head h reads KV head h // n_rep)."""
    per_head = head_norm_sum / max(tokens, 1)
    return per_head.reshape(num_kv_heads, -1).sum(dim=1)


def token_cosine(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each token's hidden state before and after a block: [..., hidden] -> [...]."""
    return torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1, eps=1e-8)


def keep_most_important(scores: torch.Tensor, n_remove: int) -> torch.Tensor:
    """Indices (ascending) of all but the `n_remove` lowest scores; ties go to the lower index."""
    order = torch.argsort(scores.float().cpu(), stable=True)
    return order[n_remove:].sort().values


def rows_of(units: torch.Tensor, width: int) -> torch.Tensor:
    """Rows [u·width, (u+1)·width) of every unit u (a head), in order."""
    return (units[:, None] * width + torch.arange(width)[None, :]).reshape(-1)


def prune_outputs(module: torch.nn.Module, idx: torch.Tensor) -> None:
    """Keep output features `idx` of a Linear (or GPT-2 Conv1D, whose weight is [in, out])."""
    conv1d = type(module).__name__ == "Conv1D"
    idx = idx.to(module.weight.device)
    w = module.weight.data
    module.weight = torch.nn.Parameter((w[:, idx] if conv1d else w[idx]).clone(), requires_grad=module.weight.requires_grad)
    if getattr(module, "bias", None) is not None:
        module.bias = torch.nn.Parameter(module.bias.data[idx].clone(), requires_grad=module.bias.requires_grad)
    if conv1d:
        module.nf = len(idx)
    else:
        module.out_features = len(idx)


def prune_inputs(module: torch.nn.Module, idx: torch.Tensor) -> None:
    """Keep input features `idx` of a Linear (or GPT-2 Conv1D); the bias is per output, unchanged."""
    conv1d = type(module).__name__ == "Conv1D"
    idx = idx.to(module.weight.device)
    w = module.weight.data
    module.weight = torch.nn.Parameter((w[idx] if conv1d else w[:, idx]).clone(), requires_grad=module.weight.requires_grad)
    if conv1d:
        module.nx = len(idx)
    else:
        module.in_features = len(idx)


def non_embedding_parameters(model: torch.nn.Module) -> int:
    """Parameters outside token/position embeddings and the output embedding (lm_head)."""
    skip = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is not None:
        skip |= {id(p) for p in out.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


# ---------------------------------------------------------------------------------------------
# Where each family keeps its MLP and attention (module names relative to a block)


@dataclass(frozen=True)
class Family:
    mlp_in: tuple[str, ...]  # layers whose output features are the MLP channels
    mlp_out: Optional[str]  # the layer whose input features are the MLP channels; None: not prunable
    mlp_width: Optional[str]  # config key of the MLP width
    attention: Optional[tuple[str, str, str, str]] = None  # q, k, v, o; None: heads cannot be pruned
    # Phi-3: mlp_in is one layer with gate and up stacked ([gate; up] output rows), and q, k and v
    # name one layer with [q; k; v] rows
    fused: bool = False


_LLAMA = Family(("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj", "intermediate_size",
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"))
FAMILIES = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,  # q_norm and k_norm act within a head: unchanged by removing heads
    "gemma": _LLAMA,
    "gemma2": _LLAMA,
    "gemma3_text": _LLAMA,
    "phi3": Family(("mlp.gate_up_proj",), "mlp.down_proj", "intermediate_size",
                   ("self_attn.qkv_proj",) * 3 + ("self_attn.o_proj",), fused=True),
    # Mixture of experts: Llama's attention; the experts' MLPs are left whole (heads and blocks only)
    "mixtral": Family((), None, None, _LLAMA.attention),
    "qwen2_moe": Family((), None, None, _LLAMA.attention),
    "qwen3_moe": Family((), None, None, _LLAMA.attention),
    "gpt2": Family(("mlp.c_fc",), "mlp.c_proj", "n_inner"),
    "opt": Family(("fc1",), "fc2", "ffn_dim"),
    "bert": Family(("intermediate.dense",), "output.dense", "intermediate_size"),
}
_HEADS = [t for t, f in FAMILIES.items() if f.attention]
_NO_HEADS_WHY = "its config derives the head size from the hidden size, so a model with fewer heads cannot be saved"


# ---------------------------------------------------------------------------------------------
# Statistics, gathered by the calibration engine's observers


class _Stats:
    """Per-block sums over the calibration tokens (padding excluded) and their token counts."""

    def __init__(self, n_blocks: int):
        self.sums: list[Optional[torch.Tensor]] = [None] * n_blocks
        self.tokens = [0] * n_blocks

    def add(self, b: int, value: torch.Tensor, count: int) -> None:
        value = value.detach().float()
        self.sums[b] = value if self.sums[b] is None else self.sums[b] + value
        self.tokens[b] += count


class _Observer:
    """Adds one block's importance statistics from the module it is hooked on: the down
    projection's input (MLP channels), o_proj's input (heads), or the block itself (its input and
    output: block importance)."""

    def __init__(self, stats: _Stats, b: int, structure: str, num_heads: int):
        self.stats, self.b, self.structure, self.num_heads = stats, b, structure, num_heads

    def add(self, inputs: tuple, output, mask: torch.Tensor | None) -> None:
        if self.structure == "mlp-channels":
            a = token_rows(inputs, mask)
            self.stats.add(self.b, (a * a).sum(0), a.shape[0])
        elif self.structure == "heads":
            o = token_rows(inputs, mask)
            o = o.reshape(-1, self.num_heads, o.shape[-1] // self.num_heads)
            self.stats.add(self.b, o.norm(dim=-1).sum(0), o.shape[0])
        else:
            y = output[0] if isinstance(output, (tuple, list)) else output
            cos = token_rows((token_cosine(inputs[0], y).unsqueeze(-1),), mask).reshape(-1)
            self.stats.add(self.b, cos.sum(), cos.numel())


# ---------------------------------------------------------------------------------------------
# The stage


class Structured(Stage):
    """Structured pruning that removes MLP channels, KV groups of heads, or whole blocks."""

    structure: Literal["mlp-channels", "heads", "blocks"] = Field(
        ..., description="what to remove: mlp-channels, heads (whole KV groups) or blocks")
    ratio: float = Field(..., gt=0, lt=1, description="share of MLP channels / KV groups / blocks removed, in (0, 1)")
    multiple_of: Optional[int] = Field(
        None, ge=1, description="mlp-channels: keep a multiple of this many channels (the nearest to what ratio keeps, "
                                "ties keeping more), e.g. a later stage's group_size, so its groups fit and it packs")

    @model_validator(mode="after")
    def _multiple_of_channels(self):
        if self.multiple_of is not None and self.structure != "mlp-channels":
            raise ValueError(f"multiple_of rounds the MLP channels kept; it does not apply to {self.structure}")
        return self

    @property
    def needs_calibration(self) -> bool:
        return True  # importance is measured on the calibration activations

    def apply(self, model: torch.nn.Module, ctx: StageContext) -> dict:
        config = model.config
        family = self._family(model)
        path, blocks = find_blocks(model)
        if ctx.calibration is None or not ctx.calibration.samples:
            raise CompressError("stage structured needs calibration data to rank importance", "add a calibration section to the recipe")
        before, before_ne = sum(p.numel() for p in model.parameters()), non_embedding_parameters(model)
        total, unit, n_remove, changes = self._removal(model, family, blocks)

        self._check_earlier_stages(blocks, path, family, config, ctx.layers)
        stats, calibration = self._collect(model, path, blocks, family, ctx)
        details: dict = {}
        if self.structure == "mlp-channels":
            keep = [keep_most_important(channel_importance(stats.sums[b], stats.tokens[b]), n_remove) for b in range(len(blocks))]
            details["kept_per_block"] = f"{total - n_remove} of {total} MLP channels"
        elif self.structure == "heads":
            keep = [keep_most_important(group_importance(stats.sums[b], stats.tokens[b], total), n_remove) for b in range(len(blocks))]
            new = changes(n_remove)
            details["kept_per_block"] = (f"{new['num_key_value_heads']} of {total} KV groups "
                                         f"({new['num_attention_heads']} query heads, head_dim {new['head_dim']})")
        else:
            scores = torch.tensor([1 - s.item() / max(t, 1) for s, t in zip(stats.sums, stats.tokens)])
            keep = keep_most_important(scores, n_remove).tolist()
            details["kept_blocks"] = f"{len(keep)} of {total}"
            # numbered as in the input model: a second blocks stage's indices are not the first one's
            details["removed_blocks"] = [getattr(blocks[i], INPUT_INDEX, i) for i in range(total) if i not in keep]
            details["block_importance"] = [round(float(s), 5) for s in scores]
        self._cut(model, path, blocks, family, keep, changes(n_remove), ctx.layers)
        if ctx.kv_cache is not None:  # an FP8 KV cache's scales follow their attention layer to its new index
            ctx.kv_cache = activations.attached_kv(model)
        if self.structure != "blocks":  # which channels / heads each block kept, in its record
            layer = family.mlp_out if self.structure == "mlp-channels" else family.attention[3]
            for b, kept in enumerate(keep):
                what = {"kept_channels": kept.tolist()} if self.structure == "mlp-channels" else \
                    {"kept_kv_heads": kept.tolist(), "kept_heads": self._query_heads(kept, config).tolist()}
                ctx.layers[f"{path}.{b}.{layer}"].update({"stage": "structured", **what})

        after, after_ne = sum(p.numel() for p in model.parameters()), non_embedding_parameters(model)
        return {
            "structure": self.structure,
            "ratio": self.ratio,
            "scheme": f"structured {self.structure} {self.ratio:g}",  # the one-line description every stage gives
            "removed": f"{n_remove} of {total} {unit}" + (" per block" if self.structure != "blocks" else ""),
            **details,
            "calibration_tokens": max(stats.tokens),
            "parameters_before": before,
            "parameters_after": after,
            "parameters_removed_pct": 100 * (before - after) / before,
            "non_embedding_parameters_before": before_ne,
            "non_embedding_parameters_after": after_ne,
            "non_embedding_removed_pct": 100 * (before_ne - after_ne) / max(before_ne, 1),
            # the calibration engine's summary; its block count is the model's before the cut
            **{("blocks_calibrated" if k == "blocks" else k): v for k, v in calibration.items()},
        }

    @property
    def reshapes(self) -> bool:
        return True

    def reshape(self, model: torch.nn.Module, records: dict[str, dict]) -> bool:
        """The cut `apply` makes, with the first channels, KV groups or blocks standing in for the
        ones calibration will rank highest: what later stages will see, for `compress plan` and the
        checks made before the first stage (on a meta-device model). Returns whether the shapes
        are the run's: not when blocks are removed from a model whose blocks differ (a Qwen-MoE's
        dense and expert layers), where which ones go decides the shapes left."""
        family = self._family(model)
        path, blocks = find_blocks(model)
        total, _, n_remove, changes = self._removal(model, family, blocks)
        first = torch.arange(total - n_remove)
        keep = first.tolist() if self.structure == "blocks" else [first] * len(blocks)
        alike = len({tuple((n, tuple(p.shape)) for n, p in b.named_parameters()) for b in blocks}) == 1
        self._cut(model, path, blocks, family, keep, changes(n_remove), records)
        return self.structure != "blocks" or alike

    def _cut(self, model: torch.nn.Module, path: str, blocks, family: Family, keep, config_changes: dict,
             records: dict[str, dict]) -> None:
        """Remove all but `keep` (per block: channel or KV group indices; for blocks, the block
        indices) and update the config; `records` (per-layer, as StageContext.layers) follow."""
        config = model.config
        if self.structure == "mlp-channels":
            self._prune_mlp(blocks, path, family, keep, records)
        elif self.structure == "heads":
            self._prune_heads(blocks, path, family, config, keep, records)
        else:
            self._remove_blocks(model, path, blocks, keep, records)
        per_layer = per_layer_config(config, keep) if self.structure == "blocks" else {}
        for key, value in {**config_changes, **per_layer}.items():
            setattr(config, key, value)

    # -- checks

    def preflight(self, model: torch.nn.Module) -> None:
        self._family(model)

    def preflight_shapes(self, model: torch.nn.Module, records: dict[str, dict], source: torch.nn.Module) -> None:
        """What the ratio removes, on the shapes the stage will see, and whether what earlier
        stages will do to the layers it cuts (`records`, as StageContext.layers) allows the cut."""
        family = self._family(model)
        path, blocks = find_blocks(model)
        self._removal(model, family, blocks)
        self._check_earlier_stages(blocks, path, family, model.config, records)

    def _removal(self, model: torch.nn.Module, family: Family, blocks) -> tuple[int, str, int, Callable[[int], dict]]:
        """(total units, their name, units removed, config changes for n removed); refuses a ratio that removes
        nothing or everything, and a config transformers would refuse to save or load."""
        config = model.config
        if self.structure == "mlp-channels":
            total, unit = weight_shape(blocks[0].get_submodule(family.mlp_out))[1], "MLP channels"
        elif self.structure == "heads":
            total, unit = config.num_key_value_heads, "KV groups of heads"
        else:
            total, unit = len(blocks), "blocks"
        n_remove = math.floor(self.ratio * total + 0.5)
        if self.multiple_of:  # the nearest multiple to what the ratio keeps; at a tie, the larger
            m = self.multiple_of
            n_remove = total - m * math.floor((total - n_remove) / m + 0.5)
        if total == 1:
            one = unit.replace("channels", "channel").replace("groups", "group").replace("blocks", "block")
            raise CompressError(f"stage structured: the model has only 1 {one}: there is nothing to remove",
                                "drop this stage")
        if n_remove == 0 or n_remove >= total:
            what = "nothing" if n_remove == 0 else "all of them"
            keeps = f" keeping a multiple of {self.multiple_of}" if self.multiple_of else ""
            if self.multiple_of and self.multiple_of >= total:  # no ratio keeps a multiple of it below the whole
                raise CompressError(f"stage structured: multiple_of {self.multiple_of} is not below the {total} {unit}: "
                                    f"the only multiple to keep would be {'none' if self.multiple_of > total else 'all'}",
                                    f"lower multiple_of, e.g. to a later stage's group size that divides {total}")
            if self.multiple_of:  # it keeps a multiple of m from m up to the largest below the whole
                m = self.multiple_of
                most = m * ((total - 1) // m)
                hint = (f"choose a ratio that keeps {m} to {most} of them (multiples of {m}), "
                        f"{_ratio_text(total - most, total)} to {_ratio_text(total - m, total)}")
            else:
                hint = (f"it removes round(ratio · {total}); choose a ratio that removes 1 to {total - 1}, "
                        f"{_ratio_text(1, total)} to {_ratio_text(total - 1, total)}")
            raise CompressError(f"stage structured: ratio {self.ratio:g} of {total} {unit}{keeps} removes {what}", hint)
        changes = lambda n: self._config_changes(config, family, blocks, total, n)  # noqa: E731
        problem = _config_problem(config, changes(n_remove))
        if problem is not None:
            valid = [n for n in range(1, total) if _config_problem(config, changes(n)) is None]
            raise CompressError(f"stage structured: removing {n_remove} of {total} {unit} gives a config that "
                                f"{type(config).__name__} rejects: {problem}",
                                f"ratios that give a valid config: {', '.join(_ratio_text(n, total) for n in valid)}"
                                if valid else f"{self.structure} pruning cannot give a valid config for this model")
        return total, unit, n_remove, changes

    def _family(self, model: torch.nn.Module) -> Family:
        model_type = getattr(model.config, "model_type", None)
        family = FAMILIES.get(model_type)
        if family is None:
            raise CompressError(f"stage structured: architecture '{model_type}' is not supported "
                                f"(supported: {', '.join(FAMILIES)}; heads only on {', '.join(_HEADS)})",
                                "use one of the supported families")
        if self.structure == "heads" and family.attention is None:
            raise CompressError(f"stage structured: heads pruning is not supported for '{model_type}': {_NO_HEADS_WHY} "
                                f"(heads: {', '.join(_HEADS)}; mlp-channels: {', '.join(n for n, f in FAMILIES.items() if f.mlp_out)}; "
                                f"blocks: {', '.join(FAMILIES)})",
                                "prune mlp-channels or blocks instead")
        if self.structure == "mlp-channels" and family.mlp_out is None:
            raise CompressError(f"stage structured: mlp-channels pruning is not supported for the mixture-of-experts "
                                f"'{model_type}': its MLPs are experts, each of its own width in one fused tensor",
                                "prune heads or blocks instead")
        return family

    def _check_earlier_stages(self, blocks, path: str, family: Family, config, records: dict[str, dict]) -> None:
        """Input columns cut out of a layer quantized in groups (or pruned N:M) by an earlier stage
        would leave its groups misaligned: refused, unless each cut spans whole groups. A KV group
        goes with its query heads, which sit side by side in the output projection's input (query
        head h reads KV group h // n_rep): n_rep · head_dim columns at a time. `records`: what
        earlier stages did (or, before the first stage, will do) to each layer."""
        if self.structure == "blocks":
            return
        if self.structure == "mlp-channels":
            layer, unit = family.mlp_out, 1
        else:
            n_rep = config.num_attention_heads // config.num_key_value_heads
            head_dim = _head_dim(blocks[0].get_submodule(family.attention[0].rsplit(".", 1)[0]), config)
            layer, unit = family.attention[3], n_rep * head_dim
        cut = (*family.mlp_in, family.mlp_out) if self.structure == "mlp-channels" else family.attention
        for b in range(len(blocks)):
            for name in dict.fromkeys(f"{path}.{b}.{n}" for n in cut):
                rec = records.get(name, {})
                # FP8 tiles span rows and columns: any cut leaves a tile's scale on other weights
                if (rec.get("weights") or {}).get("strategy") == "block":
                    raise CompressError(f"stage structured: layer {name} was quantized in FP8 tiles of "
                                        f"{'x'.join(map(str, rec['weights']['block_structure']))} by {done_by(rec)}; removing "
                                        f"{self.structure} cuts through them",
                                        "start from the model before it was compressed, with the structured stage first"
                                        if from_input(rec) else "put the structured stage before quantization")
            name = f"{path}.{b}.{layer}"
            rec = records.get(name, {})
            group = (rec.get("weights") or {}).get("group_size") if (rec.get("weights") or {}).get("strategy") == "group" else None
            pattern = rec.get("pattern")
            if (group and unit % group) or (pattern and unit % parse_pattern(pattern)[1]):  # N:M: whole runs of M kept
                what = f"quantized in groups of {group} input columns" if group else f"pruned {pattern}"
                raise CompressError(f"stage structured: layer {name} was {what} by {done_by(rec)}; removing "
                                    f"{self.structure} cuts its input columns and breaks that layout",
                                    "start from the model before it was compressed, with the structured stage first"
                                    if from_input(rec) else "put the structured stage before quantization and N:M pruning")

    def _config_changes(self, config, family: Family, blocks, total: int, n_remove: int) -> dict:
        """The config values after removing `n_remove` of `total` structures."""
        if self.structure == "mlp-channels":
            return {family.mlp_width: total - n_remove}
        if self.structure == "heads":
            n_rep = config.num_attention_heads // config.num_key_value_heads
            return {"num_attention_heads": (total - n_remove) * n_rep, "num_key_value_heads": total - n_remove,
                    "head_dim": _head_dim(blocks[0].get_submodule(family.attention[0].rsplit(".", 1)[0]), config)}
        # per-layer values for the first blocks stand in for the kept ones, known once ranked
        return {"num_hidden_layers": total - n_remove, **per_layer_config(config, list(range(total - n_remove)))}

    # -- the pass over the calibration set

    @torch.no_grad()
    def _collect(self, model: torch.nn.Module, path: str, blocks: torch.nn.ModuleList, family: Family,
                 ctx: StageContext) -> tuple[_Stats, dict]:
        """Every structure's statistics over the calibration set, through the calibration engine (one
        block on the device at a time; the model unchanged, so each block sees the unpruned model's
        hidden states)."""
        stats = _Stats(len(blocks))
        hooked = {"mlp-channels": family.mlp_out, "heads": family.attention and family.attention[3]}.get(self.structure)
        selected = {f"{path}.{b}" + (f".{hooked}" if hooked else ""): block.get_submodule(hooked) if hooked else block
                    for b, block in enumerate(blocks)}
        index = {name: b for b, name in enumerate(selected)}
        heads = model.config.num_attention_heads
        _, calibration = observe_layers(model, ctx, selected,
                                        lambda name, module: _Observer(stats, index[name], self.structure, heads), blocks_path=path)
        for b, s in enumerate(stats.sums):
            if s is None or not torch.isfinite(s).all():
                raise CompressError(f"stage structured: block {b} saw no finite calibration activations",
                                    "check the calibration data, or load the model in float32 (--dtype float32)")
        return stats, calibration  # the engine's summary: blocks, batches, parameters on the device

    # -- cutting

    @staticmethod
    def _query_heads(groups: torch.Tensor, config) -> torch.Tensor:
        """The query heads reading the KV heads `groups`, in order."""
        n_rep = config.num_attention_heads // config.num_key_value_heads
        return (groups[:, None] * n_rep + torch.arange(n_rep)[None, :]).reshape(-1)

    def _prune_mlp(self, blocks, path: str, family: Family, keep: list[torch.Tensor], records: dict[str, dict]) -> None:
        for b, block in enumerate(blocks):
            width = weight_shape(block.get_submodule(family.mlp_out))[1]
            rows = torch.cat([keep[b], keep[b] + width]) if family.fused else keep[b]  # [gate; up] stacked
            for name in family.mlp_in:
                prune_outputs(block.get_submodule(name), rows)
            down = block.get_submodule(family.mlp_out)
            prune_inputs(down, keep[b])
            mlp = block.get_submodule(family.mlp_out.rsplit(".", 1)[0]) if "." in family.mlp_out else block
            if isinstance(getattr(mlp, "intermediate_size", None), int):
                mlp.intermediate_size = len(keep[b])  # LlamaMLP keeps its width
            _update_shapes(records, f"{path}.{b}.", block, (*family.mlp_in, family.mlp_out))

    def _prune_heads(self, blocks, path: str, family: Family, config, keep: list[torch.Tensor], records: dict[str, dict]) -> None:
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        d = _head_dim(blocks[0].get_submodule(family.attention[0].rsplit(".", 1)[0]), config)
        for b, block in enumerate(blocks):
            groups = keep[b]
            q_heads = self._query_heads(groups, config)
            q_rows, kv_rows = rows_of(q_heads, d), rows_of(groups, d)
            q, k, v, o = (block.get_submodule(n) for n in family.attention)
            if family.fused:  # one layer, [q; k; v] rows: heads · d, then kv · d twice
                prune_outputs(q, torch.cat([q_rows, heads * d + kv_rows, (heads + kv) * d + kv_rows]))
            else:
                prune_outputs(q, q_rows)
                prune_outputs(k, kv_rows)
                prune_outputs(v, kv_rows)
            prune_inputs(o, q_rows)
            attn = block.get_submodule(family.attention[0].rsplit(".", 1)[0])
            for attr, value in (("num_heads", len(q_heads)), ("num_attention_heads", len(q_heads)),
                                ("num_key_value_heads", len(groups)), ("head_dim", d)):
                if isinstance(getattr(attn, attr, None), int):
                    setattr(attn, attr, value)
            _update_shapes(records, f"{path}.{b}.", block, family.attention)

    @staticmethod
    def _remove_blocks(model: torch.nn.Module, path: str, blocks: torch.nn.ModuleList, keep: list[int],
                       records: dict[str, dict]) -> None:
        parent_path, attr = path.rsplit(".", 1) if "." in path else ("", path)
        kept = torch.nn.ModuleList([blocks[i] for i in keep])
        for old, block in zip(keep, kept):
            if not hasattr(block, INPUT_INDEX):  # set by the first removal on every block it keeps
                setattr(block, INPUT_INDEX, old)
        for new, block in enumerate(kept):
            for m in block.modules():
                if isinstance(getattr(m, "layer_idx", None), int):
                    m.layer_idx = new  # the generation cache is indexed by it
        setattr(model.get_submodule(parent_path), attr, kept)
        # Records of earlier stages follow their block to its new index; those of removed blocks go.
        renamed = {}
        for name, rec in records.items():
            if name.startswith(path + "."):
                old, rest = name[len(path) + 1:].split(".", 1)
                if int(old) not in keep:
                    continue
                name = f"{path}.{keep.index(int(old))}.{rest}"
            renamed[name] = rec
        records.clear()
        records.update(renamed)


# Each kept block's index in the input model, on the block itself: a later stage that compares a
# layer with the input model's (QAT's error) looks it up there (input_layer_name).
INPUT_INDEX = "_compress_input_index"


def input_layer_name(model: torch.nn.Module, name: str) -> str:
    """What the layer `name` is called in the input model: removing blocks moves the kept ones down."""
    try:
        path, blocks = find_blocks(model)
    except CompressError:
        return name  # an architecture without a block list: nothing was removed
    if not name.startswith(path + "."):
        return name
    index, rest = name[len(path) + 1:].split(".", 1)
    origin = getattr(blocks[int(index)], INPUT_INDEX, None) if index.isdigit() and int(index) < len(blocks) else None
    return name if origin is None else f"{path}.{origin}.{rest}"


def per_layer_config(config, keep: list[int]) -> dict:
    """Config values indexed by layer, for the kept blocks `keep` (old indices, in order): each
    layer's attention kind (`layer_types`: full or sliding), and for Qwen's mixture-of-experts which
    layers have a dense MLP (`mlp_only_layers`, plus every layer off the `decoder_sparse_step`
    period, rewritten as an explicit list with step 1, since the kept layers need not stay periodic)."""
    out = {}
    if isinstance(getattr(config, "layer_types", None), list):
        out["layer_types"] = [config.layer_types[i] for i in keep]
    if isinstance(getattr(config, "mlp_only_layers", None), list) and isinstance(getattr(config, "decoder_sparse_step", None), int):
        def dense(i: int) -> bool:
            return i in config.mlp_only_layers or not (config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0)
        out["mlp_only_layers"] = [new for new, old in enumerate(keep) if dense(old)]
        out["decoder_sparse_step"] = 1
    return out


def _head_dim(attention: torch.nn.Module, config) -> int:
    """Written into the config explicitly: once heads go, it is no longer hidden_size / heads."""
    return getattr(attention, "head_dim", None) or getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _ratio_text(n_remove: int, total: int) -> str:
    """The shortest ratio that removes exactly `n_remove` of `total` (round(ratio · total)): three
    digits are too few near 1 in a wide layer (14335 of 14336 is 0.99993, not "1")."""
    for digits in range(3, 10):
        text = f"{n_remove / total:.{digits}g}"
        if math.floor(float(text) * total + 0.5) == n_remove:
            return text
    return repr(n_remove / total)


def _config_problem(config, changes: dict) -> Optional[str]:
    """Why transformers would refuse `config` with `changes` (its own validation, run by
    save_pretrained and from_pretrained), or None."""
    validate = getattr(config, "validate", None)
    if validate is None:
        return None
    def problem(cfg) -> Optional[str]:
        try:
            cfg.validate()
        except Exception as exc:  # transformers' own validation errors, wrapping a ValueError
            cause = exc.__cause__ or exc
            return str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        return None

    if problem(config) is not None:
        return None  # the model's own config does not pass: nothing to learn from the check
    trial = copy.deepcopy(config)
    for key, value in changes.items():
        setattr(trial, key, value)
    return problem(trial)


def _update_shapes(records: dict[str, dict], prefix: str, block: torch.nn.Module, names) -> None:
    """Every layer the cut reshaped has a record with its new shape: an earlier stage's follows the
    cut (a quantized layer's shape counts its packed size), and one that had none gets one, so the
    report and `compress inspect` list every layer that changed."""
    for name in names:
        rec = records.setdefault(prefix + name, {"stage": "structured"})
        rec["shape"] = list(weight_shape(block.get_submodule(name)))
