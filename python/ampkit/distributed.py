"""ampkit.distributed: compressed gradient reduction for DDP and FSDP2, as torch's hooks or unscaled for the scaler.

DDP communication hooks, registered with ``ddp.register_comm_hook(state, hook)``:

* ``fp16_compress_hook`` and ``bf16_compress_hook`` are drop-ins for torch's
  ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks`` hooks of the same names: each bucket is cast to
  FP16/BF16 and divided by the world size (in one pass, ``torch.ops.ampkit.cast_divide_``, where that gives the
  bits of torch's cast-then-divide: on the CPU, and on CUDA for power-of-two world sizes, where torch's division by
  a scalar multiplies by its reciprocal; torch's two passes otherwise), the 2-byte copy is all-reduced and copied
  back into the bucket. The grads DDP then writes are torch's bit for bit, still scaled when the loss was: a loop
  that clips right after ``backward()`` sees what it sees with torch's hook, and the scaler's own ``unscale_`` /
  ``step`` unscale and check them. An FP16 overflow caused by the compression (a gradient sum above 65504 at the
  current scale) is an Inf in the bucket, which that check catches on every rank. ``state`` is ``None`` or a
  ProcessGroup, as torch's, or an :class:`ampkit.GradScaler` or :class:`HookState`, of which these hooks use only
  the process group: the scaler is left to unscale the grads itself.
* ``fp16_compress_unscale_hook`` and ``bf16_compress_unscale_hook`` fuse the scaler's unscale into the
  decompression, for ``state`` an :class:`ampkit.GradScaler` (or a :class:`HookState` naming one): the bucket is
  widened, unscaled and checked in one pass (``torch.ops.ampkit.cast_unscale_and_check_`` with the scaler's
  ``unscale_factor``: the bits of a copy followed by the scaler's unscale) and the flag recorded with
  :meth:`ampkit.GradScaler.record_unscaled_grads`. torch runs each bucket's callback on a stream of its pool: the
  scaler keeps each bucket's flag apart and orders the streams itself (its NOTE [Scaler streams]). The grads DDP
  then writes are unscaled; the scaler's ``unscale_``/``step`` take the recorded flag instead of their own unscale
  or check pass over the grads, and every rank skips together, because after the all-reduce every rank checked the
  same values; a compression overflow is caught here. Without a scaler (``state=None``, a disabled scaler, or
  before the first ``scaler.scale``), they compress and decompress only, as torch's hooks.

When the bucket already has the compression dtype (an O2/O3 model in FP16), the cast is a no-op and the bucket
is all-reduced in place.

FSDP2 (``torch.distributed.fsdp.fully_shard``, HSDP on a 2-D mesh included): :func:`compress_fsdp` installs on
every FSDP module a reduce-scatter that sends the gradients in BF16 or FP16 and sums them in FP32 (NOTE [Compressed
FSDP reduction]) and, with an :class:`ampkit.GradScaler`, unscales and checks the reduced shards as FSDP hands them
back and records the flag (:meth:`ampkit.GradScaler.record_unscaled_grads`): the scaler's ``unscale_``/``step``
neither unscale, nor check, nor all-reduce found_inf, and every rank skips together. Without a scaler it is a
compressed transport only. Of torch 2.13's FSDP2 it relies on public API only: ``FSDPModule.set_custom_reduce_scatter``
with the ``ReduceScatter`` interface that method documents (``allocate(size, *, dtype, device)`` and
``__call__(output_tensor, input_tensor, group, op, async_op=False)``: FSDP calls it synchronously with the flat,
padded gradients of one module in its ``MixedPrecisionPolicy.reduce_dtype`` and the reduce op it chose, and reads
this rank's shards from the output), ``FSDPModule.set_all_reduce_hook`` (called on that output after the
reduce-scatter, for HSDP after FSDP's own all-reduce across the replicas), the DTensor layout of the parameters
(``device_mesh``, ``placements``), ``all_to_all_single`` and ``get_process_group_ranks``.

NOTE [Compressed FSDP reduction]
Gloo reduces in the tensor's dtype, so a BF16 reduce-scatter there also adds in BF16, and its reduce-scatter costs
an all-reduce's bytes (4 bytes per FP32 gradient element per rank on 2 ranks, counted as the bytes a rank writes to
its sockets: bench/distributed.py). ``compress_fsdp``'s reduce-scatter takes FSDP's flat buffer of S chunks (S:
the ranks of the shard group) and:
1. compresses it: an FP32 buffer (``reduce_dtype=torch.float32``, or FP32 parameters without a policy) is cast to
   the wire dtype in one pass (``cast_unscale_and_check_`` with factor 1, which with a scaler also sets this rank's
   flag where a cast value is Inf/NaN: a non-finite grad, or one above FP16's range); a buffer FSDP already cast to
   the wire dtype (``reduce_dtype`` equal to it) is only checked. Nothing is divided before the cast.
2. exchanges it: ``all_to_all_single`` sends chunk j to rank j: (S-1)/S of the buffer in 2-byte elements leave
   each rank, a ring reduce-scatter's bytes in the wire dtype.
3. adds: each rank adds the S chunks it received, in rank order, each times 1/S (FSDP's ``ReduceOp.AVG``; 1 for
   ``SUM``), into FP32, and writes FSDP's output: that FP32 sum, or it rounded once to the wire dtype when FSDP
   reduces in it.
4. passes the flag on: with a scaler, a rank whose flag is set writes +Inf into the first element of every chunk it
   sends, so every rank's sum holds a non-finite value. FSDP's all-reduce hook then unscales the output and checks
   it (``unscale_and_check_`` with the scaler's ``unscale_factor``; in the wire dtype when FSDP reduces in it, which
   a power-of-two scale leaves exact but for subnormals) and records the flag, which is the same on every
   rank of the shard group, and for HSDP of the mesh: FSDP's all-reduce across the replicas carries the Inf to every
   replica. The scaler is told that those ranks agree (``GradScaler._note_agreed_ranks``) and leaves out its found_inf
   all-reduce over them (``_dtensor.all_reduce_found_inf``): no collective beyond the reduction itself.
Every overflow is one that a sender saw: each received part times 1/S is at most max(wire dtype)/S, so the FP32
sum stays within the wire dtype's range and no receiver's sum, nor its rounding to the wire dtype, overflows. FSDP's
all-reduce across R replicas adds R such values, which in BF16 could exceed BF16's or FP32's range: with a BF16
wire and R > 1 a sender also sets its flag where a compressed value reaches 2**127 / R (an extra read of the
compressed buffer), so those sums stay below 2**127; FP16's parts add to at most R * 65504. FSDP reduces an FP16
``reduce_dtype`` as a sum (pre- and post-dividing), whose rounding to FP16 could overflow on the owning rank only:
refused with a scaler (FP16 on the wire with ``reduce_dtype=torch.float32`` is what to use).
HSDP: the all-reduce across the replicas is FSDP's own (torch 2.13 offers no public way to replace it), in
``reduce_dtype``: FP32 on the wire and in the sum with ``reduce_dtype=torch.float32``, the wire dtype with
``reduce_dtype`` equal to it (Gloo then adds in that dtype).
"""
# No `from __future__ import annotations`: DDP checks the hooks' annotations against dist.GradBucket and
# torch.futures.Future themselves.
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist

from .grad_scaler import GradScaler

__all__ = ["GradientAllReduce", "HookState", "fp16_compress_hook", "bf16_compress_hook",
           "fp16_compress_unscale_hook", "bf16_compress_unscale_hook", "compress_fsdp", "FSDPCompression"]


@dataclass
class HookState:
    """The state of ampkit's DDP hooks: the scaler whose grads the unscale hooks unscale and check (None: none; the
    torch-named hooks leave the grads to it) and the process group to all-reduce over (None: the default group, as
    DDP's)."""

    scaler: Optional[GradScaler] = None
    process_group: Optional[Any] = None


def _state(state: Any, hook: str) -> HookState:
    if state is None:
        return HookState()
    if isinstance(state, GradScaler):
        return HookState(scaler=state)
    if isinstance(state, HookState):
        return state
    if isinstance(state, dist.ProcessGroup):
        return HookState(process_group=state)
    raise TypeError(f"ampkit.distributed.{hook}: the hook's state must be an ampkit.GradScaler, an "
                    f"ampkit.distributed.HookState, a ProcessGroup or None, but got {type(state).__name__}")


_CAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The scalers a torch-named hook has said once that it leaves the grads to.
_warned_scaled: "weakref.WeakSet[GradScaler]" = weakref.WeakSet()


def _compress(buffer: torch.Tensor, dtype: torch.dtype, world_size: int, exact: bool) -> tuple[torch.Tensor, bool]:
    """The bucket cast to ``dtype`` and divided by ``world_size``, as torch's hooks' ``to(dtype).div_(world_size)``,
    and whether it was one ``cast_divide_`` pass. ``exact``: only where that pass gives torch's bits (the CPU, or a
    power-of-two world size, where CUDA's multiply by the reciprocal is the same division)."""
    fused = buffer.dtype in _CAST_DTYPES and buffer.dtype != dtype
    if fused and exact:
        fused = buffer.device.type == "cpu" or world_size & (world_size - 1) == 0
    if not fused:
        return buffer.to(dtype).div_(world_size), False
    compressed = torch.empty_like(buffer, dtype=dtype)
    torch.ops.ampkit.cast_divide_([buffer], [compressed], float(world_size))
    return compressed, True


def _compress_hook(dtype: torch.dtype, hook: str, state: Any,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's compression hook: the reduced copy written back into the bucket, scaled as it came."""
    st = _state(state, hook)
    if st.scaler is not None and st.scaler.is_enabled() and st.scaler not in _warned_scaled:
        _warned_scaled.add(st.scaler)
        warnings.warn(f"ampkit.distributed.{hook} leaves the grads scaled, as torch's hook of that name does: the "
                      "scaler given as its state unscales them in its own unscale_/step. For the unscale fused into "
                      f"the hook's decompression (one pass fewer), register {hook.replace('_hook', '_unscale_hook')} "
                      "instead.", UserWarning, stacklevel=2)
    group = st.process_group if st.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed, _ = _compress(buffer, dtype, group.size(), exact=True)
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def _compress_unscale_hook(dtype: torch.dtype, hook: str, state: Any,
                           bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    st = _state(state, hook)
    group = st.process_group if st.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed, fused = _compress(buffer, dtype, group.size(), exact=False)
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()
    scaler = st.scaler
    unscale = scaler is not None and scaler.is_enabled() and scaler._get_scale_async() is not None
    if unscale:
        scaler._note_hook_bucket(bucket.index(), hook)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        separate = reduced.data_ptr() != buffer.data_ptr()
        if not unscale:
            if separate:
                buffer.copy_(reduced)
            return buffer
        # The unscale and check the scaler would do later, done here once: unscale_/step take the flag.
        found_inf = torch.zeros(1, dtype=torch.float32, device=buffer.device)
        factor = scaler.unscale_factor(buffer.device)
        if separate and fused:  # widen, unscale and check in one pass
            torch.ops.ampkit.cast_unscale_and_check_([reduced], [buffer], found_inf, factor)
        else:
            if separate:
                buffer.copy_(reduced)
            torch.ops.ampkit.unscale_and_check_([buffer], found_inf, factor)
        scaler.record_unscaled_grads(found_inf)
        return buffer

    return future.then(decompress)


def fp16_compress_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook, torch's ``fp16_compress_hook``: each bucket all-reduced in FP16 and written back as torch's hook
    writes it (scaled grads stay scaled, for the scaler's own unscale and check).

    Args:
        state: ``None`` or a ProcessGroup (as torch's hook), an ``ampkit.GradScaler`` (not used: the grads are left
            to it) or a :class:`HookState` (its process group).
        bucket: DDP's gradient bucket; its buffer is overwritten with the averaged grads.
    """
    return _compress_hook(torch.float16, "fp16_compress_hook", state, bucket)


def bf16_compress_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook, torch's ``bf16_compress_hook``: each bucket all-reduced in BF16 (FP32's range: no compression
    overflow) and written back as torch's hook writes it; ``state`` as :func:`fp16_compress_hook`'s."""
    return _compress_hook(torch.bfloat16, "bf16_compress_hook", state, bucket)


def fp16_compress_unscale_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: each bucket all-reduced in FP16, then unscaled and checked for the scaler in ``state`` while it is
    widened back (the grads DDP writes are unscaled; the scaler's ``step`` takes the recorded flag).

    Args:
        state: an ``ampkit.GradScaler``, a :class:`HookState` (scaler and process group), a ProcessGroup or
            ``None`` (the last two, and a disabled scaler: compression only, as torch's hook).
        bucket: DDP's gradient bucket; its buffer is overwritten with the averaged, unscaled grads.
    """
    return _compress_unscale_hook(torch.float16, "fp16_compress_unscale_hook", state, bucket)


def bf16_compress_unscale_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: each bucket all-reduced in BF16, then unscaled and checked for the scaler in ``state``; ``state``
    as :func:`fp16_compress_unscale_hook`'s."""
    return _compress_unscale_hook(torch.bfloat16, "bf16_compress_unscale_hook", state, bucket)


class GradientAllReduce:
    """Data-parallel gradient averaging without DDP, by ampkit's C++ ``ampkit::distributed::GradientAllReduce``
    (what LibTorch programs use): buckets of ``bucket_cap_mb`` in reverse parameter order are all-reduced as their
    grads become ready (``overlap=True``: autograd hooks) or at :meth:`synchronize`, compressed to FP16/BF16 when
    ``compression`` says so, and, with a ``scaler``, decompressed, unscaled and checked as the unscale hooks do
    (:meth:`ampkit.GradScaler.record_unscaled_grads`). Call :meth:`synchronize` after backward, before
    ``scaler.step``. ``params`` must be the same list in the same order on every rank."""

    def __init__(self, params, process_group: Optional[Any] = None, *, compression: Optional[str] = None,
                 bucket_cap_mb: float = 25.0, overlap: bool = True, scaler: Optional[GradScaler] = None) -> None:
        where = "ampkit.distributed.GradientAllReduce"
        params = list(params)
        if not all(isinstance(p, torch.Tensor) for p in params):
            raise TypeError(f"{where}: params must be tensors")
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError(f"{where}: scaler must be an ampkit.GradScaler or None, but got {type(scaler).__name__}")
        if not isinstance(bucket_cap_mb, (int, float)) or isinstance(bucket_cap_mb, bool) or not bucket_cap_mb > 0:
            raise ValueError(f"{where}: bucket_cap_mb must be a positive number, but got {bucket_cap_mb!r}")
        group = process_group if process_group is not None else dist.group.WORLD
        self._scaler = scaler
        self._core = _core().GradientAllReduce(
            params, group, "none" if compression is None else compression, int(bucket_cap_mb * 2**20),
            bool(overlap), scaler._core if scaler is not None else None)

    def synchronize(self) -> None:
        """Waits for this round's all-reduces and writes the averaged (unscaled, with a scaler) grads."""
        self._core.synchronize()

    def set_require_sync(self, require_sync: bool) -> None:
        """``False``: backwards accumulate locally without all-reduce (gradient accumulation) until set back."""
        self._core.set_require_sync(bool(require_sync))

    def bucket_indices(self) -> list[list[int]]:
        """Parameter indices of each bucket, in launch order."""
        return self._core.bucket_indices()

    def bytes_reduced(self) -> int:
        """Bytes this rank has handed to all-reduce so far."""
        return self._core.bytes_reduced()


# ---- FSDP2 -----------------------------------------------------------------------------------------------------

_WIRE_DTYPES = (torch.bfloat16, torch.float16)


class FSDPCompression:
    """What :func:`compress_fsdp` installed on a set of FSDP modules (NOTE [Compressed FSDP reduction]): the wire
    ``dtype``, the ``scaler`` (or None) and the bytes sent. Made by :func:`compress_fsdp`, not directly."""

    def __init__(self, dtype: torch.dtype, scaler: Optional[GradScaler]) -> None:
        self.dtype = dtype
        self.scaler = scaler
        self._bytes_sent = 0

    def bytes_sent(self) -> int:
        """Bytes this rank has sent to other ranks through the compressed reduce-scatters so far (the chunks of the
        all-to-all that leave it; FSDP's all-gathers and HSDP's all-reduce across replicas are FSDP's own)."""
        return self._bytes_sent

    def _unscaling(self) -> bool:
        """Whether this iteration's grads are unscaled and checked here: a scaler whose scale exists (before the
        first ``scale()`` the grads are not scaled, and the transport only compresses)."""
        return self.scaler is not None and self.scaler._get_scale_async() is not None


class _ReduceScatter:
    """FSDP's ``ReduceScatter`` comm and all-reduce hook of one FSDP module; ``replicas``: the size of the mesh
    dimensions its parameters are replicated on (HSDP), ``replica_ranks``: those dimensions' groups of this rank."""

    def __init__(self, owner: FSDPCompression, replicas: int, replica_ranks: list) -> None:
        self._owner = owner
        self._replicas = replicas
        self._replica_ranks = replica_ranks

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False) -> None:
        owner = self._owner
        wire_dtype, where = owner.dtype, "ampkit.distributed.compress_fsdp"
        if async_op:
            raise NotImplementedError(f"{where}: the compressed reduce-scatter runs synchronously (as FSDP calls "
                                      "it), but was asked for async_op=True")
        if input_tensor.dtype not in (torch.float32, wire_dtype) or output_tensor.dtype != input_tensor.dtype:
            raise TypeError(f"{where}: FSDP's reduce-scatter buffers must be float32 (MixedPrecisionPolicy("
                            f"reduce_dtype=torch.float32)) or {wire_dtype} (reduce_dtype={wire_dtype}), but got "
                            f"{input_tensor.dtype} in, {output_tensor.dtype} out")
        unscale = owner._unscaling()
        if op == dist.ReduceOp.SUM and unscale:
            raise ValueError(f"{where}: with a scaler, FSDP's reduce op must be ReduceOp.AVG, but got {op}: FSDP sums "
                             "an FP16 reduce_dtype (or with set_force_sum_reduction_for_comms), and a sum that "
                             "overflows FP16 only on the rank that owns it would part the ranks' skip decisions; use "
                             "reduce_dtype=torch.float32 (FP16 on the wire, FP32 sums)")
        if op != dist.ReduceOp.AVG and op != dist.ReduceOp.SUM:
            raise ValueError(f"{where}: FSDP's reduce op must be ReduceOp.AVG or ReduceOp.SUM, but got {op} "
                             "(set_gradient_divide_factor is not supported)")
        shards = group.size()
        n = output_tensor.numel()
        if input_tensor.numel() != shards * n:
            raise ValueError(f"{where}: FSDP's reduce-scatter input must hold {shards} x the output's {n} elements, "
                             f"but got {input_tensor.numel()}")
        alpha = 1.0 / shards if op == dist.ReduceOp.AVG else 1.0
        found_inf = torch.zeros(1, dtype=torch.float32, device=input_tensor.device) if unscale else None
        # 1. compress (and, with a scaler, check what is sent)
        if input_tensor.dtype == wire_dtype:
            wire = input_tensor
            if unscale:
                torch.ops.ampkit.check_finite_([wire], found_inf)
        else:
            wire = torch.empty(input_tensor.shape, dtype=wire_dtype, device=input_tensor.device)
            if unscale:
                one = torch.ones(1, dtype=torch.float32, device=input_tensor.device)
                torch.ops.ampkit.cast_unscale_and_check_([input_tensor], [wire], found_inf, one)
            else:
                wire.copy_(input_tensor)
        if unscale and wire_dtype == torch.bfloat16 and self._replicas > 1 and wire.numel():
            # FSDP's all-reduce across the replicas must not overflow: values at 2**127 / R count as an overflow.
            limit = 2.0 ** (127 - math.ceil(math.log2(self._replicas)))
            found_inf.add_(torch.linalg.vector_norm(wire, float("inf")).lt(limit).logical_not())
        if unscale and n:  # the flag travels with the data: +Inf at the head of every chunk this rank sends
            wire.view(shards, n)[:, 0].masked_fill_(found_inf.ne(0), float("inf"))
        # 2. exchange: chunk j to rank j
        received = torch.empty_like(wire)
        dist.all_to_all_single(received, wire, group=group)
        owner._bytes_sent += (shards - 1) * n * wire.element_size()
        # 3. add in FP32, in rank order
        total = output_tensor if output_tensor.dtype == torch.float32 else torch.empty(
            n, dtype=torch.float32, device=output_tensor.device)
        total.zero_()
        for part in received.view(shards, n):
            total.add_(part, alpha=alpha)
        if total is not output_tensor:
            output_tensor.copy_(total)
        if unscale:
            scaler = owner.scaler
            scaler._note_agreed_ranks(tuple(sorted(dist.get_process_group_ranks(group))))
            for ranks in self._replica_ranks:
                scaler._note_agreed_ranks(ranks)
        return None

    def _after_reduce(self, reduce_output: torch.Tensor) -> None:
        """FSDP's all-reduce hook: the reduced shard (for HSDP after the all-reduce across replicas) unscaled and
        checked, the flag recorded with the scaler (NOTE [Compressed FSDP reduction])."""
        owner = self._owner
        if not owner._unscaling():
            return
        found_inf = torch.zeros(1, dtype=torch.float32, device=reduce_output.device)
        torch.ops.ampkit.unscale_and_check_([reduce_output], found_inf,
                                            owner.scaler.unscale_factor(reduce_output.device))
        owner.scaler.record_unscaled_grads(found_inf)


def _fsdp_module_type() -> type:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError as e:  # torch without FSDP2
        raise ImportError("ampkit.distributed.compress_fsdp needs torch.distributed.fsdp.FSDPModule (FSDP2)") from e
    return FSDPModule


def _own_params(module: torch.nn.Module, fsdp_type: type) -> list:
    """The parameters of FSDP module ``module`` that no FSDP module inside it holds: those of its param group."""
    inner = {id(p) for m in module.modules() if m is not module and isinstance(m, fsdp_type)
             for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in inner]


def _layout(module: torch.nn.Module, params: list) -> tuple[int, list]:
    """(the number of replicas, the ranks of this rank's groups of the replicated mesh dimensions) of the DTensor
    parameters ``params`` of one FSDP module; raises ValueError where they lie on several meshes (FSDP then has
    several param groups, to which torch 2.13 sets no custom reduce-scatter)."""
    from torch.distributed.tensor import DTensor, Replicate
    layouts = {(id(p.device_mesh), tuple(p.placements)) for p in params if isinstance(p, DTensor)}
    meshes = {key[0] for key in layouts}
    if len(meshes) > 1:
        raise ValueError(f"ampkit.distributed.compress_fsdp: the parameters of each FSDP module must lie on one "
                         f"device mesh, but those of {type(module).__name__} lie on {len(meshes)}")
    if not layouts:
        return 1, []
    p = next(p for p in params if isinstance(p, DTensor))
    mesh, replicas, ranks = p.device_mesh, 1, []
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            replicas *= mesh.size(dim)
            ranks.append(tuple(sorted(dist.get_process_group_ranks(mesh.get_group(dim)))))
    return replicas, ranks


def compress_fsdp(modules: Union[torch.nn.Module, Iterable[torch.nn.Module]], scaler: Optional[GradScaler] = None,
                  *, dtype: torch.dtype = torch.bfloat16) -> FSDPCompression:
    """Sends the gradients of FSDP2 modules in ``dtype`` over their reduce-scatter and sums them in FP32, and with
    ``scaler`` unscales and checks the reduced shards for it, so that every rank skips an overflowing step without
    a collective of the scaler's (NOTE [Compressed FSDP reduction]).

    Args:
        modules: an FSDP module (``fully_shard``'s result) or several; each FSDP module inside them is set up too,
            so pass the root to cover every parameter. Their ``MixedPrecisionPolicy.reduce_dtype`` must be
            ``torch.float32`` (FP32 accumulation) or ``dtype`` (both HSDP legs in ``dtype``), checked at the first
            reduce-scatter; with a scaler, every parameter its optimizers step must be in one of them.
        scaler: an enabled ``ampkit.GradScaler`` or None (compression only).
        dtype: the wire dtype, ``torch.bfloat16`` or ``torch.float16``.

    Sets each module's custom reduce-scatter and all-reduce hook (replacing any set before); returns the
    :class:`FSDPCompression`. A refused argument raises before any module is changed.
    """
    where = "ampkit.distributed.compress_fsdp"
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{where}: dtype must be torch.bfloat16 or torch.float16, but got {type(dtype).__name__}")
    if dtype not in _WIRE_DTYPES:
        raise ValueError(f"{where}: dtype must be torch.bfloat16 or torch.float16, but got {dtype}")
    if scaler is not None and not isinstance(scaler, GradScaler):
        raise TypeError(f"{where}: scaler must be an ampkit.GradScaler or None, but got "
                        f"{type(scaler).__module__}.{type(scaler).__qualname__}")
    if scaler is not None and not scaler.is_enabled():
        raise ValueError(f"{where}: scaler must be an enabled ampkit.GradScaler (a disabled one skips nothing; pass "
                         "scaler=None for compression only), but got a disabled one")
    fsdp_type = _fsdp_module_type()
    single = isinstance(modules, torch.nn.Module)
    try:
        given = [modules] if single else list(modules)
    except TypeError:
        raise TypeError(f"{where}: modules must be an FSDP module (torch.distributed.fsdp.fully_shard) or an "
                        f"iterable of them, but got {type(modules).__name__}") from None
    if not given:
        raise ValueError(f"{where}: modules must hold at least one FSDP module, but got an empty "
                         f"{type(modules).__name__}")
    for i, m in enumerate(given):
        if not isinstance(m, fsdp_type):
            raise TypeError(f"{where}: {'modules' if single else f'modules[{i}]'} must be an FSDP module "
                            f"(torch.distributed.fsdp.fully_shard), but got {type(m).__name__}")
    targets = list({id(m): m for g in given for m in g.modules() if isinstance(m, fsdp_type)}.values())
    layouts = [_layout(m, _own_params(m, fsdp_type)) for m in targets]  # every check before the first change
    compression = FSDPCompression(dtype, scaler)
    for m, (replicas, ranks) in zip(targets, layouts):
        comm = _ReduceScatter(compression, replicas, ranks)
        m.set_custom_reduce_scatter(comm)
        m.set_all_reduce_hook(comm._after_reduce)
    return compression


def _core():
    from ._native import _C
    return _C
