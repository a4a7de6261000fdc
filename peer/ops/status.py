"""`murmur status`: a run's config and live peers, as the DHT holds them right now.

`read_status` turns one run's records into plain data (`RunStatus`, which `to_json` prints for
scripts); `render_status` turns that into a rich table for people. Starting and stopping the DHT
node that reads the records is the caller's job (the CLI joins as a client-mode node).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from hivemind.utils.timed_storage import get_dht_time
from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from murmur.dht.clock import SAY_AT
from murmur.dht.records import RunRecord, RunRecords, config_digest
from murmur.peer.sketch import consensus_estimate


class RunNotFound(LookupError):
    """The run has neither a config record nor a live peer on the DHT; str(e) is one line."""


@dataclass(frozen=True, kw_only=True)
class PeerStatus:
    """One live peer: its announcement, joined with its latest metrics record when there is one."""

    peer_id: str
    state: str  # "training", "ready" or "finishing"
    outer_step: int  # from the announcement
    inner_steps: int | None  # from the metrics record (None: the peer has published none yet)
    samples: int | None  # from the metrics record
    loss: float | None  # last training loss, from the metrics record
    exchanges_ok: int | None = None  # from the metrics record, as are the three below
    exchanges_failed: int | None = None
    bytes_sent: int | None = None
    bytes_received: int | None = None
    samples_per_second: float
    version: int  # protocol version the peer speaks
    client_mode: bool
    last_seen: float  # seconds since the announcement was stored
    config: str | None = None  # the digest of the config it trains on (dht.records.config_digest)
    # it trains on another config than the run's record now holds (its creator published a new one since the peer
    # started): it averages only with peers of its own config
    other_config: bool = False
    clock: float | None = None  # seconds its rounds add to its machine's clock to follow the swarm's (dht.clock)


@dataclass(frozen=True, kw_only=True)
class RunStatus:
    run: str
    config: dict[str, Any] | None  # the run's training config record; None if it has expired or was never published
    created_by: str | None  # peer id of the node that published the config
    peers: list[PeerStatus]  # sorted by peer id
    # peer.sketch.consensus_estimate over the live peers' published sketches: max_i ‖φ_i − φ̄‖/‖φ̄‖, estimated
    # (None with fewer than two sketches)
    consensus_estimate: float | None = None
    config_digest: str | None = None  # of `config`: what the peers that train on it announce

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), allow_nan=False)


def find_run(records: RunRecords, creator: str | None = None) -> tuple[RunRecord | None, dict]:
    """The run's config record and its live peers' announcements, with their expiration, one read each;
    RunNotFound if the DHT has neither (`creator`: see `read_status`)."""
    record = records.fetch_config()
    announced = records.peers_with_expiration()
    if record is None and not announced:
        config = f"no config signed by its creator {creator} (--creator)" if creator else "no config"
        raise RunNotFound(f"run '{records.run_id}' not found: {config} and no live peers")
    return record, announced


def read_status(records: RunRecords, creator: str | None = None) -> RunStatus:
    """The run's config and live peers; RunNotFound if the DHT has neither.

    An announcement was stored ``records.announce_ttl`` before it expires (peers announce with the
    default ttl), which gives how long ago each peer was last seen. `creator` (the reading node's
    `NodeConfig.creator`, whose node reads no config signed by anyone else) is named in the message.
    """
    record, announced = find_run(records, creator)
    metrics = records.metrics() if announced else {}
    now = get_dht_time()
    digest = config_digest(dict(record.config)) if record else None
    peers = []
    for peer_id, (a, expiration) in sorted(announced.items()):
        m = metrics.get(peer_id)
        peers.append(
            PeerStatus(
                peer_id=peer_id, state=a.state.value, outer_step=a.step,
                inner_steps=m.step if m else None, samples=m.samples if m else None, loss=m.loss if m else None,
                exchanges_ok=m.exchanges_ok if m else None, exchanges_failed=m.exchanges_failed if m else None,
                bytes_sent=m.bytes_sent if m else None, bytes_received=m.bytes_received if m else None,
                samples_per_second=a.samples_per_second, version=a.version, client_mode=a.client_mode,
                last_seen=max(0.0, now - (expiration - records.announce_ttl)), config=a.config,
                other_config=digest is not None and a.config != digest, clock=a.clock,
            )
        )  # fmt: skip
    sketches = [m.sketch for peer_id, m in metrics.items() if peer_id in announced and m.sketch]
    return RunStatus(
        run=records.run_id,
        config=dict(record.config) if record else None,
        created_by=record.created_by if record else None,
        peers=peers,
        consensus_estimate=consensus_estimate(sketches) if len(sketches) >= 2 else None,
        config_digest=digest,
    )


def missing_config(creator: str | None = None) -> str:
    """What a reader says of a run config it did not find; `creator`: the --creator it trusts (only its config is
    read, so a mistyped one finds none)."""
    return f"no config record{f' signed by its creator {creator} (--creator)' if creator else ''} on the DHT"


def config_summary(status: RunStatus, creator: str | None = None) -> str:
    """One line on the run's config; `creator`: the --creator the reader trusts (only its config is read)."""
    if status.config is None:
        return f"run '{status.run}': {missing_config(creator)}"
    c = status.config
    return f"run '{status.run}': model {c.get('model')}, H={c.get('inner_steps')}, rank {c.get('rank')}"


def render_status(status: RunStatus, creator: str | None = None) -> RenderableType:
    """The config summary line and a table with one row per live peer."""
    if not status.peers:
        return Group(Text(config_summary(status, creator)), Text("no live peers"))
    title = f"{len(status.peers)} live peer{'s' * (len(status.peers) != 1)}"
    caption = ("outer step: rounds that took an outer step, inner step: AdamW steps, seen: since last announced, "
               "client: never dialled")  # fmt: skip
    if any(p.other_config for p in status.peers):
        caption += ", other config: trains on another config than the run's now, and averages only with its like"
    if any(_clock_off(p) for p in status.peers):
        caption += ", clock: its machine's clock is that far off the swarm's (its rounds follow the swarm's)"

    table = Table(
        title=title, caption=caption, title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD,
        show_edge=False, collapse_padding=True,
    )  # fmt: skip
    table.add_column("peer", no_wrap=True, min_width=8)
    table.add_column("state")  # wraps before a number is cut: "training (other config)" is long
    for column in ("outer step", "inner step", "samples", "loss", "samples/s", "ver", "seen"):
        table.add_column(column, justify="right")
    for p in status.peers:
        state = state_label(p)
        table.add_row(
            p.peer_id[-8:], state, str(p.outer_step), _or_dash(p.inner_steps), _or_dash(p.samples),
            "—" if p.loss is None else f"{p.loss:.3f}", f"{p.samples_per_second:.1f}", str(p.version),
            f"{p.last_seen:.0f}s",
        )  # fmt: skip
    return Group(Text(config_summary(status, creator)), table)


def state_label(p: PeerStatus) -> str:
    """Its state, marked where it is a client, on another config, or its machine's clock is off (status, dashboard)."""
    state = p.state + (" (client)" if p.client_mode else "") + (" (other config)" if p.other_config else "")
    return state + (f" (clock {abs(p.clock):.1f} s {'behind' if p.clock > 0 else 'ahead'})" if _clock_off(p) else "")


def _clock_off(peer: PeerStatus) -> bool:
    return peer.clock is not None and abs(peer.clock) >= SAY_AT  # what the peer itself says in a line


def _or_dash(value: int | None) -> str:
    return "—" if value is None else str(value)
