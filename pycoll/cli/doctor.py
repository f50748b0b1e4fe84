"""``python -m pycoll doctor``: what this machine offers pycoll, and which paths it will take.

    python -m pycoll doctor          # a compact table
    python -m pycoll doctor --json   # the same facts, machine-readable

Every check is a real attempt where one is cheap (share a memfd with a child as the arena
does, read a child's memory with process_vm_readv, a loopback TCP round trip), never a guess
from version numbers. Nothing is left behind: the memfd is closed, the child is reaped. Exit status 0
unless the machine cannot run pycoll at all (no loopback TCP).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import importlib.util
import json
import os
import platform
import secrets
import shutil
import socket
import subprocess
import sys
import time

OK, NO, INFO = "ok", "no", "info"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_shm() -> tuple[str, str, dict]:
    """The arena's real path: a memfd that a child process opens through /proc/<pid>/fd."""
    if not hasattr(os, "memfd_create") or not hasattr(os, "fork"):
        return NO, "no memfd_create: use PYCOLL_TRANSPORT=tcp on this machine", {}
    facts: dict = {}
    try:
        fd = os.memfd_create("pycoll-doctor", os.MFD_CLOEXEC)
    except OSError as e:
        return NO, f"memfd_create failed: {e}", facts
    try:
        os.ftruncate(fd, 1 << 20)
        path = f"/proc/{os.getpid()}/fd/{fd}"
        pid = os.fork()
        if pid == 0:   # a sibling rank's view: open the creator's descriptor by path
            try:
                os.close(os.open(path, os.O_RDWR))
                os._exit(0)
            except BaseException:  # noqa: BLE001 - the exit status is the answer
                os._exit(1)
        _, status = os.waitpid(pid, 0)
    except OSError as e:
        return NO, f"cannot size or share a memfd: {e}", facts
    finally:
        os.close(fd)
    facts["child_opened"] = os.waitstatus_to_exitcode(status) == 0
    if not facts["child_opened"]:
        return NO, f"a child process cannot open {path} (ptrace rules?): use PYCOLL_TRANSPORT=tcp", facts
    return OK, "memfd shared through /proc/<pid>/fd (nothing named in /dev/shm)", facts


def check_cma() -> tuple[str, str, dict]:
    """process_vm_readv on a forked child: the single-copy path for large messages."""
    try:
        scope = open("/proc/sys/kernel/yama/ptrace_scope").read().strip()
    except OSError:
        scope = None
    facts = {"ptrace_scope": scope}
    meaning = {None: "no Yama", "0": "any same-user process", "1": "descendants only "
               "(sibling ranks need prctl(PR_SET_PTRACER))", "2": "admin only", "3": "disabled"}
    if not hasattr(os, "fork") or sys.platform != "linux":
        return NO, "Linux only", facts

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    libc = ctypes.CDLL(None, use_errno=True)
    pattern = secrets.token_bytes(64)
    src = ctypes.create_string_buffer(pattern, 64)  # same address in the child after fork
    dst = ctypes.create_string_buffer(64)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: wait until the parent has read, then leave at once
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        local = IoVec(ctypes.addressof(dst), 64)
        remote = IoVec(ctypes.addressof(src), 64)
        libc.process_vm_readv.restype = ctypes.c_ssize_t
        n = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        err = ctypes.get_errno()
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)
    where = f"ptrace_scope {scope} ({meaning.get(scope, '?')})"
    if n == 64 and dst.raw == pattern:
        return OK, f"process_vm_readv works on a child; {where}", facts
    return NO, f"process_vm_readv failed ({os.strerror(err)}); {where}", facts


def check_tcp() -> tuple[str, str, dict]:
    try:
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(1)
            with socket.create_connection(srv.getsockname(), timeout=5) as c:
                peer, _ = srv.accept()
                with peer:
                    t0 = time.perf_counter()
                    for _ in range(100):
                        c.sendall(b"x")
                        peer.recv(1)
                        peer.sendall(b"y")
                        c.recv(1)
                    rtt = (time.perf_counter() - t0) / 100 * 1e6
    except OSError as e:
        return NO, f"loopback TCP fails: {e}", {}
    return OK, f"127.0.0.1 reachable, 1-byte round trip {rtt:.0f} us", {"rtt_us": round(rtt, 1)}


def check_netns() -> tuple[str, str, dict]:
    ip, root = shutil.which("ip"), hasattr(os, "geteuid") and os.geteuid() == 0
    facts = {"root": root, "ip": ip}
    if not ip:
        return NO, "no `ip` (apt-get install iproute2)", facts
    if not root:
        return NO, "needs root", facts
    try:
        p = subprocess.run([ip, "netns", "list"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return NO, f"`ip netns list` failed: {e}", facts
    if p.returncode:
        return NO, f"`ip netns list`: {p.stderr.strip()[:80]}", facts
    return OK, "root + iproute2: `ip netns` usable (multi-host tests on one machine)", facts


def check_mpi() -> tuple[str, str, dict]:
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    facts = {"mpirun": mpirun, "mpi4py": _version("mpi4py")}
    flavour = ""
    if mpirun:
        try:
            out = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                                 timeout=10)
            flavour = (out.stdout + out.stderr).strip().splitlines()[0][:60]
        except (OSError, subprocess.TimeoutExpired, IndexError):
            flavour = "?"
    facts["version"] = flavour
    ok = bool(mpirun and facts["mpi4py"])
    what = (f"{flavour or 'no mpirun'}; mpi4py {facts['mpi4py'] or 'missing'}"
            + ("" if ok else " -> bench has no MPI column"))
    return (OK if ok else NO), what, facts


def gather() -> list[dict]:
    rows = []

    def add(name: str, status: str, detail: str, **facts) -> None:
        rows.append({"check": name, "status": status, "detail": detail, **facts})

    add("python", INFO, f"{platform.python_version()} ({sys.executable})",
        version=platform.python_version())
    aff = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    add("cpus", INFO, f"{os.cpu_count()} logical, {aff} usable by this process",
        count=os.cpu_count(), usable=aff)
    for name, fn in (("shared memory", check_shm), ("cross-memory attach", check_cma),
                     ("loopback tcp", check_tcp)):
        status, detail, facts = fn()  # before torch: fork with fewer threads around
        add(name, status, detail, **facts)
    import torch
    add("torch", INFO, torch.__version__, version=torch.__version__)
    cuda = torch.cuda.is_available()
    n = torch.cuda.device_count() if cuda else 0
    add("cuda", OK if cuda else NO,
        f"{n} device(s): {torch.cuda.get_device_name(0)}" if cuda else "torch.cuda unavailable",
        available=cuda, devices=n)
    cupy = next((v for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy") if (v := _version(d))),
                None) or ("?" if importlib.util.find_spec("cupy") else None)
    nccl = False
    if cupy:
        from pycoll.cuda.facts import nccl_importable
        nccl = nccl_importable()
    add("cupy", OK if cupy else NO, (f"cupy {cupy}; cupy.cuda.nccl {'importable' if nccl else 'NOT importable'}"
                                     if cupy else "not installed (pip install 'pycoll[cuda]')"),
        version=cupy or None, nccl=nccl)
    for name, fn in (("ip netns", check_netns), ("mpi", check_mpi)):
        status, detail, facts = fn()
        add(name, status, detail, **facts)
    mpl = _version("matplotlib")
    add("matplotlib", OK if mpl else NO, f"matplotlib {mpl}" if mpl else
        "not installed (pip install 'pycoll[plot]'): draw --text and bench without --plot",
        version=mpl)
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("PYCOLL_")}
    add("PYCOLL_* settings", INFO, ", ".join(f"{k}={v}" for k, v in env.items()) or
        "none set (defaults)", env=env)
    add("paths", INFO, _paths(rows, env), transport=env.get("PYCOLL_TRANSPORT", "auto"))
    return rows


def _paths(rows: list[dict], env: dict) -> str:
    st = {r["check"]: r["status"] for r in rows}
    mode = env.get("PYCOLL_TRANSPORT", "auto")
    one_host = ("shared memory (memfd + futex)" if st["shared memory"] == OK
                else "TCP (no usable shared memory)")
    if mode == "tcp":
        one_host = "TCP (PYCOLL_TRANSPORT=tcp)"
    cuda = next(r for r in rows if r["check"] == "cuda")
    nccl = next(r for r in rows if r["check"] == "cupy").get("nccl", False)
    gpu = ("none (no CUDA here)" if st["cuda"] != OK else
           _cuda_paths(cuda["devices"], nccl, env.get("PYCOLL_CUDA_PATH", "auto")))
    return (f"transport {mode}: ranks on one host -> {one_host}; several hosts -> "
            f"hierarchical/TCP; CUDA tensors -> {gpu}")


def _cuda_paths(n_gpus: int, nccl: bool, requested: str) -> str:
    """The CUDA path (pycoll/cuda/paths.py) for one rank per GPU and for two ranks on GPU 0."""
    from pycoll.cuda.paths import CudaPathError, RankFacts, choose_path

    gpus = tuple(f"gpu{i}" for i in range(max(n_gpus, 1)))

    def pick(assignment) -> str:
        try:
            return choose_path([RankFacts("here", gpus[g], gpus, nccl, nccl, requested) for g in assignment])
        except (CudaPathError, ValueError) as e:
            return f"error: {e}"
    return (f"PYCOLL_CUDA_PATH={requested}: one rank per GPU ({len(gpus)}) -> {pick(range(len(gpus)))}; "
            f"2 ranks sharing GPU 0 -> {pick([0, 0])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pycoll doctor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the facts as JSON")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    rows = gather()
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        width = max(len(r["check"]) for r in rows)
        for r in rows:
            mark = {"ok": "ok ", "no": "-- ", "info": "   "}[r["status"]]
            print(f"{r['check']:<{width}}  {mark} {r['detail']}")
    tcp = next(r for r in rows if r["check"] == "loopback tcp")
    return 0 if tcp["status"] == OK else 1
