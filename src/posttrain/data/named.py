"""Datasets known by name (`data.dataset_name`, `data.val_dataset_name`),
with the names NeMo-RL uses, and where their parquet files are.

    resolve("DeepScaler", "train")   # -> Path(".../data/deepscaler/train.parquet"), or an error
                                     #    naming the commands that make it
    resolve("AIME2024", "test")      # -> Path(".../data/aime2024/test.parquet")

Nothing is downloaded here: each name's folder under the data directory
($POSTTRAIN_DATA, else <posttrain cache>/data) holds the files that
`hf download` and `posttrain preprocess` write, and a missing file is a
one-line error giving both commands, exactly (and any other download a set
needs: RefCOCO's COCO images). NeMo-RL's vision sets clevr-cogent,
geometry3k and refcoco are rows with images (preprocess/clevr.py, geo3k.py,
refcoco.py), each row's data_source NeMo-RL's task name, scored by its VLM
rewards (rewards/vlm.py). A set with an SFT form (`sft`: OpenMathInstruct-2's
problem and generated_solution) gives posttrain sft that file instead
(resolve(..., sft=True)), made by its own preprocess command from the same
download. Names NeMo-RL knows that posttrain cannot prepare
(SFT and preference sets, its video and audio sets, its generic loaders) are
refused with a line saying so; an unknown name gets the nearest known one.
"""

from __future__ import annotations

import difflib
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.errors import ConfigError, DataError

SPLITS = ("train", "test")
KEYS = {"train": "data.dataset_name", "test": "data.val_dataset_name"}


@dataclass(frozen=True)
class Named:
    name: str
    slug: str  # its folder under the data directory
    files: dict  # split ("train" / "test") -> the file in that folder
    hub: str = ""  # the Hugging Face dataset the raw files come from ("": generated, nothing to download)
    download: tuple = ()  # what `hf download` fetches: file names, or --include PATTERN
    prepare: tuple = ()  # `posttrain preprocess` arguments ({raw}: the download folder); (): the download is the data
    val: str | None = None  # validation when no val key is set: "test" (its own split), another name, or None
    more: tuple = ()  # further Hub downloads, each (hub, its folder under {raw}, *what `hf download` fetches)
    steps: tuple = ()  # (what, argv, argv, ...): commands other than `hf download` that fetch the rest, run next
    sft: tuple = ()  # (file, `posttrain preprocess` arguments): its SFT form, rows with a response to learn
    note: str = field(default="", compare=False)  # what it holds, for people reading the table


_MATH = "posttrain preprocess math: problem/answer rows, the MATH \\boxed{} instruction"
TABLE = (
    Named("DeepScaler", "deepscaler", {"train": "train.parquet"}, "agentica-org/DeepScaleR-Preview-Dataset",
          ("deepscaler.json",), ("math", "--input", "{raw}/deepscaler.json", "--split", "train"), val="AIME2024",
          note=_MATH),
    Named("OpenMathInstruct-2", "openmathinstruct2", {"train": "train.parquet"}, "nvidia/OpenMathInstruct-2",
          ("--include", "data/train_1M-*"), ("math", "--input", "{raw}/data", "--split", "train"),
          sft=("sft_train.parquet", "math", "--input", "{raw}/data", "--split", "train", "--sft", "generated_solution"),
          note="its train_1M split (NeMo-RL's default); problem/expected_answer (posttrain sft: generated_solution)"),
    Named("AIME2024", "aime2024", {"test": "test.parquet"}, "HuggingFaceH4/aime_2024",
          ("data/train-00000-of-00001.parquet",),
          ("math", "--input", "{raw}/data/train-00000-of-00001.parquet", "--split", "test"), note=_MATH),
    Named("AIME2025", "aime2025", {"test": "test.parquet"}, "opencompass/AIME2025",
          ("aime2025-I.jsonl", "aime2025-II.jsonl"),
          ("math", "--input", "{raw}/aime2025-I.jsonl", "{raw}/aime2025-II.jsonl", "--split", "test",
           "--problem-key", "question"), note=_MATH + " (its problem column: question)"),
    Named("AIME2026", "aime2026", {"test": "test.parquet"}, "MathArena/aime_2026", ("--include", "*.parquet"),
          ("math", "--input", "{raw}", "--split", "test"), note=_MATH),
    Named("GSM8K", "gsm8k", {"train": "train.parquet", "test": "test.parquet"}, "openai/gsm8k",
          ("--include", "main/*"), ("gsm8k", "--input", "{raw}"), val="test", note="verl's GSM8K rows"),
    Named("DAPOMath17K", "dapo-math-17k", {"train": "data/dapo-math-17k.parquet"}, "BytedTsinghua-SIA/DAPO-Math-17k",
          ("data/dapo-math-17k.parquet",), val="DAPOMathAIME2024", note="verl's layout already: no preprocessing"),
    Named("DAPOMathAIME2024", "dapo-aime-2024", {"test": "data/aime-2024.parquet"}, "BytedTsinghua-SIA/AIME-2024",
          ("data/aime-2024.parquet",), note="verl's layout already: no preprocessing"),
    Named("NuminaMath-1.5", "numinamath-1.5", {"train": "train.parquet"}, "AI-MO/NuminaMath-1.5",
          ("--include", "data/*.parquet"), ("math", "--input", "{raw}/data", "--split", "train"),
          note="proof / notfound answers and rows not marked valid are skipped, as NeMo-RL"),
    Named("OpenR1-Math-220k", "openr1-math-220k", {"train": "train.parquet"}, "open-r1/OpenR1-Math-220k",
          ("--include", "data/*.parquet"), ("math", "--input", "{raw}/data", "--split", "train"), note=_MATH),
    Named("MATH", "math", {"train": "train.parquet", "test": "test.parquet"}, "DigitalLearningGmbH/MATH-lighteval",
          ("--include", "data/*"), ("math", "--input", "{raw}/data"), val="test", note=_MATH),
    Named("MATH-500", "math-500", {"test": "test.parquet"}, "HuggingFaceH4/MATH-500", ("test.jsonl",),
          ("math", "--input", "{raw}/test.jsonl", "--data-source", "HuggingFaceH4/MATH-500"), note=_MATH),
    Named("clevr-cogent", "clevr-cogent", {"train": "train.parquet", "test": "test.parquet"},
          "MMInstruction/Clevr_CoGenT_TrainA_70K_Complex", ("--include", "data/*"),
          ("clevr", "--train", "{raw}/data", "--test", "{raw}/valA/data"), val="test",
          more=(("MMInstruction/Clevr_CoGenT_ValA", "valA", "--include", "data/*"),),
          note="images; NeMo-RL's train (TrainA_70K_Complex) and valA splits, its CLEVR prompt and reward"),
    Named("geometry3k", "geometry3k", {"train": "train.parquet", "test": "test.parquet"}, "hiyouga/geometry3k",
          ("--include", "data/*"), ("geo3k", "--input", "{raw}/data", "--style", "nemo-rl"), val="test",
          note="images; NeMo-RL's geometry3k prompt and reward (`--style verl`: verl's geo3k rows)"),
    Named("refcoco", "refcoco", {"train": "train.parquet", "test": "validation.parquet"}, "jxu124/refcoco",
          ("--include", "data/*"),
          ("refcoco", "--input", "{raw}/data", "--images-dir", "{raw}"), val="test",
          steps=(("COCO's train2014 images",
                  ("curl", "-L", "-o", "{raw}/train2014.zip", "http://images.cocodataset.org/zips/train2014.zip"),
                  ("unzip", "-q", "{raw}/train2014.zip", "-d", "{raw}")),),
          note="images (COCO's, resized to 256x256, as NeMo-RL); its validation split as test; needs Pillow"),
    Named("arith", "arith", {"train": "train.parquet", "test": "test.parquet"}, prepare=("arith",), val="test",
          note="generated: the embedded addition task"),
    Named("countdown", "countdown", {"train": "train.parquet", "test": "test.parquet"}, prepare=("countdown",),
          val="test", note="generated: TinyZero's countdown task"),
    Named("sliding_puzzle", "sliding-puzzle", {"train": "train.parquet", "test": "test.parquet"},
          prepare=("sliding-puzzle",), val="test",
          note="generated: seeds of NeMo-RL's sliding-puzzle game (posttrain.envs.sliding_puzzle)"),
    Named("guess_number", "guess-number", {"train": "train.parquet", "test": "test.parquet"},
          prepare=("guess-number",), val="test",
          note="generated: secrets of the number-guessing game (posttrain.envs.games:GuessTheNumber)"),
)
ALIASES = {"gsm8k": "GSM8K"}  # NeMo-RL registers both spellings
BY_NAME = {n.name: n for n in TABLE}

# NeMo-RL's names for data posttrain's RL rows cannot be made from: -> what it is
_SFT, _PREF, _MEDIA = "an SFT set (chat transcripts to imitate, no checkable answer)", \
    "a preference set (chosen/rejected responses)", "a video, audio or multimodal set (not supported yet)"
_LOADER = "NeMo-RL's generic loader for your own files"
REFUSED = {
    "squad": _SFT, "tulu3_sft_mixture": _SFT, "open_assistant": _SFT, "general-conversation-jsonl": _SFT,
    "Nemotron-Cascade-2-SFT-Math": _SFT, "arrow_text": "raw text for distillation",
    "HelpSteer3": _PREF, "Tulu3Preference": _PREF, "BinaryPreferenceDataset": _PREF, "PreferenceDataset": _PREF,
    "mmpr-tiny": _MEDIA, "avqa": _MEDIA, "audiomcq": _MEDIA, "daily-omni": _MEDIA, "intent-train": _MEDIA,
    "intent-bench": _MEDIA,
    "ResponseDataset": _LOADER, "openai_format": _LOADER, "NemoGymDataset": "NeMo-Gym's environment rows",
}


def data_dir() -> Path:
    """$POSTTRAIN_DATA, else <posttrain cache>/data (the cache: files.cache_root)."""
    if os.environ.get("POSTTRAIN_DATA"):
        return Path(os.environ["POSTTRAIN_DATA"])
    from posttrain.files.cache import cache_root

    return cache_root() / "data"


def lookup(name: str, split: str = "train", key: str | None = None) -> Named:
    """The table's entry for `name`, checked against `split`; a ConfigError
    for a refused or unknown name, or one without that split. Reads no file."""
    key = key or KEYS[split]
    entry = BY_NAME.get(ALIASES.get(name, name)) if isinstance(name, str) else None
    if entry is None:
        if name in REFUSED:
            raise ConfigError(f"{key}={name}: NeMo-RL's {name} is {REFUSED[name]}, which posttrain cannot prepare for "
                              "RL; write parquet rows (data_source, prompt, reward_model.ground_truth; see `posttrain "
                              f"preprocess`) and pass them as data.{'train' if split == 'train' else 'val'}_files")
        raise ConfigError(f"{key}={name} is not a dataset posttrain knows{_nearest(name)}; known names: "
                          f"{', '.join(n.name for n in TABLE)} (or pass parquet files as "
                          f"data.{'train' if split == 'train' else 'val'}_files)")
    if split not in entry.files:
        if split == "train":
            raise ConfigError(f"{key}={name}: {entry.name} has no train split (it is a validation set); set "
                              f"data.val_dataset_name={entry.name} and name the training data in data.dataset_name "
                              "or data.train_files")
        raise ConfigError(f"{key}={name}: {entry.name} has no test split (it is a training set); set "
                          f"data.dataset_name={entry.name} and name the validation data in data.val_dataset_name "
                          "(e.g. AIME2024) or data.val_files")
    return entry


def _nearest(name) -> str:
    names = [n.name for n in TABLE] + list(ALIASES) + list(REFUSED)
    by_lower: dict[str, str] = {}
    for n in names:
        by_lower.setdefault(n.lower(), n)  # GSM8K before its alias gsm8k
    close = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=0.7)
    return f" (did you mean {by_lower[close[0]]}?)" if close else ""


def resolve(name: str, split: str = "train", key: str | None = None, sft: bool = False) -> Path:
    """The parquet file of `name`'s split ("train" or "test"), or a DataError
    (a ConfigError for a name that is refused or unknown) saying how to make it.
    `sft`: the training file of its SFT form where it has one (posttrain sft)."""
    entry = lookup(name, split, key)
    sft = sft and split == "train" and bool(entry.sft)
    path = data_dir() / entry.slug / (entry.sft[0] if sft else entry.files[split])
    if not path.is_file():
        raise DataError(f"{key or KEYS[split]}={name}: no {path}; {how_to_make(entry, sft)}")
    return path


def how_to_make(entry: Named, sft: bool = False) -> str:
    """The exact commands that write the entry's files (`sft`: its SFT form's), as one phrase."""
    prepare = entry.sft[1:] if sft else entry.prepare
    root = data_dir()
    out = root / entry.slug
    raw = root / "raw" / entry.slug
    if not entry.hub:
        return f"make it with `{shlex.join(['posttrain', 'preprocess', *prepare, '--output-dir', str(out)])}`"
    if not prepare:
        fetch = shlex.join(["hf", "download", entry.hub, *entry.download, "--repo-type", "dataset",
                            "--local-dir", str(out)])
        return (f"it is in verl's parquet layout on the Hub already (no preprocessing): download it into place "
                f"with `{fetch}`")
    def filled(args) -> list[str]:
        return [a.replace("{raw}", str(raw)) for a in args]

    steps = []
    for hub, where, download in [(entry.hub, raw, entry.download),
                                 *((m[0], raw / m[1], m[2:]) for m in entry.more)]:
        fetch = shlex.join(["hf", "download", hub, *download, "--repo-type", "dataset", "--local-dir", str(where)])
        what = " ".join(download[1:]) if download[:1] == ("--include",) else " and ".join(download)
        steps.append(f"download {what} from the Hub dataset {hub} with `{fetch}`")
    for what, *commands in entry.steps:
        steps.append(f"get {what} with " + " and ".join(f"`{shlex.join(filled(c))}`" for c in commands))
    run = shlex.join(["posttrain", "preprocess", *filled(prepare), "--output-dir", str(out)])
    return f"{steps[0]} and run `{run}`" if len(steps) == 1 else f"{', '.join(steps)}, and run `{run}`"


def default_validation(name: str) -> Path | None:
    """The validation file a run on `name` gets when neither data.val_dataset_name
    nor data.val_files is set: the entry's `val` (its own test split, or another
    named set) when that file is there; else None, with a line saying why."""
    entry = lookup(name, "train")
    if entry.val is None:
        print(f"posttrain: data.dataset_name={name} has no validation split: no validation (set "
              "data.val_dataset_name, e.g. AIME2024 or MATH-500, or data.val_files)", file=sys.stderr)
        return None
    val_name = entry.name if entry.val == "test" else entry.val
    val_entry = lookup(val_name, "test")
    path = data_dir() / val_entry.slug / val_entry.files["test"]
    if path.is_file():
        return path
    print(f"posttrain: data.dataset_name={name}: no validation, its default validation set {val_name} is not "
          f"there (no {path}; {how_to_make(val_entry)}); or set data.val_dataset_name or data.val_files",
          file=sys.stderr)
    return None


__all__ = ["ALIASES", "REFUSED", "TABLE", "data_dir", "default_validation", "how_to_make", "lookup", "resolve"]
