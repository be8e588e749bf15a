"""The message of a collective mismatch (DESIGN.md rule 6): whose call differs from whose, whatever the order
the members came in.

Every backend and check builds it the same way (the threads backend's rendezvous, the nccl backend's call
ledger, the checks across processes): one line per member (a rank, or a process), the members whose call
differs from the majority's marked with whom they differ from, and where no call has a majority (two ranks,
or a three-way split), every side marked against the others. So a program that mismatches names the same
ranks however its threads were scheduled (which member came first decides nothing).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence


def header(name: str, ranks: Sequence[int], seq: int, across: str = "") -> str:
    return (
        f"collective mismatch on group '{name}' (global ranks {list(ranks)}){across} at its call #{seq}: members "
        "must call the same collectives, with the same dtypes and shapes, in the same order"
    )


def member_lines(members: Sequence[tuple[str, Hashable, str]], missing: Sequence[str] = ()) -> list[str]:
    """`members`: (who: "rank 3" / "process 1", what they called (compared with ==), how to show it), in order;
    `missing`: who has not issued the call (yet). The lines of a mismatch's message."""
    counts = Counter(what for _, what, _ in members)
    ranked = counts.most_common()
    majority = ranked[0][0] if len(ranked) == 1 or ranked[0][1] > ranked[1][1] else None
    lines = []
    for who, what, shown in members:
        if majority is not None:
            others = [w for w, c, _ in members if c == majority] if what != majority else []
        else:
            others = [w for w, c, _ in members if c != what]
        mark = f"   <-- differs from {_names(others)}" if others else ""
        lines.append(f"  {who}: {shown}{mark}")
    lines.extend(f"  {who}: (has not issued it)" for who in missing)
    return lines


def _names(whos: list[str]) -> str:
    """["rank 0", "rank 2"] -> "ranks 0, 2"; one -> itself."""
    if len(whos) == 1:
        return whos[0]
    kind = whos[0].split(" ", 1)[0]
    if all(w.startswith(kind + " ") for w in whos):
        return f"{kind}s " + ", ".join(w.split(" ", 1)[1] for w in whos)
    return ", ".join(whos)
