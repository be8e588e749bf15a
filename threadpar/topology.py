"""The parallel layout: how global ranks map onto a DP x CP x TP x PP grid (pure: no threads, no torch).

A layout is a row-major grid over the axes in `order` (outermost first). The default order is
PP, DP, CP, TP: TP is innermost so a TP group is made of adjacent ranks (adjacent GPUs share the fastest
links), PP is outermost. Groups of an axis are the lines of the grid along that axis; each group gets an
id and a name like InfiniTrain's ("DP0", "TP1", "PP2").
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from threadpar.errors import ConfigError


class Axis(str, enum.Enum):
    """A mesh axis. ("axis" is a mesh axis; "dim" is a tensor dimension.)"""

    DP = "DP"  # data parallel: replicas that average gradients
    CP = "CP"  # context parallel: slices of the sequence (ring attention)
    TP = "TP"  # tensor parallel: shards of each layer's weights
    PP = "PP"  # pipeline parallel: consecutive stages of layers

    @classmethod
    def parse(cls, value: Axis | str) -> Axis:
        if isinstance(value, Axis):
            return value
        try:
            return cls(str(value).upper())
        except ValueError:
            names = ", ".join(a.value for a in cls)
            raise ConfigError(f"unknown axis {value!r}; use one of {names}") from None


DEFAULT_ORDER = (Axis.PP, Axis.DP, Axis.CP, Axis.TP)


@dataclass(frozen=True)
class Coords:
    """A rank's position on every axis."""

    dp: int = 0
    tp: int = 0
    pp: int = 0
    cp: int = 0

    def __getitem__(self, axis: Axis | str) -> int:
        return getattr(self, Axis.parse(axis).value.lower())


def parse_order(order: Iterable[Axis | str] | str | None) -> tuple[Axis, ...]:
    if order is None:
        return DEFAULT_ORDER
    if isinstance(order, str):
        order = [part for part in order.replace(",", "-").replace(" ", "-").split("-") if part]
    axes = tuple(Axis.parse(a) for a in order)
    missing = [a.value for a in DEFAULT_ORDER if a not in axes]
    # Axes left out of a user's order go innermost; that only matters when they are larger than 1.
    axes = axes + tuple(Axis(a) for a in missing)
    if len(set(axes)) != len(axes):
        raise ConfigError(
            f"axis order {order!r} names an axis twice; give each of DP, CP, TP, PP at most once"
        )
    return axes


@dataclass(frozen=True)
class Layout:
    """Axis sizes and order, with rank <-> coordinate arithmetic and the groups of each axis."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    order: tuple[Axis, ...] = DEFAULT_ORDER
    # Derived in __post_init__ (not arguments, not compared: the fields above determine them).
    _strides: dict[Axis, int] = field(init=False, repr=False, compare=False)
    _world_size: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for axis in Axis:
            size = self.size(axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ConfigError(f"{axis.value.lower()} must be a positive int, got {size!r}")
        object.__setattr__(self, "order", parse_order(self.order))
        strides: dict[Axis, int] = {}
        stride = 1
        for axis in reversed(self.order):
            strides[axis] = stride
            stride *= self.size(axis)
        object.__setattr__(self, "_strides", strides)
        object.__setattr__(self, "_world_size", stride)

    @classmethod
    def build(
        cls,
        world_size: int | None = None,
        *,
        dp: int | None = None,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        order: Iterable[Axis | str] | str | None = None,
    ) -> Layout:
        """Sizes from the user's arguments; `dp` is derived as world / (tp * cp * pp) when not given."""
        for name, value in (("tp", tp), ("pp", pp), ("cp", cp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        model = tp * cp * pp
        if dp is None:
            if world_size is None:
                dp = 1
            elif world_size % model:
                raise ConfigError(
                    f"world size {world_size} is not divisible by tp*cp*pp = {model} (tp={tp}, cp={cp}, pp={pp}); "
                    f"choose sizes whose product divides {world_size}, or run {model * max(1, world_size // model)} ranks"
                )
            else:
                dp = world_size // model
        elif world_size is not None and dp * model != world_size:
            raise ConfigError(
                f"dp*cp*tp*pp = {dp}*{cp}*{tp}*{pp} = {dp * model} but there are {world_size} ranks; "
                f"make the product equal {world_size} (or leave dp out to derive it)"
            )
        return cls(dp=dp, tp=tp, pp=pp, cp=cp, order=parse_order(order))

    # sizes and strides ------------------------------------------------------------------------------------------
    def size(self, axis: Axis | str) -> int:
        return getattr(self, (axis if isinstance(axis, Axis) else Axis.parse(axis)).value.lower())

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def sizes(self) -> dict[Axis, int]:
        return {a: self.size(a) for a in self.order}

    def stride(self, axis: Axis | str) -> int:
        return self._strides[Axis.parse(axis)]

    # rank <-> coordinates ---------------------------------------------------------------------------------------
    def rank_of(self, coords: Coords | Mapping[Axis | str, int] | None = None, **by_name: int) -> int:
        """Global rank of a position; missing axes count as 0. `rank_of(dp=1, tp=0, pp=2)` works too."""
        values = dict(by_name)
        if isinstance(coords, Coords):
            values = {a.value.lower(): coords[a] for a in Axis} | values
        elif coords is not None:
            values = {Axis.parse(k).value.lower(): v for k, v in coords.items()} | values
        rank = 0
        for axis in Axis:
            key = axis.value.lower()
            c = values.pop(key, 0)
            if not 0 <= c < self.size(axis):
                raise ConfigError(f"coordinate {key}={c} is outside 0..{self.size(axis) - 1}")
            rank += c * self.stride(axis)
        if values:
            raise ConfigError(f"unknown axes {sorted(values)}; use dp, cp, tp, pp")
        return rank

    def coords_of(self, rank: int) -> Coords:
        self._check_rank(rank)
        s = self._strides
        return Coords(
            dp=rank // s[Axis.DP] % self.dp,
            tp=rank // s[Axis.TP] % self.tp,
            pp=rank // s[Axis.PP] % self.pp,
            cp=rank // s[Axis.CP] % self.cp,
        )

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self._world_size:
            raise ConfigError(
                f"rank {rank!r} is outside 0..{self.world_size - 1} (world_size={self.world_size})"
            )

    # groups -----------------------------------------------------------------------------------------------------
    def group_ranks(self, axis: Axis | str, rank: int) -> list[int]:
        """The global ranks that share every coordinate with `rank` except the one on `axis`, in axis order."""
        axis = Axis.parse(axis)
        c = self.coords_of(rank)
        base = rank - c[axis] * self.stride(axis)
        return [base + i * self.stride(axis) for i in range(self.size(axis))]

    def num_groups(self, axis: Axis | str) -> int:
        return self.world_size // self.size(axis)

    def group_id(self, axis: Axis | str, rank: int) -> int:
        """Index of `rank`'s group among the groups of `axis`: the other coordinates, row-major in `order`."""
        axis = Axis.parse(axis)
        c = self.coords_of(rank)
        gid = 0
        for other in self.order:
            if other is not axis:
                gid = gid * self.size(other) + c[other]
        return gid

    def group_name(self, axis: Axis | str, rank: int) -> str:
        axis = Axis.parse(axis)
        return f"{axis.value}{self.group_id(axis, rank)}"

    def groups(self, axis: Axis | str) -> list[list[int]]:
        """All groups of `axis`, indexed by group id."""
        axis = Axis.parse(axis)
        found: dict[int, list[int]] = {}
        for r in range(self.world_size):
            found.setdefault(self.group_id(axis, r), self.group_ranks(axis, r))
        return [found[i] for i in range(len(found))]

    # human-readable ---------------------------------------------------------------------------------------------
    def describe(self) -> str:
        shown = [a for a in self.order if a is not Axis.CP or self.cp > 1]
        sizes = " x ".join(f"{a.value.lower()}={self.size(a)}" for a in shown)
        return f"{self.world_size} ranks = {sizes} (order {'-'.join(a.value for a in self.order)}, last is innermost)"

    def overview(self) -> str:
        """A table of every rank's coordinates and groups, as InfiniTrain's ProcessGroupOverview prints."""
        axes = [a for a in (Axis.DP, Axis.CP, Axis.TP, Axis.PP) if a is not Axis.CP or self.cp > 1]
        rows = [["rank", *(a.value.lower() for a in axes), *(f"{a.value} group" for a in axes)]]
        for r in range(self.world_size):
            c = self.coords_of(r)
            groups = [f"{self.group_name(a, r)} {self.group_ranks(a, r)}".replace(" ", "") for a in axes]
            rows.append([str(r), *(str(c[a]) for a in axes), *groups])
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        return "\n".join([self.describe(), *lines])
