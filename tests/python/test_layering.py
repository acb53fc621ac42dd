"""The layers of shared/DESIGN.md, checked from the sources' #include lines: kernels (Torch-free, CUDA headers only
under kernels/cuda/) <- ops <- components (scaler, autocast, optim, distributed) <- bindings <- python. A layer may
include only what sits below it (and its own folder). The Python package's rules are checked from its imports."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import ampkit

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
    ("csrc/fp8", ("ampkit/grad_scaler.h", "ampkit/optim.h", "ampkit/autocast.h", "scaler/", "optim/", "autocast/",
                  "python/", "ops/")),
    ("csrc/monitor", ("ampkit/optim.h", "ampkit/autocast.h", "optim/", "autocast/", "python/", "ops/")),
])
def test_components_include_only_layers_below(folder, forbidden):
    bad = [f"{f.relative_to(ROOT)}: {inc}" for f in files(folder) for inc in includes(f)
           if any(inc.lstrip("<").startswith(x) or f"/{x}" in inc for x in forbidden)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder", ["csrc/scaler", "csrc/optim", "csrc/autocast", "csrc/distributed", "csrc/fp8",
                                    "csrc/monitor"])
def test_components_reach_kernels_only_through_the_ops(folder):
    """kernels/ is the ops' own layer: a component reads what it needs of it through <ampkit/ops.h>."""
    bad = [f"{f.relative_to(ROOT)}: {inc}" for f in files(folder) for inc in includes(f) if "kernels/" in inc]
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


# ---- Python imports --------------------------------------------------------------------------------------------
# The Python package keeps the components' layering (docs/conventions.md): the scaler and autocast import no
# optimizer module, ampkit.optim imports no scaler module, and the framework integrations use ampkit's public names
# only (no private module, no private name, no private attribute of ampkit's objects), so that ampkit's internals
# can change without breaking them. Imports are read with ast, function-local ones included.

PACKAGE = ROOT / "python" / "ampkit"


def module_of(path: Path) -> str:
    """The dotted name of a source file of the package (a package's __init__.py is the package)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every import in the file, relative ones resolved; name "" for `import module`.
    `from package import x` gives (package, x): x may be a name or a submodule."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_of(path) if path.name == "__init__.py" else module_of(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found += [(node.lineno, base, alias.name) for alias in node.names]
    return found


def reaches(module: str, name: str, target: str) -> bool:
    """Whether importing `name` from `module` (or `module` itself, name "") imports `target` or a module in it."""
    full = f"{module}.{name}" if name else module
    return any(m == target or m.startswith(target + ".") for m in (module, full))


def sources(package: str) -> list[Path]:
    folder = PACKAGE.joinpath(*package.split(".")[1:])
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [folder.with_suffix(".py")]


@pytest.mark.parametrize("importer,forbidden", [
    ("ampkit.grad_scaler", "ampkit.optim"),
    ("ampkit.autocast", "ampkit.optim"),
    ("ampkit.optim", "ampkit.grad_scaler"),
])
def test_python_components_import_only_what_they_may(importer, forbidden):
    files = sources(importer)
    assert files and all(f.is_file() for f in files), importer
    bad = [f"{f.relative_to(ROOT)}:{line}: imports {module}{'.' + name if name else ''} ({importer} must not "
           f"import {forbidden})"
           for f in files for line, module, name in python_imports(f) if reaches(module, name, forbidden)]
    assert not bad, "\n".join(bad)


def test_only_native_loads_the_extension():
    # ampkit._native checks the torch version before it loads _C; every other module takes _C from there, so that
    # no import order loads the extension first.
    bad = [f"{f.relative_to(ROOT)}:{line}: imports {module}.{name} (import _C from ampkit._native)"
           for f in sources("ampkit") if f.name != "_native.py"
           for line, module, name in python_imports(f) if reaches(module, name, "ampkit._C")]
    assert not bad, "\n".join(bad)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def ampkit_private_attributes() -> set[str]:
    """The private names (one leading underscore) that ampkit's scaler and optimizers have, as objects or classes:
    a scaler's `_core`, an optimizer's `_kind`. Those that torch's GradScaler and optimizers also have are torch's
    and stay out (a framework may use them on torch's objects)."""
    import ampkit

    params = [torch.nn.Parameter(torch.zeros(2))]
    ours = [ampkit.GradScaler("cpu"), *(cls(params) for cls in (ampkit.optim.Adam, ampkit.optim.AdamW,
                                                                  ampkit.optim.SGD, ampkit.optim.LAMB))]
    theirs = [torch.amp.GradScaler("cpu"), torch.optim.Adam(params, fused=True), torch.optim.SGD(params, fused=True)]
    names = {n for obj in ours for n in dir(obj) if _private(n)}
    return names - {n for obj in theirs for n in dir(obj)}


def test_import_reader_finds_what_it_should():
    found = python_imports(PACKAGE / "optim" / "_base.py")
    assert any(m == "ampkit" and n == "_compile" for _, m, n in found)  # from .. import _compile
    assert any(m == "ampkit._native" and n == "_C" for _, m, n in found)  # a function-local import
    assert reaches("ampkit", "optim", "ampkit.optim") and reaches("ampkit.optim._traced", "x", "ampkit.optim")
    assert not reaches("ampkit", "optimizers", "ampkit.optim")


def test_private_attribute_list_finds_what_it_should():
    found = ampkit_private_attributes()
    assert {"_core", "_kind"} <= found
    assert not {"_per_optimizer_states", "_scale", "_step_supports_amp_scaling", "step"} & found


def test_integrations_use_only_public_names_of_ampkit():
    private_attributes = ampkit_private_attributes()
    bad = []
    for f in sources("ampkit.integrations"):
        rel = f.relative_to(ROOT)
        ampkit_names = set()  # local names bound to ampkit modules (import ampkit, import ampkit.optim as o)
        for line, module, name in python_imports(f):
            if not (module == "ampkit" or module.startswith("ampkit.")):
                continue
            own = module.startswith("ampkit.integrations")  # the integrations' own helpers (_lightning)
            if not own and any(_private(part) for part in module.split(".")):
                bad.append(f"{rel}:{line}: imports the private module {module}")
            elif _private(name) and not own:
                bad.append(f"{rel}:{line}: imports the private name {name} from {module}")
            if not name:
                ampkit_names.add(module.split(".")[0])
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in ampkit_names:
                bad.append(f"{rel}:{node.lineno}: reads {ast.unparse(node)}, a private name of ampkit")
            elif node.attr in private_attributes:
                bad.append(f"{rel}:{node.lineno}: reads {ast.unparse(node)} ({node.attr} is private to ampkit's "
                           "scaler or optimizers: use or add a public method)")
    assert not bad, "\n".join(bad)


def _walk(step) -> list:
    """The ampkit modules a call goes through, in order: the module of each Python function it calls, a module
    listed again only after the call has been in another one."""
    import sys
    seq: list = []

    def profile(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith("ampkit") and (not seq or seq[-1] != module):
            seq.append(module)

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return seq


def _returns(seq: list) -> int:
    """How many times a walk comes back to a module it has left."""
    return sum(1 for i, m in enumerate(seq) if m in seq[:i])


def test_walk_counts_returns():
    assert _returns(["a", "b", "a", "c", "b"]) == 2
    assert _returns(["a", "b", "c"]) == 0
    seen = _walk(lambda: ampkit.ops.global_grad_norm([torch.ones(3)], None))
    assert seen and seen[0] == "ampkit.ops", seen


@pytest.mark.parametrize("name,kwargs", [("AdamW", {}), ("SGD", dict(momentum=0.9)), ("LAMB", dict(max_grad_norm=0.5))])
def test_optimizer_step_walks_down_the_package(name, kwargs):
    """The eager step of ampkit.optim is one descent: it comes back to a module it has left at most twice, checks,
    clipping norm and steps included (two groups whose lr changed, as a scheduler changes it: checked again). The
    same holds for DTensor groups (tests/python/test_fsdp2.py); differentiable=True, torch.optim's own formulas
    outside the fused core, is not held to it."""
    params = [torch.nn.Parameter(torch.randn(10)) for _ in range(3)]
    opt = getattr(ampkit.optim, name)([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3, **kwargs)
    for p in params:
        p.grad = torch.randn(10)
    opt.step()
    opt.param_groups[1]["lr"] = 2e-3
    opt.param_groups[0]["lr"] = 2e-3
    before = [p.detach().clone() for p in params]
    seq = _walk(opt.step)
    assert _returns(seq) <= 2, seq
    assert all(not torch.equal(p, b) for p, b in zip(params, before))
