"""Every ProcessGroup attribute that the installed torch's ``distributed_c10d.py`` reads is
one pycoll has decided how to serve: a torch release that starts reading a new one (a new
group-level hook, as 2.15's Flight Recorder was) fails this test until someone decides.

Each name is served one of three ways: ``OWN``, a Python method or property of pycoll's
group (checked to be defined in pycoll, not inherited from torch's C++ class); ``OPS``, an
op method made by ``pycoll.c10d.dispatch.op`` (direct, or through torch's hooks when the
group is hooked); ``TORCH``, torch's C++ member, which works on a pycoll group because the
group registers its TorchBackend (``dispatch.attach``) or because it is plain data.
Behaviour of each on live groups: tests/ranks/test_torch_hooks.py, test_c10d_surface.py.
"""

from __future__ import annotations

import ast
import inspect

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from pycoll.c10d.backend import ProcessGroupPycoll

OWN = {"rank", "size", "name", "_device_types", "_get_backend", "get_backend", "get_group_store", "split_group",
       "abort", "shutdown", "set_timeout", "monitored_barrier", "reconfigure", "get_reconfigure_handle",
       "supports_reconfigure", "supports_window", "supports_splitting", "supports_shrinking", "supports_coalescing",
       "options", "shrink", "register_pre_hook", "register_post_hook", "_set_default_timeout",
       "eager_connect_single_device", "_set_sequence_number_for_group", "_get_sequence_number_for_group",
       "_enable_collectives_timing", "supports_tensor_alloc", "allocate_tensor"}
OPS = {"allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "all_gather_single",
       "all_gather_single_coalesced", "allgather_coalesced", "allgather_into_tensor_coalesced", "gather", "scatter",
       "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
       "reduce_scatter_tensor_coalesced", "alltoall", "all_to_all_single", "alltoall_base", "_allgather_base",
       "_reduce_scatter_base", "barrier", "send", "recv", "recv_anysource"}
# torch's own: the enum of backend types, group naming, backend registration, coalescing
# (batch_isend_irecv asks supports_coalescing first: False, so torch never starts one),
# ephemeral timeouts (ignored, as by every backend but NCCL), windows (supports_window is
# False), hooks (_has_hooks: only for plain ProcessGroups), gather_single (unsupported,
# as on gloo), and bound_device_id.
TORCH = {"BackendType", "CUSTOM", "GLOO", "MPI", "NCCL", "UCC", "UNDEFINED", "XCCL", "__module__",
         "_add_ephemeral_timeout", "_end_coalescing", "_start_coalescing", "_has_hooks", "_register_backend",
         "_set_default_backend", "_set_group_desc", "_set_group_name", "_wait_for_pending_works", "bound_device_id",
         "group_desc", "group_name", "new_window", "gather_single"}
# Left undefined on purpose: torch uses its own path when a group lacks it.
DECLINED = {"new_group"}


def _read_on_groups() -> set[str]:
    """Attribute names of torch's ProcessGroup that distributed_c10d.py reads, plus those it
    probes with hasattr/getattr on a group-like variable (``default_pg.new_group``)."""
    tree = ast.parse(inspect.getsource(c10d))
    members = set(dir(dist.ProcessGroup)) - set(dir(object))
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} & members
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in ("hasattr", "getattr") \
                and len(call.args) >= 2 and isinstance(call.args[0], ast.Name) \
                and call.args[0].id.endswith(("pg", "group")) \
                and isinstance(call.args[1], ast.Constant):
            names.add(call.args[1].value)
    return names


def test_every_group_attribute_torch_reads_is_served_by_a_decision():
    undecided = _read_on_groups() - OWN - OPS - TORCH - DECLINED
    assert not undecided, (f"torch {torch.__version__} now reads {sorted(undecided)} on process groups: decide how "
                           f"pycoll serves each (docs/c10d.md) and add it to this test")


def test_what_pycoll_serves_itself_is_defined_in_pycoll():
    for name in OWN | OPS:
        owner = next((k for k in ProcessGroupPycoll.__mro__ if name in vars(k)), None)
        assert owner is not None and owner.__module__.startswith("pycoll."), (name, owner)


def test_new_group_is_left_to_torch():
    """torch >= 2.15 hands new_group to a default group that has one, and then attaches no
    Flight Recorder, NaN check or health check to the subgroup: pycoll has none, so its
    subgroups are made by torch's own helper, with all of them."""
    assert not hasattr(ProcessGroupPycoll, "new_group")
