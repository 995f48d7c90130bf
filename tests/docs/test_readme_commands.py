"""Every `vkv` command the READMEs show exists and answers --help, and every benchmark command they
show names a script that exists and flags it takes; `vkv profile-mapping` runs."""
import json
import re
import subprocess
import sys

import pytest
from helpers import ROOT

DOCS = [ROOT / "README.md", ROOT / "engine" / "README.md", ROOT / "benchmarks" / "README.md"]
TEXT = "\n".join(doc.read_text() for doc in DOCS)
COMMANDS = sorted(set(re.findall(r"(?:^[ \t]+|`)(?:\.venv/bin/)?vkv ([a-z][a-z-]+)", TEXT, re.MULTILINE)))
# `python benchmarks/NAME.py --flag ...` as the docs show them, a command a line
BENCHMARKS = re.findall(r"python (benchmarks/\w+\.py)((?:[ \t]+--?[\w-]+(?:[ \t]+[^\s`-][^\s`]*)*)*)", TEXT)


def vkv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from engine.cli import main; main()", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_the_readme_shows_the_commands():
    assert {"generate", "serve", "profile-mapping"} <= set(COMMANDS), COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_each_readme_command_answers_help(command, capsys):
    """In this process (`vkv` itself starts in a process of its own below: profile-mapping)."""
    from engine.cli import main
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0 and "usage: vkv " + command in capsys.readouterr().out


def test_profile_mapping_sweeps_page_sizes_and_writes_json_and_plot(tmp_path):
    done = vkv("profile-mapping", "--backend", "host", "--pages", "8", "--repeats", "2", "--page-sizes", "4096,65536",
               "--json", str(tmp_path / "m.json"), "--plot", str(tmp_path / "m.png"))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "m.json").read_text())
    assert [r["page_size"] for r in result["sweep"]] == [4096, 65536]
    assert all(r["per_page"]["map"]["n"] == 8 for r in result["sweep"]) and result["machine"]["cpu_model"]
    assert (tmp_path / "m.png").stat().st_size > 10_000
    bad = vkv("profile-mapping", "--page-sizes", "4k")
    assert bad.returncode == 2 and "--page-sizes" in bad.stderr


def test_each_benchmark_command_shown_names_a_script_and_its_flags():
    assert len(BENCHMARKS) >= 15, BENCHMARKS
    common = (ROOT / "benchmarks" / "common.py").read_text()
    for script, args in BENCHMARKS:
        source = (ROOT / script).read_text()
        if "from common import" in source:  # flags the benchmarks share are defined there
            source += common
        for flag in re.findall(r"(--[\w-]+)", args):
            assert f'"{flag}"' in source, (script, flag)
