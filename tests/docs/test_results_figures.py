"""Every figure a reader is shown names the JSON file and field it comes from, and equals it.

In README.md and benchmarks/README.md a figure is a link whose target is its result file and,
after `#`, the JSON Pointer (RFC 6901) of its field: `[1.44x](results/cpu/x.json#/rows/1/ratio)`.
A ratio of two fields of one file is `#/a:/b` (a / b); `*k` after the pointer scales it (1000:
seconds shown as ms); a list's value is its length; a space in a field's name is %20; a figure
written with % is its field times 100. The figure must equal the
value rounded to the digits written. Every number in a results table stands in such a link, but
in the columns that describe rather than measure (the first column, machine, settings, what the
comparison leaves out). `check` names each figure that fails: the file missing, the field
missing, or the value not the one written; the tests below also change a figure, a field and a
file on purpose and see the check fail."""
from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import unquote

import pytest
from helpers import ROOT

DOCUMENTS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
FIGURE = re.compile(r"\[([^\]\[]*?\d[^\]\[]*?)\]\(([^)\s#]+\.json)#([^)\s]+)\)")
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
DESCRIPTIVE = {"machine", "settings", "what it leaves out", "leaves out", "command", "run", "runs", "setup",
               "workload", "commit", "of what", "date", "notes", "goal"}


def resolve(data, pointer: str):
    node = data
    for part in pointer.lstrip("/").split("/") if pointer.strip("/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def value_of(path: Path, fragment: str) -> float:
    """The value a link names: one field, or a ratio of two (`:`), scaled by `*k`."""
    expression, _, scale = unquote(fragment).partition("*")
    data = json.loads(path.read_text())
    nodes = [resolve(data, p) for p in expression.split(":")]
    parts = [float(len(n) if isinstance(n, list) else n) for n in nodes]
    value = parts[0] / parts[1] if len(parts) == 2 else parts[0]
    return value * (float(scale) if scale else 1.0)


def matches(value: float, label: str) -> bool:
    written = NUMBER.search(label).group(0)
    decimals = len(written.partition(".")[2])
    target = float(written.replace(",", "").lstrip("+"))
    if "%" in label:
        value *= 100
    return abs(value - target) <= 0.5 * 10 ** -decimals * (1 + 1e-9) + 1e-12


def figures(text: str) -> list[tuple[str, str, str]]:
    return FIGURE.findall(text)


def check(document: Path, text: str | None = None) -> list[str]:
    """What is wrong with the document's figures, one line each (none: every figure is its field)."""
    text = document.read_text() if text is None else text
    errors = []
    for label, target, fragment in figures(text):
        path = (document.parent / target).resolve()
        where = f"{document.name}: {label!r} ({target}#{fragment})"
        if not path.is_file():
            errors.append(f"{where}: {target} is not there")
            continue
        try:
            value = value_of(path, fragment)
        except (KeyError, IndexError, ValueError, TypeError, ZeroDivisionError) as exc:
            errors.append(f"{where}: no such field ({type(exc).__name__}: {exc})")
            continue
        if not matches(value, label):
            errors.append(f"{where}: the field holds {value:.6g}")
    return errors + unsourced(document, text)


def unsourced(document: Path, text: str) -> list[str]:
    """Numbers in a results table's measuring columns that are not a sourced figure."""
    errors, header = [], None
    for line in text.splitlines() + [""]:
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set(line) <= set("|-: "):
            continue
        for name, cell in zip(header[1:], cells[1:]):
            if name in DESCRIPTIVE:
                continue
            bare = FIGURE.sub("", cell)
            bare = re.sub(r"\]\([^)]*\)", "]", bare)  # (a link's address holds digits of its own)
            if re.search(r"(?<![A-Za-z_\d])\d", bare):  # (not a name's digits: fp32, p99, e4m3)
                errors.append(f"{document.name}: {cells[0]!r}, column {name!r}: {cell!r} has a figure with no source")
    return errors


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_figure_is_the_field_it_names(document):
    assert figures(document.read_text()), f"{document} shows no sourced figure"
    assert check(document) == []


def test_a_changed_figure_a_missing_field_and_a_moved_file_fail_by_name():
    document = DOCUMENTS[0]
    text = document.read_text()
    label, target, fragment = figures(text)[0]
    number = NUMBER.search(label).group(0)
    changed = label.replace(number, number[:-1] + str((int(number[-1]) + 1) % 10), 1)
    errors = check(document, text.replace(f"[{label}]({target}#{fragment})", f"[{changed}]({target}#{fragment})", 1))
    assert len(errors) == 1 and target in errors[0] and "the field holds" in errors[0], errors
    errors = check(document, text.replace(f"({target}#{fragment})", f"({target}#{fragment}/nowhere)", 1))
    assert len(errors) == 1 and "no such field" in errors[0], errors
    errors = check(document, text.replace(f"({target}#{fragment})", f"(moved/{target}#{fragment})", 1))
    assert len(errors) == 1 and "is not there" in errors[0], errors


def test_a_figure_in_a_table_without_its_source_fails():
    table = "| question | vkv | machine |\n| --- | --- | --- |\n| speed | 1.50x | 2 vCPUs |\n"
    errors = check(DOCUMENTS[1], table)
    assert len(errors) == 1 and "'1.50x' has a figure with no source" in errors[0], errors


def anchors(document: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    heads = re.findall(r"^#+ (.*)$", document.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_link_in_the_documents_reaches_its_file_and_heading():
    history = ROOT / "benchmarks" / "results" / "HISTORY.md"
    broken = []
    for document in DOCUMENTS + [ROOT / "engine" / "README.md", history]:
        for target in re.findall(r"\]\(([^)\s]+)\)", document.read_text()):
            path, _, fragment = target.partition("#")
            if target.startswith(("http://", "https://")):
                continue
            file = (document.parent / path).resolve() if path else document
            if not file.exists():
                broken.append(f"{document.name}: {target}: no such file")
            elif fragment and file.suffix == ".md" and fragment not in anchors(file):
                broken.append(f"{document.name}: {target}: no such heading")
    assert broken == []


def test_every_result_file_is_listed_once_in_the_history():
    results = ROOT / "benchmarks" / "results"
    listed = re.findall(r"\]\(([^)\s]+\.json)\)", (results / "HISTORY.md").read_text())
    present = sorted(str(p.relative_to(results)) for p in results.rglob("*.json"))
    assert sorted(listed) == present
