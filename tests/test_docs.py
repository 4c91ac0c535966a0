"""The docs stay true: the site lists every page and package, links resolve, and the quickstart's examples run.

- mkdocs.yml's nav lists every page in docs/ once, and the API reference (docs/reference/, rendered by
  mkdocstrings) has one ``::: package`` page per leaf and wing, reaching every module under them; the strict
  site build itself is a slow test here and a step of .ci/run;
- every relative link and image in docs/*.md and README.md points to an existing file (and heading, for
  ``file.md#anchor`` links); docs/index.md links every page in docs/;
- the python blocks of docs/quickstart.md marked ``<!-- test_docs: run -->`` are executed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MD_FILES = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]


# ----------------------------------------------------------------------------------------------------------
# The site (mkdocs.yml): nav and API reference
# ----------------------------------------------------------------------------------------------------------

# Packages and modules whose API the reference documents (leaves and wings), and where.
API_PAGES = {
    "rlcore.ops": "reference/ops.md",
    "rlcore.objectives": "reference/objectives.md",
    "rlcore.advantages": "reference/advantages.md",
    "rlcore.data": "reference/data.md",
    "rlcore.rollout.rewards": "reference/rewards.md",
    "rlcore.inference": "reference/inference.md",
    "rlcore.rollout": "reference/rollout.md",
    "rlcore.training": "reference/training.md",
}
DIRECTIVE = re.compile(r"^:::\s+(\S+)", re.M)


def _mkdocs_config() -> dict:
    yaml = pytest.importorskip("yaml")
    path = ROOT / "mkdocs.yml"
    assert path.exists(), "mkdocs.yml (the documentation site) is missing"
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _nav_pages(nav) -> list[str]:
    """Every page path in a mkdocs ``nav`` (strings, ``{title: page}`` and nested sections)."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in _nav_pages(v)]
    raise AssertionError(f"unexpected nav entry {nav!r}")


def test_site_nav_lists_every_page_once():
    cfg = _mkdocs_config()
    assert cfg.get("docs_dir", "docs") == "docs"
    pages = _nav_pages(cfg["nav"])
    excluded = set((cfg.get("exclude_docs") or "").split())  # generated files kept out of the site on purpose
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if p.relative_to(DOCS).as_posix() not in excluded)
    assert sorted(set(pages)) == sorted(pages), f"a page is in the nav twice: {pages}"
    assert sorted(pages) == on_disk, f"nav vs docs/: missing {set(on_disk) - set(pages)}, gone {set(pages) - set(on_disk)}"
    plugins = [next(iter(p)) if isinstance(p, dict) else p for p in cfg["plugins"]]
    assert "mkdocstrings" in plugins, "mkdocs.yml: the mkdocstrings plugin renders the API reference"


def test_api_reference_renders_each_package_whole():
    """Each package has its page with one ``::: package`` directive, so new modules appear by themselves."""
    cfg = _mkdocs_config()
    pages = set(_nav_pages(cfg["nav"]))
    for module, page in API_PAGES.items():
        assert page in pages, f"{page} ({module}) is not in the nav of mkdocs.yml"
        targets = DIRECTIVE.findall((DOCS / page).read_text(encoding="utf-8"))
        assert targets == [module], f"{page}: expected exactly '::: {module}', found {targets}"
        assert importlib.util.find_spec(module) is not None, f"{page}: no module {module}"
    api = (DOCS / "api.md").read_text(encoding="utf-8")
    for page in API_PAGES.values():
        assert f"({page})" in api, f"docs/api.md does not link {page}"


def test_every_wing_and_leaf_module_is_in_the_reference():
    """Every module under the documented packages is reached by a directive (no package left out)."""
    documented = set(API_PAGES)
    for pkg in ("objectives", "advantages", "data", "inference", "rollout", "training"):
        for f in (ROOT / "rlcore" / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mod = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            assert any(mod == d or mod.startswith(d + ".") for d in documented), f"{mod} is not in the reference"


@pytest.mark.slow
def test_site_builds_strict(tmp_path: Path):
    """`mkdocs build --strict` (what .ci/run does): warnings such as a broken link or docstring are errors."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "reference" / "objectives" / "index.html").exists()


# ----------------------------------------------------------------------------------------------------------
# Links
# ----------------------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)


def _prose(text: str) -> str:
    """Markdown without fenced code blocks and inline code (links there are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (lower case, punctuation dropped, spaces to dashes)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        k = seen.get(slug, 0)
        seen[slug] = k + 1
        out.add(slug if k == 0 else f"{slug}-{k}")
    return out


@pytest.mark.parametrize("path", MD_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path):
    bad = []
    for target in LINK.findall(_prose(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, frag = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif frag and dest.suffix == ".md" and frag not in _anchors(dest):
            bad.append(f"{target}: no heading #{frag} in {dest.name}")
    assert not bad, f"{path.relative_to(ROOT)}: broken links: {bad}"


def test_link_checker_catches_broken_links(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) `[code](nope.md)`\n```\n[fenced](nope.md)\n```\n")
    targets = LINK.findall(_prose(page.read_text()))
    assert targets == ["#title", "missing.md"]
    assert _anchors(page) == {"title"}


def test_index_lists_every_page():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    linked = {t.partition("#")[0] for t in LINK.findall(_prose(index))}
    missing = [p.name for p in DOCS.glob("*.md") if p.name != "index.md" and p.name not in linked]
    assert not missing, f"docs/index.md does not link {missing}"


# ----------------------------------------------------------------------------------------------------------
# Quickstart examples
# ----------------------------------------------------------------------------------------------------------


def _marked_blocks() -> list[tuple[str, str]]:
    text = (DOCS / "quickstart.md").read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- test_docs: run (\S+) -->\s*```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 2, "quickstart.md lost its tested examples"
    return blocks


@pytest.mark.parametrize("name,code", _marked_blocks(), ids=[n for n, _ in _marked_blocks()])
def test_quickstart_example_runs(name: str, code: str, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # examples use repository-relative paths
    exec(compile(code, f"docs/quickstart.md:{name}", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.strip(), f"example {name} printed nothing"
