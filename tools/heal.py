"""Healing a job in-process with torch's reconfigure API (torch >= 2.14): hot spares, shrink,
grow; pycoll and gloo on the same driver.

    python tools/heal.py                              # both backends, both scenarios
    python tools/heal.py --backend pycoll --scenario spare --runs 3
    python tools/heal.py --scenario shrink-grow --hidden 5000 --batch 4   # a 25M-parameter model

Four ranks train an MLP with data-parallel SGD (momentum), each rank on its own data slot;
two hot spares start with the job (torch imported, a group made with
``enable_reconfigure=True``, waiting on the Store, holding no rank). At step ``--kill-step``
slot ``--victim`` SIGKILLs itself between its backward and its all_reduce. Then:

- ``spare``: the survivors see the all_reduce fail, find who died (its process is gone),
  hand the dead slot to a spare and reconfigure with it in the dead rank's place; rank 0
  broadcasts the model, the momentum and the step; the step is redone at full strength. The
  final model is compared with a run of the same data order with no kill (``none``).
- ``shrink-grow``: the survivors reconfigure without the dead rank and redo the step with
  three; then a spare joins (grow) and receives the state by broadcast, timed from the
  survivors' call to the first correct four-rank all_reduce after it.

Times are CLOCK_MONOTONIC (host-wide): kill -> every survivor has an error, kill -> first
shrunk step, kill -> full strength (reconfigured, state received) and -> first full-strength
step, grow -> first four-rank all_reduce. Figures: docs/faults.md, "Healing with hot spares".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD, SPARES, FEATURES, LR, MOMENTUM = 4, 2, 20, 0.05, 0.9


# -- one process of the job ------------------------------------------------------------------
def _model(hidden: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 2))


def _batch(slot: int, step: int, batch: int):
    import torch

    g = torch.Generator().manual_seed(1000 * slot + step)
    x = torch.randn(batch, FEATURES, generator=g)
    y = (x.sum(1) > 0).long()
    return x, y


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class Job:
    """One process's view: its store, its slot, the members of the configuration by slot."""

    def __init__(self, a) -> None:
        import torch
        import torch.distributed as dist

        if a.backend == "pycoll":
            import pycoll  # noqa: F401 - registers the backend
        torch.set_num_threads(1)
        self.a, self.dist, self.torch = a, dist, torch
        server = dist.TCPStore("127.0.0.1", a.port, is_master=False, timeout=timedelta(seconds=120))
        self.store = dist.PrefixStore("job", server)
        self.store.set(f"pid/{a.proc}", str(os.getpid()))
        dist.init_process_group(a.backend, store=self.store, rank=a.proc, world_size=WORLD + SPARES,
                                timeout=timedelta(seconds=a.timeout), enable_reconfigure=True)
        self.gen, self.members, self.spares_used = 0, list(range(WORLD)), 0
        self.module = _model(a.hidden)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=MOMENTUM)
        self.times: dict = {}

    def reconfigure(self, members: list[int]) -> None:
        """Every member: publish this process's handle, reconfigure with all in slot order."""
        self.gen += 1
        self.members = members
        key = f"gen{self.gen}/h"
        self.store.set(f"{key}/{self.a.proc}", self.dist._get_reconfigure_handle())
        handles = [self.store.get(f"{key}/{p}").decode() for p in members]
        self.dist._reconfigure(self.gen, handles)

    def state(self, step: int) -> int:
        """Rank 0's model, momentum and step, to every member (a joiner's state)."""
        torch = self.torch
        flat = [p.data for p in self.module.parameters()]
        for p in self.module.parameters():
            buf = self.opt.state[p].get("momentum_buffer")
            if buf is None:
                self.opt.state[p]["momentum_buffer"] = buf = torch.zeros_like(p)
            flat.append(buf)
        blob = torch.cat([t.flatten() for t in flat] + [torch.tensor([float(step)])])
        self.dist.broadcast(blob, 0)
        offset = 0
        for t in flat:
            t.copy_(blob[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        return int(blob[-1].item())

    def heal(self, spare: bool) -> None:
        """After an error: the dead members' slots to spares (or dropped), then reconfigure."""
        pids = {p: int(self.store.get(f"pid/{p}")) for p in self.members}
        dead = [p for p in self.members if not _alive(pids[p])]
        members = []
        for p in self.members:
            if p not in dead:
                members.append(p)
            elif spare:
                members.append(WORLD + self.spares_used)
                self.spares_used += 1
        if [p for p in self.members if p not in dead][0] == self.a.proc:
            self._assign(members)              # the first survivor tells the spare
        self.reconfigure(members)

    def _assign(self, members: list[int]) -> None:
        for p in members:
            if p >= WORLD and p not in self.members:
                self.store.set(f"spare/{p}", json.dumps({"gen": self.gen + 1, "members": members,
                                                         "used": self.spares_used}))

    def grow(self) -> None:
        members = self.members + [WORLD + self.spares_used]
        self.spares_used += 1
        if self.dist.get_rank() == 0:
            self._assign(members)
        self.reconfigure(members)

    def wait_as_spare(self) -> int | None:
        """Stand by until handed a slot (then join and take the state) or the job ends."""
        key = f"spare/{self.a.proc}"
        self.store.wait([key], timedelta(seconds=600))
        info = json.loads(self.store.get(key))
        if info.get("done"):
            return None
        self.gen, self.spares_used = info["gen"] - 1, info["used"]
        self.reconfigure(info["members"])
        return self.joined(0)

    def joined(self, step: int) -> int:
        """A member joined: the state from rank 0, then a four-rank all_reduce that checks it."""
        step = self.state(step)
        check = self.torch.ones(1)
        self.dist.all_reduce(check)
        self.times["check_sum"] = check.item()
        return step

    def train(self) -> None:
        torch, dist, a = self.torch, self.dist, self.a
        from torch import nn

        if a.proc >= WORLD:
            step = self.wait_as_spare()
            if step is None:
                return self.dist.destroy_process_group()   # (a spare never called: no result)
            if a.scenario == "spare":
                self.times["full_strength_at"] = time.monotonic()
        else:
            self.reconfigure(self.members)
            step = 0
        params = list(self.module.parameters())
        shrunk = False
        while step < a.steps:
            slot = self.members.index(a.proc)
            x, y = _batch(slot, step, a.batch)
            self.opt.zero_grad()
            nn.functional.cross_entropy(self.module(x), y).backward()
            if a.scenario != "none" and step == a.kill_step and slot == a.victim and self.gen == 1:
                self.store.set("killed_at", repr(time.monotonic()))
                os.kill(os.getpid(), signal.SIGKILL)
            flat = torch.cat([p.grad.flatten() for p in params])
            try:
                dist.all_reduce(flat)
            except Exception:  # noqa: BLE001 - a member died: heal, then redo the step
                self.times["error_at"] = time.monotonic()
                self.heal(spare=a.scenario == "spare")
                if a.scenario == "spare":
                    self.joined(step)
                    self.times["full_strength_at"] = time.monotonic()
                else:
                    shrunk = True
                continue
            flat /= dist.get_world_size()
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            self.opt.step()
            step += 1
            if "error_at" in self.times and "first_step_at" not in self.times:
                self.times["first_step_at"] = time.monotonic()
            if "full_strength_at" in self.times and "first_full_step_at" not in self.times:
                self.times["first_full_step_at"] = time.monotonic()
            if shrunk and dist.get_world_size() == WORLD - 1:
                shrunk = False
                t0 = time.monotonic()
                self.grow()
                self.joined(step)
                self.times["grow_s"] = time.monotonic() - t0
        if dist.get_rank() == 0:                       # the spares still standing by go home
            for p in range(WORLD, WORLD + SPARES):
                if p not in self.members:
                    self.store.set(f"spare/{p}", json.dumps({"done": True}))
        result = {"times": self.times, "rank": dist.get_rank(),
                  "killed_at": float(self.store.get("killed_at")) if self.store.check(["killed_at"]) else None,
                  "params": torch.cat([p.detach().flatten() for p in params]).tolist() if dist.get_rank() == 0 and
                  a.hidden <= 256 else None}
        dist.destroy_process_group()
        return result


def _process(proc: int, count: int, port: int, opts: dict, scenario: str) -> dict | None:
    """Process ``proc`` of the job (``pycoll.testing.spawn`` runs it): its result, or None
    for a spare that was never called."""
    return Job(argparse.Namespace(**opts, port=port, proc=proc, scenario=scenario)).train()


# -- the launcher ------------------------------------------------------------------------------
def run_job(a, scenario: str) -> dict:
    """One job: WORLD ranks and SPARES spares around a Store of this process's (it outlives
    the victim), started by ``pycoll.testing.spawn``; the victim may die."""
    from pycoll.testing import spawn

    opts = {k: getattr(a, k) for k in ("backend", "steps", "kill_step", "victim", "hidden", "batch", "timeout")}
    values = spawn.run(_process, WORLD + SPARES, opts, scenario, timeout=a.job_timeout,
                       env={"OMP_NUM_THREADS": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
                       may_die={a.victim} if scenario != "none" else set())
    results = {p: r for p, r in enumerate(values) if r is not None}
    killed = next((r["killed_at"] for r in results.values() if r["killed_at"] is not None), None)
    return {"killed_at": killed, "results": results}


def summarize(job: dict) -> dict:
    killed, res = job["killed_at"], job["results"]
    out = {}

    def since(key):
        return [r["times"][key] - killed for r in res.values() if key in r["times"]]

    if killed is not None:
        out["know_ms"] = [round(t * 1000) for t in since("error_at")]
        for key, name in (("first_step_at", "first_step_ms"), ("full_strength_at", "full_strength_ms"),
                          ("first_full_step_at", "first_full_step_ms")):
            if since(key):
                out[name] = round(max(since(key)) * 1000)
    grows = [r["times"]["grow_s"] for r in res.values() if "grow_s" in r["times"]]
    if grows:
        out["grow_ms"] = round(max(grows) * 1000)
    checks = [r["times"]["check_sum"] for r in res.values() if "check_sum" in r["times"]]
    if checks:
        out["joined_sum_ok"] = all(c == WORLD for c in checks)
    params = [r["params"] for r in res.values() if r.get("params") is not None]
    out["params"] = params[0] if params else None
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["pycoll", "gloo", "both"], default="both")
    ap.add_argument("--scenario", choices=["spare", "shrink-grow", "both", "none"], default="both")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-step", type=int, default=5)
    ap.add_argument("--victim", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64, help="MLP width (5000: 25M parameters)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=2.0, help="the groups' timeout, seconds")
    ap.add_argument("--job-timeout", type=float, default=300)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import torch

    sys.path.insert(0, ROOT)   # (the spawned processes inherit it)
    from pycoll import torch_compat

    if not torch_compat.reconfigure_supported():
        raise SystemExit(f"tools/heal.py needs torch >= 2.14 (the reconfigure API); this is {torch.__version__}")
    backends = ["pycoll", "gloo"] if a.backend == "both" else [a.backend]
    scenarios = ["spare", "shrink-grow"] if a.scenario == "both" else [a.scenario]
    report = []
    for run in range(a.runs):
        for scenario in scenarios:
            for backend in backends:                   # interleaved, run by run
                a.backend = backend
                s = summarize(run_job(a, scenario))
                if scenario == "spare":
                    ref = summarize(run_job(a, "none"))
                    if s["params"] and ref["params"]:
                        s["max_diff_vs_uninterrupted"] = max(abs(x - y) for x, y in zip(s["params"], ref["params"]))
                s.pop("params", None)
                report.append({"run": run, "scenario": scenario, "backend": backend, **s})
                if not a.json:
                    print(json.dumps(report[-1]), flush=True)
    if a.json:
        print(json.dumps(report, indent=1))
        return
    for scenario in scenarios:
        for backend in backends:
            rows = [r for r in report if r["scenario"] == scenario and r["backend"] == backend]
            keys = sorted({k for r in rows for k in r if k.endswith("_ms") and k != "know_ms"})
            med = {k: statistics.median(r[k] for r in rows if k in r) for k in keys}
            know = [max(r["know_ms"]) for r in rows if r.get("know_ms")]
            print(f"{scenario:>11} {backend:>6}: kill -> every survivor knows (median of max) "
                  f"{statistics.median(know) if know else float('nan'):.0f} ms; "
                  + "; ".join(f"{k} {v:.0f}" for k, v in med.items()))


if __name__ == "__main__":
    main()
