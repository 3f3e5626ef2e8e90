"""data.dataset_name / val_dataset_name (data/named.py), data.prompt_file /
system_prompt_file (data/prompts.py), and the math preprocessor's inputs for
the named sets, on literal cases. No network: raw files are written here in
the shape the Hub gives them, and the commands a missing file's error names
are run as they are written."""

import json
import re
import shlex

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_dataset import char_tokenizer

from posttrain.driver.build_data import data_files, load_data
from posttrain.cli import main
from posttrain.config import load_config
from posttrain.data import named
from posttrain.data.dataset import PromptDataset
from posttrain.data.prompts import PromptTemplates, read_templates
from posttrain.data.schema import read_rows, write_rows
from posttrain.errors import ConfigError, DataError

# NeMo-RL's examples/prompts/cot.txt, byte for byte: its braces doubled for str.format, two backslashes
COT = ("Think step-by-step to solve the following problem. Output your answer inside of \\\\boxed{{}} tags.:\n{}\n\n"
       "Let's think step-by-step")


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


def row(content, **extra_info):
    return {"data_source": "DigitalLearningGmbH/MATH-lighteval", "prompt": [{"role": "user", "content": content}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": extra_info}


def run_command(message: str, program: str) -> None:
    """Run the `program ...` command quoted in an error message, as a user would paste it."""
    commands = [c for c in re.findall(r"`([^`]+)`", message) if c.startswith(program)]
    assert len(commands) == 1, message
    argv = shlex.split(commands[0])
    assert argv[:2] == ["posttrain", "preprocess"]
    assert main(argv[1:]) == 0


# ---------------------------------------------------------------- resolve()

def test_resolve_finds_the_file_in_posttrain_data(data_dir):
    write_rows([row("2+2?")], data_dir / "deepscaler" / "train.parquet")
    assert named.resolve("DeepScaler", "train") == data_dir / "deepscaler" / "train.parquet"
    write_rows([row("2+2?")], data_dir / "gsm8k" / "test.parquet")
    assert named.resolve("gsm8k", "test") == data_dir / "gsm8k" / "test.parquet"  # NeMo-RL's second spelling


def test_the_data_directory_defaults_to_the_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("POSTTRAIN_DATA", raising=False)
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    assert named.data_dir() == tmp_path / "cache" / "data"


def test_a_missing_file_names_the_download_and_the_command(data_dir):
    with pytest.raises(DataError) as e:
        named.resolve("DeepScaler", "train")
    raw, out = data_dir / "raw" / "deepscaler", data_dir / "deepscaler"
    assert str(e.value) == (
        f"data.dataset_name=DeepScaler: no {out / 'train.parquet'}; download deepscaler.json from the Hub dataset "
        "agentica-org/DeepScaleR-Preview-Dataset with `hf download agentica-org/DeepScaleR-Preview-Dataset "
        f"deepscaler.json --repo-type dataset --local-dir {raw}` and run `posttrain preprocess math --input "
        f"{raw / 'deepscaler.json'} --split train --output-dir {out}`")
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"data.val_dataset_name=AIME2024: no .*aime2024/test.parquet; .* "
                                        r"`posttrain preprocess math --input .* --split test --output-dir"):
        named.resolve("AIME2024", "test")


def test_dapo_math_needs_no_preprocessing_only_placing(data_dir):
    with pytest.raises(DataError) as e:
        named.resolve("DAPOMath17K", "train")
    assert str(e.value) == (
        f"data.dataset_name=DAPOMath17K: no {data_dir / 'dapo-math-17k' / 'data' / 'dapo-math-17k.parquet'}; it is "
        "in verl's parquet layout on the Hub already (no preprocessing): download it into place with `hf download "
        "BytedTsinghua-SIA/DAPO-Math-17k data/dapo-math-17k.parquet --repo-type dataset --local-dir "
        f"{data_dir / 'dapo-math-17k'}`")
    # what that download writes (verl's rows) is what a run reads
    dapo = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "Solve 2+2. Answer: $Answer"}],
            "ability": "MATH", "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": "4"},
            "extra_info": {"index": "a1"}}
    write_rows([dapo], data_dir / "dapo-math-17k" / "data" / "dapo-math-17k.parquet")
    assert read_rows(named.resolve("DAPOMath17K"))[0]["reward_model"]["ground_truth"] == "4"


def test_generated_sets_name_their_command(data_dir):
    with pytest.raises(DataError) as e:
        named.resolve("arith", "train")
    assert str(e.value).endswith(f"make it with `posttrain preprocess arith --output-dir {data_dir / 'arith'}`")
    run_command(str(e.value), "posttrain preprocess")
    assert named.resolve("arith", "train").is_file() and named.resolve("arith", "test").is_file()


@pytest.mark.parametrize("name", ["squad", "HelpSteer3", "tulu3_sft_mixture", "open_assistant", "mmpr-tiny",
                                  "avqa", "ResponseDataset", "openai_format", "NemoGymDataset"])
def test_names_posttrain_cannot_prepare_are_refused(name, data_dir):
    with pytest.raises(ConfigError) as e:
        named.resolve(name, "train")
    msg = str(e.value)
    assert msg.startswith(f"data.dataset_name={name}: NeMo-RL's {name} is ") and "\n" not in msg
    assert "posttrain cannot prepare" in msg and msg.endswith("and pass them as data.train_files")
    assert not data_dir.exists()


def test_squad_says_what_it_is():
    with pytest.raises(ConfigError, match=r"^data.dataset_name=squad: NeMo-RL's squad is an SFT set .*write parquet "
                                          r"rows \(data_source, prompt, reward_model.ground_truth"):
        named.lookup("squad")


def test_an_unknown_name_gets_the_nearest_known_one():
    with pytest.raises(ConfigError, match=r"data.dataset_name=DeepScalar is not a dataset posttrain knows \(did you "
                                          r"mean DeepScaler\?\); known names: DeepScaler, OpenMathInstruct-2"):
        named.lookup("DeepScalar")
    with pytest.raises(ConfigError, match=r"did you mean OpenMathInstruct-2\?"):
        named.lookup("openmathinstruct2")
    with pytest.raises(ConfigError) as e:
        named.lookup("zzz")
    assert "did you mean" not in str(e.value)


def test_a_split_the_set_lacks_says_which_key_to_use():
    with pytest.raises(ConfigError, match="AIME2024 has no train split .*set data.val_dataset_name=AIME2024"):
        named.lookup("AIME2024", "train")
    with pytest.raises(ConfigError, match="DeepScaler has no test split .*set data.dataset_name=DeepScaler"):
        named.lookup("DeepScaler", "test")


def test_every_table_entry_is_well_formed():
    for entry in named.TABLE:
        assert set(entry.files) <= {"train", "test"} and entry.files
        assert entry.val in (None, "test") or "test" in named.BY_NAME[entry.val].files
        assert entry.val != "test" or "test" in entry.files
        assert entry.prepare or entry.hub  # made by a command, or downloaded as it is
        assert not entry.sft or (entry.sft[0].endswith(".parquet") and entry.sft[0] not in entry.files.values()
                                 and entry.sft[1] and "train" in entry.files)  # an SFT form: its own command
    assert not set(named.REFUSED) & set(named.BY_NAME)


# ---------------------------------------------------------------- config keys

def test_config_validation_checks_names_without_the_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_DATA", str(tmp_path / "nothing-here"))
    cfg = load_config(None, ["data.dataset_name=DeepScaler", "data.val_dataset_name=AIME2025",
                             "data.prompt_file=no/such/file.txt"])
    assert (cfg.data.dataset_name, cfg.data.val_dataset_name) == ("DeepScaler", "AIME2025")
    assert cfg.data.prompt_file == "no/such/file.txt" and cfg.data.system_prompt_file is None
    assert not (tmp_path / "nothing-here").exists()
    with pytest.raises(ConfigError, match=r"data.train_files and data.dataset_name=DeepScaler are both set; keep one"):
        load_config(None, ["data.dataset_name=DeepScaler", "data.train_files=[a.parquet]"])
    with pytest.raises(ConfigError, match=r"data.val_files and data.val_dataset_name=AIME2024 are both set"):
        load_config(None, ["data.val_dataset_name=AIME2024", "data.val_files=[b.parquet]"])
    with pytest.raises(ConfigError, match=r"did you mean GSM8K\?"):
        load_config(None, ["data.dataset_name=GSM8"])
    with pytest.raises(ConfigError, match="HelpSteer3 is a preference set"):
        load_config(None, ["data.val_dataset_name=HelpSteer3"])


# ---------------------------------------------------------------- prompt files

def test_nemo_rl_cot_file_gives_nemo_rl_text_with_a_boxed_in_the_template(tmp_path):
    (tmp_path / "cot.txt").write_text(COT)
    t = read_templates(str(tmp_path / "cot.txt"), None)
    out = t.apply([{"role": "user", "content": "What is $\\frac{1}{2}+\\frac{1}{2}$? Let's think step by step and "
                                                "output the final answer within \\boxed{}."}],
                  {"split": "test", "index": 0, "problem": "What is $\\frac{1}{2}+\\frac{1}{2}$?"})
    # str.format, as NeMo-RL: {{}} -> {}, the problem (braces and all) in place of {}
    assert out == [{"role": "user", "content": "Think step-by-step to solve the following problem. Output your answer "
                                               "inside of \\\\boxed{} tags.:\nWhat is $\\frac{1}{2}+\\frac{1}{2}$?\n\n"
                                               "Let's think step-by-step"}]
    assert COT.format("What is $\\frac{1}{2}+\\frac{1}{2}$?") == out[0]["content"]


def test_a_template_with_a_single_brace_boxed_beside_the_problem_is_refused(tmp_path):
    """`\\boxed{}` and `{}`: str.format would fail (two fields, one value); str.replace could not tell which
    `{}` is the problem. Refused, with the fix."""
    (tmp_path / "p.txt").write_text("Put the answer in \\boxed{}.\n{}")
    with pytest.raises(ConfigError) as e:
        read_templates(str(tmp_path / "p.txt"), None)
    assert str(e.value) == (
        f"data.prompt_file={tmp_path / 'p.txt'} has 2 replacement fields ({{}}, {{}}) where str.format fills exactly "
        "one {} with the problem; write literal braces doubled, as NeMo-RL's prompt files do (\\boxed{{}}), and one "
        "{} where the problem goes")
    (tmp_path / "fixed.txt").write_text("Put the answer in \\boxed{{}}.\n{}")
    fixed = read_templates(str(tmp_path / "fixed.txt"), None)
    assert fixed.apply([{"role": "user", "content": "x"}], {"problem": "2+2?"})[0]["content"] == \
        "Put the answer in \\boxed{}.\n2+2?"


@pytest.mark.parametrize("text, message", [
    ("Answer in \\boxed{}.", r"its only \{\} follows \\boxed, so the problem would go inside"),
    ("Solve it carefully.", r"has no \{\} where the problem goes; .*data.system_prompt_file"),
    ("Solve {problem}", r"has 1 replacement field \(\{problem\}\)"),
    ("Solve } {}", r"read with Python's str.format, as NeMo-RL reads it, and it fails \(Single '\}'"),
])
def test_templates_str_format_cannot_fill_are_refused(tmp_path, text, message):
    (tmp_path / "p.txt").write_text(text)
    with pytest.raises(ConfigError, match=message):
        read_templates(str(tmp_path / "p.txt"), None)


def test_a_row_without_extra_info_problem_uses_its_last_user_message():
    t = PromptTemplates(prompt="Q: {}\nA:")
    msgs = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "Solve 3+4. Answer: $Answer"}]
    assert t.apply(msgs, {"index": 7}) == msgs[:2] + [{"role": "user", "content": "Q: Solve 3+4. Answer: $Answer\nA:"}]
    assert msgs[2]["content"] == "Solve 3+4. Answer: $Answer"  # the row is not changed
    assert t.apply(msgs, {"question": "Janet's ducks?"})[2]["content"] == "Q: Janet's ducks?\nA:"  # gsm8k's key
    assert t.apply("3+4=", None) == [{"role": "user", "content": "Q: 3+4=\nA:"}]  # a plain-string prompt


def test_system_prompt_file_goes_first(tmp_path):
    (tmp_path / "sys.txt").write_text("You are a careful mathematician.\n")
    t = read_templates(None, str(tmp_path / "sys.txt"))
    assert t.apply([{"role": "user", "content": "2+2?"}], {}) == [
        {"role": "system", "content": "You are a careful mathematician.\n"}, {"role": "user", "content": "2+2?"}]
    # the row's own leading system message is replaced, not doubled
    assert t.apply([{"role": "system", "content": "old"}, {"role": "user", "content": "2+2?"}], {}) == [
        {"role": "system", "content": "You are a careful mathematician.\n"}, {"role": "user", "content": "2+2?"}]
    (tmp_path / "cot.txt").write_text(COT)
    both = read_templates(str(tmp_path / "cot.txt"), str(tmp_path / "sys.txt"))
    out = both.apply([{"role": "user", "content": "2+2? Let's think"}], {"problem": "2+2?"})
    assert [m["role"] for m in out] == ["system", "user"] and "tags.:\n2+2?\n\n" in out[1]["content"]


def test_a_missing_prompt_file_is_one_line_naming_key_path_and_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        read_templates("examples/prompts/cot.txt", None)
    assert str(e.value) == (f"data.prompt_file=examples/prompts/cot.txt does not exist (looked in {tmp_path}); give "
                            "the prompt file, or set data.prompt_file=null to keep the dataset's own prompts")
    with pytest.raises(ConfigError, match=r"^data.system_prompt_file=sys.txt does not exist .*set "
                                          r"data.system_prompt_file=null to add no system message$"):
        read_templates(None, "sys.txt")
    assert read_templates(None, None) is None


def test_templates_are_applied_before_tokenizing():
    tok = char_tokenizer("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    rows = [row("2+2? Let's think step by step", problem="2+2?"), row("no extra info")]
    data = PromptDataset.build(rows, tok, 200, templates=PromptTemplates(prompt="Q: {}", system="S"))
    assert tok.decode(data[0].prompt_ids) == "[system]S[user]Q: 2+2?"
    assert tok.decode(data[1].prompt_ids) == "[system]S[user]Q: no extra info"
    assert data[0].messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q: 2+2?"}]
    plain = PromptDataset.build(rows, tok, 200)  # no templates (posttrain eval): the rows as they are
    assert tok.decode(plain[0].prompt_ids) == "[user]2+2? Let's think step by step"


# ---------------------------------------------------------------- preprocessing into place

def test_openmathinstruct2_rows_land_where_resolve_looks(data_dir):
    with pytest.raises(DataError) as e:
        named.resolve("OpenMathInstruct-2", "train")
    raw = data_dir / "raw" / "openmathinstruct2" / "data"  # what `hf download --include 'data/train_1M-*'` writes
    raw.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([
        {"problem": "What is $2+2$?", "generated_solution": "So $\\boxed{4}$.", "expected_answer": "4",
         "problem_source": "augmented_math"},
        {"problem": "Half of 9?", "generated_solution": "It is \\boxed{4.5}", "expected_answer": "4.5",
         "problem_source": "gsm8k"}]), raw / "train_1M-00000-of-00003.parquet")
    run_command(str(e.value), "posttrain preprocess")
    rows = read_rows(named.resolve("OpenMathInstruct-2", "train"))
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["4", "4.5"]
    assert rows[0]["extra_info"] == {"split": "train", "index": 0, "problem": "What is $2+2$?"}


def test_openmathinstruct2_sft_rows_land_where_posttrain_sft_looks(data_dir, capsys):
    with pytest.raises(DataError, match=r"gsm8k/train\.parquet;"):  # a set without an SFT form: its rows, as before
        named.resolve("GSM8K", "train", sft=True)
    with pytest.raises(DataError) as e:
        named.resolve("OpenMathInstruct-2", "train", sft=True)
    assert "--sft generated_solution" in str(e.value) and "sft_train.parquet" in str(e.value)
    raw = data_dir / "raw" / "openmathinstruct2" / "data"
    raw.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([
        {"problem": "What is $2+2$?", "generated_solution": "So $\\boxed{4}$.", "expected_answer": "4",
         "problem_source": "augmented_math"},
        {"problem": "Empty?", "generated_solution": " ", "expected_answer": "0", "problem_source": "gsm8k"},
        {"problem": "Half of 9?", "generated_solution": "It is \\boxed{4.5}", "expected_answer": "4.5",
         "problem_source": "gsm8k"}]), raw / "train_1M-00000-of-00003.parquet")
    run_command(str(e.value), "posttrain preprocess")
    assert "skipped 1 train row without 'problem' or 'generated_solution' text" in capsys.readouterr().out
    path = named.resolve("OpenMathInstruct-2", "train", sft=True)
    assert path == data_dir / "openmathinstruct2" / "sft_train.parquet"
    assert pq.read_table(path).to_pylist() == [
        {"problem": "What is $2+2$?", "generated_solution": "So $\\boxed{4}$.", "expected_answer": "4"},
        {"problem": "Half of 9?", "generated_solution": "It is \\boxed{4.5}", "expected_answer": "4.5"}]
    with pytest.raises(DataError):  # the RL rows are a file of their own, made by their own command
        named.resolve("OpenMathInstruct-2", "train")
    assert main(["preprocess", "math", "--input", str(raw), "--sft", "answer_text", "--output-dir",
                 str(data_dir / "x")]) != 0
    assert "row 0 has no 'answer_text' field, the response --sft names" in capsys.readouterr().err


def test_aime_rows_land_where_resolve_looks(data_dir):
    with pytest.raises(DataError) as e:
        named.resolve("AIME2024", "test")
    raw = data_dir / "raw" / "aime2024" / "data"  # HuggingFaceH4/aime_2024: a "train" file of test problems
    raw.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([
        {"id": 60, "problem": "Find $x$.", "solution": "... $\\boxed{204}$", "answer": "204", "url": "u",
         "year": "2024"}]), raw / "train-00000-of-00001.parquet")
    run_command(str(e.value), "posttrain preprocess")
    rows = read_rows(named.resolve("AIME2024", "test"))
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["204"]
    assert rows[0]["extra_info"]["split"] == "test" and rows[0]["extra_info"]["problem"] == "Find $x$."
    assert not (data_dir / "aime2024" / "train.parquet").exists()

    with pytest.raises(DataError) as e:
        named.resolve("AIME2025", "test")
    raw = data_dir / "raw" / "aime2025"  # opencompass/AIME2025: question/answer jsonl, one file per exam
    raw.mkdir(parents=True)
    (raw / "aime2025-I.jsonl").write_text(json.dumps({"question": "Find $y$.", "answer": "70"}) + "\n")
    (raw / "aime2025-II.jsonl").write_text(json.dumps({"question": "Find $z$.", "answer": 9}) + "\n")
    run_command(str(e.value), "posttrain preprocess")
    rows = read_rows(named.resolve("AIME2025", "test"))
    assert [(r["extra_info"]["problem"], r["reward_model"]["ground_truth"]) for r in rows] == [
        ("Find $y$.", "70"), ("Find $z$.", "9")]
    assert [r["extra_info"]["index"] for r in rows] == [0, 1]


def test_math_preprocess_split_and_numina_filter(tmp_path, capsys):
    rows = [{"problem": "a", "answer": "1", "question_type": "math-word-problem", "problem_is_valid": "Yes",
             "solution_is_valid": "Yes"},
            {"problem": "b", "answer": "proof", "question_type": "proof", "problem_is_valid": "Yes",
             "solution_is_valid": "Yes"},
            {"problem": "c", "answer": "2", "question_type": "math-word-problem", "problem_is_valid": "No",
             "solution_is_valid": "Yes"}]
    (tmp_path / "numina.json").write_text(json.dumps(rows))
    assert main(["preprocess", "math", "--input", str(tmp_path / "numina.json"), "--split", "train",
                 "--output-dir", str(tmp_path / "o")]) == 0
    assert "skipped 2 train rows marked unverifiable" in capsys.readouterr().out
    assert [r["extra_info"]["problem"] for r in read_rows(tmp_path / "o" / "train.parquet")] == ["a"]
    assert main(["preprocess", "math", "--input", str(tmp_path / "numina.json"), "--split", "../x",
                 "--output-dir", str(tmp_path / "o")]) == 2
    assert "split name '../x' is not a plain file name" in capsys.readouterr().err
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    assert main(["preprocess", "math", "--input", str(tmp_path / "q.jsonl"), "--output-dir", str(tmp_path / "o")]) == 2
    assert "has no 'problem' field (another column holds it" in capsys.readouterr().err


# ---------------------------------------------------------------- a run's data from a name

def deepscaler_and_aime(data_dir):
    """DeepScaler and AIME2024 made by the commands their errors give, from literal raw rows."""
    for name, split, write in (
            ("DeepScaler", "train", lambda raw: (raw / "deepscaler.json").write_text(json.dumps([
                {"problem": "What is 2+2?", "answer": "4", "solution": "4"},
                {"problem": "What is 3+3?", "answer": "6", "solution": "6"}]))),
            ("AIME2024", "test", lambda raw: pq.write_table(pa.Table.from_pylist([
                {"problem": "Find 5+5.", "answer": "10"}]), raw / "data" / "train-00000-of-00001.parquet"))):
        with pytest.raises(DataError) as e:
            named.resolve(name, split)
        raw = data_dir / "raw" / named.BY_NAME[name].slug
        (raw / "data").mkdir(parents=True)
        write(raw)
        run_command(str(e.value), "posttrain preprocess")


def test_a_runs_dataset_built_from_dataset_name(data_dir, tmp_path, capsys):
    cfg = load_config(None, ["data.dataset_name=DeepScaler", "data.max_prompt_length=300"])
    with pytest.raises(DataError, match="data.dataset_name=DeepScaler: no "):
        data_files(cfg)
    deepscaler_and_aime(data_dir)
    train, val = data_files(cfg)  # DeepScaler has no test split: AIME2024, prepared, validates
    assert train == [str(data_dir / "deepscaler" / "train.parquet")]
    assert val == [str(data_dir / "aime2024" / "test.parquet")]
    (tmp_path / "cot.txt").write_text(COT)
    cfg = load_config(None, ["data.dataset_name=DeepScaler", "data.max_prompt_length=300",
                             f"data.prompt_file={tmp_path / 'cot.txt'}"])
    tok = char_tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")
    data = load_data(train, tok, cfg, "train")
    assert len(data) == 2 and tok.decode(data[1].prompt_ids) == COT.format("What is 3+3?")
    assert tok.decode(load_data(val, tok, cfg, "validation")[0].prompt_ids) == COT.format("Find 5+5.")


def test_validation_defaults_and_overrides(data_dir, capsys):
    deepscaler_and_aime(data_dir)
    (data_dir / "aime2024" / "test.parquet").unlink()
    _, val = data_files(load_config(None, ["data.dataset_name=DeepScaler"]))
    assert val is None  # AIME2024 not prepared: no validation, and a line says why
    assert "data.dataset_name=DeepScaler: no validation, its default validation set AIME2024 is not there" in \
        capsys.readouterr().err
    _, val = data_files(load_config(None, ["data.dataset_name=DeepScaler", "data.val_files=[v.parquet]"]))
    assert val == ["v.parquet"]
    with pytest.raises(DataError, match="data.val_dataset_name=AIME2024: no "):
        data_files(load_config(None, ["data.dataset_name=DeepScaler", "data.val_dataset_name=AIME2024"]))
    # files given: no name is looked up, and no validation unless asked, as before
    assert data_files(load_config(None, ["data.train_files=[t.parquet]"])) == (["t.parquet"], None)
