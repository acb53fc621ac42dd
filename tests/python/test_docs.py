"""docs/ stays complete and current: every public Python name, C++ name and op schema is in docs/api.md, the
autocast table matches the running torch, the Python snippets of the docs run, every relative link of the docs
leads somewhere, the README stays a front door, and docs/architecture.md indexes every NOTE of the sources."""
from __future__ import annotations

import enum
import importlib.util
import inspect
import pkgutil
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
README = ROOT / "README.md"
README_MAX_LINES = 250
# Every markdown page of the manual: the front door, docs/ and the two folder indexes it links to.
MARKDOWN = [README, *sorted(DOCS.glob("*.md")), ROOT / "examples" / "README.md",
            ROOT / "bench" / "results" / "README.md"]
# Pages whose Python snippets run, with how many run today: a snippet moved or deleted without its replacement,
# or marked as not run, fails test_no_run_snippet_is_lost.
SNIPPETS_RUN = {"docs/autocast_ops.md": 1, "docs/fp8.md": 1, "docs/frameworks.md": 1, "docs/recipes.md": 9}


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
    """ampkit and every submodule with an __all__, each imported here (so the list does not depend on what earlier
    tests imported); an integration whose framework is not installed is left out."""
    for info in pkgutil.walk_packages(ampkit.__path__, "ampkit."):
        if not info.name.rsplit(".", 1)[-1].startswith("_"):
            try:
                importlib.import_module(info.name)
            except ImportError:
                assert info.name.startswith("ampkit.integrations."), info.name
    modules = [ampkit] + [getattr(ampkit, n) for n in ampkit.__all__
                          if isinstance(getattr(ampkit, n), types.ModuleType)]
    modules += [m for name, m in sorted(sys.modules.items()) if name.startswith("ampkit.") and hasattr(m, "__all__")]
    return list({id(m): m for m in modules}.values())


def _framework_hook(klass: type, name: str) -> bool:
    """A method of an ampkit.integrations class that overrides its framework's (a Lightning precision plugin's
    hooks): the framework's API, documented there."""
    return klass.__module__.startswith("ampkit.integrations.") and any(
        name in vars(base) for base in klass.__mro__[1:] if not base.__module__.startswith("ampkit"))


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
                if name.startswith("_") or _framework_hook(klass, name):
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


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_every_page_of_the_manual_exists():
    assert all(page.is_file() for page in MARKDOWN), [_relative(p) for p in MARKDOWN if not p.is_file()]


def test_no_run_snippet_is_lost():
    """Every Python block of every page runs unless it is marked NOT_RUN; the pages that have runnable blocks, and
    how many, are pinned in SNIPPETS_RUN, so that a snippet that moves must keep running where it lands."""
    found = {_relative(p): len(python_blocks(p.read_text())) for p in MARKDOWN if p.is_file()}
    found = {doc: n for doc, n in found.items() if n}
    lost = {doc: (found.get(doc, 0), n) for doc, n in SNIPPETS_RUN.items() if found.get(doc, 0) < n}
    assert not lost, f"run snippets (found, expected) went missing: {lost}"
    new = {doc: n for doc, n in found.items() if doc not in SNIPPETS_RUN}
    assert not new, f"pages with runnable snippets that SNIPPETS_RUN does not pin (add them, or mark them): {new}"


@pytest.mark.parametrize("doc", sorted(SNIPPETS_RUN))
def test_documented_python_snippets_run(doc, tmp_path, monkeypatch):
    blocks = python_blocks((ROOT / doc).read_text())
    assert len(blocks) >= SNIPPETS_RUN[doc]
    monkeypatch.chdir(tmp_path)  # recipes write checkpoints to the working directory
    for block in blocks:
        exec(compile(block, f"{doc} snippet", "exec"), {"__name__": "__doc_snippet__"})


# ---- the README is the front door; links lead somewhere ---------------------------------------------------


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, \
        f"README.md has {lines} lines; move the detail into docs/ (at most {README_MAX_LINES})"


def test_readme_links_every_page_of_the_manual():
    linked = {(README.parent / target).resolve() for target, _ in markdown_links(README.read_text())}
    missing = [_relative(p) for p in MARKDOWN[1:] if p.resolve() not in linked]
    assert not missing, f"README.md's documentation map does not link: {missing}"


_LINK = re.compile(r"(?<!!)\[(?:[^\]\n]|\][^(])*?\]\(([^)\s]+)\)|!\[[^\]\n]*\]\(([^)\s]+)\)")


def markdown_links(markdown: str) -> list[tuple[str, str]]:
    """(path, anchor) of every relative link of a markdown text outside code; path "" for an anchor of the page."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    text = re.sub(r"`[^`\n]*`", " ", text)
    links = []
    for m in _LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        links.append((path, anchor))
    return links


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a page: lower case, punctuation dropped, spaces as hyphens, a -N
    suffix for the N-th repeat."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def test_link_parser_finds_what_it_should():
    text = ("[a](docs/x.md) [b](../y.md#sec) [c](#here) [d](https://e.org) ![i](img.png) `[e](no.md)`\n"
            "```\n[f](no.md)\n```\n[`code` text](z.md)")
    assert markdown_links(text) == [("docs/x.md", ""), ("../y.md", "sec"), ("", "here"), ("img.png", ""),
                                    ("z.md", "")]
    assert heading_anchors("# A `b` c\n## Op schemas (`torch.ops.ampkit`)\n### x\n### x\n") == {
        "a-b-c", "op-schemas-torchopsampkit", "x", "x-1"}


def test_every_relative_link_leads_to_a_file_and_heading():
    broken = []
    for page in MARKDOWN:
        for path, anchor in markdown_links(page.read_text()):
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{_relative(page)}: {path} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in heading_anchors(target.read_text()):
                broken.append(f"{_relative(page)}: {path}#{anchor} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


# ---- docs/architecture.md indexes the NOTE comments ---------------------------------------------------------


_NOTE = re.compile(r"NOTE \[([^\]\n]+)\]")
_NOTE_DEFINITION = re.compile(r"^\s*(?://|#)?\s*NOTE \[([^\]\n]+)\]\s*$", re.M)


def source_notes() -> tuple[set[str], dict[str, set[str]]]:
    """(every NOTE title the sources name, title -> the files where a comment opens with it alone on its line)."""
    titles: set[str] = set()
    defined: dict[str, set[str]] = {}
    for folder in ("csrc", "kernels", "python"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".h", ".cpp", ".cu", ".cuh", ".py"):
                continue
            text = path.read_text()
            titles.update(_NOTE.findall(text))
            for title in _NOTE_DEFINITION.findall(text):
                defined.setdefault(title, set()).add(_relative(path))
    return titles, defined


def test_architecture_indexes_every_note():
    titles, defined = source_notes()
    assert {"Deterministic norm", "Compiled steps", "Scaler streams"} <= titles
    assert "kernels/amp_functors.h" in defined["Deterministic norm"]
    rows = {m.group(1): line for line in (DOCS / "architecture.md").read_text().splitlines()
            if line.startswith("| NOTE [") for m in [_NOTE.search(line)]}
    missing = sorted(titles - set(rows))
    assert not missing, f"docs/architecture.md's NOTE index lacks: {missing}"
    stale = sorted(set(rows) - titles)
    assert not stale, f"docs/architecture.md indexes NOTEs no source names: {stale}"
    wrong = {t: sorted(files) for t, files in defined.items() if not any(f"`{f}`" in rows[t] for f in files)}
    assert not wrong, f"docs/architecture.md names another file than the one defining: {wrong}"


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
