"""`posttrain train | preprocess | eval | export | checkpoints | report | compare | submit | tiny-model`.

Errors a user can fix print one line and exit 2; `--debug` (or
POSTTRAIN_DEBUG=1) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys

from posttrain.errors import ConfigError, PosttrainError, Preempted
from posttrain.redact import redact_text

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; run again to resume


def cmd_train(args) -> int:
    from posttrain.build import build_run
    from posttrain.config import describe_keys, load_config
    from posttrain.loop import train

    if args.help_config:
        print(describe_keys())
        return 0
    config_path, overrides = split_train_args(args.args)
    cfg = load_config(config_path, overrides)
    run = build_run(cfg)
    print(f"posttrain: run directory {run.run_dir}", file=sys.stderr)
    summary = train(run)
    print(format_summary(summary))
    return 0


def split_train_args(args: list[str]) -> tuple[str | None, list[str]]:
    """[CONFIG.yaml] [key=value ...] -> (config path or None, overrides)."""
    config_path, overrides = None, []
    for i, arg in enumerate(args):
        if "=" in arg:
            overrides.append(arg)
        elif i == 0 and arg.endswith((".yaml", ".yml")):
            config_path = arg
        else:
            raise ConfigError(
                f"unexpected argument '{arg}'; pass a config file first (CONFIG.yaml) and then key=value overrides"
            )
    return config_path, overrides


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

    from posttrain.build import eos_token_ids, make_reward_pool, pick_device
    from posttrain.data.dataset import PromptDataset
    from posttrain.data.schema import read_rows
    from posttrain.loop import validate
    from posttrain.models import load_model, load_tokenizer
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.hf import HFRolloutEngine

    if args.reward_workers is not None and args.reward_workers < 0:
        raise ConfigError(f"--reward-workers must be >= 0 (0: score in this process), got {args.reward_workers}")
    # before the model: a reward file that fails to import stops here
    rewards = make_reward_pool(args.reward_fn, args.reward_workers, args.reward_timeout)
    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    model = load_model(args.model, dtype=args.dtype, trust_remote_code=args.trust_remote_code, device=device)
    rows = read_rows(args.data)
    if args.max_samples:
        rows = rows[: args.max_samples]
    data = PromptDataset.build(rows, tokenizer, args.max_prompt_length, name="eval")
    engine = HFRolloutEngine(model, eos_token_ids(tokenizer, model), tokenizer.pad_token_id, seed=args.seed)
    params = SamplingParams(max_new_tokens=args.max_response_length, n=args.n, temperature=args.temperature,
                            top_p=args.top_p, do_sample=args.temperature > 0)
    with rewards:
        m, _ = validate(engine, tokenizer, data, params, rewards, args.batch_size)
    for key, value in m.items():
        if key.endswith("/score/mean") and key != "val/score/mean":
            print(f"{key[len('val/'):-len('/score/mean')]:<30} {value:.4f}")
    print(f"{'all':<30} {m['val/score/mean']:.4f}  ({len(data)} prompts x {args.n})")
    return 0


def cmd_tiny_model(args) -> int:
    import shutil
    from pathlib import Path

    from posttrain.models import ensure_tiny_model

    src = ensure_tiny_model(seed=args.seed)
    out = Path(args.output)
    if out.exists() and any(out.iterdir()):
        raise PosttrainError(f"output directory '{out}' is not empty; choose a new --output")
    shutil.copytree(src, out, dirs_exist_ok=True)
    print(f"wrote the embedded tiny model to {out}; use it with actor_rollout_ref.model.path={out}")
    return 0


def cmd_export(args) -> int:
    from posttrain.checkpoint.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.output)
    print(f"wrote a Hugging Face model directory to {out}")
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


class _Parser(argparse.ArgumentParser):
    """Usage errors quote the arguments (`--env HF_TOKEN=...`): printed redacted. Subcommands'
    parsers are of the same class."""

    def error(self, message: str):
        super().error(redact_text(message))


def build_parser() -> argparse.ArgumentParser:
    from posttrain import __version__
    from posttrain.data.preprocess import register as register_preprocessors
    from posttrain.deploy import register as register_deploy

    p = _Parser(prog="posttrain", description="RL post-training of language models.")
    p.add_argument("--version", action="version", version=f"posttrain {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run RL training (no arguments: the embedded tiny default on the CPU)",
                       description="posttrain train [CONFIG.yaml] [key=value ...]. verl keys are accepted "
                                   "(actor_rollout_ref.actor.optim.lr=1e-5, ...); see --help-config.")
    t.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    t.add_argument("--help-config", action="store_true", help="list every config key, its type and default")
    t.set_defaults(func=cmd_train)

    pre = sub.add_parser("preprocess", help="write a dataset as parquet rows (gsm8k, arith, countdown)")
    register_preprocessors(pre.add_subparsers(dest="dataset", required=True))

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
    e.set_defaults(func=cmd_eval)

    ex = sub.add_parser("export", help="write a checkpoint's policy as a Hugging Face model directory")
    ex.add_argument("checkpoint", help="a global_step_N directory, or a run directory (its newest valid checkpoint)")
    ex.add_argument("--output", required=True, help="directory to write (must be new or empty)")
    ex.set_defaults(func=cmd_export)

    ck = sub.add_parser("checkpoints", help="list a run's checkpoints: step, size, validity, metrics")
    ck.add_argument("run_dir")
    ck.add_argument("--quick", action="store_true", help="check sizes only, not checksums")
    ck.set_defaults(func=cmd_checkpoints)

    rp = sub.add_parser("report", help="a run's metrics, samples and config as one self-contained HTML file")
    rp.add_argument("run_dir", help="a run directory (trainer.run_dir): it may still be running")
    rp.add_argument("--output", metavar="FILE.html", help="where to write (default RUN_DIR/report.html)")
    rp.set_defaults(func=cmd_report)

    cp = sub.add_parser("compare", help="several runs' metrics overlaid, and their config differences, in one HTML file")
    cp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="two or more run directories")
    cp.add_argument("--output", metavar="FILE.html", help="where to write (default ./compare.html)")
    cp.set_defaults(func=cmd_compare)

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

    tm = sub.add_parser("tiny-model", help="write the embedded tiny model's directory")
    tm.add_argument("--output", required=True, help="directory to write (must be new or empty)")
    tm.add_argument("--seed", type=int, default=0)
    tm.set_defaults(func=cmd_tiny_model)
    return p


def quiet_libraries() -> None:
    """posttrain shows its own progress; silence the libraries' bars and notices."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


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
    debug = args.debug or os.environ.get("POSTTRAIN_DEBUG") == "1"
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
