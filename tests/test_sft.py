"""posttrain sft: the supervised loss by hand, its micro-batches, the command end to end (loss falls, weights
move, exact resume, export), verl's SFT keys and bad input."""

import copy
import math
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from posttrain.driver.build_sft import build_sft_run
from posttrain.cli import main
from posttrain.checkpoint import list_checkpoints
from posttrain.config import config_to_dict, flatten, load_config
from posttrain.help_config import type_and_default
from posttrain.errors import ConfigError, DataError
from posttrain.driver.sft import train_sft
from posttrain.training.sft import SFTSettings, learned_tokens, micro_batches, nll_of, nll_sum, sft_update

from helpers import comparable, sft_overrides, write_sft


class Bigram(torch.nn.Module):
    """logits at a position = a learned row per input token: losses easy to work out by hand."""

    def __init__(self, rows):
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(rows, dtype=torch.float32))

    def forward(self, input_ids, attention_mask=None):
        return type("Out", (), {"logits": self.table[input_ids]})()


LN2, LN3 = math.log(2), math.log(3)
# after token 0: p = [1/5, 3/5, 1/5]; after 1: uniform; after 2: [2/5, 1/5, 2/5]
ROWS = [[0.0, LN3, 0.0], [0.0, 0.0, 0.0], [LN2, 0.0, LN2]]


def two_rows():
    """Row 0 learns 1 after 0 and 2 after 1; row 1 learns 1 after 2 (its last position is padding)."""
    return {"input_ids": torch.tensor([[0, 1, 2], [2, 1, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
            "labels": torch.tensor([[-100, 1, 2], [-100, 1, -100]])}


def test_the_loss_is_the_mean_over_learned_tokens_whatever_the_micro_batches():
    # -log(3/5) - log(1/3) - log(1/5) over 3 tokens = log(25) / 3
    expected = math.log(25) / 3
    grads = []
    for micro in (1, 2):
        model = Bigram(ROWS)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        m = sft_update(model, opt, two_rows(), SFTSettings(micro_batch_size=micro, grad_clip=None))
        assert m["train/loss"] == pytest.approx(expected, abs=1e-6) and m["train/learned_tokens"] == 3
        grads.append(model.table.detach().clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-7)  # one micro-batch or two: the same step
    # the step by hand: row 1 of the table (after token 1) saw one target, 2: d/dz of -log softmax(z)[2] / 3
    moved = grads[0][1] - torch.tensor(ROWS[1])
    assert torch.allclose(moved, -0.1 * torch.tensor([1 / 3, 1 / 3, -2 / 3]) / 3, atol=1e-6)
    assert nll_of(Bigram(ROWS), two_rows(), SFTSettings()) == (pytest.approx(math.log(25), abs=1e-5), 3)


def test_a_single_micro_batch_is_transformers_loss_exactly(random_qwen2):
    a, b = random_qwen2.train(), copy.deepcopy(random_qwen2)
    torch.manual_seed(1)
    ids = torch.randint(2, 40, (4, 10))
    attention = torch.ones_like(ids)
    attention[2:, 7:] = 0
    labels = torch.where(attention.bool(), ids, -100)
    labels[:, :3] = -100
    opt_a, opt_b = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (a, b))
    loss = a(input_ids=ids, attention_mask=attention, labels=labels).loss
    opt_a.zero_grad()
    loss.backward()
    opt_a.step()
    batch = {"input_ids": ids, "attention_mask": attention, "labels": labels}
    m = sft_update(b, opt_b, batch, SFTSettings(micro_batch_size=4, grad_clip=None, remove_padding=False))
    assert m["train/loss"] == loss.item()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_micro_batches_are_length_ordered_and_trimmed():
    batch = {"input_ids": torch.arange(12).view(3, 4), "attention_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1],
                                                                                      [1, 0, 0, 0]]),
             "labels": torch.full((3, 4), 5)}
    parts = micro_batches(batch, SFTSettings(micro_batch_size=2))
    assert [p["input_ids"].tolist() for p in parts] == [[[4, 5, 6, 7], [0, 1, 2, 3]], [[8]]]
    assert len(micro_batches(batch, SFTSettings(micro_batch_size=2, micro_max_tokens=5))) == 2  # 4 | 2 + 1 tokens
    assert len(micro_batches(batch, SFTSettings(micro_batch_size=2, micro_max_tokens=2))) == 3  # 4 alone | 2 | 1
    assert learned_tokens(batch) == 9


@pytest.fixture
def sft_data(tmp_path):
    train = write_sft(tmp_path / "train.parquet", [(a, b) for a in range(10, 18) for b in (20, 31)])
    val = write_sft(tmp_path / "val.parquet", [(40, 2), (51, 7), (63, 9), (72, 5)])
    return train, val


def run_sft(args):
    return train_sft(build_sft_run(load_config(None, args, command="sft")))


def test_sft_learns_resumes_exactly_and_exports(tmp_path, sft_data, tiny_model_dir):
    whole = run_sft(sft_overrides(tiny_model_dir, *sft_data, tmp_path / "whole", 6, "trainer.save_freq=3"))
    assert whole["val_after"] < whole["val_before"] - 0.05  # measured 1.93 -> 1.3x over seeds 0-2
    before = load_file(tiny_model_dir / "model.safetensors")
    after = load_file(tmp_path / "whole" / "checkpoints" / "global_step_6" / "actor" / "model.safetensors")
    assert all(not torch.equal(before[k], after[k]) for k in before)  # every weight trained
    args = sft_overrides(tiny_model_dir, *sft_data, tmp_path / "split", 6, "trainer.save_freq=3")
    stopped = build_sft_run(load_config(None, args, command="sft"))
    stopped.total_steps = 3  # as if stopped after step 3 (the schedule is the 6-step run's)
    train_sft(stopped)
    resumed = run_sft(args)
    assert resumed["start_step"] == 3 and "val_before" not in resumed
    split = load_file(tmp_path / "split" / "checkpoints" / "global_step_6" / "actor" / "model.safetensors")
    assert all(torch.equal(after[k], split[k]) for k in after)
    a, b = comparable(tmp_path / "whole"), comparable(tmp_path / "split")
    assert [line["train/loss"] for line in a if "train/loss" in line] == \
           [line["train/loss"] for line in b if "train/loss" in line]
    assert [line["step"] for line in b][-3:] == [4, 5, 6] and a[-1]["val/loss"] == b[-1]["val/loss"]
    lrs = [line["train/lr"] for line in a if "train/lr" in line]
    assert lrs[0] == pytest.approx(3e-3) and lrs[-1] < lrs[1]  # one warm-up step, then the cosine down
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "whole" / "checkpoints" / "global_step_6"), "--output", str(out)]) == 0
    exported = load_file(out / "model.safetensors")
    assert all(torch.equal(exported[k], after[k]) for k in after)


def test_sft_keeps_its_last_step_and_says_when_it_starts_over(tmp_path, sft_data, tiny_model_dir, capsys):
    """No trainer.save_freq: the last step is saved; with trainer.save_last=false nothing is, and the same
    command again says it starts over and appends the earlier metrics to metrics.discarded.jsonl."""
    run_sft(sft_overrides(tiny_model_dir, *sft_data, tmp_path / "kept", 2))
    assert [(i.step, i.valid) for i in list_checkpoints(tmp_path / "kept")] == [(2, True)]
    gone = tmp_path / "gone"
    args = sft_overrides(tiny_model_dir, *sft_data, gone, 2, "trainer.save_last=false")
    run_sft(args)
    assert not (gone / "checkpoints").exists()
    first = (gone / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert run_sft(args)["start_step"] == 0
    assert (gone / "metrics.discarded.jsonl").read_text() == first
    said = [line for line in capsys.readouterr().err.splitlines() if "no valid checkpoint" in line]
    assert len(said) == 1 and f"{gone} holds an earlier run's metrics (3 lines, steps 0-2)" in said[0], said


def test_sft_help_config_prints_the_defaults_an_sft_run_gets(tiny_model_dir, capsys):
    """Each key `posttrain sft --help-config` prints shows what a run's resolved config holds: given a model, and
    (embedded: ...) without one (verl's keys that its dialect reads itself: their own default); RL's keys are left
    out."""
    assert main(["sft", "--help-config"]) == 0
    out = capsys.readouterr().out
    printed = {m[1]: line for line in out.splitlines() if (m := re.match(r"  ([\w.]+): ", line))}
    given = flatten(config_to_dict(load_config(None, [f"model.path={tiny_model_dir}"], command="sft")))
    embedded = flatten(config_to_dict(load_config(None, [], command="sft")))
    for key, line in printed.items():
        typ, default = type_and_default(key)
        default = None if key == "model.path" else given.get(key, default)
        assert line.startswith(f"  {key}: {typ} = {default!r}"), (line, default)
        if key != "model.path" and key in given and embedded[key] != given[key]:
            assert f"(embedded: {embedded[key]!r})" in line, (line, embedded[key])
        else:
            assert "(embedded:" not in line, line
    assert {"data.response_key", "data.max_length", "data.multiturn.enable", "trainer.save_last"} <= printed.keys()
    assert not {"rollout.n", "actor.ppo_mini_batch_size", "algorithm.adv_estimator", "data.max_prompt_length",
                "reward.num_workers", "trainer.log_samples_freq", "distillation.enabled"} & printed.keys()
    assert "  actor.lr: float = 1e-05  (verl: optim.lr)  (embedded: 0.0001)" in printed["actor.lr"]
    assert printed["actor.ppo_micro_batch_size"].endswith("(verl: data.micro_batch_size_per_gpu)  (embedded: 64)")
    assert printed["data.prompt_key"] == "  data.prompt_key: str = 'question'  (embedded: 'prompt')"


def test_verls_sft_command_loads():
    """verl's examples/sft/gsm8k/run_qwen_05_peft.sh, as its torchrun line passes the keys."""
    cfg = load_config(None, [
        "data.train_files=/d/train.parquet", "data.val_files=/d/test.parquet", "data.prompt_key=extra_info",
        "data.response_key=extra_info", "optim.lr=1e-4", "data.prompt_dict_keys=['question']",
        "+data.response_dict_keys=['answer']", "data.micro_batch_size_per_gpu=4",
        "model.partial_pretrain=/m/Qwen2.5-0.5B-Instruct", "trainer.default_local_dir=/ck",
        "trainer.project_name=gsm8k-sft", "trainer.experiment_name=gsm8k-sft-qwen-2.5-0.5b-instruct",
        "trainer.logger=console", "trainer.total_epochs=1", "model.lora_rank=32", "model.lora_alpha=16",
        "model.target_modules=all-linear", "optim.clip_grad=0.5", "optim.lr_scheduler=cosine",
        "model.fsdp_config.model_dtype=bf16", "ulysses_sequence_parallel_size=1", "use_remove_padding=true",
        "model.fsdp_config.wrap_policy.min_num_params=0", "optim.betas=[0.9,0.95]", "optim.warmup_style=null"],
        command="sft")
    assert (cfg.model.path, cfg.actor.lr, cfg.actor.ppo_micro_batch_size, cfg.actor.grad_clip) == \
           ("/m/Qwen2.5-0.5B-Instruct", 1e-4, 4, 0.5)
    assert (cfg.data.prompt_key, cfg.data.prompt_dict_keys, cfg.data.response_dict_keys) == \
           ("extra_info", ["question"], ["answer"])
    assert (cfg.trainer.run_dir, cfg.model.lora_rank, cfg.model.dtype, cfg.actor.lr_scheduler_type) == \
           ("/ck", 32, "bfloat16", "cosine")
    # verl's SFT defaults where a command leaves a key out
    sft = load_config(None, ["model.partial_pretrain=/m"], command="sft")
    assert (sft.data.prompt_key, sft.data.response_key, sft.data.train_batch_size, sft.actor.lr,
            sft.actor.betas, sft.actor.lr_warmup_steps_ratio, sft.trainer.total_epochs) == \
           ("question", "answer", 256, 1e-5, [0.9, 0.95], 0.1, 4)


def test_fused_kernels_give_the_same_loss_and_step(random_qwen2):
    """model.use_fused_kernels: -log p from the hidden states a chunk at a time, the logits never whole: the same
    summed loss and the same update as the cross-entropy of the full logits, to float rounding."""
    a, b = random_qwen2.train(), copy.deepcopy(random_qwen2)
    torch.manual_seed(2)
    ids = torch.randint(2, 40, (3, 9))
    attention = torch.ones_like(ids)
    attention[1:, 6:] = 0
    labels = torch.where(attention.bool(), ids, -100)
    labels[:, :2] = -100
    batch = {"input_ids": ids, "attention_mask": attention, "labels": labels}
    with torch.no_grad():
        assert nll_sum(b, batch, "cpu", fused=True).item() == pytest.approx(nll_sum(a, batch, "cpu").item(), rel=1e-5)
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b))
    m_a = sft_update(a, opt_a, batch, SFTSettings(micro_batch_size=2, grad_clip=None))
    m_b = sft_update(b, opt_b, batch, SFTSettings(micro_batch_size=2, grad_clip=None, fused=True))
    assert m_b["train/loss"] == pytest.approx(m_a["train/loss"], rel=1e-5)
    assert m_b["train/grad_norm"] == pytest.approx(m_a["train/grad_norm"], rel=1e-4)
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert type(b.get_output_embeddings()).__name__ == "Linear"  # the stand-in head is gone after the pass


def test_bad_sft_settings_are_refused_or_named():
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.lrr' \(on the command line\); did you mean 'optim.lr'\?"):
        load_config(None, ["optim.lrr=1"], command="sft")
    with pytest.raises(ConfigError, match="data.micro_batch_size=8 .*give data.micro_batch_size_per_gpu"):
        load_config(None, ["data.micro_batch_size=8"], command="sft")
    with pytest.raises(ConfigError, match="data.chat_template"):
        load_config(None, ["data.chat_template=x"], command="sft")
    with pytest.warns(UserWarning, match="rollout.n: reinforcement-learning settings; posttrain sft does not use"):
        load_config(None, ["rollout.n=4"], command="sft")
    with pytest.warns(UserWarning, match="data.response_key: settings of posttrain sft's data"):
        load_config(None, ["data.response_key=x"])
    with pytest.raises(ConfigError, match="data.train_batch_size=3 rows must divide evenly over the 2 workers"):
        load_config(None, ["data.train_batch_size=3", "trainer.n_gpus_per_node=2"], command="sft")


@pytest.mark.parametrize("row, problem", [
    ({"question": "hi"}, "has no column 'answer'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant message"),
    ({"question": "q", "answer": "a " * 400}, "over data.max_length=64"),
])
def test_bad_sft_rows_stop_the_command_with_the_row_and_the_fix(tmp_path, tiny_model_dir, capsys, row, problem):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    extra = ["data.multiturn.enable=true"] if "messages" in row else []
    assert main(["sft", f"model.path={tiny_model_dir}", f"data.train_files={path}", "data.max_length=64",
                 "data.train_batch_size=1", f"trainer.run_dir={tmp_path / 'r'}", *extra]) != 0
    err = capsys.readouterr().err
    assert problem in err and f"row 0 of '{path}'" in err
    with pytest.raises(DataError):
        run_sft([f"model.path={tiny_model_dir}", f"data.train_files={path}", "data.max_length=64",
                 "data.train_batch_size=1", f"trainer.run_dir={tmp_path / 'r2'}", *extra])


def test_the_embedded_default_runs_and_learns(tmp_path, capsys):
    """`posttrain sft` with no arguments (the README's first SFT run): the tiny model on the arith answers."""
    assert main(["sft", f"trainer.run_dir={tmp_path / 'r'}", "trainer.logger=[]"]) == 0
    out = capsys.readouterr().out
    before, after = (float(x) for x in out.split("validation loss ")[1].split(" |")[0].split(" -> "))
    assert after < before - 0.1  # measured 0.404 -> 0.239 / 0.233 / 0.233 on seeds 0, 1, 2
    assert (tmp_path / "r" / "checkpoints" / "global_step_60" / "actor" / "model.safetensors").exists()


def test_lora_sft_trains_adapters_that_export_merged(tmp_path, sft_data, tiny_model_dir):
    summary = run_sft(sft_overrides(tiny_model_dir, *sft_data, tmp_path / "r", 4, "trainer.save_freq=4",
                                    "model.lora_rank=4", "model.lora_alpha=8", "optim.lr=1e-2"))
    assert summary["val_after"] < summary["val_before"]
    ckpt = tmp_path / "r" / "checkpoints" / "global_step_4"
    assert (ckpt / "actor" / "adapter_model.safetensors").exists()
    assert not (ckpt / "actor" / "model.safetensors").exists()  # the base is not copied: only the adapters train
    assert main(["export", str(ckpt), "--output", str(tmp_path / "hf")]) == 0
    base, merged = load_file(tiny_model_dir / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert base.keys() == merged.keys()
    assert any(not torch.equal(base[k], merged[k]) for k in base if "proj" in k)  # the adapters merged in


def test_a_tokenizer_given_apart_from_the_model_trains_and_goes_with_the_checkpoint(tmp_path, sft_data):
    """model.tokenizer_path: a model directory without tokenizer files (the embedded model's weights) trains with
    another directory's tokenizer (its chat template changed here), which the checkpoint and its export hold; a
    model directory without one, or a tokenizer directory that is not there, is named with the key to set."""
    from posttrain.errors import ModelError
    from posttrain.models import load_tokenizer, shipped

    weights, tokenizer_dir = tmp_path / "weights", tmp_path / "tokenizer"
    weights.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (weights / name).write_bytes((shipped.embedded_model() / name).read_bytes())
    tokenizer = load_tokenizer(shipped.embedded_model())
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(tokenizer_dir)
    with pytest.raises(ModelError, match=r"has no tokenizer files .*model\.tokenizer_path"):
        run_sft(sft_overrides(weights, *sft_data, tmp_path / "none", 1))
    with pytest.raises(ModelError, match=r"^model\.tokenizer_path=\S*nope: no such directory"):
        run_sft(sft_overrides(weights, *sft_data, tmp_path / "nope", 1, f"model.tokenizer_path={tmp_path / 'nope'}"))
    run = build_sft_run(load_config(None, sft_overrides(weights, *sft_data, tmp_path / "run", 2, "optim.lr=1e-4",
                                                        f"model.tokenizer_path={tokenizer_dir}"), command="sft"))
    assert run.tokenizer.decode(run.train_data[0].input_ids).startswith("user: ")  # rendered with its template
    assert train_sft(run)["steps"] == 2
    saved = tmp_path / "run" / "checkpoints" / "global_step_2" / "actor"
    assert load_tokenizer(saved).chat_template == tokenizer.chat_template
    out = tmp_path / "hf"
    assert main(["export", str(saved.parent), "--output", str(out)]) == 0
    assert load_tokenizer(out).chat_template == tokenizer.chat_template
    assert load_tokenizer(out).get_vocab() == tokenizer.get_vocab()
    assert load_config(None, ["actor_rollout_ref.model.tokenizer_path=/t"]).model.tokenizer_path == "/t"  # verl's
