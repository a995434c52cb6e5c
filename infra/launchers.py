"""Start the nodes of one training attempt, one `torchrun` each, and watch them.

Launchers: local ("nodes" on this machine), ssh (one per host), slurm (an sbatch job),
kubernetes (a JobSet or PyTorchJob). Each has four members, used by infra.torchrun:
    start(log)  start or submit every node; worker output goes to `log` line by line
    started     whether the nodes run yet (a scheduler may queue the job first)
    poll()      None while running; the exit code once every node succeeded or any failed
    stop()      end whatever still runs, on every node; returns the attempt's exit code
Any node failing ends the attempt, unless the run is elastic (elastic.min_nodes below
parallelism.nnodes): then torchrun's rendezvous trains on with the nodes that remain, and the
attempt ends when every node has ended (or the rendezvous host, node 0, is lost). A node
whose agent vanished (killed by a signal, or its ssh connection lost) is a lost node: the
attempt's failure class is node_lost (`final_state`). Every node runs the same command line;
what differs per node is derived on the node (node_wrapper).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from core.config import ConfigError, LaunchConfig, RunConfig

Log = Callable[[str], None]
STOPPED = -signal.SIGTERM  # exit code reported for a scheduler job this process ended


def free_port() -> int:
    """A port free on the loopback now, for a server that another process binds a moment
    later (a rendezvous, a test's server). Chosen below the kernel's ephemeral range where
    there is room: the kernel gives connections their source ports from that range (gloo
    alone opens one per pair of workers), and one of them taking the port in between failed
    the server's start. Below it, only another explicit bind can. (Below 30000 too: from
    there on, kube-proxy may redirect a NodePort even on the loopback.)"""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    below = range(max(1024, low - 12000), min(low, 30000))
    for port in random.sample(below, min(64, len(below))):
        with socket.socket() as s:
            try:  # every interface: a rendezvous binds them all
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class NodeLaunch:
    """One attempt, as every launcher needs it: what each node runs, and how nodes start."""

    launch: LaunchConfig  # how nodes start: kind, hosts, ssh / Slurm / Kubernetes settings
    nnodes: int
    command: list[str]  # the torchrun command line, the same on every node
    env: dict[str, str]  # worker environment on top of each node's own
    attempt_dir: Path  # scripts, manifests and scheduler logs of this attempt
    name: str  # job name, unique per attempt: goodput-<run>-<attempt>
    rdzv_endpoint: str | None = None  # host:port of the rendezvous; None: node 0, launch.rdzv_port
    grace_s: float = 60.0  # what a stopped node's workers get for an emergency checkpoint
    min_nodes: int | None = None  # elastic: the fewest nodes to train on (None: nnodes)
    # elastic.grow: a lost node's agent is started again after this long (None: never)
    restart_lost_after_s: float | None = None

    @classmethod
    def of(cls, config: RunConfig, command: list[str], env: dict[str, str], attempt_dir: Path,
           name: str) -> NodeLaunch:
        low, high = config.node_range
        grow = config.elastic.wait_for_replacement_s if low < high and config.elastic.grow else None
        return cls(config.launch, config.parallelism.nnodes, command, env, attempt_dir, name,
                   config.parallelism.rdzv_endpoint, config.faults.emergency_save_s,
                   low if low < high else None, grow)

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None

    @property
    def workdir(self) -> str:
        return self.launch.workdir or os.getcwd()

    def endpoint(self, head: str) -> str:
        return self.rdzv_endpoint or f"{head}:{self.launch.rdzv_port}"


def node_wrapper(node: str, addr: str) -> list[str]:
    """`bash -c SCRIPT torchrun` prefix that derives one node's torchrun settings from its
    index and its address (shell words, expanded on the node: literals for local and ssh
    nodes, SLURM_NODEID / SLURMD_NODENAME in a Slurm job, the JobSet job index or PyTorchJob
    replica rank and the pod IP on Kubernetes), then runs the command:

    - node 0 hosts the c10d rendezvous store (`--rdzv-conf is_host=1`, the others 0): torchrun
      would otherwise guess by matching the endpoint against its hostname, which fails when
      nodes share a hostname or resolve it to the wrong interface (STACK_NOTES);
    - `--local-addr` is the node's own address, which rank 0's node advertises for the
      workers' store (a fresh one per attempt, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1);
    - worker lines are prefixed `[node<i> rank<r>] `, which the Prefect log sink filters on.

    - the rendezvous settings of an elastic run (RDZV_CONF_ENV in the workers' environment:
      how long to wait for lost nodes) join is_host.

    They reach torchrun as PET_<FLAG> variables, read for any flag not on the command line.
    Global ranks come from the c10d rendezvous, so global rank 0 may run on any node."""
    script = (f'node={node}; export PET_RDZV_CONF="is_host=$(( node == 0 ))'
              '${GOODPUT_RDZV_CONF:+,$GOODPUT_RDZV_CONF}" '
              f'PET_LOCAL_ADDR={addr} '
              'TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[node$node rank\\${rank}] "; exec "$@"')
    return ["bash", "-c", script, "torchrun"]


# More rendezvous settings (key=value,...) for every node; node_wrapper adds is_host to them.
RDZV_CONF_ENV = "GOODPUT_RDZV_CONF"


def make_launcher(spec: NodeLaunch) -> NodeProcesses | SchedulerJob:
    launchers = {"local": LocalLauncher, "ssh": SshLauncher, "slurm": SlurmLauncher,
                 "kubernetes": KubernetesLauncher}
    return launchers[spec.launch.kind](spec)


# -- nodes as processes of this machine: local, ssh ------------------------------------------

class NodeProcesses:
    """Each node is a process here (torchrun itself, or the ssh client running it).

    A node process that ends by a signal nobody here sent (its agent vanished: the host died
    or the process was killed) is a lost node (`lost_nodes`, `final_state` NODE_LOST); so is
    an ssh client's exit 255 (the connection or the host is gone). Elastic runs go on while
    nodes remain (torchrun's rendezvous restarts the workers on them); with elastic.grow a
    lost node's agent is started again once elastic.wait_for_replacement_s has passed, at
    most launch.max_restarts times, once the remaining nodes train on without it (a node
    back sooner would join their rendezvous and the world would never have shrunk), and the
    world grows at the workers' next restart."""

    started = True
    LOST_EXIT = None  # an exit code that means the node was lost (ssh: 255)

    def __init__(self, spec: NodeLaunch):
        self.spec = spec
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        self.commands: list[tuple[list[str], dict[str, str]]] = []
        self.final_state: str | None = None  # NODE_LOST once a node was lost (classify reads it)
        self.lost_nodes: list[int] = []  # node indexes, once per loss
        self._lost_at: dict[int, float] = {}  # lost and not started again yet
        self._restarts: dict[int, int] = {}
        self._world_started_at: float | None = None  # the workers' newest start (world_started)
        self._log: Log = print

    def node_commands(self) -> list[tuple[list[str], dict[str, str]]]:
        raise NotImplementedError

    def start(self, log: Log) -> None:
        self._log = log
        self.commands = self.node_commands()
        for i, (argv, env) in enumerate(self.commands):
            log(f"node {i}: {shlex.join(argv)}")
            self.procs.append(None)
            self.readers.append(None)
            self._start_node(i)

    def _start_node(self, i: int) -> None:
        argv, env = self.commands[i]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, bufsize=1)
        reader = threading.Thread(target=self._read_output, args=(i, proc.stdout, self._log),
                                  daemon=True)
        reader.start()
        self.procs[i], self.readers[i] = proc, reader

    def _read_output(self, node: int, stream, log: Log) -> None:
        _pump(stream, log)

    def _is_lost(self, code: int) -> bool:
        return code < 0 or code == self.LOST_EXIT

    def _note_lost(self, codes: list[int | None]) -> None:
        for i, code in enumerate(codes):
            if code is not None and self._is_lost(code) and i not in self._lost_at:
                self.final_state = "NODE_LOST"
                self.lost_nodes.append(i)
                self._lost_at[i] = time.monotonic()
                how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
                remaining = sum(c is None for c in codes)
                if not self.spec.elastic:
                    then = ""
                elif i == 0:  # the rendezvous's host: the others cannot go on without it
                    then = "; it hosts the rendezvous, so the attempt ends (and is retried)"
                elif remaining >= self.spec.min_nodes:
                    then = f"; training goes on on them (elastic.min_nodes={self.spec.min_nodes})"
                else:
                    then = (f"; fewer than elastic.min_nodes={self.spec.min_nodes}: the rendezvous "
                            "waits for nodes to join, then the attempt ends as node_lost")
                self._log(f"node {i} lost: its torchrun agent ended ({how}) while {remaining} "
                          f"node(s) ran{then}")

    def world_started(self, world_size: int) -> None:
        """The supervisor saw the workers start on a world of `world_size`."""
        self._world_started_at = time.monotonic()

    def _restart_lost(self) -> None:
        """elastic.grow: start a lost node's agent again (never node 0: it hosts the
        rendezvous, whose loss ends the attempt) once the others have started without it."""
        wait = self.spec.restart_lost_after_s
        for i, since in list(self._lost_at.items()):
            shrunk = self._world_started_at is not None and self._world_started_at > since
            if (wait is None or i == 0 or not shrunk or time.monotonic() - since < wait
                    or self._restarts.get(i, 0) >= self.spec.launch.max_restarts):
                continue
            self._restarts[i] = self._restarts.get(i, 0) + 1
            del self._lost_at[i]
            self.readers[i].join(timeout=5)
            self._log(f"node {i}: starting its agent again (elastic.grow; restart "
                      f"{self._restarts[i]} of launch.max_restarts={self.spec.launch.max_restarts})"
                      "; it joins at the workers' next restart")
            self._start_node(i)

    def poll(self) -> int | None:
        codes = [p.poll() for p in self.procs]
        self._note_lost(codes)
        failed = [c for c in codes if c not in (None, 0)]
        if not self.spec.elastic:
            if failed:
                return failed[0]
            return 0 if all(c == 0 for c in codes) else None
        if codes[0] is not None and codes[0] != 0:
            return codes[0]  # the rendezvous host is gone: the others cannot go on
        if codes[0] is None:  # training goes on: a lost node may come back
            self._restart_lost()
        if any(p.poll() is None for p in self.procs):
            return None  # torchrun's rendezvous decides, on the nodes that remain
        return 0 if 0 in codes else failed[0]

    def stop(self, grace_s: float = 5.0) -> int:
        code = self.poll()
        kill_process_groups(self.procs, grace_s)
        for reader in self.readers:
            reader.join(timeout=5)
        if code is None:  # ended here (hang, cancellation): report how the nodes ended
            code = next((p.returncode for p in self.procs if p.returncode != 0), 0)
        return code


class LocalLauncher(NodeProcesses):
    """parallelism.nnodes torchrun "nodes" on this machine, meeting on a free loopback port."""

    def node_commands(self):
        # A free port rather than launch.rdzv_port: runs on one machine must not collide.
        endpoint = self.spec.rdzv_endpoint or f"127.0.0.1:{free_port()}"
        env = {**os.environ, **self.spec.env, "PET_RDZV_ENDPOINT": endpoint}
        return [(node_wrapper(str(i), "127.0.0.1") + self.spec.command, env)
                for i in range(self.spec.nnodes)]


class SshLauncher(NodeProcesses):
    """`ssh HOST 'cd WORKDIR && env ... torchrun ...'` per host; launch.hosts[0] is node 0.

    `-tt` gives the remote command a terminal, so when the ssh client ends (this process
    died, the connection dropped) the remote torchrun gets SIGHUP and stops its workers.

    Stopping does not start there: an ssh client exits at once on SIGTERM, and the next
    attempt would start while the remote workers still write their emergency checkpoint.
    Each remote command first reports its process id (then the shell execs torchrun in its
    place); `stop` sends that torchrun SIGTERM over a second connection and waits, up to the
    grace, for the node's command to end.
    """

    REMOTE_PID = "goodput-node-pid "  # the first line of each node's output
    LOST_EXIT = 255  # ssh's own failure: the connection dropped, or the host does not answer

    PROBE_TIMEOUT_S = 10  # an elastic run starts on the hosts that answer within it

    def __init__(self, spec: NodeLaunch):
        super().__init__(spec)
        self.remote_pids: dict[int, int] = {}
        self.hosts = list(spec.launch.hosts)  # node i runs on hosts[i]

    def answering(self, hosts: list[str]) -> list[str]:
        """The hosts an ssh connection reaches (all at once, each within PROBE_TIMEOUT_S)."""
        options = [*self.spec.launch.ssh.options, "-o", "BatchMode=yes",
                   "-o", f"ConnectTimeout={self.PROBE_TIMEOUT_S}"]
        probes = [subprocess.Popen(["ssh", *options, host, "true"], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                  for host in hosts]
        answers = []
        for probe in probes:
            try:
                answers.append(probe.wait(timeout=2 * self.PROBE_TIMEOUT_S) == 0)
            except subprocess.TimeoutExpired:
                probe.kill()
                probe.wait()
                answers.append(False)
        return [host for host, answered in zip(hosts, answers) if answered]

    def node_commands(self):
        launch = self.spec.launch
        if self.spec.elastic:  # start on the hosts that answer, the first of them node 0
            answering = self.answering(self.hosts)
            silent = [h for h in self.hosts if h not in answering]
            if silent and len(answering) >= self.spec.min_nodes:
                self._log(f"not answering over ssh, left out: {', '.join(silent)}; starting on "
                          f"{len(answering)} of {len(self.hosts)} hosts (elastic.min_nodes="
                          f"{self.spec.min_nodes})")
                self.hosts = answering
            elif silent:  # too few: the rendezvous waits for them, then the attempt fails
                self._log(f"not answering over ssh: {', '.join(silent)}; fewer than "
                          f"elastic.min_nodes={self.spec.min_nodes} hosts answer")
        addresses = [host.rsplit("@", 1)[-1] for host in self.hosts]
        shared = {**self.spec.env, "PET_RDZV_ENDPOINT": self.spec.endpoint(addresses[0])}
        commands = []
        for i, (host, addr) in enumerate(zip(self.hosts, addresses)):
            remote = ["env", *(f"{k}={v}" for k, v in shared.items()),
                      *node_wrapper(str(i), shlex.quote(addr)), *self.spec.command]
            line = (f"cd {shlex.quote(self.spec.workdir)} && echo {self.REMOTE_PID}$$ && "
                    f"exec {shlex.join(remote)}")
            commands.append((["ssh", "-tt", *launch.ssh.options, host, line], dict(os.environ)))
        return commands

    def _read_output(self, node: int, stream, log: Log) -> None:
        for line in stream:
            line = line.rstrip()  # also the \r a remote terminal adds
            if line.startswith(self.REMOTE_PID):  # also a node started again (elastic.grow)
                self.remote_pids[node] = int(line[len(self.REMOTE_PID):])
            else:
                log(line)

    def stop(self, grace_s: float = 5.0) -> int:
        code = self.poll()
        deadline = time.monotonic() + grace_s
        self._remote_signal("kill -TERM {pid}", timeout_s=min(grace_s, 30))
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # Past the grace (a frozen worker never answers SIGTERM, and torchrun would wait its
        # own timeout): kill the node's workers and torchrun, so that none lingers into the
        # next attempt holding its GPU; then end the ssh client, which hangs up the rest.
        self._remote_signal("pkill -KILL -P {pid}; kill -KILL {pid}", timeout_s=10)
        ended = super().stop(grace_s=1.0)
        return ended if code is None else code

    def _remote_signal(self, command: str, timeout_s: float) -> None:
        """Run `command` (with the node's torchrun pid) on every node still running, over a
        connection of its own; a host that does not answer is left to the hang-up."""
        launch = self.spec.launch
        for node, proc in enumerate(self.procs):
            pid = self.remote_pids.get(node)
            if proc.poll() is None and pid is not None:
                try:
                    subprocess.run(["ssh", *launch.ssh.options, self.hosts[node],
                                    command.format(pid=pid)],
                                   stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    pass


def _stamp_key(stamp: str) -> tuple[str, str] | None:
    """An RFC 3339 UTC timestamp as kubectl prints it (nanoseconds, trailing zeros dropped)
    in a form that sorts in time order; None when `stamp` is not one."""
    match = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?Z", stamp)
    return None if match is None else (match.group(1), (match.group(2) or "").ljust(9, "0"))


def _pump(stream, log: Log) -> None:
    for line in stream:
        log(line.rstrip())  # rstrip also drops the \r a remote terminal adds


def kill_process_groups(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every process group (workers may save), then SIGKILL whatever is left.

    torchrun starts its workers in sessions of their own, and a frozen (SIGSTOPped) worker
    never acts on SIGTERM: once torchrun is gone it would live on, orphaned. So every
    descendant is noted before the first signal and SIGKILLed at the end wherever it went.
    """
    tree = {pid for proc in procs if proc.poll() is None for pid in descendants(proc.pid)}
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    tree |= {pid for proc in procs for pid in descendants(proc.pid)}
    for proc in procs:  # the node process may be gone while orphaned workers hold its group
        _signal_group(proc, signal.SIGKILL)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        proc.wait()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...), from /proc; [] elsewhere."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, unvisited = [], [pid]
    while unvisited:
        for child in children.get(unvisited.pop(), []):
            found.append(child)
            unvisited.append(child)
    return found


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- scheduler jobs: slurm, kubernetes ----------------------------------------------------------

class SubmitStopped(Exception):
    """The attempt was stopped (a cancellation) while its job was being submitted."""


def _run(argv: list[str], timeout: float = 120.0, stop: threading.Event | None = None) -> str:
    """A scheduler command; its stdout. Fails with the command's own error message. With
    `stop`: killed, raising SubmitStopped, as soon as that is set."""
    if stop is None:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        stdout, stderr = proc.stdout, proc.stderr
    else:
        deadline = time.monotonic() + timeout
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) as proc:
            while True:
                try:
                    stdout, stderr = proc.communicate(
                        timeout=max(0.0, min(0.2, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired as e:
                    if stop.is_set() or time.monotonic() >= deadline:
                        proc.kill()
                        proc.wait()
                        if stop.is_set():
                            raise SubmitStopped(f"{argv[0]} stopped: the attempt is being "
                                                "stopped") from None
                        raise subprocess.TimeoutExpired(argv, timeout, e.output, e.stderr) from None
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed ({proc.returncode}): {stderr.strip()}")
    return stdout


# After a forced cancel: how long the scheduler may take to end the job's processes.
SCHEDULER_KILL_WAIT_S = 60.0


class SubmitRefused(ConfigError):
    """The scheduler did not take the attempt's job: it refused it (a setting to fix), or no
    controller could be found or reached for launch.scheduler_unreachable_s. Another attempt
    as configured fails the same way, so none is made (failure class config)."""


# sbatch finding no slurm.conf (none at SLURM_CONF or its default place) and no controller
# announced in DNS (configless Slurm): a shell or worker without the cluster's configuration.
_NO_SLURM_CONF_SAYS = ["resolve_ctls_from_dns_srv", "DNS SRV lookup failed",
                       "Could not establish a configuration source"]
NO_SLURM_CONF = re.compile("|".join(_NO_SLURM_CONF_SAYS), re.IGNORECASE)
# sbatch's words for a controller it cannot find (those, or a configuration it cannot read)
# or cannot reach (refused, timed out, unresolvable host), as against a job it refuses.
SLURM_UNREACHABLE = re.compile(
    "|".join(_NO_SLURM_CONF_SAYS + [
        "cannot stat file", "Unable to process configuration file",
        "Unable to contact slurm controller", "Unable to establish control machine address",
        "Unable to resolve", "connect failure", "Connection refused", "timed out",
        "Zero Bytes were transmitted", "Communication connection failure"]), re.IGNORECASE)
# Where sbatch looks when SLURM_CONF is not set: Slurm's default (Debian's, and the upstream
# build's), and what slurmd keeps on a configless cluster's nodes.
DEFAULT_SLURM_CONFS = ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf",
                       "/usr/local/etc/slurm.conf", "/run/slurm/conf/slurm.conf")


def _no_slurm_conf_here() -> bool:
    return not os.environ.get("SLURM_CONF") and not any(map(os.path.exists, DEFAULT_SLURM_CONFS))

# A refusal's words, and the settings that make the option it refuses.
SLURM_REFUSALS = [
    ("account", "launch.slurm.account (`sacctmgr show assoc user=$USER` lists yours)"),
    ("partition", "launch.slurm.partition (`sinfo -s` lists the partitions)"),
    ("qos", "the --qos in launch.slurm.extra_sbatch"),
    ("gres|gpu", "launch.slurm.gpus_per_node"),
    ("processors|node count|node configuration|nodes|cpu",
     "parallelism.nnodes, launch.slurm.cpus_per_node or launch.slurm.gpus_per_node (more than "
     "the partition's nodes have: `sinfo -N -l`), or launch.slurm.partition"),
    ("time", "launch.slurm.time (at most the partition's MaxTime: `sinfo -s`)"),
    ("option|specification", "launch.slurm.extra_sbatch and the launch.slurm.* fields"),
]


class SchedulerJob:
    """A job the scheduler runs: submitted once, queried every launch.poll_s.

    A query that fails (slurmctld restarting or failing over, the API server busy) is tried
    again at the next poll: the job runs on without its controller. Only queries failing for
    launch.scheduler_unreachable_s in a row end the attempt."""

    def __init__(self, spec: NodeLaunch):
        self.spec = spec
        self.started = False
        self.code: int | None = None
        # How the scheduler says the job ended (Slurm: COMPLETED, FAILED, TIMEOUT, NODE_FAIL,
        # OUT_OF_MEMORY, CANCELLED, ...): infra.torchrun.classify reads it.
        self.final_state: str | None = None
        self._log: Log = print
        self._next_query = 0.0
        self._failing_since: float | None = None
        # Set once the job is to be stopped (the live attempt sets its own, before it waits
        # for start() to end): a submit waiting for its controller gives up at once.
        self.stop_asked = threading.Event()

    def poll(self) -> int | None:
        self.follow_logs()
        if self.code is None and time.monotonic() >= self._next_query:
            asked = time.monotonic()
            self._next_query = asked + self.spec.launch.poll_s
            try:
                self.code = self.query()
                if self._failing_since is not None:
                    self._log(f"scheduler answers again after "
                              f"{time.monotonic() - self._failing_since:.0f}s")
                self._failing_since = None
            except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
                now = time.monotonic()
                # From the first failed query's start: squeue itself retries for about 20 s.
                self._failing_since = self._failing_since or asked
                limit = self.spec.launch.scheduler_unreachable_s
                if now - self._failing_since > limit:
                    raise RuntimeError(f"the scheduler has not answered for {limit:.0f}s "
                                       f"(launch.scheduler_unreachable_s): {e}") from e
                self._log(f"scheduler query failed ({now - self._failing_since:.0f}s so far; "
                          f"the attempt ends after {limit:.0f}s): {e}")
            if self.code is not None:
                self.follow_logs()
        return self.code

    def follow_logs(self) -> None:
        """Pass new worker output to the log."""

    def world_started(self, world_size: int) -> None:
        """The supervisor saw the workers start on a world of `world_size` (a scheduler's
        job takes no node back)."""

    def query(self) -> int | None:
        """Ask the scheduler; set `started`; the exit code once the job is over."""
        raise NotImplementedError

    def _try(self, argv: list[str], timeout: float = 120.0) -> bool:
        """A command of stop(): its failure is logged, never raised (stop() runs in `finally`,
        where it would replace the error that ended the attempt)."""
        try:
            _run(argv, timeout)
            return True
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            self._log(f"{shlex.join(argv)}: {e}")
            return False


def slurm_time_s(text: str) -> int | None:
    """sbatch --time in seconds ("minutes", "minutes:seconds", "hours:minutes:seconds",
    "days-hours[:minutes[:seconds]]"); None for no limit or a form not known here."""
    days, _, rest = text.strip().rpartition("-") if "-" in text else ("0", "", text.strip())
    try:
        parts = [int(p) for p in rest.split(":")]
        days_n = int(days)
    except ValueError:
        return None
    if "-" in text:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    elif len(parts) == 2:
        hours, (minutes, seconds) = 0, parts
    else:
        hours, minutes, seconds = 0, parts[0], 0
    return ((days_n * 24 + hours) * 60 + minutes) * 60 + seconds or None  # 0: no limit


# The least time sbatch is given, also on the last try within launch.scheduler_unreachable_s:
# a busy controller's answer (the job taken) is not cut off.
SBATCH_MIN_TIMEOUT_S = 10.0


class SlurmLauncher(SchedulerJob):
    """An sbatch script with one `srun` task (one torchrun) per node; srun ends every node
    when one fails (--kill-on-bad-exit). Watched with squeue/sacct, cancelled with scancel."""

    def __init__(self, spec: NodeLaunch):
        super().__init__(spec)
        self.job_id: str | None = None
        self.output: Path | None = None
        self._offset = 0
        self._partial = ""
        self._pending_reason = ""

    def script(self) -> str:
        spec, slurm = self.spec, self.spec.launch.slurm
        # --no-requeue: a node failure fails the attempt (the launch task's retry resumes from
        # the last validated checkpoint) instead of queueing the job again unseen.
        # Elastic: any count of the range, and the job outlives a failed node (--no-kill):
        # torchrun's rendezvous trains on with the others. The range is the allocation's; a
        # node lost from it is not replaced within the job.
        # (sbatch's --ntasks-per-node=1 would make Slurm grant the range's minimum; srun
        # places one task per node of whatever was granted.)
        nodes = f"{spec.min_nodes}-{spec.nnodes}" if spec.elastic else str(spec.nnodes)
        per_node = ["--no-kill"] if spec.elastic else ["--ntasks-per-node=1"]
        options = [f"--nodes={nodes}", *per_node, f"--time={slurm.time}", "--no-requeue"]
        # SIGTERM to the job's steps before the time limit, time for an emergency checkpoint
        # (Slurm's own at the limit leaves KillWait, often 30 s); Slurm checks every minute.
        warn_s = int(spec.grace_s) + 60
        limit_s = slurm_time_s(slurm.time)
        if limit_s is not None and limit_s >= 3 * warn_s:
            options.append(f"--signal=TERM@{warn_s}")
        options += [f"--partition={slurm.partition}"] if slurm.partition else []
        options += [f"--account={slurm.account}"] if slurm.account else []
        options += [f"--gpus-per-node={slurm.gpus_per_node}"] if slurm.gpus_per_node else []
        options += [f"--cpus-per-task={slurm.cpus_per_node}"] if slurm.cpus_per_node else []
        options += slurm.extra_sbatch
        if spec.rdzv_endpoint:
            endpoint = shlex.quote(spec.rdzv_endpoint)
        else:
            endpoint = f'"$head_node:{spec.launch.rdzv_port}"'
        # srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05): without it each
        # node's torchrun and all its workers would share one CPU.
        cpus = [f"--cpus-per-task={slurm.cpus_per_node}"] if slurm.cpus_per_node else []
        wrapper = node_wrapper("$SLURM_NODEID", '"$SLURMD_NODENAME"')
        srun = ["srun", "--kill-on-bad-exit=1", f"--nodes={spec.nnodes}", "--ntasks-per-node=1",
                *cpus, *wrapper, *spec.command]
        launch = ["# One task per node; the wrapper reads that node's SLURM_NODEID and SLURMD_NODENAME.",
                  shlex.join(srun)]
        if spec.elastic:
            # One step per node: a failed node ends its own step only, the others train on
            # (one step over all nodes would end with the node, or, with --no-kill, wait for
            # its task forever). Node 0's step, the rendezvous host's, is the job's verdict.
            wrapper = node_wrapper("$GOODPUT_NODE_INDEX", '"$SLURMD_NODENAME"')
            step = ["srun", "--nodes=1", "--ntasks=1", '--nodelist="${nodes[i]}"', *cpus]
            launch = [
                "# One step per node of whatever the allocation got of the range.",
                "steps=()",
                'for i in "${!nodes[@]}"; do',
                f"  GOODPUT_NODE_INDEX=$i {' '.join(step)} {shlex.join(wrapper + spec.command)} &",
                "  steps+=($!)",
                "done",
                'status=0; wait "${steps[0]}" || status=$?',
                'for step in "${steps[@]:1}"; do wait "$step" || true; done',
                'exit "$status"']
        return "\n".join([
            "#!/bin/bash",
            f"# Training attempt {spec.name}: {nodes} node(s), one "
            "torchrun each. Rendered by infra/launchers.py;",
            "# its name and output file are on sbatch's command line (SlurmLauncher.submit_command).",
            *(f"#SBATCH {option}" for option in options),
            "set -eo pipefail",
            f"cd {shlex.quote(spec.workdir)}",
            *spec.launch.slurm.setup,
            "set -u  # after the setup lines: conda activate and module load fail under -u",
            *(f"export {k}={shlex.quote(v)}" for k, v in spec.env.items()),
            "# The allocation's first node hosts the c10d rendezvous. (No `| head`: under",
            "# pipefail its closing the pipe early would fail the job.)",
            'nodes=( $(scontrol show hostnames "$SLURM_JOB_NODELIST") )',
            'head_node=${nodes[0]}',
            f"export PET_RDZV_ENDPOINT={endpoint}",
            *launch,
            "",
        ])

    def submit_command(self, script: Path) -> list[str]:
        """sbatch of `script`. The name and the output file are options here, not #SBATCH
        lines: a directive is split at whitespace and cut at '#', so a run directory holding
        either would send the output elsewhere (and the log would never be followed).
        --parsable prints "jobid" or "jobid;cluster"."""
        return ["sbatch", "--parsable", f"--job-name={self.spec.name}",
                f"--output={self.spec.attempt_dir.resolve()}/slurm-%j.out", str(script)]

    def start(self, log: Log) -> None:
        self._log = log
        path = self.spec.attempt_dir / "sbatch.sh"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.script())
        self.job_id = self._submit(path).strip().split(";")[0]
        self.output = self.spec.attempt_dir.resolve() / f"slurm-{self.job_id}.out"
        log(f"submitted Slurm job {self.job_id}: {path}")

    def _submit(self, script: Path) -> str:
        """sbatch's output for `script`. A controller sbatch cannot find or reach is waited
        for, submitting again after 1, 2, 4 ... (at most 60) s, for launch.scheduler_unreachable_s
        in all; then, or at once when sbatch refuses the job, SubmitRefused saying what to fix.
        A job that may have been taken unanswered is looked up by its name (unique per
        attempt) before giving up: used if queued, else cancelled by name. `stop_asked` ends
        the submit at once (SubmitStopped), the job cancelled by name if it may have been taken."""
        argv = self.submit_command(script)
        limit = self.spec.launch.scheduler_unreachable_s
        started, delay, tries = time.monotonic(), 1.0, 0
        maybe_taken = False  # a submission that timed out may have been taken, its answer lost
        while True:
            tries += 1
            if self.stop_asked.is_set():
                self._withdraw(maybe_taken)
                raise SubmitStopped("the attempt was stopped before its job was submitted")
            if maybe_taken and (known := self._queued_by_name()):
                self._log(f"the controller has this attempt's job already ({known}): not "
                          "submitting it again")
                return known
            left = limit - (time.monotonic() - started)
            try:  # sbatch retries a missing slurm.conf for 60 s itself: no longer than `left`,
                # nor so short that a slow controller's answer is lost
                return _run(argv, timeout=max(SBATCH_MIN_TIMEOUT_S, min(120.0, left)),
                            stop=self.stop_asked)
            except SubmitStopped:
                self._withdraw(True)  # sbatch was killed on its way: it may have been taken
                raise SubmitStopped("the attempt was stopped while its job was being "
                                    "submitted") from None
            except FileNotFoundError:
                raise SubmitRefused(
                    "sbatch is not on this host's PATH: launch.kind=slurm submits from where the "
                    "flow runs, which needs Slurm's client commands (sbatch, squeue, scancel)"
                ) from None
            except subprocess.TimeoutExpired as e:
                said = e.stderr or ""  # what it printed before the timeout (bytes)
                said = said.decode(errors="replace") if isinstance(said, bytes) else said
                error = f"sbatch gave no answer within {e.timeout:.0f}s: {said.strip()}"
            except RuntimeError as e:
                error = re.split(r" failed \(-?\d+\): ", str(e), maxsplit=1)[-1]  # sbatch's words
                if not SLURM_UNREACHABLE.search(error):
                    raise SubmitRefused(self._refusal(error, script)) from None
                if NO_SLURM_CONF.search(error) and _no_slurm_conf_here():
                    # Nothing to wait for: no configuration here, none in DNS. Retried, a
                    # shell without SLURM_CONF took launch.scheduler_unreachable_s to fail.
                    raise SubmitRefused(self._no_controller(
                        "sbatch found no Slurm configuration here (no SLURM_CONF, no slurm.conf "
                        f"at {', '.join(DEFAULT_SLURM_CONFS)}, no controller in DNS)", error)) from None
            maybe_taken = maybe_taken or "timed out" in error or "no answer" in error
            waited = time.monotonic() - started
            if waited + delay > limit:
                if maybe_taken and (known := self._queued_by_name()):
                    self._log(f"the controller took this attempt's job ({known}), its answer "
                              "lost: using it")
                    return known
                self._withdraw(maybe_taken)
                raise SubmitRefused(self._no_controller(
                    f"sbatch found or reached no Slurm controller in {tries} tries over "
                    f"{waited:.0f}s (launch.scheduler_unreachable_s={limit:g})", error))
            self._log(f"no Slurm controller to submit to ({waited:.0f}s so far; giving up after "
                      f"{limit:g}s, launch.scheduler_unreachable_s): submitting again in "
                      f"{delay:g}s. {error}")
            self.stop_asked.wait(delay)  # the loop's top ends the submit once it is set
            delay = min(2 * delay, 60.0)

    @staticmethod
    def _no_controller(what: str, error: str) -> str:
        conf = os.environ.get("SLURM_CONF")
        return (f"{what}: the job was not submitted. Check: "
                + (f"SLURM_CONF={conf} is this cluster's slurm.conf" if conf else
                   "SLURM_CONF is exported in the shell or worker that runs the flow (it is not "
                   "set here), or slurm.conf is at its default place")
                + "; slurmctld runs and its host and port (SlurmctldHost, SlurmctldPort) are "
                f"reachable from this host (`sinfo` says so). sbatch said: {error}")

    def _withdraw(self, maybe_taken: bool) -> None:
        """Cancel, by its name, a job a submission that went unanswered may have queued, so
        that none is left to start later and hold nodes (best effort: logged if it fails)."""
        if maybe_taken and self._try(["scancel", f"--name={self.spec.name}"], timeout=10.0):
            self._log(f"cancelled any job named {self.spec.name} (a submission went unanswered)")

    def _queued_by_name(self) -> str | None:
        """The id of a queued job named as this attempt's (unique per attempt), if the
        controller answers and has one."""
        try:
            out = _run(["squeue", "-h", f"--name={self.spec.name}", "-o", "%i"], timeout=30)
        except (RuntimeError, subprocess.TimeoutExpired, OSError):
            return None
        return out.split()[0] if out.split() else None

    @staticmethod
    def _refusal(said: str, script: Path) -> str:
        """The message of a job sbatch refused: its words, and the setting that makes them."""
        field = next((fix for words, fix in SLURM_REFUSALS
                      if re.search(words, said, re.IGNORECASE)),
                     "the launch.slurm.* fields and launch.slurm.extra_sbatch")
        return (f"sbatch refused the training job: {said.strip()}\nFix {field}. The script it "
                f"was given: {script} (`sbatch --test-only` checks one without submitting it).")

    def _queue_state(self) -> str:
        """The job's state in the queue; "" once it has left it. Why a pending job waits is
        logged whenever it changes (a drained node, the partition's limits, priority)."""
        state, _, reason = _run(["squeue", "-h", "-j", self.job_id, "-o", "%T|%r"]).strip().partition("|")
        if state == "PENDING" and reason not in ("", "None", self._pending_reason):
            self._pending_reason = reason
            self._log(f"Slurm job {self.job_id} is pending: {reason}")
        return state

    def query(self) -> int | None:
        state = self._queue_state()
        if state:  # still queued or running
            self.started = self.started or state in ("RUNNING", "COMPLETING")
            return None
        verdict = self._verdict()
        if verdict is None:  # not recorded yet: ask again at the next poll
            return None
        state, exit_code = verdict
        if state.startswith(("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED")):
            return None
        self.final_state = state.split()[0]  # "CANCELLED by 0" -> CANCELLED
        code, sig = (int(x) for x in exit_code.split(":"))
        if self.final_state == "COMPLETED":
            return 0
        return code or (128 + sig if sig else 1)  # CANCELLED, TIMEOUT, NODE_FAIL... by signal

    def _verdict(self) -> tuple[str, str] | None:
        """(state, "exit:signal") of a job that has left the queue, from what this cluster
        keeps: the controller's job record (for MinJobAge after the end, 300 s by default),
        else accounting (slurmdbd), else the job-completion file (jobcomp/filetxt, `sacct
        -c`). None while none of them has it yet; raises when none can be asked."""
        try:
            record = _run(["scontrol", "show", "job", "-o", self.job_id])
            fields = dict(f.split("=", 1) for f in record.split() if "=" in f)
            if "JobState" in fields and "ExitCode" in fields:
                return fields["JobState"], fields["ExitCode"]
        except RuntimeError as e:
            if "Invalid job id" not in str(e):
                raise
        errors = []
        for source in (["sacct", "-X"], ["sacct", "-c"]):  # accounting, then the jobcomp file
            try:
                out = _run([*source, "-j", self.job_id, "-n", "-P", "-o", "JobID,State,ExitCode"])
            except RuntimeError as e:  # "Slurm accounting storage is disabled", no jobcomp file
                errors.append(str(e))
                continue
            for line in out.splitlines():
                job, state, exit_code = line.split("|")[:3]
                if job == self.job_id:
                    return state, exit_code
            return None
        raise RuntimeError(f"Slurm job {self.job_id} left the queue and no record of how it "
                           f"ended can be read: {'; '.join(errors)}")

    def follow_logs(self) -> None:
        if self.output is None or not self.output.is_file():
            return
        with open(self.output, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk.decode(errors="replace")).split("\n")
        for line in lines:
            self._log(line.rstrip())

    def stop(self, grace_s: float = 5.0) -> int:
        """SIGTERM to the job's steps (srun passes it to each node's torchrun, whose workers
        save an emergency checkpoint), `grace_s` for the job to end by itself, then scancel;
        returns once the job has left the queue (or the wait for it ran out), so the next
        attempt never overlaps this one."""
        if self.job_id is not None and self.code is None:
            # A job still queued cannot be signalled (and has nothing to save): cancel it.
            if self.started:
                self._try(["scancel", "--signal=TERM", self.job_id])
                self._log(f"sent SIGTERM to Slurm job {self.job_id}; cancelling it if it still "
                          f"runs after {grace_s:.0f}s")
            if not self.started or not self._left_queue_within(grace_s):
                self._try(["scancel", self.job_id])
                self._log(f"cancelled Slurm job {self.job_id}")
                if not self._left_queue_within(SCHEDULER_KILL_WAIT_S):
                    self._log(f"Slurm job {self.job_id} is still in the queue after "
                              f"{SCHEDULER_KILL_WAIT_S:.0f}s; going on")
        self.follow_logs()
        if self._partial:
            self._log(self._partial.rstrip())
        return self.code if self.code is not None else STOPPED

    def _left_queue_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while True:
            try:
                if not self._queue_state():
                    return True
            except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
                self._log(f"squeue: {e}")
            if time.monotonic() >= deadline:
                return False
            self.follow_logs()
            time.sleep(min(self.spec.launch.poll_s, max(0.0, deadline - time.monotonic())))


def kubernetes_name(name: str, limit: int = 40) -> str:
    """A DNS-1123 label for the job: lowercase, at most `limit` characters (JobSet derives pod
    and service names from it). A longer name is cut and ends in a digest of the whole, so
    two attempts of a run (which differ only at the end) never get the same name."""
    clean = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if len(clean) <= limit:
        return clean
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{clean[:limit - 9].rstrip('-')}-{digest}"


class KubernetesLauncher(SchedulerJob):
    """A JobSet (one replicated job of `nnodes` single-pod jobs) or a PyTorchJob (a Master
    and nnodes-1 Workers), applied with kubectl, watched through its status conditions,
    deleted when the attempt ends. Nothing restarts inside it: the launch task's retry
    resumes from the last validated checkpoint."""

    LABEL = "goodput.dev/job"

    LOG_REFOLLOW_S = 10.0  # at most this often, a log stream that ended is followed again

    def __init__(self, spec: NodeLaunch):
        super().__init__(spec)
        self._logs: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._followed_at = 0.0
        # The newest timestamp streamed, and the lines streamed at it: where a stream
        # followed again resumes, none repeated.
        self._last_stamp: str | None = None
        self._lines_at_last: set[str] = set()
        self.name = kubernetes_name(spec.name)

    @property
    def kind(self) -> str:
        return self.spec.launch.kubernetes.kind

    @property
    def namespace(self) -> str:
        return self.spec.launch.kubernetes.namespace

    def manifest(self) -> dict:
        if self.kind == "jobset":
            # Pod <jobset>-node-<i>-0 of job i resolves as <pod>.<jobset> (JobSet's headless
            # service); the job index, from the pod's annotation, is the node index.
            endpoint = self.spec.endpoint(f"{self.name}-node-0-0.{self.name}")
            index = {"name": "NODE_INDEX", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}}
            job = {"parallelism": 1, "completions": 1, "backoffLimit": 0,
                   "template": self._pod(endpoint, [index], "$NODE_INDEX")}
            return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                    "metadata": self._metadata(),
                    "spec": {"failurePolicy": {"maxRestarts": 0},
                             "network": {"enableDNSHostnames": True},
                             "replicatedJobs": [{"name": "node", "replicas": self.spec.nnodes,
                                                 "template": {"spec": job}}]}}
        # PyTorchJob: the operator serves the master as <job>-master-0 and gives each pod its
        # node rank as RANK (master 0, workers 1..n-1).
        pod = self._pod(self.spec.endpoint(f"{self.name}-master-0"), [], "$RANK")
        replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": pod}}
        if self.spec.nnodes > 1:
            replicas["Worker"] = {"replicas": self.spec.nnodes - 1, "restartPolicy": "Never",
                                  "template": pod}
        return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": self._metadata(),
                "spec": {"runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "All"},
                         "pytorchReplicaSpecs": replicas}}

    def _metadata(self) -> dict:
        return {"name": self.name, "namespace": self.namespace, "labels": {self.LABEL: self.name}}

    def check_shared(self) -> None:
        """The pods see only launch.kubernetes' volume: the run directory, the dataset and
        the config the command names must lie on it, at the paths this process uses.
        Refused before anything is applied (a ConfigError: no retry makes it work)."""
        mount = Path(self.spec.launch.kubernetes.mount_path)
        command = self.spec.command
        needed = [("the run directory (run.runs_dir)", self.spec.attempt_dir.parents[1])]
        needed += [(f"{flag} ({field})", Path(command[command.index(flag) + 1]))
                   for flag, field in (("--dataset", "data.data_dir"), ("--config", "run.runs_dir"))
                   if flag in command]
        for what, path in needed:
            path = Path(os.path.normpath(path.absolute()))
            if mount != path and mount not in path.parents:
                raise ConfigError(f"{what} {path} is not under launch.kubernetes.mount_path="
                                  f"{mount}, the volume the training pods see; set run.runs_dir "
                                  "and data.data_dir under it, where this flow sees the same "
                                  "volume")

    def _pod(self, endpoint: str, node_env: list[dict], node: str) -> dict:
        launch = self.spec.launch
        k8s = launch.kubernetes
        pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        env = [*node_env, pod_ip, *({"name": k, "value": v} for k, v in self.spec.env.items()),
               {"name": "PET_RDZV_ENDPOINT", "value": endpoint}]
        # Kubernetes expands $(VAR) in commands itself; $$ keeps the shell's $(( )) intact.
        command = [arg.replace("$(", "$$(") for arg in
                   node_wrapper(node, '"$POD_IP"') + self.spec.command]
        container = {"name": "pytorch",  # the name the PyTorchJob operator looks for
                     "image": k8s.image, "workingDir": self.spec.workdir, "command": command,
                     "env": env, "ports": [{"containerPort": launch.rdzv_port}]}
        limits = {"nvidia.com/gpu": k8s.gpus_per_node} if k8s.gpus_per_node else {}
        requests = {k: v for k, v in (("cpu", k8s.cpu), ("memory", k8s.memory)) if v}
        if limits or requests:
            container["resources"] = {"limits": {**limits, **requests},
                                      **({"requests": requests} if requests else {})}
        # Deleting the job gives each pod this long between SIGTERM and SIGKILL: the time
        # the workers have for an emergency checkpoint (faults.emergency_save_s), and more.
        grace = int(self.spec.grace_s) + 30
        spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": grace,
                "containers": [container]}
        # /dev/shm in memory (a container's default is 64 MB, too little for NCCL), and the
        # volume the run and data directories are on.
        container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
        spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory",
                                                         "sizeLimit": k8s.shm_size}}]
        if k8s.volume_claim:
            container["volumeMounts"].append({"name": "shared", "mountPath": k8s.mount_path})
            spec["volumes"].append({"name": "shared",
                                    "persistentVolumeClaim": {"claimName": k8s.volume_claim}})
        if k8s.node_selector:
            spec["nodeSelector"] = dict(k8s.node_selector)
        if k8s.tolerations:
            spec["tolerations"] = list(k8s.tolerations)
        return {"metadata": {"labels": {self.LABEL: self.name}}, "spec": spec}

    def start(self, log: Log) -> None:
        self._log = log
        self.check_shared()
        path = self.spec.attempt_dir / "kubernetes.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.manifest(), sort_keys=False))
        _run(["kubectl", "apply", "-f", str(path)])
        log(f"applied {self.kind} {self.namespace}/{self.name}: {path}")

    def query(self) -> int | None:
        found = _run(["kubectl", "get", self.kind, self.name, "-n", self.namespace, "-o", "json"])
        status = json.loads(found).get("status") or {}
        true = {c["type"] for c in status.get("conditions", []) if c.get("status") == "True"}
        if true & {"Completed", "Succeeded"}:
            return 0
        if "Failed" in true:
            return self._failed_exit_code()
        ready = sum(j.get("ready", 0) for j in status.get("replicatedJobsStatus", []))
        if not self.started and ("Running" in true or ready >= self.spec.nnodes):
            self.started = True
            self._follow_logs()
        return None

    def _selector(self) -> list[str]:
        return ["-n", self.namespace, "-l", f"{self.LABEL}={self.name}"]

    def _failed_exit_code(self) -> int:
        """The first non-zero exit code among the pods (torchrun's), else 1; a pod that was
        evicted, or whose node went away, makes the attempt's end a lost node
        (`final_state` NODE_LOST, or PREEMPTED for the scheduler's preemption)."""
        pods = json.loads(_run(["kubectl", "get", "pods", *self._selector(), "-o", "json"]))
        statuses = [pod.get("status", {}) for pod in pods.get("items", [])]
        endings = [pod_lost(status) for status in statuses]
        self.final_state = next((e for e in endings if e == "NODE_LOST"),
                                next((e for e in endings if e), None))
        codes = [status["state"]["terminated"]["exitCode"] for pod in statuses
                 for status in pod.get("containerStatuses", [])
                 if "terminated" in status.get("state", {})]
        return next((c for c in codes if c != 0), 1)

    def _follow_logs(self) -> None:
        """Stream every pod's output until the pods end (no --prefix: torchrun's own
        [node rank] prefix is the one the log sink knows). Each line comes with its
        timestamp, so that a stream ending while the job runs (the kubelet closes a stream
        idle for 4 hours by default; an API server restarts) is followed again from the last
        line passed on (`follow_logs`)."""
        since = [f"--since-time={self._last_stamp}"] if self._last_stamp else []
        self._logs = subprocess.Popen(
            ["kubectl", "logs", *self._selector(), "-f", "--tail=-1", *since, "--timestamps",
             "--all-containers=true", f"--max-log-requests={self.spec.nnodes}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, bufsize=1)
        self._followed_at = time.monotonic()
        self._reader = threading.Thread(target=self._pass_on, args=(self._logs.stdout,),
                                        daemon=True)
        self._reader.start()

    def _pass_on(self, stream) -> None:
        resumed_at, seen = self._last_stamp, set(self._lines_at_last)
        for raw in stream:
            stamp, _, line = raw.rstrip().partition(" ")
            key = _stamp_key(stamp)
            if key is None:  # kubectl's own message, not a pod's line
                self._log(raw.rstrip())
                continue
            if resumed_at is not None:
                last = _stamp_key(resumed_at)
                if key < last or (key == last and line in seen):
                    continue  # passed on before the stream was followed again
            if self._last_stamp is None or key > _stamp_key(self._last_stamp):
                self._last_stamp, self._lines_at_last = stamp, set()
            self._lines_at_last.add(line)
            self._log(line)

    def follow_logs(self) -> None:
        if (self.started and self.code is None and self._logs is not None
                and self._logs.poll() is not None
                and time.monotonic() - self._followed_at >= self.LOG_REFOLLOW_S):
            self._reader.join(timeout=5)
            self._follow_logs()

    def stop(self, grace_s: float = 5.0) -> int:  # the scheduler applies its own grace
        if self._logs is not None:
            if self.code is not None:  # finished pods end the stream: let it drain
                try:
                    self._logs.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            kill_process_groups([self._logs])
            self._reader.join(timeout=5)
        # Foreground cascade with --wait: returns once the pods are gone (after their
        # emergency checkpoint), so the next attempt never overlaps this one.
        wait_s = int(self.spec.grace_s + 30 + SCHEDULER_KILL_WAIT_S)
        if self._try(["kubectl", "delete", self.kind, self.name, "-n", self.namespace,
                      "--ignore-not-found", "--cascade=foreground", "--wait=true",
                      f"--timeout={wait_s}s"], timeout=wait_s + 30):
            self._log(f"deleted {self.kind} {self.namespace}/{self.name}")
        return self.code if self.code is not None else STOPPED


# How Kubernetes says a pod ended with its node rather than by itself: the pod's
# status.reason (the kubelet evicting it, its node lost or shut down) and the reason of its
# DisruptionTarget condition (the taint manager deleting pods of an unreachable node, the
# pod garbage collector those of a deleted node, a drain through the eviction API, the
# kubelet under node pressure or shutdown).
POD_REASONS_NODE_LOST = {"Evicted", "NodeLost", "NodeShutdown", "Terminated"}
DISRUPTIONS_NODE_LOST = {"DeletionByTaintManager", "DeletionByPodGC", "EvictionByEvictionAPI",
                         "TerminationByKubelet"}


def pod_lost(status: dict) -> str | None:
    """NODE_LOST when a pod's status says it ended with its node, PREEMPTED when the
    scheduler preempted it, else None (it ended by itself)."""
    disruptions = {c.get("reason") for c in status.get("conditions", [])
                   if c.get("type") == "DisruptionTarget" and c.get("status") == "True"}
    if status.get("reason") in POD_REASONS_NODE_LOST or disruptions & DISRUPTIONS_NODE_LOST:
        return "NODE_LOST"
    if "PreemptionByScheduler" in disruptions:
        return "PREEMPTED"
    return None
