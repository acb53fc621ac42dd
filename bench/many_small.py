"""Many small tensors: ampkit.optim's AdamW and SGD (momentum 0.9) steps over 2,000 FP32 tensors of ~1,000
elements (bench/run.py's many_small case), and AdamW stepped through ampkit.GradScaler (``scaled``: scale, step and
update, the scaler's host path and its inf check included), timed three ways:

  warm         steps back to back (the tensors and their metadata stay in the caches);
  cold         a 256 MiB in-place pass before each step evicts the caches, as a forward and backward pass would;
  interleaved  after two steps each of torch's fused and foreach AdamW over tensors of their own, as bench/run.py
               times its rows.

With --against DIR ..., each DIR (a folder holding another build's ``ampkit`` package, its libampkit in
``ampkit/lib``) runs the same in a process of its own, alternating with this checkout's for --rounds rounds, and
the medians print side by side with the ratio of each DIR's time to this checkout's: how a change moves the time
per element, measured on one machine in one session.

Usage: python bench/many_small.py [--against DIR ...] [--rounds N] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = [(1000 + (i % 7),) for i in range(2000)]
FLUSH_BYTES = 256 << 20


def measure() -> dict:
    import torch

    import ampkit
    import ampkit.optim

    def params():
        torch.manual_seed(0)
        ps = [torch.randn(s).requires_grad_() for s in SHAPES]
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-3
        return ps

    others = [torch.optim.AdamW(params(), lr=1e-3, fused=True), torch.optim.AdamW(params(), lr=1e-3, foreach=True)]
    flush = torch.empty(FLUSH_BYTES // 4)
    out = {"ampkit": os.path.dirname(os.path.dirname(ampkit.__file__)), "torch": torch.__version__,
           "threads": torch.get_num_threads()}
    for name, make in [("adamw", lambda ps: ampkit.optim.AdamW(ps, lr=1e-3)),
                       ("sgd", lambda ps: ampkit.optim.SGD(ps, lr=1e-3, momentum=0.9)),
                       ("scaled", lambda ps: ampkit.optim.AdamW(ps, lr=1e-3, write_unscaled_grads=False))]:
        opt = make(params())
        step = opt.step
        if name == "scaled":  # the grads stay as they are (not unscaled in place): every step sees the same values
            scaler, loss = ampkit.GradScaler("cpu"), torch.ones(())

            def step():
                scaler.scale(loss)
                scaler.step(opt)
                scaler.update()
        step()
        for o in others:
            o.step()
        warm = []
        for _ in range(15):
            t0 = time.perf_counter()
            for _ in range(10):
                step()
            warm.append((time.perf_counter() - t0) * 1e3 / 10)
        cold = []
        for _ in range(30):
            flush.add_(1.0)
            t0 = time.perf_counter()
            step()
            cold.append((time.perf_counter() - t0) * 1e3)
        interleaved = []
        for _ in range(20):
            for o in others:
                o.step()
                o.step()
            t0 = time.perf_counter()
            step()
            step()
            interleaved.append((time.perf_counter() - t0) * 1e3 / 2)
        out[name] = {"warm": statistics.median(warm), "cold": statistics.median(cold),
                     "interleaved": statistics.median(interleaved)}
    return out


def run_variant(folder: str | None) -> dict:
    env = dict(os.environ)
    if folder is not None:
        env["PYTHONPATH"] = folder + os.pathsep + env.get("PYTHONPATH", "")
        env["LD_LIBRARY_PATH"] = os.path.join(folder, "ampkit", "lib") + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker"], env=env, check=True,
                          capture_output=True, text=True, cwd="/")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", nargs="*", default=[], metavar="DIR")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure()))
        return
    variants: list[str | None] = [None, *[os.path.abspath(d) for d in args.against]]
    runs: dict[int, list[dict]] = {i: [] for i in range(len(variants))}
    for _ in range(args.rounds):
        for i, folder in enumerate(variants):
            runs[i].append(run_variant(folder))
    first = runs[0][0]
    print(f"many small tensors: {len(SHAPES)} FP32 tensors of ~1,000 elements, torch {first['torch']}, "
          f"{first['threads']} threads, medians over {args.rounds} rounds (ms per step)")
    print(f"{'step':6s} {'timing':12s} " + " ".join(f"{'v' + str(i):>9s}" for i in range(len(variants)))
          + "".join(f"   v{i}/v0" for i in range(1, len(variants))))
    table = []
    for name in ("adamw", "sgd", "scaled"):
        for timing in ("warm", "cold", "interleaved"):
            ms = [statistics.median(r[name][timing] for r in runs[i]) for i in range(len(variants))]
            ratios = [m / ms[0] for m in ms[1:]]
            print(f"{name:6s} {timing:12s} " + " ".join(f"{m:9.3f}" for m in ms)
                  + "".join(f"  {r:7.2f}" for r in ratios))
            table.append({"step": name, "timing": timing, "ms": ms, "ratio_to_v0": ratios})
    for i in range(len(variants)):
        print(f"v{i}: {runs[i][0]['ampkit']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"variants": [runs[i][0]["ampkit"] for i in range(len(variants))], "rounds": args.rounds,
                       "torch": first["torch"], "threads": first["threads"], "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
