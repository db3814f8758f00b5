"""Sphinx configuration: MyST pages, the pydata theme, and an autosummary API reference.

Nothing here reaches the network at build time (no intersphinx). The API reference is generated
from the packages' docstrings by a recursive autosummary (``api.md``), so a module moved or
renamed shows up without editing this file, and ``sphinx-build -W`` fails on a stale
``{py:mod}`` reference in the prose.
"""

import sys
from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY_ROOT))

project = "dpfl-cluster"
author = "the dpfl-cluster developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
# _templates/autosummary/module.rst: a module's page is its automodule (no summary tables,
# which would document every member a second time), then its submodules, recursively.
templates_path = ["_templates"]

myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3

autosummary_generate = True
autosummary_imported_members = False
autodoc_typehints = "none"
autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
    "ignore-module-all": True,
    "undoc-members": True,
}
# The heavy libraries are mocked: the docstrings need none of them, and importing them in every
# build process (torch, MLflow, ...) is most of a build's time on two cores. Ray is imported for
# real: a mocked ``@ray.remote`` turns the actor class into a mock autodoc cannot document.
autodoc_mock_imports = [
    "boto3",
    "dp_accounting",
    "h5py",
    "matplotlib",
    "mlflow",
    "opacus",
    "pyarrow",
    "scipy",
    "tokenizers",
    "torch",
    "torchvision",
]
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "pydata_sphinx_theme"
html_title = "dpfl-cluster"
# Collapsed navigation and no copied sources: less to render for each of the ~140 pages.
html_theme_options = {"navigation_depth": 3, "show_toc_level": 2, "collapse_navigation": True}
html_copy_source = False

# A reference to a module or object of this project that does not exist fails the build (a
# stale name after a move, under -W); references to other libraries (the mocked torch, Ray,
# ..., and the standard library: no intersphinx) and to private names (a leading underscore,
# not documented) are left unresolved on purpose.
nitpicky = True
PROJECT_PACKAGES = r"(actors|algorithms|cluster|datasets|models|privacy)"
nitpick_ignore_regex = [
    (r"py:.*", rf"(?!{PROJECT_PACKAGES}\b).*"),
    (r"py:.*", r".*\._\w*"),
]
