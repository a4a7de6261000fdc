"""What one exchange costs as the model grows: time, memory and bytes, from 0.44M to 124M parameters and up.

For each registry size, two peers run in one fresh process on one CPU thread, with the allocator
setting a real peer starts with (`peer.device.keep_freed_memory`), so that peak RSS is that size's
alone: each builds the model, takes one AdamW step on one batch (plain training), and
then, in the murmur phase, builds its outer optimizer (`peer.outer.OuterOptimizer`) and its real
`GroupAverager`, the two average one round over the in-memory transport with the run's default
codecs, and each applies the result; four times, and the fastest of the last three rounds is reported
(a peer exchanges every round: the first one also pays for the process's first touch of its memory, and
on these shared cores one round's time moves by a third between runs). Before each round their
anchors differ (as two peers' do when last round put them in different groups), so the anchors travel
too, in int8: a round's costliest case. A second process
does the plain training alone, so

    added copies = (peak RSS with the exchange − peak RSS of plain training) / 2 peers / (4 B × params)

is what Murmur holds beyond training (outer state and exchange together), in fp32 model copies. Part of
it does not grow with the model: the same two phases on a model of 8,432 parameters (registered only
here) measure that fixed cost in MB, and each size's "beyond fixed" column is its added copies with that
cost taken out (the target is judged on the added copies as they are). Where the
allocator puts things changes with each process's addresses (ASLR, and the hash seed's dict orders), and
so does the heap a run leaves: both phases run `--repeats` times (3), each pair in fresh processes, and a
size's figure is the largest of its repeats (all of them are in the JSON); its times are the fastest.
Beside it: the offer, exchange and apply seconds per side and nanoseconds per parameter per side,
the bytes one side sent, the state download (a `StateDonor` to a `StateDownloader` over the in-memory
transport: the whole training state, chunked and hashed), and one checkpoint write.

    .venv/bin/python scripts/bench_model_scale.py --quick      # gpt-tiny and gpt-small: 18 processes, about a minute
    .venv/bin/python scripts/bench_model_scale.py              # up to gpt2-small (124M): minutes
    .venv/bin/python scripts/bench_model_scale.py --models gpt-tiny,gpt-20m,gpt2-small,gpt2-medium

Writes scripts/results/bench_model_scale.json (or --out); a --quick run writes
runs/model-scale-quick/bench_model_scale.json, never the committed results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"  # the committed results, which the docs quote
QUICK = ("gpt-tiny", "gpt-small")
FULL = ("gpt-tiny", "gpt-small", "gpt-20m", "gpt2-small")
BATCH, SEQUENCE = 2, 64  # one small batch: the training step's activations stay far below the parameters
TARGET_COPIES, TARGET_NS, TARGET_SPREAD = 3.0, 25.0, 1.5
TIMED = 3  # rounds timed after the first; the fastest is reported
# a model of 8,432 parameters, registered only in the bench's own processes: what Murmur adds with it is its
# fixed cost (the exchange's code, its first round's lazily built buffers and objects), not model copies
PROBE, PROBE_SHAPE = "probe-8k", {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 64}


def register_probe() -> None:
    from murmur.peer.model import MODELS, GPTConfig

    MODELS.setdefault(PROBE, GPTConfig(**PROBE_SHAPE))


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB


def plain_peers(name: str, device: str = "cpu") -> list:
    """Two peers' models after one AdamW step each: (model, optimizer) pairs."""
    import torch

    from murmur.peer.model import build_model, loss_of

    peers = []
    for seed in (1, 2):
        model = build_model(name, seed=0).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(seed)
        block = min(SEQUENCE, model.config.block_size)
        idx = torch.randint(0, 256, (BATCH, block + 1), generator=gen).to(device)
        loss_of(model(idx[:, :-1], idx[:, 1:])).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peers.append((model, optimizer))
    return peers


def run_plain(name: str) -> dict:
    plain_peers(name)
    return {"peak_rss": peak_rss()}


def run_murmur(name: str, peers: list | None = None, *, host_state: bool = False) -> dict:
    """The murmur phase on `peers` (`plain_peers`, on their device; default: made here, on the CPU), with the
    outer state where a peer keeps it (`host_state`: `murmur join --outer-state host`). Times on a GPU are
    taken with the device synchronized."""
    import torch

    from murmur.averaging.group import GroupAverager, GroupConfig, GroupPlan
    from murmur.averaging.groups import Appointment
    from murmur.averaging.state_download import StateDownloader
    from murmur.averaging.state_transfer import StateDonor, TransferConfig
    from murmur.averaging.transport import InMemoryNetwork
    from murmur.peer.checkpoint import save_checkpoint
    from murmur.peer.config import TrainConfig
    from murmur.peer.model import count_parameters
    from murmur.peer.outer import OuterOptimizer

    config = TrainConfig(model=name)
    peers = plain_peers(name) if peers is None else peers
    params = count_parameters(peers[0][0])
    device = next(peers[0][0].parameters()).device
    outers = [OuterOptimizer(model, config.outer(), host_state=host_state) for model, _ in peers]
    gen = torch.Generator().manual_seed(0)

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    @torch.no_grad()
    def inner_steps() -> None:
        for i, (outer, (model, _)) in enumerate(zip(outers, peers, strict=True)):
            for name, p in model.named_parameters():
                if i:  # the two come from different groups last round: their anchors differ, and travel (int8)
                    anchor = outer.anchor[name]  # in host memory with host_state
                    anchor.add_(torch.randn(p.shape, generator=gen).to(anchor.device), alpha=1e-4)
                p.add_(torch.randn(p.shape, generator=gen).to(device), alpha=1e-3)  # the round's inner steps moved it

    async def exchange(slot: int) -> tuple[list, list, dict[str, float]]:
        appointment, timing = Appointment(seconds=600.0, slot=slot), {}
        network = InMemoryNetwork()
        averagers = []
        for i, outer in enumerate(outers):
            averager = GroupAverager(network.transport(f"peer-{i}"), compressor(config), shapes=outer.shapes,
                                     modes=outer.modes, run_id="scale", seed=i,
                                     config=GroupConfig(exchange_timeout=600.0, message_timeout=600.0))  # fmt: skip
            await averager.start()
            averager.expect(appointment.key)
            averagers.append(averager)
        started = clock()
        offers = [outer.offer() for outer in outers]
        timing["offer"] = clock() - started
        now = asyncio.get_running_loop().time()
        ids = [a.peer_id for a in averagers]
        plans = [GroupPlan(key=appointment.key, candidates=tuple(ids[: i + 1]), planned=tuple(ids[i + 1 :]),
                           deadline=now + 600.0, not_before=now, group_size=2) for i in range(2)]  # fmt: skip
        started = clock()
        results = await asyncio.gather(*(a.average(o, p) for a, o, p in zip(averagers, offers, plans, strict=True)))
        timing["exchange"] = clock() - started
        for a in averagers:
            await a.stop()
        return offers, results, timing

    # a peer exchanges every round, so the first round (its memory not in use yet) is not timed; of the TIMED
    # rounds after it, the fastest is reported (on these shared cores one round's time moves by a third)
    timings = []
    for slot in range(1, 2 + TIMED):
        inner_steps()
        offers, results, timing = asyncio.run(exchange(slot))
        if any(r is None for r in results):
            raise SystemExit(f"{name}: the exchange failed")
        started = clock()
        for outer, offer, result in zip(outers, offers, results, strict=True):
            outer.apply(offer, result)
        timing["apply"] = clock() - started
        sent = results[0].bytes_sent
        del offers, results, offer, result  # a peer holds no round's payloads into the next (`peer.runner`)
        timings += [timing] if slot > 1 else []
    timing = min(timings, key=lambda t: sum(t.values()))
    rss_exchange = peak_rss()

    state = {f"model/{n}": p.detach().cpu() for n, p in peers[0][0].named_parameters()}  # a peer's snapshot
    outer_state = outers[0].state_dict()
    state |= {f"outer/{k}/{n}": t.cpu() for k, d in outer_state.items() if isinstance(d, dict) for n, t in d.items()}
    download = asyncio.run(state_download(state, StateDonor, StateDownloader, TransferConfig, InMemoryNetwork))
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        save_checkpoint(Path(folder), {"run_id": "scale", "model": name, "step": 1, "state": state})
        checkpoint = time.perf_counter() - started
    per_side = {k: v / 2 for k, v in timing.items()}
    compute = sum(per_side.values())
    return {
        "params": params, "peak_rss": rss_exchange, "seconds_per_side": per_side,
        "ns_per_param_per_side": 1e9 * compute / params, "bytes_sent_per_side": sent,
        "bytes_over_fp32": sent / (4 * params), "state_download_seconds": download,
        "checkpoint_write_seconds": checkpoint,
    }  # fmt: skip


def compressor(config):
    from murmur.averaging.compression import LowRankCompressor

    return LowRankCompressor(config.compression())


async def state_download(state, StateDonor, StateDownloader, TransferConfig, InMemoryNetwork) -> float:  # noqa: N803
    from murmur.averaging.state_transfer import StateSnapshot
    from murmur.averaging.wire import TensorSpec

    network = InMemoryNetwork()
    snapshot = StateSnapshot(tensors={n: t.detach().float().contiguous() for n, t in state.items()}, counters={})
    config = TransferConfig()  # what a real joiner uses
    donor = StateDonor(network.transport("donor"), config=config)
    donor.publish(snapshot)
    await donor.start()
    layout = {n: TensorSpec(shape=tuple(t.shape), dtype=t.dtype) for n, t in snapshot.tensors.items()}
    downloader = StateDownloader(network.transport("joiner"), layout, config=config)
    started = time.perf_counter()
    await downloader.download(["donor"])
    seconds = time.perf_counter() - started
    await donor.stop()
    return seconds


def measure(name: str, phase: str) -> dict:
    """One size's phase in a fresh process (peak RSS is a process's high-water mark)."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_model_scale as b, json; " \
           f"import torch; torch.set_num_threads(1); from murmur.peer.device import keep_freed_memory; " \
           f"keep_freed_memory(); b.register_probe(); print(json.dumps(b.run_{phase}({name!r})))"  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} ({phase}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked: `names` the models to measure, and `out` the file to write (a quick run's is never the
    committed one)."""
    from murmur.peer.flags import integer, out_file, results_folder  # here: the measured processes import only
    from murmur.peer.model import MODELS  # what they measure

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--models", help=f"comma-separated registry names (default: {','.join(FULL)})")
    parser.add_argument("--repeats", type=integer(1), default=3, help="fresh process pairs per size (default 3)")
    parser.add_argument("--out", type=out_file, help="the JSON to write (default: scripts/results/bench_model_scale"
                        ".json; with --quick runs/model-scale-quick/bench_model_scale.json)")  # fmt: skip
    args = parser.parse_args(argv)
    args.names = args.models.split(",") if args.models else QUICK if args.quick else FULL
    if unknown := [name for name in args.names if name not in MODELS]:
        parser.error(f"--models: unknown {', '.join(unknown)} (the registry has {', '.join(MODELS)})")
    if args.out is None:
        args.out = results_folder(None, quick=args.quick, full=RESULTS, name="model-scale") / "bench_model_scale.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = args.names
    rows = []
    # the fixed cost, for two peers: the mean of the probe's repeats (what is left of a copy at 8,432 parameters)
    probe_pairs = [(measure(PROBE, "plain"), measure(PROBE, "murmur")) for _ in range(args.repeats)]
    probes = [m["peak_rss"] - p["peak_rss"] for p, m in probe_pairs]
    fixed = sum(probes) / len(probes)
    print(f"fixed cost (a model of {probe_pairs[0][1]['params']:,} parameters, two peers): {fixed / 2**20:.1f} MB "
          f"({', '.join(f'{b / 2**20:.1f}' for b in probes)})")  # fmt: skip
    print(f"{'model':12} {'params':>8} {'offer s':>8} {'exch s':>8} {'apply s':>8} {'ns/param':>9} {'added fp32':>10} "
          f"{'(runs)':>11} {'beyond fixed':>12} {'sent/fp32':>9} {'state s':>8} {'ckpt s':>7}")  # fmt: skip
    for name in names:
        pairs = [(measure(name, "plain"), measure(name, "murmur")) for _ in range(args.repeats)]
        runs = [(m["peak_rss"] - p["peak_rss"]) / 2 / (4 * m["params"]) for p, m in pairs]
        plain, murmur = max(pairs, key=lambda pair: pair[1]["peak_rss"] - pair[0]["peak_rss"])
        fastest = min((m for _, m in pairs), key=lambda m: m["ns_per_param_per_side"])
        added = max(runs)
        beyond = added - fixed / 2 / (4 * murmur["params"])
        row = {"model": name, **murmur, "plain_peak_rss": plain["peak_rss"], "added_fp32_copies": added,
               "added_fp32_copies_runs": runs, "added_fp32_copies_beyond_fixed": beyond,
               "seconds_per_side": fastest["seconds_per_side"],
               "ns_per_param_per_side": fastest["ns_per_param_per_side"]}  # fmt: skip
        rows.append(row)
        s = row["seconds_per_side"]
        print(f"{name:12} {row['params'] / 1e6:7.2f}M {s['offer']:8.3f} {s['exchange']:8.3f} {s['apply']:8.3f} "
              f"{row['ns_per_param_per_side']:9.1f} {added:10.2f} {min(runs):5.2f}-{max(runs):<5.2f} {beyond:12.2f} "
              f"{row['bytes_over_fp32']:9.4f} "
              f"{row['state_download_seconds']:8.2f} {row['checkpoint_write_seconds']:7.2f}", flush=True)  # fmt: skip
    big = [r for r in rows if r["params"] >= 57e6]
    small = next((r for r in rows if 5e6 <= r["params"] < 57e6), None)
    targets = {
        "added_fp32_copies_at_most_3": all(r["added_fp32_copies"] <= TARGET_COPIES for r in rows),
        "ns_per_param_at_most_25_from_57M": bool(big) and all(r["ns_per_param_per_side"] <= TARGET_NS for r in big),
        "ns_per_param_spread_at_most_1.5x": bool(big and small) and all(
            r["ns_per_param_per_side"] <= TARGET_SPREAD * small["ns_per_param_per_side"] for r in big),
    }  # fmt: skip
    for target, met in targets.items():
        print(f"target {target}: {'met' if met else 'NOT met'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": 1, "batch": BATCH, "sequence": SEQUENCE, "repeats": args.repeats,
                                    "fixed_cost_bytes": fixed, "fixed_cost_runs": probes, "probe": PROBE_SHAPE,
                                    "rows": rows, "targets": targets}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
