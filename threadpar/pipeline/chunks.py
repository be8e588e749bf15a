"""Cut a model's layers into this rank's chunk modules, following `get_stage_info`."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from threadpar.errors import ConfigError
from threadpar.pipeline.partition import get_stage_info


def build_chunks(
    layers: Sequence[nn.Module],
    *,
    pp_size: int,
    pp_rank: int,
    chunks_per_stage: int = 1,
    first: nn.Module | None = None,
    last: nn.Module | None = None,
    placement: str = "loop",
) -> list[nn.Sequential]:
    """This rank's chunks as nn.Sequential modules (the layer objects themselves, not copies).

    `first` (e.g. the embedding) is prepended to global chunk 0 and `last` (e.g. final norm and head) is
    appended to the last global chunk, so they live on the first and the last pipeline stage.
    placement="v" with chunks_per_stage=2: ZB-V's chunks (rank r holds chunks r and 2 pp - 1 - r).
    """
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.Sequential, nn.ModuleList)):
        raise ConfigError(
            f"build_chunks needs a sequence of layers (list, nn.Sequential, nn.ModuleList), got "
            f"{type(layers).__name__}"
        )
    layers = list(layers)
    info = get_stage_info(len(layers), pp_size, pp_rank, chunks_per_stage, placement)
    last_chunk = pp_size * chunks_per_stage - 1
    chunks = []
    for chunk, (start, end) in zip(info.chunk_ids, info.layer_ranges_per_chunk):
        parts = list(layers[start:end])
        if chunk == 0 and first is not None:
            parts.insert(0, first)
        if chunk == last_chunk and last is not None:
            parts.append(last)
        chunks.append(nn.Sequential(*parts))
    return chunks
