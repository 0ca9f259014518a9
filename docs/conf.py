"""Sphinx configuration: the API reference from the docstrings (autodoc) and the README's sections as
guides (MyST's include). Build with warnings as errors, as CI does:

    python -m sphinx -E -W --keep-going -b html docs build/docs
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The packages are imported from the checkout (as pytest.ini's ``pythonpath = .`` does for the tests).
sys.path.insert(0, str(ROOT))

project = "privacy-engine"
author = "privacy-engine developers"
copyright = "privacy-engine developers"

extensions = [
    "myst_parser",  # the guides are Markdown, the README's sections included as they are
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings' "Args:" / "Returns:" sections (Google style)
    "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# Docstrings are reStructuredText with ``literal`` spans and simple tables; Google-style sections only.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
# Signatures keep the annotations as written; the descriptions say what the types mean.
autodoc_typehints = "signature"

myst_heading_anchors = 3

html_theme = "alabaster"
html_title = "privacy-engine"
html_show_sourcelink = False
