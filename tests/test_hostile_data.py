"""Hostile rows: every kind of unusable row is skipped at load time with one
warning line (count, first row indices and reasons, the fix); a file with no
usable row is a DataError; odd but valid unicode loads and tokenizes."""

import copy
import unicodedata

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain.data.dataset import PromptDataset, encode_prompt
from posttrain.data.schema import Rows, check_row, read_rows, write_rows
from posttrain.errors import DataError


@pytest.fixture(scope="module")
def tok(trained_tiny_model_dir):
    """The embedded model's tokenizer: byte-level BPE with a ChatML template."""
    from posttrain.models import load_tokenizer

    return load_tokenizer(trained_tiny_model_dir)


def row(content="1+1=", truth="2", source="arith", **extra):
    return {"data_source": source, "prompt": [{"role": "user", "content": content}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"k": "v"}, **extra}


def msg(**fields):
    return {"role": "user", "content": "x", **fields}


# one schema for all (so that one parquet file holds them): every bad row differs from a good one in one field
MIXED = [
    row("good 0"),
    {**row(), "prompt": [msg(content=None)]},
    {**row(), "prompt": []},
    row("good 3"),
    {**row(), "reward_model": {"style": "rule", "ground_truth": None}},
    {**row(), "prompt": None},
    {**row(), "data_source": None},
    {**row(), "data_source": ""},
    {**row(), "prompt": [msg(role=None)]},
    {**row(), "prompt": [msg(content="  \n\t")]},
    {**row(), "prompt": [msg(), None]},
    {**row(), "reward_model": None},
    row("good 12"),
]
REASONS = {
    1: "prompt message 0 content is None, not a string",
    2: "prompt is an empty list of messages",
    4: "no reward_model.ground_truth",
    5: "prompt is None, not a list of {role, content} messages or a string",
    6: "data_source is None, not a string",
    7: "data_source is empty",
    8: "prompt message 0 role is None, not a string",
    9: "every prompt message is blank",
    10: "prompt message 1 is None, not a {role, content} dict",
    11: "reward_model is None, not a dict with a ground_truth",
}
GOOD = [0, 3, 12]


def test_check_row_names_each_problem():
    for i, reason in REASONS.items():
        assert check_row(MIXED[i]) == reason
    assert all(check_row(MIXED[i]) is None for i in GOOD)
    assert check_row({**row(), "extra_info": ["a"]}) == "extra_info is list, not a dict"
    assert check_row({**row(), "extra_info": None}) is None  # null: read as {}
    assert check_row("text") == "row is str, not a dict of columns"
    assert check_row(row(), prompt_key="question") == (
        "question is None, not a list of {role, content} messages or a string")
    assert check_row({**row(), "prompt": "plain text"}) is None and check_row({**row(), "prompt": " "}) == (
        "prompt is blank")
    assert check_row(row("a\ud800b")) == "prompt[0].content holds text that is not valid unicode (a lone surrogate)"
    assert "reward_model.ground_truth holds text that is not valid unicode" in check_row(row(truth="\udfff"))
    assert "a key of extra_info holds text" in check_row({**row(), "extra_info": {"\ud800": 1}})


def test_a_mixed_file_loads_its_good_rows_in_order_and_warns_once(tmp_path, tok, capsys):
    write_rows(MIXED, tmp_path / "mixed.parquet")
    write_rows([row("good b0"), {**row(), "prompt": []}, row("good b2")], tmp_path / "b.parquet")
    rows = read_rows([tmp_path / "mixed.parquet", tmp_path / "b.parquet"])
    assert [r["prompt"][0]["content"] for r in rows] == ["good 0", "good 3", "good 12", "good b0", "good b2"]
    assert rows.indices == [0, 3, 12, 13, 15] and rows.num_invalid == 11  # file b's rows follow the 13 of mixed
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 2  # one per file
    first = ", ".join(f"row {i}: {REASONS[i]}" for i in (1, 2, 4, 5, 6)).replace(", row", "; row")
    assert warnings[0] == (f"posttrain: warning: skipped 10 of 13 rows of '{tmp_path / 'mixed.parquet'}' "
                           f"({first}; and 5 more); fix or drop them")
    assert "skipped 1 of 3 rows of" in warnings[1] and "(row 1: prompt is an empty list of messages)" in warnings[1]

    data = PromptDataset.build(rows, tok, 512)
    assert [it.index for it in data.items] == [0, 3, 12, 13, 15]
    assert data.num_invalid == 11 and data.num_dropped == 0
    assert data[1].messages[0]["content"] == "good 3" and data[1].ground_truth == "2"
    assert data[0].extra_info == {"k": "v"}
    assert "warning" not in capsys.readouterr().err  # read_rows already said it; build skipped nothing more
    # data.val_max_samples cuts the rows: the indices go with them
    assert PromptDataset.build(rows[:2], tok, 512).items[1].index == 3


def test_a_file_without_a_usable_row_is_a_data_error(tmp_path):
    write_rows([MIXED[i] for i in REASONS], tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"data file '.*bad.parquet' has no usable row: skipped 10 of 10 rows "
                                        r"\(row 0: prompt message 0 content is None, not a string; row 1: .*"
                                        r"and 5 more\); fix the rows"):
        read_rows(tmp_path / "bad.parquet")


ODD = ["zero\u200dwidth\u200bjoiner", "\u202eRTL override\u200f mark", "e\u0301 combining a\u0308", "😀 👨‍👩‍👧 🏳️‍🌈",
       "NUL\x00inside", "中文 日本語 한국어", "line\u2028separator\u2029para", "\ufeffBOM", "\U0010fffd private",
       "tab\tand\r\nnewlines", "{{ not jinja }} {% raw %}", "<|im_end|> looks special"]


def test_odd_but_valid_unicode_loads_and_round_trips(tmp_path, tok, capsys):
    write_rows([row(s, truth=s) for s in ODD], tmp_path / "odd.parquet")
    rows = read_rows(tmp_path / "odd.parquet")
    data = PromptDataset.build(rows, tok, 512)
    assert len(data) == len(ODD) and data.num_invalid == 0 and "warning" not in capsys.readouterr().err
    for s, item in zip(ODD, data.items):
        assert item.messages[0]["content"] == s and item.ground_truth == s  # parquet keeps the text exactly
        assert unicodedata.normalize("NFC", s) in tok.decode(item.prompt_ids)
        # the tokenizer normalizes to NFC (é stays é, whether one code point or two); nothing else changes
        assert tok.decode(encode_prompt(tok, s)) == unicodedata.normalize("NFC", s)


def test_columns_of_unexpected_types(tmp_path, capsys):
    def write(name, **columns):
        base = {"data_source": ["a", "a"], "prompt": [[msg()], [msg()]],
                "reward_model": [{"ground_truth": "1"}, {"ground_truth": "1"}]}
        pq.write_table(pa.table({**base, **columns}), tmp_path / name)
        return tmp_path / name

    with pytest.raises(DataError, match=r"no usable row: .*\(row 0: prompt is int, not a list of"):
        read_rows(write("int_prompt.parquet", prompt=[1, 2]))
    with pytest.raises(DataError, match=r"\(row 0: reward_model is str, not a dict with a ground_truth"):
        read_rows(write("str_rm.parquet", reward_model=["1", "2"]))
    with pytest.raises(DataError, match=r"\(row 0: data_source is bytes, not a string"):
        read_rows(write("bytes_source.parquet", data_source=[b"a", b"b"]))
    rows = read_rows(write("list_extra.parquet", extra_info=[["x"], None]))  # a list is skipped, null is {}
    assert rows == [{"data_source": "a", "prompt": [msg()], "reward_model": {"ground_truth": "1"}, "ability": "",
                     "extra_info": {}}] and rows.indices == [1]
    assert "(row 0: extra_info is list, not a dict)" in capsys.readouterr().err
    empty = pa.Table.from_pylist([row()]).slice(0, 0)
    pq.write_table(empty, tmp_path / "empty.parquet")
    with pytest.raises(DataError, match="'.*empty.parquet' holds no rows"):
        read_rows(tmp_path / "empty.parquet")
    pq.write_table(pa.table({"x": pa.array([], pa.int64())}), tmp_path / "nothing.parquet")
    with pytest.raises(DataError, match="lacks column"):
        read_rows(tmp_path / "nothing.parquet")
    (tmp_path / "dir.parquet").mkdir()
    with pytest.raises(DataError):
        read_rows(tmp_path / "dir.parquet")
    (tmp_path / "garbage.parquet").write_bytes(b"PAR1" + bytes(range(256)) + b"PAR1")
    with pytest.raises(DataError, match="is not a readable parquet file"):
        read_rows(tmp_path / "garbage.parquet")


def test_invalid_utf8_in_a_string_column_skips_that_row(tmp_path, capsys):
    # pyarrow does not validate a string column built from raw buffers, and parquet stores the bytes as they are
    data, offsets = b"a\xff\xfe", pa.array([0, 1, 3], pa.int32()).buffers()[1]
    sources = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(data)])
    pq.write_table(pa.table({"data_source": sources, "prompt": [[msg()], [msg()]],
                             "reward_model": [{"ground_truth": "1"}, {"ground_truth": "2"}]}), tmp_path / "u.parquet")
    rows = read_rows(tmp_path / "u.parquet")
    assert rows.indices == [0] and rows[0]["data_source"] == "a"
    assert "(row 1: cannot be decoded (invalid UTF-8 text" in capsys.readouterr().err


def test_write_rows_refuses_what_parquet_cannot_hold(tmp_path):
    with pytest.raises(DataError, match=r"row 1 for '.*x.parquet': prompt\[0\].content holds text that is not "
                                        r"valid unicode .*errors='replace'"):
        write_rows([row(), row("\ud800")], tmp_path / "x.parquet")
    with pytest.raises(DataError, match="integer too large for parquet's int64"):
        write_rows([row(extra_info={"n": 2**70})], tmp_path / "x.parquet")
    with pytest.raises(DataError, match="give every nested dict at least one key"):
        write_rows([row(extra_info={"nested": {}})], tmp_path / "x.parquet")
    with pytest.raises(DataError, match="row 0 for .* is not a dict of named columns"):
        write_rows([["not", "a", "dict"]], tmp_path / "x.parquet")
    with pytest.raises(DataError, match="is not a dict of named columns"):
        write_rows([{1: "a"}], tmp_path / "x.parquet")
    assert not list(tmp_path.iterdir())
    # a column that only a later row has is kept (pyarrow's from_pylist would read the first row's keys only)
    write_rows([row("a"), row("b", split="test")], tmp_path / "y.parquet")
    assert [r.get("split") for r in read_rows(tmp_path / "y.parquet")] == [None, "test"]
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match="cannot write rows to"):
        write_rows([row()], tmp_path / "file" / "z.parquet")


class NoTemplate:
    """A tokenizer without a chat template that knows only ASCII (and drops the rest)."""

    chat_template = None
    name_or_path = "ascii-only"

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text if c.isascii()]


def test_build_skips_rows_given_in_memory(tok, capsys):
    rows = [row("ok"), row("a\ud800"), {**row(), "prompt": [msg(content=3)]}, row("ok too")]
    data = PromptDataset.build(rows, tok, 512, name="validation")
    assert [it.index for it in data.items] == [0, 3] and data.num_invalid == 2
    err = capsys.readouterr().err
    assert ("posttrain: warning: skipped 2 of 4 validation rows (row 1: prompt[0].content holds text that is not "
            "valid unicode (a lone surrogate); row 2: prompt message 0 content is int, not a string); "
            "fix or drop them") in err
    # a prompt the tokenizer makes nothing of
    data = PromptDataset.build([row("中文"), row("abc")], NoTemplate(), 512)
    assert [it.index for it in data.items] == [1] and data.num_invalid == 1
    assert "(row 0: the prompt is 0 tokens long)" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"train dataset has no usable row: skipped 1 of 1 rows \(row 0: the prompt "
                                        r"is 0 tokens long\); fix or drop the rows"):
        PromptDataset.build([row("日本")], NoTemplate(), 512)
    # a chat template that refuses a row (as some refuse roles that do not alternate)
    strict = copy.deepcopy(tok)
    strict.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be "
                            "the user') }}{% endif %}" + tok.chat_template)
    data = PromptDataset.build([{**row(), "prompt": [msg(role="assistant")]}, row()], strict, 512)
    assert [it.index for it in data.items] == [1]
    assert "(row 0: the tokenizer refused the prompt (TemplateError: the first message must be the user))" in (
        capsys.readouterr().err)


def test_rows_slices_keep_their_indices():
    rows = Rows([{"a": 1}, {"a": 2}, {"a": 3}], indices=[0, 4, 7], num_invalid=5)
    assert rows[1:].indices == [4, 7] and rows[1:].num_invalid == 5 and rows[:2] == [{"a": 1}, {"a": 2}]
    assert rows[2] == {"a": 3} and Rows([{"a": 1}]).indices == [0]
