"""What the group-exchange tests share: averagers on an in-memory network, offers, plans, one round."""

import asyncio

import torch

from murmur.averaging.compression import LowRankCompressor, LowRankConfig
from murmur.averaging.group import GroupAverager, GroupConfig, GroupPlan, Offer
from murmur.averaging.groups import Appointment, plan_groups
from murmur.averaging.transport import Admission, InMemoryNetwork

SHAPES = {"delta/w": (24, 16), "delta/b": (16,), "anchor/w": (24, 16), "anchor/b": (16,)}
MODES = {"delta/w": "mean", "delta/b": "mean", "anchor/w": "diff", "anchor/b": "diff"}
FAST = GroupConfig(exchange_timeout=2.0, message_timeout=0.5)
APPOINTMENT = Appointment(seconds=2.0, slot=7)


def make_offer(seed: int, step: int = 0, *, anchor_seed: int | None = None) -> Offer:
    """Like real peers' offers: a shared part (the swarm's direction) plus this peer's own part; anchors the
    same on every peer (as after an exact group round) unless `anchor_seed` makes this peer's its own."""
    shared, own = torch.Generator().manual_seed(0), torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in SHAPES.items():
        base = torch.randn(shape, generator=shared)
        if MODES[name] == "mean":
            tensors[name] = base + 0.1 * torch.randn(shape, generator=own)
        elif anchor_seed is None:
            tensors[name] = base
        else:
            tensors[name] = base + 0.05 * torch.randn(shape, generator=torch.Generator().manual_seed(anchor_seed))
    return Offer(step=step, tensors=tensors, modes=dict(MODES))


def make_averager(network: InMemoryNetwork, name: str, config: GroupConfig = FAST, *, run_id: str = "r",
                  rank: int = 4, codec: str = "sign", diff_codec: str = "int8",
                  admission: Admission = Admission()) -> GroupAverager:  # fmt: skip
    return GroupAverager(
        network.transport(name, admission),
        LowRankCompressor(LowRankConfig(rank=rank, mean_codec=codec, diff_codec=diff_codec)),
        shapes=SHAPES,
        modes=MODES,
        run_id=run_id,
        config=config,
        seed=sum(map(ord, name)),
    )


async def started(*averagers: GroupAverager) -> tuple[GroupAverager, ...]:
    for a in averagers:
        await a.start()
        a.expect(APPOINTMENT.key)
    return averagers


def plans(names: list[str], *, window: float = 1.0, size: int = 8) -> dict[str, GroupPlan]:
    """Every peer's plan at `APPOINTMENT` as the round engine makes it: the planned group, leader first (call
    inside the event loop: deadlines are on its clock)."""
    now = asyncio.get_running_loop().time()
    out = {}
    for group in plan_groups(APPOINTMENT, names, size):
        for i, name in enumerate(group):
            out[name] = GroupPlan(key=APPOINTMENT.key, candidates=tuple(group[: i + 1]), planned=tuple(group[i + 1 :]),
                                  deadline=now + window, not_before=now, group_size=size)  # fmt: skip
    return out


async def one_round(averagers, offers, plan_of=None):
    """Every averager's `average` at once, each with its plan: the results in order."""
    plan_of = plan_of or plans([a.peer_id for a in averagers])
    return await asyncio.gather(*(a.average(o, plan_of[a.peer_id]) for a, o in zip(averagers, offers, strict=True)))


def led_by(leader: str, members: list[str], *, window: float = 1.0) -> dict[str, GroupPlan]:
    """Plans for one group at `APPOINTMENT` with a chosen leader and its members in roster order: the leader waits
    for them until `window` has passed; a member asks the leader, then, declined, leads nobody (call inside the
    event loop)."""
    now = asyncio.get_running_loop().time()
    at = {"key": APPOINTMENT.key, "deadline": now + window, "not_before": now}
    out = {leader: GroupPlan(candidates=(leader,), planned=tuple(members), **at)}
    return out | {m: GroupPlan(candidates=(leader, m), planned=(), **at) for m in members}
