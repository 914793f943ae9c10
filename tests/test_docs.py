"""README.md and docs/ stay true to the repository: no work-history wording, every file they
cite exists, every block marked runnable runs, the troubleshooting page matches the errors the
code raises, and the README's results table is the one ``python -m benchmarks.summary`` makes."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import summary

REPO = Path(__file__).resolve().parents[1]
SKIP = {".git", ".venv", "autopar.egg-info", "node_modules", ".pytest_cache"}
USER_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DOCS = ["getting-started.md", "concepts.md", "training.md", "cost-model.md", "troubleshooting.md", "design.md"]
RUNNABLE = "<!-- runnable -->"
SOURCES = ("autopar", "passes", "costmodels")


def markdown_files() -> list[Path]:
    """Every Markdown file of the repository, the dated benchmark results included (not the
    gitignored output folder ``results/`` the benchmarks write by default)."""
    return sorted(p for p in REPO.rglob("*.md")
                  if not SKIP & set(p.relative_to(REPO).parts) and p.relative_to(REPO).parts[0] != "results")


def test_no_page_speaks_of_work_sessions():
    found = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in markdown_files()
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"session [0-9]", line, re.I)]
    assert not found, "autopar: Markdown pages mention work sessions; say what the code does instead:\n" + \
        "\n".join(found)


# a path into the repository's own folders, not part of a longer path (torch/distributed/...)
REPO_PATH = re.compile(r"(?<![\w./-])((?:autopar|passes|costmodels|tests|benchmarks|examples|docs|\.ci)/[\w./-]*\w)")
CAPS_FILE = re.compile(r"(?<![\w./-])([A-Z][A-Z_]*\.md)\b")  # FACTS.md, STYLE.md: cited notes
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def cited_paths(page: Path) -> list[tuple[str, Path | None]]:
    """(as written, where it must exist; None: anywhere in the repository) for each citation."""
    text = page.read_text()
    cited = [(m, REPO / m) for m in REPO_PATH.findall(text)]
    cited += [(m, None) for m in CAPS_FILE.findall(text)]
    cited += [(m, page.parent / m) for m in LINK.findall(text) if not re.match(r"[a-z]+:", m)]
    return cited


def exists(path: Path | None, written: str) -> bool:
    if path is None:
        return any(REPO.rglob(written))
    if "autopar/passes/" in written or "autopar/costmodels/" in written:  # installed names of the folders
        path = REPO / written.replace("autopar/", "", 1)
    module = path.with_name(path.name.split(".")[0])  # passes/solve/stages.cut_stages: a module's name
    return path.exists() or Path(str(path) + ".py").exists() or module.with_suffix(".py").exists()


def test_pages_cite_only_files_that_exist():
    pages = USER_PAGES + [REPO / "benchmarks" / "README.md"]
    missing = [f"{p.relative_to(REPO)}: {written}" for p in pages for written, path in cited_paths(p)
               if not exists(path, written)]
    assert not missing, "autopar: these pages cite files the repository does not hold; cite what exists " \
        "(a public source by its name):\n" + "\n".join(missing)


def test_the_citation_check_catches_a_missing_file(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("see FACTS.md and `passes/no_such_module.py` and [x](no-such.md); `docs/design.md` exists\n")
    missing = [w for w, p in cited_paths(page) if not exists(p, w)]
    assert missing == ["passes/no_such_module.py", "FACTS.md", "no-such.md"]


def runnable_blocks() -> list[tuple[str, str]]:
    """(page:line, code) of every ```python block right after a ``<!-- runnable -->`` line."""
    blocks = []
    for page in USER_PAGES:
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines):
            if line.strip() == RUNNABLE:
                assert lines[n + 1].strip() == "```python", f"{page.name}:{n + 1}: {RUNNABLE} must precede a ```python block"
                end = lines.index("```", n + 2)
                blocks.append((f"{page.relative_to(REPO)}:{n + 2}", "\n".join(lines[n + 2:end])))
    return blocks


def test_the_pages_mark_their_offline_examples_runnable():
    pages = {where.split(":")[0] for where, _ in runnable_blocks()}
    assert {"README.md", "docs/getting-started.md", "docs/concepts.md"} <= pages, pages


@pytest.mark.parametrize("where,code", runnable_blocks(), ids=[w for w, _ in runnable_blocks()])
def test_runnable_blocks_run(where, code, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"autopar: the runnable block at {where} fails; fix it or the code:\n" + \
        done.stderr[-3000:]


# ---- the troubleshooting page against the errors the code raises ----

def message_templates() -> dict[str, list[list[str | None]]]:
    """file -> each ``autopar:`` message it holds, as literal pieces with None for a placeholder."""
    found: dict[str, list[list[str | None]]] = {}
    for folder in SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    pieces = [node.value]
                elif isinstance(node, ast.JoinedStr):
                    pieces = [v.value if isinstance(v, ast.Constant) else None for v in node.values]
                else:
                    continue
                if isinstance(pieces[0], str) and pieces[0].startswith("autopar: "):
                    found.setdefault(str(path.relative_to(REPO)), []).append(pieces)
    return found


def could_start(snippet: str, pieces: list[str | None]) -> bool:
    """Whether some message the template makes starts with ``snippet``."""
    if not snippet:
        return True
    if not pieces:
        return False
    head, rest = pieces[0], pieces[1:]
    if head is None:  # a placeholder: a value, then the rest; a snippet may end inside a value, not inside words
        if " " not in snippet:
            return True
        return any(could_start(snippet[i:], rest) for i in range(1, len(snippet))) if rest else False
    if len(snippet) <= len(head):
        return head.startswith(snippet)
    return snippet.startswith(head) and could_start(snippet[len(head):], rest)


def documented_messages(text: str) -> list[str]:
    """Each ```autopar: ...``` message start the page quotes, cut at its first ellipsis."""
    return [re.split(r"\s*(?:\.\.\.|…)", m)[0] for m in re.findall(r"`(autopar: [^`]+)`", text)]


def raised_in(text: str) -> list[str]:
    """The file patterns of every ``Raised in:`` line of the page."""
    return [g for line in re.findall(r"^Raised in: (.+)$", text, re.M) for g in re.findall(r"`([^`]+)`", line)]


def test_every_quoted_error_is_one_the_code_raises():
    templates = [t for ts in message_templates().values() for t in ts]
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    stale = [m for m in documented_messages(text) if not any(could_start(m, t) for t in templates)]
    assert len(documented_messages(text)) > 40
    assert not stale, "autopar: docs/troubleshooting.md quotes errors no code raises (reworded or removed); " \
        "quote the message as the code now says it:\n" + "\n".join(stale)


def test_every_file_that_raises_autopar_errors_has_a_family_on_the_page():
    patterns = raised_in((REPO / "docs" / "troubleshooting.md").read_text())
    unmatched = [p for p in patterns if not list(REPO.glob(p))]
    assert not unmatched, f"autopar: docs/troubleshooting.md's Raised in: lines name no file: {unmatched}"
    covered = {str(f.relative_to(REPO)) for p in patterns for f in REPO.glob(p)}
    orphans = sorted(set(message_templates()) - covered)
    assert not orphans, "autopar: these files raise autopar: errors that docs/troubleshooting.md gives no family; " \
        "add them to a section's Raised in: line (and the section's table):\n" + "\n".join(orphans)


def test_the_message_check_reads_placeholders():
    template = ["autopar: expected input ", None, " of dtype ", None]
    assert could_start("autopar: expected input 0 of dtype torch.int64", template)
    assert could_start("autopar: expected input 0 of", template)
    assert not could_start("autopar: expected an input 0 of dtype", template)
    assert not could_start("autopar: expected input 0 of dtype torch.int64 in words the code never says",
                           template)
    assert could_start("autopar: rank 3: the step did not finish", ["autopar: ", None, ": the step did not finish"])


# ---- the README ----

def test_the_readme_results_table_is_generated():
    readme = (REPO / "README.md").read_text()
    assert readme == summary.with_table(readme, summary.render()), \
        "autopar: README.md's results table differs from the results files; run python -m benchmarks.summary"


def test_the_readme_is_short_and_links_the_docs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert all(f"docs/{page}" in readme for page in DOCS), [p for p in DOCS if f"docs/{p}" not in readme]
