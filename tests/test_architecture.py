"""The folder tree is the pipeline, and imports flow one way (docs/DESIGN.md), as a test.

Every import counts, also those inside functions, so a later change cannot quietly make the model import
the tokenizer, generation import training, or the library import the CLI.
"""

import ast
from pathlib import Path

import lmforge

PKG = Path(lmforge.__file__).parent

# Shared root modules: any stage may import them; they import only each other.
SHARED = ["common", "config", "checkpoint", "run", "progress", "hardware", "_native"]
# Each stage (a subpackage) and the stages it may import. The model never sees text (no tokenizer, no data);
# generation never sees training.
STAGES = {
    "corpus": set(),
    "tokenizer": {"corpus"},
    "data": {"corpus", "tokenizer"},
    "model": set(),
    "train": {"corpus", "tokenizer", "data", "model"},
    "generate": {"tokenizer", "model"},
    "interop": {"tokenizer", "model", "train", "chat"},
    "chat": {"corpus", "tokenizer", "data", "model", "train", "generate"},
    "serve": {"tokenizer", "model", "generate", "chat"},  # the server only calls the engine (and renders chats)
    "evals": {"corpus", "tokenizer", "data", "model", "generate", "chat"},
    "rl": {"corpus", "tokenizer", "data", "model", "train", "generate", "chat", "evals"},
}
# On top: each may import everything below and the top units named here; nothing imports the CLI.
# report.py owns run reports (it may import any stage); the speedrun writes its report.md through it.
TOP = {"report": set(), "speedrun_chat": set(), "sizing": set(), "speedrun": {"report", "speedrun_chat", "sizing"},
       "cli": {"report", "speedrun", "speedrun_chat", "sizing"}}
# report.py's run cards read eval results (lmforge.evals) and the loss plot (lmforge.train.metrics).
MAX_LINES = 600


def _unit(path: Path) -> str:
    """The stage, shared module or top module a file belongs to (``tokenizer``, ``common``, ``cli`` ...)."""
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> set[str]:
    """Units imported by a file (absolute imports only; lmforge uses no relative ones)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            if node.module == "lmforge":
                found.update(a.name for a in node.names)
            elif node.module and node.module.startswith("lmforge."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("lmforge."))
    return found - {"__version__"}


def _files() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_file_belongs_to_a_known_unit():
    known = set(SHARED) | set(STAGES) | set(TOP) | {"__init__", "_core"}
    units = {_unit(p) for p in _files()}
    assert units <= known, f"place new units in tests/test_architecture.py and docs/DESIGN.md: {sorted(units - known)}"


def test_imports_flow_one_way():
    errors = []
    for path in _files():
        unit = _unit(path)
        for dep in _imports(path) - {unit, "_core"}:
            if dep == "cli":
                errors.append(f"{path.relative_to(PKG)} imports the CLI")
            elif unit in SHARED or unit == "__init__":
                if dep not in SHARED:
                    errors.append(f"shared module {path.relative_to(PKG)} imports {dep}")
            elif unit in STAGES:
                if dep not in SHARED and dep not in STAGES[unit]:
                    errors.append(f"{path.relative_to(PKG)} ({unit}) imports {dep}")
            elif unit in TOP and dep in TOP and dep not in TOP[unit]:
                errors.append(f"{path.relative_to(PKG)} ({unit}) imports {dep}")
    assert not errors, "\n".join(errors)


def test_no_module_is_too_long():
    long = {str(p.relative_to(PKG)): n for p in _files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by noun (over {MAX_LINES} lines): {long}"


def test_no_import_cycles_between_modules():
    """Imports between modules form no cycle, those inside functions too: a lazy import only hides a cycle
    (two modules that need each other), it does not remove it."""
    names = {p: ".".join(("lmforge",) + p.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
             for p in _files()}
    graph: dict[str, set[str]] = {}
    for path, name in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmforge"):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("lmforge"))
        graph[name] = {d for d in deps if d in names.values() and d != name}
    # a package's __init__ importing its own submodules is the usual re-export, not a cycle
    for name in graph:
        graph[name] = {d for d in graph[name] if not (name == d.rsplit(".", 1)[0] or d == name.rsplit(".", 1)[0])}
    seen: dict[str, int] = {}

    def visit(n: str, stack: list[str]) -> None:
        seen[n] = 1
        for d in graph[n]:
            assert seen.get(d) != 1, "import cycle: " + " -> ".join(stack + [n, d])
            if d not in seen:
                visit(d, stack + [n])
        seen[n] = 2

    for n in graph:
        if n not in seen:
            visit(n, [])


def test_importing_lmforge_has_no_side_effects():
    import subprocess
    import sys

    code = ("import logging, sys; import lmforge, lmforge.tokenizer, lmforge.data, lmforge.model, lmforge.train, "
            "lmforge.generate, lmforge.chat, lmforge.evals, lmforge.rl, lmforge.report; assert not logging.getLogger().handlers; assert not logging.getLogger('lmforge').handlers;"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_one_owner_per_fact():
    """The end-of-text token is spelled out once (lmforge.corpus.specials.EOT); everything else imports it."""
    eot = "<|endoftext|>"
    owners = [str(p.relative_to(PKG)) for p in _files() if eot in p.read_text(encoding="utf-8")]
    assert owners == ["corpus/specials.py"], f"import EOT from lmforge.corpus / lmforge.tokenizer instead: {owners}"
    from lmforge.corpus import EOT
    from lmforge.tokenizer import EOT as TOKENIZER_EOT

    assert EOT == TOKENIZER_EOT == eot


def test_tests_mirror_the_package():
    """tests/<stage>/ holds the tests of lmforge/<stage>/; the root the shared modules, the CLI and this file;
    tests/benchmarks/ smoke-runs benchmarks/, tests/tools/ the scripts of tools/; tests/fixtures/ holds committed
    input files."""
    tests = Path(__file__).parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    other = {"benchmarks", "tools", "fixtures"}
    assert folders <= set(STAGES) | other, sorted(folders - set(STAGES) - other)
    for folder in folders - {"fixtures"}:
        assert list((tests / folder).glob("test_*.py")), f"tests/{folder}/ has no tests"
