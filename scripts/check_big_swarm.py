"""A 124M-parameter model through a real swarm on loopback: exchanges, a late joiner, a SIGKILL, a finish.

Real `murmur join` processes (real DHT, real `p2pd`) train `examples/gpt2_short.py`, GPT-2 small's 12
layers of 768 with GPT-2's vocabulary on 64-byte windows (123.7M parameters), against an in-process
bootstrap node:

1. peers A and B start; the check waits until each has exchanged with the other;
2. A is SIGKILLed (its whole process group) and started again with `--resume`: it resumes from its
   newest safetensors checkpoint and exchanges with B again;
3. B leaves (SIGTERM: a clean stop), and a late joiner C starts with nothing and downloads the
   swarm's state (A's) before it announces itself;
4. every peer was given the same `--until`, so A and C stop training together and average their
   anchors in finish rounds.

At most two 124M peers run at once: a peer holds about 9.5 GB here (plain training 3.5 GB, a
checkpoint snapshot 2 GB, the outer state and an exchange the rest), and three do not fit in 24 GiB.

It prints one line per step and writes `check_big_swarm.json` (each peer's report and the lines each
check matched); exit 0 when every check held. Every process it started is reaped by process group.

    .venv/bin/python scripts/check_big_swarm.py            # about 12 minutes on 2 cores, ~20 GB of RAM
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from murmur.dht.node import stop_node
from murmur.peer.config import TrainConfig
from murmur.peer.flags import number, out_file
from murmur.peer.sim.simulate import join_command, launch, start_bootstrap, stop_processes

RESULTS = Path(__file__).resolve().parent / "results"
MODEL, DATA = "examples.gpt2_short:build_model", "examples.gpt2_short:build_batches"


def wait_for(what: str, check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            print(f"  ok: {what}", flush=True)
            return
        time.sleep(1.0)
    raise SystemExit(f"check failed: {what} (not within {timeout:.0f} s)")


def rounds_with_exchange(folder: Path) -> int:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return sum(1 for r in lines if r.get("partner"))


def log_has(log: Path, pattern: str) -> str | None:
    text = log.read_text(errors="replace") if log.exists() else ""
    found = re.search(pattern, text)
    return found.group(0) if found else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-seconds", type=number(), default=540.0, help="from start to the shared --until")
    parser.add_argument("--out", type=out_file, default=RESULTS / "check_big_swarm.json")
    args = parser.parse_args(argv)
    config = TrainConfig(model=MODEL, inner_steps=2, batch_size=2, eval_batches=1, finish_rounds=2)
    run = f"big-{os.getpid()}"
    work = Path(tempfile.mkdtemp(prefix="murmur-big-"))
    boot, maddrs = start_bootstrap(run, config)
    until = time.time() + args.train_seconds
    procs: dict[str, object] = {}
    matched: dict[str, str] = {}

    def start(name: str, seed: int, *extra: str):
        command = join_command(maddrs, run, work / name, seed, "--model", MODEL, "--data", DATA, "--until",
                               str(until), "--exchange-timeout", "120", "--checkpoint-every", "1", *extra)  # fmt: skip
        command.insert(command.index("join"), "-v")  # the peer's INFO lines go to its log
        procs[name] = launch(command, work / f"{name}.log")

    try:
        print(f"1. peers A and B train a {123.7:.1f}M model (logs in {work})", flush=True)
        start("A", 1)
        start("B", 2)
        wait_for("A and B exchanged", lambda: min(rounds_with_exchange(work / n) for n in "AB") >= 1, 300)
        print("2. A is SIGKILLed and resumes from its checkpoint", flush=True)
        wait_for("A wrote a checkpoint", lambda: any((work / "A" / "checkpoints").glob("ckpt-*.safetensors")), 240)
        os.killpg(procs["A"].pid, signal.SIGKILL)
        procs["A"].wait(timeout=30)
        before = rounds_with_exchange(work / "A")
        start("A", 1, "--resume")
        wait_for("A resumed", lambda: log_has(work / "A.log", r"resumed from [^\n]*"), 180)
        matched["A"] = log_has(work / "A.log", r"resumed from [^\n]*") or ""
        wait_for("A exchanged again", lambda: rounds_with_exchange(work / "A") > before, 240)
        print("3. B leaves, and a late joiner C downloads the swarm's state", flush=True)
        procs["B"].terminate()  # a clean stop: the peer's own SIGTERM handling, then its DHT worker and p2pd
        procs["B"].wait(timeout=120)
        print(f"  B exited with {procs['B'].returncode}", flush=True)
        start("C", 3)
        wait_for("C downloaded the state", lambda: log_has(work / "C.log", r"downloaded the swarm's state[^\n]*"), 240)
        matched["C"] = log_has(work / "C.log", r"downloaded the swarm's state[^\n]*") or ""
        print("4. A and C train until the shared --until, then finish", flush=True)
        remaining = until - time.time()
        for name, proc in procs.items():
            proc.wait(timeout=max(60.0, remaining + 300))
            print(f"  {name} exited with {proc.returncode}", flush=True)
        reports = {n: json.loads((work / n / "report.json").read_text()) if (work / n / "report.json").exists()
                   else {} for n in procs}  # fmt: skip  # a peer the OOM killer ended wrote none
        finished = {n: r.get("finish_exchanges", 0) for n, r in reports.items()}
        exchanged = {n: r.get("exchanges_ok", 0) for n, r in reports.items()}
        checks = {
            "every peer exited 0": all(p.returncode == 0 for p in procs.values()),
            "every peer exchanged": all(v >= 1 for v in exchanged.values()),
            "A and C completed a finish round": finished.get("A", 0) >= 1 and finished.get("C", 0) >= 1,
            "C downloaded the state": bool(matched.get("C")),
            "A resumed from a checkpoint": ".safetensors" in matched.get("A", ""),
        }
        for check, held in checks.items():
            print(f"check {check}: {'held' if held else 'FAILED'}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        exits = {n: p.returncode for n, p in procs.items()}
        result = {"model": MODEL, "params": 123_702_528, "checks": checks, "matched": matched, "exit_codes": exits,
                  "exchanges_ok": exchanged, "finish_exchanges": finished}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
        return 0 if all(checks.values()) else 1
    finally:
        stop_processes(list(procs.values()), 30.0)
        stop_node(boot)


if __name__ == "__main__":
    sys.exit(main())
