"""The package's one-way data flow (docs/DESIGN.md) as a test: each module imports only modules before it.

Lazy imports inside functions count too, so a later refactor cannot quietly make, say, the model
import the trainer or the library import the CLI.
"""

import ast
from pathlib import Path

import lmforge

# The order of docs/DESIGN.md: corpus readers -> tokenizer -> data -> model -> train -> generate/serve, CLI on top.
ORDER = [
    "__init__", "common", "config", "_core", "corpora", "sources",
    "bpe", "tokenizer_train", "tokenizer_io", "tokenizer",
    "shards", "loader", "data",
    "layers", "losses", "model", "optim", "checkpoint", "rundir", "distributed", "metrics", "train",
    "hf", "decoder", "generate", "speedrun",
    "cli",
]
PKG = Path(lmforge.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module == "lmforge":
                found.update(a.name for a in node.names)
            elif node.level == 0 and node.module and node.module.startswith("lmforge."):
                found.add(node.module.split(".")[1])
            elif node.level == 1:
                found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("lmforge."))
    return found


def test_every_module_is_placed_in_the_order():
    modules = {p.stem for p in PKG.glob("*.py")}
    assert modules <= set(ORDER), f"add new modules to ORDER (and docs/DESIGN.md): {sorted(modules - set(ORDER))}"


def test_imports_flow_one_way():
    bad = []
    for p in sorted(PKG.glob("*.py")):
        me = ORDER.index(p.stem)
        for dep in _imported_modules(p):
            if dep == "__version__":
                continue
            if dep not in ORDER:
                bad.append(f"{p.name} imports unknown lmforge.{dep}")
            elif ORDER.index(dep) >= me:
                bad.append(f"{p.name} imports lmforge.{dep}, which comes after it")
    assert not bad, "\n".join(bad)
