"""threadpar's torch.distributed namesakes take torch's parameters: names, order, kinds and defaults.

The table is compared with the installed torch's own functions, so a torch upgrade that adds or moves a
parameter fails here instead of leaving the copy behind (issue 19). threadpar's own extra parameters may
only follow torch's, keyword-only with a default, so that no call torch accepts means something else here.
A namesake whose parameters changed within the supported torch range takes the installed torch's through
`follows` (comm/torch_signatures.py), tested at the end on stand-ins for older and newer releases.
"""

import inspect

import pytest
import torch.distributed as dist
import torch.nn

import threadpar
from threadpar.comm.torch_signatures import follows
from threadpar.errors import ConfigError
from threadpar.parallel import DataParallel, DistributedDataParallel

FUNCTIONS = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
]
CLASSES = [  # (name, threadpar's, torch's): their constructors
    ("P2POp", threadpar.P2POp, dist.P2POp),
    ("DistributedDataParallel", DistributedDataParallel, torch.nn.parallel.DistributedDataParallel),
    ("DataParallel", DataParallel, torch.nn.DataParallel),
]
# Names threadpar exports that torch.distributed also has but which are not the same callable: classes
# whose constructors differ by design (a threadpar ProcessGroup is one rank's handle, made by new_group).
# torch.distributed.device_mesh is a module; threadpar.device_mesh() returns the layout as torch's DeviceMesh.
NOT_NAMESAKES = {"ProcessGroup", "ReduceOp", "Work", "P2POp", "device_mesh"}


def _default(value):
    """Defaults compared by meaning: torch's ReduceOp.SUM (a RedOpType) and threadpar's are both "SUM"."""
    if type(value).__name__ in ("RedOpType", "ReduceOp"):
        return ("ReduceOp", value.name)
    return value


def _parameters(fn, skip_self=False):
    params = list(inspect.signature(fn).parameters.values())
    if skip_self:
        params = params[1:]
    return [(p.name, p.kind.name, _default(p.default)) for p in params]


def _compare(name, ours, theirs):
    n = len(theirs)
    assert ours[:n] == theirs, f"{name}: threadpar's parameters\n  {ours}\ndiffer from torch's\n  {theirs}"
    for extra in ours[n:]:
        assert extra[1] == "KEYWORD_ONLY" and extra[2] is not inspect.Parameter.empty, (
            f"{name}: threadpar's own parameter {extra[0]} must come after torch's, keyword-only, with a default"
        )


@pytest.mark.parametrize("name", FUNCTIONS)
def test_function_takes_torch_parameters(name):
    _compare(name, _parameters(getattr(threadpar, name)), _parameters(getattr(dist, name)))


@pytest.mark.parametrize("name, ours, theirs", CLASSES, ids=[c[0] for c in CLASSES])
def test_class_takes_torch_parameters(name, ours, theirs):
    _compare(name, _parameters(ours.__init__, True), _parameters(theirs.__init__, True))


def test_every_namesake_is_in_the_table():
    """A function threadpar exports under a torch.distributed name is compared above."""
    shared = {n for n in threadpar.__all__ if hasattr(dist, n)} - NOT_NAMESAKES
    assert shared <= set(FUNCTIONS), f"add to FUNCTIONS: {sorted(shared - set(FUNCTIONS))}"


def test_reduce_ops_are_torch_ones():
    """Every torch ReduceOp but PREMUL_SUM (which carries a factor: left out, see notes/issue-19-api.md)."""
    theirs = set(dist.ReduceOp.RedOpType.__members__) - {"PREMUL_SUM"}
    assert theirs <= {op.name for op in threadpar.ReduceOp}
    for name in theirs:  # torch's own values are accepted wherever threadpar takes an op
        assert threadpar.ReduceOp.parse(getattr(dist.ReduceOp, name)) is threadpar.ReduceOp[name]


# follows(): a namesake written for every supported torch takes the installed torch's parameters. The torch
# functions below stand for releases before and after the namesake's (parameters added, a default changed).


def newest(tensor, group=None, async_op=False, weights_only=False):  # the namesake's view of torch
    """torch's function as the newest supported release has it."""


def older(tensor, group=None, async_op=True):  # no weights_only yet; another default
    """torch's function as an older release had it."""


def newer(tensor, group=None, async_op=False, weights_only=False, fresh=7):  # one more parameter
    """torch's function as a release newer than threadpar knows has it."""


def namesake(tensor, group=None, async_op=False, weights_only=False, *, ours=1):
    return {
        "tensor": tensor,
        "group": group,
        "async_op": async_op,
        "weights_only": weights_only,
        "ours": ours,
    }


def test_follows_keeps_a_namesake_that_already_takes_torchs_parameters():
    assert follows(newest)(namesake) is namesake  # nothing is paid per call on the torch it was written for


def test_follows_an_older_torch_parameters_positions_and_defaults():
    ours = follows(older)(namesake)
    assert _parameters(ours) == [
        *_parameters(older),
        ("weights_only", "KEYWORD_ONLY", False),  # the newer torch's, kept as threadpar's extra
        ("ours", "KEYWORD_ONLY", 1),
    ]
    assert ours("t") == namesake("t", async_op=True)  # torch's default for what the call leaves out
    assert ours("t", "g", False, ours=2) == namesake("t", "g", False, ours=2)
    assert ours("t", weights_only=True) == namesake("t", async_op=True, weights_only=True)
    with pytest.raises(TypeError):  # a fourth positional argument is one this torch does not take
        ours("t", "g", False, True)


def test_follows_a_newer_torch_parameter_only_at_its_default():
    ours = follows(newer)(namesake)
    assert _parameters(ours)[:5] == _parameters(newer)
    assert ours("t", fresh=7) == namesake("t")
    with pytest.raises(ConfigError, match=r"does not implement torch .*'s parameter fresh"):
        ours("t", fresh=8)


def test_follows_a_constructor():
    class Torchs:
        def __init__(self, module, broadcast=True):
            pass

    class Ours:
        @follows(Torchs.__init__, method=True)
        def __init__(self, module, broadcast=None, sync=None, *, extra=0):
            self.seen = (module, broadcast, sync, extra)

    assert _parameters(Ours.__init__, True) == [
        *_parameters(Torchs.__init__, True),
        ("sync", "KEYWORD_ONLY", None),
        ("extra", "KEYWORD_ONLY", 0),
    ]
    assert Ours("m").seen == ("m", True, None, 0)
    assert Ours("m", False, sync=True, extra=3).seen == ("m", False, True, 3)
    with pytest.raises(TypeError):
        Ours("m", False, True)
