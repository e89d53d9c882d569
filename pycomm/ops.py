"""``torch.ops.pycomm.all_reduce_``: a synchronous all_reduce as one torch operator.

``dist.all_reduce`` goes through torch.distributed's Python wrapper, a ProcessGroup
operator and a ``Work``; for a small synchronous CPU tensor that machinery costs more
than the communication. The operator (defined in csrc/torch/bindings/custom_ops.cc, as
DeepSpeed and vLLM define their inference all-reduces) skips all of it, and having a fake
kernel it can sit inside a ``torch.compile`` graph::

    torch.ops.pycomm.all_reduce_(tensor, "sum", group.group_name)   # or:
    pycomm.all_reduce_(tensor, group=group)

On a group whose backend is not pycomm's it calls that backend's allreduce, so code
written against it stays correct under gloo or an islands group.

``pycomm.all_reduce_`` in eager mode skips the dispatcher too: it calls the operator's
kernel by one pybind call (``pycomm._C.all_reduce_eager``, ~1 us less per call than
through torch.ops); while torch.compile traces, it emits the operator.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from pycomm._extension import load as _extension

_fakes_registered = False


def load() -> None:
    """Load the extension (which defines the operator) and register its fake kernel."""
    global _fakes_registered
    if _fakes_registered:
        return
    _extension()
    torch.library.register_fake("pycomm::all_reduce_")(_all_reduce_fake)
    _fakes_registered = True


def _all_reduce_fake(tensor: torch.Tensor, op: str, group_name: str) -> None:
    """What torch.compile traces: the operator mutates ``tensor`` and returns nothing."""
    return None


def all_reduce_(
    tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` (default: the world) and return it.

    ``op`` is "sum", "avg", "prod", "min" or "max". Synchronous: when it returns,
    ``tensor`` holds the result on every rank. On a rank that is not a member of
    ``group`` it does nothing and warns, as ``dist.all_reduce`` does.
    """
    # The common call (eager, an explicit group) in as few Python steps as possible: at
    # 1 KB this function's own cost is a fifth of the whole all_reduce. Everything else
    # takes the checked path below, which does the same with every check spelled out.
    # Tracers hand in tensor subclasses (FakeTensor, FunctionalTensor, proxies), so an
    # exact torch.Tensor with dynamo not tracing is an eager call.
    eager = _eager
    if (eager is not None and type(group) is _ProcessGroup and type(tensor) is _Tensor
            and not _is_dynamo_compiling()):
        eager(tensor, op, group)
        return tensor
    return _all_reduce_checked(tensor, op, group)


def _all_reduce_checked(
    tensor: torch.Tensor, op: str, group: dist.ProcessGroup | None
) -> torch.Tensor:
    if group is _NON_GROUP_MEMBER:
        warnings.warn("pycomm.all_reduce_: this rank is not a member of the group (as "
                      "dist.all_reduce, it does nothing here)", stacklevel=3)
        return tensor
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"pycomm.all_reduce_: group must be a torch.distributed "
                        f"ProcessGroup or None, got {type(group).__name__}")
    if _is_compiling():
        load()
        torch.ops.pycomm.all_reduce_.default(tensor, op, group_name(group))
        return tensor
    eager = _eager or _load_eager()
    eager(tensor, op, group if group is not None else _world("pycomm.all_reduce_"))
    return tensor


# Bound once: each attribute lookup on the hot path costs tens of ns. Dynamo recognises
# these functions by their objects, so the aliases still read True while it traces.
_ProcessGroup = dist.ProcessGroup
_Tensor = torch.Tensor
_NON_GROUP_MEMBER = dist.GroupMember.NON_GROUP_MEMBER
_is_compiling = torch.compiler.is_compiling
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling


# pycomm._C.all_reduce_eager once loaded: the operator's kernel by one pybind call (the
# operator through torch.ops costs ~1 us more per call from eager Python).
_eager: Callable | None = None


def _load_eager() -> Callable:
    global _eager
    load()
    _eager = _extension().all_reduce_eager
    return _eager


def _world(who: str) -> dist.ProcessGroup:
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError(f"{who}: no default process group "
                           "(call torch.distributed.init_process_group first)")
    return group


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name torch.ops.pycomm.* resolve a group by (None: the default group)."""
    return (group if group is not None else _world("pycomm.all_reduce_")).group_name
