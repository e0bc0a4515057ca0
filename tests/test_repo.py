"""CI runs exactly the test command the README gives, after a smoke run of the README's run line; the README has
exactly two set-up commands."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"## Set up and run\n(.*?)\n## ", readme, re.S).group(1)
    return [c.strip() for c in re.findall(r"```bash\n(.*?)\n```", section, re.S)]


def ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
            if line.strip() and not line.startswith(("#", "set ", "cd "))]


def test_ci_runs_the_readme_test_command():
    commands = readme_commands()
    assert len(commands) == 2 and commands[0].endswith("python train.py")
    assert ci_lines()[-1] == commands[1]


def test_ci_smoke_runs_the_readme_run_line_without_the_test_extra():
    """The run line's install (`pip install -e .`, no extra) in a venv of its own, then train.py and eval.py."""
    install = readme_commands()[0].removesuffix("&& python train.py").strip().split("&& ")[-1]
    lines = ci_lines()
    venv = next(i for i, line in enumerate(lines) if "pip install" in line)
    assert install in lines[venv] and "[test]" not in lines[venv] and ".venv-run" in lines[venv], lines[venv]
    rest = "\n".join(lines[venv + 1:-1])
    assert "python train.py" in rest and "python eval.py" in rest and "/final" in rest


def test_the_readme_is_a_front_door():
    """At most 200 lines: what the project is, the two commands, what the default run prints, then a short
    section per program pointing to its page."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the details belong in docs/"


def test_every_relative_link_of_the_shipped_texts_resolves():
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+://", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
