"""Which layers each pipeline rank holds (pure: no torch, no threads), after InfiniTrain's GetStageInfo.

The model's layers are cut into `pp_size * chunks_per_stage` consecutive chunks (virtual stages). Chunk c
runs on rank c % pp_size as that rank's local chunk c // pp_size, so with 4 ranks and 2 chunks each,
rank 0 holds chunks 0 and 4. Remainder layers go to the first chunks: 10 layers on 3 chunks is 4, 3, 3.
The first stage (rank 0, chunk 0) also holds the embedding; the last (rank pp_size - 1, the last chunk)
the final norm, the head and the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from threadpar.errors import ConfigError


@dataclass(frozen=True)
class StageInfo:
    """What one pipeline rank holds: its place in the pipeline and its layer ranges, one per local chunk."""

    pp_rank: int
    pp_size: int
    is_first_stage: bool  # holds chunk 0, hence the embedding
    is_last_stage: bool  # holds the last chunk, hence the final norm, head and loss
    chunk_ids: tuple[int, ...]  # global chunk index of each local chunk
    layer_ranges_per_chunk: tuple[tuple[int, int], ...]  # [start, end) per local chunk

    @property
    def num_layers(self) -> int:
        return sum(end - start for start, end in self.layer_ranges_per_chunk)


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def chunk_layer_ranges(total_layers: int, num_chunks: int) -> list[tuple[int, int]]:
    """[start, end) of every global chunk: equal shares, one extra layer for each of the first chunks."""
    _positive_int("total_layers", total_layers)
    _positive_int("number of chunks", num_chunks)
    if total_layers < num_chunks:
        raise ConfigError(
            f"{total_layers} layers cannot fill {num_chunks} pipeline chunks (pp_size * chunks_per_stage); "
            "every chunk needs at least one layer: use fewer stages or chunks per stage"
        )
    base, extra = divmod(total_layers, num_chunks)
    ranges, start = [], 0
    for c in range(num_chunks):
        end = start + base + (1 if c < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def get_stage_info(
    total_layers: int, pp_size: int, pp_rank: int, chunks_per_stage: int = 1, placement: str = "loop"
) -> StageInfo:
    """The layer ranges of `pp_rank`'s chunks and its first/last flags. placement "loop": chunks dealt
    round-robin over the ranks; "v" (ZB-V, 2 chunks per rank): rank r holds chunks r and 2 pp - 1 - r, so
    rank 0 holds the first and the last chunk."""
    _positive_int("pp_size", pp_size)
    _positive_int("chunks_per_stage", chunks_per_stage)
    if not isinstance(pp_rank, int) or isinstance(pp_rank, bool) or not 0 <= pp_rank < pp_size:
        raise ConfigError(f"pp_rank={pp_rank!r} is outside 0..{pp_size - 1} (pp_size={pp_size})")
    if placement not in ("loop", "v") or (placement == "v" and chunks_per_stage != 2):
        raise ConfigError(
            f"placement={placement!r} with chunks_per_stage={chunks_per_stage}: use 'loop', or 'v' with 2 chunks"
        )
    ranges = chunk_layer_ranges(total_layers, pp_size * chunks_per_stage)
    if placement == "v":
        chunk_ids: tuple[int, ...] = (pp_rank, 2 * pp_size - 1 - pp_rank)
    else:
        chunk_ids = tuple(local * pp_size + pp_rank for local in range(chunks_per_stage))
    return StageInfo(
        pp_rank=pp_rank,
        pp_size=pp_size,
        is_first_stage=pp_rank == 0,
        is_last_stage=pp_rank == (0 if placement == "v" else pp_size - 1),
        chunk_ids=chunk_ids,
        layer_ranges_per_chunk=tuple(ranges[c] for c in chunk_ids),
    )
