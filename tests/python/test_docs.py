"""docs/ stays complete and current: every public Python name, C++ name and op schema is in docs/api.md, the
autocast table matches the running torch, and the Python snippets of the docs run."""
from __future__ import annotations

import enum
import importlib.util
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import ampkit

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
HEADERS = ROOT / "csrc" / "include" / "ampkit"
REGISTRATION = ROOT / "csrc" / "ops" / "registration.cpp"
GENERATOR = ROOT / "scripts" / "gen_autocast_table.py"
NOT_RUN = "<!-- not run by tests/python/test_docs.py"


def code_text(markdown: str) -> str:
    """The text inside the fenced code blocks and inline code spans of a markdown document."""
    fence = re.compile(r"```[^\n]*\n(.*?)```", re.S)
    spans = re.findall(r"`([^`\n]+)`", fence.sub(" ", markdown))
    return "\n".join(fence.findall(markdown) + spans)


def missing_words(words, text: str) -> list[str]:
    return sorted({w for w in words if not re.search(r"(?<!\w)" + re.escape(w) + r"(?!\w)", text)})


@pytest.fixture(scope="module")
def api_code() -> str:
    return code_text((DOCS / "api.md").read_text())


@pytest.fixture(scope="module", autouse=True)
def table_check():
    """`gen_autocast_table.py --check` in a fresh process (no ampkit kernels on the autocast keys), started first
    so that it runs while the other tests do."""
    proc = subprocess.Popen([sys.executable, str(GENERATOR), "--check"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


# ---- (a) Python ------------------------------------------------------------------------------------------------


def _public_modules() -> list[types.ModuleType]:
    modules = [ampkit] + [getattr(ampkit, n) for n in ampkit.__all__
                          if isinstance(getattr(ampkit, n), types.ModuleType)]
    modules += [m for name, m in sorted(sys.modules.items()) if name.startswith("ampkit.") and hasattr(m, "__all__")]
    return list({id(m): m for m in modules}.values())


def _public_objects() -> dict[str, object]:
    """Qualified name -> object for every name in the __all__ of ampkit and of its submodules."""
    found = {}
    for module in _public_modules():
        for name in module.__all__:
            obj = getattr(module, name)
            top = getattr(ampkit, name, None)
            found[f"ampkit.{name}" if top is obj else f"{module.__name__}.{name}"] = obj
    return found


def _signature_words(fn) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.name not in ("self", "cls")
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def python_requirements() -> tuple[list[str], list[tuple[str, list[str]]], list[str]]:
    """(qualified public names, (member, acceptable spellings) of public classes, parameter names)."""
    objects = _public_objects()
    public_classes = {obj for obj in objects.values() if inspect.isclass(obj)}
    members, params = [], []
    for qualified, obj in objects.items():
        if inspect.isfunction(obj):
            params += _signature_words(obj)
        if not inspect.isclass(obj):
            continue
        if issubclass(obj, enum.Enum):
            members += [(f"{obj.__name__}.{m}", [f"{obj.__name__}.{m}"]) for m in obj.__members__]
            continue
        ours = [k for k in obj.__mro__ if k.__module__.startswith("ampkit")]
        spellings = [k.__name__ for k in obj.__mro__ if k is obj or k in public_classes]
        for klass in ours:
            for name, value in vars(klass).items():
                if name == "__init__":
                    params += _signature_words(value)
                if name.startswith("_"):
                    continue
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                if inspect.isfunction(value) or isinstance(value, property):
                    members.append((f"{obj.__name__}.{name}", [f"{s}.{name}" for s in spellings]))
                    if inspect.isfunction(value):
                        params += _signature_words(value)
    return sorted(objects), members, sorted(set(params))


def test_every_public_python_name_is_documented(api_code):
    names, members, params = python_requirements()
    assert {"ampkit.GradScaler", "ampkit.optim.AdamW"} <= set(names)  # the collection itself works
    assert any(m == "GradScaler.unscale_" for m, _ in members) and "write_unscaled_grads" in params
    missing = missing_words(names, api_code)
    missing += sorted(m for m, spellings in members if not any(missing_words([s], api_code) == [] for s in spellings))
    missing += missing_words(params, api_code)
    assert not missing, f"docs/api.md does not mention (in code) these public Python names: {missing}"


# ---- (b) C++ -------------------------------------------------------------------------------------------------

_CLASS_HEAD = re.compile(r"^(?:template\s*<[^{]*>\s*)?(class|struct)\s+(?:AMPKIT_API\s+)?(\w+)")
_ENUM_HEAD = re.compile(r"^enum\s+(?:class\s+)?(\w+)")
_NAMESPACE_HEAD = re.compile(r"^namespace\s+([\w:]*)")


def cxx_public_names(header: str) -> set[str]:
    """Public names a header declares: classes, structs, enums and enumerators, `using` aliases, AMPKIT_API free
    functions, public methods, data members and TORCH_ARG options. Private and protected sections and
    namespace detail are skipped; function bodies and brace initialisers are skipped whole."""
    text = re.sub(r"/\*.*?\*/", " ", header, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"^\s*#[^\n]*", " ", text, flags=re.M)
    names: set[str] = set()
    scopes: list[list[str]] = []  # [kind, name, access]

    def visible() -> bool:
        return all(not (kind == "namespace" and name.split("::")[-1] == "detail") and
                   (kind not in ("class", "enum") or access == "public") for kind, name, access in scopes)

    def declaration(s: str) -> None:
        in_class = bool(scopes) and scopes[-1][0] == "class"
        if not s or not visible() or s.startswith(("extern template", "friend", "static_assert")):
            return
        alias = re.match(r"^using\s+(\w+)\s*=", s)
        if alias or s.startswith("using"):
            names.update([alias.group(1)] if alias else [])
            return
        option = re.search(r"TORCH_ARG\(.*,\s*(\w+)\s*\)", s)
        if option:
            names.add(option.group(1))
        elif "(" in s:
            head = s.split("(")[0]
            name = re.search(r"(~?\w+)\s*$", head)
            if name is None or re.search(r"\boperator\b", head) or name.group(1).startswith("~"):
                return
            if in_class and name.group(1) == scopes[-1][1]:
                return  # a constructor: the class name covers it
            if in_class or "AMPKIT_API" in s:
                names.add(name.group(1))
        elif in_class:
            member = re.search(r"(\w+)\s*(?:=.*)?$", s)
            if member:
                names.add(member.group(1))

    buf: list[str] = []
    depth = 0
    i = 0
    while i < len(text):
        c = text[i]
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth > 0 or c not in ";{}":
            buf.append(c)
            i += 1
            continue
        s = " ".join("".join(buf).split())
        buf = []
        while (access := re.match(r"^(public|private|protected)\s*:\s*", s)) is not None:
            if scopes and scopes[-1][0] == "class":
                scopes[-1][2] = access.group(1)
            s = s[access.end():]
        if c == ";":
            declaration(s)
        elif c == "}":
            if scopes and scopes[-1][0] == "enum" and visible():
                names.update(e.split("=")[0].strip() for e in s.split(",") if e.strip())
            if scopes:
                scopes.pop()
        elif (m := _NAMESPACE_HEAD.match(s)) is not None:
            scopes.append(["namespace", m.group(1), "public"])
        elif (m := _ENUM_HEAD.match(s)) is not None:
            if visible():
                names.add(m.group(1))
            scopes.append(["enum", m.group(1), "public"])
        elif (m := _CLASS_HEAD.match(s)) is not None:
            if visible():
                names.add(m.group(2))
            scopes.append(["class", m.group(2), "public" if m.group(1) == "struct" else "private"])
        else:  # a function body or a brace initialiser: skip to the matching brace
            level, j = 1, i + 1
            while level:
                level += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            if s.endswith("="):
                buf = list(s + " {} ")
            else:
                declaration(s)
            i = j
            continue
        i += 1
    return names


def test_header_parser_finds_what_it_should():
    names = cxx_public_names("""
        namespace ampkit {
        struct AMPKIT_API Opts { TORCH_ARG(std::optional<double>, min_scale) = std::nullopt; TORCH_ARG(int, n) = {}; };
        struct Info { bool flag; const char* text = "x"; };
        enum class Mode { kA, kB = 2 };
        class AMPKIT_API Thing : public Base {
         public:
          explicit Thing(Opts o = {});
          ~Thing();
          int get() const { return x_; }
          void set_amp_scaling(at::Tensor a,
                               at::Tensor b) override {
            a_ = a;
          }
          using Alias = int;
         protected:
          void helper();
         private:
          struct Hidden { int y; };
          int x_;
        };
        AMPKIT_API void free_fn(const std::vector<int>& v = {});
        AMPKIT_API Stream& operator<<(Stream& s, const Thing& t);
        namespace detail { AMPKIT_API void internal(); }
        }  // namespace ampkit
        """)
    assert names == {"Opts", "min_scale", "n", "Info", "flag", "text", "Mode", "kA", "kB", "Thing", "get",
                     "set_amp_scaling", "Alias", "free_fn"}


def test_every_public_cxx_name_is_documented(api_code):
    headers = sorted(HEADERS.glob("*.h"))
    assert headers
    found = {h.name: cxx_public_names(h.read_text()) for h in headers}
    assert {"GradScalerOptions", "init_scale", "AutocastGuard", "build_info"} <= set().union(*found.values())
    missing = {name: missing_words(names, api_code) for name, names in found.items()}
    missing = {name: words for name, words in missing.items() if words}
    assert not missing, f"docs/api.md does not mention (in code) these public C++ names: {missing}"


# ---- (c) ops -------------------------------------------------------------------------------------------------


def registered_schemas() -> dict[str, str]:
    """op name -> schema, from the m.def(...) calls of registration.cpp (adjacent string literals joined)."""
    text = re.sub(r"//[^\n]*", " ", REGISTRATION.read_text())
    schemas = {}
    for call in re.finditer(r"\bm\.def\(\s*((?:\"(?:[^\"\\]|\\.)*\"\s*)+)", text):
        schema = "".join(re.findall(r"\"((?:[^\"\\]|\\.)*)\"", call.group(1)))
        schemas[schema.split("(")[0]] = schema
    return schemas


def test_every_op_and_schema_is_documented(api_code):
    schemas = registered_schemas()
    loaded = {n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
              if n.startswith("ampkit::")}
    assert "unscale_and_check_" in schemas and "unscale_and_check_" in loaded
    missing = missing_words(set(schemas) | loaded, api_code)
    assert not missing, f"docs/api.md does not name these ops of torch.ops.ampkit: {missing}"
    flat = re.sub(r"\s+", "", api_code)
    stale = [name for name, schema in schemas.items() if re.sub(r"\s+", "", schema) not in flat]
    assert not stale, f"docs/api.md does not show the schema registration.cpp declares for: {stale}"


# ---- the documented Python snippets run ------------------------------------------------------------------


def python_blocks(markdown: str) -> list[str]:
    blocks = re.finditer(r"(<!--[^\n]*-->\n)?```python\n(.*?)```", markdown, re.S)
    return [m.group(2) for m in blocks if not (m.group(1) or "").startswith(NOT_RUN)]


@pytest.mark.parametrize("doc", ["autocast_ops.md", "recipes.md"])
def test_documented_python_snippets_run(doc, tmp_path, monkeypatch):
    blocks = python_blocks((DOCS / doc).read_text())
    assert blocks
    monkeypatch.chdir(tmp_path)  # recipes write checkpoints to the working directory
    for block in blocks:
        exec(compile(block, f"{doc} snippet", "exec"), {"__name__": "__doc_snippet__"})


# ---- (d) the autocast table --------------------------------------------------------------------------------


def test_autocast_table_matches_the_running_torch(table_check):
    out, err = table_check.communicate(timeout=300)
    assert table_check.returncode == 0, f"{out}\n{err[-3000:]}"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_autocast_table", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_autocast_table_check_skips_another_torch_and_refuses_no_version(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "ERROR")  # restored afterwards (the script sets it for its own run)
    gen = _generator()
    doc = tmp_path / "autocast_ops.md"
    doc.write_text(f"# table\n\n{gen.VERSION_MARKER}0.0.1 -->\nstale content\n")
    assert gen.main(["--check", "--output", str(doc)]) == 0
    assert f"generated for 0.0.1, running {torch.__version__}" in capsys.readouterr().out
    doc.write_text("# table without a version\n")
    assert gen.main(["--check", "--output", str(doc)]) == 1
    assert gen.recorded_version((DOCS / "autocast_ops.md").read_text()) is not None
