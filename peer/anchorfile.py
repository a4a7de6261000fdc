"""The final model, `anchor.safetensors`: a peer's outer anchor as its model's own state dict.

The tensors are exactly the keys and shapes of `model.state_dict()`, so a user needs nothing of
murmur's to use it (any seed: the file holds every weight):

    model = build_model("gpt-tiny", seed=0)
    model.load_state_dict(safetensors.torch.load_file("runs/me/anchor.safetensors"))  # strict

Parameters come from the anchor (float32); a tied weight (the GPT's `lm_head.weight`, which *is*
`wte.weight`) is stored under each of its names as a copy of its own, since safetensors cannot store
tensors that share memory; buffers come from the model as they are. The metadata (a `peer.tensorfile`:
hashed, written atomically) holds murmur.kind "model", murmur.format, murmur.run_id, murmur.model,
murmur.step, murmur.outer_step, murmur.config (the run's TrainConfig as JSON) and murmur.parameters
(the names of the distinct parameters, as `named_parameters()` lists them). `read_anchor` gives back
the anchor keyed that way, as the consensus distance compares them. Before safetensors the model was
`anchor.pt`, a `torch.save` of that anchor; `peer.rundir` still knows the name.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from murmur.peer import tensorfile
from murmur.peer.tensorfile import TensorFileError

ANCHOR = "anchor.safetensors"
FORMAT = 1
KIND = "model"


def model_state(model: nn.Module, anchor: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`model.state_dict()`'s keys, each parameter's value from `anchor` (by its `named_parameters()` name,
    tied names included), each buffer (and any parameter the anchor lacks) from the model itself."""
    names = {id(p): n for n, p in model.named_parameters()}  # a tied parameter: its first name
    state = {}
    for key, value in model.state_dict(keep_vars=True).items():
        name = names.get(id(value))
        state[key] = anchor[name] if name in anchor else value.detach()
    return state


def save_anchor(
    path: Path, model: nn.Module, anchor: Mapping[str, torch.Tensor], *, run_id: str, config: Any, **steps: int
) -> None:
    """Write `model_state(model, anchor)` to `path` atomically, labelled with the run, its config (a
    `TrainConfig` or its dict) and `steps` (step=..., outer_step=...)."""
    record = config.to_record() if hasattr(config, "to_record") else config
    labels = {"murmur.kind": KIND, "murmur.format": str(FORMAT), "murmur.run_id": run_id,
              "murmur.model": str(record["model"]), "murmur.config": tensorfile.to_json(record),
              "murmur.parameters": tensorfile.to_json([n for n, _ in model.named_parameters()]),
              **{f"murmur.{k}": str(v) for k, v in steps.items()}}  # fmt: skip
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # a model's size each, left by a kill mid-write: first,
        stale.unlink(missing_ok=True)  # as on a full disk it holds the room this write needs
    tensorfile.write(path, tensorfile.snapshot(model_state(model, anchor), labels))


def read_anchor(path: Path) -> dict[str, torch.Tensor]:
    """The anchor saved in `path` by `save_anchor`, keyed by parameter name (tied copies and buffers left out);
    ValueError (one line) if the file is not such a model or is corrupt."""
    try:
        metadata, state = tensorfile.read(path, check=check_kind)
        names = tensorfile.from_json(metadata.get("murmur.parameters", "null"))
        if not isinstance(names, list) or not isinstance(state, dict) or not set(names) <= set(state):
            raise TensorFileError("is corrupt: murmur.parameters does not match its tensors")
    except TensorFileError as e:
        raise ValueError(f"model {path} {e}") from None
    return {n: state[n] for n in names}


def check_kind(metadata: dict[str, str]) -> None:
    """TensorFileError (one line) unless the metadata is a model's of a format this reader reads."""
    if metadata.get("murmur.kind") != KIND:
        raise TensorFileError("is not a murmur model (no murmur.kind 'model' metadata)")
    version = metadata.get("murmur.format", "")
    if not (version.isascii() and version.isdigit()):
        raise TensorFileError(f"is corrupt: malformed murmur.format {version[:20]!r}")
    if int(version) > FORMAT:
        raise TensorFileError(f"was written by a newer model format {version} (this murmur reads format {FORMAT})")
