"""The ``torch.backends`` entry point: every process that imports torch knows ``pycoll`` by
name, without importing pycoll itself (Ray Train's workers, spawned children), and
``import pycoll`` is cheap and side-effect free for it. Fresh interpreters, real groups."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.timeout(120)

BY_NAME = """
import os, sys, torch, torch.distributed as dist
from datetime import timedelta
assert "pycoll" in dist.Backend.backend_list, dist.Backend.backend_list
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
dist.init_process_group("pycoll", rank=rank, world_size=world, store=store)
t = torch.full((5,), float(rank + 1))
dist.all_reduce(t)
print("sum", t.tolist(), type(dist.distributed_c10d._get_default_group()).__name__, flush=True)
dist.destroy_process_group()
"""


def _python(code: str, *args: str, env: dict | None = None, timeout: float = 90) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_a_process_that_never_imports_pycoll_asks_for_it_by_name():
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    procs = [subprocess.Popen([sys.executable, "-c", BY_NAME, str(r), "2", str(store.port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "sum [3.0, 3.0, 3.0, 3.0, 3.0]" in out, out


def test_torch_device_backend_autoload_0_is_respected():
    out = _python("import sys, torch, torch.distributed as dist; "
                  "print('pycoll' in sys.modules, 'pycoll' in dist.Backend.backend_list)",
                  env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert out.split() == ["False", "False"], out


def test_import_is_cheap_and_starts_nothing():
    """What ``import torch`` now does in every process: pycoll registers the name and loads
    none of its data path, starts no thread, opens no socket or file."""
    out = _python("""
import os, sys, threading
before_fds = set(os.listdir("/proc/self/fd"))
import torch, torch.distributed as dist
import pycoll
loaded = sorted(m for m in sys.modules if m.startswith("pycoll"))
print(threading.active_count(), len(set(os.listdir("/proc/self/fd")) - before_fds))
print(" ".join(loaded))
print(pycoll.empty_shared.__module__, pycoll.ProcessGroupPycoll.__name__)   # lazy names resolve
from pycoll import stats, PartialAllReduce
""")
    threads_fds, loaded, lazy = out.strip().splitlines()[-3:]
    assert threads_fds.split()[0] == "1", out
    for heavy in ("pycoll.core.communicator", "pycoll.c10d.backend", "pycoll.transport.tcp.transport",
                  "pycoll.shm.arena", "pycoll.observe.trace"):
        assert heavy not in loaded.split(), loaded
    assert lazy == "pycoll.shm.shared ProcessGroupPycoll", out


def test_an_unknown_public_name_is_an_attribute_error():
    import pycoll

    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        getattr(pycoll, "nonexistent")
