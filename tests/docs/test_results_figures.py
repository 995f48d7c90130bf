"""Every figure a reader is shown comes from a committed result file.

benchmarks/README.md is made of sections, each a paragraph that opens in bold and names the
command that measured it (`--json benchmarks/results/...json`, or the GPU suite's `--out
benchmarks/results/DIR`, whose record is DIR/suite.json). Every number in a section's
tables must be a value of that JSON as written (to the digits shown, in the units the table
uses: ms of seconds, MiB of bytes, % of a fraction), or a ratio of two of its values (the "1.5x"
cells, "+0.9%"). The front page's results summary quotes figures from those tables only: each
number there must appear in the benchmarks README. So a figure cannot drift from its file, and a
table cannot quote a run that left no file."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import ROOT

RESULTS = ROOT / "benchmarks" / "README.md"
NUMBER = re.compile(r"(?<![\w.])([-+]?\d[\d,]*(?:\.\d+)?)\s?(x|%)?")
FRACTION = re.compile(r"(?<![\w.,/])(\d+)/(\d+)(?![\w.,/])")  # "11/32": a share the JSON holds as 0.34375
# the units a table may show a JSON's value in: as stored, s -> ms, ms -> s, fraction -> %, s -> µs,
# bytes -> KiB, MiB, GiB, MB, GB
SCALES = (1, 1e3, 1e-3, 100, 1e6, 1 / 1024, 1 / 1024 ** 2, 1 / 1024 ** 3, 1e-6, 1e-9)


def sections(text: str) -> list[tuple[str, str]]:
    """(title, body) for each paragraph that opens in bold, up to the next one or heading."""
    parts = re.split(r"\n(?=\*\*[^*\n]+\*\*|#)", text)
    return [(re.match(r"\*\*([^*]+)\*\*", p).group(1), p) for p in parts if p.startswith("**")]


def tables(body: str) -> list[list[str]]:
    """Each table's data cells, row by row: the header, the rule and the first column (each row's
    label: a layout, a page size, a rate, what was run) left out."""
    rows, found = [], []
    for line in body.splitlines() + [""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            found.append([cell for row in rows[2:] for cell in row[1:]])
            rows = []
    return found


def leaves(node) -> list[float]:
    """A JSON's numbers, less raw sample lists (which would match any figure)."""
    if isinstance(node, dict):
        return [x for k, v in node.items() if not k.startswith("samples") for x in leaves(v)]
    if isinstance(node, list):
        return [x for v in node for x in leaves(v)]
    return [float(node)] if isinstance(node, (int, float)) and not isinstance(node, bool) else []


def shown(value: float, written: str) -> bool:
    """Whether `value` is `written` to the digits written."""
    decimals = len(written.partition(".")[2])
    target = float(written.replace(",", "").lstrip("+"))
    return abs(value - target) <= 0.5 * 10 ** -decimals * (1 + 1e-9) + 1e-12


def sourced(written: str, unit: str, values: list[float]) -> bool:
    """Whether a figure written with `unit` after it ("x", "%", "ms", ...) is one of `values`:
    as it is, in another unit, or (a ratio, "x", or a change, "+N%") two values divided."""
    if unit == "x" or (unit == "%" and written[0] in "+-"):
        ratios = [a / b for a in values for b in values if b]
        return any(shown(r if unit == "x" else (r - 1) * 100, written) for r in ratios)
    return any(shown(v * s, written) for v in values for s in SCALES)


def sections_with_files() -> list[tuple[str, list[Path], list[list[str]]]]:
    found = []
    for title, body in sections(RESULTS.read_text()):
        files = sorted({ROOT / m for m in re.findall(r"--json\s+(benchmarks/results/\S+?\.json)", body)}
                       | {ROOT / m / "suite.json" for m in re.findall(r"--out\s+(benchmarks/results/[\w.-]+)", body)})
        found.append((title, files, tables(body)))
    return found


SECTIONS = sections_with_files()


def test_the_results_have_sections_with_tables():
    assert sum(bool(t) for _, _, t in SECTIONS) >= 12, [title for title, _, _ in SECTIONS]


@pytest.mark.parametrize("title, files, cells", [s for s in SECTIONS if s[2]], ids=[s[0] for s in SECTIONS if s[2]])
def test_every_table_figure_is_in_its_json(title, files, cells):
    assert files, f"section {title!r} has tables but names no --json file"
    values = [x for f in files for x in leaves(json.loads(f.read_text()))]
    unsourced = []
    for cell in (cell for table in cells for cell in table):
        for a, b in FRACTION.findall(cell):
            if not any(abs(v - int(a) / int(b)) < 1e-9 for v in values):
                unsourced.append((cell, f"{a}/{b}"))
        unsourced += [(cell, n + unit) for n, unit in NUMBER.findall(FRACTION.sub("", cell))
                      if not sourced(n, unit, values)]
    assert not unsourced, f"{title}: figures not in {[f.name for f in files]}: {unsourced}"


def test_the_front_page_quotes_only_figures_of_the_results():
    """The summary's figures (and what they are set against) are only numbers that stand in the
    results' tables, which the test above ties to their JSON."""
    summary = (ROOT / "README.md").read_text().partition("## Results at a glance")[2].partition("\n## ")[0]
    figures = [cell for table in tables(summary) for cell in table]
    assert len(figures) >= 20, summary
    in_tables = {n for _, _, cells in SECTIONS for table in cells for cell in table for n, _ in NUMBER.findall(cell)}
    missing = [(cell, n) for cell in figures for n, _ in NUMBER.findall(re.sub(r"`[^`]*`", "", cell))  # `code`: names
               if n not in in_tables]
    assert not missing, missing


def github_slug(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_every_link_into_the_results_lands_on_its_section():
    """A link `benchmarks/README.md#name` from any page of the repository names a heading of the
    results or an `<a id="name">` set before the bold paragraph it means (GitHub gives bold
    paragraphs no anchor, so without one the link opens the page's top)."""
    text = RESULTS.read_text()
    targets = {github_slug(m) for m in re.findall(r"^#+\s+(.*)$", text, re.M)} | set(re.findall(r'<a id="([\w-]+)"></a>', text))
    pages = [p for p in ROOT.rglob("*.md") if not {".venv", ".git", "node_modules"} & set(p.relative_to(ROOT).parts)]
    links = {(p.relative_to(ROOT).as_posix(), name) for p in pages
             for name in re.findall(r"benchmarks/README\.md#([\w-]+)", p.read_text())}
    assert links
    assert not [(page, name) for page, name in sorted(links) if name not in targets]
