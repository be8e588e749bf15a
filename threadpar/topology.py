"""The parallel layout: how global ranks map onto a DP x CP x TP x PP grid (pure: no threads, no torch).

A layout is a row-major grid over the axes in `order` (outermost first). The default order is
PP, DP, CP, TP: TP is innermost so a TP group is made of adjacent ranks (adjacent GPUs share the fastest
links), PP is outermost. Groups of an axis are the lines of the grid along that axis; each group gets an
id and a name like InfiniTrain's ("DP0", "TP1", "PP2").

A group may also span several axes (`Axes`: torch's DeviceMesh would flatten them into one axes): ("DP", "CP") is the
plane of ranks that share their TP and PP coordinates (named "DPCP0", ...), over which gradients are
averaged under context parallelism. The expert axes are borrowed from that plane, as torchtitan's
ParallelDims borrows ep from dp_shard x cp: with `ep` dividing dp * cp, each DP x CP group splits into
consecutive runs of ep ranks that shard the MoE experts ("EP0", ...), and the ranks at the same place of
every run hold the same experts ("EDP0", ..., expert data parallel: their expert gradients are averaged).

    dp=4, cp=1, ep=2:  DP0 [0 1 2 3];  EP0 [0 1], EP1 [2 3];  EDP0 [0 2], EDP1 [1 3]
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

EXPERT_AXES = ("EP", "EDP")  # expert parallel, expert data parallel: borrowed from DP x CP
DATA_AXES = (Axis.DP, Axis.CP)  # the plane the expert axes split

# The axes of a group: one axis, several together (("DP", "CP") or "DPCP"), or an expert axis ("EP", "EDP").
Axes = Axis | str | tuple[Axis | str, ...]
# Their canonical form: the axes in Axis order (one or more), or the expert axis's name.
CanonicalAxes = tuple[Axis, ...] | str


def parse_axes(given: Axes) -> CanonicalAxes:
    """`given` in its canonical form; a ConfigError that lists the choices for anything else."""
    if isinstance(given, Axis):
        return (given,)
    named: Axes = given
    if isinstance(given, str):
        name = given.upper()
        if name in EXPERT_AXES:
            return name
        if name in Axis.__members__:
            return (Axis(name),)
        # Axes together by name: two letters per axis ("DPCP", "CPTP").
        if len(name) % 2 == 0 and all(name[i : i + 2] in Axis.__members__ for i in range(0, len(name), 2)):
            named = tuple(name[i : i + 2] for i in range(0, len(name), 2))
        else:
            raise ConfigError(
                f"unknown axes {given!r}; use an axis (DP, CP, TP, PP), axes together (('DP', 'CP') or "
                "'DPCP'), or an expert axis (EP, EDP)"
            )
    if isinstance(named, (tuple, list)) and named:
        axes = tuple(Axis.parse(a) for a in named)
        if len(set(axes)) != len(axes):
            raise ConfigError(f"axes {given!r} name an axis twice; name each once")
        return tuple(a for a in Axis if a in axes)
    raise ConfigError(f"axes are an axis, a tuple of axes or an expert axis (EP, EDP); got {given!r}")


def names_axes(value: object) -> bool:
    """Whether `value` names axes (else, as a string, it may name one group: "TP1", "DPCP0")."""
    if not isinstance(value, (str, tuple, list)):
        return False
    try:
        parse_axes(value)  # type: ignore[arg-type]
    except ConfigError:
        return False
    return True


def axes_label(axes: CanonicalAxes) -> str:
    """The axes' name: "DP", "DPCP", "EP"; its groups are named this plus their id."""
    return axes if isinstance(axes, str) else "".join(a.value for a in axes)


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
    ep: int = 1  # expert parallel: borrowed from DP x CP (divides dp * cp)
    # Derived in __post_init__ (not arguments, not compared: the fields above determine them).
    _strides: dict[Axis, int] = field(init=False, repr=False, compare=False)
    _world_size: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for axis in Axis:
            size = self.size(axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ConfigError(f"{axis.value.lower()} must be a positive int, got {size!r}")
        if (
            not isinstance(self.ep, int)
            or isinstance(self.ep, bool)
            or self.ep < 1
            or (self.dp * self.cp) % self.ep
        ):
            raise ConfigError(
                f"ep={self.ep!r} must be a positive int that divides dp*cp = {self.dp}*{self.cp} = "
                f"{self.dp * self.cp} (the experts are split over ep of the ranks that share a model shard)"
            )
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
        ep: int = 1,
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
        return cls(dp=dp, tp=tp, pp=pp, cp=cp, order=parse_order(order), ep=ep)

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

    # groups ---------------------------------------------------------------------------------------------------
    def group_ranks(self, axes: Axes, rank: int) -> list[int]:
        """The global ranks of `rank`'s group on `axes`: for axes, those that share every coordinate with `rank`
        except the ones on `axes` (ascending: row-major in `order`); for EP/EDP, see the module docstring."""
        parsed = parse_axes(axes)
        if isinstance(parsed, str):
            plane, ep = self._plane(rank), self.ep
            place = plane.index(rank)
            return plane[place // ep * ep :][:ep] if parsed == "EP" else plane[place % ep :: ep]
        c = self.coords_of(rank)
        ranks = [rank - sum(c[a] * self.stride(a) for a in parsed)]
        for axis in parsed:
            ranks = [r + i * self.stride(axis) for r in ranks for i in range(self.size(axis))]
        return sorted(ranks)

    def _plane(self, rank: int) -> list[int]:
        return self.group_ranks(DATA_AXES, rank)

    def group_size(self, axes: Axes) -> int:
        """How many ranks each group of `axes` has."""
        parsed = parse_axes(axes)
        if isinstance(parsed, str):
            return self.ep if parsed == "EP" else self.dp * self.cp // self.ep
        size = 1
        for axis in parsed:
            size *= self.size(axis)
        return size

    def num_groups(self, axes: Axes) -> int:
        return self.world_size // self.group_size(axes)

    def group_id(self, axes: Axes, rank: int) -> int:
        """Index of `rank`'s group among the groups of `axes`: the other coordinates, row-major in `order`;
        for EP/EDP, the DP x CP group's id, then the run (EP) or the place in the runs (EDP)."""
        parsed = parse_axes(axes)
        if isinstance(parsed, str):
            place = self._plane(rank).index(rank)
            runs = self.dp * self.cp // self.ep
            if parsed == "EP":
                return self.group_id(DATA_AXES, rank) * runs + place // self.ep
            return self.group_id(DATA_AXES, rank) * self.ep + place % self.ep
        c = self.coords_of(rank)
        gid = 0
        for other in self.order:
            if other not in parsed:
                gid = gid * self.size(other) + c[other]
        return gid

    def group_name(self, axes: Axes, rank: int) -> str:
        """ "DP0", "TP1", "DPCP0", "EP1", "EDP0": the axes' name and the group's id."""
        return f"{axes_label(parse_axes(axes))}{self.group_id(axes, rank)}"

    def groups(self, axes: Axes) -> list[list[int]]:
        """All groups of `axes`, indexed by group id."""
        found: dict[int, list[int]] = {}
        for r in range(self.world_size):
            found.setdefault(self.group_id(axes, r), self.group_ranks(axes, r))
        return [found[i] for i in range(len(found))]

    def shown_axes(self) -> list[CanonicalAxes]:
        """The axes `overview` prints: every axis (CP when cp > 1), DP x CP when cp > 1, EP/EDP when ep > 1."""
        shown: list[CanonicalAxes] = [
            (a,) for a in (Axis.DP, Axis.CP, Axis.TP, Axis.PP) if a is not Axis.CP or self.cp > 1
        ]
        if self.cp > 1:
            shown.append(DATA_AXES)
        if self.ep > 1:
            shown += list(EXPERT_AXES)
        return shown

    # human-readable ---------------------------------------------------------------------------------------------
    def describe(self) -> str:
        shown = [a for a in self.order if a is not Axis.CP or self.cp > 1]
        sizes = " x ".join(f"{a.value.lower()}={self.size(a)}" for a in shown)
        experts = f", experts over ep={self.ep} of dp*cp" if self.ep > 1 else ""
        return (
            f"{self.world_size} ranks = {sizes} (order {'-'.join(a.value for a in self.order)}, last is "
            f"innermost{experts})"
        )

    def overview(self) -> str:
        """A table of every rank's coordinates and groups, as InfiniTrain's ProcessGroupOverview prints."""
        axes = [a for a in (Axis.DP, Axis.CP, Axis.TP, Axis.PP) if a is not Axis.CP or self.cp > 1]
        shown = self.shown_axes()
        rows = [["rank", *(a.value.lower() for a in axes), *(f"{axes_label(d)} group" for d in shown)]]
        for r in range(self.world_size):
            c = self.coords_of(r)
            groups = [f"{self.group_name(d, r)} {self.group_ranks(d, r)}".replace(" ", "") for d in shown]
            rows.append([str(r), *(str(c[a]) for a in axes), *groups])
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        return "\n".join([self.describe(), *lines])
