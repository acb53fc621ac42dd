"""What ampkit.debug.replay reports: the per-module rows built from one run's records (``_rows``: the error each
module adds in the forward and the backward, where Inf/NaN and underflow start), the ranking of the ops
(``_rank_ops``, ``_fix_ops``), the suggestion in words (``_suggest``), the healthy threshold ``HEALTHY_EPS``, and
``ReplayReport``, the object ``replay`` returns (its table and its JSON-safe ``as_dict``).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ._trace import _all_finite, _floats, _Run

#: A module adding at most this many times the dtype's machine epsilon of relative error (and no Inf/NaN or
#: underflow anywhere) is reported healthy.
HEALTHY_EPS = 8.0


def _finite_float(x: Any) -> Any:
    """JSON-safe: Inf and NaN as the strings 'inf', '-inf', 'nan'."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _finite_float(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_float(v) for v in x]
    return x


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if math.isinf(x) or math.isnan(x):
        return "inf" if x == math.inf else str(x)
    return f"{x:.2e}"


class ReplayReport:
    """What :func:`replay` found: ``rows`` (one dict per module, ranked: the module that introduces the problem
    first), ``top`` (the first row), ``suggestion`` (the override that would fix it, in words), ``ops`` (the
    ops compared, ranked the same way), ``loss``, ``scale``, ``dtype``, ``mode`` (``"autocast"`` or
    ``"decorated"``), ``device_type``; ``as_dict()`` (JSON-serialisable), ``str(report)`` (a table)."""

    def __init__(self, rows: list[dict], ops: list[dict], loss: dict, suggestion: str, settings: dict) -> None:
        self.rows = rows
        self.ops = ops
        self.loss = loss
        self.suggestion = suggestion
        self.settings = settings

    @property
    def top(self) -> Optional[dict]:
        """The first row: the module that introduces the problem (None for a model without modules run)."""
        return self.rows[0] if self.rows else None

    @property
    def dtype(self) -> str:
        return self.settings["dtype"]

    @property
    def scale(self) -> float:
        return self.settings["scale"]

    @property
    def mode(self) -> str:
        return self.settings["mode"]

    @property
    def device_type(self) -> str:
        return self.settings["device_type"]

    def as_dict(self) -> dict:
        """Everything as plain dicts, lists, str, int and float (Inf/NaN as the strings 'inf'/'nan'):
        ``json.dumps(report.as_dict(), allow_nan=False)`` works."""
        return _finite_float(dict(settings=dict(self.settings), loss=dict(self.loss), suggestion=self.suggestion,
                                  rows=[dict(r) for r in self.rows], ops=[dict(o) for o in self.ops]))

    def __repr__(self) -> str:
        top = self.top["module"] if self.top else None
        return f"ReplayReport(top={top!r}, rows={len(self.rows)}, dtype={self.dtype}, scale={self.scale})"

    def __str__(self) -> str:
        s = self.settings
        lines = [f"ampkit.debug.replay: {s['dtype']} ({s['mode']}) on {s['device_type']}, scale {s['scale']:g}; "
                 f"loss {self.loss['low']:.6g} (reference {self.loss['reference']:.6g})"]
        head = ("#", "module", "type", "out rel err", "grad rel err", "added err", "overflow f/b", "underflow f/b",
                "max abs")
        body = []
        for i, r in enumerate(self.rows[:30]):
            grad = r["grad_rel_err"] if r["grad_rel_err"] is not None else r["param_grad_rel_err"]
            body.append((str(i + 1), r["module"] or "(model)", r["type"], _fmt(r["out_rel_err"]), _fmt(grad),
                         _fmt(r["added_err"]), f"{r['out_overflow']}/{r['grad_overflow']}",
                         f"{r['out_underflow']}/{r['grad_underflow']}",
                         _fmt(r["max_abs"])))
        widths = [max(len(row[c]) for row in [head] + body) for c in range(len(head))]
        for row in [head] + body:
            lines.append("  ".join(v.ljust(w) if c < 3 else v.rjust(w) for c, (v, w) in enumerate(zip(row, widths))))
        if len(self.rows) > 30:
            lines.append(f"... {len(self.rows) - 30} more rows (report.rows)")
        lines.append(f"suggestion: {self.suggestion}")
        return "\n".join(lines)


def _is_ancestor(parent: str, child: str) -> bool:
    return parent != child and (parent == "" or child.startswith(parent + "."))


def _rows(run: _Run, params: list[dict], model_out: set[int]) -> list[dict]:
    rows: dict[str, dict] = {}
    for c in run.calls:
        r = rows.get(c["module"])
        if r is None:
            r = rows[c["module"]] = dict(from_loss=False, _facing=False,
                module=c["module"], type=c["type"], calls=0, order=c["order"], introduces=None, out_rel_err=0.0,
                in_rel_err=0.0, introduced_err=0.0, out_overflow=0, out_underflow=0, max_abs=0.0, grad_rel_err=None,
                param_grad_rel_err=None, grad_overflow=0, grad_underflow=0, grad_max_abs=0.0, op=None, _fwd=False,
                _bwd=False, _out_grad_finite=True)
        r["calls"] += 1
        for k in ("out_rel_err", "in_rel_err", "introduced_err", "max_abs"):
            r[k] = max(r[k], c[k])
        r["out_overflow"] += c["out_overflow"]
        r["out_underflow"] += c["out_underflow"]
        r["_fwd"] = r["_fwd"] or c["forward_introducer"]
        r["_facing"] = r["_facing"] or bool(c.pop("out_ids") & model_out)
    grads_in_bad: dict[str, bool] = {}
    in_grad_err: dict[str, float] = {}
    for g in run.grads:
        r = rows.get(g["module"])
        if r is None:
            continue
        if g["side"] == "out":
            r["grad_rel_err"] = max(r["grad_rel_err"] or 0.0, g["rel_err"])
            r["grad_overflow"] += g["overflow"]
            r["grad_underflow"] += g["underflow"]
            r["grad_max_abs"] = max(r["grad_max_abs"], g["max_abs"])
            r["_out_grad_finite"] = r["_out_grad_finite"] and g["finite"]
        else:
            in_grad_err[g["module"]] = max(in_grad_err.get(g["module"], 0.0), g["rel_err"])
            if not g["finite"]:
                grads_in_bad[g["module"]] = True
    for p in params:
        r = rows.get(p["module"])
        if r is None:
            continue
        r["param_grad_rel_err"] = max(r["param_grad_rel_err"] or 0.0, p["rel_err"])
        r["grad_overflow"] += p["overflow"]
        r["grad_underflow"] += p["underflow"]
        if not p["finite"]:
            grads_in_bad[p["module"]] = True
    for name, r in rows.items():
        r["_bwd"] = r["_out_grad_finite"] and grads_in_bad.get(name, False)
        # the backward's error increase: from the gradient of its outputs to those of its inputs and parameters
        produced = max(in_grad_err.get(name, 0.0), r["param_grad_rel_err"] or 0.0)
        r["_bwd_added"] = 0.0
        # (a gradient inherits the error of its output gradient and of the forward values it is computed from)
        inherited = max(r["grad_rel_err"] or 0.0, r["in_rel_err"], r["out_rel_err"])
        if r["grad_rel_err"] is not None and math.isfinite(inherited) and math.isfinite(produced):
            r["_bwd_added"] = max(0.0, produced - inherited)
    for name, r in rows.items():  # what a submodule adds is not its parent's (the forward does this per call)
        inner = max([o["_bwd_added"] for n, o in rows.items() if _is_ancestor(name, n)], default=0.0)
        r["grad_introduced_err"] = max(0.0, r["_bwd_added"] - inner)
    for r in rows.values():
        r["added_err"] = max(r["introduced_err"], r["grad_introduced_err"])
    if any(r["_fwd"] for r in rows.values()):   # Inf/NaN in the forward: the backward's follow from it
        for r in rows.values():
            r["_bwd"] = False
    bwd = [n for n, r in rows.items() if r["_bwd"]]
    for n in bwd:  # a module is not the one that introduces when one of its submodules is
        if any(_is_ancestor(n, other) for other in bwd):
            rows[n]["_bwd"] = False
    if not any(r["_bwd"] or r["_fwd"] or r["out_overflow"] for r in rows.values()):
        # the first gradient of the backward, that of the scaled loss w.r.t. the model's output, already overflows:
        # the innermost module computing that output is where it shows
        facing = [r for r in rows.values() if r["_facing"] and not r["_out_grad_finite"]]
        if facing:
            first = min(facing, key=lambda r: r["order"])
            first["_bwd"] = first["from_loss"] = True
    by_module: dict[str, list[dict]] = {}
    for o in run.ops:
        by_module.setdefault(o["module"], []).append(o)
    for name, r in rows.items():
        r["introduces"] = "forward" if r["_fwd"] else ("backward" if r["_bwd"] else None)
        worst = _rank_ops(by_module.get(name, []))
        r["op"] = worst[0]["op"] if worst else None
        r["op_dtype"] = worst[0]["dtype"] if worst else None
        r["fix_ops"] = _fix_ops(worst[0]) if worst else []
        for k in ("_fwd", "_bwd", "_out_grad_finite", "_bwd_added", "_facing"):
            del r[k]

    def key(r: dict) -> tuple:
        if r["introduces"] == "forward":
            return (0, r["order"])
        if r["introduces"] == "backward":
            return (1, -r["order"])  # the backward runs in reverse: the last module forward is the first backward
        return (2, -r["added_err"], r["order"])

    return sorted(rows.values(), key=key)


def _fix_ops(op: dict) -> list[str]:
    """The ops to force to FP32 for ``op``'s problem: the op itself where its own rounding, overflow or underflow
    makes it (its float64 twin on the same inputs is right), else also the low-precision ops that computed its
    inputs (it amplifies their rounding, as softmax does on large logits)."""
    own = (op["local_overflow"] or op["local_underflow"] or not op["inputs_from"]
           or (op["local_rel_err"] is not None and op["local_rel_err"] >= 0.5 * op["rel_err"]))
    if own:
        return [op["op"]]
    return op["inputs_from"] + ([op["op"]] if op["lowp"] and op["op"] not in op["inputs_from"] else [])


def _rank_ops(ops: list[dict]) -> list[dict]:
    merged: dict[tuple, dict] = {}
    for i, o in enumerate(ops):
        k = (o["module"], o["op"])
        m = merged.get(k)
        if m is None:
            m = merged[k] = dict(o, calls=0, first=i)
            m["overflow"] = m["underflow"] = 0
            m["local_overflow"] = m["local_underflow"] = 0
        m["calls"] += 1
        for f in ("rel_err", "in_rel_err", "increase"):
            m[f] = max(m[f], o[f])
        m["overflow"] += o["overflow"]
        m["underflow"] += o["underflow"]
        m["introduces_nonfinite"] = m["introduces_nonfinite"] or o["introduces_nonfinite"]
        if o["local_rel_err"] is not None:
            m["local_rel_err"] = max(m["local_rel_err"] or 0.0, o["local_rel_err"])
        m["local_overflow"] += o["local_overflow"]
        m["local_underflow"] += o["local_underflow"]
        m["inputs_from"] = sorted(set(m["inputs_from"]) | set(o["inputs_from"]))
        m["lowp"] = m["lowp"] or o["lowp"]
    ranked = sorted(merged.values(), key=lambda m: (not m["introduces_nonfinite"], m["first"] if
                                                    m["introduces_nonfinite"] else 0, -m["underflow"],
                                                    -m["increase"], m["first"]))
    for m in ranked:
        del m["first"]
    return ranked


def _suggest(rows: list[dict], loss: dict, settings: dict, dtype: torch.dtype, low_out: Any) -> str:
    """The top row in words, and the override that fixes it."""
    info = torch.finfo(dtype)
    where = f"{settings['dtype']} at scale {settings['scale']:g}"
    top = rows[0] if rows else None
    out_finite = _all_finite(_floats(low_out))
    if top is None or (top["introduces"] is None and out_finite and math.isfinite(loss["low"])
                       and top["added_err"] <= HEALTHY_EPS * info.eps
                       and not any(r["out_overflow"] or r["grad_overflow"] or r["out_underflow"]
                                   or r["grad_underflow"] for r in rows)):
        if top is None:
            return f"no module ran; nothing to compare ({where})"
        return (f"healthy in {where}: no Inf/NaN and no underflow; the largest error increase is "
                f"{top['added_err']:.2e} ({top['added_err'] / info.eps:.1f} x {settings['dtype']} eps) at "
                f"{top['module'] or '(model)'} ({top['type']}); no override needed")
    if top["introduces"] is None and out_finite and not math.isfinite(loss["low"]):
        return (f"the loss ({loss['type']}) turns Inf/NaN from finite model outputs in {where}: compute it in FP32, "
                "loss_fn(output.float(), targets)")
    name = top["module"] or "(model)"
    if top["introduces"] is None and top["grad_underflow"] and top["added_err"] <= HEALTHY_EPS * info.eps:
        return (f"{name} ({top['type']}): {top['grad_underflow']} of its gradient values underflow to zero in "
                f"{where} ({settings['dtype']}'s normals end at {info.smallest_normal:.3g}, its subnormals at "
                f"{info.smallest_normal * info.eps:.3g}): raise the loss scale (ampkit.GradScaler, a larger "
                "init_scale)")
    what = {"forward": "its output holds Inf/NaN from finite inputs",
            "backward": "its gradients hold Inf/NaN from finite output gradients (the scaled backward overflows)",
            None: (f"it adds the largest error ({top['added_err']:.2e}, "
                   + ("in the backward" if top["grad_introduced_err"] > top["introduced_err"] else "in the forward")
                   + ")")}[top["introduces"]]
    if top["out_underflow"] and top["introduces"] is None:
        what = f"{top['out_underflow']} of its output values underflow to zero"
    text = f"{name} ({top['type']}): {what} in {where}. "
    if settings["mode"] == "decorated":
        text += f"Fix: ampkit.decorate(model, optimizer, excluded=[{top['module']!r}]) keeps it FP32"
        if top["max_abs"] > info.max:
            text += (f"; its output reaches {top['max_abs']:.3g}, beyond {settings['dtype']}'s max {info.max:g}, so "
                     "the modules that take it must stay FP32 as well (or use bfloat16)")
    else:
        op, fix = top["op"], [o for o in top["fix_ops"] if o not in settings["fp32_ops"]]
        if op is None:
            return text + ("No op of this module was compared; run its forward in FP32 (inside "
                           "ampkit.autocast(..., enabled=False))")
        if not fix:
            text += f"{', '.join(top['fix_ops'])} already run(s) in FP32 here; the problem is in its inputs or range"
        else:
            how = ("its op" if fix == [op] else "its inputs are computed by " + ", ".join(o for o in fix if o != op)
                   + f" in {settings['dtype']} and its op")
            text += (f"Fix: ampkit.autocast({settings['device_type']!r}, dtype=torch.{settings['dtype']}, "
                     f"fp32_ops={settings['fp32_ops'] + fix!r}) ({how} {op} ran in {top['op_dtype']})")
    if top["introduces"] == "backward" and top["from_loss"]:
        return (f"{name} ({top['type']}): the gradient of the scaled loss w.r.t. its output (the model's output) "
                f"already overflows {where} (max |grad| {top['grad_max_abs']:.3g} in the reference): lower the loss "
                f"scale (the scaler backs off by itself after a skipped step; GradScaler(max_scale=...) bounds it)")
    if top["introduces"] == "backward":
        text += "; or lower the loss scale (the scaler backs off by itself after a skipped step)"
    return text
