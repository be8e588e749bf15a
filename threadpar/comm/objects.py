"""Collectives of picklable Python objects, with torch.distributed's names and parameters.

As torch does, each object is pickled into a uint8 tensor on the rank's device and sent with the group's
tensor collectives: the sizes first (so every member can pad to the longest), then the bytes. Receivers get
unpickled copies, never the sender's own objects. Only pickle what the ranks of your own program produced.
`weights_only=True` (torch 2.14's parameter; the functions take the installed torch's parameters:
comm/torch_signatures.py) serializes with torch.save and loads with torch.load(weights_only=True), as torch's
_object_to_tensor / _tensor_to_object do (torch/distributed/distributed_c10d.py).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist

from threadpar.comm import torch_args
from threadpar.comm.functional import GroupLike, get_group
from threadpar.comm.group import ProcessGroup
from threadpar.comm.rank_groups import current_groups
from threadpar.comm.torch_signatures import follows
from threadpar.errors import ConfigError


def _encode(obj: Any, device: torch.device, weights_only: bool = False) -> torch.Tensor:
    if weights_only:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getvalue()
    else:
        data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)  # [len(data)]


def _decode(data: torch.Tensor, weights_only: bool = False) -> Any:
    raw = data.cpu().numpy().tobytes()
    return torch.load(io.BytesIO(raw), weights_only=True) if weights_only else pickle.loads(raw)


def _padded(data: torch.Tensor, length: int) -> torch.Tensor:
    out = torch.zeros(length, dtype=torch.uint8, device=data.device)
    out[: data.numel()] = data
    return out


def _sizes(pg: ProcessGroup, data: torch.Tensor) -> list[int]:
    """Every member's byte count, in group order (one all-gather)."""
    mine = torch.tensor([data.numel()], dtype=torch.int64, device=data.device)
    everyone = torch.empty(pg.size(), dtype=torch.int64, device=data.device)
    pg.all_gather_into_tensor(everyone, mine)
    return everyone.tolist()


def _check_list(op: str, what: str, objects: object, size: int) -> list:
    if not isinstance(objects, list) or len(objects) != size:
        got = len(objects) if isinstance(objects, list) else type(objects).__name__
        raise ConfigError(f"{op}: {what} must be a list of {size} entries (one per group member), got {got}")
    return objects


@follows(dist.all_gather_object)
def all_gather_object(
    object_list: list[Any], obj: Any, group: GroupLike = None, weights_only: bool = False
) -> None:
    """object_list[i] = member i's `obj` (object_list must have one entry per member)."""
    pg = get_group(group)
    _check_list("all_gather_object", "object_list", object_list, pg.size())
    data = _encode(obj, current_groups().device, weights_only)
    sizes = _sizes(pg, data)
    longest = max(sizes)
    rows = torch.empty(pg.size() * longest, dtype=torch.uint8, device=data.device)
    pg.all_gather_into_tensor(rows, _padded(data, longest))
    for i, n in enumerate(sizes):
        object_list[i] = _decode(rows[i * longest : i * longest + n], weights_only)


@follows(dist.broadcast_object_list)
def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: GroupLike = None,
    device: torch.device | None = None,
    group_src: int | None = None,
    weights_only: bool = False,
) -> None:
    """Every member's object_list becomes the source's (same length on every member). `device`: where the
    bytes travel; it must be the rank's device (the default)."""
    pg = get_group(group)
    root = torch_args.required_peer("broadcast_object_list", pg, "src", src, group_src)
    here = current_groups().device
    torch_args.check_device_id("broadcast_object_list", device, here)
    if not isinstance(object_list, list) or not object_list:
        raise ConfigError(
            "broadcast_object_list: object_list must be a non-empty list (the same length everywhere)"
        )
    sizes = torch.empty(len(object_list), dtype=torch.int64, device=here)
    if pg.global_rank == root:
        parts = [_encode(o, here, weights_only) for o in object_list]
        sizes.copy_(torch.tensor([p.numel() for p in parts], dtype=torch.int64))
    pg.broadcast(sizes, root)
    counts = sizes.tolist()
    data = (
        torch.cat(parts)
        if pg.global_rank == root
        else torch.empty(sum(counts), dtype=torch.uint8, device=here)
    )
    pg.broadcast(data, root)
    if pg.global_rank != root:
        for i, piece in enumerate(data.split(counts)):
            object_list[i] = _decode(piece, weights_only)


@follows(dist.gather_object)
def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: GroupLike = None,
    group_dst: int | None = None,
    weights_only: bool = False,
) -> None:
    """On the destination (global rank 0 when neither `dst` nor `group_dst`), object_gather_list[i] =
    member i's `obj`; the other members pass None."""
    pg = get_group(group)
    root = torch_args.peer("gather_object", pg, "dst", dst, group_dst)
    root = 0 if root is None else root
    if pg.global_rank == root:
        _check_list("gather_object", "object_gather_list", object_gather_list, pg.size())
    elif object_gather_list is not None:
        raise ConfigError(
            f"gather_object: only the destination rank {root} passes object_gather_list; "
            f"rank {pg.global_rank} passed one (pass None)"
        )
    data = _encode(obj, current_groups().device, weights_only)
    sizes = _sizes(pg, data)
    longest = max(sizes)
    rows = None
    if pg.global_rank == root:
        rows = [torch.empty(longest, dtype=torch.uint8, device=data.device) for _ in sizes]
    pg.gather(_padded(data, longest), rows, root)
    if rows is not None:
        assert object_gather_list is not None  # checked above: the destination passes the list
        for i, (row, n) in enumerate(zip(rows, sizes)):
            object_gather_list[i] = _decode(row[:n], weights_only)


@follows(dist.scatter_object_list)
def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: GroupLike = None,
    group_src: int | None = None,
    weights_only: bool = False,
) -> None:
    """scatter_object_output_list[0] = the source's scatter_object_input_list[this member's group rank]; the
    source is global rank 0 when neither `src` nor `group_src`."""
    pg = get_group(group)
    root = torch_args.peer("scatter_object_list", pg, "src", src, group_src)
    root = 0 if root is None else root
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise ConfigError(
            "scatter_object_list: scatter_object_output_list must be a list of at least one entry"
        )
    here = current_groups().device
    header = torch.empty(pg.size() + 1, dtype=torch.int64, device=here)  # [longest, size of each member's]
    rows = None
    if pg.global_rank == root:
        inputs = _check_list(
            "scatter_object_list", "scatter_object_input_list", scatter_object_input_list, pg.size()
        )
        parts = [_encode(o, here, weights_only) for o in inputs]
        longest = max(p.numel() for p in parts)
        header.copy_(torch.tensor([longest, *(p.numel() for p in parts)], dtype=torch.int64))
        rows = [_padded(p, longest) for p in parts]
    elif scatter_object_input_list is not None:
        raise ConfigError(
            f"scatter_object_list: only the source rank {root} passes scatter_object_input_list; "
            f"rank {pg.global_rank} passed one (pass None)"
        )
    pg.broadcast(header, root)
    longest, *sizes = header.tolist()
    mine = torch.empty(longest, dtype=torch.uint8, device=here)
    pg.scatter(mine, rows, root)
    scatter_object_output_list[0] = _decode(mine[: sizes[pg.rank()]], weights_only)
