"""Issue 35 (points 7 and 8): a damaged or ambiguous data file is refused with one line naming the file, the
row (and line, or byte offset) and the fix; nothing is read differently from what the file says.

Each case writes a small real file in tmp_path and reads it the ways a user does: ``load_rows`` (what a run
calls) and ``fedpeft data`` (exit 2, one ``error:`` line)."""

from __future__ import annotations

import gzip
import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedpeft.cli import main
from fedpeft.data.files import read_file
from fedpeft.data.sources import DataError, load_rows


def _refusal(path, split: str = "train") -> str:
    """The one-line message ``load_rows`` refuses ``path`` (a file or a data folder) with."""
    with pytest.raises(DataError) as err:
        load_rows(str(path), split)
    message = str(err.value)
    assert "\n" not in message
    return message


def _cli_error(capsys, path) -> str:
    """``fedpeft data PATH``: exit 2 and one ``error:`` line, no traceback."""
    code = main(["data", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err + out
    return err


def _lines(*rows: dict) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


ROWS = [{"text": f"t{i}", "label": i % 2} for i in range(3)]


# point 7: unreadable files ------------------------------------------------------------------------


def test_non_utf8_jsonl_names_the_line_and_byte(tmp_path, capsys):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(_lines(*ROWS[:2]) + b'{"text": "caf\xe9", "label": 0}\n')  # Latin-1 'é'
    offset = len(_lines(*ROWS[:2])) + len(b'{"text": "caf')
    message = _refusal(path)  # old code: UnicodeDecodeError traceback
    assert message == (f"{path}: line 3: not UTF-8 text (byte 0xe9 at offset {offset}); save the file as UTF-8 "
                       "(e.g. iconv -f <its encoding> -t utf-8), or correct that byte")
    assert "line 3: not UTF-8 text" in _cli_error(capsys, path)


def test_non_utf8_json_csv_and_tsv_name_the_line(tmp_path):
    cases = {"rows.json": b'[{"text": "a", "label": 0},\n {"text": "caf\xe9", "label": 1}]',
             "rows.csv": b"text,label\na,0\ncaf\xe9,1\n",
             "rows.tsv": b"text\tlabel\na\t0\nb\t1\ncaf\xe9\t1\n"}
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        message = _refusal(path)  # old code: UnicodeDecodeError traceback (.json), pandas' message (.csv, .tsv)
        offset = data.index(b"\xe9")
        line = data[:offset].count(b"\n") + 1
        assert message.startswith(f"{path}: line {line}: not UTF-8 text (byte 0xe9 at offset {offset})")
        assert "save the file as UTF-8" in message


def test_non_utf8_inside_a_jsonl_gz_names_the_line_of_the_uncompressed_data(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(gzip.compress(_lines(*ROWS) + b'{"text": "\xff", "label": 0}\n'))
    assert _refusal(path).startswith(f"{path}: line 4: not UTF-8 text (byte 0xff at offset "
                                     f"{len(_lines(*ROWS)) + 10} of the uncompressed data)")


def test_an_invalid_json_file_names_line_and_column(tmp_path, capsys):
    path = tmp_path / "rows.json"
    path.write_text('[{"text": "a", "label": 0},\n {"text": "b" "label": 1}]')
    message = _refusal(path)  # old code: JSONDecodeError traceback
    assert message.startswith(f"{path}: line 2 column 15: not valid JSON (Expecting ',' delimiter); fix it there")
    assert "line 2 column 15" in _cli_error(capsys, path)
    path.write_text("\n".join(json.dumps(r) for r in ROWS))  # JSON lines in a .json file
    assert "line 2 column 1: not valid JSON (Extra data)" in _refusal(path) and "name it .jsonl" in _refusal(path)
    path.write_text("  \n")
    assert _refusal(path) == (f"{path}: the file is empty; a .json file holds one JSON list of rows "
                              "[{...}, ...]")  # old code: "Expecting value" traceback
    path.write_text('{"train": []}')
    assert _refusal(path).startswith(f"{path}: holds a JSON object, not a list of rows; give a list")


def test_a_truncated_jsonl_gz_is_refused_after_its_last_whole_line(tmp_path, capsys):
    whole = gzip.compress(_lines(*({"text": f"row {i} " * 20, "label": i % 2} for i in range(3000))))
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    message = _refusal(path)  # old code: EOFError traceback
    assert message.startswith(f"{path}: the compressed data ends early, after line ")
    assert message.endswith("the file is truncated; copy or download it again (gzip -t FILE checks a gzip file)")
    assert 0 < int(message.split("after line ")[1].split(":")[0]) < 3000
    assert "ends early" in _cli_error(capsys, path)


def test_damaged_and_uncompressed_jsonl_gz_are_refused(tmp_path):
    whole = bytearray(gzip.compress(_lines(*ROWS)))
    whole[-6] ^= 0xFF  # inside the CRC / length trailer
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(bytes(whole))
    message = _refusal(path)  # old code: BadGzipFile traceback
    assert message.startswith(f"{path}: damaged gzip data after line ") and "copy or download it again" in message
    path.write_bytes(_lines(*ROWS))  # plain text named .gz
    assert _refusal(path).startswith(f"{path}: not gzip-compressed data (Not a gzipped file")
    assert "name it .jsonl" in _refusal(path)


@pytest.mark.parametrize("damage", ["truncated", "overwritten", "not parquet"])
def test_a_corrupt_parquet_file_is_refused(tmp_path, capsys, damage):
    path = tmp_path / "rows.parquet"
    pd.DataFrame({"text": [f"t{i}" for i in range(50)], "label": [i % 2 for i in range(50)]}).to_parquet(path)
    data = path.read_bytes()
    damaged = {"truncated": data[: len(data) // 2],
               "overwritten": data[:4] + b"\x00" * 200 + data[204:],
               "not parquet": b"text,label\na,0\n"}[damage]
    path.write_bytes(damaged)
    message = _refusal(path)  # old code: ArrowInvalid / OSError traceback
    assert message.startswith(f"{path}: not a readable parquet file (")
    assert message.endswith("the file is damaged or not parquet: write it again (e.g. pandas DataFrame.to_parquet), "
                            "or convert it to .jsonl")
    assert "not a readable parquet file" in _cli_error(capsys, path)


def test_a_parquet_file_naming_a_column_twice_is_refused(tmp_path):
    path = tmp_path / "rows.parquet"
    table = pa.table([pa.array(["a", "b"]), pa.array([0, 1]), pa.array([1, 0])], names=["text", "label", "label"])
    pq.write_table(table, path)
    assert _refusal(path) == f"{path}: column 'label' appears twice; rename or drop one"  # old code: the last one


def test_an_unreadable_path_is_one_line(tmp_path):
    path = tmp_path / "folder.jsonl"
    path.mkdir()
    with pytest.raises(DataError, match=r"folder\.jsonl: cannot be read \(Is a directory\); check the path"):
        read_file(path)


def test_an_integer_json_cannot_parse_is_one_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a", "label": ' + "9" * 5000 + "}\n")  # over Python's 4300-digit limit
    assert _refusal(path).startswith(f"{path}: row 1 (line 1): not valid JSON (Exceeds the limit")


# point 8: a key given twice in a JSON row ----------------------------------------------------------


def test_a_key_given_twice_in_a_jsonl_row_is_refused(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(_lines(ROWS[0]) + b"\n" + b'{"text": "b", "label": 0, "label": 1}\n')
    message = _refusal(path)  # old code: label 1, silently
    assert message == (f"{path}: row 2 (line 3): key 'label' is given twice in the row (0, then 1); a JSON parser "
                       "keeps only the last value: keep one of them")
    assert "row 2 (line 3): key 'label' is given twice" in _cli_error(capsys, path)


def test_a_key_given_twice_in_a_json_record_or_a_nested_object_is_refused(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('[{"text": "a", "label": 0},\n {"text": "b", "text": "c", "label": 1}]')
    assert _refusal(path) == (f"{path}: row 2: key 'text' is given twice in the row ('b', then 'c'); a JSON parser "
                              "keeps only the last value: keep one of them")
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}, '
                    '{"role": "assistant", "content": "yes", "content": "no"}]}\n')
    assert "row 1 (line 1): key 'content' is given twice in messages[1] ('yes', then 'no')" in _refusal(chat)


def test_the_same_key_in_different_objects_is_fine(tmp_path):
    path = tmp_path / "rows.jsonl"
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "label": 0}
    path.write_text(json.dumps(row) + "\n")
    assert load_rows(str(path), "train") == [row]


# point 8: CSV quotes that run past their line, ragged rows, a column named twice ---------------------


def test_an_unterminated_csv_quote_no_longer_swallows_the_next_rows(tmp_path, capsys):
    path = tmp_path / "rows.csv"
    path.write_text('text,label\n"great movie,1\nawful,0\n"fine",1\nok,0\n')
    message = _refusal(path)  # old code: 2 rows, the first one 'great movie,1\nawful,0\nfine"' labelled 1
    assert message.startswith(f"{path}: row 1 (line 2): a quoted cell runs past the end of its line, to line 4 (a "
                              "quote left open swallows the rows after it); close it on its line: a row is one line: "
                              "a quoted cell may hold commas and doubled quotes")
    assert "convert the file to JSON lines" in message
    assert "row 1 (line 2): a quoted cell runs past" in _cli_error(capsys, path)
    path.write_text('text,label\nfine,1\n"great movie,1\nawful,0\n')  # open to the end of the file
    assert _refusal(path).startswith(f"{path}: row 2 (line 3): a quote opened on this line is never closed (the 2 "
                                     "lines to the end of the file would be one cell); close it on its line")


def test_a_quoted_csv_cell_with_a_line_break_is_refused_with_the_one_line_rule(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text('text,label\nok,0\n"two\nlines",1\n')
    message = _refusal(path)  # old code: read as 'two\nlines'
    assert message.startswith(f"{path}: row 2 (line 3): a quoted cell runs past the end of its line, to line 4")
    assert "not line breaks (replace them with spaces, or convert the file to JSON lines, which keeps them)" in message


def test_quoted_csv_cells_on_one_line_are_read_as_before_and_malformed_quoting_is_refused(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text('text,label\n"a, ""quoted"" word",1\nplain,0\n\n"",0\n  \n')
    assert load_rows(str(path), "train") == [{"text": 'a, "quoted" word', "label": 1}, {"text": "plain", "label": 0},
                                             {"text": "", "label": 0}]  # blank lines skipped, as pandas did
    path.write_text('text,label\n"a"b,1\n')
    assert _refusal(path).startswith(f"{path}: row 1 (line 2): malformed CSV quoting (")


def test_a_ragged_csv_or_tsv_row_is_refused(tmp_path):
    csv_path = tmp_path / "rows.csv"
    csv_path.write_text("text,label\nhello there,1,0\nworld,1\n")
    assert _refusal(csv_path) == (  # old code: 'hello there' taken as an index, text '1', label 0
        f"{csv_path}: row 1 (line 2): 3 cells where the header has 2 (['text', 'label']); give every row one cell "
        "per column (quote a cell that holds a comma)")
    csv_path.write_text("text,label\nfine,1\nmissing\n")
    assert _refusal(csv_path).startswith(f"{csv_path}: row 2 (line 3): 1 cell where the header has 2")
    tsv_path = tmp_path / "rows.tsv"
    tsv_path.write_text("text\tlabel\na\ttab\t1\n")
    assert _refusal(tsv_path).endswith("(a tab inside a cell splits it: TSV has no quoting)")


def test_a_header_naming_a_column_twice_is_refused_and_an_index_column_is_kept(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("text,label,label\na,0,1\n")
    assert _refusal(path) == (f"{path}: line 1: the header names column 'label' twice (columns 2 and 3); rename or "
                              "drop one")  # old code: 'label' and 'label.1'
    pd.DataFrame({"text": ["a", "b"], "label": [0, 1]}).to_csv(path)  # index=True: an unnamed first column
    assert load_rows(str(path), "train") == [{"Unnamed: 0": "0", "text": "a", "label": 0},
                                             {"Unnamed: 0": "1", "text": "b", "label": 1}]
    path.write_text("")
    assert _refusal(path) == f"{path}: the file is empty; a CSV file starts with a header row of column names"


def test_a_long_csv_cell_is_read_whole(tmp_path):
    path = tmp_path / "rows.csv"
    text = "word " * 40_000  # 200,000 characters, over the csv module's default cell limit
    path.write_text(f'text,label\n"{text}",1\n')
    assert load_rows(str(path), "train") == [{"text": text, "label": 1}]


# Hub rows the catalog cannot convert -----------------------------------------------------------------


def test_a_hub_row_the_catalog_cannot_convert_is_one_line(tmp_path, monkeypatch):
    import datasets

    from fedpeft import hub

    monkeypatch.setattr(hub, "hub_unavailable", lambda *a, **k: None)
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *a, **k: [{"sentence": "fine", "label": 1}, {"text": "renamed", "label": 0}])
    with pytest.raises(DataError) as err:
        load_rows("sst2", "train", data_dir=str(tmp_path))  # not local: from the (stubbed) Hub
    assert str(err.value).startswith("hub:nyu-mll/glue split 'train' row 2: catalog dataset 'sst2' cannot convert it "
                                     "to fedpeft's schema (KeyError: 'sentence'; fields: label, text)")


# the real CSV and TSV files read as pandas read them before -----------------------------------------


REAL_TABLES = ["e2e_nlg/raw/devset.csv", "e2e_nlg/raw/testset_w_refs.csv", "sst2/raw/dev.tsv",
               "mrpc/raw/glue_dev_tokenized.tsv", "qnli/raw/glue_dev.tsv", "cola/raw/in_domain_dev.tsv"]


@pytest.mark.needs_data
@pytest.mark.parametrize("name", REAL_TABLES)
def test_the_shared_csv_and_tsv_files_read_as_pandas_read_them(name):
    """Quoted cells and CRLF lines (e2e), a byte-order mark (mrpc), quotes inside TSV cells (qnli), an unnamed
    column (cola) and numeric labels (sst2): the rows the pandas reader gave, cell for cell."""
    import csv

    from conftest import DATA_DIR

    path = DATA_DIR / name
    tsv = name.endswith(".tsv")
    frame = pd.read_csv(path, sep="\t" if tsv else ",", dtype=str, keep_default_na=False,
                        quoting=csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL)
    expected = frame.to_dict(orient="records")
    for row in expected:  # the label cells as the old reader turned them into numbers
        if "label" in row:
            text = row["label"].strip()
            row["label"] = int(text) if text.lstrip("+-").isdigit() else (row["label"] if text else None)
    rows = read_file(path)
    assert len(rows) == len(frame) > 400 and rows == expected
