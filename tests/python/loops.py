"""Training loops shared by the tests: optimizers stepped in lockstep on the same grads, runs of seeded grads, a
scaler driven through a sequence of overflows, and a training step captured in a CUDA graph and replayed (torch's
capture recipe) against the same steps run eagerly."""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from factories import grads_for


def step_in_lockstep(runs: Sequence[tuple], steps: range, grads: Callable = grads_for,
                     before_step: Optional[Callable[[int], None]] = None) -> None:
    """Steps optimizers side by side on the same grads (or one optimizer on the seeded grads of each step).

    Args:
        runs: ``(params, optimizer)`` or ``(params, optimizer, to_grad)`` per optimizer, their params of one shape
            each; ``to_grad`` turns a drawn grad into that run's ``.grad`` (default: a clone).
        steps: the step indices; each draws ``grads(params of the first run, step)``.
        grads: the grads of a step (default: ``factories.grads_for``).
        before_step: called with the step index after the grads are set, before the optimizers step (a schedule
            that changes lr).
    Mutates the params' ``.grad``, the params and the optimizers' state; the optimizers step in the order given.
    """
    for step in steps:
        drawn = grads(runs[0][0], step)
        for run in runs:
            to_grad = run[2] if len(run) > 2 else torch.Tensor.clone
            for p, g in zip(run[0], drawn):
                p.grad = to_grad(g)
        if before_step is not None:
            before_step(step)
        for run in runs:
            run[1].step()


def run_steps(params: Sequence[torch.Tensor], optimizer, step_grads: Sequence[Sequence[torch.Tensor]]) -> None:
    """One ``optimizer.step()`` per list of ``step_grads``, each after a clone of that list is set as the grads."""
    for gs in step_grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        optimizer.step()


def seeded_bf16_grads(seed: int, sizes: Sequence[int], steps: int) -> list[list[torch.Tensor]]:
    """``steps`` lists of BF16 grads of the given sizes, drawn from torch's default generator seeded with ``seed``."""
    torch.manual_seed(seed)
    return [[torch.randn(n).to(torch.bfloat16) for n in sizes] for _ in range(steps)]


def capture_and_replay(setup: Callable[[], tuple], step: Callable, xs: torch.Tensor, ys: torch.Tensor,
                       warmup: int = 3) -> tuple[tuple, tuple]:
    """Trains twice on the batches ``xs[i], ys[i]``: eagerly, and with one step captured in a CUDA graph and
    replayed (``warmup`` eager steps on a side stream first create the states and buffers, as torch's capture
    recipe has it).

    Args:
        setup: builds a fresh ``(model, optimizer, scaler)``, the same each call.
        step: ``step(model, optimizer, scaler, x, y)``, one training step.
        xs, ys: the batches, stacked on the first dimension (CUDA tensors).
        warmup: eager steps before the capture.
    Returns ``(eager, replayed)``, each the ``(model, optimizer, scaler)`` it trained, after a device sync.
    """
    eager = setup()
    for i in range(len(xs)):
        step(*eager, xs[i], ys[i])
    model, opt, scaler = setup()
    static_x, static_y = xs[0].clone(), ys[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(warmup):
            static_x.copy_(xs[i])
            static_y.copy_(ys[i])
            step(model, opt, scaler, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        step(model, opt, scaler, static_x, static_y)
    for i in range(warmup, len(xs)):
        static_x.copy_(xs[i])
        static_y.copy_(ys[i])
        graph.replay()
    torch.cuda.synchronize()
    return eager, (model, opt, scaler)


def drive_scaler(scaler, overflows, n_params=1, device="cpu"):
    """Steps a tiny problem (``n_params`` parameters of 4 ones, SGD) on ``device`` with ``scaler`` (ampkit's or
    torch's); ``overflows[i]`` says whether step i's grads hold Inf. Returns the scale after each update()."""
    history = []
    ps = [torch.nn.Parameter(torch.ones(4, device=device)) for _ in range(n_params)]
    opt = torch.optim.SGD(ps, lr=1e-3)
    for o in overflows:
        opt.zero_grad()
        scaler.scale(sum(p.sum() for p in ps)).backward()
        if o:
            ps[-1].grad[-1] = math.inf
        scaler.step(opt)
        scaler.update()
        history.append(scaler.get_scale())
    return history
