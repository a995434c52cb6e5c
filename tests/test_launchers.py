"""Launchers without a cluster: the rendered Slurm script and Kubernetes manifests, and the
exact command lines, driven through the production code path against fake `ssh`, `sbatch`,
`squeue`, `sacct`, `scancel`, `srun`, `scontrol` and `kubectl` executables on PATH. The fakes
record their argv and answer like the real ones; the fake Slurm runs the rendered script
with bash (its `srun` starts one task per node), and a fake interpreter in place of the
nodes' Python records what each node's torchrun would have been given.

Real multi-node training runs are in tests/test_multinode.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from core.config import ConfigError
from core.protocol import ResumeSpec
from infra.launchers import (
    STOPPED,
    KubernetesLauncher,
    NodeLaunch,
    kubernetes_name,
    make_launcher,
    node_wrapper,
)
from infra.torchrun import AGENT_MODULE, run_attempt, stop_live_attempts, torchrun_command, worker_env
from tasks import control  # at import: Prefect's logging setup, before caplog's handler
from tests.helpers import REPO, small_config

FAKE_TOOLS = r'''
import json, os, signal, subprocess, sys, time
from pathlib import Path

state = Path(os.environ["FAKE_DIR"])
prog, args = Path(sys.argv[0]).name, sys.argv[1:]
with open(state / "calls.jsonl", "a") as f:
    f.write(json.dumps([prog, *args]) + "\n")


def fake_python():
    """Stands in for the nodes' Python: records what torchrun would have been given."""
    keys = ("PET_RDZV_ENDPOINT", "PET_RDZV_CONF", "PET_LOCAL_ADDR",
            "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "GOODPUT_ATTEMPT", "GLOO_SOCKET_IFNAME",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    record = {"argv": args, "cwd": os.getcwd(), "env": {k: os.environ.get(k) for k in keys}}
    (state / f"node-{os.environ['PET_LOCAL_ADDR']}.json").write_text(json.dumps(record))
    print(f"torchrun on {os.environ['PET_LOCAL_ADDR']}", flush=True)
    sys.exit(int(os.environ.get("FAKE_EXIT", "0")))


def ssh():
    """Runs the remote command here as sshd would, in a session of its own (inside the
    network namespace that owns the host's address when FAKE_SSH_NETNS maps addresses to
    namespaces). As a real client does, it exits at once on SIGTERM or SIGHUP, and the
    remote command gets SIGHUP (with -tt its terminal goes away)."""
    rest = list(args)
    while rest[0].startswith("-"):
        rest = rest[2:] if rest[0] in ("-o", "-i", "-p") else rest[1:]
    host, command = rest[0].rsplit("@", 1)[-1], rest[1]
    if host in os.environ.get("FAKE_SSH_DOWN", "").split(","):  # a host that does not answer
        print(f"ssh: connect to host {host} port 22: No route to host", file=sys.stderr)
        sys.exit(255)
    netns = json.loads(os.environ.get("FAKE_SSH_NETNS", "{}"))
    argv = ["bash", "-c", command]
    if host in netns:
        argv = ["ip", "netns", "exec", netns[host], *argv]
    remote = subprocess.Popen(argv, start_new_session=True)

    def hang_up(signum, frame):
        try:
            os.killpg(remote.pid, signal.SIGHUP)
        except ProcessLookupError:
            pass
        os._exit(255)

    signal.signal(signal.SIGTERM, hang_up)
    signal.signal(signal.SIGHUP, hang_up)
    code = remote.wait()
    sys.exit(code if code >= 0 else 128 - code)


def job_file(job, suffix):
    return state / f"job-{job}.{suffix}"


def sbatch():
    assert args[0] == "--parsable"
    script = Path(args[-1])
    options = dict(line[len("#SBATCH --"):].split("=", 1) for line in script.read_text().splitlines()
                   if line.startswith("#SBATCH --") and "=" in line)
    options.update(arg[2:].split("=", 1) for arg in args[1:-1] if "=" in arg)  # the command line wins
    job = str(len(list(state.glob("job-*.script"))) + 1)
    job_file(job, "script").write_text(script.read_text())
    if os.fork() == 0:  # the job runs in the background, as under slurmd
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # let the caller's pipes close
            os.dup2(devnull, fd)
        if os.environ.get("FAKE_SLURM", "").startswith("hold"):
            if os.environ["FAKE_SLURM"] == "hold-ignoring-sigterm":  # ends only when cancelled
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            job_file(job, "pid").write_text(str(os.getpid()))
            time.sleep(300)
            os._exit(0)
        nodes = int(options["nodes"])
        env = {**os.environ, "SLURM_JOB_ID": job, "SLURM_NNODES": str(nodes),
               "SLURM_JOB_NODELIST": ",".join(f"fakenode{i}" for i in range(nodes))}
        with open(options["output"].replace("%j", job), "w") as out:
            proc = subprocess.Popen(["bash", str(script)], stdout=out, stderr=subprocess.STDOUT, env=env)
            job_file(job, "pid").write_text(str(proc.pid))
            code = proc.wait()
        job_file(job, "exit").write_text(str(code))
        os._exit(0)
    print(f"{job};fakecluster")


def alive(job):
    try:
        os.kill(int(job_file(job, "pid").read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


def squeue():
    job = args[args.index("-j") + 1]
    if os.environ.get("FAKE_SQUEUE_FLAKY"):
        count = job_file(job, "squeue-calls")
        n = int(count.read_text()) if count.exists() else 0
        count.write_text(str(n + 1))
        if n % 2:
            sys.exit("slurm_load_jobs error: Socket timed out on send/recv operation")
    queried = job_file(job, "queried")
    if job_file(job, "exit").exists() or job_file(job, "cancelled").exists() or not alive(job):
        return
    reason = os.environ.get("FAKE_PENDING_REASON", "None")
    print("RUNNING|None" if queried.exists() else f"PENDING|{reason}")  # queued at the first look
    queried.touch()


def job_state(job):
    """(state, exit code) of an ended job as slurmctld records it; None while it runs."""
    if job_file(job, "cancelled").exists():
        return "CANCELLED", "0:15"
    if job_file(job, "exit").exists():
        code = int(job_file(job, "exit").read_text())
        return ("COMPLETED", "0:0") if code == 0 else ("FAILED", f"{code}:0")
    if not alive(job):
        return "FAILED", "0:15"
    return None


def sacct():
    """As on a cluster without slurmdbd: only `sacct -c` (the job-completion file) answers."""
    if "-c" not in args:
        sys.exit("Slurm accounting storage is disabled")
    job = args[args.index("-j") + 1]
    ended = job_state(job)
    if ended:
        print(f"{job}|{ended[0]}|{ended[1]}")


def scancel():
    job = args[-1]
    if args[0] != "--signal=TERM":  # a cancel; with --signal the job only gets the signal
        job_file(job, "cancelled").touch()
    os.killpg(int(job_file(job, "pid").read_text()), signal.SIGKILL if args[0] != "--signal=TERM"
              else signal.SIGTERM)


def srun():
    first = next(i for i, a in enumerate(args) if not a.startswith("--"))
    options, command = args[:first], args[first:]
    nodes = int(next(o for o in options if o.startswith("--nodes=")).split("=")[1])
    procs = [subprocess.Popen(command, env={**os.environ, "SLURM_NODEID": str(i),
                                            "SLURMD_NODENAME": f"fakenode{i}"})
             for i in range(nodes)]
    codes = [p.wait() for p in procs]
    sys.exit(next((c for c in codes if c), 0))


def scontrol():
    if args[:2] == ["show", "hostnames"]:
        print("\n".join(args[2].split(",")))
        return
    assert args[:3] == ["show", "job", "-o"], args
    job = args[3]
    if os.environ.get("FAKE_SCONTROL_FORGETS"):  # the record is gone (MinJobAge passed)
        sys.exit("slurm_load_jobs error: Invalid job id specified")
    state, code = job_state(job) or ("RUNNING", "0:0")
    print(f"JobId={job} JobName=fake UserId=root(0) JobState={state} Reason=None ExitCode={code}")


def kubectl():
    verb = args[0]
    if verb == "apply":
        manifest = yaml_load(Path(args[args.index("-f") + 1]))
        (state / "applied.json").write_text(json.dumps(manifest))
        print(f"{manifest['kind'].lower()}/{manifest['metadata']['name']} created")
    elif verb == "get" and args[1] == "pods":
        print((state / "k8s-pods.json").read_text())
    elif verb == "get":
        statuses = json.loads((state / "k8s-status.json").read_text())
        print(json.dumps({"status": statuses[0]}))
        if len(statuses) > 1:
            (state / "k8s-status.json").write_text(json.dumps(statuses[1:]))
    elif verb == "logs":  # the whole log, then the stream ends (as when the pods end)
        lines = (state / "k8s-logs.txt").read_text().splitlines()
        stamped = [(f"2026-11-23T00:00:{1 + i // 2:02d}.{25 * (1 + i % 2)}Z", line)
                   for i, line in enumerate(lines)]  # two lines a second
        since = next((a.split("=", 1)[1] for a in args if a.startswith("--since-time=")), None)
        if since:  # the API server keeps whole seconds of it
            stamped = [(t, line) for t, line in stamped if t[:19] >= since[:19]]
        drop = state / "k8s-logs-drop-after"
        if drop.exists():  # this stream breaks early
            stamped = stamped[:int(drop.read_text())]
            drop.unlink()
        for t, line in stamped:
            print(f"{t} {line}" if "--timestamps" in args else line)
    elif verb == "delete":
        print("deleted")


def yaml_load(path):
    import yaml
    return yaml.safe_load(path.read_text())


{"python": fake_python, "ssh": ssh, "sbatch": sbatch, "squeue": squeue, "sacct": sacct,
 "scancel": scancel, "srun": srun, "scontrol": scontrol, "kubectl": kubectl}[prog]()
'''

TOOLS = ("python", "ssh", "sbatch", "squeue", "sacct", "scancel", "srun", "scontrol", "kubectl")


@pytest.fixture
def fakes(tmp_path, monkeypatch) -> Path:
    """The fake executables first on PATH; returns the directory where they keep state."""
    bin_dir, state = tmp_path / "bin", tmp_path / "fake-state"
    bin_dir.mkdir()
    state.mkdir()
    tool = bin_dir / "fake_tools.py"
    tool.write_text(f"#!{sys.executable}\n{FAKE_TOOLS}")
    tool.chmod(0o755)
    for name in TOOLS:
        (bin_dir / name).symlink_to(tool)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DIR", str(state))
    return state


def calls(state: Path, prog: str) -> list[list[str]]:
    lines = (state / "calls.jsonl").read_text().splitlines()
    return [call[1:] for call in map(json.loads, lines) if call[0] == prog]


def node_records(state: Path) -> dict[str, dict]:
    return {p.stem.removeprefix("node-"): json.loads(p.read_text()) for p in state.glob("node-*.json")}


def launch_config(tmp_path, fakes: Path, *overrides: str):
    """A 2-node run whose nodes' Python is the recording fake."""
    return small_config(tmp_path, "parallelism.nnodes=2", "parallelism.nproc_per_node=1",
                        f"launch.python={fakes.parent / 'bin' / 'python'}", "launch.poll_s=0.05",
                        f"launch.workdir={tmp_path}", *overrides)


def spec_of(config, attempt: str = "t1") -> NodeLaunch:
    command = torchrun_command(config, config.run_dir / "config.yaml",
                               Path(config.data.data_dir) / "set", attempt)
    return NodeLaunch.of(config, command, worker_env(config, attempt),
                         config.run_dir.attempt(attempt), f"goodput-test-{attempt}")


def attempt(config, attempt_id: str = "t1", lines: list[str] | None = None):
    log = lines.append if lines is not None else (lambda line: None)
    return run_attempt(config, config.run_dir / "config.yaml", Path(config.data.data_dir) / "set",
                       attempt_id, log, poll_s=0.05)


def assert_node_settings(records: dict[str, dict], endpoint: str, addresses: list[str],
                         attempt_id: str = "t1") -> None:
    """What each node's torchrun got: one host of the rendezvous, its own address, the log prefix."""
    assert sorted(records) == sorted(addresses)
    for i, addr in enumerate(addresses):
        env = records[addr]["env"]
        assert env["PET_RDZV_ENDPOINT"] == endpoint
        assert env["PET_RDZV_CONF"] == f"is_host={int(i == 0)}"
        assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == f"[node{i} rank${{rank}}] "
        assert env["GOODPUT_ATTEMPT"] == attempt_id
        assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        argv = records[addr]["argv"]
        assert argv[:4] == ["-m", AGENT_MODULE, "--nnodes=2", "--nproc-per-node=1"]
        assert f"--rdzv-id=test-{attempt_id}" in argv and "--max-restarts=0" in argv


# -- the torchrun command ------------------------------------------------------------------------

def test_torchrun_command_is_the_same_for_every_node(tmp_path):
    config = small_config(tmp_path, "parallelism.nnodes=3", "parallelism.nproc_per_node=4")
    command = torchrun_command(config, Path("run.yaml"), Path("data"), "abc-1", ResumeSpec.scratch())
    assert command[:9] == [sys.executable, "-m", AGENT_MODULE, "--nnodes=3",
                           "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-id=test-abc-1",
                           "--max-restarts=0", "--tee=3"]
    attempt_dir = (tmp_path / "runs" / "test" / "attempts" / "attempt-abc-1").resolve()
    assert command[9] == f"--log-dir={attempt_dir / 'torchrun'}"
    assert command[10:] == ["-m", "training", "--config", str(Path("run.yaml").resolve()),
                            "--dataset", str(Path("data").resolve()), "--resume", "none"]
    assert not any(a.startswith(("--rdzv-endpoint", "--node-rank", "--local-addr")) for a in command)


def test_node_wrapper_derives_each_nodes_settings(tmp_path):
    out = tmp_path / "env"
    for node, addr in (("0", "10.0.0.1"), ("1", "10.0.0.2")):
        subprocess.run([*node_wrapper(node, addr), "bash", "-c",
                        f'echo "$PET_RDZV_CONF|$PET_LOCAL_ADDR|$TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE" >> {out}'],
                       check=True)
    assert out.read_text().splitlines() == ["is_host=1|10.0.0.1|[node0 rank${rank}] ",
                                            "is_host=0|10.0.0.2|[node1 rank${rank}] "]


def test_worker_environment(tmp_path):
    config = small_config(tmp_path, "launch.network_interface=ib0", "launch.env={NCCL_DEBUG: WARN}")
    env = worker_env(config, "a-1")
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "ib0"
    assert env["NCCL_DEBUG"] == "WARN" and env["GOODPUT_ATTEMPT"] == "a-1"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "PATH" not in env  # each node keeps its own environment


_FAULTS_OF_A_STEP = """
import resource, torch
from training.allocator import keep_freed_memory
from training.model import ModelArgs, Transformer
kept = keep_freed_memory()
model = Transformer(ModelArgs(vocab_size=1024, dim=128, n_layers=2, n_heads=4, max_seq_len=128))
optimizer = torch.optim.AdamW(model.parameters())
tokens = torch.randint(0, 1024, (8, 129))
faults = []
for step in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# The fewest of the steps after the first two: now and then one step faults in a few hundred
# pages for something else (a lazily built table), never the thousands of a remapped step.
print(kept, min(faults[2:]))
"""


def test_the_trainer_keeps_freed_memory_for_the_next_step():
    """python -m training fixes glibc's malloc thresholds (training.allocator): a training
    step reuses the pages the step before freed instead of faulting thousands in anew;
    MALLOC_*_THRESHOLD_ in the environment (launch.env) is left to glibc."""
    import subprocess
    import sys

    def a_later_step(env: dict[str, str]) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", _FAULTS_OF_A_STEP], capture_output=True, text=True,
                             cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                             check=True).stdout.split()
        return out[0], int(out[1])

    kept, faults = a_later_step({})
    # About 100 on a quiet machine, 256 once under CI's load; the pages faulted in anew are
    # ten times that and more (below).
    assert kept == "True" and faults < 600, faults
    # glibc's default, as the environment names it: every large block mapped anew
    kept, faults = a_later_step({"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert kept == "False" and faults > 2000, faults


# -- ssh ---------------------------------------------------------------------------------------------

def test_ssh_runs_one_torchrun_per_host(tmp_path, fakes):
    config = launch_config(tmp_path, fakes, "launch.kind=ssh", "launch.hosts=[alice@10.1.0.1, 10.1.0.2]",
                           "launch.rdzv_port=29555", "launch.network_interface=eth7",
                           "launch.ssh.options=[-i, /keys/id, -o, BatchMode=yes]")
    lines: list[str] = []
    result = attempt(config, lines=lines)
    assert result.failure_class == "done" and result.exit_code == 0
    ssh = sorted(calls(fakes, "ssh"), key=lambda c: c[5].endswith("2"))  # nodes start concurrently
    assert [c[:6] for c in ssh] == [["-tt", "-i", "/keys/id", "-o", "BatchMode=yes", "alice@10.1.0.1"],
                                    ["-tt", "-i", "/keys/id", "-o", "BatchMode=yes", "10.1.0.2"]]
    remote = shlex.split(ssh[0][6])
    assert remote[:3] == ["cd", str(tmp_path), "&&"]
    records = node_records(fakes)
    assert_node_settings(records, "10.1.0.1:29555", ["10.1.0.1", "10.1.0.2"])
    assert all(r["env"]["GLOO_SOCKET_IFNAME"] == "eth7" and r["cwd"] == str(tmp_path)
               for r in records.values())
    assert "torchrun on 10.1.0.1" in lines and "torchrun on 10.1.0.2" in lines


def test_ssh_config_needs_one_host_per_node(tmp_path):
    with pytest.raises(Exception, match="one host per node: 1 launch.hosts for parallelism.nnodes=2"):
        small_config(tmp_path, "parallelism.nnodes=2", "launch.kind=ssh", "launch.hosts=[a]")


# -- slurm -------------------------------------------------------------------------------------------

SLURM = ("launch.kind=slurm", "launch.slurm.partition=gpu", "launch.slurm.account=proj7",
         "launch.slurm.time=02:00:00", "launch.slurm.gpus_per_node=1", "launch.slurm.cpus_per_node=96",
         "launch.slurm.extra_sbatch=[--exclusive, --qos=high]",
         "launch.slurm.setup=[export FAKE_SETUP_RAN=1]")


def test_slurm_script(tmp_path, fakes):
    config = launch_config(tmp_path, fakes, *SLURM)
    spec = spec_of(config)
    script = make_launcher(spec).script()
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert [line for line in lines if line.startswith("#SBATCH")] == [
        "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --time=02:00:00",
        "#SBATCH --no-requeue", f"#SBATCH --signal=TERM@{int(config.faults.emergency_save_s) + 60}",
        "#SBATCH --partition=gpu", "#SBATCH --account=proj7",
        "#SBATCH --gpus-per-node=1", "#SBATCH --cpus-per-task=96", "#SBATCH --exclusive",
        "#SBATCH --qos=high"]
    # The workers are told before the time limit, with time for an emergency checkpoint; a
    # limit too short for that leaves it at Slurm's own signal at the limit.
    short = make_launcher(spec_of(launch_config(tmp_path, fakes, *SLURM, "launch.slurm.time=0:30")))
    assert not any("--signal" in line for line in short.script().splitlines())
    assert f"cd {tmp_path}" in lines and "export FAKE_SETUP_RAN=1" in lines
    assert "export GOODPUT_ATTEMPT=t1" in lines
    assert 'export PET_RDZV_ENDPOINT="$head_node:29400"' in lines
    # Setup lines run before `set -u` (conda activate and module load fail under it).
    assert lines.index("set -eo pipefail") < lines.index("export FAKE_SETUP_RAN=1") \
        < lines.index("set -u  # after the setup lines: conda activate and module load fail under -u")
    srun = shlex.split(lines[-1])
    assert srun[:5] == ["srun", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=1",
                        "--cpus-per-task=96"]
    assert srun[5:9] == node_wrapper("$SLURM_NODEID", '"$SLURMD_NODENAME"')
    assert srun[9:] == spec.command
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid shell


def test_slurm_job_is_submitted_watched_and_its_output_streamed(tmp_path, fakes):
    """Also where the run directory's path holds a space and a '#' (neither fits in an
    #SBATCH line: the output file is named on sbatch's command line)."""
    config = launch_config(tmp_path / "my runs#2", fakes, *SLURM)
    lines: list[str] = []
    result = attempt(config, lines=lines)
    assert result.failure_class == "done" and result.exit_code == 0
    attempt_dir = config.run_dir.attempt("t1")
    assert calls(fakes, "sbatch") == [["--parsable", "--job-name=goodput-test-t1",
                                       f"--output={attempt_dir.resolve()}/slurm-%j.out",
                                       str(attempt_dir / "sbatch.sh")]]
    queries = calls(fakes, "squeue")
    assert len(queries) >= 2 and set(map(tuple, queries)) == {("-h", "-j", "1", "-o", "%T|%r")}
    # Gone from the queue (real squeue then prints nothing): the controller's record says how.
    assert calls(fakes, "scontrol")[-1] == ["show", "job", "-o", "1"]
    assert calls(fakes, "sacct") == []
    assert calls(fakes, "scancel") == []  # it finished by itself
    assert calls(fakes, "srun")[0][:3] == ["--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=1"]
    # The script ran: each node's torchrun got the head node as endpoint and its own name.
    assert_node_settings(node_records(fakes), "fakenode0:29400", ["fakenode0", "fakenode1"])
    assert {"torchrun on fakenode0", "torchrun on fakenode1"} <= set(lines)


def test_slurm_job_failure_is_classified(tmp_path, fakes, monkeypatch):
    monkeypatch.setenv("FAKE_EXIT", "75")
    config = launch_config(tmp_path, fakes, *SLURM)
    result = attempt(config)
    assert result.exit_code == 75 and result.failure_class == "retryable"


def test_a_job_the_controller_forgot_is_read_from_the_job_completion_file(tmp_path, fakes,
                                                                           monkeypatch):
    """Past MinJobAge, `scontrol show job` no longer knows the job; without slurmdbd plain
    sacct fails ("accounting storage is disabled"): `sacct -c` has the verdict."""
    monkeypatch.setenv("FAKE_EXIT", "75")
    monkeypatch.setenv("FAKE_SCONTROL_FORGETS", "1")
    config = launch_config(tmp_path, fakes, *SLURM)
    result = attempt(config)
    assert result.exit_code == 75 and result.failure_class == "retryable"
    tries = calls(fakes, "sacct")[-2:]
    assert [call[:2] for call in tries] == [["-X", "-j"], ["-c", "-j"]]


def test_slurm_job_gets_sigterm_when_the_attempt_stops(tmp_path, fakes, monkeypatch):
    """Stopping sends SIGTERM to the job's steps (the workers' cue for an emergency
    checkpoint) and waits for the job to leave the queue; it ends by itself here."""
    monkeypatch.setenv("FAKE_SLURM", "hold")  # the job runs until signalled
    config = launch_config(tmp_path, fakes, *SLURM, "run.startup_timeout_s=0.5")
    lines: list[str] = []
    result = attempt(config, lines=lines)
    assert result.failure_class == "hang" and result.exit_code == STOPPED  # never beat: hung
    assert calls(fakes, "scancel") == [["--signal=TERM", "1"]]
    assert calls(fakes, "squeue")[-1] == ["-h", "-j", "1", "-o", "%T|%r"]  # seen gone before returning
    assert not [line for line in lines if line.startswith("cancelled Slurm job")]


def test_why_a_slurm_job_waits_is_logged_and_a_job_cancelled_before_it_ran_is_not_retried(
        tmp_path, fakes, monkeypatch):
    """A pending job says why it waits (a drained node, limits); cancelled outside goodput
    before any worker ran, it is no crash to retry."""
    from core.protocol import FailureClass, write_exit_record
    from infra.torchrun import classify

    monkeypatch.setenv("FAKE_PENDING_REASON", "ReqNodeNotAvail, UnavailableNodes:n2")
    lines: list[str] = []
    result = attempt(launch_config(tmp_path, fakes, *SLURM), lines=lines)
    assert result.failure_class == "done"
    assert lines.count("Slurm job 1 is pending: ReqNodeNotAvail, UnavailableNodes:n2") == 1

    cancelled = classify(tmp_path, "c-1", 143, hung=False, wall=1.0, scheduler_state="CANCELLED")
    assert cancelled.failure_class == FailureClass.CANCELLED
    assert "administrator) before any worker ran: not retried" in cancelled.reason
    # Cancelled while training (scancel: preemption ends a job PREEMPTED): the workers saved
    # an emergency checkpoint on its SIGTERM, and the run stops there. It was retried, as a
    # preemption: `scancel` could not stop a run.
    write_exit_record(tmp_path, "c-2", 0, FailureClass.RETRYABLE, "preempted: emergency checkpoint", 9)
    scancelled = classify(tmp_path, "c-2", 143, hung=False, wall=1.0, scheduler_state="CANCELLED")
    assert scancelled.failure_class == FailureClass.CANCELLED
    assert "the workers saving an emergency checkpoint first: not retried" in scancelled.reason
    assert classify(tmp_path, "c-2", 143, hung=False, wall=1.0,
                    scheduler_state="PREEMPTED").failure_class == FailureClass.RETRYABLE


def test_a_slurm_job_still_queued_is_cancelled_at_once(tmp_path, fakes, monkeypatch):
    monkeypatch.setenv("FAKE_SLURM", "hold")
    config = launch_config(tmp_path, fakes, *SLURM)
    launcher = make_launcher(spec_of(config))
    launcher.start(lambda line: None)
    assert not launcher.started  # never polled: as far as we know, still pending
    assert launcher.stop(grace_s=60) == STOPPED
    assert calls(fakes, "scancel") == [["1"]]  # no SIGTERM first, no 60 s wait


def test_slurm_job_ignoring_sigterm_is_cancelled_after_the_grace(tmp_path, fakes, monkeypatch):
    monkeypatch.setenv("FAKE_SLURM", "hold-ignoring-sigterm")
    config = launch_config(tmp_path, fakes, *SLURM, "run.startup_timeout_s=0.5")
    lines: list[str] = []
    result = attempt(config, lines=lines)
    assert result.failure_class == "hang" and result.exit_code == STOPPED
    assert calls(fakes, "scancel") == [["--signal=TERM", "1"], ["1"]]
    assert "cancelled Slurm job 1" in lines


def test_another_thread_stops_a_live_attempt(tmp_path, fakes, monkeypatch):
    """What a cancelled flow run does (tasks.control.no_orphan_workers): its main thread stops
    the attempt that the launch task's thread supervises, whatever the launcher."""
    import threading
    import time

    monkeypatch.setenv("FAKE_SLURM", "hold")
    config = launch_config(tmp_path, fakes, *SLURM)
    results = []
    supervisor = threading.Thread(target=lambda: results.append(attempt(config)))
    supervisor.start()
    deadline = time.monotonic() + 30
    while not (fakes / "job-1.queried").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # polls every 0.05 s: squeue has said RUNNING by now
    for thread in stop_live_attempts():
        thread.join(timeout=30)
    supervisor.join(timeout=30)
    assert not supervisor.is_alive()
    [result] = results
    # A cancellation ends the attempt as cancelled, never as a failure to retry.
    assert result.exit_code == STOPPED and result.failure_class == "cancelled"
    assert calls(fakes, "scancel") == [["--signal=TERM", "1"]]  # stopped once, not twice
    assert stop_live_attempts() == []  # nothing left to stop


def test_a_stop_whose_securing_outlasts_its_time_names_the_checkpoints_left(monkeypatch, caplog):
    """A cancel's SIGTERM: the emergency checkpoint is validated and uploaded within
    SIGTERM_BUDGET_S. Past it the next run secures it, and the log says so, naming the
    steps; on a loaded machine the log had ended with the cancel alone."""
    import logging
    import signal
    import threading

    from prefect.exceptions import TerminationSignal

    monkeypatch.setattr(control, "SIGTERM_BUDGET_S", 3.0)
    release = threading.Event()
    with caplog.at_level(logging.WARNING, logger="tasks.control"):
        with pytest.raises(TerminationSignal):
            with control.no_orphan_workers(lambda: release.wait(30), left_unsecured=lambda: [25]):
                raise TerminationSignal(signal.SIGTERM)
    release.set()
    [said] = [r.getMessage() for r in caplog.records if "ran out" in r.getMessage()]
    assert "checkpoint(s) 25 were validated and uploaded" in said and "the next run" in said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tasks.control"):
        with pytest.raises(TerminationSignal):  # secured in time: nothing to say
            with control.no_orphan_workers(lambda: None, left_unsecured=lambda: [25]):
                raise TerminationSignal(signal.SIGTERM)
    assert not [r for r in caplog.records if "ran out" in r.getMessage()]


def test_a_task_that_never_started_is_a_warning_without_prefect_s_advice():
    """After a server restart mid-training, tasks whose engine could not reach the API end
    Pending, and Prefect's task engine logged each at ERROR with advice to wait for futures
    (example code included), which the flow does. The record keeps its first line, as a
    warning; any other task's end is left as it is."""
    import logging

    logger = logging.getLogger("prefect.task_runs")
    assert any(isinstance(f, control.TasksThatNeverStarted) for f in logger.filters)
    seen = []
    for message in ("Finished in state Pending()\nPlease wait for all submitted tasks to complete "
                    "before exiting your flow by calling `.wait()` ...", "Finished in state Failed('boom')"):
        record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, message, (), None)
        assert control.TasksThatNeverStarted().filter(record)
        seen.append(record)
    pending, failed = seen
    assert (pending.levelname, pending.getMessage()) == (
        "WARNING", "Finished in state Pending(): the task never started (its engine could not "
                   "reach the API); the flow says what is redone")
    assert (failed.levelname, failed.getMessage()) == ("ERROR", "Finished in state Failed('boom')")


def test_a_failing_scheduler_query_is_retried_at_the_next_poll(tmp_path, fakes, monkeypatch):
    """squeue failing now and then (slurmctld busy) does not end a healthy attempt."""
    monkeypatch.setenv("FAKE_SQUEUE_FLAKY", "1")  # every other squeue fails
    config = launch_config(tmp_path, fakes, *SLURM)
    lines: list[str] = []
    result = attempt(config, lines=lines)
    assert result.failure_class == "done" and result.exit_code == 0
    # Counted from the failed query's start: the fake squeue's own run (a Python start, over
    # 0.5 s on a loaded machine) may round it up to a second, never more than a few.
    failed = [int(m.group(1)) for line in lines if "Socket timed out" in line
              for m in [re.search(r"scheduler query failed \((\d+)s so far", line)] if m]
    assert failed and max(failed) <= 5, lines[-20:]


# -- kubernetes --------------------------------------------------------------------------------------

K8S = ("launch.kind=kubernetes", "launch.kubernetes.image=registry.example/goodput:1.0",
       "launch.kubernetes.namespace=ml", "launch.kubernetes.gpus_per_node=1",
       "launch.kubernetes.volume_claim=shared-runs")


def k8s_config(tmp_path, fakes, *overrides: str):
    """A 2-node Kubernetes run whose run and data directories are on the shared volume."""
    return launch_config(tmp_path, fakes, *K8S, f"launch.kubernetes.mount_path={tmp_path}",
                         *overrides)


def run_container(container: dict, fakes: Path, env: dict[str, str]) -> None:
    """Run a manifest's container command here, as the kubelet would in the pod."""
    values = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    command = [arg.replace("$$(", "$(") for arg in container["command"]]  # Kubernetes' own expansion
    subprocess.run(command, env={**os.environ, **values, **env}, check=True, cwd=fakes)


def test_jobset_manifest(tmp_path, fakes):
    config = k8s_config(tmp_path, fakes)
    spec = spec_of(config)
    manifest = KubernetesLauncher(spec).manifest()
    assert manifest["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and manifest["kind"] == "JobSet"
    assert manifest["metadata"] == {"name": "goodput-test-t1", "namespace": "ml",
                                    "labels": {"goodput.dev/job": "goodput-test-t1"}}
    assert manifest["spec"]["failurePolicy"] == {"maxRestarts": 0}
    [replicated] = manifest["spec"]["replicatedJobs"]
    assert replicated["name"] == "node" and replicated["replicas"] == 2
    job = replicated["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["backoffLimit"]) == (1, 1, 0)
    pod = job["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == "registry.example/goodput:1.0"
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"},
                                         {"name": "shared", "mountPath": str(tmp_path)}]
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
                              {"name": "shared", "persistentVolumeClaim": {"claimName": "shared-runs"}}]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] == 90  # faults.emergency_save_s (60) and more
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['jobset.sigs.k8s.io/job-index']"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["PET_RDZV_ENDPOINT"]["value"] == "goodput-test-t1-node-0-0.goodput-test-t1:29400"
    assert container["command"][-len(spec.command):] == spec.command
    # What the pods' torchrun get, with the index and IP the cluster would provide.
    for i in range(2):
        run_container(container, fakes, {"NODE_INDEX": str(i), "POD_IP": f"10.9.0.{i + 1}"})
    assert_node_settings(node_records(fakes), "goodput-test-t1-node-0-0.goodput-test-t1:29400",
                         ["10.9.0.1", "10.9.0.2"])


def test_kubernetes_pods_land_on_a_gpu_pool_and_share_the_run(tmp_path, fakes):
    """Pods for a tainted GPU pool (tolerations, nodeSelector) with CPU and memory requests;
    a run whose directories the pods cannot see is refused before anything is applied."""
    config = k8s_config(tmp_path, fakes, "launch.kubernetes.cpu=96", "launch.kubernetes.memory=1800Gi",
                        "launch.kubernetes.node_selector={pool: h100}",
                        "launch.kubernetes.tolerations=[{key: nvidia.com/gpu, operator: Exists, "
                        "effect: NoSchedule}]")
    manifest = KubernetesLauncher(spec_of(config)).manifest()
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "h100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["containers"][0]["resources"] == {
        "limits": {"nvidia.com/gpu": 1, "cpu": 96, "memory": "1800Gi"},
        "requests": {"cpu": 96, "memory": "1800Gi"}}
    with pytest.raises(ConfigError, match="needs launch.kubernetes.volume_claim"):
        small_config(tmp_path, "launch.kind=kubernetes", "launch.kubernetes.image=x")
    # Where the directories lie is checked where the pods are made, before anything is applied.
    elsewhere = make_launcher(spec_of(launch_config(tmp_path, fakes, *K8S)))  # mount_path /goodput
    with pytest.raises(ConfigError, match=r"the run directory \(run.runs_dir\) .* is not under "
                                          r"launch.kubernetes.mount_path=/goodput, the volume the "
                                          r"training pods see"):
        elsewhere.start(print)
    assert not (fakes / "calls.jsonl").exists() or calls(fakes, "kubectl") == []


def test_kubernetes_names_of_two_attempts_differ_when_cut():
    long = [kubernetes_name(f"goodput-llama3-8b-fineweb-edu-v2-0f3c2a1-{n}") for n in (1, 2)]
    assert long[0] != long[1]
    import re
    assert all(len(n) <= 40 and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", n) for n in long)
    assert kubernetes_name("goodput-Run_1-t1") == "goodput-run-1-t1"  # short: only cleaned


def test_pytorchjob_manifest(tmp_path, fakes):
    config = k8s_config(tmp_path, fakes, "launch.kubernetes.kind=pytorchjob",
                           "parallelism.nnodes=3")
    manifest = KubernetesLauncher(spec_of(config)).manifest()
    assert manifest["apiVersion"] == "kubeflow.org/v1" and manifest["kind"] == "PyTorchJob"
    assert manifest["spec"]["runPolicy"] == {"backoffLimit": 0, "cleanPodPolicy": "All"}
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    assert {k: (v["replicas"], v["restartPolicy"]) for k, v in replicas.items()} == \
        {"Master": (1, "Never"), "Worker": (2, "Never")}
    [container] = replicas["Master"]["template"]["spec"]["containers"]
    assert container["name"] == "pytorch"  # the operator finds the trainer by this name
    for rank in range(3):  # the operator's RANK is the node rank
        run_container(container, fakes, {"RANK": str(rank), "POD_IP": f"10.8.0.{rank + 1}"})
    records = node_records(fakes)
    assert [records[f"10.8.0.{r + 1}"]["env"]["PET_RDZV_CONF"] for r in range(3)] == \
        ["is_host=1", "is_host=0", "is_host=0"]
    assert {r["env"]["PET_RDZV_ENDPOINT"] for r in records.values()} == {"goodput-test-t1-master-0:29400"}


def set_k8s(fakes: Path, statuses: list[dict], pods: list[int] = (), logs: str = "") -> None:
    (fakes / "k8s-status.json").write_text(json.dumps(statuses))
    (fakes / "k8s-pods.json").write_text(json.dumps({"items": [
        {"status": {"containerStatuses": [{"state": {"terminated": {"exitCode": c}}}]}} for c in pods]}))
    (fakes / "k8s-logs.txt").write_text(logs)


RUNNING = {"replicatedJobsStatus": [{"name": "node", "ready": 2, "active": 2}]}


def test_kubernetes_job_is_applied_watched_streamed_and_deleted(tmp_path, fakes):
    config = k8s_config(tmp_path, fakes)
    set_k8s(fakes, [{}, RUNNING, RUNNING, {"conditions": [{"type": "Completed", "status": "True"}]}],
            logs="[node0 rank0] [train] done: step 30, loss 1.0\n")
    lines: list[str] = []
    result = attempt(config, lines=lines)
    assert result.failure_class == "done" and result.exit_code == 0
    manifest = config.run_dir.attempt("t1") / "kubernetes.yaml"
    assert yaml.safe_load(manifest.read_text())["kind"] == "JobSet"
    kubectl = calls(fakes, "kubectl")
    get = ["get", "jobset", "goodput-test-t1", "-n", "ml", "-o", "json"]
    assert [c for c in kubectl if c[0] != "logs"] == [
        ["apply", "-f", str(manifest)], get, get, get, get,
        ["delete", "jobset", "goodput-test-t1", "-n", "ml", "--ignore-not-found",
         "--cascade=foreground", "--wait=true", "--timeout=150s"]]
    # Logs are followed once every pod is ready.
    assert [c for c in kubectl if c[0] == "logs"] == [
        ["logs", "-n", "ml", "-l", "goodput.dev/job=goodput-test-t1", "-f", "--tail=-1",
         "--timestamps", "--all-containers=true", "--max-log-requests=2"]]
    assert "[node0 rank0] [train] done: step 30, loss 1.0" in lines


def test_a_kubernetes_log_stream_that_ends_early_is_followed_again_without_repeats(
        tmp_path, fakes, monkeypatch):
    """The kubelet closes a log stream idle for 4 hours by default, and an API server restart
    ends one: while the job runs, the stream is followed again from the last line passed on
    (by timestamp: the server keeps whole seconds, the lines of that second are not repeated)."""
    monkeypatch.setattr(KubernetesLauncher, "LOG_REFOLLOW_S", 0.0)
    config = k8s_config(tmp_path, fakes)
    logged = [f"[node0 rank0] [train] step {i}" for i in range(1, 6)]
    set_k8s(fakes, [{}, *[RUNNING] * 20, {"conditions": [{"type": "Completed", "status": "True"}]}],
            logs="".join(line + "\n" for line in logged))
    (fakes / "k8s-logs-drop-after").write_text("2")
    lines: list[str] = []
    result = attempt(config, lines=lines)
    assert result.failure_class == "done"
    assert [line for line in lines if "[train] step" in line] == logged  # each once, in order
    follows = [c for c in calls(fakes, "kubectl") if c[0] == "logs"]
    assert len(follows) >= 3  # broken, followed again, and again while the job still ran
    assert not any(a.startswith("--since-time") for a in follows[0])
    assert "--since-time=2026-11-23T00:00:01.50Z" in follows[1]
    assert "--since-time=2026-11-23T00:00:03.25Z" in follows[-1]


def test_kubernetes_failure_reports_the_pods_exit_code(tmp_path, fakes):
    config = k8s_config(tmp_path, fakes, "launch.kubernetes.kind=pytorchjob")
    set_k8s(fakes, [{"conditions": [{"type": "Running", "status": "True"}]},
                    {"conditions": [{"type": "Failed", "status": "True"}]}], pods=[0, 75])
    result = attempt(config)
    assert result.exit_code == 75 and result.failure_class == "retryable"
    kubectl = [c for c in calls(fakes, "kubectl") if c[0] != "logs"]
    assert kubectl[-2] == ["get", "pods", "-n", "ml", "-l", "goodput.dev/job=goodput-test-t1",
                           "-o", "json"]
    assert kubectl[-1][:3] == ["delete", "pytorchjob", "goodput-test-t1"]


def test_kubernetes_job_is_deleted_when_the_attempt_stops(tmp_path, fakes):
    config = k8s_config(tmp_path, fakes, "run.startup_timeout_s=0.5")
    set_k8s(fakes, [RUNNING])  # running forever, never a heartbeat
    result = attempt(config)
    assert result.failure_class == "hang" and result.exit_code == STOPPED
    assert calls(fakes, "kubectl")[-1][:3] == ["delete", "jobset", "goodput-test-t1"]


def test_stopping_kills_a_frozen_worker_in_its_own_session(tmp_path):
    """As torchrun does, the 'node' starts its worker in a new session; the worker is frozen
    (SIGSTOP) so SIGTERM never reaches it: it must still be gone after stop()."""
    import signal
    import time

    from infra.launchers import descendants, kill_process_groups

    pid_file = tmp_path / "worker.pid"
    node_code = (
        "import os, signal, subprocess, sys, time\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(w.pid))\n"
        "os.kill(w.pid, signal.SIGSTOP)\n"
        "time.sleep(600)\n")
    node = subprocess.Popen([sys.executable, "-c", node_code], start_new_session=True)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the node never started its worker"
        time.sleep(0.1)
    worker = int(pid_file.read_text())
    assert worker in descendants(node.pid)
    kill_process_groups([node], grace_s=0.5)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{worker}").exists() and (Path(f"/proc/{worker}/stat").read_text().split()[2]
                                                  != "Z"):
        assert time.monotonic() < deadline, "the frozen worker survived"
        time.sleep(0.1)
    try:
        os.kill(worker, signal.SIGKILL)  # nothing left to kill: reaped or a zombie of init
    except ProcessLookupError:
        pass


def start_slow_saving_worker(tmp_path, config, save_s: float):
    """A real torchrun (one node, one worker) through `config`'s launcher; the worker answers
    SIGTERM or SIGHUP as an emergency checkpoint would: it takes `save_s`, then writes
    `saved` (with the signal's name) and exits. Returns the launcher, once the worker runs,
    the `saved` path and the launcher's log; `ready`, beside it, holds the worker's pid."""
    import time

    ready, saved = tmp_path / "ready", tmp_path / "saved"
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, pathlib, signal, sys, time\n"
        "def save(signum, frame):\n"
        f"    time.sleep({save_s})\n"
        f"    pathlib.Path({str(saved)!r}).write_text(signal.Signals(signum).name)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, save)\n"
        "signal.signal(signal.SIGHUP, save)\n"
        f"pathlib.Path({str(ready)!r}).write_text(str(os.getpid()))\n"
        "time.sleep(600)\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
               "--rdzv-backend=c10d", "--rdzv-id=grace", str(worker)]
    launcher = make_launcher(NodeLaunch.of(config, command, worker_env(config, "grace-1"),
                                           tmp_path / "attempt", "goodput-grace"))
    lines: list[str] = []
    launcher.start(lines.append)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert launcher.poll() is None, "\n".join(lines)
        assert time.monotonic() < deadline, "the worker never started\n" + "\n".join(lines)
        time.sleep(0.2)
    return launcher, saved, lines


def test_torchrun_gives_its_workers_the_whole_emergency_save_time(tmp_path):
    """A stop SIGTERMs torchrun, which passes it on to the workers and, unless told
    otherwise, SIGKILLs them 30 s later: an emergency checkpoint that takes longer was lost
    although faults.emergency_save_s allowed it. The workers' environment tells torchrun
    faults.emergency_save_s; shown here the short way round: allowed 3 s, a save of 12 s is
    cut short by torchrun at 3 s (the launcher's own grace is longer), where its default
    30 s would have let it finish."""
    import time

    config = small_config(tmp_path, "faults.emergency_save_s=2.5")
    assert worker_env(config, "grace-1")["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "3"
    launcher, saved, lines = start_slow_saving_worker(tmp_path, config, save_s=12)
    started = time.monotonic()
    launcher.stop(grace_s=60)
    assert not saved.exists(), "\n".join(lines[-20:])
    assert 3 <= time.monotonic() - started < 12


def test_stopping_an_ssh_node_waits_for_its_emergency_checkpoint(tmp_path, fakes):
    """An ssh client exits at once on SIGTERM: stopping it alone would return while the
    remote workers still save, and the next attempt would overlap them. The stop SIGTERMs
    the remote torchrun over a second connection and returns once the node's command ended."""
    from infra.launchers import free_port

    config = small_config(tmp_path, "launch.kind=ssh", "launch.hosts=[me@127.0.0.1]",
                          f"launch.rdzv_port={free_port()}", "faults.emergency_save_s=20")
    launcher, saved, lines = start_slow_saving_worker(tmp_path, config, save_s=3)
    [node_pid] = launcher.remote_pids.values()
    launcher.stop(grace_s=config.faults.emergency_save_s)
    assert saved.read_text() == "SIGTERM", "\n".join(lines[-20:])
    assert [*config.launch.ssh.options, "me@127.0.0.1", f"kill -TERM {node_pid}"] in calls(fakes, "ssh")
    assert not any(line.startswith(launcher.REMOTE_PID) for line in lines)  # not in the log


def test_a_frozen_ssh_node_is_killed_on_its_host_when_the_grace_ends(tmp_path, fakes):
    """A frozen worker never answers SIGTERM, and its torchrun would wait its own timeout:
    past the grace, the node's workers and torchrun are killed on the host itself, so none
    lingers into the next attempt holding its GPU."""
    import signal
    import time

    from infra.launchers import free_port

    config = small_config(tmp_path, "launch.kind=ssh", "launch.hosts=[127.0.0.1]",
                          f"launch.rdzv_port={free_port()}", "faults.emergency_save_s=20")
    launcher, saved, lines = start_slow_saving_worker(tmp_path, config, save_s=3)
    [node_pid] = launcher.remote_pids.values()
    worker = int((tmp_path / "ready").read_text())
    os.kill(worker, signal.SIGSTOP)
    started = time.monotonic()
    launcher.stop(grace_s=2)
    assert time.monotonic() - started < 15
    kill = f"pkill -KILL -P {node_pid}; kill -KILL {node_pid}"
    assert [*config.launch.ssh.options, "127.0.0.1", kill] in calls(fakes, "ssh")
    stat = Path(f"/proc/{worker}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z"
    assert not saved.exists()


def test_losing_node_0_of_an_elastic_run_says_the_attempt_ends(tmp_path):
    """Node 0 hosts the rendezvous: the others cannot go on without it. Its loss was told
    "training goes on on them", then "fewer than elastic.min_nodes=1 remained"; both wrong."""
    from infra.launchers import NodeProcesses

    config = small_config(tmp_path, "parallelism.nnodes=1:2", "parallelism.nproc_per_node=1")
    said = []
    nodes = NodeProcesses(NodeLaunch.of(config, ["torchrun"], {}, tmp_path, "goodput-test-1"))
    nodes._log = said.append
    nodes._note_lost([-9, None])
    assert said == ["node 0 lost: its torchrun agent ended (killed by signal 9) while 1 node(s) "
                    "ran; it hosts the rendezvous, so the attempt ends (and is retried)"]
    nodes._note_lost([-9, -9])
    assert "training goes on" not in said[1] and said[1].startswith("node 1 lost")
    assert nodes.lost_nodes == [0, 1]
