"""Writing outputs so that nothing is lost: a temporary directory beside the destination, moved
into place only when complete; an existing destination only replaced with --force; never inside
(or onto) the input model."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import torch

from compress.errors import CompressError


class AtomicOutput:
    """`with AtomicOutput(dest, force, protect=[model_dir]) as tmp:` write into tmp; on success it
    becomes dest, on any exception it is removed."""

    def __init__(self, dest: str | Path, force: bool = False, protect: list[str | Path] = ()):
        self.dest = Path(dest).expanduser().resolve()
        self.force = force
        for p in protect:
            p = Path(p).expanduser().resolve()
            if self.dest == p or p in self.dest.parents:
                raise CompressError(f"output {dest} lies inside the input model {p}", "choose an output directory outside the input model")
        if self.dest.exists() and not self.dest.is_dir():
            raise CompressError(f"output {dest} is a file", "choose a directory path for the output")
        if self.dest.exists() and not force:
            raise CompressError(f"output directory {dest} already exists", "pass --force to replace it, or choose another --output")
        self.tmp = self.dest.parent / f".{self.dest.name}.tmp-{os.getpid()}"

    def __enter__(self) -> Path:
        try:
            self.dest.parent.mkdir(parents=True, exist_ok=True)
            if self.tmp.exists():
                shutil.rmtree(self.tmp)
            self.tmp.mkdir()
        except OSError as exc:
            raise CompressError(f"cannot create output directory {self.dest}: {exc.strerror}", "check permissions and free space") from None
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        old = None
        if self.dest.exists():
            old = self.dest.parent / f".{self.dest.name}.old-{os.getpid()}"
            os.replace(self.dest, old)
        os.replace(self.tmp, self.dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return False


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """Peak resident memory (and CUDA allocation) while the block runs, sampled every 20 ms."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.peak_rss = 0
        self.peak_cuda = 0
        self._stop = threading.Event()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, _rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakMemory":
        self.start = time.perf_counter()
        self.peak_rss = _rss_bytes()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        self._stop.set()
        self._thread.join()
        self.peak_rss = max(self.peak_rss, _rss_bytes())
        self.wall_s = time.perf_counter() - self.start
        if torch.cuda.is_available():
            self.peak_cuda = torch.cuda.max_memory_allocated()
        return False


def dir_weight_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
