"""`Lazy`: a read-only mapping whose values are computed each time they are read.

An offer, a group's decoded contributions and a round's projections each cover the whole model. Held
as dicts of tensors they cost a full model copy apiece (about 11 fp32 copies per exchange in all);
read through `Lazy`, only the tensor being encoded, judged or applied exists at a time. A value is
computed anew on every read, so a reader that needs one twice keeps it itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

V = TypeVar("V")


class Lazy(Mapping[str, V]):
    """Names in a fixed order, each value made by its zero-argument function when read."""

    def __init__(self, makers: Mapping[str, Callable[[], V]]) -> None:
        self._makers = dict(makers)

    def __getitem__(self, name: str) -> V:
        return self._makers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def __contains__(self, name: object) -> bool:
        return name in self._makers
