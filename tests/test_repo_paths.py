"""Every repository path that a tracked ``*.py`` or ``*.md`` file cites exists, and nothing cites
a spec file the repository does not ship."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("sparrow_jax", "pallas_kernels", "scripts", "configs", "tests", "docs", "notes",
       "checkpoints", ".ci")
# A path starts at a top-level folder (or is a top-level file) and runs over path characters
# (possessively: no backtracking into a shorter path); one followed by a glob or template
# character ({, *, <, $) is a pattern, not a path.
CITED = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*+|[A-Z][A-Z_]+\.md)(?![{*<$])"
                   % "|".join(map(re.escape, TOP)))
# Written by runs, not shipped.
GENERATED = ("runs/", ".venv", ".whl")


def _tracked(*patterns):
    """The tracked files matching ``patterns``; in a copy without git (a GPU machine's), every
    such file outside the generated and hidden folders."""
    if (ROOT / ".git").exists():
        out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
        return [ROOT / p for p in out.split()]
    return [f for p in patterns for f in ROOT.rglob(p)
            if not any(part.startswith((".", "__")) or part == "runs"
                       for part in f.relative_to(ROOT).parts[:-1])]


def _citations():
    for f in _tracked("*.py", "*.md"):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            for m in CITED.finditer(line):
                yield f.relative_to(ROOT), n, m.group(1).rstrip(".-/")


def test_cited_paths_exist():
    found = list(_citations())
    assert len(found) > 50  # the pattern finds what it should
    missing = [f"{f}:{n}: {p}" for f, n, p in found
               if not p.startswith(GENERATED) and not (ROOT / p).exists()]
    assert not missing, "\n".join(missing)


def test_no_citations_of_an_unshipped_spec():
    bad = [f"{f.relative_to(ROOT)}:{n}" for f in _tracked("*.py", "*.md", "*.sh", "*.yaml")
           for n, line in enumerate(f.read_text().splitlines(), 1)
           if re.search(r"\bDESIGN\b|\.\./shared", line)]
    assert not bad, bad
