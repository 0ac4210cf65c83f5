"""MkDocs hook: fcp's docstrings use reST roles (``:func:`name```, ``:class:`~pkg.mod.Name```);
the API pages show the name alone, as Sphinx would (``~`` keeps the last component only)."""

from __future__ import annotations

import re

_ROLES = r":(?:func|class|mod|data|meth|attr|exc|obj|ref):"
_SHORT = re.compile(_ROLES + r"<code>~(?:[\w.]*\.)?(\w+)</code>")
_ROLE = re.compile(_ROLES + r"(?=<code>)")


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub("", _SHORT.sub(r"<code>\1</code>", html))
