"""Model plumbing: resolving a model reference, loading it and its tokenizer, reading and writing
linear weights (GPT-2's Conv1D stores them transposed), hashing weights for provenance."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
from pathlib import Path

import torch

from compress.checkpoint import INCOMPLETE_MARKER
from compress.errors import CompressError, first_line

PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = PACKAGE_DIR / "assets" / "ref-llama"
REPO_DIR = PACKAGE_DIR.parent
# The bundled recipes and calibration texts: top-level directories of a checkout, and inside the
# package of an installed wheel (pyproject.toml's package-dir maps them there).
BUNDLED = {"recipes": "bundled_recipes", "calibration": "bundled_calibration"}


def bundled_dir(kind: str) -> Path:
    """The directory of the bundled `recipes` or `calibration`, wherever compress runs from."""
    checkout = REPO_DIR / kind
    return checkout if (REPO_DIR / "pyproject.toml").is_file() and checkout.is_dir() else PACKAGE_DIR / BUNDLED[kind]


def bundled_file(p: Path) -> Path | None:
    """`recipes/NAME.yaml` or `calibration/NAME.txt`, as recipes and the README name them, as the
    bundled file from any working directory; None when it is not one."""
    if p.is_absolute() or len(p.parts) < 2 or p.parts[0] not in BUNDLED:
        return None
    f = bundled_dir(p.parts[0]).joinpath(*p.parts[1:])
    return f if f.exists() else None

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_reference(value, what: str) -> str | None:
    """A model (or directory) given to the Python API as a str or a Path, as the string the CLI
    would pass; anything else, a loaded model above all, is refused with what to pass instead."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise CompressError(f"{what}: expected a directory or hub id (a str or Path), got a {type(value).__name__}",
                        "save a loaded model with save_pretrained(DIR) and pass DIR" if isinstance(value, torch.nn.Module)
                        else f"pass {what} as a str or pathlib.Path")


def resolve_model(ref: str) -> str:
    """A local directory, `default` (the bundled ref-llama), or a hub id passed through as is."""
    if ref == "default":
        return str(DEFAULT_MODEL_DIR)
    p = Path(ref).expanduser()
    if p.exists():
        if not p.is_dir():
            raise CompressError(f"model path {ref} is a file", "pass the directory that holds config.json")
        if (p / INCOMPLETE_MARKER).exists():
            raise CompressError(f"model directory {ref} is an unfinished compress output (the run writing it was interrupted)",
                                "use a finished output; the next run into the same destination removes this one")
        if not (p / "config.json").is_file():
            raise CompressError(f"model directory {ref} has no config.json", "pass a Hugging Face model directory")
        return str(p)
    if ref.startswith((".", "/", "~")) or not _looks_like_hub_id(ref):
        raise CompressError(f"model path {ref} does not exist", "check the path, or give a hub id such as org/name")
    return ref  # a hub id: transformers resolves it (from the local cache when offline)


def _looks_like_hub_id(ref: str) -> bool:
    parts = ref.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and "\\" not in ref


def load_config(ref: str):
    from transformers import AutoConfig

    path = resolve_model(ref)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        first = first_line(exc, limit=1000)
        if "does not recognize this architecture" in first:  # a config transformers cannot map to a class
            kind = first.split("`")[1] if first.count("`") >= 2 else "unknown"
            raise CompressError(f"model {ref}: architecture (model_type) '{kind}' is not supported by the installed "
                                "transformers", "upgrade transformers, or convert the model to a supported architecture") from None
        hint = ("its config.json is damaged: restore it from the model's source" if Path(path).is_dir()
                else "check the id or path; offline, the model must be in the local cache")
        raise CompressError(f"cannot load model config for {ref}: {first}", hint) from None


def is_causal_lm(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    return any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs)


def model_class(config):
    from transformers import AutoModel, AutoModelForCausalLM

    return AutoModelForCausalLM if is_causal_lm(config) else AutoModel


def check_context(config, seq_len: int, key: str) -> None:
    """Refuse windows longer than the model's positions: learned position embeddings would fail
    with an index error, rotary ones compute on positions never trained."""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise CompressError(f"{key} {seq_len} is longer than the model's context ({limit} positions, "
                            "max_position_embeddings in its config.json)", f"set {key} to at most {limit}")


def fit_context(config, seq_len: int) -> int:
    """`seq_len`, or the model's whole context where that is shorter: windows a command chooses
    for the user (prune's, bench's) rather than ones the user asked for."""
    return min(seq_len, getattr(config, "max_position_embeddings", None) or seq_len)


def load_model(ref: str, dtype: str = "auto", device: str | torch.device = "cpu"):
    """Load (model, tokenizer, config) for a local dir, hub id or `default`."""
    path = resolve_model(ref)
    config = load_config(ref)
    if dtype != "auto" and dtype not in DTYPES:
        raise CompressError(f"unknown dtype {dtype!r}", f"use auto or one of {', '.join(DTYPES)}")
    torch_dtype = "auto" if dtype == "auto" else DTYPES[dtype]
    if Path(path).is_dir() and not any(Path(path).glob("*.safetensors")) and not any(Path(path).glob("*.bin")):
        raise CompressError(f"model directory {ref} holds no weights (*.safetensors or *.bin)", "point --model at a complete checkpoint")
    from compress import packing

    if Path(path).is_dir() and packing.is_packed(path):  # compressed-tensors: dequantized on load
        model = packing.load_packed(path, config, model_class(config), None if dtype == "auto" else DTYPES[dtype])
    else:
        model = _from_pretrained(ref, path, config, torch_dtype)
    tokenizer = _load_tokenizer(ref, path)
    model.eval()
    model.to(device)
    if getattr(model.config, "use_cache", None) is not None:
        model.config.use_cache = False
    _reattach_activation_quant(model, path)
    return model, tokenizer, config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def load_tokenizer(ref: str):
    """The tokenizer of a local dir, hub id or `default`, without its weights."""
    return _load_tokenizer(ref, resolve_model(ref))


def _load_tokenizer(ref: str, path: str | Path):
    from transformers import AutoTokenizer

    if Path(path).is_dir() and not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        raise CompressError(f"model directory {ref} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})",
                            "copy the tokenizer files from the model's source into the directory")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise CompressError(f"cannot load the tokenizer of {ref}: {first_line(exc)}", "the model directory needs tokenizer files") from None


def _from_pretrained(ref: str, path: str, config, torch_dtype):
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors comes with transformers
        SafetensorError = OSError
    try:
        return model_class(config).from_pretrained(path, dtype=torch_dtype)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        first = first_line(exc)
        mismatch = _shape_mismatch(path, config) if "mismatch" in str(exc) else None
        if mismatch:  # transformers' own message points at a report its logging (silenced here) printed
            raise CompressError(f"cannot load model weights from {ref}: {mismatch}",
                                "the weights and config.json disagree: use the config.json they were saved with") from None
        raise CompressError(f"cannot load model weights from {ref}: {first}", "the checkpoint may be truncated or corrupted") from None


def _shape_mismatch(path: str, config) -> str | None:
    """The first tensor whose stored shape differs from the one config.json builds, described;
    None when none is found (or the files cannot be read)."""
    from safetensors import safe_open

    try:
        with torch.device("meta"):  # shapes only: nothing allocated
            expected = {k: tuple(v.shape) for k, v in model_class(config).from_config(config).state_dict().items()}
        for f in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as handle:
                for key in handle.keys():
                    stored = tuple(handle.get_slice(key).get_shape())
                    if key in expected and expected[key] != stored:
                        return f"tensor {key} is {list(stored)} in {f.name}, but config.json makes it {list(expected[key])}"
    except Exception:  # a diagnosis only: the caller reports the original error
        return None
    return None


def local_dir(ref: str) -> Path:
    """The directory holding a model's files: a local path, or a hub id's local cache snapshot."""
    path = Path(resolve_model(ref))
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(ref, local_files_only=True))
    except Exception:
        raise CompressError(f"model {ref} is not available locally", "download it first, or pass a local directory") from None


def load_skeleton(ref: str, dtype: str = "auto"):
    """(model, tokenizer, config) with every parameter on the meta device (for offload: disk);
    buffers such as rotary tables are real. Weights are read later, block by block."""
    from compress.offload import parameters_on_meta, release_freed_memory

    config = load_config(ref)
    path = local_dir(ref)
    kwargs = {} if dtype == "auto" else {"dtype": DTYPES[dtype]}
    if dtype == "auto" and getattr(config, "dtype", None) is not None:
        kwargs = {"dtype": config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype))}
    elif dtype == "auto":  # as from_pretrained does: the stored weights' own
        from compress.offload import stored_float_dtype

        kwargs = {"dtype": stored_float_dtype(path) or torch.float32}
    with parameters_on_meta():
        model = model_class(config).from_config(config, **kwargs)
    release_freed_memory()  # the transient real tensors each parameter was created as
    model.eval()
    if getattr(model.config, "use_cache", None) is not None:
        model.config.use_cache = False
    tokenizer = _load_tokenizer(ref, path)
    check_offload_model(model, ref)
    return model, tokenizer, config


def check_offload_model(model: torch.nn.Module, ref: str) -> None:
    """What offload: disk cannot stream: experts fused into one parameter per block."""
    from compress.moe import is_fused_experts

    if any(is_fused_experts(m) for m in model.modules()):
        raise CompressError(f"offload: disk does not support mixture-of-experts models yet ({ref})", "drop offload: disk")


def read_meta(path: str | Path) -> dict:
    """A compress output's compress.json ({} when there is none); a damaged one is an error
    naming it, not a crash in whatever reads it next."""
    meta_file = Path(path) / "compress.json"
    if not meta_file.is_file():
        return {}
    try:
        meta = json.loads(meta_file.read_text())
    except (ValueError, OSError) as exc:
        raise CompressError(f"{meta_file}: damaged ({first_line(exc)})", "write the checkpoint again") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("layers", {}), dict):
        raise CompressError(f"{meta_file}: damaged (not the object compress writes)", "write the checkpoint again")
    for name, record in meta.get("layers", {}).items():
        problem = _record_problem(record)
        if problem:
            raise CompressError(f"{meta_file}: damaged (layer {name}: {problem})", "write the checkpoint again")
    return meta


def _record_problem(record) -> str | None:
    """What is wrong with one layer's record in compress.json, as far as readers rely on it."""
    from pydantic import ValidationError

    from compress.schemes import QuantArgs

    if not isinstance(record, dict):
        return "its record is not an object"
    for key in ("weights", "input_activations"):
        value = record.get(key)
        if value is None:
            continue
        try:
            QuantArgs(**value)
        except (TypeError, ValidationError):
            return f"`{key}` is not a quantization scheme"
    shape = record.get("shape")
    if shape is not None and not (isinstance(shape, list) and len(shape) == 2 and all(type(d) is int for d in shape)):
        return "`shape` is not [out_features, in_features]"
    return None


def _reattach_activation_quant(model: torch.nn.Module, path: str) -> None:
    """A compress checkpoint with quantized activations records their scheme and static ranges."""
    meta = read_meta(path)
    if not meta:
        return
    from compress import activations

    activations.reattach(model, meta.get("layers", {}), meta.get("kv_cache"))


def get_weight(module: torch.nn.Module) -> torch.Tensor:
    """The weight as a float32 [out_features, in_features] tensor (a copy)."""
    w = module.weight.detach()
    if type(module).__name__ == "Conv1D":  # GPT-2 stores [in, out]
        w = w.t()
    return w.float().clone()


def weight_shape(module: torch.nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of a Linear or GPT-2 Conv1D, without copying the weight."""
    w = module.weight
    return (w.shape[1], w.shape[0]) if type(module).__name__ == "Conv1D" else (w.shape[0], w.shape[1])


def set_weight(module: torch.nn.Module, weight: torch.Tensor) -> None:
    """Write a [out, in] weight back in the module's own layout, dtype and device."""
    if type(module).__name__ == "Conv1D":
        weight = weight.t()
    with torch.no_grad():
        module.weight.copy_(weight.to(module.weight.dtype))


def weights_hash(ref: str) -> str | None:
    """sha256 over the model's weight files (sorted by name), for provenance."""
    path = Path(resolve_model(ref))
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(ref, local_files_only=True))
        except Exception:
            return None
    h = hashlib.sha256()
    files = sorted(list(path.glob("*.safetensors")) + list(path.glob("*.bin")))
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest() if files else None


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def meta_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` on the meta device: its modules, names, shapes and config, no memory
    (each parameter and buffer is replaced by an empty meta tensor of its shape before copying)."""
    memo: dict[int, object] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = torch.nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def saved_dtype(config) -> torch.dtype:
    """The dtype a checkpoint's config says its weights are stored in (float32 when it says none)."""
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return saved if isinstance(saved, torch.dtype) else getattr(torch, str(saved).removeprefix("torch."), torch.float32)


def describe_dtype(source: dict) -> str:
    """A source model's dtype as the run used it, and the one on disk where --dtype converted it."""
    dtype, on_disk = source.get("dtype"), source.get("dtype_on_disk")
    return f"{dtype}, converted from {on_disk}" if on_disk and dtype and on_disk != dtype else str(dtype)
