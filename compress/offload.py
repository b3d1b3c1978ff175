"""`offload: disk`: compress a model that does not fit in RAM.

The model is built with every parameter on the meta device (buffers such as rotary tables stay
real). The parts outside the transformer blocks are read from the checkpoint up front; each block
is read from the safetensors files when the calibration engine reaches it, and written to its own
output shard, then dropped, as soon as it is done. Peak memory is one block plus the activations.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from compress.errors import CompressError


@contextmanager
def parameters_on_meta():
    """Build modules with parameters on the meta device and buffers as usual."""
    original = nn.Module.register_parameter

    def register(self, name, param):
        original(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def checkpoint_index(directory: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, for a single file or a sharded checkpoint."""
    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise CompressError(f"offload: disk needs safetensors weights; {directory} has none", "convert the checkpoint to safetensors")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def stored_float_dtype(directory: Path) -> torch.dtype | None:
    """The dtype of the checkpoint's first floating-point tensor: what `from_pretrained(dtype="auto")`
    loads a model in when its config names none."""
    files = dict.fromkeys(checkpoint_index(directory).values())
    for file in files:
        with safe_open(file, "pt") as f:
            for name in f.keys():
                dtype = SAFETENSORS_FLOATS.get(f.get_slice(name).get_dtype())
                if dtype is not None:
                    return dtype
    return None


class DiskOffload:
    """Reads module tensors from the source checkpoint on demand; writes finished ones to `dest`."""

    def __init__(self, model: nn.Module, source: Path, dest: Path, n_shards: int):
        fixed_mmap_threshold()  # run_recipe sets it earlier; this covers direct use of the class
        self.model = model
        self.index = checkpoint_index(source)
        self.dest = dest
        self.n_shards = n_shards
        self.weight_map: dict[str, str] = {}
        self.total_size = 0
        self.written: set[str] = set()
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        missing = [n for n in self.index if n not in params and n not in dict(model.named_buffers())]
        if missing:
            raise CompressError(
                f"offload: disk: checkpoint tensor '{missing[0]}' has no parameter of that name in the model "
                f"({len(missing)} unmatched)", "this checkpoint's names need converting on load; compress it without offload")

    def _read(self, name: str, like: torch.Tensor) -> nn.Parameter:
        """The stored tensor, in the dtype of the meta parameter it fills: the skeleton was built in
        the dtype asked for (--dtype), as a model loaded into memory would be cast to it."""
        with safe_open(self.index[name], "pt") as f:
            t = f.get_tensor(name)
        return nn.Parameter(t.to(like.dtype) if t.is_floating_point() else t, requires_grad=False)

    def load(self, prefix: str) -> None:
        """Materialise every parameter under `prefix` (a module name, '' for all) on CPU."""
        module = self.model.get_submodule(prefix) if prefix else self.model
        base = f"{prefix}." if prefix else ""
        for mod_name, mod in module.named_modules():
            for pname, param in list(mod._parameters.items()):
                if param is None or param.device.type != "meta":
                    continue
                full = f"{base}{mod_name + '.' if mod_name else ''}{pname}"
                if full not in self.index:
                    continue  # tied to another tensor (e.g. lm_head to the embeddings): tie_weights fills it
                mod._parameters[pname] = self._read(full, param)

    def load_outside(self, blocks_path: str) -> None:
        """Everything except the blocks: embeddings, final norm, head."""
        for name, module in self.model.named_children():
            self._load_except(module, name, blocks_path)
        if hasattr(self.model, "tie_weights"):
            self.model.tie_weights()

    def _load_except(self, module: nn.Module, name: str, skip: str) -> None:
        if name == skip:
            return
        if skip.startswith(name + "."):
            for pname, param in list(module._parameters.items()):
                if param is not None and param.device.type == "meta" and f"{name}.{pname}" in self.index:
                    module._parameters[pname] = self._read(f"{name}.{pname}", param)
            for child_name, child in module.named_children():
                self._load_except(child, f"{name}.{child_name}", skip)
        else:
            self.load(name)

    def release(self, prefix: str, shard: int) -> None:
        """Write the finished module's tensors to shard number `shard`, then drop them."""
        module = self.model.get_submodule(prefix)
        tensors = {}
        for pname, param in module.named_parameters():
            full = f"{prefix}.{pname}"
            if full in self.index:
                tensors[full] = param.detach().to("cpu").contiguous()
        self._write(tensors, shard)
        for mod in module.modules():
            for pname, param in list(mod._parameters.items()):
                if param is not None:
                    mod._parameters[pname] = nn.Parameter(param.detach().to("meta"), requires_grad=False)
        release_freed_memory()


    def finish(self) -> None:
        """Write every tensor not yet written (the parts outside the blocks) and the index."""
        state = {n: p for n, p in self.model.named_parameters(remove_duplicate=False)}
        rest = {n: state[n].detach().contiguous() for n in self.index if n not in self.written and n in state
                and state[n].device.type != "meta"}
        self._write(rest, self.n_shards)
        unwritten = [n for n in self.index if n not in self.written]
        if unwritten:
            raise CompressError(f"offload: disk: tensor '{unwritten[0]}' was never written", "please report this")
        (self.dest / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(self.weight_map.items()))}, indent=2))

    def _write(self, tensors: dict[str, torch.Tensor], shard: int) -> None:
        if not tensors:
            return
        file = f"model-{shard:05d}-of-{self.n_shards:05d}.safetensors"
        save_file(tensors, self.dest / file, metadata={"format": "pt"})
        for name, t in tensors.items():
            self.weight_map[name] = file
            self.total_size += t.numel() * t.element_size()
            self.written.add(name)


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise), so that resident memory
    reflects the one block held rather than every block ever loaded."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def fixed_mmap_threshold(threshold: int = 1 << 20) -> None:
    """Serve allocations above `threshold` bytes from mmap, returned to the OS on free. glibc
    otherwise raises the threshold after the first large free and carves later blocks out of a heap
    that fragments, so resident memory grew with the number of blocks streamed (make bench: the
    control row with MALLOC_MMAP_THRESHOLD_ fixed showed no growth from 2 to 12 layers)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass
