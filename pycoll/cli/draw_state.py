"""What every element holds after each round: the schedule run on symbols instead of numbers.

Each element is a set of tokens (``None`` while it holds nothing meaningful): a rank number
for its contribution (all_reduce, reduce, reduce_scatter), the block owner for data that
only moves (all_gather, gather, scatter, broadcast), ``"2→1"`` for all_to_all's block from
rank 2 to rank 1. Receive and copy overwrite; receive-reduce and reduce take the union. The
final state is checked against what the collective must produce, so a picture also says
whether the schedule it shows is right. ``in`` and ``out`` are one tensor for the in-place
collectives (all_reduce, broadcast, reduce), as ``collectives.py`` passes them.
"""

from __future__ import annotations

from pycoll.algorithms.schedule import Copy, Recv, RecvReduce, Reduce, Send


def rng(buf: str, start: int, count: int) -> str:
    return f"{buf}[{start}:{start + count})"


def action_label(a) -> str:
    """One action in a few characters: ``→r1 out[0:2)``, ``←r3 out[2:4) +=``, ``copy ...``."""
    if isinstance(a, Send):
        return f"→r{a.peer} {rng(a.buf, a.start, a.count)}"
    if isinstance(a, (Recv, RecvReduce)):
        return f"←r{a.peer} {rng(a.buf, a.start, a.count)}" + (" +=" if isinstance(a, RecvReduce) else "")
    op = "copy" if isinstance(a, Copy) else "+="
    src, dst = rng(a.src, a.src_start, a.count), rng(a.dst, a.dst_start, a.count)
    return f"{src}→{dst}" if op == "copy" else f"{dst} += {src}"


REDUCING = ("all_reduce", "reduce", "reduce_scatter")
IN_PLACE = ("all_reduce", "broadcast", "reduce")


def _initial(tl, rank: int, sizes: dict[str, int]) -> dict[str, list]:
    c, n = tl.collective, tl.count
    st = {b: [None] * size for b, size in sizes.items()}
    if c in IN_PLACE:
        st["in"] = st["out"] = [None] * max(sizes.get("in", 0), sizes.get("out", 0))
        if c != "broadcast" or rank == tl.root:
            st["out"][:] = [frozenset({str(rank)})] * len(st["out"])
    elif c in ("all_gather", "gather", "reduce_scatter"):
        st["in"][:] = [frozenset({str(rank)})] * len(st["in"])
    elif c == "scatter" and rank == tl.root:
        st["in"][:] = [frozenset({str(e // n)}) for e in range(len(st["in"]))]
    elif c == "all_to_all":
        st["in"][:] = [frozenset({f"{rank}→{e // n}"}) for e in range(len(st["in"]))]
    return st


def _expected(tl, rank: int, e: int):
    c, n, P, root = tl.collective, tl.count, tl.world, tl.root
    everyone = frozenset(str(r) for r in range(P))
    if c == "all_reduce" or (c == "reduce_scatter") or (c == "reduce" and rank == root):
        return everyone
    if c == "broadcast":
        return frozenset({str(root)})
    if c == "all_gather" or (c == "gather" and rank == root):
        return frozenset({str(e // n)})
    if c == "scatter":
        return frozenset({str(rank)})
    if c == "all_to_all":
        return frozenset({f"{e // n}→{rank}"})
    return "any"


def simulate(tl) -> tuple[dict, str]:
    """({(rank, round): {buf: contents after that round}}, verdict line)."""
    sizes = {b: n for b, n in tl.buffers().items()}
    sizes.setdefault("in", 0)
    sizes.setdefault("out", 0)
    state = [_initial(tl, r, sizes) for r in range(tl.world)]
    steps = {(s.rank, tl.rounds[s.rank][i]): step for s in tl.schedules
             for i, step in enumerate(s.steps)}
    sent = {}  # (src, dst, ordinal) -> payload; frames pair up in order per (src, dst)
    ords: dict[tuple[int, int], int] = {}
    got: dict[tuple[int, int], int] = {}
    out = {}
    for rd in range(tl.n_rounds):
        for r in range(tl.world):  # every send of the round reads the state before it
            for a in steps.get((r, rd), ()):
                if isinstance(a, Send):
                    k = ords.get((r, a.peer), 0)
                    ords[r, a.peer] = k + 1
                    sent[r, a.peer, k] = state[r][a.buf][a.start:a.start + a.count]
        for r in range(tl.world):
            st = state[r]
            for a in steps.get((r, rd), ()):
                if isinstance(a, (Recv, RecvReduce)):
                    k = got.get((a.peer, r), 0)
                    got[a.peer, r] = k + 1
                    data = sent.pop((a.peer, r, k))
                    _write(st[a.buf], a.start, data, isinstance(a, RecvReduce))
                elif isinstance(a, (Copy, Reduce)):
                    data = st[a.src][a.src_start:a.src_start + a.count]
                    _write(st[a.dst], a.dst_start, data, isinstance(a, Reduce))
            out[r, rd] = {b: list(v) for b, v in st.items()}
    return out, _verdict(tl, state)


def _write(dst: list, start: int, data: list, reduce: bool) -> None:
    for i, v in enumerate(data):
        old = dst[start + i]
        if reduce:
            v = None if v is None or old is None else old | v
        dst[start + i] = v


def _verdict(tl, state) -> str:
    if tl.collective == "barrier":
        return "result: every rank heard from every other" if _heard_all(tl) else \
            "WRONG: some rank leaves before hearing from every other"
    for r in range(tl.world):
        for e, v in enumerate(state[r]["out"]):
            want = _expected(tl, r, e)
            if want != "any" and v != want:
                return (f"WRONG: rank {r} out[{e}] holds {label(tl, v)}, "
                        f"expected {label(tl, want)}")
    return "result checked: every output element holds what the collective must produce"


def _heard_all(tl) -> bool:
    """Barrier: knowledge spreads along transfers, round by round."""
    know = [{r} for r in range(tl.world)]
    for rd in range(tl.n_rounds):
        new = [set(k) for k in know]
        for t in tl.transfers:
            if t.round == rd:
                new[t.dst] |= know[t.src]
        know = new
    return all(len(k) == tl.world for k in know)


def label(tl, v) -> str:
    """Short text for one element: Σ = every rank's contribution, else the tokens."""
    if v is None:
        return "·"
    if tl.collective in REDUCING and len(v) == tl.world:
        return "Σ"
    if tl.collective in REDUCING or tl.collective == "all_reduce":
        return "".join(sorted(v, key=int))
    return "+".join(sorted(v))
