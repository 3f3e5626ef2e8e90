"""NeMo-RL's SFT layout (examples/run_sft.py, examples/configs/sft.yaml: sft.*, policy.*, data.*,
checkpointing.*, logger.*, cluster.*) -> `posttrain sft`'s keys. policy.*, checkpointing.*, logger.* and
cluster.* are read as the GRPO layout reads them (grpo.py, policy.py); sft.* and data.* here.

    translate_sft({"sft": {"max_num_steps": 20}}, "in sft.yaml")   # {"trainer.total_training_steps": 20}

NeMo-RL's meanings are kept: policy.train_global_batch_size counts rows; a run is
min(max_num_epochs x batches per epoch, max_num_steps) steps; validation is sft.val_batches batches of
sft.val_global_batch_size rows (data.val_max_samples, their product); without policy.scheduler the LR is
constant; policy.tokenizer.chat_template null is NeMo-RL's passthrough template (the messages' text
joined), "default" the tokenizer's own; data.max_input_seq_length bounds a row (data.max_length).

NeMo-RL's SFT datasets by name are Hugging Face Hub sets that posttrain does not download: a name is
refused with the files to give instead, unless data.train_files / data.val_files (or posttrain's
data.dataset_name / data.val_dataset_name) are given beside it. OpenMathInstruct-2 for training is posttrain's
named set of that name (data.dataset_name), whose SFT form posttrain sft reads (data/named.py; the file is looked
for when the run is built, not here).
"""

from __future__ import annotations

import difflib
import fnmatch
import sys
from typing import Any, Container

from posttrain.config.dialects.nemo_rl.keys import OFF, OTHER_TRAINERS, RENAMES, SWITCHED, TUNING
from posttrain.config.dialects.nemo_rl.policy import Leaves, checkpointing_and_logger, policy
from posttrain.errors import ConfigError
from posttrain.text.lines import clipped, printable

# NeMo-RL's chat_template: null (transformers' tokenizer gets this passthrough template; nemo_rl/data/chat_templates.py)
PASSTHROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
SECTIONS = ("sft", "policy", "data", "checkpointing", "logger", "cluster")
# the GRPO table's keys that an SFT file means otherwise, or that mean nothing in SFT
NOT_SFT = ("data.max_input_seq_length", "logger.num_val_samples_to_print")

SFT_RENAMES = {
    "sft.max_num_steps": "trainer.total_training_steps",
    "sft.max_num_epochs": "trainer.max_epochs",  # the min of the two: posttrain's training_steps
    "sft.val_period": "trainer.test_freq",
    "sft.val_at_start": "trainer.val_before_train",
    "sft.val_at_end": "trainer.val_at_end",
    "sft.seed": "trainer.seed",
    "sft.only_unmask_final": "data.only_last_turn",
    "policy.train_global_batch_size": "data.train_batch_size",  # rows per optimizer step, as posttrain sft's
    "policy.max_total_sequence_length": "data.max_length",
    "data.max_input_seq_length": "data.max_length",  # after the line above: the bound NeMo-RL's SFT puts on a row
}
SFT_OFF = {
    "data.add_eos": (True,),  # posttrain learns the end of a row's last turn, the EOS where no token ends it
    "data.default.processor": ("sft_processor", None), "data.train.processor": ("sft_processor", None),
    "data.validation.processor": ("sft_processor", None),
    "data.*.system_key": (None,), "data.*.system_prompt": (None,),
    "policy.dtensor_cfg.dp_replicate_size": (1,),  # HSDP: posttrain's FSDP2 shards over every worker
}
SFT_TUNING = (
    "sft.val_micro_batch_size",  # rows per validation forward: the loss is the same
    "data.add_bos",  # a row starts as the chat template renders it (docs/sft.md)
    "data.add_generation_prompt",  # the assistant's opening is context either way
    "data.*.split",  # with the files given, the files are the split
    "data.*.use_preserving_dataset",
    "logger.num_val_samples_to_print",
)
# checkpointing.metric_name in NeMo-RL's SFT -> posttrain sft's metric
METRICS = {"val:val_loss": "val/loss", "train:loss": "train/loss", "train:grad_norm": "train/grad_norm",
           "train:lr": "train/lr"}
# named unused in one warning line when set to anything else
UNUSED = {
    "data.default.system_prompt_file": ((None,), "NeMo-RL's SFT does not apply it either"),
    "data.train.system_prompt_file": ((None,), "NeMo-RL's SFT does not apply it either"),
    "data.validation.system_prompt_file": ((None,), "NeMo-RL's SFT does not apply it either"),
}
# the Hub split posttrain prepares of a named set with an SFT form (data/named.py's download)
PREPARED_SPLITS = {"OpenMathInstruct-2": "train_1M"}
_MEDIA = ("refcoco", "clevr-cogent", "geometry3k", "mmpr-tiny", "avqa", "audiomcq", "daily-omni", "intent-train",
          "intent-bench")


def translate_sft(tree: dict, origin: str, given: Container[str] = ()) -> dict[str, Any]:
    """A resolved NeMo-RL SFT tree -> {posttrain key: value}. `given`: posttrain's keys set on the command line
    (data.train_files / data.val_files, or a dataset name, there replace the file's datasets). ConfigError names
    the first NeMo-RL key posttrain sft cannot honour."""
    for section in tree:
        if section not in SECTIONS and section != "defaults":
            raise ConfigError(_foreign(section, origin))
    f = Leaves(tree)
    out: dict[str, Any] = {}
    for section, why in SWITCHED.items():
        if f.get(f"{section}.enabled") is True:
            raise ConfigError(f"{section}.enabled=true ({origin}): {why}")
        f.under(section)
    for nemo, ours in {**{k: v for k, v in RENAMES.items() if k not in NOT_SFT}, **SFT_RENAMES}.items():
        if f.has(nemo):
            out[ours] = f.get(nemo)
    _sft(f, out, origin)
    rows = f.flat.pop("policy.train_global_batch_size", None)  # rows here, not GRPO's samples: read above
    policy(f, out, origin)
    if rows is not None:
        f.flat["policy.train_global_batch_size"] = rows
    for key in [k for k in out if k.startswith(("rollout.", "ref."))]:
        out.pop(key)  # the policy section's generation and log-prob settings: a supervised run has neither
    _schedule(f, out)
    _chat_template(f, out)
    _metric_name(f, origin)
    checkpointing_and_logger(f, out, origin)
    _data(f, out, origin, given)
    unused = []
    for key, (allowed, why) in UNUSED.items():
        if f.has(key) and f.get(key) not in allowed:
            unused.append(f"{key}={printable(f.flat[key])} ({why})")
    if unused:
        print(f"posttrain: warning: {', '.join(unused)} ({origin}): set, but unused by posttrain sft", file=sys.stderr)
    _left(f, origin)
    return out


def _foreign(section: str, origin: str) -> str:
    if section in ("grpo", "ppo", "loss_fn", "env", "value", "value_loss_fn", "async_rl", "reward_penalties"):
        return (f"{section}.* ({origin}): NeMo-RL's reinforcement-learning layout is posttrain train's "
                "(`posttrain train --config FILE`); posttrain sft reads NeMo-RL's SFT layout (sft.*)")
    if section in OTHER_TRAINERS:
        return (f"{section}.* ({origin}): {OTHER_TRAINERS[section]} is not supported; posttrain sft reads NeMo-RL's "
                "SFT layout (sft.*)")
    return (f"NeMo-RL key '{section}' ({origin}) is not part of NeMo-RL's SFT layout, which posttrain sft reads "
            f"({', '.join(s + '.*' for s in SECTIONS)})")


def _sft(f: Leaves, out: dict, origin: str) -> None:
    if f.has("sft.max_num_epochs"):  # without max_num_steps the epochs alone bound the run, as in NeMo-RL
        out["trainer.total_epochs"] = f.get("sft.max_num_epochs")
    batches, rows = f.get("sft.val_batches"), f.get("sft.val_global_batch_size")
    if batches is not None or rows is not None:
        for key, value in (("sft.val_batches", batches), ("sft.val_global_batch_size", rows)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{key}={clipped(value)} ({origin}): a whole number")
        if batches is not None and batches > 0:  # NeMo-RL validates on the first val_batches batches
            out["data.val_max_samples"] = batches * (rows if rows is not None else 32)  # 32: NeMo-RL's default
        elif batches is not None:  # <= 0: every batch
            out["data.val_max_samples"] = None


def _schedule(f: Leaves, out: dict) -> None:
    """A file that sets the optimizer sets the LR schedule too: NeMo-RL's is constant without policy.scheduler
    (posttrain sft's default is verl's warm-up and cosine)."""
    if not f.has("policy.optimizer.name"):
        return
    out["actor.lr_scheduler_type"] = "constant"
    out["actor.lr_warmup_steps_ratio"] = 0.0
    out.setdefault("actor.lr_warmup_steps", 0)


def _chat_template(f: Leaves, out: dict) -> None:
    """policy.tokenizer.chat_template: absent or "default": the tokenizer's own; null: NeMo-RL's passthrough
    template; else a Jinja template, or a path ending in .jinja (read when the run is built)."""
    if not f.has("policy.tokenizer.chat_template"):
        return
    template = f.get("policy.tokenizer.chat_template")
    if template is None:
        out["data.custom_chat_template"] = PASSTHROUGH_TEMPLATE
    elif not (isinstance(template, str) and template.lower() == "default"):
        out["data.custom_chat_template"] = template


def _metric_name(f: Leaves, origin: str) -> None:
    """checkpointing.metric_name in NeMo-RL's SFT names (val:val_loss) -> the val:/train: + posttrain metric
    spelling the shared checkpointing translation reads."""
    name = f.flat.get("checkpointing.metric_name")
    if name in METRICS:
        f.flat["checkpointing.metric_name"] = f"{name.split(':', 1)[0]}:{METRICS[name]}"
    elif name is not None and f.flat.get("checkpointing.keep_top_k") is not None and \
            f.flat.get("checkpointing.enabled", True) and not (isinstance(name, str) and "/" in name):
        raise ConfigError(f"checkpointing.metric_name={clipped(name)} ({origin}) is not one posttrain sft records; "
                          f"use one of {', '.join(METRICS)}, null (the newest), or val:/train: followed by a "
                          "posttrain metric (val:val/loss)")


def _data(f: Leaves, out: dict, origin: str, given: Container[str]) -> None:
    """data.train / data.validation (data.default filling what they leave out) -> posttrain sft's files, columns,
    held-out share and prompt file."""
    for split in ("train", "validation"):
        if isinstance(f.flat.get(f"data.{split}"), list):
            raise ConfigError(f"data.{split} is a list of datasets ({origin}): give posttrain their parquet files, "
                              f"data.{'train' if split == 'train' else 'val'}_files=[a.parquet,b.parquet], instead "
                              "of NeMo-RL's per-dataset entries")
    f.get("data.validation")  # null: no validation set (but a share held out of train)

    def get(split: str, key: str):
        own = f"data.{split}.{key}"
        f.get(f"data.default.{key}")
        return f.get(own) if f.has(own) else f.flat.get(f"data.default.{key}")

    columns: dict[str, Any] = {}
    for split, files, named in (("train", "data.train_files", "data.dataset_name"),
                                ("validation", "data.val_files", "data.val_dataset_name")):
        replaced = files in given or named in given
        name, path = get(split, "dataset_name"), get(split, "data_path")
        if split == "validation" and not any(k.startswith("data.validation.") for k in f.flat):
            name = path = None  # data.default alone names no validation set
        got = _columns(name, {k: get(split, k) for k in ("input_key", "output_key", "chat_key", "tool_key")})
        prepared = _prepared(name) if split == "train" and path is None and not replaced else None
        if path is not None or files in given or prepared:
            columns = columns or got
        if not replaced and path is not None:  # (the command line's data replaces the file's dataset)
            if not str(path).endswith(".parquet"):
                raise ConfigError(f"data.{split}.data_path={path} ({origin}): posttrain sft reads parquet rows; "
                                  "convert the file to parquet (its columns as they are) and give the .parquet")
            out[files] = [path]
        elif prepared:  # posttrain's named set, its SFT form (resolved when the run is built)
            hub_split = get(split, "split")
            if hub_split is not None and hub_split != PREPARED_SPLITS.get(prepared, hub_split):
                raise ConfigError(f"data.{split}.split={printable(hub_split)} ({origin}): posttrain prepares "
                                  f"{prepared}'s {PREPARED_SPLITS[prepared]} split; set that, or give "
                                  f"{files}=[FILE.parquet], parquet rows with the columns "
                                  f"{got.get('data.prompt_key')} and {got.get('data.response_key')}")
            out[named] = prepared
        elif not replaced and name is not None:
            raise ConfigError(_named(split, name, got, origin))
        share, seed, prompt = (get(split, k) for k in ("split_validation_size", "seed", "prompt_file"))
        if split == "train":  # the training split's: posttrain has one prompt file, held-out share and seed
            out.update({k: v for k, v in (("data.val_split_size", share or None), ("data.seed", seed),
                                          ("data.prompt_file", prompt)) if v is not None})
    out.update(columns)


def _columns(name, keys: dict) -> dict[str, Any]:
    """The posttrain sft keys that read the columns NeMo-RL's dataset class reads: openai_format's messages
    (multi-turn), else a prompt and a response column (ResponseDataset's input/output, OpenMathInstruct-2's
    problem and output_key)."""
    if name == "openai_format":
        return {"data.multiturn.enable": True, "data.multiturn.messages_key": keys["chat_key"] or "messages",
                "data.multiturn.tools_key": keys["tool_key"] or "tools"}
    defaults = {"ResponseDataset": ("input", "output"), None: ("input", "output"),
                "OpenMathInstruct-2": ("problem", "expected_answer")}.get(name, (None, None))
    prompt = "problem" if name == "OpenMathInstruct-2" else keys["input_key"] or defaults[0]
    response = keys["output_key"] or defaults[1]
    out = {}
    if prompt is not None:
        out["data.prompt_key"] = prompt
    if response is not None:
        out["data.response_key"] = response
    return out


def _prepared(name) -> str | None:
    """posttrain's name of a named set it prepares in an SFT form (OpenMathInstruct-2), else None."""
    from posttrain.data import named

    entry = named.BY_NAME.get(named.ALIASES.get(name, name)) if isinstance(name, str) else None
    return entry.name if entry is not None and entry.sft else None


def _named(split: str, name, columns: dict, origin: str) -> str:
    """The refusal of a dataset named in an SFT file: what to give instead."""
    files = "data.train_files" if split == "train" else "data.val_files"
    if name in _MEDIA:
        why = f"NeMo-RL's {printable(name)} is a vision, video or audio set (posttrain's SFT does not train on " \
              "images, video or audio yet)"
    else:
        from posttrain.data import named

        known = named.BY_NAME.get(named.ALIASES.get(name, name)) if isinstance(name, str) else None
        why = (f"NeMo-RL's {printable(name)} is a Hugging Face Hub set, which posttrain does not download"
               if not known else f"posttrain prepares {known.name}'s SFT rows for training only (no validation "
               "split; data.train.split_validation_size holds a share out)" if known.sft else
               f"posttrain prepares {known.name} as RL rows (a prompt and the answer to check), without the "
               "responses NeMo-RL's SFT learns")
    if "data.multiturn.messages_key" in columns:
        what = f"a column {columns['data.multiturn.messages_key']} of chat messages"
    elif columns:
        what = f"the columns {columns.get('data.prompt_key', 'question')} and " \
               f"{columns.get('data.response_key', 'answer')}"
    else:
        what = "a prompt column and a response column, named by data.prompt_key and data.response_key"
    none = "" if split == "train" else "; or data.validation=null for none"
    return (f"data.{split}.dataset_name={printable(name)} ({origin}): {why}; give {files}=[FILE.parquet], "
            f"parquet rows with {what}{none}")


def _left(f: Leaves, origin: str) -> None:
    """Every leaf not read above: an "off" value, a tuning knob, or refused."""
    off = {**OFF, **SFT_OFF}
    for key, value in f.left().items():
        allowed = next((v for pattern, v in off.items() if fnmatch.fnmatchcase(key, pattern)), None)
        if allowed is not None and value in allowed:
            continue
        if allowed is not None:
            raise ConfigError(f"{key}={clipped(value)} ({origin}) is not supported by posttrain sft; set it to "
                              f"{' or '.join('null' if a is None else str(a).lower() for a in allowed)}")
        if any(fnmatch.fnmatchcase(key, p) or key == p.removesuffix(".*") for p in (*TUNING, *SFT_TUNING)):
            continue
        known = [*RENAMES, *SFT_RENAMES, *off, *(f"{s}.enabled" for s in SWITCHED)]
        match = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        raise ConfigError(f"NeMo-RL key {key!r} ({origin}) is not supported by posttrain sft"
                          f"{f'; did you mean {match[0]!r}?' if match else ''} (the guide docs/sft.md lists the keys)")
