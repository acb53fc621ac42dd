"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism) for ampkit's C++ core.

The core and the ``torch.ops.ampkit`` kernels work on plain tensors and have no DTensor sharding rules. An update
of the optimizers and the grad checks of the scaler are elementwise, so each rank runs them on its local shards:
``p._local_tensor`` shares storage with the DTensor ``p`` and ``p.grad._local_tensor`` with its grad, so writes to
them are writes to the DTensors. Optimizer states are kept as DTensors of the parameter's layout (as torch.optim
keeps them: ``zeros_like`` of a DTensor is a DTensor), so that ``state_dict()`` and
``torch.distributed.checkpoint`` see the same state as with torch.optim; ``step`` stays a plain scalar tensor, and
so does ``sr_seed``, the seed of ``master_weights="stochastic"``, the same on every rank (NOTE [Stochastic rounding
of DTensor parameters] below). An 8-bit state is packed per local shard instead (NOTE [8-bit states of DTensor
parameters] below).

An Inf/NaN in a sharded grad is seen only by the rank that holds that shard: ``all_reduce_found_inf`` all-reduces
found_inf (MAX) over the mesh dimensions the grads are not replicated on, as torch's DTensor does for
``torch._amp_foreach_non_finite_check_and_unscale_``, so that every rank skips the step together; a group whose
ranks hold the same flag already (flags recorded by ``ampkit.distributed.compress_fsdp``, which travel with the
reduced grads: NOTE [Compressed FSDP reduction]) is left out.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Container, Iterable, Iterator, Optional

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
            # A grad of another dtype (FP32 grads of a BF16 parameter, grad_dtype) needs the shard to accept it.
            grad_dtype = lp.grad_dtype if g is not None and g.dtype != lp.dtype else False
            restore.append((lp, lp.grad, grad_dtype))
            if grad_dtype is not False:
                lp.grad_dtype = None
            lp.grad = g
            out.append(lp)
        yield out
    finally:
        for lp, old, grad_dtype in reversed(restore):
            lp.grad = old
            if grad_dtype is not False:
                lp.grad_dtype = grad_dtype


# NOTE [8-bit states of DTensor parameters]
# An 8-bit moment (NOTE [8-bit block-wise states] in kernels/blockwise8.h) is one packed uint8 tensor: the codes of
# its blocks of 256 elements, then their FP32 absmaxes. It cannot be sharded like its parameter, so each rank keeps
# the packed state of its local shard: the blocks are laid out per local shard, block 0 starting at the shard's
# first element. Whether a moment is 8-bit is decided by the whole parameter (4096 elements or more, as without
# sharding), so that every rank holds the same kind of state for it; a rank whose shard is small gets a packed state
# all the same (an empty shard an empty one).
# For state_dict() and torch.distributed.checkpoint the packed states of one parameter form a DTensor of shape
# (s_1, ..., s_k, B) on the parameter's mesh: one row per shard, s_i the size of the i-th mesh dimension the
# parameter is sharded on (placement Shard(i - 1) there, Replicate where the parameter is replicated), B the bytes
# of the packed state of the largest local shard; a rank's row is its packed state, then zero padding. DCP saves
# each rank's row and loads it back into the same rank under the same sharding, bit for bit. A checkpoint of
# another number of shards has another shape: DCP refuses it (its "Size mismatch between saved ... and current"
# names the state and both shapes) and load_state_dict refuses it too (naming the optimizer, the state and both
# shapes), never reading one rank's blocks as another's. A DTensor state of the same shape from another layout of
# the same number of shards (a parameter sharded on another dimension) cannot be told apart: resume on the
# sharding the checkpoint was saved from.
# For a parameter sharded on dim 0 (FSDP2), where every local shard's numel is a multiple of 256 the blocks are
# those of the unsharded parameter and a sharded step is bit-identical to an unsharded one; otherwise the blocks
# that straddle a shard boundary are cut in two, each part quantized with its own absmax, and the steps differ by
# that quantization.
_QUANT_BLOCK = 256  # kQuantBlock, kernels/blockwise8.h
_BLOCK_BYTES = _QUANT_BLOCK + 4  # a block's codes and its FP32 absmax
BLOCKWISE8_MIN_NUMEL = 4096  # kBlockwise8MinNumel, csrc/include/ampkit/ops.h
_MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def blockwise8_bytes(numel: int) -> int:
    """The bytes of the packed 8-bit state of ``numel`` elements (``ampkit::blockwise8_state_bytes``)."""
    return -(-numel // _QUANT_BLOCK) * _BLOCK_BYTES


def is_packed(key: str, value: object) -> bool:
    """Whether state entry ``key`` holds an 8-bit state (a moment kept as uint8)."""
    return key in _MOMENTS and torch.is_tensor(value) and value.dtype == torch.uint8


def _packed_layout(p: torch.Tensor, where: str = "ampkit") -> tuple:
    """The global shape and placements of the packed states of the DTensor parameter ``p``; a shard larger than the
    first (a placement that does not chunk as torch.chunk) raises NotImplementedError."""
    from torch.distributed.tensor import Replicate, Shard
    mesh = p.device_mesh
    sizes = list(p.shape)
    rows, placements = [], []
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            placements.append(Replicate())
            continue
        if isinstance(placement, Shard):  # chunked as torch.chunk: the first shard is the largest
            d = placement.dim % max(len(sizes), 1)
            sizes[d] = -(-sizes[d] // mesh.size(dim))
        placements.append(Shard(len(rows)))
        rows.append(mesh.size(dim))
    largest = 1
    for s in sizes:
        largest *= s
    if p._local_tensor.numel() > largest:
        raise NotImplementedError(
            f"{where}: 8-bit states of a DTensor parameter of shape {tuple(p.shape)} with placements "
            f"{tuple(p.placements)}, whose local shard of {p._local_tensor.numel()} elements is larger than the "
            f"first shard ({largest}); use torch.bfloat16 states for this sharding")
    return tuple(rows) + (blockwise8_bytes(largest),), tuple(placements)


def wrap_packed(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The packed state ``value`` of ``p``'s local shard as this rank's row of the DTensor of NOTE [8-bit states of
    DTensor parameters] (no communication). A row made by :func:`packed_zeros` is used as it is, without a copy."""
    from torch.distributed.tensor import DTensor
    shape, placements = _packed_layout(p)
    local_shape = (1,) * (len(shape) - 1) + shape[-1:]
    row = value._base
    if not (row is not None and tuple(row.shape) == local_shape and row.data_ptr() == value.data_ptr()
            and row.is_contiguous()):
        row = torch.zeros(local_shape, dtype=torch.uint8, device=value.device)
        row.view(-1)[:value.numel()].copy_(value)
    stride = tuple(torch.empty(shape, device="meta").stride())
    return DTensor.from_local(row, p.device_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def packed_zeros(p: torch.Tensor, where: str) -> torch.Tensor:
    """A new packed state of zeros for ``p``'s local shard: a view of its zero-padded row (:func:`wrap_packed`)."""
    shape, _ = _packed_layout(p, where)
    row = torch.zeros((1,) * (len(shape) - 1) + shape[-1:], dtype=torch.uint8, device=p._local_tensor.device)
    return row.view(-1)[:blockwise8_bytes(p._local_tensor.numel())]


def packed_local(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The packed state of ``p``'s local shard held by the packed DTensor ``value``: a view of this rank's row (the
    fused step updates it in place)."""
    return value._local_tensor.reshape(-1)[:blockwise8_bytes(p._local_tensor.numel())]


# The state entries that stay plain tensors for DTensor parameters, the same on every rank: the step count (as
# torch.optim keeps it) and the seed of stochastic rounding (NOTE [Stochastic rounding of DTensor parameters]).
PLAIN_ENTRIES = ("step", "sr_seed")


def wrap_state(key: str, value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state entry made on ``p``'s local shard, as a DTensor: a packed 8-bit state by :func:`wrap_packed`,
    another by :func:`wrap_like`; an entry of ``PLAIN_ENTRIES`` as it is."""
    if key in PLAIN_ENTRIES:
        return value
    return wrap_packed(value, p) if is_packed(key, value) else wrap_like(value, p)


def wrap_like(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state tensor made on ``p``'s local shard, as a DTensor of ``p``'s layout (no communication)."""
    from torch.distributed.tensor import DTensor
    if tuple(value.shape) != tuple(p._local_tensor.shape):
        return value
    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def local_entry(key: str, value: torch.Tensor, p: torch.Tensor, where: str) -> torch.Tensor:
    """The local shard of state entry ``key`` loaded for the DTensor parameter ``p``; a DTensor entry must have
    ``p``'s layout (else its shard would be another part of the tensor than ``p``'s), a packed 8-bit one the layout
    of NOTE [8-bit states of DTensor parameters] (else it was saved under another sharding)."""
    if not is_dtensor(value):
        return value
    if is_packed(key, value):
        shape, placements = _packed_layout(p)
        if value.device_mesh != p.device_mesh or tuple(value.placements) != placements or tuple(value.shape) != shape:
            raise ValueError(
                f"{where}: an 8-bit state of shape {tuple(value.shape)} with placements {tuple(value.placements)}, "
                f"but a parameter of shape {tuple(p.shape)} with placements {tuple(p.placements)} keeps its 8-bit "
                f"states in shape {shape} with placements {placements} (one row of packed blocks per shard): it was "
                "saved under another sharding (another number of ranks?). 8-bit states are packed per local shard "
                "and load only into the sharding they were saved from; to reshard, load them there into an "
                "optimizer with FP32 moments, the state dict's exp_avg_dtype / exp_avg_sq_dtype / momentum_dtype "
                "left out of its param groups (load_state_dict dequantizes each shard), and save that")
        return packed_local(value, p)
    if value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements):
        raise ValueError(f"{where}: a DTensor state with placements {tuple(value.placements)} for a parameter with "
                         f"placements {tuple(p.placements)} (or on another mesh); redistribute it to the "
                         "parameter's layout (torch.distributed.checkpoint does)")
    return value._local_tensor


def local_state(state: dict, p: torch.Tensor) -> dict:
    """A copy of the state of parameter ``p`` with DTensor entries replaced by their local shards (a packed 8-bit
    state by the packed state of ``p``'s local shard)."""
    return {k: (packed_local(v, p) if is_packed(k, v) else v._local_tensor) if is_dtensor(v) else v
            for k, v in state.items()}


def store_state(p: torch.Tensor, state: dict, before: dict, after: dict) -> None:
    """Writes back into ``state`` what the core changed in ``after`` (a ``local_state`` copy, ``before`` as it
    was passed): new or replaced tensors are wrapped as DTensors of ``p``'s layout, packed 8-bit states as NOTE
    [8-bit states of DTensor parameters] says (``step`` and ``sr_seed`` stay plain scalars: ``PLAIN_ENTRIES``),
    removed entries are removed; untouched entries keep their DTensor objects."""
    for key in list(state):
        if key not in after:
            del state[key]
    for key, value in after.items():
        if key in before and before[key] is value:
            continue
        if is_dtensor(p) and torch.is_tensor(value) and not is_dtensor(value):
            value = wrap_state(key, value, p)
        state[key] = value


# The groups of an ampkit.optim step that the core leaves to Python (NOTE [The policy across groups] in
# ampkit/optim_core.h): a group holding DTensor parameters, whose local shards the core steps here, or one with
# differentiable=True (torch.optim's own formulas, the optimizer's). OptimizerCore.step_groups calls check_group for
# each before any group is written, and step_group in the group's turn; ``core`` is the optimizer's OptimizerCore.
def check_group(optimizer, core, groups: list, index: int) -> None:
    """Checks group ``index`` (DTensor parameters: their local shards and grads), writing nothing."""
    group = groups[index]
    with local_grads(group["params"], type(optimizer).__name__) as params:
        core.check(group, params)


def packed_entries(optimizer, group: dict) -> list:
    """The state entries ``group`` keeps as 8-bit states (on parameters of 4096 elements or more); SGD keeps no
    momentum buffer without momentum."""
    return [entry for key, entry in zip(optimizer._state_dtype_keys, optimizer._state_dtype_entries)
            if group.get(key) is torch.uint8 and (entry != "momentum_buffer" or group.get("momentum", 0) != 0)]


def step_group(optimizer, core, groups: list, grad_scale, found_inf, index: int, grad_norm) -> None:
    """The step of group ``index``: differentiable=True, the optimizer's own; else the core updates each rank's
    local shards (params, grads and states share storage with the DTensors), and states it creates are stored as
    DTensors. 8-bit states follow the whole parameter (NOTE [8-bit states of DTensor parameters]): they are made
    here, with the step count, for every shard of a parameter of 4096 elements or more, small shards included (the
    core would keep FP32 for those). master_weights="stochastic": the seeds are made here, the same on every rank,
    and each shard rounds with its own key (NOTE [Stochastic rounding of DTensor parameters]). ``grad_norm``:
    LAMB's clipping norm, over every rank's shards (NOTE [Norms of sharded grads])."""
    group = groups[index]
    params = [p for p in group["params"] if p.grad is not None]
    if group.get("differentiable"):
        optimizer._differentiable_step(group, params, grad_scale, found_inf)
        return
    name = type(optimizer).__name__
    get_state = optimizer.state.get  # dict.get: no default entry created
    found = [get_state(p) for p in params]
    states = [{} if st is None else st for st in found]
    before = [local_state(st, p) for p, st in zip(params, states)]
    after = [dict(b) for b in before]
    packed = packed_entries(optimizer, group)
    for p, a in zip(params, after):
        missing = [k for k in packed if k not in a]
        if not missing or not is_dtensor(p) or p.numel() < BLOCKWISE8_MIN_NUMEL or not core.takes_fused(local(p)):
            continue
        if "step" not in a:  # a moment present without a step would be taken for a loaded one (SGD)
            a["step"] = torch.ops.ampkit.make_optim_state(local(p), ["step"])[0]
        for k in missing:
            a[k] = packed_zeros(p, name)
    seeds = shard_keys(core, params, after) if group.get("master_weights") == "stochastic" else ()
    with local_grads(params, name) as local_params:
        core.step(group, local_params, after, grad_scale, found_inf, optimizer.write_unscaled_grads, grad_norm)
    for a, seed in seeds:  # the parameter's seed is what the state keeps, not the shard's key
        a["sr_seed"] = seed
    for p, st, b, a, had in zip(params, states, before, after, found):
        store_state(p, st, b, a)
        if had is None and st:  # a state the core created
            optimizer.state[p] = st


# NOTE [Stochastic rounding of DTensor parameters]
# master_weights="stochastic" rounds each element with the random bits of (key, element index, step) (NOTE
# [Counter-based stochastic rounding] in kernels/stochastic_rounding.h), the element index being its index in the
# tensor the kernels are given: for a DTensor parameter, in the local shard. So that the rounding is the same
# function of the parameter on every rank and across checkpoints:
# - The seed (state "sr_seed") is one per parameter, the same on every rank of its mesh. The step that creates the
#   state makes it here, before the core's step: each rank draws it from torch's default generator (as the core
#   draws an unsharded parameter's), then the first rank's is broadcast, one mesh dimension after the other from the
#   rank at coordinate 0 of that dimension (one broadcast of the group's new seeds per mesh layout and dimension of
#   more than one rank, at state creation only). The ranks agree whatever state their generators are in (seeded per
#   rank for dropout, say). As every FSDP2 step, state creation is collective: the ranks step the parameter
#   together, with the same state entries. The seed is kept as a plain 0-dim int64 tensor, as ``step``: DCP saves
#   it once (a plain tensor is the same on every rank) and every rank loads that one, on any number of ranks; a
#   model that is not distributed loads it as it is. A state dict given to load_state_dict gives each rank the seed
#   it holds.
# - Each shard rounds with a key of its own: seed XOR (k * 0x9E3779B97F4A7C15 mod 2^64), k the shard's index (this
#   rank's coordinates on the mesh dimensions the parameter is sharded on, row-major; replicas of a shard, HSDP's
#   replicate dimension, share k, so they round alike and stay equal). Shard 0's key is the seed itself. With the
#   seed alone, element i of every shard would take the same bits at every step: rounding errors correlated across
#   shards. The key is passed to the core for the step only (``shard_keys``); the state keeps the seed. A key is
#   made once per seed tensor and kept while the seed lives and is not written (its version counter), so that a
#   step costs no tensor op per parameter.
# - What holds: each rank's update of its shard is, bit for bit, ampkit's update of a plain tensor holding the
#   shard, with its grad, step and key. Shard 0, and a parameter in one shard, round as the unsharded parameter.
#   The other shards' elements take other bits than the same elements of an unsharded parameter: a run on several
#   shards is NOT bit-identical to an unsharded run, nor to one on another number of shards, even from the same
#   weights and grads. Each is unbiased (every element rounds up with probability its distance from the lower
#   neighbour), and the weights differ by the rounding: at most one BF16 unit in the last place per element and step
#   from the rounding alone. A checkpoint resumed on as many shards continues bit for bit; on another number of
#   shards it loads bit for bit and rounds otherwise from its first step. (Bit-identity with the unsharded run
#   would need the global element index in the counter: the shard's first element passed to the kernels.)
_KEY_STRIDE = 0x9E3779B97F4A7C15  # 2^64 / the golden ratio, odd: k -> k * stride is one-to-one mod 2^64


def shard_index(p: torch.Tensor) -> int:
    """The index of this rank's shard of the DTensor parameter ``p``: its coordinates on the mesh dimensions ``p``
    is sharded on, row-major (0 where it is replicated on every dimension)."""
    mesh = p.device_mesh
    coordinate = mesh.get_coordinate()
    k = 0
    for dim, placement in enumerate(p.placements):
        if placement.is_shard():
            k = k * mesh.size(dim) + coordinate[dim]
    return k


def shard_key_mask(k: int) -> int:
    """What the seed is XORed with for shard ``k``, as a signed 64-bit integer (0 for shard 0)."""
    mask = (k * _KEY_STRIDE) & 0xFFFFFFFFFFFFFFFF
    return mask - (1 << 64) if mask >= 1 << 63 else mask


def _broadcast_seeds(params: list, seeds: list) -> None:
    """Makes each new seed the one of the rank at coordinate 0 of its parameter's mesh, in place: per mesh layout,
    one broadcast of the stacked seeds per mesh dimension of more than one rank."""
    import torch.distributed as dist
    batches: dict = {}
    for p, seed in zip(params, seeds):
        mesh = p.device_mesh
        key = (tuple(mesh.mesh.shape), tuple(mesh.mesh.reshape(-1).tolist()), seed.device)
        batches.setdefault(key, (mesh, []))[1].append(seed)
    for mesh, batch in batches.values():
        stacked = torch.stack(batch)
        coordinate = mesh.get_coordinate()
        for dim in range(mesh.ndim):
            if mesh.size(dim) == 1:
                continue
            source = list(coordinate)
            source[dim] = 0
            dist.broadcast(stacked, src=int(mesh.mesh[tuple(source)]), group=mesh.get_group(dim))
        for seed, value in zip(batch, stacked.unbind()):
            seed.copy_(value)


# id of a seed tensor -> (a weak reference to it, its version when the key was made, the key of this rank's shard;
# None: the seed itself). The reference's callback drops the entry when the seed dies, before its id can be reused.
_made_keys: dict = {}


def _shard_key(seed: torch.Tensor, p: torch.Tensor) -> Optional[torch.Tensor]:
    """The key of this rank's shard of ``p`` whose seed is ``seed``; None where it is the seed itself (shard 0)."""
    ident = id(seed)
    made = _made_keys.get(ident)
    if made is not None and made[0]() is seed and made[1] == seed._version:
        return made[2]
    k = shard_index(p)
    key = torch.bitwise_xor(seed, shard_key_mask(k)) if k else None
    _made_keys[ident] = (weakref.ref(seed, lambda _, ident=ident: _made_keys.pop(ident, None)), seed._version, key)
    return key


def shard_keys(core, params: list, after: list) -> list:
    """Before the core's step of a master_weights="stochastic" group: makes the seeds the step would make for
    DTensor parameters, the same on every rank, and puts each shard's key in place of its seed in ``after`` (NOTE
    [Stochastic rounding of DTensor parameters]). Returns the (state, seed) pairs to put back after the step."""
    new = [(p, a) for p, a in zip(params, after)
           if is_dtensor(p) and "sr_seed" not in a and core.takes_fused(p._local_tensor)]
    if new:
        seeds = [torch.ops.ampkit.make_optim_state(p._local_tensor, ["sr_seed"])[0] for p, _ in new]
        _broadcast_seeds([p for p, _ in new], seeds)
        for (_, a), seed in zip(new, seeds):
            a["sr_seed"] = seed
    swapped = []
    for p, a in zip(params, after):
        seed = a.get("sr_seed")
        if seed is None or not is_dtensor(p):
            continue
        key = _shard_key(seed, p)
        if key is not None:
            swapped.append((a, seed))
            a["sr_seed"] = key
    return swapped


def _groups(grads: Iterable[torch.Tensor]) -> list:
    """The process groups of the mesh dimensions on which DTensor grads are not replicated, in order of first
    appearance (the same on every rank when the ranks hold the same parameters), one per set of ranks: FSDP2 gives
    each ``fully_shard`` call a mesh of its own, and their groups over the same ranks need one all-reduce."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate
    seen, ranks, groups = set(), set(), []
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
                group = mesh.get_group(dim)
                members = tuple(sorted(dist.get_process_group_ranks(group)))
                if members not in ranks:
                    ranks.add(members)
                    groups.append(group)
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

    def all_reduce_found_inf(self, found_infs: Iterable[torch.Tensor], agreed: Container = ()) -> None:
        """:func:`all_reduce_found_inf` over these parameters' grads; nothing to do for plain parameters."""
        if self.sharded:
            all_reduce_found_inf(found_infs, self.params, agreed)


def all_reduce_found_inf(found_infs: Iterable[torch.Tensor], params: Iterable[torch.Tensor],
                         agreed: Container = ()) -> None:
    """All-reduces (MAX, in place) each found_inf flag over the groups of the DTensor grads of ``params``, but over
    none whose ranks (a sorted tuple of global ranks) are in ``agreed``: there every rank holds the same flags
    already. A no-op without DTensor grads."""
    import torch.distributed as dist
    groups = _groups(p.grad for p in params if p.grad is not None)
    if agreed:
        groups = [g for g in groups if tuple(sorted(dist.get_process_group_ranks(g))) not in agreed]
    if not groups:
        return
    flags, done = [], set()
    for t in found_infs:
        key = None if t is None else (t.device, t.data_ptr())
        if key is not None and key not in done:  # a flag listed twice is reduced once
            done.add(key)
            flags.append(t)
    for group in groups:
        for t in flags:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


# NOTE [Norms of sharded grads]
# A global grad norm (LAMB's clipping) over DTensor grads needs every rank's shards. Each rank takes the norm of the
# local shards it holds with ampkit's own grad norm (the order of NOTE [Deterministic norm], divided by grad_scale,
# rounded once to FP32, as an unsharded step takes it); its square, exact in float64, is that rank's partial sum of
# squares. The partial sums are all-gathered (one collective per mesh dimension the grads are sharded on: one for
# FSDP2) and every rank adds the same gathered values the same way in float64, so the ranks agree bit for bit (an
# all-reduce leaves the order of the adds to the backend); the root of the total is rounded once to FP32. With one
# shard this gives the unsharded norm's bits; with several, the shard sums are rounded once each before they are
# added, so the norm may differ from an unsharded run's by a few units in the last place of FP32. DTensor grads on
# several meshes or placements are reduced group by group; plain tensors count once (replicated on every rank).
def global_grad_norm(grads: list, grad_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of the whole tensors whose (local shards of) grads are ``grads``, divided by ``grad_scale``: a
    0-dim FP32 tensor on the first grad's device, the same bits on every rank (NOTE [Norms of sharded grads])."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate

    # (mesh, the mesh dims the grads are sharded on) -> the mesh and the local shards, in order of first appearance
    groups: dict = {}
    plain = []
    for g in grads:
        if not is_dtensor(g):
            plain.append(g)
            continue
        dims = tuple(d for d, placement in enumerate(g.placements) if not isinstance(placement, Replicate))
        groups.setdefault((id(g.device_mesh), dims), (g.device_mesh, []))[1].append(g._local_tensor)
    total = None
    for (_, dims), (mesh, local_grads) in groups.items():
        # (torch.ops.ampkit: each list holds a grad; ampkit.ops' wrapper only adds the empty case)
        partial = torch.ops.ampkit.global_grad_norm(local_grads, grad_scale).double().square().reshape(1)
        for dim in dims:
            group = mesh.get_group(dim)
            gathered = [torch.empty_like(partial) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, partial, group=group)
            partial = torch.cat(gathered).sum().reshape(1)
        total = partial if total is None else total + partial.to(total.device)
    if plain:
        partial = torch.ops.ampkit.global_grad_norm(plain, grad_scale).double().square().reshape(1)
        total = partial if total is None else total + partial.to(total.device)
    if total is None:
        return torch.zeros((), dtype=torch.float32)
    return total.sqrt().to(torch.float32).reshape(())
