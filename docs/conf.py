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
templates_path = ["_templates"]

myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3

autosummary_generate = True
autosummary_imported_members = False
autodoc_typehints = "none"
autodoc_default_options = {"members": True, "show-inheritance": True, "ignore-module-all": True}
# The heavy libraries are mocked: the docstrings need none of them, and importing them in every
# build process (torch, Ray, MLflow, ...) is most of a build's time on two cores.
autodoc_mock_imports = [
    "boto3",
    "dp_accounting",
    "h5py",
    "matplotlib",
    "mlflow",
    "opacus",
    "pyarrow",
    "ray",
    "scipy",
    "tokenizers",
    "torch",
    "torchvision",
]
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "pydata_sphinx_theme"
html_title = "dpfl-cluster"
html_static_path = ["_static"]
html_theme_options = {"navigation_depth": 3, "show_toc_level": 2}
