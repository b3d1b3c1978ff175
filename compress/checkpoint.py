"""Writing outputs so that nothing is lost: a temporary directory beside the destination, moved
into place only when complete; an existing destination (unless empty) only replaced with --force;
never inside (or onto) the input model."""

from __future__ import annotations

import errno
import fnmatch
import os
import shutil
import signal
import stat
import tempfile
import threading
import time
from pathlib import Path

import torch

from compress.errors import CompressError


# Testing hook: the kill tests set these to make a run kill itself at a named point, so that every
# point is hit deterministically (a timer would land wherever the machine happened to be).
KILL_AT_ENV = "COMPRESS_TEST_KILL_AT"  # a point name, or a pattern such as "progress:block 2*"
KILL_SIGNAL_ENV = "COMPRESS_TEST_KILL_SIGNAL"  # KILL (the default), INT (Ctrl-C) or TERM (`kill`)
INCOMPLETE_MARKER = "COMPRESS_INCOMPLETE"  # in a temporary output until it is moved into place


def kill_point(name: str) -> None:
    """Named points where a test may kill the run: loaded, calibrated, progress:<description>,
    cache-storing, stage-done:<i>, saving, before-move, replacing. A no-op unless COMPRESS_TEST_KILL_AT is set."""
    pattern = os.environ.get(KILL_AT_ENV)
    if pattern and fnmatch.fnmatchcase(name, pattern):
        sig = {"INT": signal.SIGINT, "TERM": signal.SIGTERM}.get(os.environ.get(KILL_SIGNAL_ENV, "KILL").upper(), signal.SIGKILL)
        signal.raise_signal(sig)  # INT/TERM surface as KeyboardInterrupt right here, as a real one would


def watch_progress(progress):
    """progress() with every description a kill point (`progress:<description>`), when testing."""
    if not os.environ.get(KILL_AT_ENV):
        return progress

    def update(description: str, completed: int, total: int) -> None:
        kill_point(f"progress:{description}")
        progress(description, completed, total)

    return update


def left_by_dead_runs(directory: Path, pattern: str) -> list[Path]:
    """Entries of `directory` matching `pattern` and named `...-<pid>` by a run that is gone
    (killed: SIGKILL, power loss, no chance to clean up), recognised by their dead process id."""
    found = []
    for p in Path(directory).glob(pattern):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            found.append(p)
    return found


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _usual_file_modes(directory: Path) -> None:
    """Every file as a plain write would create it (0666 less the umask). safetensors writes its
    files 0600, so another user could not read a model that the rest of the directory shares."""
    umask = os.umask(0)
    os.umask(umask)
    for f in directory.rglob("*"):
        if f.is_file() and not f.is_symlink():
            f.chmod(0o666 & ~umask)


def write_whole(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file beside it: a write that fails part way (a full
    disk) leaves the earlier file, or none, never a truncated one. A symbolic link is written
    through (its target replaced), as a plain write would."""
    path = Path(path).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_side_output(path: str | Path, option: str, inputs: list[str | Path] = (), directory: bool = False,
                      replaces: str | None = None) -> Path:
    """Before any work: a report, recipe or benchmark directory named by `option` may not lie in
    (or be) an input model's directory, nor be a directory where a file is meant (or a file where
    a directory is), and its parent must be writable, so a finished run does not fail on writing
    its last file. With `replaces`, an existing file is overwritten only when it starts so (an
    earlier report of the same kind), never another file (a typo of a path). Returns the resolved path."""
    dest = Path(path).expanduser().resolve()
    for p in inputs:
        p = Path(p).expanduser()
        if not p.is_dir():
            continue  # a hub id: nothing of the user's to protect here
        p = p.resolve()
        if dest == p or p in dest.parents:
            raise CompressError(f"{option} {path} lies inside the input model {p}", "write it outside the model's directory")
        if directory and dest in p.parents:
            raise CompressError(f"{option} {path} holds the input model {p}", "choose a directory that holds no input")
    if not directory and dest.is_dir():
        raise CompressError(f"{option} {path} is a directory", "give a file path")
    if replaces is not None and dest.is_file() and dest.stat().st_size:  # an empty file (mktemp's) holds nothing to lose
        try:
            with open(dest, "rb") as fh:
                head = fh.read(len(replaces.encode()))
        except OSError:
            head = b""
        if head != replaces.encode():
            raise CompressError(f"{option} {path} exists and is not a report of this kind; it would be overwritten",
                                "remove it, or choose another path")
    if directory and dest.exists() and not dest.is_dir():
        raise CompressError(f"{option} {path} is a file", "give a directory")
    writable_ancestor([dest, *dest.parents] if directory else list(dest.parents), f"{option} {path}")
    return dest


def writable_ancestor(candidates: list[Path], what: str) -> Path:
    """The first of `candidates` (a path and its parents, nearest first) that exists, checked to
    be a directory this process can create files in: what the operating system would otherwise
    refuse only when the output is written, after the work. `what` names the path in the error."""
    existing = next((q for q in candidates if q.exists()), None)
    if existing is not None and not existing.is_dir():
        raise CompressError(f"{what}: {existing} is a file, not a directory", "choose a path under a directory")
    try:  # a file really created there (root passes os.access even where nothing can be written, /sys)
        if existing is None:
            raise OSError(errno.ENOENT, "nothing of the path exists")
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as exc:
        raise CompressError(f"{what}: {existing} is not a writable directory ({exc.strerror})",
                            "choose a path you can write to") from None
    return existing


class AtomicOutput:
    """`with AtomicOutput(dest, force, protect=[model_dir]) as tmp:` write into tmp; on success it
    becomes dest, on any exception it is removed."""

    def __init__(self, dest: str | Path, force: bool = False, protect: list[str | Path] = ()):
        self.dest = Path(dest).expanduser().resolve()
        self.force = force
        if self.dest.parent.is_dir():  # what killed runs into the same destination left behind
            self._roll_back_interrupted_replace()
            self._remove_stale()
        for p in protect:
            p = Path(p).expanduser().resolve()
            if self.dest == p or p in self.dest.parents:
                raise CompressError(f"output {dest} lies inside the input model {p}", "choose an output directory outside the input model")
            if self.dest in p.parents:  # --force would replace the directory, input included
                raise CompressError(f"input {p} lies inside the output directory {dest}", "choose an output directory that holds no input")
        if self.dest.exists() and not self.dest.is_dir():
            raise CompressError(f"output {dest} is a file", "choose a directory path for the output")
        # An empty directory (`mktemp -d`'s) holds nothing to lose: it is replaced without --force,
        # and the output keeps its permissions (mktemp's 0700).
        self.existed = self.dest.exists()
        self.was_empty = self.dest.is_dir() and not any(self.dest.iterdir())
        self.empty_mode = stat.S_IMODE(self.dest.stat().st_mode) if self.was_empty else None
        if self.dest.exists() and not force and not self.was_empty:
            raise CompressError(f"output directory {dest} already exists", "pass --force to replace it, or choose another --output")
        if self.dest.exists() and not (self.dest / "compress.json").is_file() and any(self.dest.iterdir()):
            # --force replaces the whole directory: only ever one that compress wrote
            raise CompressError(f"output directory {dest} exists and was not written by compress (no compress.json); "
                                "--force replaces only compress outputs", "choose another --output, or empty that directory yourself")
        added = _added_since_written(self.dest)
        if added:  # a user's notes saved into an output would go with it
            listed = ", ".join(added[:3]) + (f" and {len(added) - 3} more" if len(added) > 3 else "")
            raise CompressError(f"output directory {dest} holds files compress did not write ({listed}); --force would delete them",
                                "move them out of the directory, or choose another --output")
        self.tmp = self.dest.parent / f".{self.dest.name}.tmp-{os.getpid()}"
        self._check_creatable(dest)
        self.created: list[Path] = []  # parent directories this run makes, removed again if it fails

    def _check_creatable(self, dest) -> None:
        """Before any work, what the operating system would refuse only when the output is written:
        a parent that is a file or cannot be written (writable_ancestor), a name that, as the
        temporary `.<name>.tmp-<pid>` written first, is over the file system's limit."""
        existing = writable_ancestor(list(self.dest.parents), f"output {dest}")
        try:
            name_max = os.pathconf(existing, "PC_NAME_MAX")
        except (OSError, ValueError):
            name_max = 255
        longest = max([len(self.tmp.name.encode()), len(f".{self.dest.name}.old-{os.getpid()}".encode())]
                      + [len(part.encode()) for part in self.dest.relative_to(existing).parts])
        if longest > name_max:
            room = name_max - (longest - len(self.dest.name.encode()))
            raise CompressError(f"output {dest}: the name is {len(self.dest.name.encode())} bytes; compress writes it first as "
                                f".{self.dest.name[:8]}….tmp-{os.getpid()}, over the file system's {name_max}",
                                f"choose a name of at most {room} bytes")

    def __enter__(self) -> Path:
        try:
            missing = [q for q in [self.dest.parent, *self.dest.parent.parents] if not q.exists()]
            for q in reversed(missing):
                try:
                    q.mkdir()
                    self.created.append(q)
                except FileExistsError:  # made meanwhile by someone else: theirs, not removed
                    pass
            if self.tmp.exists():
                shutil.rmtree(self.tmp)
            self.tmp.mkdir()
            (self.tmp / INCOMPLETE_MARKER).write_text("compress is writing this directory; it is not a checkpoint\n")
        except OSError as exc:
            self._remove_created()
            raise CompressError(f"cannot create output directory {self.dest}: {exc.strerror}", "check permissions and free space") from None
        return self.tmp

    def _remove_created(self) -> None:
        """The parent directories this run made, deepest first, while still empty: a failed or
        interrupted run leaves the file system as it found it."""
        for q in reversed(self.created):
            try:
                q.rmdir()
            except OSError:
                break

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self._remove_created()
            return False
        old = None
        try:  # a Ctrl-C here must not leave the finished temporary directory behind, nor lose dest
            kill_point("before-move")
            (self.tmp / INCOMPLETE_MARKER).unlink(missing_ok=True)
            (self.tmp / MANIFEST).write_text("".join(f + "\n" for f in _files(self.tmp)))
            _usual_file_modes(self.tmp)
            if not self.existed or self.was_empty:
                # Nothing there to keep: renaming onto a missing or empty directory is one atomic
                # step, and fails (ENOTEMPTY, EEXIST) if files arrived meanwhile, which stay put.
                if self.empty_mode is not None:
                    os.chmod(self.tmp, self.empty_mode)
                try:
                    os.replace(self.tmp, self.dest)
                except OSError as exc:
                    if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
                    how = "was empty when the run started and now holds files" if self.was_empty else "appeared during the run"
                    raise CompressError(f"output directory {self.dest} {how}; it was left alone and nothing was written",
                                        "run again with another --output") from None
                return False
            if self.dest.exists():
                old = self.dest.parent / f".{self.dest.name}.old-{os.getpid()}"
                os.replace(self.dest, old)
                kill_point("replacing")
            os.replace(self.tmp, self.dest)
        except BaseException:  # the old output back where it was, if it had been moved aside
            if old is not None and old.exists() and not self.dest.exists():
                os.replace(old, self.dest)
            shutil.rmtree(self.tmp, ignore_errors=True)
            self._remove_created()
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return False

    def _left_by_dead_runs(self, kind: str) -> list[Path]:
        """`.<dest>.<kind>-<pid>` directories of killed earlier runs into the same destination."""
        return [p for p in left_by_dead_runs(self.dest.parent, f".{self.dest.name}.{kind}-*") if p.is_dir()]

    def _remove_stale(self) -> None:
        for p in self._left_by_dead_runs("tmp"):
            shutil.rmtree(p, ignore_errors=True)

    def _roll_back_interrupted_replace(self) -> None:
        """A --force run killed between moving the old output aside and moving the new one in
        left the old, complete checkpoint as `.<dest>.old-<pid>`: put it back, as if the
        interrupted run had never started."""
        if self.dest.exists():
            return
        for p in self._left_by_dead_runs("old"):
            os.replace(p, self.dest)
            return


MANIFEST = ".compress-files"  # every file a finished output was written with, one relative path a line


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def _added_since_written(directory: Path) -> list[str]:
    """Files in a compress output that its run did not write (none known for outputs written
    before the manifest existed)."""
    manifest = directory / MANIFEST
    if not directory.is_dir() or not manifest.is_file():
        return []
    written = set(manifest.read_text().splitlines())
    return [f for f in _files(directory) if f not in written]


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
