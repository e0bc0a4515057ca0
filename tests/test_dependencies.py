"""Every package the shipped code imports is declared in setup.cfg, so `pip install -e .` alone runs it.

A run-time dependency that only the test extra brings in (torch pulls jinja2, which transformers needs for chat
templates and does not declare) works in every test venv and fails on a user's machine; CI's smoke run of the
README's run line catches those at run time, this test catches a new import at once.
"""

import ast
import configparser
import importlib.metadata
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = [*(ROOT / "r3jax").rglob("*.py"), ROOT / "train.py", ROOT / "eval.py", *(ROOT / "scripts").glob("*.py")]
# packages that transformers needs at run time for what r3jax does with it, without declaring them
UNDECLARED_BY_TRANSFORMERS = {"jinja2"}  # apply_chat_template


def requirement_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(re.split(r"[<>=!~\[; ]", line)[0].lower().replace("_", "-"))
    return names


def declared() -> tuple[set[str], set[str]]:
    """(install_requires, every extra) as normalised distribution names."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = set()
    for _, value in cfg["options.extras_require"].items():
        extras |= requirement_names(value)
    return requirement_names(cfg["options"]["install_requires"]), extras


def imported_modules(path: pathlib.Path) -> set[str]:
    """Top-level names of the absolute imports in a file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_import_of_the_shipped_code_is_declared():
    required, extras = declared()
    owners = importlib.metadata.packages_distributions()
    local = {"r3jax", "make_arith_base", "launch_common"} | {p.stem for p in (ROOT / "scripts").glob("*.py")}
    missing = []
    for path in SHIPPED:
        for module in sorted(imported_modules(path) - set(sys.stdlib_module_names) - local):
            dists = {d.lower().replace("_", "-") for d in owners.get(module, [module])}
            if not dists & (required | extras):
                missing.append(f"{path.relative_to(ROOT)}: import {module} ({sorted(dists)})")
    assert not missing, "imported but not declared in setup.cfg:\n" + "\n".join(missing)


def test_what_transformers_needs_undeclared_is_declared():
    required, _ = declared()
    assert UNDECLARED_BY_TRANSFORMERS <= required
