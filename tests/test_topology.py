"""Layout arithmetic, checked exhaustively on small worlds."""

import itertools

import pytest

from threadpar.errors import ConfigError
from threadpar.topology import Axis, Coords, Layout

SIZES = [1, 2, 3, 4]
ORDERS = [None, "TP-DP-PP", "DP-PP-TP", ("PP", "TP", "DP")]


def all_layouts():
    for dp, tp, pp in itertools.product(SIZES, repeat=3):
        for order in ORDERS:
            yield Layout.build(dp=dp, tp=tp, pp=pp, order=order)


def test_rank_coords_roundtrip_and_groups_partition_the_world():
    for layout in all_layouts():
        n = layout.world_size
        assert n == layout.dp * layout.tp * layout.pp
        seen = set()
        for r in range(n):
            c = layout.coords_of(r)
            assert layout.rank_of(c) == r
            seen.add((c.dp, c.tp, c.pp))
        assert len(seen) == n
        for axis in (Axis.DP, Axis.TP, Axis.PP):
            groups = layout.groups(axis)
            assert len(groups) == layout.num_groups(axis)
            assert sorted(r for g in groups for r in g) == list(range(n))
            for r in range(n):
                members = layout.group_ranks(axis, r)
                assert r in members and len(members) == layout.size(axis)
                assert groups[layout.group_id(axis, r)] == members
                # members differ only on `axis`, and are listed in axis order
                others = [a for a in Axis if a is not axis]
                assert all(layout.coords_of(m)[o] == layout.coords_of(r)[o] for m in members for o in others)
                assert [layout.coords_of(m)[axis] for m in members] == list(range(layout.size(axis)))
                assert layout.group_name(axis, r) == f"{axis.value}{layout.group_id(axis, r)}"


def test_default_order_puts_tp_innermost_and_pp_outermost():
    layout = Layout.build(8, tp=2, pp=2)
    assert layout.dp == 2
    assert layout.group_ranks("TP", 0) == [0, 1]  # adjacent ranks
    assert layout.group_ranks("DP", 0) == [0, 2]
    assert layout.group_ranks("PP", 0) == [0, 4]
    assert layout.stride(Axis.TP) == 1 and layout.stride(Axis.DP) == 2 and layout.stride(Axis.PP) == 4
    assert layout.coords_of(5) == Coords(dp=0, tp=1, pp=1)
    assert layout.rank_of(dp=1, tp=1, pp=1) == 7
    assert layout.group_name("PP", 3) == "PP3"


def test_configurable_order():
    layout = Layout.build(8, tp=2, pp=2, order="TP-DP-PP")  # PP innermost now
    assert layout.group_ranks("PP", 0) == [0, 1]
    assert layout.group_ranks("TP", 0) == [0, 4]


def test_dp_is_derived_and_bad_sizes_are_explained():
    assert Layout.build(12, tp=2, pp=3).dp == 2
    with pytest.raises(ConfigError, match="not divisible by tp\\*cp\\*pp = 4"):
        Layout.build(6, tp=2, pp=2)
    with pytest.raises(ConfigError, match="= 6 but there are 8 ranks; make the product equal 8"):
        Layout.build(8, dp=3, tp=2)
    with pytest.raises(ConfigError, match="tp must be a positive int"):
        Layout.build(8, tp=0)
    with pytest.raises(ConfigError, match="unknown axis"):
        Layout.build(4, order="TP-XX")
    with pytest.raises(ConfigError, match="names an axis twice"):
        Layout.build(4, order="TP-TP-PP")
    with pytest.raises(ConfigError, match=r"outside 0\.\.3"):
        Layout.build(4).coords_of(4)
    with pytest.raises(ConfigError, match=r"tp=2 is outside 0\.\.1"):
        Layout.build(4, tp=2).rank_of(tp=2)


def test_cp_axis_multiplies_with_the_others():
    layout = Layout.build(16, tp=2, cp=2, pp=2)
    assert layout.dp == 2
    assert layout.group_ranks("TP", 0) == [0, 1]
    assert layout.group_ranks("CP", 0) == [0, 2]
    assert layout.group_ranks("DP", 0) == [0, 4]
    assert layout.group_ranks("PP", 0) == [0, 8]


def test_overview_lists_every_rank_with_its_groups():
    text = Layout.build(4, tp=2).overview()
    lines = text.splitlines()
    assert "4 ranks" in lines[0]
    assert lines[1].split()[:4] == ["rank", "dp", "tp", "pp"]
    assert len(lines) == 2 + 4
    assert "TP1[2,3]" in lines[-1] and "DP1[1,3]" in lines[-1]


def test_combined_and_expert_axes_partition_the_world_into_their_groups():
    """Every axes (axes together, EP, EDP) partitions the ranks; a combined axes's members differ only on its
    axes; EP runs are consecutive in the DP x CP group and EDP takes the same place of every run."""
    for dp, cp, tp, pp in itertools.product([1, 2, 4], [1, 2], [1, 2], [1, 2]):
        for ep in (e for e in (1, 2, 4) if (dp * cp) % e == 0):
            layout = Layout.build(dp=dp, cp=cp, tp=tp, pp=pp, ep=ep, order="TP-DP-CP-PP")
            for axes in [("DP", "CP"), ("CP", "TP"), ("PP", "TP", "DP"), "EP", "EDP"]:
                groups = layout.groups(axes)
                assert sorted(r for g in groups for r in g) == list(range(layout.world_size)), axes
                assert all(len(g) == layout.group_size(axes) for g in groups), axes
            for r in range(layout.world_size):
                plane = layout.group_ranks(("DP", "CP"), r)
                others = [Axis.TP, Axis.PP]
                assert all(layout.coords_of(m)[o] == layout.coords_of(r)[o] for m in plane for o in others)
                place = plane.index(r)
                assert layout.group_ranks("EP", r) == plane[place // ep * ep : place // ep * ep + ep]
                assert layout.group_ranks("EDP", r) == plane[place % ep :: ep]
                assert layout.group_name("EDP", r) == f"EDP{layout.group_id('EDP', r)}"


def test_axes_are_named_as_the_issue_names_them_and_overview_prints_them():
    layout = Layout.build(8, cp=2, ep=2)
    assert layout.group_name(("CP", "DP"), 5) == "DPCP0" and layout.group_name("DPCP", 5) == "DPCP0"
    assert (layout.group_ranks("EP", 0), layout.group_name("EP", 0)) == ([0, 1], "EP0")
    assert (layout.group_ranks("EDP", 3), layout.group_name("EDP", 3)) == ([1, 3, 5, 7], "EDP1")
    header, *rows = layout.overview().splitlines()[1:]
    assert header.split()[-6:] == ["DPCP", "group", "EP", "group", "EDP", "group"]
    assert rows[2].split()[-3:] == ["DPCP0[0,1,2,3,4,5,6,7]", "EP1[2,3]", "EDP0[0,2,4,6]"]
    assert "EP" not in Layout.build(4).overview()  # shown only when ep > 1


def test_bad_axes_and_ep_sizes_are_config_errors_that_say_what_to_pass():
    with pytest.raises(ConfigError, match="must be a positive int that divides dp\\*cp = 2\\*1 = 2"):
        Layout.build(4, tp=2, ep=4)
    with pytest.raises(ConfigError, match="unknown axes 'XP'; use an axis"):
        Layout.build(4).group_ranks("XP", 0)
    with pytest.raises(ConfigError, match="name an axis twice"):
        Layout.build(4).group_ranks(("DP", "DP"), 0)
