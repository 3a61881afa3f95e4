"""The README is a front page and the docs are a site that builds: a README that grows back into a manual, a
link to a file that moved, or a page MkDocs cannot build fails here, not in a reader's browser."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# the README's two commands, exactly: .ci/run and the docs quote them, and a new reader runs them first
COMMANDS = ("bash scripts/bootstrap.sh && .venv/bin/python examples/demo.py",
            "bash scripts/bootstrap.sh && .venv/bin/python -m pytest -q -n 3 tests")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
# [text](target): inline links; images too. Targets with a scheme (https:, mailto:) and pure anchors are not files
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _without_code(text: str) -> str:
    # a link inside a code block or a code span is an example, not a link
    text = FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def _relative_links(page: Path):
    for target in LINK.findall(_without_code(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        yield target, (page.parent / target.split("#", 1)[0]).resolve()


def test_readme_is_a_front_page_of_at_most_300_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move the detail to a page in docs/ and link it"


def test_readme_opens_with_its_two_commands_before_any_other_code():
    first = FENCE.search(README.read_text(encoding="utf-8"))
    assert first is not None, "README.md has no code block"
    block = first.group(1)
    for command in COMMANDS:
        assert command in block, f"README.md's first code block lacks {command!r}:\n{block}"


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_at_a_file_that_exists(page):
    broken = [target for target, path in _relative_links(page) if not path.exists()]
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"
    if page == README:   # the README's links into docs/ are the site's pages: each must be one
        outside = [t for t, p in _relative_links(page) if p.is_relative_to(DOCS) and p.suffix != ".md"]
        assert not outside, f"README.md links into docs/ at something that is not a page: {outside}"


def test_the_site_builds_in_strict_mode_without_a_warning(tmp_path):
    """What CI builds: `mkdocs build --strict` fails on a broken link or anchor, a page outside the nav, a nav
    entry without a page (mkdocs.yml's validation settings), and on a docstring mkdocstrings cannot render."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        mkdocs = Path(shutil.which("mkdocs") or "mkdocs")
    # the package is read from this checkout (mkdocs.yml's handler paths), not from an installed copy
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    start = time.monotonic()
    out = subprocess.run([str(mkdocs), "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    seconds = time.monotonic() - start
    log = out.stdout + out.stderr
    assert out.returncode == 0, f"mkdocs build --strict failed (exit {out.returncode}) in {seconds:.1f} s:\n{log}"
    warnings = [line for line in log.splitlines() if line.lstrip().startswith("WARNING")]
    assert not warnings, "\n".join(warnings)
    assert (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8").count("TrainerWrapper") > 0, \
        "the API reference rendered without TrainerWrapper: mkdocstrings found no docstrings"
