"""Every relative link in README.md and docs/*.md resolves: the file or directory exists,
and a ``#anchor`` names a heading (GitHub's slug) or an explicit ``<a id/name>`` anchor in
the target Markdown file. No network: web links (http, https, mailto, any ``scheme:``)
are not followed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
# [text](target) and ![alt](target); the target may be <wrapped> and followed by a title.
_INLINE_LINK = re.compile(
    r"\[(?P<text>[^\]]*)\]\(\s*(?P<target><[^>\n]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)"
)
_REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:[ \t]*(<[^>\n]*>|\S+)", re.MULTILINE)
_HTML_ANCHOR = re.compile(r"<a\s[^>]*?\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_files(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _without_fenced_code(text: str) -> str:
    """The text with every fenced code block blanked out (line count kept)."""
    out: list[str] = []
    fence: str | None = None
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(1)
                out.append("")
            else:
                out.append(line)
        else:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                    and not line.strip().strip(fence[0]):
                fence = None
            out.append("")
    return "\n".join(out)


def _without_code(text: str) -> str:
    """The text with fenced blocks and inline code spans blanked (newlines kept), so that
    brackets and parentheses inside code are not read as links."""
    text = _without_fenced_code(text)
    return _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def _heading_text(raw: str) -> str:
    """A heading's rendered text: code spans keep their content, links and images their
    text, HTML tags and emphasis markers go."""
    text = _CODE_SPAN.sub(lambda m: m.group(2).strip(), raw)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)
    return text.strip()


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, every character that is not a
    letter, digit, space, hyphen or underscore removed, each space a hyphen."""
    text = _heading_text(heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def github_anchors(text: str) -> set[str]:
    """Every anchor a Markdown page offers: its headings' slugs (a repeated slug gets
    -1, -2, ... as on GitHub) and explicit <a id="..."> / <a name="..."> anchors."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}

    def add_heading(raw: str) -> None:
        slug = github_slug(raw)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")

    lines = _without_fenced_code(text).split("\n")
    for i, line in enumerate(lines):
        m = _ATX_HEADING.match(line)
        if m:
            add_heading(m.group(2) or "")
            continue
        prev = lines[i - 1] if i else ""
        if (_SETEXT_UNDERLINE.match(line) and prev.strip()
                and not _ATX_HEADING.match(prev)
                and not re.match(r"^\s*([|>*+-]|\d+[.)])", prev)):
            add_heading(prev.strip())
    anchors.update(_HTML_ANCHOR.findall(_without_code(text)))
    return anchors


def relative_links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every link that is not a web or other ``scheme:`` link, outside
    code; inline links, images and reference definitions."""
    prose = _without_code(text)
    found: list[tuple[int, str]] = []
    matches = [(m.start(), m.group("target")) for m in _INLINE_LINK.finditer(prose)]
    matches += [(m.start(1), m.group(1)) for m in _REFERENCE_DEFINITION.finditer(prose)]
    for offset, target in sorted(matches):
        target = target.strip()
        if target.startswith("<") and target.endswith(">"):
            target = target[1:-1].strip()
        if not target or _SCHEME.match(target) or target.startswith("//"):
            continue
        found.append((prose.count("\n", 0, offset) + 1, target))
    return found


def broken_links(files: Iterable[Path], root: Path = ROOT) -> list[str]:
    """One line per relative link that does not resolve, as ``file:line: target: why``."""
    problems: list[str] = []
    anchor_cache: dict[Path, set[str]] = {}

    def anchors_of(path: Path) -> set[str]:
        if path not in anchor_cache:
            anchor_cache[path] = github_anchors(path.read_text(encoding="utf-8"))
        return anchor_cache[path]

    for source in files:
        source = source.resolve()
        try:
            shown = source.relative_to(root.resolve())
        except ValueError:
            shown = source
        for line, target in relative_links(source.read_text(encoding="utf-8")):
            path_part, _, anchor = target.partition("#")
            path_part = unquote(path_part.split("?", 1)[0])
            anchor = unquote(anchor)
            if not path_part:
                resolved = source
            elif path_part.startswith("/"):
                resolved = root / path_part.lstrip("/")
            else:
                resolved = source.parent / path_part
            where = f"{shown}:{line}: {target}"
            if not resolved.exists():
                problems.append(f"{where}: {path_part} does not exist")
                continue
            if not anchor:
                continue
            page = resolved / "README.md" if resolved.is_dir() else resolved
            if page.suffix.lower() not in (".md", ".markdown") or not page.is_file():
                continue  # e.g. a source file's #L10 line anchor: nothing to check
            if anchor not in anchors_of(page):
                problems.append(f"{where}: no anchor #{anchor} in {page.name}")
    return problems


def test_every_relative_link_and_anchor_resolves():
    files = markdown_files()
    assert (ROOT / "README.md") in files and len(files) > 1, files
    problems = broken_links(files)
    assert not problems, f"{len(problems)} broken link(s):\n" + "\n".join(problems)


def test_a_broken_link_and_a_broken_anchor_are_both_reported(tmp_path):
    (tmp_path / "other.md").write_text(
        "# Other page\n\n## Real heading\n\n## Real heading\n\n<a id=\"explicit\"></a>\n",
        encoding="utf-8")
    (tmp_path / "sub").mkdir()
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "Fine: [other](other.md), [heading](other.md#real-heading),\n"
        "[second heading](other.md#real-heading-1), [explicit](other.md#explicit),\n"
        "[here](#page), [a folder](sub/), [the web](https://example.com/x.md#nope),\n"
        "[mail](mailto:someone@example.com), `[in code](gone.md)`.\n\n"
        "```\n[in a fence](gone.md)\n```\n\n"
        "Broken: [missing](missing.md) and\n"
        "[bad anchor](other.md#no-such-heading), [bad local](#nowhere).\n",
        encoding="utf-8")
    problems = broken_links([page], root=tmp_path)
    assert problems == [
        "page.md:12: missing.md: missing.md does not exist",
        "page.md:13: other.md#no-such-heading: no anchor #no-such-heading in other.md",
        "page.md:13: #nowhere: no anchor #nowhere in page.md",
    ], problems


def test_anchors_follow_githubs_slug_rules():
    text = (
        "# genserve\n"
        "## Python client library: `genserve.client`\n"
        "## Configuration: `genserve serve` flags\n"
        "## Notes\n"
        "## Notes\n"
        "### A -- B, (c) & d_e\n"
        "```\n# not a heading\n```\n"
        "Setext heading\n"
        "--------------\n"
    )
    assert github_anchors(text) == {
        "genserve",
        "python-client-library-genserveclient",
        "configuration-genserve-serve-flags",
        "notes",
        "notes-1",
        "a----b-c--d_e",
        "setext-heading",
    }
