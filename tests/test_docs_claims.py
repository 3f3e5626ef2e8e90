"""The config keys the README and the manual (docs/*.md) name in their prose are keys posttrain takes.

tests/test_guides.py runs the pages' shell blocks; this module reads the rest: every inline code span shaped as a
dotted key (`actor.lr`, `actor_rollout_ref.actor.optim.lr`, `trainer.save_freq=5`, `grpo.*`) is

- not a key at all: a file name (`config.yaml`), a Python name (`torch.compile`, `RolloutBatch.weight_versions`),
  a parquet row's field (`extra_info.question`): `not_a_key` says which, NOT_KEYS lists the rest per page; or
- a key, written in full or short for one (SHORT: `fsdp_config.param_offload` in a table of verl's keys is
  `actor_rollout_ref.actor.fsdp_config.param_offload`), that posttrain's loader takes: its own keys (SCHEMA),
  verl's (the RL and the SFT trainer's spellings), NeMo-RL's (a file's keys or an override, in the layout that
  has them: GRPO, PPO, distillation, SFT); a section (`algorithm.rollout_correction`, `grpo.*`) of one of them; or
- a key the page says posttrain refuses, or another framework's that posttrain does not take (REFUSED, with the
  page's reason): the loader must refuse it, whatever its value.

A span with a value (`actor.lr=1e-5`) loads through the loader's dialects and checks (with the keys CONTEXT says the
page gives it with, where its value needs them). Metric names have a slash (`critic/score/mean`) and are not keys.
Every entry of NOT_KEYS, SHORT, REFUSED and CONTEXT is still on its page. A table whose header has `key` and
`default` (docs/configuration.md's first keys) gives SCHEMA's defaults.
"""

import functools
import re
from pathlib import Path

import pytest

from posttrain.config import SCHEMA, canonicalize, load_config
from posttrain.config.dialects import nemo_rl
from posttrain.config.dialects.nemo_rl import keys as nemo_keys
from posttrain.config.dialects.verl import sft as verl_sft
from posttrain.config.dialects.verl.keys import CUSTOM_REWARD_NAME, CUSTOM_REWARD_PATH, HYBRID_ENGINE, alias_table
from posttrain.config.flat import parse_override
from posttrain.config.load import canonical, from_layers
from posttrain.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # the loader's "set, but unused" as keys are probed

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
KEY = re.compile(r"[+~]*(?P<key>[A-Za-z_]\w*(?:\.(?:\w+|\*))+)(?:=(?P<value>\S*))?")
FILE_SUFFIXES = ("json", "jsonl", "yaml", "yml", "py", "md", "txt", "db", "pt", "bin", "safetensors", "sh",
                 "parquet", "jinja")
PYTHON_MODULES = ("posttrain", "torch", "os", "pdb", "str", "vllm", "verl", "ray")  # `torch.compile`, `verl.trainer...`

# spans shaped as keys that are not posttrain config keys: page -> span -> what it is
NOT_KEYS = {
    "docs/data-and-rewards.md": {"extra_info.question": "a parquet row's field", "extra_info.problem": "the same",
                                 "reward_model.ground_truth": "a parquet row's field (verl's row layout)"},
    "docs/environments.md": {"extra_info.interaction_kwargs.name": "a parquet row's field"},
    "docs/coming-from-nemo-rl.md": {"prorlv2.v2": "a NeMo-RL example file's name", "prorlv2_1_moe.v2": "the same"},
}
# keys written short, in a table or a sentence whose context gives the rest: page -> span -> the full key
SHORT = {
    "*": {"data.*.env_name": "data.default.env_name",
          "distillation.teacher_models.*.model_path": "distillation.teacher_models.teacher.model_path"},
    "docs/algorithms.md": {"filter_groups.metric": "algorithm.filter_groups.metric"},
    "docs/coming-from-verl.md": {
        "fsdp_config.param_offload": "actor_rollout_ref.actor.fsdp_config.param_offload",
        "policy_loss.loss_mode": "actor_rollout_ref.actor.policy_loss.loss_mode",
        "fused_kernel_options.impl_backend=triton": "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton"},
    "docs/distributed.md": {
        "fused_kernel_options.impl_backend=triton": "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton"},
    "docs/coming-from-nemo-rl.md": {"cfg.max_moves": "env.sliding_puzzle_game.cfg.max_moves",
                                    "dtensor_cfg._v2": "policy.dtensor_cfg._v2"},
    "docs/distillation.md": {"teacher_models.*.inference.*": "distillation.teacher_models.teacher.inference.*",
                             "distillation_loss.topk": "distillation.distillation_loss.topk",
                             "distillation_loss.topk=k": "distillation.distillation_loss.topk",
                             "dtensor_cfg.cpu_offload": "teacher.dtensor_cfg.cpu_offload"},
    "docs/metrics-and-logging.md": {"tool_config.npu.contents": "global_profiler.global_tool_config.npu.contents"},
}
# keys the page names as refused, or as another framework's that posttrain does not take: page -> key -> the page's why
REFUSED = {
    "docs/coming-from-nemo-rl.md": {"async_rl.*": "NeMo-RL's single-controller path, refused"},
    "docs/distillation.md": {"policy.dtensor_cfg.tensor_parallel_size=2": "NeMo-RL's file sets it; refused, give 1"},
    "docs/sft.md": {"data.micro_batch_size": "verl's deprecated global micro-batch, refused",
                    "data.chat_template": "verl's template registry, refused",
                    "model.external_lib": "refused: posttrain imports no module for the model"},
}
# values that load only beside other keys the page gives them with: page -> span -> those keys
CONTEXT = {
    "docs/async.md": {"data.train_batch_size=0": ("async_training.trigger_parameter_sync_step=4",)},
    "docs/algorithms.md": {"algorithm.use_pf_ppo=true": ("algorithm.adv_estimator=gae",)},
    "docs/coming-from-nemo-rl.md": {
        "algorithm.rollout_correction.rollout_rs=geometric": ("algorithm.rollout_correction.rollout_rs_threshold=1.002",),
        "reward.model.enable=true": ("reward.model.path=RM_DIR",)},
    "docs/coming-from-verl.md": {"reward_model.enable=True": ("reward_model.model.path=RM_DIR",)},
    "docs/multi-turn-tools.md": {"rollout.multi_turn.enable=true": ("rollout.multi_turn.tool_config_path=tools.yaml",)},
}
# NeMo-RL's layouts: the overrides that make a file of it, and the sections it holds its keys in
NEMO_LAYOUTS = {"GRPO": ([], (*nemo_keys.SECTIONS, "data")),
                "PPO": (["ppo.num_generations_per_prompt=8", "value.model_name=m"], ("ppo", "value", "value_loss_fn")),
                "distillation": (["teacher.model_name=m"], ("distillation", "teacher", "loss_fn")),
                "reward-model environment": (["data.default.env_name=reward_model"], ("env",))}
NEMO_SFT = ["sft.max_num_steps=1"]
VALUES = (None, True, False, 1, 0, "x")  # a key's probes: a value it takes, or a refusal of the value, not the key
# how the loader says it has no such key (posttrain's, verl's RL or SFT spelling, NeMo-RL's)
UNKNOWN = re.compile(r"unknown config key '([^']+)'|verl key '([^']+)' .*not supported yet"
                     r"|NeMo-RL key '([^']+)' .*(?:is not supported by posttrain|is not part of)")


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def code_spans(page: Path) -> list[str]:
    """The page's inline code spans outside fenced blocks, a span's line breaks as spaces."""
    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)]


def key_spans(page: Path) -> list[str]:
    return sorted({s for s in code_spans(page) if KEY.fullmatch(s)})


def not_a_key(span: str) -> str | None:
    """Why a span shaped as a key is none (a file, a Python name), or None."""
    key = KEY.fullmatch(span)["key"]
    first, last = key.split(".")[0], key.split(".")[-1]
    if last in FILE_SUFFIXES:
        return "a file name"
    if first in PYTHON_MODULES or first[0].isupper():
        return "a Python module, class or attribute"
    return None


def routes(overrides: list[str]):
    """(command, a function giving the loader's layer for `overrides`) through each dialect that may hold them, in
    this order: posttrain's and verl's RL keys (and NeMo-RL's overrides by name), NeMo-RL's layouts, then posttrain
    sft's (verl's SFT spellings) and NeMo-RL's SFT layout. A route that does not take them raises ConfigError."""
    nemo, ours = nemo_rl.split_overrides(overrides, None)
    yield "train", lambda: _layer("train", ours, nemo)
    for layout, sections in NEMO_LAYOUTS.values():
        if overrides[-1].split(".")[0] in sections:
            yield "train", lambda L=layout: _layer("train", [], [*L, *overrides])
    yield "sft", lambda: _layer("sft", ours, nemo)
    yield "sft", lambda: _layer("sft", [], [*NEMO_SFT, *overrides])


def _layer(command: str, ours: list[str], nemo: list[str]) -> dict:
    layer = canonicalize(dict(parse_override(a) for a in ours), "docs", command)
    if nemo:
        layer = {**canonical(nemo_rl.translate(None, nemo, "docs", command, given=layer), "docs"), **layer}
    return layer


def probes(key: str):
    """The layers of `key` with each of VALUES, through every route: each a function raising or returning."""
    for v in VALUES:
        yield from (layer for _, layer in routes([f"{key}={'null' if v is None else v}"]))


@functools.cache
def takes(key: str) -> bool:
    """Whether the loader knows `key`: with one of VALUES a route takes it, or refuses it naming it, for its value
    or its context, and not as unknown. `rollout.engine_kwargs.vllm.NAME`: a name of yours; `X.*`: a section."""
    key = re.sub(r"\.[A-Z][A-Z_]*(?=\.|$)", ".name", key)
    if key.endswith(".*"):
        return is_section(key[:-2]) or takes(key[:-2] + ".name")
    for layer in probes(key):
        try:
            layer()
            return True
        except (ConfigError, TypeError) as e:  # TypeError: a probe its code does not expect
            unknown = {k for m in UNKNOWN.finditer(str(e)) for k in m.groups() if k}
            if key not in unknown and re.search(rf"(?<![\w.]){re.escape(key)}(?![\w.])", str(e)):
                return True
    return is_section(key)


def refused(key: str) -> bool:
    """Whether no value of VALUES makes `key` load, in any dialect (a key the page names as refused)."""
    return not any(_builds(layer) for layer in probes(key))


def _builds(layer) -> bool:
    try:
        layer()
        return True
    except (ConfigError, TypeError):
        return False


@functools.cache
def known_names() -> frozenset[str]:
    """Every key, key prefix and free-form mapping the loader's tables name: posttrain's, verl's, NeMo-RL's."""
    names = set(SCHEMA) | set(alias_table(SCHEMA)) | set(verl_sft.EXACT) | set(verl_sft.UNUSED)
    names |= {CUSTOM_REWARD_PATH, CUSTOM_REWARD_NAME, HYBRID_ENGINE}
    names |= {f"{theirs}{key[len(ours):]}" for theirs, ours in verl_sft.PREFIXES for key in SCHEMA if key.startswith(ours)}
    for table in (nemo_keys.RENAMES, nemo_keys.OFF, nemo_keys.TUNING, nemo_keys.IS_CORRECTION, nemo_keys.WHOLE,
                  nemo_keys.SWITCHED, nemo_keys.DATA_KEYS):
        names |= {n.rstrip(".*") for n in table}
    return frozenset(names)


def is_section(key: str) -> bool:
    """`grpo`, `algorithm.rollout_correction`, `data.train`: a group of keys of one of the dialects."""
    return key in nemo_keys.SECTIONS or any(n.startswith(key + ".") for n in known_names())


def placeholder(value: str) -> bool:
    """`actor.lr=LR`, `trainer.max_epochs=E`, `rollout.stale_updates=k`, `algorithm.name=`: no value to load."""
    return value == "" or len(value) == 1 and value.isalpha() or bool(re.search(r"[A-Z]{2}|[|]", value))


def loads(span: str, context: tuple = ()) -> str | None:
    """Whether `key=value` (with the `context` keys the page gives it with) loads: None, or the loader's line. The
    first route whose layer builds decides, through the rest of load_config (load.from_layers: the presets under
    the layer, the merge, validation)."""
    error = "no route takes it"
    for command, layer in routes([*context, span]):
        try:
            keys = layer()
        except ConfigError as e:
            error = error if error != "no route takes it" else str(e)
            continue
        try:
            from_layers([keys], command)
            return None
        except ConfigError as e:
            return str(e)
    return error


def check(page: str, span: str) -> str | None:
    """What is wrong with one key span of a page, or None."""
    if span in NOT_KEYS.get(page, {}) or not_a_key(span):
        return None
    full = SHORT.get(page, {}).get(span) or SHORT["*"].get(span) or span
    m = KEY.fullmatch(full)
    key, value = m["key"], m["value"]
    if span in REFUSED.get(page, {}):
        if value is not None and not placeholder(value):
            return None if loads(full) else f"`{span}` is named refused, and it loads"
        return None if refused(key) else f"`{span}` is named refused, and a value of it loads"
    if not takes(key):
        return f"`{span}`: no key of posttrain's, verl's or NeMo-RL's"
    if value is not None and not placeholder(value) and "*" not in key:
        error = loads(f"{key}={value}", CONTEXT.get(page, {}).get(span, ()))
        return f"`{span}` does not load: {error}" if error else None
    return None


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_key_in_the_prose_is_taken_or_named_refused(page):
    found = [f for f in (check(page_id(page), span) for span in key_spans(page)) if f]
    assert not found, f"{page_id(page)}:\n" + "\n".join(found)


def test_every_exception_is_still_on_its_page():
    for table in (NOT_KEYS, SHORT, REFUSED, CONTEXT):
        for page, spans in table.items():
            where = PAGES if page == "*" else [REPO / page]
            on = {s for p in where for s in key_spans(p)}
            assert set(spans) <= on, f"{page}: no longer names {sorted(set(spans) - on)}; drop them here"


def test_the_checker_tells_keys_from_the_rest():
    assert takes("actor.lr") and takes("actor_rollout_ref.actor.optim.lr") and takes("optim.lr")  # ours, verl's RL, SFT
    assert takes("grpo.max_num_steps") and takes("value_loss_fn.scale") and takes("loss_fn.kl_type")  # NeMo-RL's
    assert takes("data.add_bos") and takes("grpo.*") and takes("algorithm.rollout_correction")  # NeMo-RL's SFT
    assert takes("rollout.engine_kwargs.vllm.NAME") and takes("async_training.checkpoint_engine.*")
    assert not takes("model.lora.rank") and not takes("actor.fsdp_config.model_dtype") and not takes("actor.lrr")
    assert not takes("grpo.max_num_stepz") and not takes("policy.generation.bakend")
    assert refused("data.micro_batch_size") and refused("model.lora.rank") and not refused("actor.lr")
    assert check("README.md", "trainer.save_freq=5") is None and check("README.md", "algorithm.name=dapo") is None
    assert "does not load" in check("README.md", "rollout.dtype=fp8")
    assert "does not load" in check("README.md", "algorithm.adv_estimator=grpoo")
    assert "no key" in check("README.md", "model.lora.rank")
    assert not_a_key("config.yaml") and not_a_key("torch.compile") and not_a_key("RolloutBatch.weight_versions")
    assert not not_a_key("trainer.save_freq=5") and placeholder("K") and not placeholder("1e-5")


@pytest.mark.parametrize("span", ["actor.lr=1e-5", "actor.lr=fast", "rollout.dtype=fp8", "algorithm.name=dapo"])
def test_loads_agrees_with_load_config(span):
    try:
        load_config(None, [span])
        real = None
    except ConfigError as e:
        real = str(e)
    ours = loads(span)
    assert (ours is None) == (real is None), (ours, real)


# ---- tables of keys with their defaults (docs/configuration.md's first keys, ...): SCHEMA's defaults

TABLE_SECTION = {"docs/rollout-correction.md": "algorithm.rollout_correction."}  # its table's keys are below it


def default_rows(page: Path) -> list[tuple[list[str], str]]:
    """(the keys, the default cell) of each row of the page's tables whose header has `key` and `default`."""
    rows, columns = [], None
    for line in page.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None or set(cells[0]) <= set("-: "):
            columns = None if cells is None else columns
        elif columns is None:
            names = [c.lower() for c in cells]
            columns = (names.index("key"), names.index("default")) if {"key", "default"} <= set(names) else ()
        elif columns:
            keys = [TABLE_SECTION.get(page_id(page), "") + k for k in re.findall(r"`([^`]+)`", cells[columns[0]])]
            rows.append((keys, cells[columns[1]].replace("`", "")))
    return rows


def default_problem(keys: list[str], cell: str) -> str | None:
    """A literal default (`64`, `null`, `[console]`; `1, 1` for two keys) must be SCHEMA's; a description
    (`half the cores`) stands for a default computed at run time, SCHEMA's null."""
    literal = re.fullmatch(r"[^\s()]+(?:, [^\s()]+)*", cell)
    values = cell.split(", ") if literal and len(keys) > 1 else [cell] * len(keys)
    for key, value in zip(keys, values):
        if key not in SCHEMA:
            return f"`{key}` is no key of posttrain's"
        want = SCHEMA[key][1]
        if literal and not same(parse_override(f"k={value}")[1], want) or not literal and want is not None:
            return f"`{key}`: the table says {cell!r}, the schema {want!r}"
    return None


def same(value, want) -> bool:
    """A table's value as the schema's default (`1e-6` reads as text in YAML 1.1, as a float in the schema)."""
    if isinstance(want, float) and isinstance(value, str):
        try:
            return float(value) == want
        except ValueError:
            return False
    return value == want


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_a_table_of_keys_gives_their_defaults(page):
    wrong = [p for keys, cell in default_rows(page) if (p := default_problem(keys, cell))]
    assert not wrong, f"{page_id(page)}:\n" + "\n".join(wrong)


def test_the_first_keys_table_is_found():
    rows = default_rows(REPO / "docs" / "configuration.md")
    assert len(rows) >= 15 and ["actor.lr"] in [keys for keys, _ in rows]
    assert "schema 1e-06" in default_problem(["actor.lr"], "1e-5") and default_problem(["actor.lr"], "1e-6") is None
