"""The front door stays what it promises: README's two commands exist, every relative link in the
docs resolves, every block marked runnable runs on CPU, every results table matches the results
file it names, and benchmarks/results/ and README.md stay small."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import summary

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted([README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
RESULTS = ROOT / "benchmarks" / "results"
RUNNABLE = "<!-- runnable -->"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
SUMMARY = re.compile(r"^<!-- python -m benchmarks\.summary (\S+)(.*) -->$")

if not README.exists():  # a copy of the sources without the docs (an sdist, the GPU check's dry run)
    pytest.skip("no README.md in this checkout", allow_module_level=True)


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def code_block_after(lines: list[str], index: int) -> tuple[str, str]:
    """The language and text of the fenced block that starts on the line after ``index``."""
    opening = lines[index + 1].strip() if index + 1 < len(lines) else ""
    assert opening.startswith("```"), f"line {index + 2}: {RUNNABLE} must be followed by a code block"
    end = next(i for i in range(index + 2, len(lines)) if lines[i].strip().startswith("```"))
    return opening[3:].strip(), "\n".join(lines[index + 2 : end])


def runnable_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for index, line in enumerate(lines):
            if line.strip() == RUNNABLE:
                language, code = code_block_after(lines, index)
                assert language == "python", f"{path.name}:{index + 1}: only python blocks are runnable"
                blocks.append((f"{path.relative_to(ROOT)}:{index + 1}", code))
    return blocks


def test_readme_is_short_and_puts_install_and_quick_start_first() -> None:
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 200 and len(text.encode()) <= 12 * 1024, (len(lines), len(text.encode()))
    assert any(line.startswith("pip install") for line in lines[:40]), "pip install within 40 lines"
    assert any(line.startswith("```python") for line in lines[:60]), "a Python block within 60 lines"
    top = "\n".join(lines[:12])
    assert "**Status.**" in top and "GPU" in top, "the status (CPU and GPU) near the top"


def test_pyproject_long_description_is_the_readme() -> None:
    assert re.search(r'^readme = "README.md"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)


def test_readme_two_commands_are_make_targets() -> None:
    lines = README.read_text().splitlines()
    heading = lines.index("## The two commands")
    start = next(i for i in range(heading, len(lines)) if lines[i].startswith("```"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    commands = [line.split("#")[0].strip() for line in lines[start + 1 : end]]
    assert commands == ["make demo", "make test"]
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    assert {"demo", "test"} <= targets


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    missing = []
    for number, line in prose_lines(path):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            resolved = (path.parent / target.split("#")[0]).resolve()
            if not resolved.exists():
                missing.append(f"line {number}: {target}")
    assert not missing, f"{path.name}: links that do not resolve: {missing}"


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_tracker_or_run_numbers_in_user_docs(path: Path) -> None:
    if path.name == "CHANGELOG.md":
        return
    for number, line in prose_lines(path):
        found = re.search(r"\b(issue|run) #?\d+\b", line, re.IGNORECASE)
        assert not found, f"line {number}: {line}"


@pytest.mark.parametrize(("where", "code"), runnable_blocks(), ids=[where for where, _ in runnable_blocks()])
def test_runnable_block_runs_on_cpu(where: str, code: str, tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{where}:\n{done.stdout}\n{done.stderr}"


def test_readme_has_one_performance_table() -> None:
    markers = [line for _, line in prose_lines(README) if SUMMARY.match(line)]
    assert len(markers) == 1, markers


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_results_tables_match_their_results_file(path: Path) -> None:
    lines = path.read_text().splitlines()
    for index, line in enumerate(lines):
        found = SUMMARY.match(line)
        if not found:
            continue
        options = found.group(2).split()
        kind = options[options.index("--table") + 1] if "--table" in options else "steps"
        threads = int(options[options.index("--threads") + 1]) if "--threads" in options else None
        results = json.loads((ROOT / found.group(1)).read_text())
        expected = summary.render(results, kind, threads, "--short" in options)
        assert lines[index + 1 : index + 1 + len(expected)] == expected, (
            f"{path.name}:{index + 1}: the table differs from {found.group(1)}; "
            f"render it again with: {line[5:-4]}"
        )


def test_results_folder_holds_one_small_json_per_platform() -> None:
    files = sorted(path.name for path in RESULTS.iterdir())
    assert all(re.fullmatch(r"(cpu|cuda)-[a-z0-9-]+\.json", name) for name in files), files
    assert sum(path.stat().st_size for path in RESULTS.iterdir()) <= 1 << 20
    for name in files:
        results = json.loads((RESULTS / name).read_text())
        assert results["platform"] == name.removesuffix(".json")
        assert {"date", "commit", "processor", "torch", "threads", "command"} <= set(results["environment"])
