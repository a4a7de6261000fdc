"""The run's training config: what every peer of a run must agree on.

The bootstrap node publishes it on the DHT as the run record, so a volunteer needs only a
bootstrap address and a run id. It travels as a flat dict of scalars; `from_record` checks every
key and value, so a wrong or hostile record gets a one-line error instead of a crash later.

It imports no torch at module level (the model registry and the configs of the compressor and the
outer optimizer are imported where they are used), so the command line reads its defaults at once.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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


def _flag(default: Any, description: str, metavar: str | None = None, **constraints: Any) -> Any:
    """A field with its CLI help (its `--flag` is generated from the field's name, type and bounds; `peer.flags`)."""
    extra = {"metavar": metavar} if metavar else None
    return Field(default, description=description, json_schema_extra=extra, **constraints)


class TrainConfig(BaseModel):
    """Every field is a flag of `murmur bootstrap` and `murmur simulate` (`peer.flags.train_flags` makes them
    from this schema: name, type, bounds and description), and a key of the run record."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    model: str = _flag(
        DEFAULT_MODEL, "a registry model (peer.model.MODELS) or a researcher's builder, pkg.module:function"
    )
    seed: int = _flag(0, "model init seed, the same on every peer", ge=0)
    batch_size: int = _flag(16, "sequences per inner step", "B", ge=1)
    inner_steps: int = _flag(20, "H, AdamW steps between exchanges", "H", ge=1)
    inner_lr: float = _flag(2e-3, "AdamW learning rate", "LR", gt=0)
    warmup_steps: int = _flag(20, "inner steps of linear learning-rate warmup", "STEPS", ge=0)
    weight_decay: float = _flag(0.01, "AdamW weight decay", "WD", ge=0)
    grad_clip: float = _flag(1.0, "clip each inner step's gradient norm to this", "NORM", gt=0)
    # plain averaging: in the learning-rate sweep (scripts/results/bench_convergence_sweep.json) it
    # beat DiLoCo's Nesterov 0.7 / 0.9 for both diloco and murmur at the budgets measured here
    outer_lr: float = _flag(1.0, "outer (Nesterov) learning rate; 1 with no momentum: plain averaging", "LR", gt=0)
    outer_momentum: float = _flag(0.0, "outer Nesterov momentum", "M", ge=0, lt=1)
    rank: int = _flag(4, "rank of the low-rank codecs", "R", ge=1)
    codec: Literal["sign", "lowrank", "dense"] = _flag(
        "sign", "how the pseudo-gradient travels: sign (1 bit + row scales), lowrank (rank-R factors) or dense (fp16)"
    )
    consensus_codec: Literal["int8", "lowrank", "dense"] = _flag(
        "int8",
        "how anchors that differ are pulled together: int8 (a scale per row), lowrank (a PowerGossip pull) or "
        "dense (fp16)",
    )
    consensus: bool = _flag(True, "pull the group's anchors together as well as averaging their updates")
    error_feedback: bool = _flag(True, "keep what compression dropped and send it in later rounds")
    residual_precision: Literal["bf16", "fp32"] = _flag(
        "bf16", "precision of the kept error-feedback residual: bf16 holds half a model copy less than fp32"
    )
    solo_after: int = _flag(4, "rounds without a group before a peer takes an outer step alone", "ROUNDS", ge=1)
    # rounds on a shared clock (averaging.groups)
    round_seconds: float = _flag(0.0, "length of a round; 0: H steps and an exchange at the swarm's pace", "SECONDS",
                                 ge=0)  # fmt: skip
    shortest_round: float = _flag(2.0, "an automatic round is no shorter (appointments travel through the DHT)",
                                  "SECONDS", gt=0)  # fmt: skip
    group_size: int = _flag(8, "the most peers averaged together in a round", "G", ge=2)
    window: float = _flag(0.25, "share of a round a group's leader waits for late members, in (0, 1]", "SHARE", gt=0,
                          le=1)  # fmt: skip
    # when a peer's training ends (its --duration): rounds that average anchors only, so that the final models
    # agree (scripts/simulate_scale.py measures how many a swarm needs)
    finish_rounds: int = _flag(0, "when a peer's --duration is over: K rounds that only average anchors, so that the "
                               "final models agree", "K", ge=0)  # fmt: skip
    finish_codec: Literal["dense", "int8"] = _flag("dense", "how a finish round's anchors travel: dense (fp16) or int8")
    eval_batches: int = _flag(8, "held-out batches per evaluation", "N", ge=1)
    heldout_fraction: float = _flag(0.1, "share of the built-in data held out for evaluation", "SHARE", gt=0, lt=1)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise ConfigError(_one_line(e)) from None

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        from murmur.peer.model import MODELS

        if self.model not in MODELS and not is_spec(self.model):
            raise ValueError(
                f"unknown model '{self.model}'; choose one of: {', '.join(MODELS)}, or pkg.module:build_model"
            )
        self.outer()
        self.compression()
        self.rounds()
        return self

    def outer(self) -> OuterConfig:
        from murmur.peer.outer import OuterConfig

        return OuterConfig(
            lr=self.outer_lr,
            momentum=self.outer_momentum,
            consensus=self.consensus,
            error_feedback=self.error_feedback,
            residual_precision=self.residual_precision,
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
        return self.model_dump()

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> TrainConfig:
        """A run record read from the DHT: every key known, every value of its field's type (an int for a
        float is taken as a float; nothing else is converted), every bound kept; ConfigError otherwise."""
        if not isinstance(record, dict):
            raise ConfigError(f"run config must be a dict, got {type(record).__name__}")
        return cls(**record)

    def with_overrides(self, **overrides: Any) -> TrainConfig:
        """A copy with the given fields replaced (None: kept), validated as a new config."""
        return TrainConfig(**(self.model_dump() | {k: v for k, v in overrides.items() if v is not None}))


def _one_line(error: ValidationError) -> str:
    """A config's validation errors in one line, each naming its field: `rank must be at least 1, got 0`."""
    unknown = sorted(str(e["loc"][0]) for e in error.errors() if e["type"] == "extra_forbidden")
    if unknown:
        return f"run config has unknown keys {unknown}: is this peer older than the run?"
    problems = []
    for e in error.errors():
        name, value, context = ".".join(map(str, e["loc"])), e.get("input"), e.get("ctx") or {}
        kind = e["type"]
        if kind == "value_error":  # a check of ours: its message says it all
            problems.append(str(context.get("error", e["msg"])))
        elif kind.endswith("_type"):
            problems.append(f"run config key '{name}' must be {kind.removesuffix('_type')}, got {value!r}")
        elif kind == "greater_than_equal":
            problems.append(f"{name} must be at least {context['ge']}, got {value!r}")
        elif kind == "greater_than":
            problems.append(f"{name} must be above {context['gt']}, got {value!r}")
        elif kind in ("less_than", "less_than_equal"):
            problems.append(f"{name} must be {'below' if kind == 'less_than' else 'at most'} "
                            f"{context.get('lt', context.get('le'))}, got {value!r}")  # fmt: skip
        elif kind == "literal_error":
            problems.append(f"{name} must be {context['expected']}, got {value!r}")
        else:
            problems.append(f"{name}: {e['msg']}")
    return "; ".join(" ".join(p.split()) for p in problems)
