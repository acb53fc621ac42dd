"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism) for ampkit's C++ core.

The core and the ``torch.ops.ampkit`` kernels work on plain tensors and have no DTensor sharding rules. An update
of the optimizers and the grad checks of the scaler are elementwise, so each rank runs them on its local shards:
``p._local_tensor`` shares storage with the DTensor ``p`` and ``p.grad._local_tensor`` with its grad, so writes to
them are writes to the DTensors. Optimizer states are kept as DTensors of the parameter's layout (as torch.optim
keeps them: ``zeros_like`` of a DTensor is a DTensor), so that ``state_dict()`` and
``torch.distributed.checkpoint`` see the same state as with torch.optim; ``step`` stays a plain scalar tensor.

An Inf/NaN in a sharded grad is seen only by the rank that holds that shard: ``all_reduce_found_inf`` all-reduces
found_inf (MAX) over the mesh dimensions the grads are not replicated on, as torch's DTensor does for
``torch._amp_foreach_non_finite_check_and_unscale_``, so that every rank skips the step together.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional

import torch

_dtensor_type: Optional[type] = None


def _type() -> Optional[type]:
    global _dtensor_type
    if _dtensor_type is None:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # torch without distributed support: no DTensor can exist
            return None
        _dtensor_type = DTensor
    return _dtensor_type


def is_dtensor(t: object) -> bool:
    cls = _type()
    return cls is not None and isinstance(t, cls)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def any_dtensor(tensors: Iterable[object]) -> bool:
    cls = _type()
    # type() against the plain classes first: isinstance on a tensor class costs several times more per element
    return cls is not None and any(type(t) not in _PLAIN and isinstance(t, cls) for t in tensors)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the same tensor object every call, sharing the DTensor's storage); a plain
    tensor as it is."""
    return t._local_tensor if is_dtensor(t) else t


def _local_grad(p: torch.Tensor, where: str) -> Optional[torch.Tensor]:
    g = p.grad
    if g is None:
        return None
    if not is_dtensor(g):
        raise TypeError(f"{where}: a DTensor parameter of shape {tuple(p.shape)} has a grad that is not a DTensor "
                        f"({type(g).__name__})")
    if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
        raise ValueError(f"{where}: a DTensor parameter of shape {tuple(p.shape)} with placements "
                         f"{tuple(p.placements)} has a grad with placements {tuple(g.placements)} (or on another "
                         "mesh); its local shards do not line up. Redistribute the grad to the parameter's placements")
    return g._local_tensor


@contextlib.contextmanager
def local_grads(params: list, where: str = "ampkit") -> Iterator[list]:
    """``params`` with each DTensor replaced by its local shard, whose ``.grad`` is the local shard of the
    DTensor's grad for the duration of the block (the C++ core reads ``p.grad``); restored on exit."""
    if not any_dtensor(params):
        yield params
        return
    out, restore = [], []
    try:
        for p in params:
            if not is_dtensor(p):
                out.append(p)
                continue
            g = _local_grad(p, where)
            lp = p._local_tensor
            restore.append((lp, lp.grad))
            lp.grad = g
            out.append(lp)
        yield out
    finally:
        for lp, old in reversed(restore):
            lp.grad = old


def wrap_like(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state tensor made on ``p``'s local shard, as a DTensor of ``p``'s layout (no communication)."""
    from torch.distributed.tensor import DTensor
    if tuple(value.shape) != tuple(p._local_tensor.shape):
        return value
    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def local_entry(value: torch.Tensor, p: torch.Tensor, where: str) -> torch.Tensor:
    """The local shard of a state entry loaded for the DTensor parameter ``p``; a DTensor entry must have ``p``'s
    layout (else its shard would be another part of the tensor than ``p``'s)."""
    if not is_dtensor(value):
        return value
    if value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements):
        raise ValueError(f"{where}: a DTensor state with placements {tuple(value.placements)} for a parameter with "
                         f"placements {tuple(p.placements)} (or on another mesh); redistribute it to the "
                         "parameter's layout (torch.distributed.checkpoint does)")
    return value._local_tensor


def local_state(state: dict) -> dict:
    """A copy of a parameter's state with DTensor entries replaced by their local shards."""
    return {k: v._local_tensor if is_dtensor(v) else v for k, v in state.items()}


def store_state(p: torch.Tensor, state: dict, before: dict, after: dict) -> None:
    """Writes back into ``state`` what the core changed in ``after`` (a ``local_state`` copy, ``before`` as it
    was passed): new or replaced tensors are wrapped as DTensors of ``p``'s layout (``step`` stays a plain scalar,
    as torch.optim keeps it), removed entries are removed; untouched entries keep their DTensor objects."""
    for key in list(state):
        if key not in after:
            del state[key]
    for key, value in after.items():
        if key in before and before[key] is value:
            continue
        if key != "step" and is_dtensor(p) and torch.is_tensor(value) and not is_dtensor(value):
            value = wrap_like(value, p)
        state[key] = value


def _groups(grads: Iterable[torch.Tensor]) -> list:
    """The process groups of the mesh dimensions on which DTensor grads are not replicated, in order of first
    appearance (the same on every rank when the ranks hold the same parameters)."""
    from torch.distributed.tensor import Replicate
    seen, groups = set(), []
    for g in grads:
        if not is_dtensor(g):
            continue
        mesh = g.device_mesh
        for dim, placement in enumerate(g.placements):
            if isinstance(placement, Replicate):
                continue
            key = (id(mesh), dim)
            if key not in seen:
                seen.add(key)
                groups.append(mesh.get_group(dim))
    return groups


class StepParams:
    """The parameters of one scaler call (``unscale_``, ``step``), scanned for DTensors once: ``sharded`` decides
    the kind of the call, and the methods below take their plain path without looking at a tensor again."""

    def __init__(self, params: list):
        self.params = params
        self.sharded = any_dtensor(params)

    def sharded_grads(self) -> bool:
        """Whether a DTensor parameter has a grad (the grads this rank holds are shards of the norm)."""
        return self.sharded and any(p.grad is not None and is_dtensor(p) for p in self.params)

    def local_grads(self, where: str):
        """:func:`local_grads` of these parameters."""
        return local_grads(self.params, where) if self.sharded else contextlib.nullcontext(self.params)

    def all_reduce_found_inf(self, found_infs: Iterable[torch.Tensor]) -> None:
        """:func:`all_reduce_found_inf` over these parameters' grads; nothing to do for plain parameters."""
        if self.sharded:
            all_reduce_found_inf(found_infs, self.params)


def all_reduce_found_inf(found_infs: Iterable[torch.Tensor], params: Iterable[torch.Tensor]) -> None:
    """All-reduces (MAX, in place) each found_inf flag over the groups of the DTensor grads of ``params``; a no-op
    without DTensor grads."""
    groups = _groups(p.grad for p in params if p.grad is not None)
    if not groups:
        return
    import torch.distributed as dist
    flags, done = [], set()
    for t in found_infs:
        key = None if t is None else (t.device, t.data_ptr())
        if key is not None and key not in done:  # a flag listed twice is reduced once
            done.add(key)
            flags.append(t)
    for group in groups:
        for t in flags:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
