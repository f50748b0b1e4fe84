"""``python -m pycoll draw``: an algorithm's schedule, step by step, as a picture or a table.

    python -m pycoll draw ring --collective all_reduce --world-size 4 -o ring.png
    python -m pycoll draw all_reduce/halving_doubling -n 5 --text
    python -m pycoll draw --all --out docs/gallery          # every algorithm, P = 4 and 5

The picture is built from the very ``Schedule`` objects the executor runs: one schedule per
rank, from ``pycoll.algorithms``. Schedules do not share step numbers (frames are matched
per ordered pair of ranks, in order), so this module first matches every ``Send`` with its
``Recv``/``RecvReduce`` and places each rank's steps on global *rounds*: a step runs one
round after the rank's previous step, and both ends of a transfer share a round (the
earliest round at which both sides can be in it). ``timeline()`` is pure and testable;
``draw_plot.render()`` (matplotlib, imported lazily) draws it.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

from pycoll.algorithms import ALGORITHMS, get
from pycoll.algorithms.schedule import (
    COMM,
    Copy,
    Recv,
    RecvReduce,
    Reduce,
    Schedule,
    Send,
)
from pycoll.cli.draw_state import rng

ROOTED = ("broadcast", "reduce", "gather", "scatter")
PER_BLOCK = ("all_gather", "gather", "scatter", "reduce_scatter", "all_to_all")  # count = one block


@dataclass(frozen=True)
class Transfer:
    """One message: ``send`` on rank ``src`` matched with ``recv`` on rank ``dst``."""

    round: int
    src: int
    dst: int
    send: Send
    recv: Recv | RecvReduce

    @property
    def reduces(self) -> bool:
        return isinstance(self.recv, RecvReduce)


@dataclass(frozen=True)
class Local:
    round: int
    rank: int
    action: Copy | Reduce


@dataclass
class Drawing:
    collective: str
    algorithm: str
    world: int
    count: int
    root: int | None
    schedules: list[Schedule]
    rounds: list[list[int]]  # rounds[rank][step]
    transfers: list[Transfer] = field(default_factory=list)
    locals: list[Local] = field(default_factory=list)

    @property
    def n_rounds(self) -> int:
        return max((r[-1] + 1 for r in self.rounds if r), default=0)

    @property
    def name(self) -> str:
        """The schedule's own name (differs from the algorithm when it falls back)."""
        return self.schedules[0].name if self.schedules else self.algorithm

    def buffers(self) -> dict[str, int]:
        """Every buffer any rank touches -> its largest extent, ordered in, temps, out."""
        ext: dict[str, int] = defaultdict(int)
        for s in self.schedules:
            for name, size in s.temps.items():
                ext[name] = max(ext[name], size)
            for step in s.steps:
                for a in step:
                    for buf, start, count in _ranges(a):
                        ext[buf] = max(ext[buf], start + count)
        order = ["in"] + sorted(k for k in ext if k not in ("in", "out")) + ["out"]
        return {k: ext[k] for k in order if ext.get(k)}

    def summary(self) -> str:
        red = sum(t.reduces for t in self.transfers)
        sent = [sum(a.count for st in s.steps for a in st if isinstance(a, Send))
                for s in self.schedules]
        return (f"{self.n_rounds} rounds, {len(self.transfers)} transfers ({red} receive-reduce, "
                f"{len(self.transfers) - red} receive), {len(self.locals)} local actions; "
                f"steps per rank {[len(s.steps) for s in self.schedules]}; "
                f"elements sent per rank {sent}")


def _ranges(a) -> list[tuple[str, int, int]]:
    if isinstance(a, (Copy, Reduce)):
        return [(a.src, a.src_start, a.count), (a.dst, a.dst_start, a.count)]
    return [(a.buf, a.start, a.count)]


# ---------------------------------------------------------------- building schedules

def resolve(name: str, collective: str | None = None) -> tuple[str, str]:
    """(collective, algorithm) from ``ring`` + collective, ``all_reduce/ring`` or a module
    name such as ``ring_allreduce``; ValueError names the choices."""
    for sep in ("/", ":"):
        if sep in name:
            collective, name = name.split(sep, 1)
    if collective is not None:
        get(collective, name)  # raises with the valid names
        return collective, name
    owners = [c for c, algos in ALGORITHMS.items() if name in algos]
    if len(owners) == 1:
        return owners[0], name
    for c, algos in ALGORITHMS.items():
        for a, fn in algos.items():
            if fn.__module__.rsplit(".", 1)[-1] == name:
                return c, a
    if owners:
        raise ValueError(f"{name!r} is an algorithm of {', '.join(owners)}: pass --collective "
                         f"(or write e.g. {owners[0]}/{name})")
    raise ValueError(f"unknown algorithm {name!r}; choose from: {', '.join(all_names())}")


def all_names() -> list[str]:
    return [f"{c}/{a}" for c, algos in ALGORITHMS.items() for a in algos]


def default_count(collective: str, world: int) -> int:
    """One element per chunk: P for whole-buffer collectives, 1 for per-block ones."""
    return 1 if collective in PER_BLOCK else world


def build(collective: str, algorithm: str, world: int, count: int | None = None,
          root: int = 0) -> list[Schedule]:
    """Every rank's schedule, exactly as the executor gets it."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if not 0 <= root < world:
        raise ValueError(f"root {root} is not a rank of a world of {world}")
    fn = get(collective, algorithm)
    n = default_count(collective, world) if count is None else count
    out = []
    for r in range(world):
        if collective == "barrier":
            out.append(fn(r, world))
        elif collective in ROOTED:
            out.append(fn(r, world, n, root))
        elif collective == "reduce_scatter":
            out.append(fn(r, world, [n] * world))
        elif collective == "all_to_all":
            out.append(fn(r, world, [n] * world, [n] * world))
        else:
            out.append(fn(r, world, n))
    return out


def timeline(collective: str, algorithm: str, world: int, count: int | None = None,
             root: int = 0) -> Drawing:
    """Match every transfer and place every rank's steps on global rounds (see module doc)."""
    scheds = build(collective, algorithm, world, count, root)
    n = default_count(collective, world) if count is None else count
    sends: dict[tuple[int, int], deque] = defaultdict(deque)
    for s in scheds:
        for i, step in enumerate(s.steps):
            for a in step:
                if isinstance(a, Send):
                    sends[s.rank, a.peer].append((i, a))
    pairs = []  # (src, src_step, send, dst, dst_step, recv)
    for s in scheds:
        for j, step in enumerate(s.steps):
            for a in step:
                if isinstance(a, (Recv, RecvReduce)):
                    if not sends[a.peer, s.rank]:
                        raise ValueError(f"{s.name}: rank {s.rank} step {j} receives from rank "
                                         f"{a.peer}, which sends it nothing more")
                    i, snd = sends[a.peer, s.rank].popleft()
                    if snd.count != a.count:
                        raise ValueError(f"{s.name}: rank {a.peer} sends {snd.count} elements "
                                         f"to rank {s.rank}, which receives {a.count}")
                    pairs.append((a.peer, i, snd, s.rank, j, a))
    left = [k for k, q in sends.items() if q]
    if left:
        raise ValueError(f"{scheds[0].name}: sends never received on pairs {left}")
    partners: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for src, i, _, dst, j, _ in pairs:
        partners[src, i].append((dst, j))
        partners[dst, j].append((src, i))
    rounds = [list(range(len(s.steps))) for s in scheds]
    limit = sum(len(s.steps) for s in scheds) + 1
    changed = True
    while changed:  # monotone: each step as early as its predecessor and its partners allow
        changed = False
        for r, rr in enumerate(rounds):
            for i in range(len(rr)):
                want = max([rr[i - 1] + 1 if i else 0]
                           + [rounds[p][q] for p, q in partners[r, i]])
                if want > rr[i]:
                    if want > limit:
                        raise ValueError(f"{scheds[0].name}: the steps cannot be placed on "
                                         "rounds (a transfer cycle: the schedule would deadlock)")
                    rr[i], changed = want, True
    tl = Drawing(collective, algorithm, world, n, root if collective in ROOTED else None,
                  scheds, rounds)
    tl.transfers = sorted((Transfer(rounds[src][i], src, dst, snd, rcv)
                           for src, i, snd, dst, j, rcv in pairs),
                          key=lambda t: (t.round, t.src, t.dst))
    tl.locals = [Local(rounds[s.rank][i], s.rank, a) for s in scheds
                 for i, step in enumerate(s.steps) for a in step if not isinstance(a, COMM)]
    tl.locals.sort(key=lambda x: (x.round, x.rank))
    return tl


# ---------------------------------------------------------------- text mode

def table(tl: Drawing) -> str:
    """The schedule as a table: one line per transfer (both ends) or local action, by round."""
    root = f", root {tl.root}" if tl.root is not None else ""
    fell = "" if tl.name.startswith(tl.algorithm) else f" (runs {tl.name})"
    lines = [f"# {tl.collective} / {tl.algorithm}{fell}: world {tl.world}, count {tl.count}{root}",
             f"# {tl.summary()}",
             f"{'round':>5}  {'from':>4}  {'to':>4}  {'action':<12} {'source':<16} "
             f"{'destination':<16} {'elements':>8}"]
    rows = [(t.round, 0, t.src, t.dst, "recv+reduce" if t.reduces else "recv",
             rng(t.send.buf, t.send.start, t.send.count),
             rng(t.recv.buf, t.recv.start, t.recv.count) + (" +=" if t.reduces else ""),
             t.send.count) for t in tl.transfers]
    rows += [(x.round, 1, x.rank, x.rank, "copy" if isinstance(x.action, Copy) else "reduce",
              rng(x.action.src, x.action.src_start, x.action.count),
              rng(x.action.dst, x.action.dst_start, x.action.count)
              + (" +=" if isinstance(x.action, Reduce) else ""), x.action.count)
             for x in tl.locals]
    for rd, _, src, dst, kind, a, b, n in sorted(rows, key=lambda r: r[:4]):
        lines.append(f"{rd:>5}  {src:>4}  {dst:>4}  {kind:<12} {a:<16} {b:<16} {n:>8}")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pycoll draw", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("algorithm", nargs="?",
                   help="ring, all_reduce/ring, or a module name (ring_allreduce); "
                        "one of: " + ", ".join(all_names()))
    p.add_argument("--collective", "-c", choices=list(ALGORITHMS))
    p.add_argument("--world-size", "-n", type=int, default=4)
    p.add_argument("--count", type=int, default=None,
                   help="elements: the whole buffer (all_reduce, broadcast, reduce; default P) "
                        "or one rank's block (the others; default 1)")
    p.add_argument("--root", type=int, default=0)
    p.add_argument("-o", "--output", help="picture file, .png or .svg "
                                          "(default: COLLECTIVE-ALGORITHM-pP.png)")
    p.add_argument("--text", action="store_true", help="print the schedule as a table instead")
    p.add_argument("--all", action="store_true", help="every algorithm, for each of --worlds")
    p.add_argument("--worlds", default="4,5", help="world sizes for --all (default 4,5)")
    p.add_argument("--out", default=".", help="directory for --all pictures")
    p.add_argument("--columns", type=int, default=8, help="rounds per row of the picture")
    p.add_argument("--dpi", type=int, default=100)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.all == bool(args.algorithm):
        p.error("name one ALGORITHM, or pass --all")
    try:
        if args.all:
            worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
            jobs = [(c, a, w) for c in ALGORITHMS for a in ALGORITHMS[c] for w in worlds]
        else:
            c, a = resolve(args.algorithm, args.collective)
            jobs = [(c, a, args.world_size)]
        tls = [timeline(c, a, w, args.count, args.root if args.root < w else 0)
               for c, a, w in jobs]
    except ValueError as e:
        p.error(str(e))
    if args.text:
        print("\n\n".join(table(tl) for tl in tls))
        return 0
    try:
        from pycoll.cli import draw_plot
        draw_plot.require_matplotlib()
    except ImportError as e:
        print(f"pycoll draw: {e}", file=sys.stderr)
        return 2
    for tl in tls:
        if args.all:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            path = Path(args.out) / f"{tl.collective}-{tl.algorithm}-p{tl.world}.png"
        else:
            path = Path(args.output or f"{tl.collective}-{tl.algorithm}-p{tl.world}.png")
        draw_plot.render(tl, path, columns=args.columns, dpi=args.dpi)
        print(f"wrote {path}  ({tl.summary()})")
    return 0
