"""Byzantine attacks on gossip DiLoCo: can one bad peer out of 8 derail the honest ones?

Runs the convergence benchmark's harness (`peer.sim.virtual.run_murmur`, 8 peers, the real protocol over
the in-memory transport) once clean and once per attack. The attacker trains honestly but rewrites
every frame it sends, at the wire level (`before_send`): it decodes the frame, changes the tensors
and re-encodes it, so the honest peers' decoder, checks and robust aggregation see exactly what a
real attacker's bytes would be. Attacks on every float tensor of a message:

    scaled     × 100
    noise      Gaussian noise of the tensor's own RMS, in place of the tensor
    sign_flip  negated
    nan        NaN and ±Inf in place of the values
    replay     the tensors of the attacker's first message of the same kind (an old update)

uint8 tensors (packed sign bits) get random bytes under `noise` and are left alone otherwise (with
a float scale beside them, negating the scale is the sign flip). Writes bench_attack.json into
--out with each attack's final honest mean eval loss ÷ the clean run's, the worst honest peer, and
the non-finite values in honest peers' models (target: every ratio ≤ 1.05, zero non-finite).

    .venv/bin/python scripts/bench_attack.py --quick    # tiny budget, under 2 minutes
    .venv/bin/python scripts/bench_attack.py            # 8 peers, 8 rounds of H=10: about 30 minutes on 2 busy cores
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import msgpack
import torch

from murmur.averaging import wire
from murmur.peer.config import TrainConfig
from murmur.peer.data import DataConfig, load_corpus
from murmur.peer.sim.virtual import Scenario, run_murmur

ATTACKS = ("scaled", "noise", "sign_flip", "nan", "replay")
TARGET_RATIO = 1.05


class Attacker:
    """A `before_send` hook: rewrites every frame `attacker` sends according to `attack`."""

    def __init__(self, attack: str, attacker: str, seed: int = 0) -> None:
        if attack not in ATTACKS:
            raise ValueError(f"unknown attack {attack!r}")
        self.attack = attack
        self.attacker = attacker
        self.gen = torch.Generator().manual_seed(seed)
        self.first: dict[int, dict[str, list]] = {}  # message kind -> its first tensors (for replay)
        self.tampered = 0

    async def __call__(self, src: str, dst: str, frame: bytes) -> bytes:
        if src != self.attacker:
            return frame
        message = msgpack.unpackb(frame, raw=False)  # our own honest peer's frame, so trusted
        if not message["x"]:
            return frame
        self.tampered += 1
        if self.attack == "replay":
            message["x"] = self.first.setdefault(message["k"], message["x"])
        else:
            message["x"] = {name: self._entry(*entry) for name, entry in message["x"].items()}
        return msgpack.packb(message, use_bin_type=True)

    def _entry(self, dtype_name: str, shape: list[int], raw: bytes) -> list:
        if dtype_name == "uint8":  # sign bits: only noise touches them
            if self.attack == "noise":
                raw = bytes(torch.randint(0, 256, (len(raw),), generator=self.gen).tolist())
            return [dtype_name, shape, raw]
        dtype = wire.dtype_from_name(dtype_name)
        t = wire.tensor_from_bytes(raw, dtype, shape).float()
        if self.attack == "scaled":
            t = t * 100
        elif self.attack == "noise":
            t = torch.randn(t.shape, generator=self.gen) * t.square().mean().sqrt()
        elif self.attack == "sign_flip":
            t = -t
        else:  # nan
            flat = t.view(-1)
            flat[0::3], flat[1::3], flat[2::3] = math.nan, math.inf, -math.inf
        t = t.to(dtype)
        return [dtype_name, list(t.shape), wire.tensor_to_bytes(t)]


class EventCounter(logging.Handler):
    """Counts the honest peers' averaging log lines: aborted exchanges, clips, cool-downs."""

    EVENTS = {"aborted": "aborted", "clipped": "clipped", "cool-down": "on cool-down"}

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts = dict.fromkeys(self.EVENTS, 0)

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        for event, marker in self.EVENTS.items():
            self.counts[event] += marker in text


def run(attack: str | None, config: TrainConfig, corpus, scenario: Scenario, attacker: int) -> dict:
    hook = None if attack is None else Attacker(attack, f"p{attacker}", seed=scenario.seed)
    started = time.monotonic()
    events = EventCounter()
    averaging_log = logging.getLogger("murmur.averaging")
    averaging_log.addHandler(events)
    try:
        result = run_murmur(config, corpus, scenario, name=attack or "clean", tamper=hook)
    finally:
        averaging_log.removeHandler(events)
    honest = [i for i in range(scenario.peers) if attack is None or i != attacker]
    losses = [result.peer_losses[i] for i in honest]
    return {
        "honest_mean_loss": sum(losses) / len(losses),
        "worst_honest_loss": max(losses),
        "non_finite": sum(result.peer_non_finite[i] for i in honest),
        "exchanges": result.exchanges,
        "lonely_rounds": result.lonely_rounds,
        "tampered_frames": 0 if hook is None else hook.tampered,
        "events": events.counts,
        "wall_seconds": time.monotonic() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny budget on a small corpus: under 2 minutes")
    parser.add_argument("--rounds", type=int, help="outer rounds of the budget (default 8, quick 2)")
    parser.add_argument("--inner-steps", type=int, help="H (default 10, quick 2)")
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    parser.add_argument("--attacker", type=int, default=3, help="which of the 8 peers attacks")
    parser.add_argument("--out", type=Path, default=Path("scripts/results"))
    args = parser.parse_args()

    torch.set_num_threads(1)  # one thread per core left free; two thrash on a shared 2-core box
    averaging_log = logging.getLogger("murmur.averaging")
    averaging_log.setLevel(logging.INFO)
    averaging_log.propagate = False  # counted by EventCounter, not printed
    peers = 8
    rounds = args.rounds or (2 if args.quick else 8)
    config = TrainConfig(
        inner_steps=args.inner_steps or (2 if args.quick else 10),
        outer_lr=1.0,  # the convergence benchmark's swept defaults
        outer_momentum=0.0,
        warmup_steps=2 if args.quick else 20,
        eval_batches=1 if args.quick else 8,
        batch_size=8 if args.quick else 16,
    )
    budget = peers * config.batch_size * config.inner_steps * rounds
    scenario = Scenario(peers=peers, sample_budget=budget, eval_points=1)
    corpus = load_corpus(DataConfig(max_bytes=400_000) if args.quick else DataConfig())
    started = time.monotonic()
    clean = run(None, config, corpus, scenario, args.attacker)
    print(f"clean      loss {clean['honest_mean_loss']:.4f} worst {clean['worst_honest_loss']:.4f} "
          f"exchanges {clean['exchanges']} {clean['events']}  ({clean['wall_seconds']:.0f} s)", flush=True)  # fmt: skip
    rows = {}
    for attack in args.attacks:
        r = run(attack, config, corpus, scenario, args.attacker)
        r["loss_vs_clean"] = r["honest_mean_loss"] / clean["honest_mean_loss"]
        r["worst_vs_clean"] = r["worst_honest_loss"] / clean["honest_mean_loss"]
        rows[attack] = r
        print(f"{attack:10s} loss {r['honest_mean_loss']:.4f} worst {r['worst_honest_loss']:.4f} "
              f"ratio {r['loss_vs_clean']:.4f} worst ratio {r['worst_vs_clean']:.4f} non-finite {r['non_finite']} "
              f"exchanges {r['exchanges']} {r['events']}  ({r['wall_seconds']:.0f} s)", flush=True)  # fmt: skip
        met = all(r["loss_vs_clean"] <= TARGET_RATIO and r["non_finite"] == 0 for r in rows.values())
        report = {
            "config": {"peers": peers, "rounds": rounds, "attacker": args.attacker, "quick": args.quick,
                       "train": config.to_record(), "target_ratio": TARGET_RATIO},
            "clean": clean,
            "attacks": rows,
            "targets_met": met and len(rows) == len(args.attacks),
            "wall_seconds": time.monotonic() - started,
        }  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)  # after every attack, so a cut-short run keeps its rows
        (args.out / "bench_attack.json").write_text(json.dumps(report, indent=2))
    print(f"targets met: {report['targets_met']}")


if __name__ == "__main__":
    main()
