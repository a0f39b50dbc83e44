"""The documentation stays true to the repository: links resolve, named files and modules exist.

README.md is the front door and docs/*.md hold one page per tool or topic. These checks read
them (and the code, for paths into docs/) as text: no import of the package, well under a second.
Each rule is also run on a planted mistake, so a checker that stopped finding anything fails.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 400

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
URL_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
# A path into docs/ (not a longer path that merely ends in a folder called docs).
DOCS_PATH = re.compile(r"(?<![\w./-])docs/[\w.-]+(?:/[\w.-]+)*")
# fsdp_utils/x/y.py or a folder fsdp_utils/x/, and the dotted fsdp_utils.x.y (module or name).
MODULE_FILE = re.compile(r"(?<![\w./-])fsdp_utils/(?:\w+/)*(?:\w+\.py\b|\w+/)")
MODULE_DOTTED = re.compile(r"(?<![\w./-])fsdp_utils(?:\.[A-Za-z_]\w*)+")


def markdown_files(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def code_files(root: Path = REPO) -> list[Path]:
    """Tracked and new (not ignored) files that may name a docs page: code, scripts, docs."""
    listing = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    paths = [root / name for name in listing.split("\0") if name]
    code = [p for p in paths if p.suffix in {".py", ".sh"} or p.name == "Makefile"]
    return sorted({*[p for p in code if p.is_file()], *markdown_files(root)})


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked out."""
    lines, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append(CODE_SPAN.sub(" ", line))
    return lines


def github_anchor(heading: str) -> str:
    """GitHub's rule: the heading's text, lower-case, punctuation but `-` dropped, spaces to `-`."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; repeated headings get -1, -2, ... as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else HEADING.match(line)
        if match:
            anchor = github_anchor(match.group(2))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """Relative links of a Markdown page whose file or #anchor does not exist."""
    problems = []
    # Joined, so that a link whose text is wrapped over two lines is still found.
    for target in LINK.findall("\n".join(prose_lines(page.read_text()))):
        if URL_SCHEME.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            problems.append(f"{page.name}: ({target}): no such file {path_part}")
        elif (
            anchor
            and destination.suffix == ".md"
            and anchor not in anchors(destination.read_text())
        ):
            problems.append(f"{page.name}: ({target}): no heading #{anchor} in {destination.name}")
    return problems


def missing_docs_paths(text: str, root: Path = REPO) -> list[str]:
    paths = {match.rstrip(".") for match in DOCS_PATH.findall(text)}
    return sorted(path for path in paths if not (root / path).exists())


def top_level_names(source: Path) -> set[str]:
    """Names a module defines or imports at its top level (inside top-level if/try too)."""
    names: set[str] = set()
    body = list(ast.parse(source.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If | ast.Try):
            body.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                body.extend(handler.body)
    return names


def dotted_path_exists(dotted: str, root: Path = REPO) -> bool:
    """fsdp_utils.a.b.c: modules and packages as far as they go, then one name the last defines."""
    first, *rest = dotted.split(".")
    folder: Path | None = root / first
    source = root / first / "__init__.py"
    if not source.is_file():
        return False
    for part in rest:
        if folder is not None and (folder / part / "__init__.py").is_file():
            folder, source = folder / part, folder / part / "__init__.py"
        elif folder is not None and (folder / f"{part}.py").is_file():
            folder, source = None, folder / f"{part}.py"
        else:
            # An attribute of the last module; what lies beyond it (a method) is not checked.
            return part in top_level_names(source)
    return True


def stale_module_paths(text: str, root: Path = REPO) -> list[str]:
    files = {m for m in MODULE_FILE.findall(text) if not (root / m).exists()}
    dotted = {m for m in MODULE_DOTTED.findall(text) if not dotted_path_exists(m, root)}
    return sorted(files | dotted)


def too_long(text: str) -> bool:
    return len(text.splitlines()) > README_MAX_LINES


# --- the repository's documentation ----------------------------------------------------------


def test_readme_is_a_front_door() -> None:
    lines = len((REPO / "README.md").read_text().splitlines())
    assert not too_long((REPO / "README.md").read_text()), (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move the details to a page in docs/"
    )


def test_relative_links_resolve() -> None:
    problems = [p for page in markdown_files() for p in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_docs_paths_named_in_code_exist() -> None:
    problems = [
        f"{path.relative_to(REPO)}: {missing}"
        for path in code_files()
        for missing in missing_docs_paths(path.read_text(errors="replace"))
    ]
    assert not problems, "paths into docs/ that do not exist:\n" + "\n".join(problems)


def test_module_paths_in_docs_exist() -> None:
    problems = [
        f"{page.relative_to(REPO)}: {stale}"
        for page in markdown_files()
        for stale in stale_module_paths(page.read_text())
    ]
    assert not problems, "module paths that do not exist (renamed?):\n" + "\n".join(problems)


# --- each rule catches a planted mistake (and passes the right form) -------------------------


def test_links_planted(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Offline assets: `download_models.py`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Twice\n\n## Twice\n\n```bash\n# not a heading\n```\n\n"
        "[ok](other.md#offline-assets-download_modelspy) [ok](#twice-1) [ok](https://example.org/x)\n"
        "[bad](missing.md) [bad](other.md#offline-assets) [bad, wrapped\nover two lines](#not-a-heading) "
        "`[in code](missing.md)`\n"
    )
    assert [p.split(": (")[1].split(")")[0] for p in broken_links(page)] == [
        "missing.md",
        "other.md#offline-assets",
        "#not-a-heading",
    ]


def test_docs_paths_planted(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "download.md").write_text("# Download\n")
    # Spelled with {} so that this file itself names no missing page.
    missing, elsewhere = "nowhere.md", "elsewhere.md"
    text = f"see docs/download.md. and docs/{missing}, not site/docs/{elsewhere}"
    assert missing_docs_paths(text, tmp_path) == [f"docs/{missing}"]


def test_module_paths_planted() -> None:
    good = (
        "`fsdp_utils/data/prepare.py`, `fsdp_utils/chess_eval/`, fsdp_utils.metrics.trackers, "
        "fsdp_utils.hub.resolve.resolve_model_dir, `fsdp_utils.plan.report.Margin`, "
        "HF_HOME/fsdp_utils/prepared, `python -m fsdp_utils.plot runs/chess`."
    )
    assert stale_module_paths(good) == []
    stale = "fsdp_utils/data.py fsdp_utils/lora_export.py fsdp_utils.trackers fsdp_utils.plan.report.Nope"
    assert stale_module_paths(stale) == [
        "fsdp_utils.plan.report.Nope",
        "fsdp_utils.trackers",
        "fsdp_utils/data.py",
        "fsdp_utils/lora_export.py",
    ]


@pytest.mark.parametrize(
    ("lines", "expected"), [(README_MAX_LINES, False), (README_MAX_LINES + 1, True)]
)
def test_readme_length_planted(lines: int, expected: bool) -> None:
    assert too_long("line\n" * lines) is expected
