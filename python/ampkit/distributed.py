"""ampkit.distributed: compressed gradient all-reduce for DDP that the loss scaler sees.

``fp16_compress_hook`` and ``bf16_compress_hook`` are DDP communication hooks, registered with
``ddp.register_comm_hook(state, hook)``, where ``state`` is an :class:`ampkit.GradScaler` (or a
:class:`HookState` naming a process group too, or ``None`` for compression without the scaler). Per bucket:

* compress: cast to FP16/BF16 and divide by the world size, in one pass (``torch.ops.ampkit.cast_divide_``: the
  bits of torch's hook, which casts and then divides the copy, on the CPU; torch's CUDA division by a scalar
  multiplies by its reciprocal, the same bits for power-of-two world sizes);
* all-reduce the 2-byte copy (half the bytes of an FP32 all-reduce);
* decompress into the bucket, unscale and check it in one pass (``torch.ops.ampkit.cast_unscale_and_check_`` with
  the scaler's ``unscale_factor``: the bits of a copy followed by the scaler's unscale) and record the flag with
  :meth:`ampkit.GradScaler.record_unscaled_grads`. torch runs each bucket's callback on a stream of its pool:
  the scaler keeps each bucket's flag apart and orders the streams itself (its NOTE [Scaler streams]). The
  grads DDP then writes are unscaled; the scaler's ``unscale_``/``step`` take the recorded flag instead of their
  own unscale or check pass over the grads, and every rank skips together, because after the all-reduce every
  rank checked the same values. An FP16 overflow caused by the compression itself (a gradient sum above 65504 at
  the current scale) is an Inf in the reduced bucket: it is caught here, the step is skipped on every rank, and
  the scale backs off.

When the bucket already has the compression dtype (an O2/O3 model in FP16), the cast is a no-op and the bucket
is all-reduced in place.
Without a scaler (``state=None``, or a disabled scaler, or before the first ``scaler.scale``), the hooks
compress and decompress only, as torch's.
"""
# No `from __future__ import annotations`: DDP checks the hooks' annotations against dist.GradBucket and
# torch.futures.Future themselves.
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .grad_scaler import GradScaler

__all__ = ["GradientAllReduce", "HookState", "fp16_compress_hook", "bf16_compress_hook"]


@dataclass
class HookState:
    """The state of ampkit's DDP hooks: the scaler whose grads they unscale and check (None: none) and the process
    group to all-reduce over (None: the default group, as DDP's)."""

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


def _compress_hook(dtype: torch.dtype, hook: str, state: Any,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    st = _state(state, hook)
    group = st.process_group if st.process_group is not None else dist.group.WORLD
    world_size = group.size()
    buffer = bucket.buffer()
    # Cast, then divide in the wire dtype (torch's hooks' bits), in one pass when ampkit's kernels take the dtypes.
    fused = buffer.dtype in _CAST_DTYPES and buffer.dtype != dtype
    if fused:
        compressed = torch.empty_like(buffer, dtype=dtype)
        torch.ops.ampkit.cast_divide_([buffer], [compressed], float(world_size))
    else:
        compressed = buffer.to(dtype).div_(world_size)
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
    """DDP hook: all-reduce each bucket in FP16, unscaled and checked for the scaler given as ``state``."""
    return _compress_hook(torch.float16, "fp16_compress_hook", state, bucket)


def bf16_compress_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: all-reduce each bucket in BF16 (FP32's range: no compression overflow), unscaled and checked."""
    return _compress_hook(torch.bfloat16, "bf16_compress_hook", state, bucket)


class GradientAllReduce:
    """Data-parallel gradient averaging without DDP, by ampkit's C++ ``ampkit::distributed::GradientAllReduce``
    (what LibTorch programs use): buckets of ``bucket_cap_mb`` in reverse parameter order are all-reduced as their
    grads become ready (``overlap=True``: autograd hooks) or at :meth:`synchronize`, compressed to FP16/BF16 when
    ``compression`` says so, and, with a ``scaler``, decompressed, unscaled and checked as the DDP hooks do
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
    from . import _C
    return _C
