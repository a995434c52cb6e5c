"""A real Slurm cluster on this machine: one controller and two compute nodes, for the tests
and for trying `launch.kind=slurm` before a cluster is at hand.

Debian's `slurm-wlm` (with `munge`) runs several `slurmd` on one host: each node is a
`slurmd -N <name>` on a port of its own, all at 127.0.0.1. Everything the daemons write
(munge key and socket, slurm.conf, spool, state, logs) lives under one directory. There is
no accounting database: finished jobs are read back from the job-completion file
(`JobCompType=jobcomp/filetxt`, `sacct -c`), as on a cluster without slurmdbd.

    with LocalSlurm(tmp_dir) as slurm:          # as root; nodes n1 and n2, 2 CPUs each
        env = {**os.environ, **slurm.env}       # SLURM_CONF for sbatch, squeue, scancel, ...
        slurm.set_node_state("n2", "down")      # a node lost mid-job

Node names must resolve to this host, as they do on a cluster (the rendezvous endpoint is
the first node's name): `ensure_names_resolve()` adds them to /etc/hosts when they do not.

From a shell: `python -m infra.local_slurm --dir ./slurm` (prints the SLURM_CONF to export).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from infra.launchers import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARK = "# goodput local Slurm nodes"


def missing_daemons() -> list[str]:
    return [name for name in (*DAEMONS, "mungekey", "sbatch") if _which(name) is None]


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def ensure_names_resolve(names: list[str]) -> list[str]:
    """Add `127.0.0.1 <names>` to /etc/hosts for the names that do not resolve; returns
    them (nothing to undo when empty). Needs root."""
    unresolved = []
    for name in names:
        try:
            socket.gethostbyname(name)
        except OSError:
            unresolved.append(name)
    if unresolved:
        with open(HOSTS_FILE, "a") as f:
            f.write(f"127.0.0.1 {' '.join(unresolved)} {HOSTS_MARK}\n")
    return unresolved


def forget_names() -> None:
    """Remove the lines ensure_names_resolve added."""
    lines = HOSTS_FILE.read_text().splitlines(keepends=True)
    kept = [line for line in lines if HOSTS_MARK not in line]
    if kept != lines:
        HOSTS_FILE.write_text("".join(kept))


class LocalSlurm:
    """munged, slurmctld and one slurmd per node, in the foreground as children of this
    process (sessions of their own); a context manager that starts and stops them."""

    def __init__(self, root: str | os.PathLike, nodes: tuple[str, ...] = ("n1", "n2"),
                 cpus_per_node: int = 2, partition: str = "debug"):
        self.root = Path(root).absolute()
        self.nodes, self.cpus_per_node, self.partition = nodes, cpus_per_node, partition
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.jobcomp = self.root / "jobcomp.txt"
        self.ctld_port = free_port()
        self.node_ports = {node: free_port() for node in nodes}
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm client command needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def log(self, daemon: str) -> Path:
        return self.root / "log" / f"{daemon}.log"

    # -- start / stop ---------------------------------------------------------------------

    def __enter__(self) -> LocalSlurm:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 60.0) -> None:
        if os.geteuid() != 0:
            raise PermissionError("a local Slurm cluster runs its daemons as root")
        missing = missing_daemons()
        if missing:
            raise FileNotFoundError(f"not installed: {', '.join(missing)} "
                                    "(apt-get install slurm-wlm)")
        for sub in ("munge", "log", "state", *(f"spool/{node}" for node in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses a socket directory others can write to, or a readable key.
        os.chmod(self.root / "munge", 0o711)
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            subprocess.run([_which("mungekey"), "-c", "-k", str(key)], check=True)
        os.chmod(key, 0o600)
        self._spawn("munged", [_which("munged"), "-F", "-f", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--log-file={self.log('munged')}",
                               f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                               f"--seed-file={self.root / 'munge' / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), timeout_s, "munged's socket")
        self.conf.write_text(self.slurm_conf())
        self.start_controller()
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", [_which("slurmd"), "-D", "-f", str(self.conf),
                                           "-N", node])
        self._wait(self._nodes_idle, timeout_s, f"nodes {', '.join(self.nodes)} idle")

    def start_controller(self) -> None:
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf)])

    def stop_controller(self) -> None:
        self._end("slurmctld")

    def stop(self) -> None:
        """Cancel every job first: a job's slurmstepd outlives the slurmd that started it."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", f"--partition={self.partition}"],
                           env=self.client_env(), capture_output=True, timeout=30)
            self._wait(lambda: not self.queue(), 60.0, "the queue to empty", raise_=False)
        for name in [n for n in self.procs if n.startswith("slurmd-")]:
            self._end(name)
        self._end("slurmctld")
        self._end("munged")

    # -- what the tests do to it ----------------------------------------------------------

    def client_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def run(self, *argv: str, check: bool = True) -> str:
        proc = subprocess.run(list(argv), env=self.client_env(), capture_output=True, text=True,
                              timeout=60)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def queue(self) -> list[str]:
        """Job ids still queued or running."""
        out = self.run("squeue", "-h", "-o", "%i", check=False)
        return out.split()

    def set_node_state(self, node: str, state: str, reason: str = "goodput test") -> None:
        """`scontrol update NodeName=... State=...`: down, drain, resume."""
        self.run("scontrol", "update", f"NodeName={node}", f"State={state}", f"Reason={reason}")

    def node_state(self, node: str) -> str:
        return self.run("sinfo", "-h", "-n", node, "-o", "%T").strip()

    def resume_nodes(self) -> None:
        """Every node back in service (after a test set one down)."""
        # Only a node taken out of service can be resumed: Slurm refuses State=resume for one
        # still completing the job scancel just ended ("Invalid node state specified").
        for node in self.nodes:
            state = self.node_state(node).rstrip("*~#")
            if any(word in state for word in ("down", "drain", "fail")):
                self.set_node_state(node, "resume")
        self._wait(self._nodes_idle, 60.0, "nodes idle again")

    # -- internals --------------------------------------------------------------------------

    def slurm_conf(self) -> str:
        root = self.root
        lines = [
            "ClusterName=goodput",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool' / '%n'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.log('slurmctld')}",
            f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
            # Process tracking without cgroups (none in a container); pgid adds ~3 s per job.
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            # Nodes may claim more CPUs than this machine has.
            "SlurmdParameters=config_overrides",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            # No slurmdbd: finished jobs are read back with `sacct -c` from this file.
            "JobCompType=jobcomp/filetxt", f"JobCompLoc={self.jobcomp}",
            "MpiDefault=none", "MailProg=/bin/true",
            "ReturnToService=2",
            # sbatch refuses a job no node of its partition can run (more nodes or CPUs than
            # it has), as on most clusters; without it the job waits forever (PartitionConfig).
            "EnforcePartLimits=ALL",
            # Start jobs at once (sbatch -> COMPLETED in about a second, not three).
            "SchedulerParameters=batch_sched_delay=0",
            # Seconds between SIGTERM and SIGKILL when a job is cancelled or times out.
            "KillWait=30",
            "InactiveLimit=0", "MinJobAge=300", "SlurmctldTimeout=30", "SlurmdTimeout=30",
        ]
        for node, port in self.node_ports.items():
            lines.append(f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 "
                         f"Port={port} CPUs={self.cpus_per_node} State=UNKNOWN")
        lines.append(f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE "
                     "State=UP")
        return "\n".join(lines) + "\n"

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(argv, env=self.client_env(), stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        log.close()

    def _end(self, name: str, grace_s: float = 10.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def _nodes_idle(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}); its log: "
                                   f"{self.root / 'log'}")
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(node, "").rstrip("*") == "idle" for node in self.nodes)

    def _wait(self, ready, timeout_s: float, what: str, raise_: bool = True) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return True
            time.sleep(0.2)
        if raise_:
            raise TimeoutError(f"local Slurm: no {what} after {timeout_s:.0f}s; logs in "
                               f"{self.root / 'log'}")
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="./slurm", help="where the cluster keeps its files")
    args = parser.parse_args()
    # Ctrl-C or SIGTERM stops the cluster: handled, not the default (which ended this process
    # at once and left munged, slurmctld and both slurmd running).
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    names = ensure_names_resolve(["n1", "n2"])
    slurm = LocalSlurm(args.dir)
    try:
        with slurm:
            print(f"export SLURM_CONF={slurm.conf}   # then: sinfo; Ctrl-C stops the cluster",
                  flush=True)
            while not stop.wait(1.0):
                pass
    finally:
        if names:
            forget_names()


if __name__ == "__main__":
    main()
