"""The layers of shared/DESIGN.md, checked from the sources' #include lines: kernels (Torch-free, CUDA headers only
under kernels/cuda/) <- ops <- components (scaler, autocast, optim, distributed) <- bindings <- python. A layer may
include only what sits below it (and its own folder)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
SOURCES = ("*.h", "*.hpp", "*.cpp", "*.cu", "*.cuh")

# The header-only c10 scalar types are the one piece of Torch the kernels may use (DESIGN.md).
KERNEL_TORCH_ALLOWED = {"c10/util/Half.h", "c10/util/BFloat16.h"}
TORCH_PREFIXES = ("ATen/", "torch/", "c10/", "caffe2/")
CUDA_HEADERS = re.compile(r"^(cuda|cuda_[a-z0-9_]+|cublas\w*|curand\w*|driver_types|vector_types|crt/[\w/]+)\.h$")


def files(folder: str):
    base = ROOT / folder
    for pattern in SOURCES:
        yield from base.rglob(pattern)


def includes(path: Path):
    """The included names; system headers (<...>) keep a leading '<' so a quoted local file never looks like one."""
    return [("<" if kind == "<" else "") + name for kind, name in INCLUDE.findall(path.read_text())]


def system(inc: str) -> str:
    return inc[1:] if inc.startswith("<") else ""


def test_kernels_are_torch_free_and_keep_cuda_headers_under_cuda():
    bad = []
    for f in files("kernels"):
        rel = f.relative_to(ROOT)
        for inc in includes(f):
            if system(inc).startswith(TORCH_PREFIXES) and system(inc) not in KERNEL_TORCH_ALLOWED:
                bad.append(f"{rel}: {inc}")
            if CUDA_HEADERS.match(system(inc)) and "cuda" not in rel.parts[1:-1]:
                bad.append(f"{rel}: {inc} (CUDA headers belong under kernels/cuda/)")
            if inc.startswith("ampkit/") or "csrc/" in inc:
                bad.append(f"{rel}: {inc} (kernels must not reach up into csrc)")
    assert not bad, "\n".join(bad)


def test_cpu_sources_include_no_cuda_header():
    # The CPU-only build must compile on a host without the CUDA toolkit.
    bad = []
    for f in list(files("csrc")) + [p for p in files("kernels") if "cuda" not in p.relative_to(ROOT).parts]:
        rel = f.relative_to(ROOT)
        if "cuda" in f.name or rel.parts[:2] == ("csrc", "python"):
            continue
        for inc in includes(f):
            if (CUDA_HEADERS.match(system(inc)) or system(inc).startswith(("c10/cuda/", "ATen/cuda/"))
                    or "kernels/cuda/" in inc):
                bad.append(f"{rel}: {inc}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder,forbidden", [
    ("csrc/ops", ("ampkit/grad_scaler.h", "ampkit/optim.h", "ampkit/autocast.h", "ampkit/ampkit.h", "scaler/",
                  "optim/", "autocast/", "python/")),
    ("csrc/scaler", ("ampkit/optim.h", "ampkit/autocast.h", "optim/", "autocast/", "python/", "ops/")),
    ("csrc/optim", ("autocast/", "python/", "ops/")),
    ("csrc/autocast", ("python/", "ops/")),
    ("csrc/distributed", ("ampkit/optim.h", "ampkit/autocast.h", "optim/", "autocast/", "python/", "ops/")),
])
def test_components_include_only_layers_below(folder, forbidden):
    bad = [f"{f.relative_to(ROOT)}: {inc}" for f in files(folder) for inc in includes(f)
           if any(inc.lstrip("<").startswith(x) or f"/{x}" in inc for x in forbidden)]
    assert not bad, "\n".join(bad)


# What csrc/python may bind (docs/architecture.md): the public C++ API (<ampkit/...>) and its own helpers, plus the
# one type the optimizer core owns for borrowing a caller's tensors (csrc/optim/borrowed_tensors.h). No op
# internals, kernels or component internals: a binding translates, the components decide.
PYTHON_BINDING_INTERNALS_ALLOWED = {"../optim/borrowed_tensors.h"}


def test_python_bindings_include_only_the_public_api_and_their_own_helpers():
    own = {f.name for f in files("csrc/python")}
    bad = []
    for f in files("csrc/python"):
        for inc in includes(f):
            allowed = inc.startswith(("<", "ampkit/")) or inc in own or inc in PYTHON_BINDING_INTERNALS_ALLOWED
            if allowed:
                continue
            bad.append(f"{f.relative_to(ROOT)}: {inc}")
    assert not bad, "\n".join(bad)


def test_each_python_binding_file_binds_one_component_and_module_cpp_only_assembles():
    module = (ROOT / "csrc/python/module.cpp").read_text()
    # module.cpp: the build's description and the calls of each component's bind_*; no class or op binding
    assert "py::class_" not in module and "m.def(\"_optim" not in module
    binds = set(re.findall(r"ampkit::python::(bind_\w+)\(m\)", module))
    assert binds == {f.stem for f in (ROOT / "csrc/python").glob("bind_*.cpp")}
