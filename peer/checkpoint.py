"""Checkpoint files: a peer's whole training state, written atomically and checked before use.

A checkpoint is `ckpt-<step:08d>.safetensors`, a `peer.tensorfile`: every tensor of the state under
its path ("trainer/model/wte.weight", "trainer/inner/state/0/exp_avg", "warm_starts/..."), and in
the metadata the rest of the state as JSON (counters, AdamW's param_groups, the peer id), a sha256
over everything, and the labels:

    murmur.kind "checkpoint" | murmur.format "2" | murmur.run_id | murmur.model | murmur.step
    murmur.config (the run's TrainConfig as JSON, if the state carries a "config")

so an empty, truncated, corrupted, foreign or too-new file gets a one-line `CheckpointError`, and
nothing is rebuilt before the hash matches. Nothing is ever unpickled.

`save_checkpoint` writes a hidden temp file in the same folder, fsyncs it, renames it into place
and fsyncs the folder, so a crash leaves the previous checkpoint whole. It then prunes to the newest
`keep` checkpoints of its run and model *that verify* (header, labels and sha256): a corrupt file is
never counted, so it can never push out a good one, and it is never deleted either (nor is another
run's file), so the newest checkpoint that loads is always kept. On a disk with no room for a new checkpoint beside
those kept, the older ones are deleted first (the newest that verifies stays), with one warning: otherwise every later
checkpoint would fail, and a crash would go back to the first ones.
`CheckpointWriter` does the same off the training thread: the loop only takes the snapshot.
`latest_checkpoint` returns the newest usable one for a run and model, skipping each other one
with a warning. `remembered_peers` reads the live peers a checkpoint names from its header alone: a peer that
resumes joins through them too, when the initial peers it was given are gone. `load_state_dict` methods check
saved state with `check_tensors` and `check_count`.

Checkpoints of format 1 (`ckpt-<step>.pt`, `peer.checkpoint_v1`) that an older murmur left are still
read, so an upgraded peer resumes where it was (at the same step a `.safetensors` one wins); they are
never written, never counted when pruning and never deleted: the user removes them.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from murmur.dht.addresses import AddressError, parse_peer_multiaddr
from murmur.peer import checkpoint_v1, tensorfile
from murmur.peer.tensorfile import Snapshot, TensorFileError

logger = logging.getLogger("murmur.checkpoint")

FORMAT = 2
KIND = "checkpoint"
LABELS = ("run_id", "model", "step", "config")  # in the metadata, each its own entry; the rest in murmur.state
_NAME = re.compile(r"ckpt-(\d{8,})\.(safetensors|pt)")
_TEMP_GLOB = ".ckpt-*.tmp"  # tensorfile's hidden temp files: never match ckpt-*


class CheckpointError(ValueError):
    """A checkpoint or a state dict that cannot be used; str(e) is one line."""


def save_checkpoint(directory: Path, state: dict[str, Any], *, keep: int = 2) -> Path:
    """Write `state` atomically as `directory/ckpt-<step>.safetensors`; keep the newest `keep` that verify
    (see `prune`).

    `state` carries "run_id" (str), "model" (str) and "step" (int) for the labels and the name, and may
    carry "config" (the run config, a dict); the rest is tensors, None, bools, numbers, strings, and
    lists, tuples and dicts of them.
    """
    return write_snapshot(directory, snapshot(state), keep=keep)


def snapshot(state: Mapping[str, Any], *, version: int = FORMAT) -> Snapshot:
    """`state` copied and labelled for a checkpoint: training may change its tensors right after."""
    run_id, model, step = state.get("run_id"), state.get("model"), state.get("step")
    if not isinstance(run_id, str) or not isinstance(model, str) or type(step) is not int or step < 0:
        raise ValueError("a checkpoint state needs 'run_id' and 'model' strings and a non-negative int 'step'")
    labels = {"murmur.kind": KIND, "murmur.format": str(version), "murmur.run_id": run_id, "murmur.model": model,
              "murmur.step": str(step)}  # fmt: skip
    if "config" in state:
        labels["murmur.config"] = tensorfile.to_json(state["config"])
    return tensorfile.snapshot({k: v for k, v in state.items() if k not in LABELS}, labels)


def write_snapshot(directory: Path, taken: Snapshot, *, keep: int = 2) -> Path:
    """Hash, write, fsync and rename a `snapshot()` into place; `prune` to the newest `keep`."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    labels = taken.metadata
    path = directory / f"ckpt-{int(labels['murmur.step']):08d}.safetensors"
    for stale in directory.glob(_TEMP_GLOB):  # left by a crash mid-write: first, as on a full disk it holds the
        stale.unlink(missing_ok=True)  # room this write needs (the folder's one writer is this peer: FolderLock)
    run_id, model = labels["murmur.run_id"], labels["murmur.model"]
    if keep > 1 and not _room_for(directory, taken) and (gone := prune(directory, run_id=run_id, model=model, keep=1)):
        # the older checkpoints kept would take the room of the newest, and every later one would fail with them
        if str(directory) not in _cramped:  # said once: it goes on every checkpoint while the disk is full
            _cramped.add(str(directory))
            logger.warning("%s has no room for a checkpoint beside the %d kept: the older ones make room for the "
                           "newest", directory, len(gone) + 1)  # fmt: skip
    tensorfile.write(path, taken)
    prune(directory, run_id=run_id, model=model, keep=keep)
    return path


_cramped: set[str] = set()  # the folders said to have no room for all the checkpoints kept


def _room_for(directory: Path, taken: Snapshot) -> bool:
    """Whether the file system of `directory` has room for the checkpoint `taken` (its tensors, its metadata, and a
    margin for the header and the blocks' rounding); True if it cannot tell."""
    size = sum(t.numel() * t.element_size() for t in taken.tensors.values())
    size += sum(len(k) + len(v) for k, v in taken.metadata.items()) + (1 << 16)
    try:
        return shutil.disk_usage(directory).free >= size
    except OSError:  # the folder not made yet, or gone: the write says what is wrong
        return True


def prune(directory: Path, *, run_id: str, model: str, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints of this run and model that verify; returns what went.

    Only files that verified are counted and only they are deleted: a truncated or corrupt file (which
    `latest_checkpoint` skips) neither takes a good file's place nor disappears, and another run's or
    model's file in the same folder is left alone, as are format-1 `.pt` files.
    """
    kept, removed = 0, []
    for path in checkpoint_files(directory):
        if path.suffix != ".safetensors" or not _verifies(path, run_id=run_id, model=model):
            continue
        kept += 1
        if kept > keep:
            path.unlink(missing_ok=True)
            _verified.pop(str(path.resolve()), None)
            removed.append(path)
    return removed


# checkpoints that verified, by path: (size, mtime in ns, run id, model). A write verifies the new file once,
# not every file it keeps (a 124M model's checkpoint is 1.5 GB to read and hash); a file changed since is
# verified again.
_verified: dict[str, tuple[int, int, str, str]] = {}


def _verifies(path: Path, *, run_id: str, model: str) -> bool:
    try:
        stat = path.stat()
    except OSError:
        return False
    key, seen = str(path.resolve()), (stat.st_size, stat.st_mtime_ns, run_id, model)
    if _verified.get(key) == seen:
        return True
    try:
        load_checkpoint(path, run_id=run_id, model=model)
    except CheckpointError:
        return False
    _verified[key] = seen
    return True


class CheckpointWriter:
    """Writes checkpoints on a thread of its own, so the training loop pays only for the snapshot.

    `submit` copies the state at once (the snapshot: training may change the tensors right after)
    and hands the hashing, the write and the fsyncs to the writer thread. A snapshot is a copy of the
    whole training state (a 124M model's is 2.5 GB), so at most one is held besides the one being
    written: while a write is in progress, a round's `submit` takes none and returns False (the next
    round's will), and a `final` one waits for the write to end first. A failed write is a warning, once until a
    write succeeds again (which says so); `flush` waits for the pending write and returns the last path written.
    """

    def __init__(self, directory: Path, *, keep: int = 2) -> None:
        self.directory, self.keep = directory, keep
        self.last: Path | None = None
        self.failed = 0  # checkpoints not saved since the last one that was
        self._pending: Snapshot | None = None
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="murmur-checkpoint", daemon=True)
        self._thread.start()

    def submit(self, state: dict[str, Any], *, final: bool = False) -> bool:
        """Snapshot `state` for the writer; False if a write was in progress (not `final`): nothing taken."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the checkpoint writer is closed")
            if self._busy and not final:
                return False
            self._cond.wait_for(lambda: not self._busy)
            self._pending = None  # superseded (nothing else is held while the new snapshot is taken)
        taken = snapshot(state)
        with self._cond:
            self._pending = taken
            self._cond.notify_all()
        return True

    def flush(self) -> Path | None:
        with self._cond:
            self._cond.wait_for(lambda: self._pending is None and not self._busy)
            return self.last

    def close(self) -> Path | None:
        """Write what is pending, stop the thread; returns the last path written."""
        last = self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        if self.failed:  # the end of a run whose failures were said once, long before
            logger.warning("the last %d checkpoints were not saved in %s; the newest saved is %s", self.failed,
                           self.directory, last or "none")  # fmt: skip
        return last

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                taken, self._pending, self._busy = self._pending, None, True
            path = None
            try:
                path = write_snapshot(self.directory, taken, keep=self.keep)
            except Exception as e:  # a checkpoint that cannot be written never stops training
                if not self.failed:  # said once until one is saved: a full disk fails every round, for days
                    logger.warning("checkpoint not saved in %s: %s; training goes on, and the next checkpoints are "
                                   "tried", self.directory, _first_line(e))  # fmt: skip
                self.failed += 1
            else:
                if self.failed:
                    logger.warning("checkpoints are saved again in %s (%d were not)", self.directory, self.failed)
                self.failed = 0
            with self._cond:
                self.last = path or self.last
                self._busy = False
                self._cond.notify_all()


def load_checkpoint(path: Path, *, run_id: str | None = None, model: str | None = None) -> dict[str, Any]:
    """The state saved in `path`, after checking its header, labels (run id and model, if given) and hash."""
    path = Path(path)
    try:
        if path.suffix == ".pt":
            return checkpoint_v1.load(path, run_id=run_id, model=model)
        metadata, rest = tensorfile.read(path, check=lambda m: _check_labels(m, run_id=run_id, model=model))
        labels = {"run_id": metadata["murmur.run_id"], "model": metadata["murmur.model"],
                  "step": int(metadata["murmur.step"])}  # fmt: skip
        if "murmur.config" in metadata:
            labels["config"] = tensorfile.from_json(metadata["murmur.config"])
    except (TensorFileError, checkpoint_v1.FrameError) as e:
        raise _failure(path, str(e)) from None
    if not isinstance(rest, dict):
        raise _failure(path, "is corrupt: its state is not a dict")
    return labels | rest


def _check_labels(metadata: dict[str, str], *, run_id: str | None, model: str | None) -> None:
    """TensorFileError unless the metadata is a checkpoint's of a format this peer reads, for this run and model."""
    if metadata.get("murmur.kind") != KIND:
        kind = metadata.get("murmur.kind")
        raise TensorFileError(f"is not a checkpoint (a murmur {kind!r} file)" if isinstance(kind, str)
                              else "is not a murmur checkpoint (no murmur metadata)")  # fmt: skip
    version, step = decimal(metadata.get("murmur.format")), decimal(metadata.get("murmur.step"))
    if version is None or step is None or not all(isinstance(metadata.get(f"murmur.{k}"), str) for k in LABELS[:2]):
        raise TensorFileError("is corrupt: malformed metadata")
    if version > FORMAT:
        raise TensorFileError(f"was written by a newer format {version} (this peer reads format {FORMAT})")
    for key, expected in (("run_id", run_id), ("model", model)):
        if expected is not None and metadata[f"murmur.{key}"] != expected:
            raise TensorFileError(f"is for {key.replace('_', ' ')} {metadata[f'murmur.{key}']!r}, not {expected!r}")


def decimal(text: Any) -> int | None:
    """A non-negative int written as decimal digits, or None."""
    return int(text) if isinstance(text, str) and text.isascii() and text.isdigit() else None


def _failure(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} {why}")


def latest_checkpoint(
    directory: Path, *, run_id: str, model: str, accept: Callable[[dict[str, Any]], None] | None = None
) -> tuple[dict[str, Any], Path] | None:
    """The newest usable checkpoint of this run and model in `directory`, or None.

    Checkpoints are tried newest first; one that fails to load, or that `accept` (if given) rejects
    by raising ValueError, is skipped with a one-line warning and the next older one is tried.
    """
    for path in checkpoint_files(Path(directory)):
        try:
            state = load_checkpoint(path, run_id=run_id, model=model)
        except CheckpointError as e:
            logger.warning("%s; skipped", e)
            continue
        try:
            if accept is not None:
                accept(state)
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("checkpoint %s does not fit this peer: %s; skipped", path, _first_line(e))
            continue
        return state, path
    return None


def remembered_peers(directory: Path, *, run_id: str, limit: int = 8) -> list[str]:
    """The addresses of the live peers that the newest checkpoint of `run_id` in `directory` remembers (its state's
    "peers"), without the peer that wrote it; [] if none. Only the header is read (no tensor, no hash: each is only
    an address to try, checked as a multiaddr), so a peer can join through them before it knows its model."""
    for path in checkpoint_files(Path(directory)):
        try:
            metadata = tensorfile.read_metadata(path) if path.suffix == ".safetensors" else {}
            state = json.loads(metadata.get(tensorfile.STATE, "null"))
        except (TensorFileError, ValueError):
            continue
        if metadata.get("murmur.run_id") != run_id or not isinstance(state, dict):
            continue
        writer, found = state.get("peer_id"), []
        for address in state.get("peers") if isinstance(state.get("peers"), list) else []:
            try:
                address = parse_peer_multiaddr(address)
            except AddressError:
                continue
            if not (isinstance(writer, str) and writer and address.endswith(f"/p2p/{writer}")):
                found.append(address)
        return list(dict.fromkeys(found))[:limit]
    return []


def check_tensors(
    tensors: Any,
    shapes: Mapping[str, tuple[int, ...]],
    what: str,
    *,
    partial: bool = False,
    integral: Collection[str] = (),
    unbounded: Collection[str] = (),
) -> Mapping[str, torch.Tensor]:
    """Check a saved {name: tensor} against the expected names and shapes, and that all are finite but those
    named in `unbounded` (a model's buffers: an attention mask of -inf).

    With `partial`, names may be missing (error-feedback residuals, warm starts), never unknown. Every tensor
    is a float tensor but those named in `integral`, which are not (a model's integer or bool buffers, as
    BatchNorm's `num_batches_tracked`).
    """
    if not isinstance(tensors, Mapping):
        raise CheckpointError(f"{what} is not a dict of tensors")
    unknown = sorted(set(tensors) - set(shapes))
    missing = [] if partial else sorted(set(shapes) - set(tensors))
    if unknown or missing:
        raise CheckpointError(f"{what} does not match this model: unknown {unknown[:3]}, missing {missing[:3]}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.is_floating_point() == (name in integral):
            raise CheckpointError(f"{what} {name} is not {'an integer' if name in integral else 'a float'} tensor")
        if tuple(t.shape) != tuple(shapes[name]):
            raise CheckpointError(f"{what} {name} has shape {tuple(t.shape)}, expected {tuple(shapes[name])}")
        if name not in unbounded and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{what} {name} is not finite")
    return tensors


def check_count(value: Any, what: str) -> int:
    """A saved counter: a non-negative int."""
    if type(value) is not int or value < 0:
        raise CheckpointError(f"{what} must be a non-negative int, got {value!r}")
    return value


def checkpoint_files(directory: Path) -> list[Path]:
    """Every ckpt-*.safetensors and ckpt-*.pt in `directory`, newest first (at one step, .safetensors first)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), m.group(2) == "safetensors", p) for p in directory.iterdir()
             if (m := _NAME.fullmatch(p.name))]  # fmt: skip
    return [p for *_, p in sorted(found, reverse=True)]


def named_step(path: Path) -> int | None:
    """The step a checkpoint's file name gives (`ckpt-00000120.safetensors`: 120), or None for another name."""
    return int(m.group(1)) if (m := _NAME.fullmatch(path.name)) else None


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:200]
