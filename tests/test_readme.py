"""The README stays a user's document (issue 33).

Under 800 lines; one "Figures" section whose figures are the current ones, the
history of measurements in bench/HISTORY.md, linked from it; and every file it
links to exists. Read as text: no database.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 800


def _sections(text: str) -> list[str]:
    return re.findall(r"^## (.+)$", text, flags=re.MULTILINE)


def test_the_readme_is_under_800_lines() -> None:
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n < MAX_LINES, (
        f"README.md has {n} lines (under {MAX_LINES}, issue 33): move detail to the "
        "documents it links (docs/design.md, bench/HISTORY.md, the packages' .md files)"
    )


def test_one_figures_section_linking_the_history_of_measurements() -> None:
    text = README.read_text(encoding="utf-8")
    assert _sections(text).count("Figures") == 1
    figures = text.split("\n## Figures\n", 1)[1].split("\n## ", 1)[0]
    assert "(bench/HISTORY.md)" in figures
    assert (ROOT / "bench" / "HISTORY.md").is_file()
    # a before/after pair is history: it belongs in bench/HISTORY.md
    assert "before (two runs)" not in figures


def test_every_relative_link_of_the_readme_exists() -> None:
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    relative = [t for t in targets if "://" not in t]
    assert relative, "no relative link found: the pattern is wrong"
    missing = [t for t in relative if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
