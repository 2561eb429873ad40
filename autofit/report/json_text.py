"""A command's ``--json`` document as text: its members one a line, a list of records one record a line.

A plan's document is mostly its candidates (a 70B plan's 8,910, each with its DeepSpeed JSON; a 405B plan's 96,560):
records a reader greps or a program parses, not text to read nested. ``json.dumps`` encodes in C only without an
indent (``json/encoder.py``: ``c_make_encoder`` runs where ``indent`` is None, ``_make_iterencode``'s pure-Python
generator otherwise), so each record is written by the C encoder on a line of its own, and the rest (the model, the
hardware, the budget: a few hundred values) with ``indent=1``. The text parses back to the same document
(``json.loads``), with ``json.dumps``'s rules: ``ensure_ascii``, ``NaN``/``Infinity``, tuples as lists, a value JSON
cannot hold a ``TypeError``.
"""

from __future__ import annotations

import json
from typing import Any

_RECORD = json.JSONEncoder()


def document_text(document: Any) -> str:
    """``document`` as JSON text: an object's members one a line (one space in), each list of objects among them
    one object a line (two spaces in, each written without an indent), any other member as ``json.dumps(member,
    indent=1)`` writes it; anything but an object with string keys as ``json.dumps(document, indent=1)``."""
    if type(document) is not dict or not document or not all(isinstance(key, str) for key in document):
        return json.dumps(document, indent=1)
    members = [f"{json.dumps(key)}: {_member(value)}" for key, value in document.items()]
    return "{\n " + ",\n ".join(members) + "\n}"


def _member(value: Any) -> str:
    if isinstance(value, (list, tuple)) and value and all(isinstance(item, dict) for item in value):
        return "[\n  " + ",\n  ".join(_RECORD.encode(item) for item in value) + "\n ]"
    return json.dumps(value, indent=1).replace("\n", "\n ")
