"""`posttrain sft --config FILE` with NeMo-RL's SFT layout (dialects/nemo_rl/sft.py): NeMo-RL's own sft.yaml and
sft_openmathinstruct2.yaml (from tests/data/nemo_rl/examples_*.json, as test_nemo_rl_config.py reads them) mapped
key by key, short runs of sft.yaml and sft_openmathinstruct2.yaml (on OpenMathInstruct-2's SFT rows, prepared
here from rows in the Hub's shape) on the tiny model, and what is refused."""

import json
import math
from pathlib import Path

import pytest

from posttrain.driver.build_sft import build_sft_run
from posttrain.config import load_config
from posttrain.config.dialects.nemo_rl.sft import PASSTHROUGH_TEMPLATE
from posttrain.errors import ConfigError, DataError
from posttrain.models import load_tokenizer
from posttrain.driver.sft import train_sft

from helpers import write_sft

EXAMPLES = Path(__file__).parent / "data" / "nemo_rl" / "examples_7ea279a.json"  # as test_nemo_rl_config.py's
FSDP2 = ["policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true", "++policy.optimizer.kwargs.lr=2e-5"]


def example(tmp_path, name: str) -> str:
    """NeMo-RL's examples/configs/NAME.yaml (its `defaults:` merged in) written back to a YAML file."""
    tree = json.loads(EXAMPLES.read_text())["configs"][f"{name}.yaml"]
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(tree))  # JSON is YAML
    return str(path)


def sft_template() -> str:
    return json.loads(EXAMPLES.read_text())["configs"]["sft.yaml"]["policy"]["tokenizer"]["chat_template"]


def test_nemo_rls_sft_yaml_maps_onto_posttrain_sft_and_runs_two_steps(tmp_path, tiny_model_dir):
    train = write_sft(tmp_path / "train.parquet", [(a, b) for a in range(10, 14) for b in (20, 31)])
    val = write_sft(tmp_path / "val.parquet", [(40, 2), (51, 7), (63, 9), (72, 5), (80, 1)])
    cfg = load_config(example(tmp_path, "sft"), [
        f"policy.model_name={tiny_model_dir}", f"data.train_files={train}", f"data.val_files={val}",
        "sft.max_num_steps=2", "policy.train_global_batch_size=4", "policy.train_micro_batch_size=2",
        "policy.max_total_sequence_length=128", "policy.precision=float32", "sft.val_global_batch_size=2",
        "logger.wandb_enabled=false", "logger.tensorboard_enabled=false",
        f"checkpointing.checkpoint_dir={tmp_path / 'run'}"], command="sft")
    d, a, t = cfg.data, cfg.actor, cfg.trainer
    assert (d.train_files, d.val_files, d.prompt_key, d.response_key) == \
           ([str(train)], [str(val)], "question", "answer")
    assert (d.train_batch_size, a.ppo_micro_batch_size, d.max_length) == (4, 2, 128)
    assert d.val_max_samples == 8 * 2  # sft.val_batches x sft.val_global_batch_size
    assert d.custom_chat_template == sft_template() and d.only_last_turn is False and d.shuffle is True
    assert (t.total_training_steps, t.max_epochs, t.total_epochs) == (2, 1, 1)  # min(epochs x batches, steps)
    assert (t.test_freq, t.val_before_train, t.val_at_end, t.seed) == (10, True, False, 42)
    assert (t.run_dir, t.save_freq, t.keep_top_k, t.keep_top_k_metric, t.keep_top_k_mode) == \
           (str(tmp_path / "run"), 10, 3, "val/loss", "min")  # metric_name val:val_loss, higher_is_better false
    assert (t.logger, t.n_gpus_per_node, t.nnodes) == (["console"], 1, 1)
    assert (a.lr, a.weight_decay, a.betas, a.eps, a.grad_clip) == (5e-6, 0.1, [0.9, 0.98], 1e-5, 1.0)
    assert (a.lr_scheduler_type, a.lr_warmup_steps) == ("constant", 0)  # NeMo-RL: no policy.scheduler, constant
    assert (cfg.model.path, cfg.model.dtype, cfg.model.lora_rank) == (str(tiny_model_dir), "float32", 0)
    run = build_sft_run(cfg)
    assert run.actor.optimizer.param_groups[0]["eps"] == 1e-5  # AdamW's epsilon, as the file sets it
    ex = run.train_data[0]  # the file's template writes no end of turn after the answer: the EOS is learned
    assert run.tokenizer.decode(ex.input_ids) == " Question: What is 10 + 20? Answer: 30<|im_end|>"
    assert run.tokenizer.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if m]) == " 30<|im_end|>"
    summary = train_sft(run)
    assert summary["steps"] == 2 and math.isfinite(summary["loss_first"]) and math.isfinite(summary["loss_last"])
    assert math.isfinite(summary["val_before"])
    saved = tmp_path / "run" / "checkpoints" / "global_step_2" / "actor"
    assert load_tokenizer(saved).chat_template == sft_template()  # the run's template goes on with its model


def test_nemo_rl_sft_overrides_alone_keep_posttrain_sfts_schedule():
    cfg = load_config(None, ["sft.max_num_steps=20", "sft.val_period=5", "policy.train_global_batch_size=8",
                             "sft.only_unmask_final=true", "sft.val_batches=0"], command="sft")
    assert (cfg.trainer.total_training_steps, cfg.trainer.test_freq, cfg.data.train_batch_size) == (20, 5, 8)
    assert cfg.data.only_last_turn is True and cfg.data.val_max_samples is None  # val_batches <= 0: every batch
    assert cfg.actor.lr_scheduler_type == "cosine"  # no optimizer given: posttrain sft's (verl's) default


def test_sft_openmathinstruct2_loads_as_it_is_and_with_its_rows_given(tmp_path):
    path = example(tmp_path, "sft_openmathinstruct2")
    cfg = load_config(path, command="sft")  # no data here: the named set's file is looked for when the run is built
    d = cfg.data
    assert (d.dataset_name, d.train_files, d.val_files, d.prompt_key, d.response_key, d.val_split_size) == \
           ("OpenMathInstruct-2", None, None, "problem", "generated_solution", 0.05)
    with pytest.raises(ConfigError, match=r"^data\.train\.split=train_2M .*posttrain prepares OpenMathInstruct-2's "
                                          r"train_1M split.*data\.train_files=\[FILE\.parquet\].*problem and "
                                          r"generated_solution"):
        load_config(path, ["data.train.split=train_2M"], command="sft")
    cfg = load_config(path, ["data.train_files=/d/omi.parquet"], command="sft")
    assert cfg.data.dataset_name is None  # the rows given replace the named set
    d, a, t = cfg.data, cfg.actor, cfg.trainer
    # the base model with its instruct model's tokenizer (policy.tokenizer.name)
    assert (cfg.model.path, cfg.model.tokenizer_path) == ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct")
    assert load_config(path, ["data.train_files=/d/omi.parquet", "policy.tokenizer.name=null"],
                       command="sft").model.tokenizer_path is None
    assert load_config(path, ["data.train_files=/d/omi.parquet", "policy.tokenizer.name=${policy.model_name}"],
                       command="sft").model.tokenizer_path is None  # the model's own
    assert a.tensor_parallel_size == 4  # policy.dtensor_cfg.tensor_parallel_size: each layer split over 4 workers
    assert (d.train_files, d.val_files, d.prompt_key, d.response_key) == \
           (["/d/omi.parquet"], None, "problem", "generated_solution")  # its output_key
    assert (d.val_split_size, d.seed, d.prompt_file) == (0.05, 42, "examples/prompts/math.txt")
    assert (d.train_batch_size, a.ppo_micro_batch_size, d.max_length, d.val_max_samples) == (512, 2, 4096, 4 * 128)
    assert (a.lr, a.weight_decay, a.grad_clip) == (2e-5, 0.01, float("inf"))  # max_grad_norm null: no clipping
    assert (t.total_training_steps, t.test_freq, t.save_freq, t.keep_top_k, t.n_gpus_per_node) == \
           (1000000, 500, 500, 100, 8)


def omi_raw(path: Path, n: int) -> Path:
    """Rows as nvidia/OpenMathInstruct-2's parquet shards hold them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([
        {"problem": f"What is {a} + 7?", "generated_solution": f"{a} + 7 = {a + 7}. \\boxed{{{a + 7}}}",
         "expected_answer": str(a + 7), "problem_source": "augmented_math"} for a in range(n)]), path)
    return path


def test_sft_openmathinstruct2_runs_on_the_prepared_sft_rows_and_names_the_commands_without_them(
        tmp_path, tiny_model_dir, monkeypatch):
    from posttrain.data.preprocess import math as math_rows

    data = tmp_path / "data"
    monkeypatch.setenv("POSTTRAIN_DATA", str(data))
    monkeypatch.chdir(tmp_path)  # its data.default.prompt_file, examples/prompts/math.txt, as in a NeMo-RL checkout
    Path("examples/prompts").mkdir(parents=True)
    Path("examples/prompts/math.txt").write_text("Solve the following math problem step by step.\n\n{}\n")
    cfg = load_config(example(tmp_path, "sft_openmathinstruct2"), [
        f"policy.model_name={tiny_model_dir}", "policy.tokenizer.name=null",
        "policy.dtensor_cfg.tensor_parallel_size=1", "cluster.gpus_per_node=1", "sft.max_num_steps=2", "policy.train_global_batch_size=4",
        "policy.train_micro_batch_size=2", "policy.max_total_sequence_length=128", "policy.precision=float32",
        "sft.val_global_batch_size=2", "logger.wandb_enabled=false", "logger.tensorboard_enabled=false",
        f"checkpointing.checkpoint_dir={tmp_path / 'run'}"], command="sft")
    with pytest.raises(DataError) as missing:  # not prepared: the commands that make its SFT rows, exactly
        build_sft_run(cfg)
    raw, out = data / "raw" / "openmathinstruct2", data / "openmathinstruct2"
    assert str(missing.value) == (
        f"data.dataset_name=OpenMathInstruct-2: no {out / 'sft_train.parquet'}; download data/train_1M-* from the "
        f"Hub dataset nvidia/OpenMathInstruct-2 with `hf download nvidia/OpenMathInstruct-2 --include "
        f"'data/train_1M-*' --repo-type dataset --local-dir {raw}` and run `posttrain preprocess math --input "
        f"{raw}/data --split train --sft generated_solution --output-dir {out}`")
    omi_raw(raw / "data" / "train_1M-00000-of-00001.parquet", 40)
    math_rows.run_sft([str(raw / "data")], out, "generated_solution", "train")
    run = build_sft_run(cfg)
    assert (len(run.train_data), len(run.val_data)) == (38, 2)  # data.train.split_validation_size 0.05 held out
    ex = run.train_data[0]
    text = run.tokenizer.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if m])
    assert "\\boxed{" in text and "Solve the following" in run.tokenizer.decode(ex.input_ids)  # generated_solution
    summary = train_sft(run)
    assert summary["steps"] == 2 and math.isfinite(summary["loss_first"]) and math.isfinite(summary["loss_last"])


def test_the_megatron_sft_file_is_refused_naming_the_key_and_loads_with_the_fsdp2_switch(tmp_path):
    path = example(tmp_path, "sft_openmathinstruct2_megatron")
    with pytest.raises(ConfigError, match=r"^policy\.megatron_cfg\.enabled=true .*policy\.megatron_cfg\.enabled="
                                          r"false policy\.dtensor_cfg\.enabled=true"):
        load_config(path, command="sft")
    cfg = load_config(path, [*FSDP2, "policy.dtensor_cfg.tensor_parallel_size=1",
                             "data.train_files=/d/omi.parquet"], command="sft")
    assert cfg.actor.use_dynamic_bsz and cfg.actor.ppo_max_token_len_per_gpu == 4096  # sequence_packing: a budget
    assert (cfg.actor.lr, cfg.trainer.nnodes) == (2e-5, 2)
    cfg = load_config(path, [*FSDP2, "policy.dtensor_cfg.tensor_parallel_size=1"], command="sft")
    assert (cfg.data.dataset_name, cfg.data.response_key) == ("OpenMathInstruct-2", "generated_solution")


def test_hub_and_vision_datasets_are_refused_with_the_files_to_give(tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.train\.dataset_name=squad .*Hugging Face Hub set.*"
                                          r"data\.train_files=\[FILE\.parquet\]"):
        load_config(example(tmp_path, "sft"), command="sft")
    with pytest.raises(ConfigError, match=r"^data\.validation\.dataset_name=squad .*data\.val_files=.*"
                                          r"data\.validation=null for none"):
        load_config(example(tmp_path, "sft"), ["data.train_files=/d/t.parquet"], command="sft")
    cfg = load_config(example(tmp_path, "sft"), ["data.train_files=/d/t.parquet", "data.validation=null"],
                      command="sft")
    assert (cfg.data.train_files, cfg.data.val_files) == (["/d/t.parquet"], None)
    cfg = load_config(example(tmp_path, "sft"), ["data.dataset_name=GSM8K", "data.val_dataset_name=GSM8K"],
                      command="sft")  # posttrain's named sets replace the file's too
    assert (cfg.data.dataset_name, cfg.data.val_dataset_name, cfg.data.train_files) == ("GSM8K", "GSM8K", None)
    with pytest.raises(ConfigError, match=r"^data\.train\.dataset_name=clevr-cogent .*vision"):
        load_config(example(tmp_path, "sft_vlm_3B"), command="sft")


def test_nemo_rls_own_data_files_and_columns(tmp_path):
    base = [f"policy.model_name={tmp_path}"]
    cfg = load_config(None, [*base, "data.train.dataset_name=ResponseDataset", "data.train.data_path=/d/r.parquet",
                             "data.train.input_key=q", "data.train.output_key=a"], command="sft")
    assert (cfg.data.train_files, cfg.data.prompt_key, cfg.data.response_key) == (["/d/r.parquet"], "q", "a")
    cfg = load_config(None, [*base, "data.train.data_path=/d/r.parquet"], command="sft")
    assert (cfg.data.prompt_key, cfg.data.response_key) == ("input", "output")  # ResponseDataset's defaults
    cfg = load_config(None, [*base, "data.train.dataset_name=openai_format", "data.train.data_path=/d/c.parquet",
                             "data.train.chat_key=conversation"], command="sft")
    assert cfg.data.multiturn.enable and cfg.data.multiturn.messages_key == "conversation"
    with pytest.raises(ConfigError, match=r"^data\.train\.data_path=/d/r\.jsonl .*parquet"):
        load_config(None, [*base, "data.train.data_path=/d/r.jsonl"], command="sft")


@pytest.mark.parametrize("override, match", [
    ("policy.dtensor_cfg.context_parallel_size=1", ("actor.ulysses_sequence_parallel_size", 1)),  # 2: two workers
    ("policy.sequence_packing.enabled=true", ("actor.use_dynamic_bsz", True)),  # a token budget per micro-batch
    ("data.add_eos=false", r"^data\.add_eos=False .*set it to true"),
    ("checkpointing.metric_name=val:accuracy", r"^checkpointing\.metric_name=val:accuracy .*val:val_loss"),
    ("logger.swanlab_enabled=true", r"^logger\.swanlab_enabled=true"),
    ("policy.dtensor_cfg.lora_cfg.enabled=true", ("model.lora_rank", 8)),
    ("+grpo.max_num_steps=3", r"^grpo\.\* .*posttrain train"),
    ("+policy.tokenizer.video.num_frames=16", r"NeMo-RL key 'policy\.tokenizer\.video\.num_frames' .*not supported"),
])
def test_sft_keys_are_mapped_or_refused_in_one_line(tmp_path, override, match):
    args = ["data.train_files=/d/t.parquet", "data.validation=null", override]
    if isinstance(match, tuple):  # mapped as the GRPO layout maps it
        cfg = load_config(example(tmp_path, "sft"), args, command="sft")
        section, key = match[0].split(".")
        assert getattr(getattr(cfg, section), key) == match[1]
        return
    with pytest.raises(ConfigError, match=match) as e:
        load_config(example(tmp_path, "sft"), args, command="sft")
    assert "\n" not in str(e.value)


def test_chat_template_null_default_and_a_jinja_file(tmp_path):
    def template(value):
        return load_config(None, [f"policy.tokenizer.chat_template={value}"], command="sft").data.custom_chat_template

    assert template("null") == PASSTHROUGH_TEMPLATE  # NeMo-RL: null is its passthrough template
    assert template("default") is None  # the tokenizer's own
    assert template("t.jinja") == "t.jinja"  # read when the run is built
    with pytest.warns(UserWarning, match="data.custom_chat_template: settings of posttrain sft's data; set, but "
                                         "unused by posttrain train"):
        load_config(None, ["data.custom_chat_template=x"])
    with pytest.raises(ConfigError, match=r"^data\.chat_template=chatml .*verl's name of a template.*"
                                          r"data\.custom_chat_template"):
        load_config(None, ["data.chat_template=chatml"], command="sft")


def test_a_jinja_file_replaces_the_tokenizers_template_for_the_run(tmp_path, tiny_model_dir):
    (tmp_path / "plain.jinja").write_text(sft_template())
    train = write_sft(tmp_path / "train.parquet", [(1, 2), (3, 4)])
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"data.train_files={train}", "data.train_batch_size=2",
                             f"data.custom_chat_template={tmp_path / 'plain.jinja'}", "trainer.logger=[]",
                             f"trainer.run_dir={tmp_path / 'r'}"], command="sft")
    run = build_sft_run(cfg)
    try:
        assert run.tokenizer.chat_template == sft_template()
        assert run.tokenizer.decode(run.train_data[0].input_ids) == " Question: What is 1 + 2? Answer: 3<|im_end|>"
    finally:
        run.writer.close()
        run.actor.shutdown()
    cfg.data.custom_chat_template, cfg.trainer.run_dir = str(tmp_path / "missing.jinja"), str(tmp_path / "r2")
    with pytest.raises(ConfigError, match=r"data\.custom_chat_template=.*missing\.jinja: cannot read"):
        build_sft_run(cfg)
