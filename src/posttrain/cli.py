"""`posttrain train | sft | preprocess | eval | export | checkpoints | report | compare | submit | deploy | tiny-model | fetch-model`:
the top of the package (nothing in it imports this module).

Errors a user can fix print one line and exit 2; `--debug` (or
POSTTRAIN_DEBUG=1, or `train --debug`) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys

from posttrain.arguments import add_work_commands, root_parser, split_train_args
from posttrain.errors import ConfigError, PosttrainError, Preempted
from posttrain.runtime.quiet import quiet_libraries
from posttrain.text.redact import redact_text

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; run again to resume


def cmd_train(args) -> int:
    from posttrain.driver.build import build_run
    from posttrain.config import load_config
    from posttrain.driver.loop import train
    from posttrain.help_config import describe_keys

    if args.help_config:
        print(describe_keys())
        return 0
    config_path, overrides = split_train_args(args.args, args.config)
    cfg = load_config(config_path, overrides)
    if args.debug_run or cfg.trainer.debug:  # a run to debug: docs/debugging.md
        from posttrain.runtime.debugging import post_mortem_on_crash

        cfg.trainer.debug = True
        post_mortem_on_crash()
    run = build_run(cfg)
    print(f"posttrain: run directory {run.run_dir}", file=sys.stderr)
    summary = train(run)
    print(format_summary(summary))
    return 0


def cmd_sft(args) -> int:
    from posttrain.driver.build_sft import build_sft_run
    from posttrain.config import load_config
    from posttrain.driver.sft import train_sft
    from posttrain.help_config import describe_sft_keys

    if args.help_config:
        print(describe_sft_keys())
        return 0
    config_path, overrides = split_train_args(args.args, args.config)
    cfg = load_config(config_path, overrides, command="sft")
    if args.debug_run or cfg.trainer.debug:
        from posttrain.runtime.debugging import post_mortem_on_crash

        cfg.trainer.debug = True
        post_mortem_on_crash()
    run = build_sft_run(cfg)
    print(f"posttrain: run directory {run.run_dir}", file=sys.stderr)
    summary = train_sft(run)
    print(format_sft_summary(summary))
    return 0


def format_sft_summary(s: dict) -> str:
    parts = []
    if "loss_first" in s:
        parts.append(f"training loss {s['loss_first']:.4f} -> {s['loss_last']:.4f}")
    if "val_before" in s and "val_after" in s:
        parts.append(f"validation loss {s['val_before']:.4f} -> {s['val_after']:.4f}")
    elif "val_after" in s:
        parts.append(f"validation loss {s['val_after']:.4f}")
    return "done: " + " | ".join(parts + format_summary(s)[len("done: "):].split(" | ")[-2:])


def format_summary(s: dict) -> str:
    parts = []
    if "val_before" in s and "val_after" in s:
        gain = s["val_after"] - s["val_before"]
        parts.append(f"validation score {s['val_before']:.3f} -> {s['val_after']:.3f} ({gain:+.3f})")
    elif "val_after" in s:
        parts.append(f"validation score {s['val_after']:.3f}")
    ran = s["steps"] - s.get("start_step", 0)
    resumed = f" (resumed at step {s['start_step']}, now at {s['steps']})" if s.get("start_step") else ""
    parts.append(f"{ran} step{'' if ran == 1 else 's'} in {s['seconds']:.0f} s{resumed}")
    parts.append(f"run directory {s['run_dir']}")
    return "done: " + " | ".join(parts)


def cmd_eval(args) -> int:
    import torch

    from posttrain.driver.build import make_reward_pool
    from posttrain.driver.placement import pick_device
    from posttrain.data.dataset import PromptDataset
    from posttrain.data.schema import read_rows
    from posttrain.driver.sampling import load_tool_use
    from posttrain.models import load_model, load_tokenizer
    from posttrain.models.loader import eos_token_ids
    from posttrain.models.processor import is_vision_dir, load_processor
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.hf import HFRolloutEngine
    from posttrain.driver.validation import validate

    if args.reward_workers is not None and args.reward_workers < 0:
        raise ConfigError(f"--reward-workers must be >= 0 (0: score in this process), got {args.reward_workers}")
    # before the model: a reward file that fails to import stops here
    rewards = make_reward_pool(args.reward_fn, args.reward_workers, args.reward_timeout)
    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    processor = (load_processor(args.model, trust_remote_code=args.trust_remote_code) if is_vision_dir(args.model)
                 else None)  # a vision-language model: prompts with images
    tokenizer = (processor.tokenizer if processor is not None
                 else load_tokenizer(args.model, trust_remote_code=args.trust_remote_code))
    model = load_model(args.model, dtype=args.dtype, trust_remote_code=args.trust_remote_code, device=device)
    rows = read_rows(args.data)
    if args.max_samples:
        rows = rows[: args.max_samples]
    eos = eos_token_ids(tokenizer, model)
    tools, settings = None, None
    if args.tool_config or args.tools:  # multi-turn: the model may call the tools (rollout/multiturn.py)
        tools, settings = load_tool_use(args.tool_config, args.tools, args.reward_timeout,
                                        max_assistant_turns=args.max_assistant_turns,
                                        max_tool_response_length=args.max_tool_response_length,
                                        max_response_length=args.max_response_length, eos_token_ids=eos)
    data = PromptDataset.build(rows, tokenizer, args.max_prompt_length, name="eval",
                               template_kwargs=settings.template_kwargs if settings else None, processor=processor)
    engine = HFRolloutEngine(model, eos, tokenizer.pad_token_id, seed=args.seed)
    params = SamplingParams(max_new_tokens=args.max_response_length, n=args.n, temperature=args.temperature,
                            top_p=args.top_p, do_sample=args.temperature > 0)
    try:
        with rewards:
            m, _ = validate(engine, tokenizer, data, params, rewards, args.batch_size, tools=tools, multi_turn=settings,
                            processor=processor)
    finally:
        if tools is not None:
            tools.close()
    for key, value in m.items():
        if key.endswith("/score/mean") and key != "val/score/mean":
            print(f"{key[len('val/'):-len('/score/mean')]:<30} {value:.4f}")
    print(f"{'all':<30} {m['val/score/mean']:.4f}  ({len(data)} prompts x {args.n})")
    for key, value in m.items():  # the numbers a reward's dict return held beside its score (verl's acc, ...)
        name = key[len("val/"):-len("/mean")] if key.startswith("val/") and key.endswith("/mean") else ""
        if name and "/" not in name and name not in ("score", "response_length"):
            print(f"{name:<30} {value:.4f}  (the reward's '{name}', mean over the samples that returned it)")
    if tools is not None:
        print(f"{'tool use':<30} {m['val/multi_turn/tool_use_ratio']:.4f}  (tool calls per sample "
              f"{m['val/multi_turn/tool_calls/mean']:.2f}, turns {m['val/multi_turn/turns/mean']:.2f}, tool errors "
              f"{m['val/multi_turn/tool_errors']:.0f})")
    return 0


def cmd_fetch_model(args) -> int:
    """Print the directory of a real pretrained model (converted on first use): model.path=$(posttrain fetch-model)."""
    from posttrain.models.fetch import fetch_model

    print(fetch_model(args.name, args.output, args.from_file))
    return 0


def cmd_tiny_model(args) -> int:
    """Print or copy an embedded model (shipped, or built for another --seed), or with --rebuild build it afresh."""
    import hashlib
    import shutil
    from pathlib import Path

    from posttrain.files.cache import directory_digest
    from posttrain.models import shipped
    from posttrain.tiny import arith, games as tiny_games, tools as tiny_tools, vision_model as tiny_vision

    # --task -> (what it is, the shipped directory or None, its checked directory, its build)
    tasks = {"arith": ("", shipped.EMBEDDED_DIR, lambda: arith.ensure_tiny_model(seed=args.seed),
                       arith.build_tiny_model),
             "tools": ("tool-using ", shipped.TOOLS_DIR, shipped.tools_model, tiny_tools.build_tools_model),
             "games": ("number-guessing ", shipped.GAMES_DIR, shipped.games_model, tiny_games.build_games_model),
             "vision": ("vision ", shipped.VISION_DIR, shipped.vision_model, tiny_vision.build_vision_model)}
    what, shipped_dir, ready, build = tasks[args.task]
    if args.task != "arith" and args.seed != 0 and not args.rebuild:
        raise PosttrainError(f"the {what}tiny model ships for seed 0 only; build another with --rebuild --output DIR")
    if args.output is None:
        if args.rebuild:
            raise PosttrainError("--rebuild needs --output DIR (a new or empty directory to build into)")
        print(ready())
        return 0
    out = Path(args.output)
    if out.exists() and any(out.iterdir()):
        raise PosttrainError(f"output directory '{out}' is not empty; choose a new --output")
    if not args.rebuild:
        shutil.copytree(ready(), out, dirs_exist_ok=True)
        print(f"wrote the {what}embedded tiny model to {out}; use it with actor_rollout_ref.model.path={out}")
        return 0
    meta = build(out, seed=args.seed)
    weights = [hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (out, shipped_dir)]
    same = "the same weights as" if weights[0] == weights[1] else "other weights than"
    scores = ", ".join(f"{k} {v:.3f}" for k, v in meta.items() if k.endswith(("_accuracy", "_success")))
    print(f"built the {what}tiny model into {out} in {meta['seconds']:.0f} s: {meta['sft_steps']} warm-up steps, "
          f"{scores}; {same} the shipped model (seed 0; rounding differs between CPUs). "
          f"Its digest: {directory_digest(out)}")
    return 0


def cmd_export(args) -> int:
    from posttrain.checkpoint.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.output, adapter=args.adapter)
    print(f"wrote {'a peft adapter' if args.adapter else 'a Hugging Face model'} directory to {out}")
    return 0


def cmd_checkpoints(args) -> int:
    from posttrain.checkpoint import list_checkpoints

    infos = list_checkpoints(args.run_dir, checksums=not args.quick)
    if not infos:
        print(f"no checkpoints under {args.run_dir}/checkpoints")
        return 0
    keys = [k for k in ("val/score/mean", "critic/score/mean") if any(k in i.metrics for i in infos)]
    print(f"{'step':>6}  {'size':>9}  {'state':<7}" + "".join(f"  {k:>18}" for k in keys) + "  path")
    for i in infos:
        values = "".join(f"  {i.metrics[k]:>18.4f}" if k in i.metrics else f"  {'-':>18}" for k in keys)
        state = "valid" if i.valid else "INVALID"
        print(f"{i.step:>6}  {i.size / 2**20:>7.1f}MB  {state:<7}{values}  {i.path}"
              + ("" if i.valid else f"  ({i.problem})"))
    return 0


def cmd_report(args) -> int:
    from posttrain.report import write_report

    print(f"wrote {write_report(args.run_dir, args.output)}")
    return 0


def cmd_compare(args) -> int:
    from posttrain.report import write_compare

    print(f"wrote {write_compare(args.run_dirs, args.output)}")
    return 0


def cmd_submit(args) -> int:
    """Submit `posttrain COMMAND` as a Ray job and follow it, or ask about a job (--status/--logs/--stop/--list)."""
    from posttrain.distributed import jobs

    action = next((a for a in ("status", "logs", "stop") if getattr(args, a)), "list" if args.list else None)
    if action and args.command:
        raise ConfigError(f"--{action} takes no command after --; submit and query in separate calls")
    if args.follow and action != "logs":
        raise ConfigError("--follow goes with --logs JOB_ID")
    if action is None:  # check what is local before contacting the cluster
        jobs.entrypoint(args.command)
        runtime_env = jobs.build_runtime_env(args.runtime_env, args.working_dir, args.env)
    address = jobs.resolve_address(args.address)
    if action == "status":
        return jobs.show_status(address, args.status)
    if action == "logs":
        return jobs.show_logs(address, args.logs, follow_logs=args.follow)
    if action == "stop":
        return jobs.stop(address, args.stop)
    if action == "list":
        return jobs.list_jobs(address)
    return jobs.submit(address, args.command, runtime_env, wait=not args.no_wait)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: the commands that do work (arguments.py), each given its
    handler here, then `submit` and `deploy`, which start work elsewhere."""
    from posttrain.deploy import register as register_deploy

    parser, sub = root_parser()
    commands = add_work_commands(sub)
    for name, handler in (("train", cmd_train), ("sft", cmd_sft), ("eval", cmd_eval), ("export", cmd_export),
                          ("checkpoints", cmd_checkpoints), ("report", cmd_report), ("compare", cmd_compare),
                          ("tiny-model", cmd_tiny_model), ("fetch-model", cmd_fetch_model)):
        commands[name].set_defaults(func=handler)

    sm = sub.add_parser("submit", help="run a posttrain command as a job on a Ray cluster and follow its logs",
                        description="posttrain submit --address http://HEAD:8265 [options] -- train [CONFIG.yaml] "
                                    "[key=value ...]. The exit status is the job's. Also: --status/--logs/--stop "
                                    "JOB_ID, --list.")
    sm.add_argument("command", nargs="*", metavar="-- COMMAND", help="the posttrain command the job runs, after --")
    sm.add_argument("--address", help="the head's dashboard, http://HEAD:8265 (default: $RAY_ADDRESS if http(s))")
    sm.add_argument("--working-dir", metavar="DIR", help="a local directory uploaded as the job's working directory")
    sm.add_argument("--runtime-env", metavar="FILE", help="a Ray runtime_env, YAML or JSON (pip, env_vars, ...)")
    sm.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for the job (repeatable; wins over --runtime-env)")
    sm.add_argument("--no-wait", action="store_true", help="print the job id and return at once")
    query = sm.add_mutually_exclusive_group()
    query.add_argument("--status", metavar="JOB_ID", help="print a job's status")
    query.add_argument("--logs", metavar="JOB_ID", help="print a job's logs (--follow: until it ends)")
    query.add_argument("--stop", metavar="JOB_ID", help="stop a job (it saves a checkpoint first)")
    query.add_argument("--list", action="store_true", help="list the cluster's jobs")
    sm.add_argument("--follow", action="store_true", help="with --logs: stream until the job ends")
    sm.set_defaults(func=cmd_submit)

    dp = sub.add_parser("deploy", help="render a KubeRay manifest or a Slurm script that runs posttrain on a cluster")
    register_deploy(dp.add_subparsers(dest="target", required=True))
    return parser


def redact_warnings() -> None:
    """Print warnings through redact_text: one may quote a config value that holds a URL password."""
    import warnings

    show = warnings.showwarning
    if getattr(show, "posttrain_redacts", False):
        return

    def showwarning(message, category, filename, lineno, file=None, line=None):
        show(redact_text(str(message)), category, filename, lineno, file, line)

    showwarning.posttrain_redacts = True
    warnings.showwarning = showwarning


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    redact_warnings()
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = args.debug or getattr(args, "debug_run", False) or os.environ.get("POSTTRAIN_DEBUG") == "1"
    try:
        return args.func(args)
    except Preempted as e:
        print(redact_text(f"posttrain: {e}"), file=sys.stderr)
        return EXIT_PREEMPTED
    except PosttrainError as e:
        if debug:
            raise
        # errors quote config values and addresses, which may carry a URL password or a token
        print(redact_text(f"posttrain: error: {e}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("posttrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
