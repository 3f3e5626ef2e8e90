"""posttrain against Hugging Face TRL's GRPOTrainer on the same work: seconds
per GRPO step.

Both sides train the same model directory (common.make_model) on the same
synthetic prompts (common.make_prompts) with the same reward (the arith
reward, posttrain.rewards.arith.compute_score), and each step is
  - `--prompts` prompts x `--n` samples generated at temperature 1.0,
    responses of exactly `--response-length` tokens (EOS disabled),
  - scored, with a KL loss to a frozen reference model (beta 0.04),
  - one optimizer update (lr 1e-6), float32, `--threads` torch threads.
posttrain runs in this process (common.time_posttrain); TRL runs in a
subprocess (bench/trl_side.py) with an interpreter that has trl: `--trl-python`,
or bench/.venv-trl, which is built on first use on top of this interpreter's
packages (the same torch, transformers and posttrain) with trl==1.16.0 added.
The sides take turns, `--rounds` fresh runs each (default 2), so that a
machine that is slower for a while weighs on both alike; the first step of
every run is warm-up, and the table reports the median of all the others.

    .venv/bin/python bench/trl_grpo.py [--steps 6] [--rounds 2] [--prompts 16] [--n 8] [--response-length 16]
                                       [--only posttrain|trl] [--json PATH] [--trl-python PATH]
                                       [--model DIR] [--micro-batch M]

At real size, on SmolLM2-135M-Instruct (`posttrain fetch-model` prints its directory), two passes of 64
sequences on both sides (TRL in one pass of 128 needed more than 16 GB and was killed on a 24 GB machine):

    .venv/bin/python bench/trl_grpo.py --model $(.venv/bin/posttrain fetch-model) --steps 3 --rounds 1 \
        --response-length 24 --micro-batch 64 --trl-batch 64x2 --trl-checkpointing off
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

import common

BENCH = Path(__file__).resolve().parent
TRL_VENV = BENCH / ".venv-trl"
TRL_REQUIREMENT = "trl==1.16.0"
LR, BETA, TEMPERATURE = 1e-6, 0.04, 1.0
# TRL's split of the prompts x n completions of a step: per-device batch x accumulation steps, with
# steps_per_generation = accumulation (one generation and one optimizer step per step). Tried on the
# 2-core CPU at 16 x 8 x 16 tokens, 2 threads, idle machine, median s/step of steps 2..5:
# 128x1 2.51, 32x4 2.54, 16x8 2.60 (at 1 thread: 4.2-4.5 for all three). 128x1 and 32x4 are even within
# the noise, smaller micro-batches are a little slower (more, smaller forward/backward passes for the
# reference pass and the update); so the default is the whole step's batch in one pass, no accumulation
# (PROMPTSxN x 1).


def has_trl(python: str) -> bool:
    return subprocess.run([python, "-c", "import trl"], capture_output=True).returncode == 0


def parent_site_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def build_trl_venv() -> str:
    """bench/.venv-trl: a venv that sees this interpreter's site-packages (a
    .pth file adds them as site directories, so their own .pth files, such
    as posttrain's editable install, work too, and pip counts their packages
    as installed) and has trl installed on top, every package already
    installed here pinned to its version so that pip adds packages and never
    replaces torch or transformers."""
    python = TRL_VENV / "bin" / "python"
    if not python.exists():
        common.log(f"creating {TRL_VENV.relative_to(BENCH.parent)} on top of {sys.executable}")
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    site_packages = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip()
    (Path(site_packages) / "_bench_parent_env.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in parent_site_dirs()))
    constraints = TRL_VENV / "constraints.txt"
    pins = sorted({f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions(path=parent_site_dirs())
                   if d.metadata["Name"] and d.metadata["Name"].lower() not in ("pip", "setuptools")})
    constraints.write_text("\n".join(pins) + "\n")
    command = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-c", str(constraints),
               TRL_REQUIREMENT]
    common.log(f"installing trl into {TRL_VENV.relative_to(BENCH.parent)} (once): {' '.join(command)}")
    subprocess.run(command, check=True, stdout=sys.stderr)
    check = subprocess.run([str(python), "-c", "import json, torch, transformers, trl; print(json.dumps("
                            "[torch.__version__, torch.__file__, transformers.__version__]))"],
                           check=True, capture_output=True, text=True)
    torch_version, torch_file, transformers_version = json.loads(check.stdout)
    import transformers
    if (torch_version, transformers_version) != (torch.__version__, transformers.__version__) or not any(
            torch_file.startswith(d) for d in parent_site_dirs()):
        raise SystemExit(f"{TRL_VENV} has torch {torch_version} ({torch_file}), transformers {transformers_version}, "
                         f"not this interpreter's torch {torch.__version__}, transformers {transformers.__version__}")
    return str(python)


def trl_python(given: str | None) -> str:
    if given:
        if not has_trl(given):
            raise SystemExit(f"--trl-python {given}: cannot import trl")
        return given
    python = TRL_VENV / "bin" / "python"
    if python.exists() and has_trl(str(python)):
        return str(python)
    return build_trl_venv()


def time_trl(python: str, model_dir: Path, rows: list[dict], args, tmp: Path, checkpointing: bool) -> dict:
    config = {"gradient_checkpointing": checkpointing, "model_dir": str(model_dir), "rows": rows, "prompts": args.prompts, "n": args.n,
              "response_length": args.response_length, "steps": args.steps, "threads": args.threads, "lr": LR,
              "beta": BETA, "temperature": TEMPERATURE, "batch_split": args.trl_batch,
              "output_dir": str(tmp / "trl_out")}
    (tmp / "trl_config.json").write_text(json.dumps(config))
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               TOKENIZERS_PARALLELISM="false")
    common.log(f"TRL: {args.steps} steps with {python} (batch split {args.trl_batch}, gradient checkpointing "
               f"{'on' if checkpointing else 'off'})")
    subprocess.run([python, str(BENCH / "trl_side.py"), "--config", str(tmp / "trl_config.json"),
                    "--out", str(tmp / "trl_result.json")], check=True, stdout=sys.stderr, env=env)
    return json.loads((tmp / "trl_result.json").read_text())


def merged(runs: list[dict]) -> dict:
    """Several runs of one side (one per round) as one result: `measured_s`
    holds every run's steps after its warm-up step."""
    return {**runs[-1], "step_s": [r["step_s"] for r in runs],
            "measured_s": [s for r in runs for s in (r["step_s"][1:] or r["step_s"])]}


def summary(result: dict, completions: int) -> dict:
    measured = result["measured_s"]
    median = statistics.median(measured)
    return {"step_s": result["step_s"], "median_s": median, "min_s": min(measured), "max_s": max(measured),
            "completions_per_s": completions / median, "response_length": result["response_length"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--response-length", type=int, default=16)
    p.add_argument("--steps", type=int, default=6, help="steps per side; the first is warm-up")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of one run per side, alternating, so that a machine slower for a while weighs on "
                        "both sides alike; the medians are over every measured step of every round")
    p.add_argument("--only", choices=["posttrain", "trl"])
    p.add_argument("--json", help="also write the numbers here")
    p.add_argument("--trl-python", help="an interpreter that has trl (default: bench/.venv-trl, built when needed)")
    p.add_argument("--trl-checkpointing", choices=["off", "on", "both"], default="both",
                   help="TRL's gradient checkpointing: off (the same work as posttrain: the headline ratio), on "
                        "(GRPOConfig's default), or both (default)")
    p.add_argument("--trl-batch", help="TRL's per-device batch x accumulation steps, e.g. 32x4; their product is "
                                       "prompts x n (default: prompts*n x 1, one pass)")
    p.add_argument("--model", help="a Hugging Face model directory to train on both sides (default: the benchmark's "
                                    "3M-parameter Qwen2, common.make_model)")
    p.add_argument("--micro-batch", type=int, help="posttrain's sequences per forward/backward pass (log-probs and "
                                                   "update; default 64); pair with --trl-batch for TRL's")
    args = p.parse_args()
    args.trl_batch = args.trl_batch or f"{args.prompts * args.n}x1"
    torch.set_num_threads(args.threads)
    completions = args.prompts * args.n
    python = trl_python(args.trl_python) if args.only != "posttrain" else None

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = Path(args.model) if args.model else common.make_model(tmp / "model")
        extra = [f"actor.ppo_micro_batch_size={args.micro_batch}", f"rollout.log_prob_micro_batch_size={args.micro_batch}",
                 f"ref.log_prob_micro_batch_size={args.micro_batch}"] if args.micro_batch else []
        rows = common.make_prompts(args.prompts * args.steps)
        data_file = common.write_prompts(rows, tmp / "train.parquet")
        runs: dict[str, list] = {}
        for round_ in range(1, args.rounds + 1):
            # TRL's subprocess first: this process's memory grows with posttrain's side and is not given back
            if args.only != "posttrain":
                if args.trl_checkpointing in ("off", "both"):
                    runs.setdefault("trl", []).append(time_trl(python, model_dir, rows, args, tmp, False))
                if args.trl_checkpointing in ("on", "both"):
                    runs.setdefault("trl_default", []).append(time_trl(python, model_dir, rows, args, tmp, True))
            if args.only != "trl":
                common.log(f"round {round_}: posttrain: {args.steps} steps of {args.prompts} prompts x {args.n}, "
                           f"{args.response_length} tokens")
                runs.setdefault("posttrain", []).append(common.time_posttrain(
                    model_dir, data_file, args.prompts, args.n, args.response_length, args.steps, extra))
        results = {side: merged(r) for side, r in runs.items()}

    out: dict = {"settings": {"model": args.model or "common.make_model", "micro_batch": args.micro_batch,
                              "prompts": args.prompts, "n": args.n, "response_length": args.response_length,
                              "steps": args.steps, "rounds": args.rounds, "threads": args.threads, "lr": LR,
                              "beta": BETA, "temperature": TEMPERATURE, "dtype": "float32"}}
    print(f"{args.prompts} prompts x {args.n} samples per step, {args.response_length}-token responses (EOS off), "
          f"KL beta {BETA}, 1 update per step, lr {LR}, float32, {args.threads} threads; median of steps "
          f"2..{args.steps} of {args.rounds} alternating run(s) per side")
    rows_out = []
    if "posttrain" in results:
        out["posttrain"] = {"versions": common.versions(), **summary(results["posttrain"], completions),
                            "phases": results["posttrain"]["phases"]}
        print(f"posttrain side: {out['posttrain']['versions']}")
    for side in ("trl", "trl_default"):
        if side not in results:
            continue
        r = results[side]
        out[side] = {"gradient_checkpointing": side == "trl_default", "versions": r["versions"], **summary(r, completions), "batch_split": r["batch_split"],
                      "completion_length_min": r["completion_length_min"],
                      "completion_length_max": r["completion_length_max"], "reward_calls": r["reward_calls"],
                      "cpu_s": r["cpu_s"]}
        v = r["versions"]
        if side == "trl" or "trl" not in results:
            print(f"TRL side: trl {v['trl']}, transformers {v['transformers']}, torch {v['torch']}, "
                  f"accelerate {v['accelerate']}, {r['threads']} threads; per-device batch x accumulation "
                  f"{r['batch_split']}, generation batch {r['generation_batch_size']}, reference model "
                  f"{r['ref_model']}")
    for side, name in (("posttrain", "posttrain"), ("trl", "TRL GRPOTrainer"),
                       ("trl_default", "TRL GRPOTrainer, gradient checkpointing (its default)")):
        if side in out:
            s = out[side]
            rows_out.append([name, f"{s['median_s']:.3f}", f"{s['min_s']:.3f}..{s['max_s']:.3f}",
                             f"{s['completions_per_s']:.1f}", f"{s['response_length']:.1f}"])
    print()
    print(common.markdown_table(["side", "s/step (median)", "min..max", "completions/s", "mean response length"],
                                rows_out))
    if "posttrain" in out and ("trl" in out or "trl_default" in out):
        print()
    if "posttrain" in out and "trl" in out:
        out["speedup"] = out["trl"]["median_s"] / out["posttrain"]["median_s"]
        print(f"posttrain is {out['speedup']:.2f}x faster than TRL per step (the same work: no recomputation)")
    if "posttrain" in out and "trl_default" in out:
        out["speedup_vs_default"] = out["trl_default"]["median_s"] / out["posttrain"]["median_s"]
        print(f"posttrain is {out['speedup_vs_default']:.2f}x faster than TRL with its default gradient "
              "checkpointing")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
