"""Top-level JSON arrays are streamed (``formats.reader._iter_array``) with the values and errors of a whole-document
``json.load``: on every JSON array of ../shared/data and of the demo catalog, on edge cases (``NaN``, ``1e400``,
lone surrogate escapes, duplicate keys, a ``null`` first element, elements larger than the read buffer, broken
arrays), compressed or not; and in memory that does not grow with the file (tracemalloc)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from test_raw_prompts_pass import _peak_bytes  # tracemalloc's peak over one call

from eagle_assets.formats import reader
from eagle_assets.formats.reader import FormatError, iter_raw_records

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


def _whole_document(path: Path) -> list[tuple[int, object]]:
    """What the reader gave before streaming: the array read by one ``json.load``."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8-sig", errors="surrogateescape") as fh:
        return list(enumerate(json.load(fh)))


def _starts_with_array(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


def _array_files() -> list[Path]:
    found = sorted((REPO / "catalogs").rglob("*.json"))
    if SHARED.is_dir():
        found += sorted(p for p in SHARED.rglob("*.json") if "tokenizers" not in p.parts)
    return [p for p in found if _starts_with_array(p)]


@pytest.fixture
def small_buffer(monkeypatch):
    """A 4 KiB read buffer: most records then cross a refill."""
    monkeypatch.setattr(reader, "_ARRAY_READ_CHARS", 4096)


def test_every_array_of_the_shared_data_and_the_demo_catalog_reads_as_one_json_load(small_buffer):
    files = _array_files()
    if not SHARED.is_dir():
        pytest.skip(f"../shared/data is absent ({SHARED}); only the demo catalog's arrays would be compared")
    assert len(files) >= 5, files
    for path in files:
        try:
            expected = _whole_document(path)
        except ValueError:  # JSON Lines that opens with an array record: not an array document
            continue
        assert repr(list(iter_raw_records(path))) == repr(expected), path


CASES = {
    "empty": "[]",
    "null_first": "[null, 1, \"a\", [], {}]",
    "non_finite_and_big": "[1e400, NaN, -Infinity, 12345678901234567890123, -0.0, 1E2]",
    "duplicate_keys": '[{"a": 1, "a": 2}]',
    "surrogates": '["\\ud800", "\\ud83d\\ude00", "\\u0000"]',
    "whitespace_and_brackets_in_strings": ' \n [ {"x": [1, 2, {"y": null}]} ,\n\t{"z": "],[,"} ] \n\n',
    "long_element": json.dumps([{"id": 0, "text": "x" * 50_000}, {"id": 1}]),
    "number_at_refill": "[" + ",".join(str(10 ** (i % 12)) for i in range(3000)) + "]",
    "pretty": json.dumps([{"conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(200)], indent=2),
}

BROKEN = {
    "trailing_data": "[1] x",
    "two_arrays": "[1][2]",
    "trailing_comma": "[1,]",
    "unclosed": '[{"a": 1}',
    "missing_comma": "[1 2]",
    "bad_element": '[{"a": 1}, {"a": tru}, {"a": 3}]',
    "only_bracket": "[",
}


@pytest.mark.parametrize("compressed", [False, True])
def test_edge_cases_give_the_values_of_json_load(tmp_path, small_buffer, compressed):
    for name, text in CASES.items():
        path = tmp_path / (name + (".json.gz" if compressed else ".json"))
        if compressed:
            with gzip.open(path, "wt", encoding="utf-8") as fh:
                fh.write(text)
        else:
            path.write_text(text)
        assert repr(list(iter_raw_records(path))) == repr(_whole_document(path)), name


def test_a_broken_array_is_refused_before_any_record_with_json_loads_message(tmp_path, small_buffer):
    for name, text in BROKEN.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        records = iter_raw_records(path)
        with pytest.raises(FormatError) as info:
            next(records)  # the first record already: nothing of a broken array is yielded
        with pytest.raises(json.JSONDecodeError) as plain:
            _whole_document(path)
        where = f"({plain.value.msg} at line {plain.value.lineno} column {plain.value.colno})"
        assert "starts with '['" in str(info.value) and where in str(info.value), (name, str(info.value))


def test_memory_does_not_grow_with_the_array(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "_ARRAY_READ_CHARS", 1 << 16)
    record = {"conversations": [{"from": "human", "value": "q " * 300}, {"from": "gpt", "value": "a " * 300}]}
    sizes = {}
    for n in (2_000, 8_000):
        path = tmp_path / f"a{n}.json"
        path.write_text(json.dumps([dict(record, id=i) for i in range(n)]))
        sizes[n] = path.stat().st_size

        def drain(path=path):
            for _ in iter_raw_records(path):
                pass

        peak = _peak_bytes(drain)
        assert peak < 1.5e6, (n, peak)  # the read buffer and one record, whatever the file (~5 and ~20 MB)
    whole = _peak_bytes(lambda: _whole_document(tmp_path / "a8000.json"))
    assert whole > sizes[8_000], whole  # the whole-document read does hold the file (so the bound above can fail)
