"""The library's layers: no module of `r3jax/` imports from a layer above its own, counting imports inside
functions (read from the source with `ast`, so nothing is imported to check)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "r3jax"

# Lowest first. A module may import its own package and the packages of lower layers only; the programs
# (train.py, eval.py, scripts/, bench/) sit above them all.
LAYERS = (
    ("compiles", "hosts", "jsonl"),        # utilities
    ("model",),
    ("sampling", "rewards", "data"),
    ("rl",),
    ("eval",),
    ("train",),
)
LAYER_OF = {package: i for i, layer in enumerate(LAYERS) for package in layer}


def package_of(path: pathlib.Path) -> str:
    """The top-level package (or root module) of `r3jax` a source file belongs to."""
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def imported_packages(tree: ast.AST):
    """(line, package) for every `r3jax.<package>` an import statement names, wherever it stands."""
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"line {node.lineno}: relative import; the library imports absolutely")
        packages = {name.split(".")[1] for name in names if name.startswith("r3jax.")}
        yield from ((node.lineno, package) for package in sorted(packages))


SOURCES = sorted(p for p in ROOT.rglob("*.py") if p.name != "__init__.py" or p.parent != ROOT)


def test_every_package_has_a_layer():
    packages = {package_of(p) for p in SOURCES}
    assert packages <= set(LAYER_OF), f"packages with no layer in LAYERS: {sorted(packages - set(LAYER_OF))}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_layer_above_its_own(path):
    own = package_of(path)
    upward = [f"line {line}: r3jax.{package}" for line, package in imported_packages(ast.parse(path.read_text()))
              if package in LAYER_OF and package != own and LAYER_OF[package] >= LAYER_OF[own]]
    assert not upward, (f"{path.relative_to(ROOT.parent)} ({own}, layer {LAYER_OF[own]}) imports from its own "
                        f"layer or above: {upward}")


def test_the_check_sees_an_upward_import_inside_a_function():
    tree = ast.parse("def load():\n    from r3jax.train import checkpoint\n")
    assert list(imported_packages(tree)) == [(2, "train")]
