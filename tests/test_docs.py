"""The front door stays what it promises: README's two commands exist, every relative link in the
docs resolves, every block marked runnable runs on CPU, every other documented call of fusedamp
matches the real signature, every results table (and its note when its code changed since the
run) and the GPU status match the results file they name, and benchmarks/results/ and README.md
stay small."""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import fusedamp
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
    markers = [line for _, line in prose_lines(README) if SUMMARY.match(line) and "gpu-status" not in line]
    assert len(markers) == 1, markers


def test_readme_status_of_the_gpu_is_rendered_from_its_results() -> None:
    """What ran on a GPU, at which commits, stated once from the GPU results file: not by hand."""
    top = README.read_text().splitlines()[:20]
    assert "<!-- python -m benchmarks.summary benchmarks/results/cuda-h200.json --table gpu-status -->" in top


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_results_tables_match_their_results_file(path: Path) -> None:
    """Every block under a benchmarks.summary marker is what it renders from the results file now,
    the note under it included: a table measured before a change to the code it measures says so
    (where git can tell; see benchmarks/summary.py's MEASURES)."""
    lines = path.read_text().splitlines()
    assert summary.updated_lines(lines) == lines, (
        f"{path.name}: a results block differs from its file; render them again with: "
        f"python -m benchmarks.summary --update {path.relative_to(ROOT)}"
    )


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root,
                          capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_a_table_measured_before_its_code_changed_gets_the_note(tmp_path: Path) -> None:
    """In a repository of its own: a change to a measured file after the run's commit (in the work
    tree or committed) marks the table; other files do not; an unknown commit or no repository
    leaves the note to the file (None)."""
    repo, plain = tmp_path / "repo", tmp_path / "plain"
    kernel, readme = repo / "csrc" / "cpu" / "kernel.cpp", repo / "csrc" / "README.md"
    kernel.parent.mkdir(parents=True)
    plain.mkdir()
    kernel.write_text("1")
    readme.write_text("1")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "measured")
    commit = _git(repo, "rev-parse", "HEAD")
    results: dict[str, Any] = {"platform": "cpu-x", "environment": {"commit": commit}}
    assert summary.note(results, "steps", repo) == ""
    readme.write_text("2")
    _git(repo, "commit", "-q", "-am", "docs only")
    assert summary.note(results, "steps", repo) == ""
    kernel.write_text("2")
    assert summary.note(results, "steps", repo) == summary.STALE_NOTE
    _git(repo, "commit", "-q", "-am", "a kernel change")
    assert summary.note(results, "steps", repo) == summary.STALE_NOTE
    assert summary.note(results, "gemm", repo) == ""  # the GEMM's figures measure other files
    assert summary.note(results, "steps", plain) is None
    results["environment"]["commit"] = "0" * 40
    assert summary.note(results, "steps", repo) is None


# --- Documented calls against the real signatures ---------------------------------------------------

CODE_SPAN = re.compile(r"`([^`]+)`")
KEYWORD_ONLY = "__keyword_only__"


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the python blocks not marked runnable (those run), with a signature's bare
    ``*`` (keyword-only from here) turned into a keyword argument so that the text parses."""
    lines = path.read_text().splitlines()
    blocks = []
    for index, line in enumerate(lines):
        if line.strip() == "```python" and (index == 0 or lines[index - 1].strip() != RUNNABLE):
            end = next(i for i in range(index + 1, len(lines)) if lines[i].strip().startswith("```"))
            text = textwrap.dedent("\n".join(lines[index + 1 : end]))  # a block inside a list item
            blocks.append((index + 2, re.sub(r"(?<=[(,])(\s*)\*(\s*),", rf"\1{KEYWORD_ONLY}=None,\2", text)))
    return blocks


def resolve(node: ast.expr) -> Any:
    """The fusedamp object a call's function names (``fusedamp.x.y``, or a bare name that fusedamp
    exports, as prose writes ``FusedAdamW(...)``), else None."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    names.append(node.id)
    names.reverse()
    if names[0] != "fusedamp":
        if len(names) != 1 or names[0] not in fusedamp.__all__:
            return None
        names.insert(0, "fusedamp")
    found: Any = fusedamp
    for name in names[1:]:
        found = getattr(found, name)  # an AttributeError is a documented name that does not exist
    return found


def signature_problems(call: ast.Call, statement: bool, in_block: bool = True) -> list[str]:
    """What ``call`` gets wrong about the signature of the fusedamp callable it names. A statement
    whose positional arguments are bare names and that gives a keyword a value is a signature as
    documented (``fusedamp.autocast(device_type, dtype=None, *, fused_gemm=False)``; in a code span
    of the prose, with a positional argument: ``FusedMuon(moments="int8")`` there is shorthand):
    every parameter, in order, with its default and kind. Any other call must bind (``...`` stands
    for arguments left out)."""
    target = resolve(call.func)
    if target is None:
        return []
    try:
        signature = inspect.signature(target)
    except ValueError:  # a pybind function: no signature to compare with
        return []
    label = ast.unparse(call.func)
    positional = [arg for arg in call.args if not isinstance(arg, ast.Starred)]
    keywords = [keyword for keyword in call.keywords if keyword.arg is not None]
    documented = (statement and keywords and (in_block or positional)
                  and all(isinstance(arg, ast.Name) for arg in positional))
    if not documented:
        if any(isinstance(arg, ast.Constant) and arg.value is Ellipsis for arg in positional):
            positional = []
        try:
            signature.bind_partial(*positional, **{keyword.arg: None for keyword in keywords})
        except TypeError as error:
            return [f"{label}(...): {error}"]
        return []
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    written = [(arg.id, inspect.Parameter.empty, kind) for arg in positional]
    for keyword in keywords:
        if keyword.arg == KEYWORD_ONLY:
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        default = eval(compile(ast.Expression(keyword.value), "<docs>", "eval"), {"torch": torch})
        written.append((keyword.arg, default, kind))
    real = [(p.name, p.default, p.kind) for p in signature.parameters.values()]
    if written != real:
        return [f"{label}: documented {written}, real {real}"]
    return []


def documented_calls(path: Path) -> list[tuple[str, ast.Call, bool, bool]]:
    """(where, call, whether it is a statement of its own, whether in a python block) for every call
    in the python blocks that do not run and in the code spans of the prose that parse as Python."""
    calls = []
    sources = [(f"{path.name}:{line}", text, True) for line, text in python_blocks(path)]
    sources += [(f"{path.name}:{number}", span, False) for number, line in prose_lines(path)
                for span in CODE_SPAN.findall(line) if "(" in span]
    for where, text, in_block in sources:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            assert not in_block, f"{where}: a python block that does not parse"
            continue  # a code span that is not Python
        statements = {id(s.value) for s in tree.body if isinstance(s, ast.Expr)}
        calls += [(where, node, id(node) in statements, in_block)
                  for node in ast.walk(tree) if isinstance(node, ast.Call)]
    return calls


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_documented_calls_match_the_signatures(path: Path) -> None:
    problems = [f"{where}: {problem}" for where, call, statement, in_block in documented_calls(path)
                for problem in signature_problems(call, statement, in_block)]
    assert not problems, "\n".join(problems)


def test_ops_page_names_each_op_with_its_schema_arguments() -> None:
    """docs/ops.md's table names each torch.ops.fusedamp op with its schema's arguments, in order
    (``...``: the others)."""
    problems = []
    for number, line in prose_lines(ROOT / "docs" / "ops.md"):
        if not line.startswith("| `"):
            continue
        for span in CODE_SPAN.findall(line.split("|")[1]):
            call = ast.parse(span).body[0].value  # type: ignore[attr-defined]
            schema = getattr(torch.ops.fusedamp, call.func.id).default._schema
            real = [argument.name for argument in schema.arguments]
            written = [arg.id for arg in call.args if isinstance(arg, ast.Name)]
            rest = any(isinstance(arg, ast.Constant) and arg.value is Ellipsis for arg in call.args)
            if written != (real[: len(written)] if rest else real):
                problems.append(f"ops.md:{number}: {span}, schema {real}")
    assert not problems, "\n".join(problems)


def test_the_signature_check_can_fail() -> None:
    def check(text: str) -> list[str]:
        tree = ast.parse(re.sub(r"(?<=[(,])(\s*)\*(\s*),", rf"\1{KEYWORD_ONLY}=None,\2", text))
        return signature_problems(tree.body[0].value, True)  # type: ignore[attr-defined]

    assert check('fusedamp.ops.gemm(a, b, bias=None, activation="none", out_dtype=None)') == []
    assert check('fusedamp.ops.gemm(a, b, bias=None, activation="gelu", out_dtype=None)')  # a default
    assert check('fusedamp.ops.gemm(a, b, bias=None, out_dtype=None)')  # a parameter left out
    assert check('fusedamp.ops.gemm(a, b, *, bias=None, activation="none", out_dtype=None)')  # a kind
    assert check('fusedamp.nn.Linear(4, 8, True, "gelu")') == []  # binds (device="gelu")
    assert check('fusedamp.ops.gemm(x, w, act="gelu")')  # no such keyword


def test_results_folder_holds_one_small_json_per_platform() -> None:
    files = sorted(path.name for path in RESULTS.iterdir())
    assert all(re.fullmatch(r"(cpu|cuda)-[a-z0-9-]+\.json", name) for name in files), files
    assert sum(path.stat().st_size for path in RESULTS.iterdir()) <= 1 << 20
    for name in files:
        results = json.loads((RESULTS / name).read_text())
        assert results["platform"] == name.removesuffix(".json")
        assert {"date", "commit", "processor", "torch", "threads", "command"} <= set(results["environment"])


def test_a_results_file_records_the_settings_its_command_ran_under() -> None:
    """The command a results file keeps reproduces the run: the ISA and thread settings it ran
    under are part of it, build settings (in build_info) and the rest of the environment not."""
    from benchmarks.__main__ import command_line

    settings = {
        "FUSEDAMP_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "FUSEDAMP_CPU_ISAS": "all", "HOME": "/root"
    }
    assert command_line(["--only", "optim,unscale"], settings) == (
        "ATEN_CPU_CAPABILITY=avx2 FUSEDAMP_CPU_ISA=avx2 python -m benchmarks --only optim,unscale"
    )
    assert command_line([], {}) == "python -m benchmarks"
