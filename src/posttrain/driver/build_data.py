"""A run's prompts: which files (data.train_files, a named data set, or the embedded arith task generated into the
cache), read into PromptDatasets with the chat template, validation held out of training where asked."""

from __future__ import annotations

import random
import sys


from posttrain.data import named
from posttrain.data.dataset import PromptDataset
from posttrain.data.preprocess import arith
from posttrain.data.prompts import read_templates
from posttrain.data.schema import read_rows
from posttrain.errors import ConfigError
from posttrain.files.cache import cache_root
from posttrain.tiny.arith import ensure_tiny_model
from posttrain.tools import ToolSet


EMBEDDED_DATA_VERSION = "arith-v1"


def embedded_data_files() -> tuple[str, str]:
    """The arith task's train/test parquet, generated once into the cache."""
    out = cache_root() / "data" / EMBEDDED_DATA_VERSION
    train, test = out / "train.parquet", out / "test.parquet"
    if not (train.exists() and test.exists()):
        arith.run(out, seed=0)
    return str(train), str(test)


def model_dir_of(cfg) -> str:
    return cfg.model.path or str(ensure_tiny_model())


def tokenizer_of(cfg, model_dir: str):
    """The run's tokenizer: model.tokenizer_path's (a directory of the tokenizer's files), else the model
    directory's own."""
    from posttrain.models import load_tokenizer

    apart = cfg.model.tokenizer_path
    return load_tokenizer(apart or model_dir, trust_remote_code=cfg.model.trust_remote_code, apart=apart is not None)


def data_files(cfg, sft: bool = False) -> tuple[list[str], list[str] | None]:
    """The run's train and validation files, resolved once: data.train_files, else data.dataset_name's file
    (data.named.resolve; `sft`, posttrain sft's: its SFT form where it has one), else the embedded arith task;
    data.val_files, else data.val_dataset_name's file, else the default of the training data (the embedded task's
    test split; a named set's own test split or its paired set, when prepared: named.default_validation), else
    none."""
    d = cfg.data
    train, val, default_val = d.train_files, d.val_files, None
    if train is None and d.dataset_name is not None:
        train = [str(named.resolve(d.dataset_name, "train", sft=sft))]
        if val is None and d.val_dataset_name is None and not d.val_split_size:  # else: held out of train
            found = named.default_validation(d.dataset_name)
            default_val = str(found) if found is not None else None
    elif train is None:
        train_file, default_val = embedded_data_files()
        train = [train_file]
    if val is None and d.val_dataset_name is not None:
        val = [str(named.resolve(d.val_dataset_name, "test"))]
    elif val is None and default_val is not None:
        val = [default_val]
    return train, val


def load_datasets(cfg, train_files: list[str], val_files: list[str] | None, tokenizer, templates,
                  tools: ToolSet | None, processor=None) -> tuple[PromptDataset, PromptDataset | None]:
    """The training and validation prompts (with data.val_split_size, validation held out of training);
    with tools, their schemas in each prompt's chat template; with a vision-language model's `processor`
    (models.processor.load_processor), the rows' images in the prompts (load_data)."""
    schemas = tools.schemas if tools is not None else None
    train_data = load_data(train_files, tokenizer, cfg, "train", templates=templates, tool_schemas=schemas,
                           processor=processor)
    val_data = (load_data(val_files, tokenizer, cfg, "validation", cfg.data.val_max_samples, templates, schemas,
                          processor) if val_files else None)
    if cfg.data.val_split_size:
        seed = cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed
        train_data, val_data = hold_out(train_data, val_data, cfg.data.val_split_size, seed, cfg.data.val_max_samples)
    return train_data, val_data


def load_data(files, tokenizer, cfg, name: str, max_samples: int | None = None, templates=None,
              tool_schemas: list | None = None, processor=None):
    """files' rows as a PromptDataset; `templates`: data.prompts.PromptTemplates (None: read the config's
    data.prompt_file / system_prompt_file, if any); `tool_schemas`: the tools the chat template tells the
    model about (multi-turn rollouts); `processor`: a vision-language model's, for rows with images under
    data.image_key (None: a text-only model, which refuses them; rows with data.video_key's videos are refused
    either way)."""
    if templates is None:
        templates = read_templates(cfg.data.prompt_file, cfg.data.system_prompt_file)
    rows = read_rows(files, prompt_key=cfg.data.prompt_key)
    if max_samples is not None:
        rows = rows[:max_samples]
    return PromptDataset.build(
        rows, tokenizer, cfg.data.max_prompt_length, prompt_key=cfg.data.prompt_key,
        filter_overlong=cfg.data.filter_overlong_prompts, truncation=cfg.data.truncation, name=name,
        template_kwargs=template_kwargs(cfg, tool_schemas), templates=templates, processor=processor,
        image_key=cfg.data.image_key, video_key=cfg.data.video_key,
    )


def template_kwargs(cfg, tool_schemas: list | None) -> dict:
    """The chat template's extra arguments: data.apply_chat_template_kwargs, and the tools (`tools=`, which
    templates with tool support render into the system prompt) when there are tools."""
    kwargs = dict(cfg.data.apply_chat_template_kwargs)
    if tool_schemas:
        kwargs["tools"] = tool_schemas
    return kwargs


def hold_out(train, val, share: float, seed: int | None, max_samples: int | None = None):
    """data.val_split_size (NeMo-RL's split_validation_size): with no validation set, a seeded random
    `share` of the training prompts (at least one) becomes the validation set and leaves training.
    -> (train, val); with a validation set given, both unchanged (and one line says so)."""
    if val is not None:
        print(f"posttrain: data.val_split_size={share} unused: a validation set is given", file=sys.stderr)
        return train, val
    count = max(1, round(share * len(train)))
    if count >= len(train):
        raise ConfigError(f"data.val_split_size={share} holds out all {len(train)} training prompts; make it smaller")
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    held, kept = sorted(order[:count]), sorted(order[count:])
    if isinstance(train, list):  # posttrain sft's examples
        return [train[i] for i in kept], [train[i] for i in held][:max_samples]
    val_items = [train.items[i] for i in held][:max_samples]
    return (PromptDataset([train.items[i] for i in kept], train.num_dropped, train.num_invalid),
            PromptDataset(val_items))

