"""The documentation says what the code does: every strategy argument is documented in its
docstring (the Options page is generated from it, so nothing is kept by hand), every shell and
Python block in README.md and docs/ is run by a named test or marked as not run with why, and the
plan the README's command prints is the one docs/memory-plans.md shows."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
from pathlib import Path

import pytest
import tomllib
from dist_utils import excerpt

from fsdp_strategy import FSDPCustomFabricStrategy, FSDPCustomStrategy
from fsdp_strategy.arguments import StrategyArguments

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)\s*(python|py|bash|sh|shell|console|zsh)\b")
MARK = re.compile(r"^\s*<!-- (not run: \S.{9,}|run by (\.ci/run|tests/[\w/]+\.py::\w+)) -->\s*$")


def _documented(cls: type) -> set[str]:
    """The names of the ``Args:`` section of a class's docstring (``**fsdp_kwargs`` as ``fsdp_kwargs``)."""
    doc = inspect.getdoc(cls) or ""
    assert "\nArgs:\n" in doc, f"{cls.__name__}'s docstring has no Args section"
    section = doc.split("\nArgs:\n", 1)[1].split("\n\n", 1)[0]
    return {match.group(1) for match in re.finditer(r"^    (?:\*\*)?(\w+):", section, re.MULTILINE)}


def _arguments(cls: type) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self"}


def test_every_strategy_argument_is_documented_once_in_its_docstring():
    trainer, fabric = _documented(StrategyArguments), _documented(FSDPCustomFabricStrategy)
    assert trainer == _arguments(FSDPCustomStrategy), (
        f"undocumented: {sorted(_arguments(FSDPCustomStrategy) - trainer)}; "
        f"not arguments: {sorted(trainer - _arguments(FSDPCustomStrategy))}"
    )
    assert fabric <= _arguments(FSDPCustomFabricStrategy)
    missing = _arguments(FSDPCustomFabricStrategy) - fabric - trainer
    assert not missing, f"FSDPCustomFabricStrategy's {sorted(missing)} are documented on neither strategy"


def _blocks() -> list[tuple[Path, int, str, str]]:
    """(page, line, the marker line before the block, the block's text) of every shell and Python block."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            if FENCE.match(line):
                fence = line.strip()[:3]
                end = next(i for i in range(number + 1, len(lines)) if lines[i].strip().startswith(fence))
                before = lines[number - 1] if number else ""
                found.append((page, number + 1, before, "\n".join(lines[number + 1 : end])))
    return found


def _reads(path: Path, name: str, page: str) -> bool:
    """Whether test ``name`` in ``path`` (or a function of that file it calls) names ``page``."""
    source = path.read_text()
    functions = {node.name: node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)}
    if name not in functions:
        return False
    body = ast.get_source_segment(source, functions[name]) or ""
    called = {node.id for node in ast.walk(functions[name]) if isinstance(node, ast.Name)} & set(functions)
    return any(page in (ast.get_source_segment(source, functions[f]) or "") for f in {name, *called}) or page in body


def test_every_shell_and_python_block_is_run_by_a_test_or_marked_not_run():
    ci = (ROOT / ".ci" / "run").read_text()
    unmarked, wrong = [], []
    for page, line, marker, text in _blocks():
        where = f"{page.relative_to(ROOT)}:{line}"
        match = MARK.match(marker)
        if match is None:
            unmarked.append(where)
            continue
        how = match.group(2)
        if how == ".ci/run":
            wrong += [f"{where}: {command!r} is not in .ci/run" for command in text.splitlines() if command not in ci]
        elif how is not None:
            path, name = how.split("::")
            source = (ROOT / path).read_text() if (ROOT / path).exists() else ""
            if f"def {name}(" not in source:
                wrong.append(f"{where}: {how} does not exist")
            elif not _reads(ROOT / path, name, page.name):
                wrong.append(f"{where}: {how} never reads {page.name}")
    assert not unmarked, (
        "put '<!-- run by tests/<file>.py::<test> -->' or '<!-- not run: <why> -->' on the line before "
        f"each of these blocks: {unmarked}"
    )
    assert not wrong, wrong


def _block_after(page: str, words: str, fence: str = "```") -> str:
    """The first block opened by exactly ``fence`` after ``words`` on ``page``."""
    lines = (ROOT / page).read_text().splitlines()
    number = next(i for i, line in enumerate(lines) if words in line)
    inside, skipping = None, False
    for line in lines[number:]:
        if not line.strip().startswith("```"):
            if inside is not None:
                inside.append(line)
        elif inside is not None:
            return "\n".join(inside)
        elif skipping:
            skipping = False
        elif line.strip() == fence:
            inside = []
        else:
            skipping = True  # another kind of block: to its end
    raise AssertionError(f"no {fence} block after {words!r} in {page}")


@pytest.mark.slow
def test_readme_plan_command_prints_the_plan_the_docs_show(tmp_path):
    """README's `fsdp-plan` command, run as written, prints the plan docs/memory-plans.md quotes."""
    (command,) = _block_after("README.md", "**Check that it fits.**", "```bash").splitlines()
    assert command.startswith("fsdp-plan "), command
    done = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300)  # as README
    assert done.returncode == 0, excerpt(done.stderr, 3000)
    readme = (ROOT / "README.md").read_text()
    prose = readme[readme.index("**Check that it fits.**") :].split("```")[0]
    assert "pip install '.[plan]'" in prose  # the install line README gives the presets installs what they need
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(requirement.startswith("transformers") for requirement in extras["plan"])
    quoted = _block_after("docs/memory-plans.md", "The same from the shell").strip()
    assert command in _block_after("docs/memory-plans.md", "The same from the shell", "```bash")
    assert done.stdout.strip() == quoted, f"update docs/memory-plans.md to what the command prints:\n{done.stdout}"


def _slug(heading: str) -> str:
    """The anchor MkDocs (and GitHub) gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[\s]+", "-", text)


def test_readme_links_point_at_files_and_headings_that_exist():
    """mkdocs checks the links inside docs/; README's, which GitHub renders, are checked here."""
    readme = (ROOT / "README.md").read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        page = ROOT / path if path else ROOT / "README.md"
        if not page.exists():
            broken.append(target)
        elif anchor and page.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, broken


def test_moving_from_lightnings_fsdp_changes_the_strategy_class_only():
    """docs/differences.md's before and after differ in the strategy's import only, and the after
    builds a Trainer (on the CPU here, with a stand-in block class)."""
    page = (ROOT / "docs" / "differences.md").read_text()
    section = page[page.index("## Moving from Lightning's `FSDPStrategy`") :]
    before, after = (block.split("\n", 1)[1] for block in section.split("```python")[1:3])
    before, after = before.split("```")[0], after.split("```")[0]
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert changed == [
        (
            "from lightning.pytorch.strategies import FSDPStrategy",
            "from fsdp_strategy import FSDPCustomStrategy as FSDPStrategy",
        )
    ]
    from torch import nn

    namespace = {"Block": nn.Linear}
    exec(after.replace('accelerator="cuda", devices=8', 'accelerator="cpu", devices=1'), namespace)
    assert type(namespace["trainer"].strategy).__name__ == "FSDPCustomStrategy"


def test_the_site_fits_a_1280_pixel_screen():
    """Wide tables fit the page and code lines wrap (checked by eye at 1280 px with chromium: the Options
    page's Default column, the memory plan's long lines): the stylesheet that does it is in the site."""
    config = (ROOT / "mkdocs.yml").read_text()
    assert "extra_css:\n  - stylesheets/extra.css" in config
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text()
    assert "white-space: pre-wrap" in css and "table-layout: auto" in css and "overflow-wrap" in css


def test_every_list_renders_as_a_list():
    """A list right after a paragraph line, with no blank line between, is one run-on paragraph in
    the site (Python-Markdown, mkdocs' renderer) though GitHub shows a list: rendered with the
    site's extensions, no paragraph holds a line that starts a list item."""
    import markdown

    extensions = ["tables", "admonition", "toc", "pymdownx.superfences"]
    run_on = []
    for page in [*PAGES, ROOT / "ARCHITECTURE.md"]:
        html = markdown.markdown(page.read_text(), extensions=extensions)
        for paragraph in re.findall(r"<p>(.*?)</p>", html, re.DOTALL):
            starts = [line for line in paragraph.splitlines()[1:] if re.match(r"\s*([-*+]|\d+\.) \S", line)]
            run_on += [f"{page.name}: {line.strip()[:60]}" for line in starts]
    assert not run_on, "lists that render as paragraphs (add a blank line before them):\n" + "\n".join(run_on)
