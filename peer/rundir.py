"""A run folder (`--out-dir`, `--checkpoint-dir`): whether a new run may write into it.

A peer writes `metrics.jsonl`, `report.json`, `anchor.safetensors` and `checkpoints/` there (before
safetensors: `anchor.pt` and `ckpt-*.pt`, which count as an earlier run too). A new run in a
folder that holds an earlier one would overwrite that run's model and report, append to its metrics
and prune its checkpoints, so `check_fresh` refuses it in one line unless the peer resumes (which
continues the earlier run on purpose). `murmur simulate` instead moves on to the next free folder
(`fresh_folder`) and says so.
"""

from __future__ import annotations

from pathlib import Path

OUTPUTS = ("anchor.safetensors", "anchor.pt", "report.json", "metrics.jsonl")


def earlier_run(out_dir: Path | None, checkpoints: Path | None) -> list[str]:
    """What of an earlier run these folders hold (file names, for the message); [] if nothing."""
    found = [name for name in OUTPUTS if out_dir is not None and (out_dir / name).exists()]
    saved = ("ckpt-*.safetensors", "ckpt-*.pt")
    if checkpoints is not None and checkpoints.is_dir() and any(any(checkpoints.glob(g)) for g in saved):
        found.append(f"checkpoints in {checkpoints}")
    return found


def check_fresh(out_dir: Path | None, checkpoints: Path | None, *, resume: bool) -> None:
    """ValueError (one line) if a run that does not resume would write over an earlier run's files."""
    found = [] if resume else earlier_run(out_dir, checkpoints)
    if found:
        where = out_dir if out_dir is not None else checkpoints
        raise ValueError(f"{where} holds an earlier run ({', '.join(found)}): pass --resume to continue it, "
                         "or choose a new folder")  # fmt: skip


def fresh_folder(folder: Path) -> Path:
    """`folder` if it holds no earlier run, else the first of folder-2, folder-3, ... that does not exist."""
    if not folder.exists() or not any(folder.iterdir()):
        return folder
    n = 2
    while (candidate := folder.with_name(f"{folder.name}-{n}")).exists():
        n += 1
    return candidate
