"""ampkit.distributed: compressed gradient all-reduce for DDP, as torch's hooks or unscaled for the loss scaler.

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
"""
# No `from __future__ import annotations`: DDP checks the hooks' annotations against dist.GradBucket and
# torch.futures.Future themselves.
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .grad_scaler import GradScaler

__all__ = ["GradientAllReduce", "HookState", "fp16_compress_hook", "bf16_compress_hook",
           "fp16_compress_unscale_hook", "bf16_compress_unscale_hook"]


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


def _core():
    from ._native import _C
    return _C
