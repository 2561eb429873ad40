"""``document_text``: text that parses back to the document, for every kind of value a document may hold, with a
list of records one record a line."""

from __future__ import annotations

import enum
import json
import math
import random
from collections import OrderedDict
from typing import Any

import pytest

from autofit.report.json_text import document_text


class Stage(enum.IntEnum):
    THREE = 3


class Name(str):
    pass


EDGES: list[Any] = [
    {}, [], (), "", 0, -1, 2**70, 0.1, -0.0, 1e16, 1e-7, 123456789.123, math.nan, math.inf, -math.inf, True, False,
    None, "é ü 中 \U0001f600", "quote \" backslash \\ newline \n tab \t nul \x00", {"nested": {"": [{}, [[]], ()]}},
    {7: "int key", 2.5: "float key", True: "bool key", False: "false key", None: "null key", "s": "str key"},
    OrderedDict([("b", 1), ("a", 2)]), Stage.THREE, {"stage": Stage.THREE, Name("sub"): Name("class")},
    [1, 1.0, True, "1", None, [1, [2, [3]]], {"a": (1, 2)}],
]


def same(text: str, document: Any) -> bool:
    """Whether ``text`` parses back to ``document`` as JSON holds it (NaN compared as text: it equals nothing)."""
    return json.dumps(json.loads(text)) == json.dumps(document)


@pytest.mark.parametrize("document", EDGES, ids=range(len(EDGES)))
def test_every_kind_of_value_reads_back_as_json_holds_it(document: Any) -> None:
    assert same(document_text(document), document)
    wrapped = {"wrapped": [document, {"again": document}], "records": [{"value": document}, {"again": [document]}]}
    assert same(document_text(wrapped), wrapped)


def test_a_list_of_records_is_one_record_a_line_and_the_rest_indented() -> None:
    records = [{"config": {"zero_stage": s, "label": f"z{s}"}, "peak": 1.5 * s, "fits": s < 3} for s in range(4)]
    document = {"model": {"name": "m", "n_params": 7}, "candidates": records, "rejected": [], "note": None}
    lines = document_text(document).splitlines()
    for record in records:  # each record is the standard library's own compact text of it, on its line
        assert "  " + json.dumps(record) + ("," if record is not records[-1] else "") in lines
    assert ' "model": {' in lines and '  "name": "m",' in lines  # a member that is not a list of records: indented
    assert same("\n".join(lines), document)


def random_document(rng: random.Random, depth: int) -> Any:
    scalars = [lambda: rng.randint(-10**12, 10**12), lambda: rng.random() * 10 ** rng.randint(-12, 20),
               lambda: rng.choice([True, False, None]), lambda: "".join(chr(rng.randint(0, 0x2FF)) for _ in range(5))]
    if depth == 0 or rng.random() < 0.3:
        return rng.choice(scalars)()
    if rng.random() < 0.5:
        return [random_document(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["config", "deepspeed", "x", "ü"]) + str(i): random_document(rng, depth - 1)
            for i in range(rng.randint(0, 4))}


def test_random_documents_read_back_as_json_holds_them() -> None:
    rng = random.Random(49)
    for _ in range(300):
        document = random_document(rng, 5)
        assert same(document_text(document), document)
        records = {"records": [{"r": random_document(rng, 3)} for _ in range(rng.randint(1, 4))]}
        assert same(document_text(records), records)


@pytest.mark.parametrize("document", [{"a": {1, 2}}, [object()], {(1, 2): "tuple key"}, {"r": [{"a": {1}}]}])
def test_what_json_cannot_hold_is_a_type_error_as_there(document: Any) -> None:
    with pytest.raises(TypeError):
        json.dumps(document, indent=1)
    with pytest.raises(TypeError):
        document_text(document)
