"""A run folder (`--out-dir`, `--checkpoint-dir`): whether a new run may write into it.

A peer writes `metrics.jsonl`, `report.json`, `anchor.safetensors` and `checkpoints/` there (before
safetensors: `anchor.pt` and `ckpt-*.pt`, which count as an earlier run too). A new run in a
folder that holds an earlier one would overwrite that run's model and report, append to its metrics
and prune its checkpoints, so `check_fresh` refuses it in one line unless the peer resumes (which
continues the earlier run on purpose), and refuses a resume into a folder of another run, whose final model
would be overwritten just the same (`other_run`). `murmur simulate` instead moves on to the next free folder
(`fresh_folder`) and says so. A peer holds its folders (`FolderLock`) while it runs, so a second peer
started on them, with `--resume` or before the first has written anything, is refused instead of
interleaving its files with the first's and resuming from its checkpoints.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

OUTPUTS = ("anchor.safetensors", "anchor.pt", "report.json", "metrics.jsonl")
LOCK = ".murmur.lock"  # in each folder a peer writes to: its process id, under a POSIX lock while it runs


def earlier_run(out_dir: Path | None, checkpoints: Path | None) -> list[str]:
    """What of an earlier run these folders hold (file names, for the message); [] if nothing."""
    found = [name for name in OUTPUTS if out_dir is not None and (out_dir / name).exists()]
    saved = ("ckpt-*.safetensors", "ckpt-*.pt")
    if checkpoints is not None and checkpoints.is_dir() and any(any(checkpoints.glob(g)) for g in saved):
        found.append(f"checkpoints in {checkpoints}")
    return found


def final_model(out_dir: Path | None) -> Path | None:
    """The final model an earlier run left in `out_dir` (`anchor.safetensors`, or an older murmur's `.pt`), if any."""
    found = [out_dir / name for name in OUTPUTS[:2]] if out_dir is not None else []
    return next((path for path in found if path.is_file()), None)


def final_step(out_dir: Path | None) -> int | None:
    """The inner step of the final model (`anchor.safetensors`) in `out_dir`, from its header; None if there is none,
    or it does not read."""
    from murmur.peer import tensorfile
    from murmur.peer.tensorfile import TensorFileError

    try:
        step = tensorfile.read_metadata(out_dir / "anchor.safetensors").get("murmur.step") if out_dir else None
    except TensorFileError:
        return None
    return int(step) if isinstance(step, str) and step.isascii() and step.isdigit() else None


def _labels(path: Path) -> dict[str, str]:
    """A murmur file's labels from its header alone ({} if it does not read: an unreadable file proves nothing)."""
    from murmur.peer import tensorfile
    from murmur.peer.tensorfile import TensorFileError

    try:
        return tensorfile.read_metadata(path)
    except TensorFileError:
        return {}


def _checkpoints_in(checkpoints: Path | None) -> list[Path]:
    return [] if checkpoints is None or not checkpoints.is_dir() else sorted(checkpoints.glob("ckpt-*.safetensors"))


def other_run(out_dir: Path | None, checkpoints: Path | None, run_id: str) -> tuple[str, str] | None:
    """(the other run's id, the file that names it) if these folders hold another run's final model, or only
    other runs' checkpoints; None if they hold this run's, or nothing readable (an unreadable file proves nothing)."""
    anchor = out_dir / "anchor.safetensors" if out_dir is not None else None
    other = _labels(anchor).get("murmur.run_id") if anchor is not None and anchor.is_file() else None
    if other not in (None, run_id):
        return other, anchor.name
    found = {path.name: _labels(path).get("murmur.run_id") for path in _checkpoints_in(checkpoints)}
    runs = {name: run for name, run in found.items() if run is not None}
    if runs and run_id not in runs.values():
        name, other = next(iter(runs.items()))
        return other, name
    return None


def other_model(checkpoints: Path | None, run_id: str, model: str) -> tuple[str, str] | None:
    """(the other model, the file that names it) if the checkpoint folder holds checkpoints of this run for another
    model (the run's creator changed its model since, or reused its id); None if it holds none."""
    for path in _checkpoints_in(checkpoints):
        labels = _labels(path)
        if labels.get("murmur.run_id") == run_id and (other := labels.get("murmur.model")) not in (None, model):
            return other, path.name
    return None


def check_fresh(out_dir: Path | None, checkpoints: Path | None, *, resume: bool, run_id: str | None = None) -> None:
    """ValueError (one line) if a run that does not resume would write over an earlier run's files, or if one
    that resumes (`run_id`) would write over another run's."""
    from murmur.peer.model import MODEL_FILE  # what `murmur export` writes: read before a peer's files

    found = [] if resume else earlier_run(out_dir, checkpoints)
    where = out_dir if out_dir is not None else checkpoints
    if out_dir is not None and (out_dir / MODEL_FILE).exists():
        raise ValueError(f"{out_dir} holds {MODEL_FILE}, an export: sample and export of {out_dir} would read it, not "
                         "this peer's models; choose another folder")  # fmt: skip
    if found:
        raise ValueError(f"{where} holds an earlier run ({', '.join(found)}): pass --resume to continue it, "
                         "or choose a new folder")  # fmt: skip
    if resume and run_id is not None and (other := other_run(out_dir, checkpoints, run_id)):
        raise ValueError(f"{where} holds run {other[0]!r} ({other[1]}), not {run_id!r}: --resume continues only "
                         "the folder's own run; choose a new folder")  # fmt: skip


def check_writable(*folders: Path | None) -> None:
    """ValueError (one line) unless each folder is one this peer can make or write into: a checkpoint folder that
    is a file or read-only would fail every checkpoint of the run, each only a warning."""
    for folder in folders:
        if folder is None:
            continue
        existing = folder
        while not existing.exists() and existing.parent != existing:  # the folder, or the nearest one that exists
            existing = existing.parent
        where = folder if existing == folder else f"{folder}: {existing}"
        if not existing.is_dir():
            raise ValueError(f"{where} is a file, not a folder")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"{where} is not writable")


def fresh_folder(folder: Path) -> Path:
    """`folder` if it holds no earlier run, else the first of folder-2, folder-3, ... that does not exist."""
    if not folder.exists() or not any(folder.iterdir()):
        return folder
    n = 2
    while (candidate := folder.with_name(f"{folder.name}-{n}")).exists():
        n += 1
    return candidate


class FolderLock:
    """The folders of one running peer, each made if missing and locked (`fcntl.lockf` on `LOCK`: the kernel
    releases it when the process dies, however it dies, and a forked child does not inherit it). `take`
    raises ValueError (one line) if another process holds one of them. A lock lives in its folder: a folder
    deleted while the peer runs takes the lock with it, until `renew` takes it again."""

    def __init__(self, held: list[tuple[Path, int]]) -> None:
        self._held = held  # (folder, descriptor of its lock file)

    @classmethod
    def take(cls, *folders: Path | None) -> FolderLock:
        held: list[tuple[Path, int]] = []
        try:
            for folder in dict.fromkeys(f for f in folders if f is not None):
                held.append((folder, _lock(folder)))
        except BaseException:
            cls(held).release()
            raise
        return cls(held)

    def renew(self) -> list[Path]:
        """Lock each folder again whose lock file is no longer the one held (the folder, or the file, was deleted
        while the peer ran; it is made again); returns those folders. ValueError (one line) if another process
        holds one of them now: it started there meanwhile, and this peer must not write there."""
        renewed = []
        for i, (folder, fd) in enumerate(self._held):
            try:
                if os.path.samestat(os.fstat(fd), os.stat(folder / LOCK)):
                    continue
            except FileNotFoundError:
                pass
            try:
                self._held[i] = (folder, _lock(folder))
            except FolderInUse as e:
                raise ValueError(f"{folder} was deleted while this peer ran, and another murmur peer (process "
                                 f"{e.holder}) holds it now") from None  # fmt: skip
            os.close(fd)
            renewed.append(folder)
        return renewed

    def release(self) -> None:
        for _, fd in self._held:
            os.close(fd)  # the lock goes with the descriptor
        self._held = []


class FolderInUse(ValueError):
    def __init__(self, folder: Path, holder: str) -> None:
        super().__init__(f"{folder} is in use by another murmur peer (process {holder}): stop it, or choose another "
                         "folder")  # fmt: skip
        self.holder = holder


def _lock(folder: Path) -> int:
    """`folder` made if missing and its `LOCK` file locked by this process: the file's descriptor (on a file system
    without locks, unlocked: there is none to hold); ValueError (one line) if another process holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks: none to hold
            return fd
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise FolderInUse(folder, holder) from None
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:  # a full disk: say which file, not a bare '[Errno 28] No space left on device'
        os.close(fd)
        raise OSError(f"cannot write {folder / LOCK}: {e.strerror}") from None
    return fd
