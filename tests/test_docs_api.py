"""docs/API.md's examples run as written: every ```python block, in order, in one namespace, from the repository's
root (so a renamed function or a changed signature fails here, not in a reader's hands)."""

import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "API.md"


def code_blocks(text: str) -> list[tuple[int, str]]:
    """(first line, code) of every ```python block."""
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)]


def test_the_page_has_examples_for_every_package():
    text = PAGE.read_text()
    for package in ("model", "sampling", "rewards", "data", "rl"):
        assert f"## `r3jax.{package}`" in text, package
    assert len(code_blocks(text)) >= 5


def test_every_example_runs(monkeypatch):
    monkeypatch.chdir(ROOT)
    namespace: dict = {"__name__": "docs_api"}
    for line, code in code_blocks(PAGE.read_text()):
        try:
            exec(compile(code, f"{PAGE.relative_to(ROOT)}:{line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"docs/API.md, the block at line {line}: {type(e).__name__}: {e}") from e
    assert os.path.isfile(os.path.join(namespace["out_dir"], "config.json"))
