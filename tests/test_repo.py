"""CI runs exactly the test command the README gives; the README has exactly two set-up commands."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"## Set up and run\n(.*?)\n## ", readme, re.S).group(1)
    commands = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert len(commands) == 2 and commands[0].strip().endswith("python train.py")
    command = commands[1].strip()
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci_lines == [command]
