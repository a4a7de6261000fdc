"""The run's training config: what every peer of a run must agree on.

The bootstrap node publishes it on the DHT as the run record, so a volunteer needs only a
bootstrap address and a run id. It travels as a flat dict of scalars; `from_record` checks every
key and value, so a wrong or hostile record gets a one-line error instead of a crash later.

It imports no torch at module level (the model registry and the configs of the compressor and the
outer optimizer are imported where they are used), so the command line reads its defaults at once.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from murmur.averaging.compression import LowRankConfig
    from murmur.peer.outer import OuterConfig
    from murmur.peer.rounds import RoundConfig

DEFAULT_MODEL = "gpt-tiny"  # the registry model a run trains unless told otherwise (peer.model.MODELS)
_SPEC = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")


def is_spec(text: str) -> bool:
    """Whether `text` has the shape `pkg.module:function`; nothing is imported (see `peer.workload`)."""
    return isinstance(text, str) and bool(_SPEC.fullmatch(text))


class ConfigError(ValueError):
    """A bad config value; str(e) is one line."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str = DEFAULT_MODEL  # a registry name, or the import path of a researcher's model builder
    seed: int = 0  # model init, identical on every peer
    batch_size: int = 16
    inner_steps: int = 20  # H: local AdamW steps between exchanges
    inner_lr: float = 2e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # plain averaging: in the learning-rate sweep (scripts/results/bench_convergence_sweep.json) it
    # beat DiLoCo's Nesterov 0.7 / 0.9 for both diloco and murmur at the budgets measured here
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    rank: int = 4
    # how the pseudo-gradient travels: "sign" (1 bit + row scales), "lowrank" (rank-r factors) or "dense" (fp16)
    codec: str = "sign"
    # how anchors are pulled together when a group's differ: "int8" (a scale per row; all move to the same mean),
    # "lowrank" (a rank-r PowerGossip pull, a fraction of the bytes) or "dense" (fp16)
    consensus_codec: str = "int8"
    consensus: bool = True
    error_feedback: bool = True
    solo_after: int = 4  # rounds without a group before a peer takes an outer step alone
    # rounds on a shared clock (averaging.groups): a round lasts round_seconds (0: H steps and an exchange at the
    # swarm's pace), peers average in groups of at most group_size, and a leader waits `window` of a round for
    # late members
    round_seconds: float = 0.0
    shortest_round: float = 2.0  # seconds: an automatic round is no shorter (appointments travel through the DHT)
    group_size: int = 8
    window: float = 0.25
    # when a peer's training ends (its --duration): rounds that average anchors only, so that the final models
    # agree (scripts/simulate_scale.py measures how many a swarm needs); "dense" (fp16) or "int8" anchors
    finish_rounds: int = 0
    finish_codec: str = "dense"
    eval_batches: int = 8
    heldout_fraction: float = 0.1

    def __post_init__(self) -> None:
        from murmur.peer.model import MODELS

        if self.model not in MODELS and not is_spec(self.model):
            raise ConfigError(
                f"unknown model '{self.model}'; choose one of: {', '.join(MODELS)}, or pkg.module:build_model"
            )
        for name in ("batch_size", "inner_steps", "rank", "eval_batches", "solo_after", "group_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("inner_lr", "outer_lr", "grad_clip"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive finite number, got {value}")
        for name in ("warmup_steps", "weight_decay", "finish_rounds", "seed"):
            if not getattr(self, name) >= 0:  # NaN fails too
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        try:
            self.outer()
            self.compression()
            self.rounds()
            if self.finish_codec not in ("dense", "int8"):
                raise ValueError(f"finish_codec must be 'dense' or 'int8', got {self.finish_codec!r}")
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def outer(self) -> OuterConfig:
        from murmur.peer.outer import OuterConfig

        return OuterConfig(
            lr=self.outer_lr,
            momentum=self.outer_momentum,
            consensus=self.consensus,
            error_feedback=self.error_feedback,
        )

    def rounds(self) -> RoundConfig:
        """The round engine's config (`peer.rounds`): the round's length, the schedule, lonely rounds, the finish."""
        from murmur.averaging.groups import ScheduleConfig
        from murmur.peer.rounds import RoundConfig

        schedule = ScheduleConfig(group_size=self.group_size, window=self.window)
        return RoundConfig(inner_steps=self.inner_steps, round_seconds=self.round_seconds, solo_after=self.solo_after,
                           finish_rounds=self.finish_rounds, schedule=schedule,
                           shortest_round=self.shortest_round)  # fmt: skip

    def compression(self) -> LowRankConfig:
        from murmur.averaging.compression import LowRankConfig

        return LowRankConfig(
            rank=self.rank, seed=self.seed, mean_codec=self.codec, diff_codec=self.consensus_codec
        )  # fmt: skip

    def finish_compression(self) -> LowRankConfig:
        """How a finish round's anchors travel: whole in fp16 ("dense"), or as int8 with a scale per row; a
        low-rank pull would need many more rounds to agree."""
        from murmur.averaging.compression import LowRankConfig

        return LowRankConfig(rank=self.rank, seed=self.seed, mean_codec=self.codec, diff_codec=self.finish_codec)

    def to_record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> TrainConfig:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(record) - set(fields))
        if unknown:
            raise ConfigError(f"run config has unknown keys {unknown}: is this peer older than the run?")
        values = {}
        for name, value in record.items():
            kind = type(getattr(cls(), name))
            if kind is float and type(value) is int:
                value = float(value)
            if type(value) is not kind:
                raise ConfigError(f"run config key '{name}' must be {kind.__name__}, got {value!r}")
            values[name] = value
        return cls(**values)

    def with_overrides(self, **overrides: Any) -> TrainConfig:
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})
