"""Corpus readers: every source kind, its options, and one clear error per kind of bad input."""

from __future__ import annotations

import pytest

from attnflow.errors import InputError
from attnflow.runs.readers import ReadOptions, open_corpus, wiki_path

from corpus_helpers import write_jsonl


def test_wiki_is_read_by_path_in_file_order():
    corpus = open_corpus("wiki")
    assert corpus.path == wiki_path() and corpus.path.name == "summaries_en-us.json"
    first = next(iter(corpus))
    assert first.startswith("20th-century classical music is Western art music")
    assert corpus.validate() == 10033


def test_txt_one_document_per_line_skips_blank_lines(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("first doc.\n\n  \nsecond doc.\r\nthird\n", encoding="utf-8")
    assert list(open_corpus(str(path))) == ["first doc.", "second doc.", "third"]


def test_txt_paragraph_mode_joins_lines_between_blank_lines(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("a one.\na two.\n\n\nb one.\n\nc one.\nc two.", encoding="utf-8")
    docs = list(open_corpus(str(path), ReadOptions(txt_docs="paragraph")))
    assert docs == ["a one.\na two.", "b one.", "c one.\nc two."]


def test_txt_byte_order_mark_is_dropped(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffhello.\n".encode("utf-8"))
    assert list(open_corpus(str(path))) == ["hello."]


def test_jsonl_reads_the_chosen_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"body": "one.", "id": 1}, {"body": "two."}, "", {"body": None}])
    assert list(open_corpus(str(path), ReadOptions(text_field="body"))) == ["one.", "two."]


def test_jsonl_malformed_line_reports_its_number(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok."}, {"text": "ok."}, '{"text": "broken'])
    with pytest.raises(InputError, match=r"d\.jsonl line 3: malformed JSON.*\(use skip_bad to skip bad lines\)"):
        open_corpus(str(path)).validate()


def test_jsonl_skip_bad_counts_and_skips(tmp_path):
    records = [{"text": "a."}, "not json", {"text": 5}, {"other": "x"}, '["a list"]', {"text": "b."}]
    corpus = open_corpus(str(write_jsonl(tmp_path / "d.jsonl", records)), ReadOptions(skip_bad=True))
    assert corpus.validate() == 2
    assert list(corpus) == ["a.", "b."]
    assert corpus.info()["bad_lines_skipped"] == 4


@pytest.mark.parametrize(
    "record, message",
    [
        ({"body": "x"}, r"line 1: no field 'text' \(fields: body\); choose the text with text_field"),
        ({"text": ["x"]}, r"line 1: field 'text' is a list, not a string"),
        ([1, 2], r"line 1: expected a JSON object, got list"),
    ],
)
def test_jsonl_bad_records_say_what_is_wrong(tmp_path, record, message):
    path = write_jsonl(tmp_path / "d.jsonl", [record])
    with pytest.raises(InputError, match=message):
        open_corpus(str(path)).validate()


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".csv"])
def test_invalid_utf8_says_line_and_byte(tmp_path, suffix):
    path = tmp_path / f"bad{suffix}"
    good = {".txt": b"fine.\n", ".jsonl": b'{"text": "fine."}\n', ".csv": b"text\nfine.\n"}[suffix]
    path.write_bytes(good + b'{"text": "caf\xe9"}\n')
    line = good.count(b"\n") + 1
    with pytest.raises(InputError, match=rf"invalid UTF-8 at line {line}, byte {len(good) + 13} \(column 14\)"):
        open_corpus(str(path)).validate()


def test_csv_column_and_quoted_newlines(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text('id,review\n1,"good film,\nreally."\n2,bad.\n3,\n', encoding="utf-8")
    assert list(open_corpus(str(path), ReadOptions(text_column="review"))) == ["good film,\nreally.", "bad."]


def test_csv_missing_column_lists_the_columns(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("id,review\n1,x\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"no column 'text' \(columns: id, review\); choose the text with text_column"):
        open_corpus(str(path)).validate()


def test_parquet_column_missing_column_and_non_text_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["one.", None, "two."], "n": [1, 2, 3]}), path)
    assert list(open_corpus(str(path), ReadOptions(text_column="body"))) == ["one.", "two."]
    with pytest.raises(InputError, match=r"no column 'text' \(columns: body, n\)"):
        open_corpus(str(path)).validate()
    with pytest.raises(InputError, match=r"column 'n' holds int64, not text"):
        open_corpus(str(path), ReadOptions(text_column="n")).validate()


@pytest.mark.parametrize("content", [b"", b"\n\n   \n"])
def test_empty_corpus_is_refused(tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_bytes(content)
    with pytest.raises(InputError, match="has no text: the corpus is empty"):
        open_corpus(str(path)).validate()


def test_unknown_type_missing_file_and_folder(tmp_path):
    (tmp_path / "x.docx").write_text("x")
    with pytest.raises(InputError, match=r"unknown file type '\.docx'; use \.txt, \.jsonl, \.csv or \.parquet"):
        open_corpus(str(tmp_path / "x.docx"))
    with pytest.raises(InputError, match="no such file"):
        open_corpus(str(tmp_path / "nope.txt"))
    with pytest.raises(InputError, match="is a folder"):
        open_corpus(str(tmp_path))
    with pytest.raises(InputError, match="^txt_docs must be one of"):
        open_corpus("wiki", ReadOptions(txt_docs="sentence"))


def test_messages_are_one_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"text": '])
    with pytest.raises(InputError) as caught:
        open_corpus(str(path)).validate()
    assert "\n" not in str(caught.value)


def test_csv_long_fields_and_malformed_csv(tmp_path):
    path = tmp_path / "long.csv"
    long_text = "word " * 40000  # 200,000 characters: above the csv module's default field limit
    path.write_text(f'text\n"{long_text}"\n', encoding="utf-8")
    assert list(open_corpus(str(path))) == [long_text]
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b'text\nok\n"a"b\n')
    with pytest.raises(InputError, match=r"bad\.csv line 3: malformed CSV"):
        open_corpus(str(bad)).validate()
