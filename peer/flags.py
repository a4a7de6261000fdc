"""The `murmur` command line: every flag, its help text and its range, without torch or hivemind.

`build_parser` imports nothing heavy, so `murmur --help`, a bad flag and `murmur report` answer at
once; the commands import what they use. Every number is range-checked here, when it is parsed, so a
bad one is one line naming that flag (`argument --duration: must be a positive number, got -5`)
and exit code 2, before anything starts. The defaults shown for the peer's own flags are
`JOIN_DEFAULTS`; a test checks them against `GroupConfig` and `PeerOptions`, which own them.
"""

from __future__ import annotations

import argparse
import math
import time
import typing
from collections.abc import Callable
from pathlib import Path

from murmur.peer.config import TrainConfig

DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")


def unknown_device(text: str) -> str:
    """Why `text` is not a --device: the choices, and for one GPU of several (`cuda:1`) how to pick it."""
    index = text.removeprefix("cuda:")
    hint = f" (one GPU of several: CUDA_VISIBLE_DEVICES={index} with --device cuda)" if index.isdigit() else ""
    return f"unknown device {text!r}; choose one of: {', '.join(DEVICES)}{hint}"


def device_choice(text: str) -> str:
    """An argparse type: one of `DEVICES`."""
    if text not in DEVICES:
        raise argparse.ArgumentTypeError(unknown_device(text))
    return text


PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")
OUTER_STATES: tuple[str, ...] = ("auto", "device", "host")
# the defaults of GroupConfig (exchange_timeout) and PeerOptions, as --help shows them
JOIN_DEFAULTS = {"exchange_timeout": 10.0, "eval_every": 5, "checkpoint_every": 1, "checkpoint_interval": 30.0,
                 "overlap": False}  # fmt: skip
MAX_PEERS = 64  # murmur simulate on one machine
INT64_MAX = 2**63 - 1  # the largest whole number the run record (msgpack) and torch's seeds hold


class Parser(argparse.ArgumentParser):
    commands: dict[str, argparse.ArgumentParser] = {}  # the top parser's: its subcommands' parsers

    def error(self, message: str) -> None:  # one line, exit code 2
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse's, but a flag the command does not take is that command's error (`murmur status: error:
        unrecognized arguments: ...`), not `murmur`'s, which reads as if no command took it."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.commands.get(getattr(namespace, "command", None), self).error(
                f"unrecognized arguments: {' '.join(extras)}"
            )
        return namespace


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [minimum, maximum], and never above INT64_MAX."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            span = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        if value > INT64_MAX:
            raise argparse.ArgumentTypeError(f"must be at most {INT64_MAX} (2^63 - 1), got {value}")
        return value

    return parse


def number(*, zero: bool = False, minimum: float = 0.0, maximum: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a finite number above 0 (or at least 0, with `zero`), at least `minimum` and at most
    `maximum`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"must be a {'non-negative' if zero else 'positive'} number, got {text}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g}, got {text}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:g}, got {text}")
        return value

    return parse


PORT = integer(0, 65535)


def out_folder(text: str) -> Path:
    """An argparse type: a folder that results are written into, checked now (it, or the nearest folder above it
    that exists, is a folder this user can write into), so that a bad one fails in one line before a run of minutes
    rather than at its end. Nothing is made here: a command that then fails on another flag leaves no empty folder
    behind; the command makes it when it writes."""
    from murmur.peer.rundir import check_writable

    path = Path(text)
    try:
        check_writable(path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return path


def out_file(text: str) -> Path:
    """An argparse type: a file that results are written to, its folder checked now (`out_folder`)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    out_folder(str(path.parent))
    return path


def png_file(text: str) -> Path:
    """An argparse type: a file name ending in .png (`murmur report --out report.json` would put the chart over the
    simulation's report)."""
    if Path(text).suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"the chart is a PNG: give a file name ending in .png, got {text}")
    return out_file(text)


def results_folder(out: Path | None, *, quick: bool, full: Path, name: str) -> Path:
    """Where a benchmark writes its results: `--out` if given, else `full` (the committed results that the docs
    quote) for a full run, and runs/NAME-quick for a `--quick` one, which must never overwrite them."""
    if out is not None:
        return out
    return out_folder(f"runs/{name}-quick") if quick else full


CENTURY = 100 * 365.25 * 86400.0  # seconds


def future_time(text: str) -> float:
    """An argparse type: a Unix time not yet past (a past one would train nothing and exit 0: `--until 3600`, seconds
    typed for a time). A minute of grace: a program that hands its peers one end (`murmur simulate`) computes it
    before they parse it, and a peer that then starts after it reports its 0 steps rather than failing."""
    value = number()(text)
    if value <= (now := time.time()) - 60:
        raise argparse.ArgumentTypeError(f"must be a Unix time in the future (it is now {now:.0f}), got {text}: for "
                                         "seconds of training use --duration")  # fmt: skip
    if value > now + CENTURY:  # JavaScript's Date.now() and `date +%s%3N` count milliseconds: a peer trained for ever
        raise argparse.ArgumentTypeError(f"must be a Unix time in seconds (it is now {now:.0f}), got {text}, more than "
                                         "a century away: milliseconds?")  # fmt: skip
    return value


def train_flags(parser: argparse.ArgumentParser, *, registry_only: bool = False) -> None:
    """A flag for every field of `TrainConfig`, made from its schema: `--inner-steps` from `inner_steps`, its type
    and bounds checked here, its description as the help. None (the flag not given) keeps the config's default.
    `registry_only`: --model takes a registry model only (`murmur simulate`), and its help says so."""
    group = parser.add_argument_group("run config (published to the DHT; joiners take it from there)")
    for name, field in TrainConfig.model_fields.items():
        extra = field.json_schema_extra or {}
        default = field.default
        shown = f"{default:g}" if isinstance(default, float) else str(default).lower() if default in (True, False) \
            else default  # fmt: skip
        described = "a registry model (peer.model.MODELS)" if registry_only and name == "model" else field.description
        kwargs: dict = {"dest": name, "default": None, "help": f"{described} (default: {shown})"}
        if extra.get("metavar"):
            kwargs["metavar"] = extra["metavar"]
        if field.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(field.annotation) is typing.Literal:
            kwargs["choices"] = typing.get_args(field.annotation)
        elif field.annotation is not str:
            kwargs["type"] = _bounded(field.annotation, field.metadata)
        elif registry_only and name == "model":
            kwargs["type"] = registry_model
        group.add_argument("--" + name.replace("_", "-"), **kwargs)


def registry_model(text: str) -> str:
    """An argparse type: a registry model's name, or a researcher's `pkg.module:function` (the command says why it
    takes none); an unknown name's message offers the registry only, not the builder that the run config's does."""
    from murmur.peer.config import is_spec
    from murmur.peer.model import MODELS

    if text not in MODELS and not is_spec(text):
        raise argparse.ArgumentTypeError(f"unknown model '{text}'; choose one of: {', '.join(MODELS)}")
    return text


def _bounded(kind: type, bounds: list) -> Callable[[str], int | float]:
    """An argparse type for an int or float field with annotated_types bounds (Ge, Gt, Le, Lt)."""
    limits = {key: getattr(b, key) for b in bounds for key in ("ge", "gt", "le", "lt") if hasattr(b, key)}
    if kind is int:
        return integer(limits.get("ge", -(2**63)), limits.get("le"))

    def parse(text: str) -> float:
        value = number(zero="gt" not in limits)(text)  # every float of the config is finite and not negative
        checks = (("gt", lambda v, b: v > b, "above"), ("ge", lambda v, b: v >= b, "at least"),
                  ("lt", lambda v, b: v < b, "below"), ("le", lambda v, b: v <= b, "at most"))  # fmt: skip
        for key, ok, words in checks:
            if key in limits and not ok(value, limits[key]):
                raise argparse.ArgumentTypeError(f"must be {words} {limits[key]:g}, got {text}")
        return value

    return parse


def _creator(text: str) -> str:
    """The run creator's peer id: its form is checked where it is used (`dht.node`), except "self", which the
    creator's own node means internally and which, typed here, waited for a config that nobody else could sign."""
    if text == "self":
        raise argparse.ArgumentTypeError("must be the run creator's peer id, as the join line names it, not 'self'")
    return text


def creator_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--creator", type=_creator, metavar="PEER_ID",
                        help="the run creator's peer id, as the join line names it: a run config signed by anyone "
                             "else is refused (default: trust the first config found)")  # fmt: skip


def node_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=PORT, default=0, help="TCP port, 0 picks a free one (default: %(default)s)")
    parser.add_argument("--identity", help="key file that keeps this node's peer id across restarts")


def access_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("private runs (see averaging/access.py)")
    group.add_argument("--run-secret-file", type=Path, metavar="FILE",
                       help="shared run secret: only peers that know it pair")  # fmt: skip
    group.add_argument("--allow-peers", nargs="+", metavar="PEER_ID", help="only these peer ids may pair")


def device_flags(parser: argparse.ArgumentParser, *, batching: bool) -> None:
    group = parser.add_argument_group("device")
    group.add_argument("--device", type=device_choice, metavar="{" + ",".join(DEVICES) + "}", default="auto",
                       help="auto: CUDA if available; one GPU of several: CUDA_VISIBLE_DEVICES=N with cuda (default: "
                            "auto)")  # fmt: skip
    group.add_argument("--precision", choices=PRECISIONS, default="auto",
                       help="auto: bf16 on CUDA if supported, else fp16 with a grad scaler; fp32 on CPU")  # fmt: skip
    if batching:
        group.add_argument("--batch-size", type=integer(1), metavar="B", dest="micro_batch",
                           help="sequences per forward pass; the run's batch size is reached by accumulation "
                           "(default: fit the card's free memory)")  # fmt: skip
        group.add_argument("--grad-accum", type=integer(1), metavar="N", help="micro-batches per inner step")
        group.add_argument("--outer-state", choices=OUTER_STATES, default="auto",
                           help="where the outer state (anchor, origin, momentum, residual) lives: device, with "
                           "the model; host, in pinned host memory, off the card, a piece at a time brought over "
                           "each round; auto, on the card unless a training step does not fit beside it "
                           "(default: auto)")  # fmt: skip


def workload_flags(parser: argparse.ArgumentParser, *, joining: bool) -> None:
    """--model and --data of a researcher's own workload; the bootstrap node only prints them in its join line."""
    group = parser.add_argument_group("a researcher's own model and data (imported from this machine only)")
    if joining:
        group.add_argument("--model", metavar="PKG.MODULE:FUNCTION",
                           help="builds the run's model: build_model() -> Module")  # fmt: skip
    what = "batches" if joining else ("the batch builder joiners pass (for the join line), a custom --model's or a "
                                      "registry model's on your own data:")  # fmt: skip
    group.add_argument("--data", metavar="PKG.MODULE:FUNCTION",
                       help=f"{what} build_batches(split, *, seed, batch_size) -> iterator of tuples")  # fmt: skip


def _join_parser(sub) -> None:
    join = sub.add_parser("join", help="join a run as a training peer")
    join.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="bootstrap multiaddrs")
    join.add_argument("--run", required=True, help="run id")
    creator_flag(join)
    join.add_argument("--duration", type=number(), metavar="SECONDS",
                      help="seconds to train; the round under way then runs on to its end (default: until "
                           "Ctrl-C)")  # fmt: skip
    join.add_argument("--until", type=future_time, metavar="UNIX_TIME",
                      help="wall-clock end, in seconds since the epoch: no round starts that would end later, so "
                           "peers given the same --until end on the same round")  # fmt: skip
    join.add_argument("--out-dir", type=Path,
                      help="folder for metrics.jsonl, report.json, anchor.safetensors, checkpoints/")  # fmt: skip
    join.add_argument("--data-seed", type=integer(0), default=0, help="seed of this peer's data stream")
    join.add_argument("--exchange-timeout", type=number(minimum=0.5, maximum=3600), metavar="SECONDS",
                      default=JOIN_DEFAULTS["exchange_timeout"],
                      help="bound on one group exchange once its group is sealed, 0.5 to 3600 (default: "
                           "%(default)s)")  # fmt: skip
    join.add_argument("--quiet", action="store_true", help="no per-round progress line")
    join.add_argument("--eval-every", type=integer(0), default=JOIN_DEFAULTS["eval_every"], metavar="N",
                      help="rounds between held-out evaluations, 0: at start and stop only "
                           "(default: %(default)s)")  # fmt: skip
    join.add_argument("--resume", action="store_true", help="continue from the newest usable checkpoint")
    join.add_argument("--restart", action="store_true",
                      help="a warm parent restarts the peer with --resume if it is killed or crashes "
                           "(needs --out-dir or --checkpoint-dir)")  # fmt: skip
    join.add_argument("--checkpoint-every", type=integer(1), default=JOIN_DEFAULTS["checkpoint_every"], metavar="N",
                      help="rounds between checkpoints (default: %(default)s)")  # fmt: skip
    join.add_argument(
        "--checkpoint-interval",
        type=number(zero=True),
        default=JOIN_DEFAULTS["checkpoint_interval"],
        metavar="SECONDS",
        help="and at least this many seconds apart (default: %(default)s)",
    )
    join.add_argument("--checkpoint-dir", type=Path, metavar="DIR", help="default: OUT_DIR/checkpoints")
    join.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=JOIN_DEFAULTS["overlap"],
                      help="train on while gathering and exchanging; the steps are kept on top of the round's "
                           "outer step (default: off)")  # fmt: skip
    node_flags(join)
    join.add_argument("--client-mode", action="store_true",
                      help="behind NAT, no inbound connections: start every exchange, never be dialled")  # fmt: skip
    join.add_argument("--use-relay", action=argparse.BooleanOptionalAction, default=True,
                      help="reach peers through libp2p circuit relays (default: on)")  # fmt: skip
    join.add_argument("--use-auto-relay", action="store_true", help="find relays and be reachable through them")
    device_flags(join, batching=True)
    workload_flags(join, joining=True)
    access_flags(join)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="murmur", description="Decentralized training: gossip DiLoCo over a DHT.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    parser.commands = sub.choices

    boot = sub.add_parser("bootstrap", help="start a bootstrap node for a run and print the join line")
    boot.add_argument("--run", required=True, help="run id, shared by every peer of the run")
    node_flags(boot)
    train_flags(boot)
    workload_flags(boot, joining=False)
    access_flags(boot)

    _join_parser(sub)

    sim = sub.add_parser("simulate", help="run a bootstrap node and N peers on 127.0.0.1, then write a report")
    sim.add_argument("--peers", type=integer(1, MAX_PEERS), default=4,
                     help="peer processes to start (default: %(default)s)")  # fmt: skip
    sim.add_argument("--duration", type=number(), default=60.0, metavar="SECONDS",
                     help="seconds each peer trains (default: %(default)s)")  # fmt: skip
    sim.add_argument("--report", type=out_file, default=Path("report.json"), metavar="PATH",
                     help="the swarm's report, as JSON (default: %(default)s)")  # fmt: skip
    sim.add_argument("--run", default="sim", help="run id (default: %(default)s)")
    sim.add_argument(
        "--port",
        type=PORT,
        default=0,
        help="the bootstrap node's port on 127.0.0.1, 0 picks a free one (default: %(default)s)",
    )
    sim.add_argument("--out-dir", type=out_folder,
                     help="folder for the peers' logs (default: runs/RUN; a folder that holds an earlier "
                          "simulation is kept, and the next free RUN-2, RUN-3 ... is used)")  # fmt: skip
    train_flags(sim, registry_only=True)
    device_flags(sim, batching=False)
    access_flags(sim)

    status = sub.add_parser("status", help="show a run's config and live peers, read from the DHT")
    status.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="bootstrap multiaddrs")
    status.add_argument("--run", required=True, help="run id")
    creator_flag(status)
    status.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    dash = sub.add_parser("dashboard", help="serve a live web page of a run's peers and charts, read from the DHT")
    dash.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="bootstrap multiaddrs")
    dash.add_argument("--run", required=True, help="run id")
    creator_flag(dash)
    dash.add_argument("--host", default="127.0.0.1",
                      help="address the page is served on (default: %(default)s, this machine only)")  # fmt: skip
    dash.add_argument("--port", type=PORT, default=8080,
                      help="the page's TCP port, 0 picks a free one (default: %(default)s)")  # fmt: skip
    # at least a second: a reading is a DHT lookup of every record of the run, which peers renew every few seconds
    dash.add_argument("--period", type=number(minimum=1, maximum=3600), default=2.0, metavar="SECONDS",
                      help="seconds between readings of the DHT, 1 to 3600 (default: %(default)s)")  # fmt: skip

    export = sub.add_parser("export", help="write a run's model as model.safetensors and config.json")
    export.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="folder to write (made if missing)")
    source = export.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="source", type=Path, metavar="PATH",
                        help="a peer's --out-dir, a checkpoint, an anchor file or an earlier export")  # fmt: skip
    source.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MADDR",
        help="a live swarm's bootstrap multiaddrs: the model is downloaded from a peer (with --run)",
    )
    export.add_argument("--run", help="run id, with --initial-peers")
    creator_flag(export)
    workload_flags(export, joining=True)
    access_flags(export)  # a private run's donors send its model only to who knows its secret

    sample = sub.add_parser("sample", help="print text from a built-in GPT that a run trained")
    sample.add_argument("source", type=Path, metavar="PATH",
                        help="a peer's --out-dir, a checkpoint, an anchor.safetensors or an export folder")  # fmt: skip
    sample.add_argument("--prompt", default="", help="text to continue (default: a new line)")
    sample.add_argument("--tokens", type=integer(1, 100_000), default=200, help="bytes to draw (default: %(default)s)")
    sample.add_argument("--temperature", type=number(zero=True), default=0.8,
                        help="0 always takes the likeliest byte (default: %(default)s)")  # fmt: skip
    sample.add_argument("--top-k", type=integer(1), default=40,
                        help="draw among the K likeliest bytes (default: %(default)s)")  # fmt: skip
    sample.add_argument("--seed", type=integer(0), default=0, help="seed of the draws (default: %(default)s)")

    report = sub.add_parser("report", help="plot a peer's or a simulation's metrics logs to a PNG")
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a folder with metrics.jsonl or peer-*/")
    report.add_argument("--out", type=png_file, metavar="PNG", help="output file (default: RUN_DIR/report.png)")

    doctor = sub.add_parser("doctor", help="check that this machine can join a run, with a fix for each problem")
    doctor.add_argument("--host", default="127.0.0.1", help="address join will listen on (default: %(default)s)")
    doctor.add_argument("--port", type=PORT, default=0, help="port join will listen on (default: %(default)s)")
    return parser
