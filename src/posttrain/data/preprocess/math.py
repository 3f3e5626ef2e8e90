"""MATH-style problems (MATH / lighteval, MATH-500, DeepScaleR, the original
MATH tarball, AIME, OpenMathInstruct-2, NuminaMath-1.5, OpenR1-Math) ->
train/test parquet rows in verl's layout, as verl's
examples/data_preprocess/math_dataset.py writes them.

    run(["data/MATH"], "data/math")   # -> [data/math/train.parquet, data/math/test.parquet]

One input row {"problem": "P", "solution": "... \\\\boxed{\\\\frac{1}{2}}", "level": "Level 2",
"type": "Algebra"} at index 5 of the train split becomes

    {"data_source": "DigitalLearningGmbH/MATH-lighteval",
     "prompt": [{"role": "user", "content": "P " + INSTRUCTION}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "\\\\frac{1}{2}"},
     "extra_info": {"split": "train", "index": 5, "problem": "P", "solution": "... \\\\boxed{...}",
                    "level": "Level 2", "subject": "Algebra"}}

extra_info keeps the problem, the reference solution, the level, the
subject (MATH's `type`, MATH-500's `subject`) and MATH-500's `unique_id`
where the input has them. The ground truth is the row's `answer` when it
has one (MATH-500, DeepScaleR, AIME), else its `expected_answer`
(OpenMathInstruct-2), else the content of the last \\boxed{} (or \\fbox{})
of its `solution`; a row with none is skipped and counted. So is a row
marked unverifiable as NeMo-RL filters NuminaMath-1.5: an answer `proof` or
`notfound`, a question_type `proof`, a problem_is_valid or
solution_is_valid other than `Yes`. The problem is the row's `problem`, or
the column `problem_key` names (AIME2025's `question`); extra_info keeps it
as `problem`.

Inputs: .jsonl, .json (a list of rows, or one row per file as in the MATH
tarball) and .parquet files, or directories of them (searched recursively;
hidden files and folders such as a download's .cache/ are not read). A
file's split is read from its path below the input given: `train` or
`test` as a word of a file or folder name (MATH's `train/algebra/1.json`,
the Hub's `data/train-00000-of-00001.parquet`, MATH-500's `test.jsonl`);
a file named neither gives `<its stem>.parquet` (DeepScaleR's
`deepscaler.json` -> deepscaler.parquet). `split` puts every row in
<split>.parquet instead (AIME 2024's Hub file is named train, but it is a
test set: `--split test`). Rows of one split are numbered from 0 in file
order.

SFT rows instead (`run_sft`, `posttrain preprocess math --sft COLUMN`):
{"problem", COLUMN, "expected_answer"}, the row's problem, the response to
learn (OpenMathInstruct-2's generated_solution) and its answer as above (or
null), in sft_<split>.parquet: the rows posttrain sft reads with
data.prompt_key=problem and data.response_key=COLUMN.

    run_sft(["raw/openmathinstruct2/data"], "data/openmathinstruct2", "generated_solution", "train")
    # -> [data/openmathinstruct2/sft_train.parquet]
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.data.schema import write_rows
from posttrain.errors import DataError
from posttrain.rewards.math import last_boxed

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"  # verl's name: its reward routing and ours agree
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SUFFIXES = (".jsonl", ".json", ".parquet")
_HOW = ("pass MATH-style files (.jsonl, .json or .parquet rows with 'problem' and 'solution' holding a "
        "\\boxed{} answer, or 'problem' and 'answer'), or directories of them")
ANSWER_KEYS = ("answer", "expected_answer")  # expected_answer: OpenMathInstruct-2's
UNVERIFIABLE = frozenset({"proof", "notfound"})  # NuminaMath-1.5's answers that are not answers
SPLIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def split_of(path: Path, root: Path) -> str:
    """'train' or 'test' when a word of the file's name or of a folder below
    `root` (the input given) says so, else the file's stem."""
    parts = path.relative_to(root).parts if root != path else (path.name,)
    for part in reversed(parts):
        words = re.split(r"[^a-z]+", part.lower())
        for split in ("train", "test"):
            if split in words:
                return split
    return path.stem


def find_files(inputs) -> list[tuple[Path, Path]]:
    """-> (file, the input it came from) for every data file of the inputs."""
    files = []
    for p in (Path(x) for x in (inputs if isinstance(inputs, (list, tuple)) else [inputs])):
        if not p.exists():
            raise DataError(f"MATH input '{p}' does not exist; {_HOW}")
        if p.is_file():
            if p.suffix not in SUFFIXES:
                raise DataError(f"MATH input '{p}' is not a .jsonl, .json or .parquet file; {_HOW}")
            files.append((p, p))
        else:
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not found:
                raise DataError(f"no .jsonl, .json or .parquet files under '{p}'; {_HOW}")
            files.extend((f, p) for f in found)
    return files


def read_file(path: Path, problem_key: str = "problem") -> list[dict]:
    """The rows of one file, as dicts."""
    try:
        if path.suffix == ".parquet":
            rows = pq.read_table(path).to_pylist()
        elif path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as fh:
                rows = [json.loads(line) for line in fh if line.strip()]
        else:
            data = json.loads(path.read_text(encoding="utf-8"))
            rows = data if isinstance(data, list) else [data]
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"MATH file '{path}' is unreadable ({str(e).splitlines()[0][:120]}); {_HOW}") from e
    # the shape is checked by field names; a row whose values are missing or
    # hold no answer is skipped (and counted) by run()
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or problem_key not in row:
            hint = "" if problem_key != "problem" else " (another column holds it, as AIME2025's 'question'? name it " \
                "with --problem-key)"
            raise DataError(f"MATH file '{path}' row {i} has no '{problem_key}' field{hint}; {_HOW}")
        if not any(k in row for k in (*ANSWER_KEYS, "solution")):
            raise DataError(f"MATH file '{path}' row {i} has neither an 'answer' nor a 'solution' field (nor "
                            f"OpenMathInstruct-2's 'expected_answer'); {_HOW}")
    return rows


def ground_truth(row: dict) -> str | None:
    """The row's `answer` (a string, or a number as AIME sets give it), else
    its `expected_answer`, else its solution's last boxed answer, else None."""
    for key in ANSWER_KEYS:
        answer = row.get(key)
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if isinstance(answer, str) and answer.strip():
            return answer.strip()
    solution = row.get("solution")
    found = last_boxed(solution) if isinstance(solution, str) else None
    return found or None


def unverifiable(row: dict) -> bool:
    """Marked by NuminaMath-1.5 as having no checkable answer (NeMo-RL drops these rows too)."""
    answer = row.get("answer")
    if isinstance(answer, str) and answer.strip().lower() in UNVERIFIABLE:
        return True
    if str(row.get("question_type") or "").strip().lower() == "proof":
        return True
    return any(key in row and row[key] != "Yes" for key in ("problem_is_valid", "solution_is_valid"))


def make_row(row: dict, truth: str, split: str, index: int, data_source: str, problem_key: str = "problem") -> dict:
    problem = row[problem_key]
    extra = {"split": split, "index": index, "problem": problem}
    if isinstance(row.get("solution"), str):
        extra["solution"] = row["solution"]
    for ours, theirs in (("level", "level"), ("subject", "type"), ("subject", "subject"), ("unique_id", "unique_id")):
        if row.get(theirs) is not None:
            extra[ours] = str(row[theirs])
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": problem + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": extra,
    }


def _check_split(split: str | None) -> None:
    """DataError unless `split` (None: each file's own) is a plain file name."""
    if split is not None and not SPLIT_NAME.fullmatch(split):
        raise DataError(f"split name {split!r} is not a plain file name; use letters, digits, '_', '-' or '.' "
                        "(e.g. train or test)")


def _write_splits(by_split: dict, inputs, output_dir, prefix: str, what: str) -> list[Path]:
    """output_dir/<prefix><split>.parquet for each split of `by_split`, train then test then the rest; -> their
    paths. DataError naming `inputs` when there are none (`what`: the rows it looked for)."""
    if not by_split:
        names = ", ".join(map(str, inputs if isinstance(inputs, (list, tuple)) else [inputs]))
        raise DataError(f"no MATH rows {what} in {names}; {_HOW}")
    order = sorted(by_split, key=lambda s: ({"train": 0, "test": 1}.get(s, 2), s))
    return [write_rows(by_split[s], Path(output_dir) / f"{prefix}{s}.parquet") for s in order]


def run(inputs, output_dir, data_source: str = DATA_SOURCE, split: str | None = None,
        problem_key: str = "problem") -> list[Path]:
    """Write output_dir/<split>.parquet for each split found (every row in
    <split>.parquet when `split` is given); -> their paths. Rows are numbered
    from 0 within a split, in file order. Prints how many rows had no answer
    to recover, or were marked unverifiable (skipped)."""
    _check_split(split)
    by_split: dict[str, list[dict]] = {}
    skipped: dict[str, int] = {}
    marked: dict[str, int] = {}
    for f, root in find_files(inputs):
        name = split or split_of(f, root)
        for row in read_file(f, problem_key):
            if unverifiable(row):
                marked[name] = marked.get(name, 0) + 1
                continue
            truth = ground_truth(row)
            problem = row[problem_key]
            if truth is None or not isinstance(problem, str) or not problem.strip():
                skipped[name] = skipped.get(name, 0) + 1
                continue
            rows = by_split.setdefault(name, [])
            rows.append(make_row(row, truth, name, len(rows), data_source, problem_key))
    for name, count in skipped.items():
        print(f"skipped {count} {name} row{'s' if count > 1 else ''} without an answer (an 'answer', or a "
              f"\\boxed{{}} in the 'solution') or without '{problem_key}' text")
    for name, count in marked.items():
        print(f"skipped {count} {name} row{'s' if count > 1 else ''} marked unverifiable (a 'proof' or 'notfound' "
              "answer, question_type 'proof', or problem_is_valid / solution_is_valid not 'Yes')")
    return _write_splits(by_split, inputs, output_dir, "", "with an answer")


def run_sft(inputs, output_dir, response_key: str, split: str | None = None,
            problem_key: str = "problem") -> list[Path]:
    """Write output_dir/sft_<split>.parquet for each split found: each row's
    problem, its `response_key` text and its answer (ground_truth(), or null),
    in file order; -> their paths. A row without problem or response text is
    skipped and counted (no answer is needed: the response is what is learned)."""
    _check_split(split)
    by_split: dict[str, list[dict]] = {}
    skipped: dict[str, int] = {}
    for f, root in find_files(inputs):
        name = split or split_of(f, root)
        for i, row in enumerate(read_file(f, problem_key)):
            if response_key not in row:
                raise DataError(f"MATH file '{f}' row {i} has no '{response_key}' field, the response --sft names "
                                f"(OpenMathInstruct-2's: generated_solution); columns: {', '.join(map(str, row))}")
            problem, response = row[problem_key], row[response_key]
            if not all(isinstance(t, str) and t.strip() for t in (problem, response)):
                skipped[name] = skipped.get(name, 0) + 1
                continue
            by_split.setdefault(name, []).append(
                {"problem": problem, response_key: response, "expected_answer": ground_truth(row)})
    for name, count in skipped.items():
        print(f"skipped {count} {name} row{'s' if count > 1 else ''} without '{problem_key}' or '{response_key}' "
              "text")
    return _write_splits(by_split, inputs, output_dir, "sft_", f"with '{problem_key}' and '{response_key}' text")
