"""The layer-by-layer calibration engine, shared by every algorithm that needs activations.

    capture the inputs of the first block for every calibration batch, and the keywords each
        later block gets otherwise (a sliding-window layer's mask)
    for each block:
        bring it to the compute device
        hook its target layers; run every batch through it (the stage's observers accumulate
            statistics, e.g. GPTQ's Hessian)
        let the stage compress the block
        run every batch through the compressed block again: these outputs, carrying this
            block's error as at inference, are the next block's inputs
        send the block back

Only one block and the activations are on the device at once. Cached activations stay on the
device, move to CPU, or spill to disk past `activation_budget` bytes of host memory, so peak
memory does not grow with the number of samples.

A stage plugs in by implementing the `BlockwiseStage` protocol: `observe(name, module)` returns an
observer (or None) whose `add(inputs, output)` is called on every forward of that module, and
`compress_block(block_index, block, prefix, layers, observers, ctx, runner)` does the work (`prefix` is the
block's module name plus a dot; `layers` are the selected modules inside it, by full name, and the
block itself when it is selected). A stage that also has `compress_outside(layers, observers, ctx)`
gets the selected layers outside the blocks (a BERT pooler, a targeted lm_head) observed after the
last block, on the model's own run from the compressed blocks' outputs (`run_outside`), and
compresses them there; without it they see no calibration inputs. A stage that only gathers
statistics (static activation ranges, KV cache scales, structured importance) is an `Observing`:
the block it leaves unchanged runs once, its calibration pass's outputs feeding the next block.
"""

from __future__ import annotations

import contextvars
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from compress.activations import CACHE_ARGUMENTS
from compress.errors import CompressError
from compress.moe import routes_tokens

# Where each family keeps its list of blocks (transformer layers), by config.model_type.
BLOCK_PATHS = {
    "llama": "model.layers",
    "mistral": "model.layers",
    "qwen2": "model.layers",
    "qwen3": "model.layers",
    "mixtral": "model.layers",
    "qwen2_moe": "model.layers",
    "gemma": "model.layers",
    "gemma2": "model.layers",
    "gemma3_text": "model.layers",
    "qwen3_moe": "model.layers",
    "phi3": "model.layers",
    "opt": "model.decoder.layers",
    "gpt2": "transformer.h",
    "bert": "encoder.layer",
}


def find_blocks(model: torch.nn.Module, declared: str | None = None) -> tuple[str, torch.nn.ModuleList]:
    """The ModuleList of transformer blocks: from the recipe's `blocks:` key, else the family table."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    candidates = [declared] if declared else []
    if not declared and model_type in BLOCK_PATHS:
        path = BLOCK_PATHS[model_type]
        # A task head wraps the base model (BertForMaskedLM.bert, LlamaForCausalLM.model).
        candidates += [path, f"{getattr(model, 'base_model_prefix', '')}.{path}", path.split(".", 1)[-1]]
    for path in candidates:
        try:
            blocks = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(blocks, torch.nn.ModuleList) and len(blocks) > 0:
            return path, blocks
    # The model's own ModuleLists, longest first, as the hint: the transformer layers are among them.
    lists = sorted(((n, len(m)) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)),
                   key=lambda item: -item[1])
    found = ", ".join(f"{n} ({k})" for n, k in lists[:4]) if lists else "none"
    example = lists[0][0] if lists else "model.layers"
    if declared:
        raise CompressError(f"`blocks: {declared}` names no ModuleList in this {model_type} model (its ModuleLists: {found})",
                            f"give the dotted path of the transformer layers, e.g. `blocks: {example}`")
    raise CompressError(
        f"architecture '{model_type}' is not known to the calibration engine (its ModuleLists: {found})",
        f"declare its transformer layers in the stage, e.g. `blocks: {example}`",
    )


class Observer(Protocol):
    def add(self, inputs: tuple, output: Any, mask: torch.Tensor | None) -> None: ...


class BlockwiseStage(Protocol):
    def observe(self, name: str, module: torch.nn.Module) -> Observer | None: ...

    def compress_block(self, index: int, block: torch.nn.Module, prefix: str, layers: dict[str, torch.nn.Module],
                       observers: dict[str, Observer], ctx: Any, runner: "BlockRunner") -> None: ...


OUTSIDE = -1  # the block index compress_block is given for the layers outside the blocks


def block_label(index: int) -> str:
    """How progress and notes name where a layer is solved: `block 3`, or outside the blocks."""
    return "outside the blocks" if index == OUTSIDE else f"block {index + 1}"


class SolvesOutsideBlocks:
    """For a BlockwiseStage whose compress_block needs only the layers and their observers (neither
    the block nor a runner): the layers outside the blocks (a BERT pooler, a targeted lm_head) are
    compressed the same way, at block index OUTSIDE, on the inputs run_outside gives them."""

    def compress_outside(self, layers: dict, observers: dict, ctx: Any) -> None:
        self.compress_block(OUTSIDE, None, "", layers, observers, ctx, None)


def token_rows(inputs: tuple, mask: torch.Tensor | None) -> torch.Tensor:
    """A hooked layer's input as float32 [tokens, features], padding positions dropped: what every
    observer accumulates its statistics over."""
    x = inputs[0].detach()
    if mask is not None and x.dim() == 3 and x.shape[:2] == mask.shape:
        x = x[mask.to(x.device).bool()]
    elif mask is not None and x.dim() == 2 and x.shape[0] == mask.numel():
        x = x[mask.reshape(-1).to(x.device).bool()]  # tokens flattened before the layer (OPT's MLP)
    return x.reshape(-1, x.shape[-1]).float()


class BlockRunner:
    """Lets a stage run the block on its cached inputs, e.g. to score candidate scales by the
    block's output error (AWQ)."""

    def __init__(self, block: torch.nn.Module, store: "ActivationStore", records: list, device: torch.device,
                 index: int = 0):
        self.block, self.store, self.records, self.device, self.index = block, store, records, device, index
        self.batch = 0  # the cached batch being run (run_hooked), for the hooks

    def kwargs(self, j: int) -> dict:
        """The keywords this block receives with batch j, on the device."""
        return _move(self.records[j].kwargs_for(self.index), self.device)

    def __len__(self) -> int:
        return len(self.records)

    def spread(self, limit: int | None) -> list[int]:
        """The cached batches a stage takes when it scores on `limit` of them (all without one):
        spread evenly over the calibration set rather than its first ones, which are its longest
        samples (calibration_batches) or, for text cut into windows, its first pages."""
        n = len(self.records)
        if limit is None or limit >= n:
            return list(range(n))
        return [int(j * (n - 1) / max(limit - 1, 1) + 0.5) for j in range(limit)]  # the first and last among them

    def forward(self, j: int, hidden: torch.Tensor | None = None, parameters: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The block's output [batch, seq, features] on cached batch j (or on `hidden`, another
        stream of inputs with batch j's shapes and keywords), with `parameters` (names inside the
        block -> tensors) standing in for the block's own for this call only. Gradients flow when
        the caller enables them, e.g. to learn quantization parameters through the block (AutoRound)."""
        x = self.store.get(j) if hidden is None else hidden
        kwargs = self.kwargs(j)
        if parameters is None:
            return _block_output(self.block(x, **kwargs))
        return _block_output(torch.func.functional_call(self.block, parameters, (x,), kwargs, strict=False))

    def mask(self, j: int) -> torch.Tensor | None:
        """Batch j's [batch, seq] mask of the tokens that count (None: all of them)."""
        mask = self.records[j].mask
        return None if mask is None else mask.to(self.device).bool()

    @torch.no_grad()
    def outputs(self, limit: int | None = None, module: str | None = None) -> list[torch.Tensor]:
        """The block's outputs on `limit` cached batches (spread), as [tokens, features] with the
        padding dropped (it must not count in an error to minimise); with `module` (a path inside
        the block), that sub-module's outputs instead, the forward stopping as soon as it has run."""
        if module is None:
            return [token_rows((self.forward(j),), self.records[j].mask) for j in self.spread(limit)]
        captured: list[torch.Tensor] = []

        def hook(_module, _inputs, output):
            captured.append(token_rows((_block_output(output),), self.records[self.batch].mask))
            raise _StopForward

        self.run_hooked(self.spread(limit), [self.block.get_submodule(module).register_forward_hook(hook)])
        return captured

    def run_hooked(self, batches: list[int], handles: list, before_batch: Callable[[int], None] | None = None) -> None:
        """The block on the cached `batches` with the hooks of `handles` registered (removed
        after, whatever happens); `self.batch` is the batch being run, and a hook may end its
        forward early by raising _StopForward."""
        try:
            for j in batches:
                self.batch = j
                if before_batch is not None:
                    before_batch(j)
                try:
                    self.block(self.store.get(j), **self.kwargs(j))
                except _StopForward:
                    pass
        finally:
            for handle in handles:
                handle.remove()


    @torch.no_grad()
    def outputs_of(self, modules: list[str], limit: int | None = None) -> dict[str, list[torch.Tensor]]:
        """outputs(limit, module) for several sub-modules at once, from whole forwards of the block:
        one pass serves them all (a block's experts). A module that a batch does not reach (an
        expert no token was routed to) has no entry for it."""
        captured: dict[str, list[torch.Tensor]] = {name: [] for name in modules}

        def hook_for(name: str):
            def hook(_module, _inputs, output):
                captured[name].append(token_rows((_block_output(output),), self.records[self.batch].mask))
            return hook

        self.run_hooked(self.spread(limit), [self.block.get_submodule(name).register_forward_hook(hook_for(name))
                                             for name in captured])
        return captured


    @torch.no_grad()
    def calls(self, module: str, fed_by: str, limit: int | None = None) -> list["ModuleCall"] | None:
        """How `module` (a path inside the block) is called on `limit` cached batches (spread), the
        forward stopping there; None unless one of its arguments is `fed_by`'s output itself (then
        a stage may call it again with that input changed, skipping the rest of the block: AWQ)."""
        batches = self.spread(limit)
        fed, found = [None], []

        def keep_output(_module, _inputs, output):
            fed[0] = output

        def stop_at_call(_module, args, kwargs):
            where = next((i for i, a in enumerate(args) if a is fed[0]), None)
            where = next((k for k, v in kwargs.items() if v is fed[0]), None) if where is None else where
            found.append(ModuleCall(args, kwargs, self.records[self.batch].mask, where))
            raise _StopForward

        self.run_hooked(batches, [self.block.get_submodule(fed_by).register_forward_hook(keep_output),
                            self.block.get_submodule(module).register_forward_pre_hook(stop_at_call, with_kwargs=True)],
                        before_batch=lambda j: fed.__setitem__(0, None))
        return found if len(found) == len(batches) and all(c.input is not None for c in found) else None


@dataclass
class ModuleCall:
    """One call of a sub-module in a block forward (BlockRunner.calls): its arguments, the batch's
    padding mask, and which argument (an index or a keyword) is the tracked input."""
    args: tuple
    kwargs: dict
    mask: torch.Tensor | None
    where: int | str | None

    @property
    def input(self) -> torch.Tensor | None:
        if self.where is None:
            return None
        return self.args[self.where] if isinstance(self.where, int) else self.kwargs[self.where]

    def run(self, module: torch.nn.Module, x: torch.Tensor | None = None) -> torch.Tensor:
        """The module called again (with x in place of the tracked input): [tokens, features], padding dropped."""
        args, kwargs = list(self.args), dict(self.kwargs)
        if x is not None and isinstance(self.where, int):
            args[self.where] = x
        elif x is not None:
            kwargs[self.where] = x
        return token_rows((_block_output(module(*args, **kwargs)),), self.mask)


class _StopForward(Exception):
    """Ends a forward early: once the last block's keywords are recorded, or a layer has run."""


def _raise_stop(_module, _inputs, _output):
    raise _StopForward


@dataclass
class BlockInput:
    hidden: torch.Tensor
    kwargs: dict  # the keywords the first block receives
    mask: torch.Tensor | None  # [batch, seq] of the tokens that count (padding excluded)
    # block index -> the keywords it receives otherwise than the first block: a sliding-window
    # layer's mask beside a full-attention one, Gemma 3's local and global rotary tables (_ABSENT:
    # one the first block gets and this one does not)
    per_block: dict[int, dict] = field(default_factory=dict)

    def kwargs_for(self, block: int) -> dict:
        own = self.per_block.get(block)
        if own is None:
            return self.kwargs
        return {k: v for k, v in {**self.kwargs, **own}.items() if v is not _ABSENT}


class ActivationStore:
    """Block inputs of every batch: on the device, on CPU, or on disk past a host-memory budget."""

    def __init__(self, device: torch.device, keep_on_device: bool, budget_bytes: int | None):
        self.device = device
        self.keep_on_device = keep_on_device
        self.budget = budget_bytes
        self.items: list[torch.Tensor | Path] = []
        self.in_memory = 0
        self._dir: tempfile.TemporaryDirectory | None = None
        self.spilled = 0

    def append(self, hidden: torch.Tensor) -> None:
        size = hidden.numel() * hidden.element_size()
        if self.budget is not None and self.in_memory + size > self.budget:
            if self._dir is None:
                self._dir = tempfile.TemporaryDirectory(prefix="compress-activations-")
            path = Path(self._dir.name) / f"{len(self.items)}.pt"
            try:
                torch.save(hidden.detach().cpu(), path)
            except (OSError, RuntimeError) as exc:  # torch reports a full disk as "unexpected pos"
                raise CompressError(f"spilling calibration activations to {self._dir.name} failed "
                                    f"({str(exc).splitlines()[0][:120]})",
                                    "free disk space there (or set TMPDIR to a disk with room), or raise "
                                    "activation_budget") from exc
            self.items.append(path)
            self.spilled += 1
            return
        self.in_memory += size
        self.items.append(hidden.detach() if self.keep_on_device else hidden.detach().cpu())

    def __len__(self) -> int:
        return len(self.items)

    def drop_last(self) -> None:
        item = self.items.pop()
        if isinstance(item, Path):
            item.unlink(missing_ok=True)
            self.spilled -= 1
        else:
            self.in_memory -= item.numel() * item.element_size()

    def get(self, i: int) -> torch.Tensor:
        item = self.items[i]
        if isinstance(item, Path):
            return torch.load(item, weights_only=True).to(self.device)
        return item.to(self.device)

    def close(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()


# Tokens per calibration forward with `batch_size: auto`. One sample per forward leaves a GPU
# launch-bound on all but large models (ref-llama's 128 windows: 1.0 s at one window, 0.12 s at
# eight, on an H100); on the CPU a few samples per forward help a little (MiniLM's 128 lines, padded
# eight to a forward: GPTQ stage 6.3-6.6 s -> 5.6-5.7 s). The budget bounds the transient
# activations of the widest layer (4096 tokens x 28672 features x 4 bytes = 470 MB).
AUTO_BATCH_TOKENS = {"cpu": 1024, "cuda": 4096}


# rotary embeddings whose tables depend on the length of the batch (the padded one): LongRoPE
# (Phi-3 128k) switches to its long factors past original_max_position_embeddings, dynamic NTK
# rescales past max_position_embeddings
_LENGTH_DEPENDENT_ROPE = ("longrope", "dynamic")


def padding_changes_results(model: torch.nn.Module) -> str | None:
    """Why padding a sample to a longer batch would change what the model computes for it (None
    where the mask makes padding harmless): then samples of different lengths run one per forward."""
    if routes_tokens(model):
        return "in a mixture-of-experts model the padding would reach the experts as if it were text"
    config = getattr(model, "config", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    for params in (rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope else [rope]):
        kind = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
        if kind in _LENGTH_DEPENDENT_ROPE:
            return f"the model's rotary embedding ({kind}) depends on the padded length, so padding would change a sample's positions"
    return None


def resolve_batch_size(batch_size: int | str, device: torch.device, samples: list[dict], no_padding: bool = False) -> int:
    """A stage's `batch_size`; `auto` fills the device's token budget (the CPU's for other device
    types) with as many samples as fit at the longest one's length, at least one. Samples of
    different lengths are padded, and every observer drops the padding (`token_rows`), except
    where padding would change the results (`no_padding`: padding_changes_results, e.g. an expert
    sees a gathered subset of tokens that no mask lines up with): there `auto` pads nothing and
    runs such samples one per forward."""
    if batch_size != "auto":
        return int(batch_size)
    lengths = {s["input_ids"].shape[1] for s in samples}
    if not lengths or (no_padding and len(lengths) > 1):
        return 1
    return max(1, AUTO_BATCH_TOKENS.get(device.type, AUTO_BATCH_TOKENS["cpu"]) // max(lengths))


def calibration_batches(samples: list[dict], batch_size: int) -> list[dict]:
    """The batches the engine runs: samples concatenated `batch_size` at a time (as resolved by
    `resolve_batch_size`), padded to the longest where lengths differ. Samples go longest first, so
    each batch holds samples of about one length and pads little (MiniLM's benchmark calibration,
    13,314 tokens in batches of 8, fills 16,376 token slots in the given order, 13,656 sorted);
    the first forward is then the largest, so one that does not fit fails at once. Equal lengths
    keep their order."""
    samples = sorted(samples, key=lambda s: -s["input_ids"].shape[1])
    out = []
    for start in range(0, len(samples), batch_size):
        group = samples[start : start + batch_size]
        length = max(s["input_ids"].shape[1] for s in group)
        batch: dict[str, list] = {}
        for s in group:
            pad = length - s["input_ids"].shape[1]
            mask = s.get("attention_mask", torch.ones_like(s["input_ids"]))
            for key, value in {**s, "attention_mask": mask}.items():
                batch.setdefault(key, []).append(torch.nn.functional.pad(value, (0, pad)) if pad else value)
        merged = {k: torch.cat(v) for k, v in batch.items()}
        if all("attention_mask" not in s for s in group) and bool(merged["attention_mask"].all()):
            merged.pop("attention_mask")  # causal LMs without padding: let the model build its own mask
        out.append(merged)
    return out


@contextmanager
def on_device(module: torch.nn.Module, device: torch.device):
    """`module` on `device` for a while, then back on the CPU in the memory it had there (returned_home)."""
    if device.type == "cpu":
        yield module
        return
    with returned_home(module, lambda: module.to(device)):
        yield module


@contextmanager
def returned_home(module: torch.nn.Module, move: Callable[[], Any]):
    """`move` the module elsewhere for a while. Back on the CPU, each tensor's values are copied into
    the memory it had there rather than moved into new memory: tensors that share memory keep
    sharing it (an unfused expert's weights are views of the fused parameters, moe.Expert), so a
    model's RAM is not allocated a second time, block by block, over a run on an accelerator."""
    home = [(owner, kind, name, tensor.data) for owner in module.modules() for kind in ("_parameters", "_buffers")
            for name, tensor in getattr(owner, kind).items() if tensor is not None and tensor.device.type == "cpu"]
    failed = True
    try:
        move()
        yield module
        failed = False
    finally:
        try:
            with torch.no_grad():
                for owner, kind, name, cpu in home:
                    now = getattr(owner, kind).get(name)
                    if now is None or now.shape != cpu.shape or now.dtype != cpu.dtype or now.data_ptr() == cpu.data_ptr():
                        continue  # not moved, or replaced with another shape or type (moved below as it is)
                    cpu.copy_(now)
                    if kind == "_parameters":
                        now.data = cpu  # the same Parameter object, as module.to() keeps it
                    else:
                        owner._buffers[name] = cpu
            module.to("cpu")
        except Exception:
            if not failed:
                raise
            # already failing (a device error may fail every copy too): that error is the one to see


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_move(v, device) for v in value)
    if isinstance(value, list):
        return [_move(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value


class BlockStandIn(torch.nn.Module):
    """Takes block `index`'s place in the model's layer loop for a while (blocks_swapped): calls
    `forward(index, hidden, *args, **kwargs)`, and answers for the block any attribute the loop
    reads from it (Qwen2 reads decoder_layer.attention_type). The blocks are not registered in it,
    so moving the model moves everything but them."""

    def __init__(self, blocks: torch.nn.ModuleList, index: int, forward: Callable):
        super().__init__()
        self.index = index
        self.__dict__["_blocks"], self.__dict__["_forward"] = blocks, forward

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_blocks"][self.__dict__["index"]], name)

    def forward(self, hidden, *args, **kwargs):
        return self.__dict__["_forward"](self.index, hidden, *args, **kwargs)


@torch.no_grad()
def capture_block_inputs(model, path: str, blocks: torch.nn.ModuleList, batches: list[dict],
                         device: torch.device, store: ActivationStore) -> tuple[list[BlockInput], str | None]:
    """Run the model through its block loop for every batch and record what the blocks receive.

    The block list is swapped for recorders while the rest of the model (embeddings, rotary
    tables, norms: everything outside the blocks) sits on the device. The first recorder keeps the
    hidden states and keywords; each later one passes its input on untouched and keeps only the
    keywords that differ from the first block's (models with mixed layer types hand each type its
    own mask or rotary tables), sharing one copy among the blocks given the same object; the last
    one ends the forward. Positional arguments are bound to each block's parameter names so they
    can be replayed as keywords. Returns the records, and why the loop could not be traced (None
    when it was).
    """
    import inspect

    records: list[BlockInput] = []
    raw_first: dict = {}  # the first block's keywords in this batch, as the model passed them
    shared: dict[int, tuple] = {}  # id -> (the model's object, kept alive; its CPU copy), per batch
    params = {}  # block class -> its forward's parameter names

    def bound(block: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
        if type(block) not in params:
            params[type(block)] = list(inspect.signature(block.forward).parameters)
        kwargs = {**kwargs, **dict(zip(params[type(block)][1:], args))}
        for cache_key in CACHE_ARGUMENTS:
            if cache_key in kwargs:
                kwargs[cache_key] = None
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        return kwargs

    def record(index: int, hidden, *args, **kwargs):
        kwargs = bound(blocks[index], args, kwargs)
        passed = current["passed"]
        # The engine feeds each block the previous one's output: a loop that changes it in between
        # (DeBERTa-v2's convolution after its first layer) would be calibrated wrong. (A loop that
        # takes item 0 of a block's tuple gets the first row of a recorder's bare tensor.)
        if index > 0 and not (_same_value(hidden, passed) or (isinstance(passed, torch.Tensor) and passed.dim() > 1
                                                               and _same_value(hidden, passed[0]))):
            raise CompressError(f"the model changes the hidden states between {path}.{index - 1} and {path}.{index}, and "
                                "the calibration engine feeds each block the previous block's output",
                                "calibrate it with a stage that needs no activations (rtn, magnitude), or declare "
                                "blocks: a list whose blocks each take the one before's output")
        current["passed"] = hidden
        if index == 0:
            raw_first.clear()
            raw_first.update(kwargs)
            store.append(hidden)
            records.append(BlockInput(hidden=None, kwargs=_move(kwargs, "cpu"), mask=current["mask"]))  # type: ignore[arg-type]
        else:
            own = {k: v for k, v in kwargs.items() if not _same_value(v, raw_first.get(k, _ABSENT))}
            own.update({k: _ABSENT for k in raw_first if k not in kwargs})
            if own:
                records[-1].per_block[index] = {k: cpu_copy(v) for k, v in own.items()}
        if index == len(blocks) - 1:
            raise _StopForward
        return hidden if current["form"] == "bare" else (hidden, None)

    def cpu_copy(value: Any) -> Any:  # one copy of an object handed to several blocks
        if id(value) not in shared:
            shared[id(value)] = (value, value if value is _ABSENT else _move(value, "cpu"))
        return shared[id(value)][1]

    # what a recorder returns: the hidden states, or (a loop that unpacks a block's output into
    # two, as DeBERTa-v2's and older transformers' do) the hidden states and None
    current: dict = {"mask": None, "passed": None, "form": "bare"}
    untraced: str | None = None
    recorders = torch.nn.ModuleList([BlockStandIn(blocks, i, record) for i in range(len(blocks))])
    with blocks_swapped(model, path, recorders), on_device(model, device):
        n = 0
        while n < len(batches):
            batch = batches[n]
            n += 1
            mask = batch.get("attention_mask")
            # a batch without padding needs no mask (every token counts), and observers skip
            # selecting its rows: a boolean gather per hooked layer per batch
            current["mask"] = mask if mask is not None and not bool(mask.all()) else None
            shared.clear()
            try:
                model(**{k: v.to(device) for k, v in batch.items()})
            except _StopForward:
                pass
            except CompressError:
                raise
            except Exception as error:
                # A layer loop that needs more of a block's output than its hidden states fails
                # past the first block: tried once more with (hidden, None); failing that, every
                # block gets the first block's keywords, as the engine gave them before it traced
                # the loop, and the run warns. A loop that did trace, or a failure before the
                # first block, is a real error.
                if len(records) < n or any(r.per_block for r in records):
                    raise
                if n == 1 and current["form"] == "bare":
                    records.clear()
                    store.drop_last()
                    current["form"], n = "tuple", 0
                    continue
                untraced = f"{type(error).__name__}: {error}"[:200]
    return records, untraced


_ABSENT = object()


def _same_value(a: Any, b: Any) -> bool:
    """Whether a keyword a later block receives is the first block's: the same object, or equal."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


@contextmanager
def blocks_swapped(model: torch.nn.Module, path: str, replacement: torch.nn.Module):
    """Temporarily put `replacement` where the block list is, so that moving the model moves
    everything but the blocks (which may be on disk, i.e. on the meta device)."""
    parent_path, attr = path.rsplit(".", 1) if "." in path else ("", path)
    parent = model.get_submodule(parent_path)
    blocks = getattr(parent, attr)
    setattr(parent, attr, replacement)
    try:
        yield
    finally:
        setattr(parent, attr, blocks)


@torch.no_grad()
def run_outside(model, path: str, blocks: torch.nn.ModuleList, batches: list[dict], records: list[BlockInput],
                store: ActivationStore, device: torch.device, stage: Any, layers: dict[str, torch.nn.Module], ctx: Any,
                tuple_len: int | None, progress: Callable = lambda *_: None) -> None:
    """Observe and compress the selected `layers` outside the blocks: every batch through the model
    with its blocks stood in for by what the engine computed, so the parts before the blocks run on
    the batch itself and the parts after them (final norm, pooler, heads) on the last compressed
    block's outputs (in `store`), as at inference. (Layers before the blocks, such as OPT's
    project_in, are therefore solved last, the blocks having been calibrated on their float
    outputs.) As in capture_block_inputs, only the parts outside the blocks move to the device;
    the stage's observers are made there, and `stage.compress_outside(layers, observers, ctx)`
    runs there too. `tuple_len`: how many items a block returns, None for a bare tensor."""
    current = {"batch": 0}

    def replay(index: int, hidden, *args, **kwargs):
        out = store.get(current["batch"]).to(hidden.device) if index == len(blocks) - 1 else hidden
        # a loop that unpacks what each block returns (`hidden, _ = layer(...)`) gets as many items
        return out if tuple_len is None else (out, *[None] * (tuple_len - 1))

    # The routers do not run here, so a MoE model asked for their logits would compute its
    # load-balancing loss from none.
    extra = {"output_router_logits": False} if getattr(model.config, "output_router_logits", False) else {}

    stand_ins = torch.nn.ModuleList([BlockStandIn(blocks, i, replay) for i in range(len(blocks))])
    with blocks_swapped(model, path, stand_ins), on_device(model, device):
        observers = {n: obs for n, m in layers.items() if (obs := stage.observe(n, m)) is not None}

        fired: set = set()

        def hook_for(name: str, observer):
            def hook(module, inputs, output):
                observer.add(inputs, output, records[current["batch"]].mask)
                fired.add(name)
                if len(fired) == len(observers):
                    raise _StopForward  # the rest of the model (an lm_head's logits, say) serves no observer
            return hook

        handles = [layers[n].register_forward_hook(hook_for(n, obs)) for n, obs in observers.items()]
        try:
            for j, batch in enumerate(batches):
                current["batch"] = j
                fired.clear()
                progress("outside the blocks: calibrating", j, len(batches))
                try:
                    model(**{k: v.to(device) for k, v in batch.items()}, **extra)
                except _StopForward:
                    pass
        finally:
            for handle in handles:
                handle.remove()
        stage.compress_outside(layers, observers, ctx)


class Observing(SolvesOutsideBlocks):
    """A BlockwiseStage that only gathers statistics: `observe(name, module)` makes each selected
    layer's observer, and nothing is changed, so every block's outputs are the model's own; the
    selected layers outside the blocks are observed too (on the model's own run, run_outside).
    `observers` holds every observer made, by layer name."""

    leaves_blocks_unchanged = True  # the engine propagates each block's outputs from its calibration pass

    def __init__(self, observe: Callable[[str, torch.nn.Module], Any]):
        self._observe = observe
        self.observers: dict[str, Any] = {}

    def observe(self, name: str, module: torch.nn.Module):
        observer = self.observers[name] = self._observe(name, module)
        return observer

    def compress_block(self, index, block, prefix, layers, observers, ctx, runner) -> None:
        # The block's statistics are complete: an observer that hooks more than the engine does
        # (kv_cache's) lets go now, before the next block runs.
        for observer in observers.values():
            if callable(getattr(observer, "done", None)):
                observer.done()


@torch.no_grad()
def observe_layers(model: torch.nn.Module, ctx: Any, selected: dict[str, torch.nn.Module],
                   observe: Callable[[str, torch.nn.Module], Any], blocks_path: str | None = None) -> tuple[dict, dict]:
    """Statistics of the selected layers over the calibration set, the model unchanged: through the
    engine, one block on the device at a time (batch size, activation placement and budget as the
    engine's stages default them). Returns (observers by layer name, the engine's summary). An
    architecture whose blocks the engine does not know is run whole instead, on the device at
    once, and the summary says so."""
    from compress.stages.base import parse_bytes

    stage = Observing(observe)
    try:
        find_blocks(model, blocks_path)
    except CompressError as unknown:
        return _observe_whole(model, ctx, selected, stage), {"whole_model_pass": unknown.message}
    engine = Engine(ctx.device, activation_budget=parse_bytes("auto"), blocks_path=blocks_path, progress=ctx.progress,
                    offload=ctx.offload)
    summary = engine.run(model, ctx.calibration.samples, stage, selected, ctx)
    return stage.observers, summary


@torch.no_grad()
def _observe_whole(model: torch.nn.Module, ctx: Any, selected: dict, stage: Observing) -> dict:
    """observe_layers for a model whose blocks the engine cannot find: every sample through the
    whole model on the device, the observers hooked."""
    samples = ctx.calibration.samples
    mask: dict = {"now": None}
    with on_device(model, ctx.device):
        observers = {n: obs for n, m in selected.items() if (obs := stage.observe(n, m)) is not None}
        handles = [selected[n].register_forward_hook(lambda mod, inputs, output, obs=obs: obs.add(inputs, output, mask["now"]))
                   for n, obs in observers.items()]
        try:
            for j, sample in enumerate(samples):
                ctx.progress("calibrating (the whole model)", j, len(samples))
                batch = {k: v.to(ctx.device) for k, v in sample.items()}
                mask["now"] = batch.get("attention_mask")
                model(**batch)
        finally:
            for handle in handles:
                handle.remove()
    return observers


def _block_output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def solve_layers(items: list, solve: Callable[[Any, torch.device], Any], apply: Callable[[Any, Any], None],
                 devices: list[torch.device]) -> None:
    """`solve(item, device)` for every item of a block (a layer's name, or a group of layers solved
    together), then `apply(item, result)` in order on this thread.

    On one device each item is solved and applied before the next is touched, so only one
    item's working tensors exist at a time. With several, the items are dealt out round-robin,
    each device solving its share in order on its own thread, concurrently with the others (the
    work is in torch operations, which release the GIL); a result is applied as soon as it and
    those before it are done. A solve reads only its own layers' weights and statistics, so
    where it runs changes nothing but the device its arithmetic happens on."""
    if len(devices) <= 1 or len(items) <= 1:
        for item in items:
            apply(item, solve(item, devices[0]))
        return
    from concurrent.futures import ThreadPoolExecutor

    def on(device: torch.device, item: Any) -> Any:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # this thread's kernels and allocations go there
        return solve(item, device)

    workers = [ThreadPoolExecutor(max_workers=1) for _ in devices]  # one queue per device
    try:
        # Each solve runs in a copy of this thread's context: the stored-scale dtype
        # (quant.scales_stored_as) is a context variable, which new threads would not see.
        futures = [workers[k % len(devices)].submit(contextvars.copy_context().run, on, devices[k % len(devices)], item)
                   for k, item in enumerate(items)]
        for item, future in zip(items, futures):
            apply(item, future.result())  # re-raises a layer's error here
    finally:
        for worker in workers:
            worker.shutdown(cancel_futures=True)


class Engine:
    """Runs a BlockwiseStage over a model, one block at a time."""

    def __init__(self, device: torch.device, batch_size: int | str = "auto", activations_on: str = "auto",
                 activation_budget: int | None = None, blocks_path: str | None = None, progress=lambda *_: None,
                 offload=None):
        self.device = device
        self.batch_size = batch_size
        self.activations_on = activations_on
        self.activation_budget = activation_budget
        self.blocks_path = blocks_path
        self.progress = progress
        self.offload = offload  # compress.offload.DiskOffload: blocks read from and written to disk

    @torch.no_grad()
    def run(self, model: torch.nn.Module, samples: list[dict], stage: BlockwiseStage,
            selected: dict[str, torch.nn.Module], ctx: Any) -> dict:
        path, blocks = find_blocks(model, self.blocks_path)
        padding_harms = padding_changes_results(model)
        batch_size = resolve_batch_size(self.batch_size, self.device, samples, padding_harms is not None)
        if padding_harms and batch_size > 1 and len({s["input_ids"].shape[1] for s in samples}) > 1:
            raise CompressError(f"batch_size {batch_size} would pad calibration samples of different lengths, and "
                                f"{padding_harms}",
                                "set batch_size: auto or 1, or calibrate on equal windows (calibration.packing: true)")
        batches = calibration_batches(samples, batch_size)
        keep_on_device = self.activations_on == "device" or (self.activations_on == "auto" and self.device.type != "cpu"
                                                              and self._fits_on_device(batches, model))
        store = ActivationStore(self.device, keep_on_device, self.activation_budget)
        records, untraced = capture_block_inputs(model, path, blocks, batches, self.device, store)
        solves_outside = callable(getattr(stage, "compress_outside", None))
        outside = {n: m for n, m in selected.items() if solves_outside and not n.startswith(path + ".")}
        peak_device_params = 0
        first_groups = None
        tuple_len = None  # how many items the blocks return (None: a bare tensor), for run_outside
        try:
            for i, block in enumerate(blocks):
                prefix = f"{path}.{i}."
                layers = {n: m for n, m in selected.items() if n.startswith(prefix) or n == prefix[:-1]}
                if self.offload is not None:
                    self.offload.load(prefix[:-1])
                with on_device(block, self.device):
                    on_device_params = sum(p.numel() for p in model.parameters() if p.device.type == self.device.type)
                    peak_device_params = max(peak_device_params, on_device_params)
                    runner = BlockRunner(block, store, records, self.device, i)
                    # Usually one calibration pass serves every layer of the block. Sequentially, the
                    # layers go in groups that read the same input (q/k/v, then o, gate/up, down), each
                    # group calibrated on inputs that already carry the error of the groups before it.
                    sequential = getattr(stage, "true_sequential", False)
                    groups = self.sequential_groups(layers, runner) if sequential else [list(layers)]
                    if len(groups) > 1 and first_groups is None:
                        first_groups = [[n.removeprefix(prefix) for n in g] for g in groups]
                    # A stage that leaves the blocks as they are (Observing) takes the block's outputs
                    # for the next one from its calibration pass: the block need not run again.
                    keep_outputs = getattr(stage, "leaves_blocks_unchanged", False) and len(groups) == 1 \
                        and (i + 1 < len(blocks) or bool(outside))
                    propagated = False
                    for group in groups:
                        members = {n: layers[n] for n in group}
                        observers = {n: obs for n, m in members.items() if (obs := stage.observe(n, m)) is not None}
                        if observers:
                            kept = self._calibrate(runner, members, observers, f"block {i + 1}/{len(blocks)}: calibrating",
                                                   stop_after=group[-1] if len(groups) > 1 else None,
                                                   keep_outputs=keep_outputs)
                            if keep_outputs:
                                propagated, tuple_len = True, kept
                        if members:
                            stage.compress_block(i, block, prefix, members, observers, ctx, runner)
                        del observers
                    # The next block sees this block's compressed outputs, as it will at inference
                    # (after the last block: the layers outside the blocks, when they are observed).
                    if (i + 1 < len(blocks) or outside) and not propagated:
                        for j in range(len(records)):
                            self.progress(f"block {i + 1}/{len(blocks)}: propagating", j, len(records))
                            raw = block(store.get(j), **runner.kwargs(j))
                            tuple_len = len(raw) if isinstance(raw, (tuple, list)) else None
                            self._replace(store, j, _block_output(raw))
                if self.offload is not None:
                    self.offload.release(prefix[:-1], shard=i + 1)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            if outside:
                run_outside(model, path, blocks, batches, records, store, self.device, stage, outside, ctx,
                            tuple_len, self.progress)
        finally:
            store.close()
        summary = {"blocks": len(blocks), "batch_size": batch_size, "batches": len(records),
                   "activations_spilled": store.spilled,
                   "max_parameters_on_device": peak_device_params}
        if outside:
            summary["outside_blocks"] = list(outside)
        if untraced is not None:
            summary["untraced_layer_loop"] = f"every block was given the first block's keywords ({untraced})"
            summary["warnings"] = [f"the model's layer loop could not be traced past its first block ({untraced}): each "
                                   "block was calibrated on the previous block's output with the first block's keywords, "
                                   "unchecked; a model that changes the hidden states between blocks, or gives blocks "
                                   "their own masks, was calibrated on wrong inputs: check the evaluation"]
        if first_groups is not None:  # true_sequential: the order layers were solved in (first block)
            summary["sequential_groups"] = first_groups
        return summary

    def _calibrate(self, runner: BlockRunner, layers: dict, observers: dict, desc: str, stop_after: str | None = None,
                   keep_outputs: bool = False) -> int | None:
        """Every cached batch through the block with `observers` hooked on their layers; with
        `stop_after` (a layer's name) each forward ends once that layer has run. With `keep_outputs`
        each batch's block output replaces its input in the store, as propagating would; returns how
        many items the block returns (None: a bare tensor)."""
        records = runner.records
        handles = [layers[n].register_forward_hook(self._hook(obs, runner)) for n, obs in observers.items()]
        if stop_after is not None:
            handles.append(layers[stop_after].register_forward_hook(_raise_stop))
        returned = {"tuple_len": None}
        if keep_outputs:
            def keep(_block, _inputs, output):  # runs after every hook inside the block
                returned["tuple_len"] = len(output) if isinstance(output, (tuple, list)) else None
                self._replace(runner.store, runner.batch, _block_output(output))
            handles.append(runner.block.register_forward_hook(keep))
        runner.run_hooked(list(range(len(records))), handles, before_batch=lambda j: self.progress(desc, j, len(records)))
        return returned["tuple_len"]

    @staticmethod
    @torch.no_grad()
    def sequential_groups(layers: dict, runner: "BlockRunner") -> list[list[str]]:
        """The block's target layers in the order they run, grouped by the input they read: layers
        fed the same tensor (q, k, v; gate, up) are solved together. Found by one forward of the
        first cached batch, so it holds for any architecture; layers that batch does not reach (MoE
        experts it routes no token to) are solved last, as one group."""
        calls: list[tuple[str, torch.Tensor]] = []  # the inputs are kept alive, so `is` compares them
        # A pre-hook put first sees the input before any other pre-hook (activation fake-quant) replaces it.
        handles = [m.register_forward_pre_hook(lambda mod, args, name=n: calls.append((name, args[0])), prepend=True)
                   for n, m in layers.items()]
        try:
            runner.outputs(limit=1)
        finally:
            for h in handles:
                h.remove()
        groups: list[list[str]] = []
        group_inputs: list[torch.Tensor] = []
        for name, x in calls:
            if any(name in g for g in groups):
                continue  # a layer that runs twice keeps its first place
            k = next((k for k, seen in enumerate(group_inputs) if seen is x), None)
            if k is None:
                groups.append([])
                group_inputs.append(x)
                k = len(groups) - 1
            groups[k].append(name)
        seen = {n for g in groups for n in g}
        unseen = [n for n in layers if n not in seen]  # not reached by the forward (an unrouted expert)
        return groups + ([unseen] if unseen else [])

    @staticmethod
    def _hook(observer, runner: BlockRunner):
        def hook(module, inputs, output):
            observer.add(inputs, output, runner.records[runner.batch].mask)
        return hook

    @staticmethod
    def _replace(store: ActivationStore, j: int, hidden: torch.Tensor) -> None:
        item = store.items[j]
        if isinstance(item, Path):
            torch.save(hidden.detach().cpu(), item)
        else:
            store.items[j] = hidden.detach() if store.keep_on_device else hidden.detach().cpu()

    def _fits_on_device(self, batches, model) -> bool:
        if self.device.type != "cuda":
            return False
        hidden = getattr(model.config, "hidden_size", 0)
        need = sum(b["input_ids"].numel() for b in batches) * hidden * 4
        free, _ = torch.cuda.mem_get_info(self.device)
        return need < 0.5 * free
