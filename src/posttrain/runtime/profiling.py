"""Step profiling: which RL steps are captured, by which tool, into which files.

verl's `global_profiler.*` and per-role `profiler.*` keys in posttrain's terms
(config.ProfilerConfig; build.make_profiler turns it into plain arguments).
The loop wraps each step in `profiler.step(n)` (n counts from 1, as the
console does); the phases it times (`timing_s/gen`, ...) are marked through
`phase(name)`, which metrics.timed calls, so nothing is threaded through the
loop. Tools:

- torch: `torch.profiler` (CPU, and CUDA when the run is on CUDA) over the
  listed steps: a chrome trace per step (`step{N}.json`), or per run of
  consecutive listed steps with `continuous` (`steps{A}-{B}.json`), in
  save_path; phases are `record_function` ranges. Open it in ui.perfetto.dev.
- npu: the same traces (posttrain runs on CUDA or the CPU, not Ascend NPUs;
  torch_npu's profiler is torch.profiler's API, so they are its nearest kin).
- nsys: Nsight Systems records from outside the process: run
  `nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat posttrain train ...`;
  this calls torch.cuda.profiler.start/stop around the captures and pushes
  NVTX ranges per step and phase. Without CUDA nothing is captured (a warning).
- torch_memory: the CUDA allocator's history is recorded over the captured
  steps and a snapshot is dumped after each (`step{N}.pickle`, for
  pytorch.org/memory_viz); steps null means every step (verl dumps one after
  every step with this tool). Without CUDA nothing is recorded (a warning).

`discrete`: instead of whole steps, each phase of `phases` (the enabled
roles' phases, ROLE_PHASES) is its own capture (`step{N}_{phase}.json`);
without it the whole step is captured and every phase labelled. Ranks: the
profiler runs in the process that runs the loop (build.make_profiler says
which rank that counts as).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

TOOLS = ("torch", "nsys", "torch_memory", "npu")
# verl's roles -> the phases (loop.py's timing_s names) that are their work in posttrain
ROLE_PHASES = {"actor": ("old_log_prob", "update_actor", "update_weights"), "ref": ("ref",),
               "rollout": ("gen", "gen_max"), "critic": ("values", "update_critic")}
# the per-role tool_config settings read (the rest are named unused): tool -> keys
TOOL_SETTINGS = {"torch": ("discrete", "contents"), "npu": ("discrete", "contents"), "nsys": ("discrete",),
                 "torch_memory": ()}
# tool_config.<torch|npu>.contents: what each adds to torch's profiler ("npu": the accelerator's activity)
CONTENTS = ("cpu", "cuda", "npu", "memory", "shapes", "stack", "module")

_active: StepProfiler | None = None  # the profiler of the step running now, for phase()


def phase(name: str):
    """A context marking a phase of the running step (labelled; captured alone
    in discrete mode); nothing when no profiled step is running."""
    return _active.phase(name) if _active is not None else nullcontext()


def rank_selected(rank: int, all_ranks: bool, ranks) -> bool:
    """verl's rule: every rank with all_ranks, else those listed, else rank 0."""
    return bool(all_ranks) or (rank in ranks if ranks else rank == 0)


def warn(message: str) -> None:
    print(f"posttrain: warning: {message}", file=sys.stderr)


class StepProfiler:
    """`with profiler.step(n):` around each RL step. `StepProfiler()` profiles nothing.

    tool: one of TOOLS or None; steps: the step numbers to capture (None: none,
    or every step for torch_memory); save_path: where files go; continuous:
    consecutive listed steps in one capture; discrete: each phase in `phases`
    its own capture; contents: CONTENTS for torch's profiler (empty: CPU and
    CUDA activity); memory_*: torch.cuda.memory._record_memory_history's
    max_entries, context, stacks; cuda: whether the run is on CUDA (None: is it available).
    """

    def __init__(self, tool: str | None = None, steps=None, save_path: str | Path = "profile", *,
                 continuous: bool = False, discrete: bool = False, phases=(), contents=(),
                 memory_max_entries: int = 100_000, memory_context: str | None = "all", memory_stacks: str = "all",
                 cuda: bool | None = None):
        if tool is not None and tool not in TOOLS:
            raise ValueError(f"profiler tool {tool!r} is not one of: {', '.join(TOOLS)}")
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.tool = "torch" if tool == "npu" else tool
        self.steps = None if steps is None else set(steps)
        if self.tool != "torch_memory" and self.steps is None:
            self.tool = None  # no step listed: nothing to do
        if self.tool in ("nsys", "torch_memory") and not self.cuda:
            what = "an Nsight Systems capture" if self.tool == "nsys" else "CUDA memory snapshots"
            how = (" (run `nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat posttrain train "
                   "...` on a GPU)") if self.tool == "nsys" else ""
            warn(f"profiler.tool={tool} takes {what}, and this run is not on CUDA: nothing is profiled{how}")
            self.tool = None
        self.save_path = Path(save_path)
        self.continuous = continuous
        self.discrete = discrete and self.tool != "torch_memory"  # a memory history spans whole steps
        self.phases, self.contents = frozenset(phases), frozenset(contents)
        self.memory = {"max_entries": memory_max_entries, "context": memory_context, "stacks": memory_stacks}
        self.written: list[Path] = []  # the files written, in order
        self._prof = None  # the running capture: a torch.profiler.profile, or True for nsys / torch_memory
        self._name = ""  # its file name (without suffix)
        self._step = self._first = 0  # the step running, the first step of the running capture

    @property
    def enabled(self) -> bool:
        return self.tool is not None

    def profiles(self, step: int) -> bool:
        return self.enabled and (self.steps is None or step in self.steps)

    @contextmanager
    def step(self, n: int):
        """Capture step n if it is listed (the capture may go on into the next listed step: continuous)."""
        global _active
        if not self.profiles(n):
            yield
            return
        self._step = n
        if not self.discrete:
            if self._prof is None:
                self._first = n
                self._start(f"step{n}")
            else:  # a continuous capture goes on
                self._name = f"steps{self._first}-{n}"
        _active = self
        try:
            with self._range(f"step{n}"):
                yield
        except BaseException:
            _active = None
            self._stop()  # a failed step ends its capture (and keeps what was captured)
            raise
        _active = None
        if self.tool == "torch_memory":
            self._dump_memory(n)
        follows = self.steps is None or n + 1 in self.steps
        if not (self.continuous and follows):
            self._stop()

    @contextmanager
    def phase(self, name: str):
        alone = self.discrete and name in self.phases and self._prof is None
        if alone:
            self._start(self._unique(f"step{self._step}_{name}"))
        try:
            with self._range(name):
                yield
        finally:
            if alone:
                self._stop()

    def close(self) -> None:
        """End a capture still running (a continuous one the run stopped inside)."""
        self._stop()

    # ------------------------------------------------------------ the tools

    def _range(self, name: str):
        if self.tool == "torch":
            return torch.profiler.record_function(name)
        if self.tool == "nsys":
            return _nvtx_range(name)
        return nullcontext()

    def _start(self, name: str) -> None:
        self._name = name
        if self.tool == "torch":
            self._prof = torch.profiler.profile(
                activities=self._activities(), record_shapes="shapes" in self.contents,
                profile_memory="memory" in self.contents, with_stack="stack" in self.contents,
                with_modules="module" in self.contents)
            self._prof.start()
        elif self.tool == "nsys":
            torch.cuda.profiler.start()
            self._prof = True
        elif self.tool == "torch_memory":
            torch.cuda.memory._record_memory_history(**self.memory)
            self._prof = True

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        if self.tool == "torch":
            prof.stop()
            self._write(self.save_path / f"{self._name}.json", prof.export_chrome_trace)
        elif self.tool == "nsys":
            torch.cuda.profiler.stop()
        elif self.tool == "torch_memory":
            torch.cuda.memory._record_memory_history(enabled=None)

    def _dump_memory(self, n: int) -> None:
        torch.cuda.synchronize()
        self._write(self.save_path / f"step{n}.pickle", torch.cuda.memory._dump_snapshot)

    def _write(self, path: Path, save) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save(str(path))
        self.written.append(path)
        print(f"posttrain: profile: wrote {path}", file=sys.stderr)

    def _activities(self) -> list:
        A = torch.profiler.ProfilerActivity
        cpu = not self.contents or "cpu" in self.contents
        device = self.cuda and (not self.contents or bool({"cuda", "npu"} & self.contents))
        return [A.CPU] * (cpu or not device) + [A.CUDA] * device

    def _unique(self, name: str) -> str:
        """A phase run twice in a step (dynamic sampling's rounds) gets a second file."""
        taken = {p.stem for p in self.written}
        k, out = 1, name
        while out in taken:
            k += 1
            out = f"{name}_{k}"
        return out


@contextmanager
def _nvtx_range(name: str):
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def tool_settings(tool: str | None, role_tool_configs: dict) -> tuple[dict, list[str]]:
    """Per-role tool_config dicts ({role: {tool: {key: value}}}) -> ({role: the
    chosen tool's settings that are read}, the keys set but unused, as
    profiler.<role>.tool_config.<tool>.<key>)."""
    read, unused = {}, []
    for role, config in role_tool_configs.items():
        for name, settings in (config or {}).items():
            known = TOOL_SETTINGS.get(name, ()) if name == tool else ()
            for key, value in (settings or {}).items():
                if key in known:
                    read.setdefault(role, {})[key] = value
                else:
                    unused.append(f"profiler.{role}.tool_config.{name}.{key}")
    return read, unused
