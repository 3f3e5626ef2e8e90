"""Property-based tests (hypothesis): generated hostile rows and config values
either load or fail with the documented error (DataError, ConfigError),
never another exception.

Every property runs a fixed set of examples (derandomize=True, no example
database), so a run is repeatable and never flaky; each takes a few seconds.
"""

import math
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from posttrain.config import SCHEMA, Config, config_to_yaml, load_config
from posttrain.config.dialects.verl.keys import alias_table
from posttrain.data.dataset import PromptDataset
from posttrain.data.schema import read_rows, write_rows
from posttrain.errors import ConfigError, DataError


def fixed(max_examples: int):
    """The same examples every run (derandomized, no example database); no deadline: a busy machine is slow."""
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def tok(trained_tiny_model_dir):
    from posttrain.models import load_tokenizer

    return load_tokenizer(trained_tiny_model_dir)


# --- rows ----------------------------------------------------------------------------------------------------

ODD = ["a\u200db", "\u202eabc\u200f", "e\u0301", "😀👨‍👩‍👧", "a\x00b", "中文", "x\u2028y", "\ufeff", " ", "", "\n",
       "\ud800", "ok\udfff", "<|im_end|>", "{{ x }}"]
# any code point, lone surrogates included (hypothesis leaves them out unless asked)
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=8) | st.sampled_from(ODD)
SCALAR = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | TEXT | st.binary(max_size=3))
KEY = TEXT | st.sampled_from(["role", "content", "ground_truth", "style"]) | st.integers(0, 2)
ANY = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEY, inner, max_size=3),
                   max_leaves=6)

GOOD_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12).filter(str.strip) | st.sampled_from(
    ["1+1=", "What is 2+3?", "中文 question", "😀 emoji"])
GOOD_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": GOOD_TEXT})
GOOD_ROW = st.fixed_dictionaries({
    "data_source": st.sampled_from(["arith", "openai/gsm8k"]),
    "prompt": st.lists(GOOD_MESSAGE, min_size=1, max_size=2),
    "ability": st.just("math"),
    "reward_model": st.fixed_dictionaries({"style": st.just("rule"), "ground_truth": GOOD_TEXT}),
    "extra_info": st.just({}) | st.fixed_dictionaries({"index": st.integers(0, 9)}),
})
COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]
# a value nearly right is more hostile than a random one: it gets past the first checks
NEAR = {
    "prompt": st.lists(st.fixed_dictionaries({"role": ANY | st.just("user"), "content": ANY | TEXT}), max_size=3),
    "reward_model": st.fixed_dictionaries({"style": ANY, "ground_truth": ANY}),
    "extra_info": st.dictionaries(KEY, ANY, max_size=2),
}


@st.composite
def hostile_row(draw):
    row = dict(draw(GOOD_ROW))
    for column in draw(st.lists(st.sampled_from(COLUMNS), min_size=1, max_size=3, unique=True)):
        kind = draw(st.sampled_from(["any", "near", "drop"]))
        if kind == "drop":
            row.pop(column)
        else:
            row[column] = draw(NEAR.get(column, ANY) if kind == "near" else ANY)
    return row


ROWS = st.lists(GOOD_ROW | hostile_row(), min_size=1, max_size=5)


@st.composite
def one_odd_column(draw):
    """Good rows, but one column's values all of one other kind: pyarrow writes these (one type per column)."""
    rows = [dict(r) for r in draw(st.lists(GOOD_ROW, min_size=1, max_size=4))]
    column = draw(st.sampled_from(COLUMNS))
    kind = draw(st.sampled_from([st.none(), st.integers(-5, 5), st.floats(), TEXT, st.lists(st.integers(), max_size=2),
                                 st.lists(TEXT, max_size=2), NEAR.get(column, st.none())]))
    for r in rows:
        r[column] = draw(st.none() | kind)
    return rows


def check_loaded(data: PromptDataset, num_rows: int) -> None:
    """What a loaded dataset promises the training step."""
    assert len(data) >= 1 and data.num_invalid + data.num_dropped + len(data) <= num_rows
    indices = [it.index for it in data.items]
    assert indices == sorted(set(indices)) and all(0 <= i < num_rows for i in indices)
    for it in data.items:
        assert isinstance(it.prompt_ids, list) and it.prompt_ids and all(type(t) is int for t in it.prompt_ids)
        assert it.ground_truth is not None and isinstance(it.extra_info, dict)
        assert isinstance(it.data_source, str) and it.data_source


def load_through_parquet(rows, tok):
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = write_rows(rows, Path(tmp) / "rows.parquet")
        except DataError:
            event("write_rows refused")  # pyarrow cannot store these rows: the writer says so
            return
        try:
            data = PromptDataset.build(read_rows(path), tok, max_prompt_length=64)
        except DataError:
            event("read_rows or build refused")
            return
        check_loaded(data, len(rows))
        event("loaded all rows" if len(data) == len(rows) else "loaded some rows")


@fixed(200)
@given(rows=ROWS)
def test_generated_rows_load_or_raise_data_error(rows, tok):
    load_through_parquet(rows, tok)


@fixed(120)
@given(rows=one_odd_column())
def test_a_column_of_another_type_loads_or_raises_data_error(rows, tok):
    load_through_parquet(rows, tok)


@fixed(200)
@given(rows=ROWS, truncation=st.sampled_from(["error", "left", "right"]), filter_overlong=st.booleans())
def test_rows_given_in_memory_load_or_raise_data_error(rows, truncation, filter_overlong, tok):
    # surrogates and mixed types reach build() this way (parquet refuses them before)
    try:
        data = PromptDataset.build(rows, tok, max_prompt_length=24, filter_overlong=filter_overlong,
                                   truncation=truncation)
    except DataError:
        event("build refused")
        return
    check_loaded(data, len(rows))
    event("loaded all rows" if len(data) == len(rows) else "loaded some rows")
    assert all(len(it.prompt_ids) <= 24 for it in data.items)


# --- config ---------------------------------------------------------------------------------------------------

REAL_KEYS = sorted(SCHEMA) + sorted(alias_table(SCHEMA))


def near_miss(key: str, position: int, char: str, how: str) -> str:
    i = position % (len(key) + 1)
    return {"insert": key[:i] + char + key[i:], "drop": key[:i] + key[i + 1:],
            "replace": key[:i] + char + key[i + 1:], "dot": key.replace(".", ".."),
            "case": key.upper()}[how]


CONFIG_KEY = (st.sampled_from(REAL_KEYS)
              | st.builds(near_miss, st.sampled_from(REAL_KEYS), st.integers(0, 60), st.characters(codec="utf-8"),
                          st.sampled_from(["insert", "drop", "replace", "dot", "case"]))
              | st.text(max_size=12)
              | st.sampled_from(REAL_KEYS).map(lambda k: "+" + k))
WEIRD_VALUES = ["", " ", "nan", "NaN", ".nan", "inf", "-inf", ".inf", "-1", "0", "-0.0", "1e400", "1.0e400",
                "9" * 40, "0x10", "0o7", "1_000", "True", "yes", "off", "null", "~", "[]", "{}", "[1, [2]]",
                "[a, {b: c}]", "{a: 1}", "{a: {b: {c: []}}}", "???", "${x}", "${oc.env:HOME}", "a${b}c",
                "${oc.env:NOPE_NOT_SET}", "!!set {a, b}", "!!binary aGk=", "!!python/object:os.system x",
                "!!float abc", "2020-01-01", "2020-01-01 10:00:00", "&a [*a]", "[", "{", "'", '"', "a: b: c",
                "- a\n- b", "---\na\n---\nb", "=", "a=b", "\x00", "\ud800", "é", "[console, jsonl]", "[0.9, 0.95]",
                "[nan, inf]", "[1, 2, 3]", "'1'", "!!int 3", "[.inf]", "1.5", "64", "8", "grpo", "gae", "dapo",
                "2020-02-30", "!!bool x", "!!timestamp x", "!!int abc", "[" * 2000, "a\nb", "multi\nline: [1]",
                '"a\\nb"', '"x\\u2028y"', '"\\ud800"', '"\\x00"', "a\x85b"]


def typed_value(key: str):
    """A value of roughly the key's own type: values that get past OmegaConf reach validate()."""
    typ = str(SCHEMA[key][0]) if key in SCHEMA else ""
    if "bool" in typ:
        return st.sampled_from(["true", "false", "True", "1", "maybe"])
    if "int" in typ:
        return st.integers(-3, 300).map(str) | st.sampled_from(["-1", "0", str(2**70), "null"])
    if "float" in typ:
        return st.floats().map(repr) | st.sampled_from(["1e-5", ".inf", "-.inf", ".nan", "0.0", "1e400"])
    if "List" in typ:
        return st.lists(st.text(max_size=4) | st.floats().map(repr), max_size=3).map(lambda v: "[" + ",".join(v) + "]")
    return st.text(max_size=10)


CONFIG_VALUE = st.sampled_from(WEIRD_VALUES) | st.text(max_size=10) | st.floats().map(repr) | st.integers().map(str)
REAL_KEY = st.sampled_from(sorted(SCHEMA))
# mostly real keys: an unknown key fails at once, a real one with an odd value goes through OmegaConf and validate()
OVERRIDE = st.one_of(
    st.builds("{}={}".format, REAL_KEY, st.sampled_from(WEIRD_VALUES)),
    REAL_KEY.flatmap(lambda k: typed_value(k).map(lambda v: f"{k}={v}")),
    REAL_KEY.flatmap(lambda k: typed_value(k).map(lambda v: f"{k}={v}")),
    st.builds("{}={}".format, CONFIG_KEY, CONFIG_VALUE),
    st.text(max_size=10),
)


def loads_or_config_error(path, overrides) -> None:
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        assert len(str(e).strip().splitlines()) == 1  # one line, as the CLI prints it
        event("ConfigError")
        return
    event("loaded")
    assert isinstance(cfg, Config)
    config_to_yaml(cfg).encode("utf-8")  # what the run saves first: a loaded config can be written
    # a config that loads can be trained on: the sizes validate() checks are sizes
    assert cfg.data.train_batch_size >= 1 and cfg.rollout.n >= 1 and not math.isnan(cfg.actor.lr)


@fixed(200)
@given(overrides=st.lists(OVERRIDE, max_size=4))
def test_generated_overrides_load_or_raise_config_error(overrides):
    loads_or_config_error(None, overrides)


SECTION = st.sampled_from(sorted({k.split(".")[0] for k in REAL_KEYS}) + ["", "x", "actor.lr"])
LEAF = st.sampled_from(sorted({k.split(".")[-1] for k in REAL_KEYS}))
YAML_SCALAR = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6))
YAML_TREE = st.recursive(
    st.dictionaries(LEAF | st.text(max_size=4), YAML_SCALAR | st.lists(YAML_SCALAR, max_size=2), max_size=3),
    lambda inner: st.dictionaries(SECTION | LEAF, inner | YAML_SCALAR, max_size=3), max_leaves=8)


def yaml_text(tree) -> str:
    return yaml.safe_dump(tree, allow_unicode=True)


CONFIG_FILE = (YAML_TREE.map(yaml_text)
               | st.sampled_from(REAL_KEYS).flatmap(lambda k: CONFIG_VALUE.map(lambda v: f"{k}: {v}\n"))
               | st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
               | st.sampled_from(["", "---", "- a\n- b\n", "42", "actor:\n  lr: [", "actor: {lr: 1}\nactor: 2\n",
                                  "actor:\n", "? [a, b]\n: c\n", "1: 2\n", "null: 1\n", "actor:\n  1: 2\n",
                                  "&a {actor: *a}\n", "trainer:\n  logger: *x\n"]))


@fixed(150)
@given(text=CONFIG_FILE, raw=st.binary(max_size=8), use_raw=st.booleans(), overrides=st.lists(OVERRIDE, max_size=2))
def test_generated_config_files_load_or_raise_config_error(text, raw, use_raw, overrides):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        # surrogates and raw bytes make a file that is not UTF-8, as a truncated download or another encoding would
        path.write_bytes(raw if use_raw else text.encode("utf-8", "surrogatepass"))
        loads_or_config_error(str(path), overrides)
