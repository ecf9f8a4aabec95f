"""The README stays a user document: short, its links resolve, and CI runs its test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_is_short():
    assert len(README.splitlines()) <= 250


def test_links_resolve():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    local = [link for link in links if not link.startswith("http")]
    assert local, "no local links found: the pattern is wrong"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def test_ci_runs_the_readme_test_command():
    commands = [c for c in re.findall(r"```bash\n(pip install -e [^\n]+)\n```", README) if "&&" in c]
    assert commands[:2] == ['pip install -e . && dflash-mlx generate "What is the capital of France?"',
                            'pip install -e ".[test]" && python -m pytest -q'], commands
    test_command = commands[1].split("&& ")[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines()[-1] or any(
        line.strip().startswith(test_command) for line in ci.splitlines())
