"""The stage cache behind `--resume`: each completed stage's result, stored under a key made of
everything that determines it, so that a run continues after its last completed stage and a
rerun with a later stage changed recomputes only from that stage on.

    key(base)    = sha256(input weights hash, config.json hash, dtype as loaded)
    key(stage i) = sha256(key(stage i-1), stage name, stage config as dumped, calibration
                          fingerprint, library versions, seed, device)

An entry `<cache>/stages/<key>/` holds what a later stage or the saver needs and cannot recompute:

    model.safetensors   every parameter and persistent buffer after the stage (weights, smoothed
                        norms, ...), in the model's own dtype, so a restore is bitwise
    state.json          ctx.layers (the per-layer records packing and the report read, and the
                        activation-quantization scheme and static ranges), the stage's report
                        entry, its index and name
    rng.safetensors     torch's CPU generator state, so a later stochastic step draws the same
                        numbers as in an uninterrupted run

Activation fake-quantization hooks are not state: they are reattached from the records, as
`compress eval` does when it loads a checkpoint. An entry is written into a temporary directory
and renamed into place, so a killed run never leaves an entry that looks complete.

Why only with --resume (or --cache-dir): storing an entry writes the whole model once per stage,
which for a 7B model is 14 GB of disk traffic per stage; a run that will not be resumed should
not pay that. Limits: an entry must fit the freshly loaded model's parameter names and shapes, so
none is stored from the first stage that changes them on (structured pruning, distillation into
fewer blocks): such a recipe resumes at most from before that stage; CUDA generator state is not stored, so
resumed GPU runs are not guaranteed to be bitwise equal; `offload: disk` is not cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from compress import moe
from compress.checkpoint import kill_point, left_by_dead_runs
from compress.errors import CompressError

ENTRY_FORMAT = 1
CACHE_ENV = "COMPRESS_CACHE"


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "compress"


def _sha(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()


def _file_sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


class StageCache:
    """Stores and restores stage results of one run; `keys[i]` is stage i's key."""

    def __init__(self, root: Path, keys: list[str], names: list[str]):
        self.root = root
        self.keys = keys
        self.names = names
        self.restored = 0  # stages taken from the cache in this run
        self.stored: list[int] = []
        self.skipped: dict[int, str] = {}  # stage index -> why it was not stored

    def entry(self, index: int) -> Path:
        return self.root / "stages" / self.keys[index]

    def restore(self, net: torch.nn.Module, ctx, reports: list[dict]) -> int:
        """Load the latest stored stage result that fits `net`; returns how many stages it covers
        (0: start from the beginning). Fills ctx.layers and `reports` for the restored stages."""
        found = self._load_latest(net)
        if found is None:
            return 0
        last, state, rng = found
        torch.set_rng_state(rng)
        ctx.layers.clear()
        ctx.layers.update(state["layers"])
        ctx.kv_cache = state.get("kv_cache")
        from compress import activations

        activations.reattach(net, ctx.layers, ctx.kv_cache)
        for i in range(last + 1):
            earlier = self._read_entry(i)
            # an earlier entry may have been pruned by hand; the restored one carries the
            # records, so only its report line would be missing
            entry = dict(earlier["report"]) if earlier else {"name": self.names[i], "summary": {}}
            reports.append({**entry, "from_cache": True})
        self.restored = last + 1
        ctx.progress(f"resuming after stage {last + 1} ({self.names[last]}) from the cache", 1, 1)
        return last + 1

    def _load_latest(self, net: torch.nn.Module) -> tuple[int, dict, torch.Tensor] | None:
        """(index, state, generator state) of the latest entry that fits, loaded into `net`."""
        from safetensors.torch import load_file, load_model

        with moe.fused_layout(net):  # entries hold a mixture-of-experts model in its own layout
            for last in range(len(self.keys) - 1, -1, -1):
                state = self._read_entry(last)
                if state is None or not _fits(net, self.entry(last) / "model.safetensors"):
                    continue
                try:  # load_model reads the whole file before touching net, so a failure leaves net as it was
                    rng = load_file(self.entry(last) / "rng.safetensors")["cpu"]
                    load_model(net, self.entry(last) / "model.safetensors", strict=True)
                except Exception:  # a damaged entry is a cache miss, never a failed run
                    continue
                return last, state, rng
        return None
        return 0

    def store(self, index: int, net: torch.nn.Module, ctx, report: dict) -> None:
        """Write stage `index`'s result; atomically (temporary directory, then rename)."""
        from safetensors.torch import save_file, save_model

        final = self.entry(index)
        if final.is_dir():
            return  # the same key: the same result, already stored
        try:
            text = json.dumps({"format": ENTRY_FORMAT, "index": index, "name": self.names[index], "key": self.keys[index],
                               "report": report, "layers": ctx.layers, "kv_cache": ctx.kv_cache}, allow_nan=True)
        except TypeError as exc:  # a record that JSON cannot hold would not come back as it was
            self.skipped[index] = f"records are not JSON: {exc}"
            return
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            with moe.fused_layout(net):  # unfused experts are views of the fused parameters: saved as those
                save_model(net, str(tmp / "model.safetensors"))
            save_file({"cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
            kill_point("cache-storing")
            (tmp / "state.json").write_text(text)
            os.replace(tmp, final)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if final.is_dir():  # another run stored the same key first: the same result
                return
            raise CompressError(f"cannot write the stage cache in {self.root}: {exc.strerror}",
                                "free disk space, or pass another --cache-dir") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.stored.append(index)

    def _read_entry(self, index: int) -> dict | None:
        d = self.entry(index)
        try:
            state = json.loads((d / "state.json").read_text())
        except (OSError, ValueError):
            return None
        if state.get("format") != ENTRY_FORMAT or state.get("key") != self.keys[index]:
            return None
        if not (d / "model.safetensors").is_file() or not (d / "rng.safetensors").is_file():
            return None
        return state

    def describe(self) -> dict:
        return {"dir": str(self.root), "keys": self.keys, "restored_stages": self.restored,
                "stored_stages": self.stored, **({"not_stored": self.skipped} if self.skipped else {})}


def _fits(net: torch.nn.Module, file: Path) -> bool:
    """Same tensor names, shapes and dtypes as the model (up to tied duplicates)."""
    from safetensors import safe_open

    expected = net.state_dict()
    try:
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
            for name in names:
                t = expected.get(name)
                sl = f.get_slice(name)
                if t is None or list(sl.get_shape()) != list(t.shape) or sl.get_dtype() != _st_dtype(t.dtype):
                    return False
    except Exception:  # a damaged entry is a cache miss, never a failed run
        return False
    shared = {id(t.untyped_storage()) for n, t in expected.items() if n in names}
    return all(n in names or id(t.untyped_storage()) in shared for n, t in expected.items())


_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def _st_dtype(dtype: torch.dtype) -> str:
    return _ST_DTYPES.get(dtype, str(dtype))


def prepare(cache_dir: str | Path | None, recipe, inputs: list[str | Path] = (), output: str | Path | None = None) -> Path:
    """The cache directory, created; checked before the model is loaded, so a bad one costs
    nothing: not inside an input model (compress never writes there), nor inside the output
    (which this run replaces, and whose directory the cache would make appear)."""
    if recipe.offload == "disk":
        raise CompressError(f"{recipe.source}: --resume does not work with offload: disk",
                            "drop --resume: an offloaded run streams one stage straight into its output")
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    where = root.resolve()
    for model in inputs:
        model = Path(model).expanduser().resolve()
        if model.is_dir() and (where == model or model in where.parents):
            raise CompressError(f"cache directory {root} lies inside the input model {model}",
                                "pass a --cache-dir outside the model's directory")
    if output is not None:
        out = Path(output).expanduser().resolve()
        if where == out or out in where.parents:
            raise CompressError(f"cache directory {root} lies inside the output directory {output}, which the run replaces",
                                "pass a --cache-dir outside the output")
    if root.exists() and not root.is_dir():
        raise CompressError(f"cache directory {root} is a file", "pass --cache-dir DIR, a directory (or unset COMPRESS_CACHE)")
    try:
        (root / "stages").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CompressError(f"cannot create the cache directory {root}: {exc.strerror}", "pass another --cache-dir") from None
    _remove_stale_entries(root / "stages")
    return root


def _remove_stale_entries(stages: Path) -> None:
    """Entries a killed run was writing (`.KEY.tmp-PID`, a whole model each) go once their process
    is gone; a running one's are left alone."""
    for tmp in left_by_dead_runs(stages, ".*.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def open_cache(root: Path, recipe, model_dir: str, source: dict, calibration, seed: int,
               devices: list[torch.device]) -> StageCache:
    """The cache for this run, keys computed up front (no stage has to run to know them)."""
    from compress.report import versions

    if not source.get("weights_sha256"):
        raise CompressError(f"--resume needs the input model's weight files to key the cache; none found for {source.get('ref')}",
                            "pass a local model directory")
    cal = calibration.fingerprint if calibration is not None else None
    key = _sha("model", source["weights_sha256"], _file_sha(Path(model_dir) / "config.json"), source.get("dtype"))
    keys, names = [], []
    for name, stage in recipe.stages:
        key = _sha("stage", key, name, stage.model_dump(mode="json"), cal, versions(), seed, [str(d) for d in devices])
        keys.append(key)
        names.append(name)
    return StageCache(root, keys, names)
