"""The documentation site (docs/) builds with every warning an error, and README.md is short
and links only to pages that exist."""

import fcntl
import hashlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = REPO / "README.md"
README_MAX_LINES = 200
# Markdown links into docs/: [text](docs/PAGE.md) or [text](docs/PAGE.md#anchor)
DOCS_LINK = re.compile(r"\]\(docs/([^)#]+)\.md(?:#([^)]+))?\)")
BUILD_TIMEOUT_S = 540
# One worker runs this module's tests, so the site (≈ 50 s of CPU) is built once, not per worker.
pytestmark = pytest.mark.xdist_group("docs")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built from docs/ with ``-W``: a warning (a stale module name, bad docstring
    markup, a missing page) fails the build."""
    out = tmp_path_factory.mktemp("site")
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-j", "2"]
    command += ["-b", "html", "-d", str(out / "doctrees"), str(DOCS), str(out / "html")]
    # Sphinx writes the API stubs into docs/_generated, in the tree: a build that finds a stub
    # another build is still writing skips its submodules. One build of this checkout at once.
    digest = hashlib.sha256(str(REPO).encode()).hexdigest()[:12]
    with open(Path(tempfile.gettempdir()) / f"dpfl-docs-build-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build = subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
    # The first lines say why (a module autodoc could not import); the last, what it broke.
    assert build.returncode == 0, f"{build.stderr[:3000]}\n...\n{build.stderr[-1500:]}"
    return out / "html"


def test_the_site_builds_without_warnings(site):
    assert (site / "index.html").is_file()
    assert (site / "architecture.html").is_file()
    # The API reference is generated, module by module, from the packages' docstrings.
    assert (site / "_generated" / "privacy.accountant.html").is_file()


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    assert "uv run pytest" in README.read_text()


def test_every_docs_link_in_the_readme_is_a_page_of_the_site(site):
    links = DOCS_LINK.findall(README.read_text())
    assert links, "README.md links to no page of docs/"
    for page, anchor in links:
        html = site / f"{page}.html"
        assert html.is_file(), f"README.md links to docs/{page}.md, which is no page"
        if anchor:
            assert f'id="{anchor}"' in html.read_text(), f"docs/{page}.md has no #{anchor}"
